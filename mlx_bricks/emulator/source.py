"""The kernel source MLX 0.32 generates for ``mx.fast.metal_kernel``, and its C++ form.

``generate`` follows ``mlx/backend/common/metal_kernel.cpp`` (``write_signature``,
``write_template``, ``make_template_hash`` and the kernel-name rules) so that the text is the one
MLX prints with ``verbose=True``, including its quirks:

* ``<in>_shape``/``_strides``/``_ndim`` parameters and the attributes are detected by plain
  substring search in ``source`` (not ``header``);
* inputs with fewer than 8 elements go to the ``constant`` address space, 0-d inputs (and Python
  scalars) are ``const constant T&``;
* with two or more outputs, a shape/strides/ndim parameter and no attribute, MLX 0.32 closes the
  signature after the first output and writes ``) {`` again after the next one: the source does
  not compile on Metal. ``generate`` reproduces the text; ``cpp_translation_unit`` refuses it.

``cpp_translation_unit`` turns the same pieces into one C++ file for clang: the shim include,
the header and body (lightly rewritten: functional and C-style casts to any type that may be a
vector, ``static_cast``, ``threadgroup`` declarations, ``1.0h`` literals; run through the
preprocessor first when a macro casts to one of its parameters: the caller hands in the
preprocessor, this module runs no tool), the signature and an ``extern "C"`` entry that binds
buffers and attributes. The address-space keywords stay: the shim makes them clang address
spaces.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Tuple

MAX_CONSTANT_ARRAY_SIZE = 8

# (attribute, MSL type) in the order MLX checks them (and writes them into the signature).
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# C++ expression (given `emu_l`, an EmuLane*) for each attribute's value.
_ATTRIBUTE_VALUES = {
    "dispatch_quadgroups_per_threadgroup": "(emu_l->dispatch_threads_per_threadgroup[0] * "
    "emu_l->dispatch_threads_per_threadgroup[1] * emu_l->dispatch_threads_per_threadgroup[2] + 3) / 4",
    "dispatch_simdgroups_per_threadgroup": "emu_l->dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup": "emu_u3(emu_l->dispatch_threads_per_threadgroup)",
    "grid_origin": "uint3(0u)",
    "grid_size": "emu_u3(emu_l->threads_per_grid)",
    "quadgroup_index_in_threadgroup": "emu_l->thread_index_in_threadgroup / 4",
    "quadgroups_per_threadgroup": "(emu_l->threads_per_threadgroup[0] * "
    "emu_l->threads_per_threadgroup[1] * emu_l->threads_per_threadgroup[2] + 3) / 4",
    "simdgroup_index_in_threadgroup": "emu_l->simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup": "emu_l->simdgroups_per_threadgroup",
    "thread_execution_width": "32u",
    "thread_index_in_quadgroup": "emu_l->thread_index_in_threadgroup % 4",
    "thread_index_in_simdgroup": "emu_l->thread_index_in_simdgroup",
    "thread_index_in_threadgroup": "emu_l->thread_index_in_threadgroup",
    "thread_position_in_grid": "emu_u3(emu_l->thread_position_in_grid)",
    "thread_position_in_threadgroup": "emu_u3(emu_l->thread_position_in_threadgroup)",
    "threadgroup_position_in_grid": "emu_u3(emu_l->threadgroup_position_in_grid)",
    "threadgroups_per_grid": "emu_u3(emu_l->threadgroups_per_grid)",
    "threads_per_grid": "emu_u3(emu_l->threads_per_grid)",
    "threads_per_simdgroup": "32u",
    "threads_per_threadgroup": "emu_u3(emu_l->threads_per_threadgroup)",
}

# MLX's get_type_string, keyed by the dtype's name (str(mx.float16) == "mlx.core.float16").
TYPE_STRINGS = {
    "bool": "bool",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "float16": "float16_t",
    "bfloat16": "bfloat16_t",
    "float32": "float",
    "float64": "double",
    "complex64": "complex64_t",
}


def dtype_name(dtype) -> str:
    """``"float16"`` for ``mx.float16`` (and for the string ``"float16"``)."""
    return str(dtype).rsplit(".", 1)[-1]


def type_string(dtype) -> str:
    """MLX's C type name for an ``mx.Dtype`` (``float16_t``, ``bfloat16_t``, ``float``, ...)."""
    name = dtype_name(dtype)
    try:
        return TYPE_STRINGS[name]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no Metal type") from None


@dataclass(frozen=True)
class InputInfo:
    """What the generator needs to know about one input: its dtype, ndim and element count."""

    dtype: object
    ndim: int
    size: int


