"""MSL -> C++ rewriting: only what clang cannot take as it is (``source.cpp_translation_unit``
calls it on a kernel's header and body).

Functional and C-style casts to any type that may be a vector become brace constructions,
``static_cast`` to such a type likewise, ``threadgroup`` arrays declared in a kernel body become
``static`` (:class:`TgDecl` records them for the fiber runtime), ``1.0h`` literals lose their
suffix, and ``#include <metal_*>`` lines go. The address-space keywords stay: the shim makes
them clang address spaces.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


_SCALARS = "bool|char|uchar|short|ushort|int|uint|long|ulong|half|float|bfloat"
_VEC_NAME = rf"(?:packed_)?(?:{_SCALARS})[234]"
_METAL_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<metal_\w+>.*$", re.M)
_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
# (each pattern starts with its literal, which `re` finds fast; the lookbehind after it is `\b`)
_HALF_SUFFIX = re.compile(r"[\d.][hH]\b")
_STATIC_CAST = re.compile(r"static_cast(?<!\wstatic_cast)\s*<")
# Names that may denote a type: a functional cast `N(x)` or C-style cast `(N)x` through one of
# them goes to emu::mk / emu::cvt (see _rewrite_constructors).
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_TYPEDEF = re.compile(r"typedef(?<!\wtypedef)\b[^;{}]*?\b([A-Za-z_]\w*)\s*;")
_USING = re.compile(r"using(?<!\wusing)\s+([A-Za-z_]\w*)\s*=")
_TEMPLATE = re.compile(r"template(?<!\wtemplate)\s*<")
_TYPE_PARAM = re.compile(r"^\s*(?:typename|class)\s*(?:\.\.\.)?\s*([A-Za-z_]\w*)\s*(?:=[\s\S]*)?$")
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(\([^)]*\))?((?:[^\n\\]|\\\n?)*)",
                     re.M)
_VEC_RE = re.compile(rf"^(?:metal::)?(?:{_VEC_NAME}|vec\s*<.*>)$", re.S)
# a one-level template argument list, for qualified names (`Traits<T>::vec4`)
_TARGS = r"<(?:[^<>;{}]|<[^<>;{}]*>)*>"
_QUAL = rf"(?:typename\s+)?(?:::\s*)?(?:[A-Za-z_]\w*\s*(?:{_TARGS})?\s*::\s*)*"
_QUAL_BEFORE = re.compile(rf"(?:typename\s+)?(?:::\s*)?(?:[A-Za-z_]\w*\s*(?:{_TARGS})?\s*::\s*)+$")
# `X (*p)...` / `X (&r)...` at the start of a statement declares p, r: not a cast
_DECLARATOR_PAREN = re.compile(r"\s*[*&]")


def _balanced(text: str, start: int, open_: str = "<", close: str = ">") -> int:
    """Index just past the ``close`` matching the ``open_`` at ``start`` (or -1)."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == open_:
            depth += 1
        elif c == close:
            depth -= 1
            if depth == 0:
                return i + 1
        elif c in ";{}":
            return -1
    return -1


def type_names(text: str) -> set[str]:
    """Names the text declares as types whose kind the rewriter cannot see: typedef and using
    aliases (of anything), template type parameters, and object-like macros naming a type."""
    text = _COMMENT.sub(" ", text)
    names: set[str] = set()
    names.update(m.group(1) for m in _TYPEDEF.finditer(text))
    names.update(m.group(1) for m in _USING.finditer(text))
    for m in _TEMPLATE.finditer(text):
        end = _balanced(text, m.end() - 1)
        if end < 0:
            continue
        for param in _split_top(text[m.end() : end - 1]):
            pm = _TYPE_PARAM.match(param)
            if pm:
                names.add(pm.group(1))
    defines = [(m.group(1), m.group(3).strip()) for m in _DEFINE.finditer(text) if not m.group(2)]
    for _ in range(3):  # `#define V4 T4` after `using T4 = ...`
        for name, value in defines:
            if _VEC_RE.match(value) or value in names or re.fullmatch(_SCALARS, value):
                names.add(name)
    return names


