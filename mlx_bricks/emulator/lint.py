"""Performance lint for MSL kernels: patterns that compile and run right on Metal but are slow
on Apple GPUs, which have no 64-bit integer divider and load best in vectors.

Two rules:

``int64-division``
    A 64-bit integer ``/`` or ``%`` by a value that is not a compile-time constant, inside a
    loop (Apple GPUs emulate it in software: dozens of instructions per element). Found in the
    kernel's LLVM IR as clang builds it for the emulator (``-O1``, template arguments applied,
    helpers inlined, so the types are the real ones; a constant divisor, which compiles to a
    multiply, is not reported), placed by its debug location in the kernel's header or source.
``strided-scalar-load``
    Inside a loop, an element read whose index multiplies by a runtime stride (a name
    containing ``stride``, or ``<input>_strides[...]``): one scalar load per element where a
    contiguous operand could take vector loads. Found in the MSL text.

A line (or the line above it) whose comment says ``lint-ok: <rule> <why>`` keeps that rule
quiet there: the intended scalar fallback beside a vector path, say. :func:`lint_kernel` (also
``mlx_bricks.emulator.lint_kernel``) returns the findings; tests/test_metal_src_rules.py holds
the bricks' kernels to none.
"""
from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import compile as _compile
from .source import Generated, cpp_translation_unit
from .toolchain import clang_or_raise, preprocess

RULES = ("int64-division", "strided-scalar-load")
_KERNEL_FILES = ("header", "source")


@dataclass(frozen=True)
class Finding:
    """One lint finding: ``rule`` (one of :data:`RULES`), where (``file`` "header" or
    "source", 1-based ``line``), the source ``text`` of that line and a ``message``."""

    rule: str
    file: str
    line: int
    text: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.rule}: {self.message}\n    {self.text.strip()}"


def _lines(gen: Generated) -> dict[str, list[str]]:
    return {"header": gen.header.split("\n"), "source": gen.body.split("\n")}


def _waived(lines: list[str], line: int, rule: str) -> bool:
    """Whether line ``line`` (1-based) or the one above carries ``lint-ok: <rule>``."""
    for n in (line, line - 1):
        if 1 <= n <= len(lines) and re.search(rf"lint-ok:\s*{re.escape(rule)}\b", lines[n - 1]):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# int64-division: from the IR


_DEFINE = re.compile(r"^define [^@]*@([\w.$]+)\(")
_LABEL = re.compile(r"^([\w.$-]+):")
_TARGET = re.compile(r"label %([\w.$-]+)")
_DIV = re.compile(r"=\s*(sdiv|udiv|srem|urem)(?: exact)? (?:<\d+ x )?i64>? ([^,]+), ([^,]+?)"
                   r"(?:, !dbg !(\d+))?$")
_META = re.compile(r"^!(\d+) = (?:distinct )?!(\w+)\((.*)\)$")


def _field(body: str, name: str) -> str | None:
    m = re.search(rf"\b{name}: (!\d+|\d+|\"[^\"]*\")", body)
    return m.group(1) if m else None