@dataclass
class Param:
    """One parameter of the generated kernel signature, in buffer order for buffers."""

    kind: str  # "input" | "shape" | "strides" | "ndim" | "output" | "attribute"
    name: str
    decl: str  # the C type as written in the signature ("const device float16_t*")
    buffer: int = -1  # [[buffer(n)]] index, -1 for attributes
    input_index: int = -1  # which input a shape/strides/ndim belongs to
    scalar: bool = False  # passed by reference (`constant T&`)


@dataclass
class Generated:
    """The generated kernel: MLX's name and text, plus what the C++ form needs."""

    kernel_name: str
    source: str
    header: str
    body: str
    template_line: str  # "template <typename T, int N>\n" or ""
    signature: str  # from "[[kernel]] void" through the opening brace
    instantiation: str  # MLX's trailing explicit instantiation ("" without templates)
    template_args: str  # "<bfloat16_t, 3, 1>" or ""
    params: list[Param] = field(default_factory=list)
    malformed: bool = False


def _template_value(value) -> tuple[str, str]:
    """(parameter kind, value text) for one template argument, as MLX writes them."""
    if isinstance(value, bool):
        return "bool", "1" if value else "0"
    if isinstance(value, int):
        return "int", str(value)
    if type(value).__name__ == "Dtype":
        return "typename", type_string(value)
    raise TypeError(
        f"template argument {value!r}: expected an int, a bool or an mx.Dtype"
    )


def template_hash(template_def: str) -> str:
    """MLX's make_template_hash: '<a, b>' -> '_a_b' (pop_back drops the final '_')."""
    out = []
    i = 0
    while i < len(template_def):
        c = template_def[i]
        if c in "<>":
            out.append("_")
        elif c == "," and i + 1 < len(template_def) and template_def[i + 1] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]


def generate(
    name: str,
    input_names: list[str],
    output_names: list[str],
    source: str,
    header: str,
    inputs: list[InputInfo],
    output_dtypes: list,
    template: list[tuple[str, object]] | None = None,
    atomic_outputs: bool = False,
) -> Generated:
    """The kernel MLX 0.32 builds for these arguments (see the module docstring)."""
    template = list(template or [])
    shape_infos = [
        (n + "_shape" in source, n + "_strides" in source, n + "_ndim" in source)
        for n in input_names
    ]
    attributes = [(a, t) for a, t in METAL_ATTRIBUTES if a in source]

    kernel_name = "custom_kernel_" + name
    targs = ""
    if template:
        targs = "<" + ", ".join(_template_value(v)[1] for _, v in template) + ">"
        kernel_name += "_" + template_hash(targs)
    for info in inputs:
        kernel_name += "_" + type_string(info.dtype)
        if info.ndim == 0:
            kernel_name += "s"
        elif info.size < MAX_CONSTANT_ARRAY_SIZE:
            kernel_name += "c"
    for dt in output_dtypes:
        kernel_name += "_" + type_string(dt)

    template_line = ""
    if template:
        template_line = (
            "template <"
            + ", ".join(f"{_template_value(v)[0]} {n}" for n, v in template)
            + ">\n"
        )
    sig = ["[[kernel]] void ", kernel_name, "(\n"]
    params: list[Param] = []
    index = 0
    for i, (n, info) in enumerate(zip(input_names, inputs)):
        location = "constant" if info.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if info.ndim == 0 else "*"
        decl = f"const {location} {type_string(info.dtype)}{ref}"
        sig.append(f"  {decl} {n} [[buffer({index})]],\n")
        params.append(Param("input", n, decl, index, i, scalar=info.ndim == 0))
        index += 1
        if info.ndim > 0:
            for flag, suffix, ctype, scalar in (
                (shape_infos[i][0], "_shape", "const constant int*", False),
                (shape_infos[i][1], "_strides", "const constant int64_t*", False),
                (shape_infos[i][2], "_ndim", "const constant int&", True),
            ):
                if flag:
                    sig.append(f"  {ctype} {n}{suffix} [[buffer({index})]],\n")
                    params.append(Param(suffix[1:], n + suffix, ctype, index, i, scalar))
                    index += 1
    malformed = False
    n_out = len(output_names)
    for i, (n, dt) in enumerate(zip(output_names, output_dtypes)):
        ts = type_string(dt)
        decl = f"device atomic<{ts}>*" if atomic_outputs else f"device {ts}*"
        sig.append(f"  {decl} {n} [[buffer({index})]]")
        params.append(Param("output", n, decl, index))
        # MLX compares the buffer index (which counts shape/strides/ndim buffers too) with
        # the number of inputs and outputs: the source of the malformed-signature quirk.
        if index < len(inputs) + n_out - 1 or attributes:
            sig.append(",\n")
        else:
            sig.append(") {\n")
            if i < n_out - 1:
                malformed = True
        index += 1
    for i, (a, t) in enumerate(attributes):
        sig.append(f"  {t} {a} [[{a}]]")
        sig.append(",\n" if i < len(attributes) - 1 else ") {\n")
        params.append(Param("attribute", a, t))
    signature = "".join(sig)

    instantiation = ""
    if template:
        tdef = kernel_name + targs
        instantiation = (
            f'\ntemplate [[host_name("{kernel_name}")]] [[kernel]] decltype({tdef}) {tdef};\n'
        )
    text = header + template_line + signature + source + "\n}\n" + instantiation
    return Generated(
        kernel_name=kernel_name,
        source=text,
        header=header,
        body=source,
        template_line=template_line,
        signature=signature,
        instantiation=instantiation,
        template_args=targs,
        params=params,
        malformed=malformed,
    )


