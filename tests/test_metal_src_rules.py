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

from mlx_bricks import kernels
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


# ---------------------------------------------------------------------------------------------
# Issue 28: self-contained headers, the performance lint, and the tuner's view of the sources

import importlib.resources  # noqa: E402

ALL_SOURCES = sorted(p.name for p in importlib.resources.files("mlx_bricks.metal_src").iterdir()
                     if p.name.endswith((".h", ".metal")))
HEADERS = [n for n in ALL_SOURCES if n.endswith(".h")]


@pytest.mark.parametrize("filename", HEADERS)
def test_headers_are_self_contained(filename):
    """Each header includes <metal_stdlib> and says `using namespace metal;` before its first
    declaration, inside an include guard: it does not lean on what MLX's prepended utilities
    or another header happen to provide (issue 28: q8_0.h and decode_attention.h did)."""
    text = _strip_comments(read_source(filename))
    guard = re.search(r"#ifndef (MLX_BRICKS_\w+_H)\s*#define \1\b", text)
    assert guard and text.rstrip().endswith("#endif"), f"{filename}: no include guard"
    body = text[guard.end():]
    inc = body.find("#include <metal_stdlib>")
    using = body.find("using namespace metal;")
    first = re.search(r"^\s*(?:template|struct|inline|typedef|enum|namespace|constexpr)\b", body,
                      re.M)
    assert inc >= 0 and using > inc, f"{filename}: needs #include <metal_stdlib> and using"
    assert first is None or using < first.start(), f"{filename}: using namespace metal too late"


def test_sources_pass_the_text_lint():
    from mlx_bricks.emulator.lint import strided_loads

    found = [str(f) for n in ALL_SOURCES for f in strided_loads(n, read_source(n))]
    assert not found, "\n".join(found)


def test_kernels_have_no_64_bit_division_in_loops():
    """The IR rule of the lint over one launch of every kernel, as the ops make it (the rule
    sees the instantiated types; the q8_0 kernels had 64-bit % and / per element before issue
    28). One clang run per kernel."""
    from mlx_bricks.emulator.lint import int64_divisions
    from mlx_bricks.tools import mac_check
    from tests.support import require_backend

    require_backend("emulator")
    picked = {}
    for _, record in mac_check.launches("emulator"):
        picked.setdefault(record[0], record)
    assert len(picked) >= 10
    found = [f"{name}: {f}" for name, record in sorted(picked.items())
             for f in int64_divisions(mac_check.generated(record))]
    assert not found, "\n".join(found)


def test_every_source_file_feeds_the_tuners_cache_key(monkeypatch):
    """The decision cache's context hashes every kernel source as MLX gets it (tune/cache.py):
    each metal_src file belongs to a registered kernel, and an edit of any one changes the key,
    so a decision measured on a former kernel is never served (issue 28's kernel changes)."""
    from mlx_bricks.tune import cache

    import mlx_bricks.ops  # noqa: F401  (registers the kernels)

    # another test of this worker may have hashed while it had a kernel of its own registered
    cache.kernel_source_hash.cache_clear()
    cache.kernel_source_hash()  # imports every op module, registering every kernel
    used = set()
    for name in kernels.registered():
        s = kernels.spec(name)
        if s.body:
            used.update([s.body, *s.headers])
    assert set(ALL_SOURCES) <= used
    before = cache.kernel_source_hash()
    original = kernels.read_source
    for edited in ("decode_attention.h", "q8_0.h", "gemm.h"):
        def fake(filename, package=kernels.SOURCE_PACKAGE, _e=edited):
            text = original(filename, package)
            return text + "\n// edited\n" if filename == _e else text

        monkeypatch.setattr(kernels, "read_source", fake)
        cache.kernel_source_hash.cache_clear()
        assert cache.kernel_source_hash() != before, edited
    monkeypatch.setattr(kernels, "read_source", original)
    cache.kernel_source_hash.cache_clear()
    assert cache.kernel_source_hash() == before
