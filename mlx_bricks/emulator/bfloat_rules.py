"""Metal's bfloat conversion rules, checked on clang's AST of a kernel.

MSL 3.1 (as MLX's ``bf16_math.h`` quotes it): "bfloat is an extended floating point type that
only allows implicit conversion to a type of greater floating point rank. While bfloat can be
implicitly converted to float, it cannot be implicitly converted to half, and neither float nor
half can be implicitly converted to bfloat." clang's ``__bf16``, the emulator's bfloat, converts
implicitly from and to every arithmetic type (except ``_Float16``, which it refuses both ways),
so ``bfloat x = 1.0f;`` and ``bfloat y = 0;`` compile here and fail on a Mac (the classic MLX
bfloat compile error).

The kernel's translation unit goes through ``clang -fsyntax-only -Xclang -ast-dump`` (templates
instantiated with the launch's arguments) and every *implicit* conversion written in the kernel's
header or source is checked: one whose result is a scalar bfloat (from float, int, bool, ...:
initialisations, assignments, returns, arguments, the usual arithmetic conversions of
``b * 2``, the conversion back of ``b += 1.0f``), and one from a bfloat to anything but float,
bool (conditions) or double. Explicit
conversions (``bfloat(x)``, ``static_cast<bfloat>(x)``, ``T(x)``, C-style casts) pass, as do
conversions inside the emulator's shim.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_KERNEL_FILES = ("header", "source")
_BF16 = "__bf16"
# clang's TextNodeDumper prints each location as file:line:col, line:L:C or col:C, dropping
# what did not change since the location printed before it (in dump order).
_LOC = re.compile(r"(?:(line):(\d+):(\d+)|(col):(\d+)|(<[\w ]+>|[^\s<>,:']+):(\d+):(\d+))")
_QUOTED = re.compile(r"'[^']*'")
_NODE = re.compile(r"^[|`\- ]*([A-Z]\w*) ")
_TYPE = re.compile(r"> '([^']*)'(?::'([^']*)')?")
_CAST_KIND = re.compile(r" <(\w+)>")
_HARMLESS = {"LValueToRValue", "NoOp", "ToVoid"}
_COMPUTE_RESULT = re.compile(r"ComputeResultTy='([^']*)'(?::'([^']*)')?")
_FROM_BF16_OK = {"float", _BF16, "bool", "double"}


@dataclass(frozen=True)
class Conversion:
    """An implicit conversion Metal refuses: where (``file``, ``line``, ``col``) and what."""

    file: str
    line: int
    col: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.what}"


def _canonical(line: str) -> str | None:
    m = _TYPE.search(line)
    if not m:
        return None
    return m.group(2) or m.group(1)


def refused_conversions(ast_dump: str) -> list[Conversion]:
    """The implicit conversions to or from bfloat that Metal refuses, in a text AST dump.

    ``ast_dump`` is clang's ``-ast-dump`` output for a translation unit whose kernel parts
    carry ``#line 1 "header"`` / ``#line 1 "source"`` markers (source.cpp_translation_unit).
    """
    file, line_no = "", 0
    pending = None  # (file, line, col, result type, kind) of a cast awaiting its child's type
    found: dict[tuple[str, int, int], Conversion] = {}
    for text in ast_dump.splitlines():
        node = _NODE.match(text)
        if pending is not None and node:
            cfile, cline, ccol, result, kind = pending
            child = _canonical(text)
            pending = None
            if child == _BF16 and result not in _FROM_BF16_OK:
                found.setdefault((cfile, cline, ccol), Conversion(
                    cfile, cline, ccol,
                    f"implicit conversion from bfloat to {result} (Metal converts a bfloat "
                    "implicitly only to float)"))
            elif result == _BF16 and child != _BF16:
                found.setdefault((cfile, cline, ccol), Conversion(
                    cfile, cline, ccol,
                    f"implicit conversion from {child} to bfloat (Metal converts to bfloat "
                    "only explicitly: bfloat(x), static_cast<bfloat>(x))"))
        first = None
        for m in _LOC.finditer(_QUOTED.sub("''", text)):
            if m.group(1):
                line_no = int(m.group(2))
                col = int(m.group(3))
            elif m.group(4):
                col = int(m.group(5))
            else:
                file, line_no, col = m.group(6), int(m.group(7)), int(m.group(8))
            if first is None:
                first = (file, line_no, col)
        if node and node.group(1) == "CompoundAssignOperator" and first is not None \
                and first[0] in _KERNEL_FILES and _canonical(text) == _BF16:
            # `b += x`: computed in the wider type, converted back to bfloat implicitly
            m = _COMPUTE_RESULT.search(text)
            computed = m and (m.group(2) or m.group(1))
            if computed and computed != _BF16:
                found.setdefault(first, Conversion(
                    *first, f"compound assignment to a bfloat computed in {computed} (the "
                    "result converts to bfloat implicitly, which Metal refuses)"))
            continue
        if not node or node.group(1) != "ImplicitCastExpr" or "part_of_explicit_cast" in text:
            continue
        kind = _CAST_KIND.search(_QUOTED.sub("''", text))
        if first is None or first[0] not in _KERNEL_FILES or not kind:
            continue
        if kind.group(1) in _HARMLESS:
            continue
        pending = (*first, _canonical(text), kind.group(1))
    return sorted(found.values(), key=lambda c: (c.file, c.line, c.col))