# ---------------------------------------------------------------------------------------------
# MSL -> C++ rewriting (only what clang cannot take as it is)

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


def rewrite_msl(text: str, decls: list[TgDecl], names: set[str] | None = None) -> str:
    """The C++ clang compiles for a piece of MSL (header or body); line count is preserved.
    ``names``: the type names of the whole kernel (``type_names``); default: this text's."""
    text = _METAL_INCLUDE.sub("", text)
    if _HALF_SUFFIX.search(text):
        text = _HALF_LITERAL.sub(r"\1f16", text)
    text = _STATIC_CAST.sub("::emu::scast<", text)
    text = _rewrite_constructors(text, type_names(text) if names is None else names)
    return _rewrite_threadgroup(text, decls)


@dataclass
class TranslationUnit:
    """The C++ text clang compiles for one kernel, and its threadgroup declarations."""

    text: str
    tg_decls: list[TgDecl]


Preprocessor = Callable[[str, str], Tuple[str, str]]


def cpp_translation_unit(gen: Generated, preprocess: Preprocessor | None = None) -> TranslationUnit:
    """One C++ file for clang: shim + rewritten header + MLX's signature + rewritten body +
    the ``emu_kernel_entry`` that binds buffers and attributes.

    ``preprocess(header, body) -> (header, body)`` expands the kernel's macros, line numbers
    kept (``toolchain.preprocess``); it is called only for a kernel with a function-like macro
    that casts to a parameter (:func:`macro_casts_parameter`), and such a kernel needs it.

    Raises:
        ValueError: the kernel needs the preprocessor and ``preprocess`` is None.
    """
    decls: list[TgDecl] = []
    header = _METAL_INCLUDE.sub("", gen.header)
    body = _METAL_INCLUDE.sub("", gen.body)
    if macro_casts_parameter(header + "\n" + body):
        if preprocess is None:
            raise ValueError(f"kernel {gen.kernel_name!r} has a macro that casts to one of its "
                             "parameters: pass preprocess= (toolchain.preprocess)")
        header, body = preprocess(header, body)
    names = type_names(header + "\n" + gen.template_line + "\n" + body)
    header = rewrite_msl(header, decls, names)
    body = rewrite_msl(body, decls, names)
    parts = ['#include "metal_shim.h"\n']
    if header:
        parts.append('#line 1 "header"\n' + header)
        if not header.endswith("\n"):
            parts.append("\n")
    parts.append('#line 1 "signature"\n' + gen.template_line + gen.signature)
    parts.append('#line 1 "source"\n' + body + "\n}\n")
    parts.append('#line 1 "entry"\n')
    fn = gen.kernel_name + gen.template_args
    if gen.template_args:
        parts.append(f"template decltype({fn}) {fn};\n")
    parts.append(_entry(gen, fn))
    return TranslationUnit("".join(parts), decls)


def _entry(gen: Generated, fn: str) -> str:
    args = []
    for p in gen.params:
        if p.kind == "attribute":
            args.append(_ATTRIBUTE_VALUES[p.name])
        elif p.scalar:
            base = p.decl[:-1]  # drop '&'
            args.append(f"*({base}*)(emu_b[{p.buffer}])")
        else:  # C-style casts: they may also give the pointer its address space
            args.append(f"({p.decl})(emu_b[{p.buffer}])")
    joined = ",\n      ".join(args)
    return (
        "static inline uint3 emu_u3(const uint32_t* v) { return uint3{v[0], v[1], v[2]}; }\n"
        'extern "C" __attribute__((visibility("default"))) void emu_kernel_entry(void** emu_b) {\n'
        "  EmuLane* emu_l = emu_cur();\n"
        "  (void)emu_l;\n"
        f"  {fn}(\n      {joined});\n"
        "}\n"
    )
