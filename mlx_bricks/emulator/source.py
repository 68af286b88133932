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
the header and body (lightly rewritten by ``rewrite.py``: functional and C-style casts to any type that may be a
vector, ``static_cast``, ``threadgroup`` declarations, ``1.0h`` literals; run through the
preprocessor first when a macro casts to one of its parameters: the caller hands in the
preprocessor, this module runs no tool), the signature and an ``extern "C"`` entry that binds
buffers and attributes. The address-space keywords stay: the shim makes them clang address
spaces.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Tuple

from .rewrite import (  # noqa: F401  (TgDecl, rewrite_msl, type_names: re-exported)
    TgDecl,
    drop_metal_includes,
    macro_casts_parameter,
    rewrite_msl,
    type_names,
)

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
    header = drop_metal_includes(gen.header)
    body = drop_metal_includes(gen.body)
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