def macro_casts_parameter(text: str) -> bool:
    """A function-like macro whose body calls or casts to a parameter (`#define C(T, x) T(x)`):
    the parameter may be a vector type only the preprocessor can reveal."""
    for m in _DEFINE.finditer(text):
        if not m.group(2):
            continue
        body = m.group(3)
        for p in re.findall(r"[A-Za-z_]\w*", m.group(2)):
            if re.search(rf"(?<![\w.]){p}\s*\(|\(\s*{p}\s*\)", body):
                return True
    return False


def _rewrite_constructors(text: str, names: set[str]) -> str:
    """Functional casts ``N(a, ...)`` -> ``::emu::mk<N>(a, ...)`` and C-style casts ``(N)x`` ->
    ``::emu::cvt<N>() ->* x`` for every N that is, or may be, an MSL vector type: the vector
    names, ``vec<T, n>``, ``decltype(...)`` and the ``names`` (aliases, template type
    parameters; qualified ones too, `typename Traits<T>::vec4(x)`). ``emu::mk`` gives each its
    MSL meaning (a vector conversion is component by component; clang alone would reinterpret
    the bits of a same-size vector)."""
    alts = _VEC_NAME + "".join("|" + re.escape(a) for a in sorted(names, key=len, reverse=True))
    ctor = re.compile(rf"(?<![\w.>~])(?:{alts})\s*\(")

    def functional(m: re.Match) -> tuple[int, int, str] | None:
        """(start, end, replacement) for a cast, None for what only looks like one."""
        start = m.start()
        window = text[max(0, start - 200) : start]
        if window.rstrip().endswith("::"):  # a qualified name: `typename Traits<T>::vec4(`
            q = _QUAL_BEFORE.search(window)
            if q and q.group(0):
                start -= len(q.group(0))
                window = window[: len(window) - len(q.group(0))]
        before = window.rstrip()
        if re.search(r"\boperator$", before):  # conversion function `operator T()`
            return None
        if _DECLARATOR_PAREN.match(text, m.end()) and (before == "" or before[-1] in ";{}"):
            return None  # `T (*p)[4] = ...;` declares p
        name = text[start : m.end()].rstrip()[:-1].rstrip()
        return (start, m.end(), f"::emu::mk<{name}>(")

    pieces = []
    pos = 0
    for m in ctor.finditer(text):
        if m.start() < pos:
            continue
        r = functional(m)
        if r is None or r[0] < pos:
            continue
        pieces.append(text[pos : r[0]])
        pieces.append(r[2])
        pos = r[1]
    pieces.append(text[pos:])
    text = "".join(pieces)

    # vec<T, N>(...) and decltype(...)(...): balanced brackets
    out = []
    pos = 0
    for m in re.finditer(r"(?<![\w.:])(?:metal::)?(?:vec\s*<|decltype\s*\()", text):
        if m.start() < pos:
            continue
        opener = text[m.end() - 1]
        end = _balanced(text, m.end() - 1, opener, ">" if opener == "<" else ")")
        if end < 0:
            continue
        rest = re.match(r"\s*\(", text[end:])
        if not rest:
            continue
        out.append(text[pos : m.start()])
        out.append(f"::emu::mk<{text[m.start():end]}>(")
        pos = end + rest.end()
    out.append(text[pos:])
    text = "".join(out)

    cast = re.compile(
        rf"\(\s*({_QUAL}(?:{alts}|vec\s*{_TARGS}))\s*\)(?=\s*[\w(\-+!~*.:])"
    )

    def c_cast(m: re.Match) -> str:
        before = text[max(0, m.start() - 100) : m.start()].rstrip()
        if re.search(r"(?:\b(?:sizeof|alignof|decltype)|[\w\]\)])$", before) and not re.search(
            r"\breturn$", before
        ):
            return m.group(0)
        return f"::emu::cvt<{m.group(1)}>() ->* "

    return cast.sub(c_cast, text)