def _in_loop(blocks: dict[str, list[str]], order: list[str]) -> set[str]:
    """Blocks of a function that lie on a cycle of its control-flow graph (Tarjan's SCCs)."""
    succ = {b: [t for t in blocks[b] if t in blocks] for b in order}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    looped: set[str] = set()
    counter = 0
    for root in order:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on.add(node)
            if i < len(succ[node]):
                work.append((node, i + 1))
                nxt = succ[node][i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1 or node in succ[node]:
                    looped.update(comp)
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return looped


def _ir_divisions(ir: str) -> list[tuple[str, int]]:
    """(debug location id, 0) of each 64-bit division by a non-constant inside a loop."""
    found = []
    fn_blocks: dict[str, list[str]] | None = None
    order: list[str] = []
    divs: list[tuple[str, str]] = []
    current = None
    for line in ir.split("\n"):
        if fn_blocks is None:
            if _DEFINE.match(line):
                fn_blocks, order, divs = {}, [], []
                current = "%entry"
                fn_blocks[current] = []
                order.append(current)
            continue
        if line.startswith("}"):
            looped = _in_loop(fn_blocks, order)
            found += [(dbg, 0) for block, dbg in divs if block in looped]
            fn_blocks = None
            continue
        m = _LABEL.match(line)
        if m:
            current = m.group(1)
            fn_blocks.setdefault(current, [])
            order.append(current)
            continue
        stripped = line.strip()
        if stripped.startswith(("br ", "switch ")) or (stripped.startswith("i") and "label %" in
                                                         stripped):
            fn_blocks[current].extend(_TARGET.findall(stripped))
        d = _DIV.search(stripped)
        if d and d.group(4) and not re.fullmatch(r"-?\d+", d.group(3).strip()):
            divs.append((current, d.group(4)))
    return found


def _locate(meta: dict[str, tuple[str, str]], dbg: str) -> tuple[str, int] | None:
    """(kernel file, line) of a DILocation written in the kernel's header or source; None for
    one in the shim (the emulator's own code, inlined wherever it is called)."""
    kind, body = meta.get(dbg, ("", ""))
    if kind != "DILocation":
        return None
    scope = _field(body, "scope")
    for _ in range(64):
        _, sbody = meta.get(scope[1:] if scope else "", ("", ""))
        file_ref = _field(sbody, "file")
        if file_ref:
            name = (_field(meta.get(file_ref[1:], ("", ""))[1], "filename") or "").strip('"')
            return (name, int(_field(body, "line") or 0)) if name in _KERNEL_FILES else None
        scope = _field(sbody, "scope")
        if not scope:
            return None
    return None


def _ir(gen: Generated) -> str:
    """The kernel's LLVM IR at -O1 with debug locations (address spaces as in the compile)."""
    clang, _ = clang_or_raise()
    cmd = [clang, *_compile.COMMON_FLAGS, "-O1", "-g", *_compile.DIAG_FLAGS, "-I",
           str(_compile.SHIM_DIR)]
    tu = cpp_translation_unit(gen, preprocess)
    with tempfile.TemporaryDirectory(dir=_compile.cache_dir()) as tmpd:
        tmp = Path(tmpd)
        _compile.build(gen.kernel_name, tu.text, cmd, ["-S", "-emit-llvm", "-o", "lint.ll"], tmp)
        return (tmp / "lint.ll").read_text()


def int64_divisions(gen: Generated) -> list[Finding]:
    """The ``int64-division`` findings of a generated kernel (one clang run to LLVM IR).

    Raises:
        EmulatorCompileError: no clang, or the kernel does not compile.
    """
    ir = _ir(gen)
    meta = {}
    for line in ir.split("\n"):
        m = _META.match(line)
        if m:
            meta[m.group(1)] = (m.group(2), m.group(3))
    lines = _lines(gen)
    out, seen = [], set()
    for dbg, _ in _ir_divisions(ir):
        where = _locate(meta, dbg)
        if where is None or where in seen:
            continue
        seen.add(where)
        file, line = where
        text = lines[file][line - 1] if 1 <= line <= len(lines[file]) else ""
        if _waived(lines[file], line, "int64-division"):
            continue
        out.append(Finding("int64-division", file, line, text,
                           "64-bit integer division or modulo by a runtime value in a loop "
                           "(emulated in software on Apple GPUs): use 32-bit index math, or a "
                           "contiguous fast path"))
    return sorted(out, key=lambda f: (f.file, f.line))


# ---------------------------------------------------------------------------------------------
# strided-scalar-load: from the text

_LOOP = re.compile(r"\b(?:for|while)\s*\(")
_SUBSCRIPT = re.compile(r"(?:\b\w+|[\])])\s*\[")
_STRIDE = re.compile(r"\w*stride\w*", re.I)


def _blank_comments(text: str) -> str:
    """``text`` with comments replaced by spaces (offsets and line numbers kept)."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text,
                  flags=re.S)


def _match(text: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket matching the one at ``i``."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == open_:
            depth += 1
        elif text[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def _loop_spans(text: str) -> list[tuple[int, int]]:
    spans = []
    for m in _LOOP.finditer(text):
        end = _match(text, m.end() - 1, "(", ")")
        rest = len(text) - len(text[end:].lstrip())
        if rest < len(text) and text[rest] == "{":
            spans.append((rest, _match(text, rest, "{", "}")))
        else:
            spans.append((rest, text.find(";", rest) + 1 or len(text)))
    return spans


def strided_loads(file: str, text: str) -> list[Finding]:
    """The ``strided-scalar-load`` findings of one piece of MSL (``file``: its name in the
    messages, "header" or "source")."""
    code = _blank_comments(text)
    lines = text.split("\n")
    spans = _loop_spans(code)
    out, seen = [], set()
    for m in _SUBSCRIPT.finditer(code):
        if not any(a <= m.start() < b for a, b in spans):
            continue
        end = _match(code, m.end() - 1, "[", "]")
        index = code[m.end():end - 1]
        after = code[end:end + 3].lstrip()
        if after.startswith("=") and not after.startswith("=="):
            continue  # a store
        if "*" not in index or not _STRIDE.search(index):
            continue
        line = code.count("\n", 0, m.start()) + 1
        if line in seen or _waived(lines, line, "strided-scalar-load"):
            continue
        seen.add(line)
        out.append(Finding("strided-scalar-load", file, line, lines[line - 1],
                           "scalar load along a runtime stride inside a loop: give the "
                           "stride == 1 case a vector-load path (and mark the fallback "
                           "'lint-ok: strided-scalar-load')"))
    return out


def lint(gen: Generated, rules=RULES) -> list[Finding]:
    """The findings of ``rules`` for a generated kernel (see the module docstring).

    Raises:
        ValueError: an unknown rule.
        EmulatorCompileError: ``int64-division`` needs clang and a kernel that compiles.
    """
    unknown = set(rules) - set(RULES)
    if unknown:
        raise ValueError(f"unknown lint rules {sorted(unknown)}; known: {', '.join(RULES)}")
    found: list[Finding] = []
    if "strided-scalar-load" in rules:
        found += strided_loads("header", gen.header) + strided_loads("source", gen.body)
    if "int64-division" in rules:
        found += int64_divisions(gen)
    return found
