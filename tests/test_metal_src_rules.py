"""Source rules for the GEMM-pipeline MSL (issue 15's Metal review), checked on the text:

* no ``const`` member function reads ``thread_elements()`` (fix 1): on Metal the const overload
  returns the elements by value, a copy per fragment instead of the accumulator registers
  (the emulator's shim now returns a copy too: tests/emulator/test_shim_signatures.py);
* every loop that indexes a per-thread register array of the pipeline (accumulator fragments,
  loader chunk pointers and registers, a fragment's two elements) is fully unrolled with
  ``BRICKS_UNROLL`` (fix 2): a rolled loop with a variable index puts the array in stack memory
  for the whole kernel on Apple GPUs.
"""
from __future__ import annotations

import re

import pytest

from mlx_bricks.kernels import read_source

# The files built on gemm.h's pipeline (attention has its own header and review items).
PIPELINE_SOURCES = ("gemm.h", "gemm.metal", "swiglu.h", "swiglu_fused.metal",
                    "swiglu_split.metal", "rms_norm_qkv.h", "rms_norm_qkv.metal",
                    "rms_norm_inv.metal")
# Register arrays indexed by a loop variable: acc[i][j], a_frag/b_frag, loader src/regs,
# a fragment's elements e[t] / g[e] / u[e], Vec128 chunk elements .v[j].
REGISTER_INDEX = re.compile(r"(?:\bacc|_frag|\bsrc|\bregs|\.u|\.v)\[|\b[egu]\[\w+\]")
UNROLL = re.compile(r"BRICKS_UNROLL|_Pragma\(\"clang loop unroll|#pragma unroll")


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def _loop_bodies(text: str):
    """(line number, text before the loop on its line and the previous line, loop body) for
    every ``for`` loop with a braced or one-statement body."""
    for m in re.finditer(r"\bfor\s*\(", text):
        depth, i = 0, m.end() - 1
        while True:  # skip the loop header
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
            if depth == 0:
                break
        rest = text[i:].lstrip()
        start = len(text) - len(rest)
        if rest.startswith("{"):
            depth, j = 0, start
            while True:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
                if depth == 0:
                    break
            body = text[start:j]
        else:
            body = rest.split(";", 1)[0]
        line = text.count("\n", 0, m.start()) + 1
        lines = text[: m.start()].split("\n")
        before = "\n".join(lines[-2:])
        yield line, before, body


@pytest.mark.parametrize("filename", PIPELINE_SOURCES)
def test_register_array_loops_are_unrolled(filename):
    text = _strip_comments(read_source(filename))
    rolled = [line for line, before, body in _loop_bodies(text)
              if REGISTER_INDEX.search(body) and not UNROLL.search(before)
              and not _indexes_runtime_only(body)]
    assert not rolled, f"{filename}: loops indexing register arrays without BRICKS_UNROLL at " \
                       f"lines {rolled}"


def _indexes_runtime_only(body: str) -> bool:
    """Loops over runtime bounds (K, a row's chunks) whose register indexing happens inside an
    inner loop that is itself checked: the outer loop has no register index of its own."""
    inner = list(_loop_bodies(body))
    own = body
    for _, _, inner_body in inner:
        own = own.replace(inner_body, "")
    return not REGISTER_INDEX.search(own)


@pytest.mark.parametrize("filename", PIPELINE_SOURCES)
def test_no_const_method_reads_thread_elements(filename):
    text = _strip_comments(read_source(filename))
    offenders = []
    # a member function header: `name(...) const {`, then its body up to the matching brace
    for m in re.finditer(r"\)\s*const\s*(?:thread\s*)?\{", text):
        depth, j = 0, m.end() - 1
        while True:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
            if depth == 0:
                break
        if "thread_elements()" in text[m.end():j]:
            offenders.append(text.count("\n", 0, m.start()) + 1)
    assert not offenders, f"{filename}: const member functions call thread_elements() at " \
                          f"lines {offenders}"


def test_rules_catch_the_reviewed_patterns():
    """The checks above fail on the two patterns the review found (so they can fail)."""
    rolled = """
    for (short i = 0; i < TM; ++i) {
      const thread auto& e = acc[i][0].thread_elements();
    }"""
    assert [1 for _, before, body in _loop_bodies(rolled)
            if REGISTER_INDEX.search(body) and not UNROLL.search(before)]
    const_store = "void store(device T* C) const { auto e = acc[0][0].thread_elements(); }"
    assert re.search(r"\)\s*const\s*\{[^}]*thread_elements\(\)", const_store)