@dataclass
class TgDecl:
    """A ``threadgroup`` array declared in a kernel body, moved into the launch's shared memory."""

    slot: int
    type: str
    name: str
    dims: str

    def describe(self) -> str:
        return f"threadgroup {self.type} {self.name}{self.dims}"


def _split_top(text: str, sep: str = ",") -> list[str]:
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    parts.append("".join(cur))
    return parts


_DECLARATOR = re.compile(r"([A-Za-z_]\w*)\s*((?:\[[^\]]*\]\s*)*)$")


def _rewrite_threadgroup(text: str, decls: list[TgDecl]) -> str:
    """``threadgroup T x[N];`` (threadgroup storage declared in a function) -> a
    ``threadgroup``-qualified reference into the threadgroup's shared block (``emu_tg_alloc``):
    clang refuses automatic address-space variables, and no constructor runs (Metal runs none
    either: threadgroup memory starts undefined)."""
    out = []
    pos = 0
    for m in re.finditer(r"threadgroup(?<!\wthreadgroup)\b", text):
        if m.start() < pos:
            continue
        start = m.start()
        align = None
        pre = re.search(r"alignas\s*\(([^()]*(?:\([^()]*\)[^()]*)*)\)\s*$", text[:start])
        if pre:  # alignas(16) threadgroup T x[N];
            start, align = pre.start(), pre.group(1).strip()
        line_start = text.rfind("\n", 0, start) + 1
        before = text[:start].rstrip()
        at_statement = text[line_start:start].strip() == "" or (before and before[-1] in ";{}")
        if not at_statement:
            continue
        end = text.find(";", m.end())
        if end < 0:
            continue
        stmt = text[m.end():end]
        outside = re.sub(r"\[[^\]]*\]", "[]", stmt)  # array bounds may hold anything
        if "(" in outside or "=" in outside or "{" in outside:
            continue  # a pointer with an initialiser, a parameter list, ...: not storage
        parts = _split_top(stmt)
        first = _DECLARATOR.search(parts[0].rstrip())
        if not first:
            continue
        ctype = parts[0][: first.start()].strip()
        if not ctype or ctype.endswith(("*", "&")) or ctype in ("const",):
            continue
        declarators = [(first.group(1), first.group(2).replace(" ", ""))]
        ok = True
        for p in parts[1:]:
            d = _DECLARATOR.match(p.strip())
            if not d or p.strip().startswith(("*", "&")):
                ok = False
                break
            declarators.append((d.group(1), d.group(2).replace(" ", "")))
        if not ok:
            continue
        newlines = text.count("\n", start, end)
        pieces = []
        for name, dims in declarators:
            slot = len(decls)
            decls.append(TgDecl(slot, ctype, name, dims))
            full = f"{ctype} {dims}" if dims else ctype
            alignment = f"alignof({full})"
            if align:
                alignment = f"(({align}) > {alignment} ? ({align}) : {alignment})"
            pieces.append(
                f"threadgroup {ctype} (&{name}){dims} = *(threadgroup {ctype} (*){dims})"
                f"::emu_tg_alloc({slot}u, sizeof({full}), {alignment}, sizeof({ctype}));"
            )
        repl = " ".join(pieces) + "\n" * newlines
        out.append(text[pos:start])
        out.append(repl)
        pos = end + 1
    out.append(text[pos:])
    return "".join(out)


def drop_metal_includes(text: str) -> str:
    """``text`` without its ``#include <metal_*>`` lines (the shim stands for them)."""
    return _METAL_INCLUDE.sub("", text)


def rewrite_msl(text: str, decls: list[TgDecl], names: set[str] | None = None) -> str:
    """The C++ clang compiles for a piece of MSL (header or body); line count is preserved.
    ``names``: the type names of the whole kernel (``type_names``); default: this text's."""
    text = _METAL_INCLUDE.sub("", text)
    if _HALF_SUFFIX.search(text):
        text = _HALF_LITERAL.sub(r"\1f16", text)
    text = _STATIC_CAST.sub("::emu::scast<", text)
    text = _rewrite_constructors(text, type_names(text) if names is None else names)
    return _rewrite_threadgroup(text, decls)
