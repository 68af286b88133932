"""The CUDA source of a twin launch, as MLX 0.32 builds it and as the build cache compiles it.

``mx.fast.cuda_kernel`` wraps a body in a generated ``__global__`` signature (``build_kernel`` in
``mlx/backend/cuda/custom_kernel.cpp``): the default header, our header, ``namespace
mlx::core::cu``, inputs as ``const T*`` plus ``<name>_shape`` / ``_strides`` / ``_ndim``
parameters where the body names them, outputs as ``T*``, template values as ``constexpr`` /
``using`` lines. :func:`generated_source` reproduces that text (the compile checks of
``mlx_bricks.cudacheck`` compile it; :func:`jit_unit` is it under MLX's own module name).

:func:`translation_unit` writes the same kernel with an ``extern "C"`` signature for
``mx.fast.precompiled_cuda_kernel`` (a precompiled kernel is looked up by its plain name and
gets each input's and output's pointer, then int scalars; no shape parameters). So the shapes,
strides (int64 as low and high halves) and ndims the body reads are passed as scalars and
rebuilt as the same ``Shape`` / ``Strides`` / ``int`` locals, zero-padded to :data:`MAX_NDIM`.
A body that reads the strides of views (``ensure_row_contiguous=False``: attention, decode)
cannot be precompiled (a lazy array's strides are known only at evaluation): its source goes to
MLX's JIT disk cache instead (:class:`JitUnit`, ``mlx_bricks.cuda.build``).

Nothing here imports MLX at module level or touches a GPU.
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass

#: MLX 0.32's ``dtype_to_cuda_type``.
CUDA_TYPES = {
    "bool": "bool", "int8": "int8_t", "int16": "int16_t", "int32": "int32_t",
    "int64": "int64_t", "uint8": "uint8_t", "uint16": "uint16_t", "uint32": "uint32_t",
    "uint64": "uint64_t", "float16": "__half", "bfloat16": "__nv_bfloat16",
    "float32": "float", "float64": "double",
}
#: What ``build_kernel`` puts before the user's header.
DEFAULT_HEADER = """
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

"""
# What ``build_kernel`` puts between the user's header and the kernel, and after the body.
_OPEN = "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
_CLOSE = "\n}\n\n} // namespace mlx::core::cu\n"


def _dtype_name(dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def template_lines(template, ctype=None) -> list[str]:
    """The constants MLX's ``build_kernel`` declares at the top of a kernel body for its
    ``template``: ``constexpr`` ints and bools, ``using`` for dtypes (``ctype(dtype)``: the CUDA
    type's name; default :data:`CUDA_TYPES`); a blank line after them."""
    ctype = ctype or (lambda d: CUDA_TYPES[_dtype_name(d)])
    lines = []
    for name, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};\n")
        else:
            lines.append(f"  using {name} = {ctype(value)};\n")
    return lines + ["\n"] if lines else lines


def _kernel(header: str, declaration: str, params: list[str], lines: list[str],
            body: str) -> str:
    """One kernel's whole source, laid out as ``build_kernel`` lays it out."""
    return "".join([DEFAULT_HEADER, header, _OPEN, f"{declaration}(\n", ",\n".join(params),
                    ") {\n", *lines, body, _CLOSE])


def generated_source(func_name: str, header: str, body: str, inputs, output_names,
                     output_dtypes, template=()) -> str:
    """The CUDA source ``mx.fast.cuda_kernel`` builds (MLX 0.32 ``build_kernel``).

    Args:
        func_name: the ``__global__`` function's name.
        header, body: as given to ``cuda_kernel``.
        inputs: ``[(name, dtype, ndim), ...]`` in launch order (dtype an ``mx.Dtype`` or its
            name; ndim 0 for a scalar array, which gets no shape/strides parameters).
        output_names, output_dtypes: the outputs.
        template: ``[(name, value), ...]``: int, bool or dtype.

    Raises:
        KeyError: a dtype CUDA has no type for.
    """
    params = []
    for name, dtype, ndim in inputs:
        params.append(f"    const {CUDA_TYPES[_dtype_name(dtype)]}* {name}")
        if ndim > 0:
            for what, ctype in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
                if f"{name}_{what}" in body:
                    params.append(f"    const __grid_constant__ {ctype} {name}_{what}")
    params += [f"    {CUDA_TYPES[_dtype_name(d)]}* {n}" for n, d in zip(output_names, output_dtypes)]
    return _kernel(header, f"__global__ void {func_name}", params, template_lines(template),
                   body)


#: MLX's ``MAX_NDIM`` (``mlx/backend/cuda/device/config.h``): length of ``Shape`` / ``Strides``.
MAX_NDIM = 10
#: Include name of MLX's device header in the default header.
DEVICE_HEADER_NAME = "mlx/backend/cuda/device/utils.cuh"
#: Stand-in for MLX's device header (not installed with MLX's wheel: it is compiled into
#: ``libmlx.so``). It includes what MLX 0.32's includes (``config.h``, installed, where found;
#: ``cuda/std/complex`` as its ``complex.cuh`` does) and declares what the twins use of it, the
#: ``Shape`` / ``Strides`` types, plus its two float constants, so the module's globals match:
#: NVRTC then gives the same kernel code as with MLX's own header (PTX compared, MLX 0.32.4).
DEVICE_HEADER = f"""#pragma once
#if __has_include("mlx/backend/cuda/device/config.h")
#include "mlx/backend/cuda/device/config.h"
#endif
#define LIBCUDACXX_ENABLE_SIMPLIFIED_COMPLEX_OPERATIONS
#include <cuda/std/complex>
#include <cuda/std/type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
#ifndef MAX_NDIM
#define MAX_NDIM {MAX_NDIM}
#endif
namespace mlx::core::cu {{
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
constexpr float F8E4M3_MAX = 448.0f;
constexpr float F4E2M1_MAX = 6.0f;
}}  // namespace mlx::core::cu
"""


def template_tag(template, type_name=_dtype_name) -> str:
    """The template values as a name part, as MLX's ``template_arguments_hash`` writes them:
    ``_<int>``, ``_t`` / ``_f``, ``_<type_name(dtype)>`` per value (``""`` for none)."""
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append(f"_{type_name(value)}")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# The precompiled unit (``mx.fast.precompiled_cuda_kernel``)

@dataclass(frozen=True)
class Unit:
    """One kernel variant's complete CUDA source for ``precompiled_cuda_kernel``.

    Attributes:
        func_name: the ``extern "C"`` kernel's name (the cubin's symbol).
        source: the translation unit.
        shape_args: ``(input index, what)`` per rebuilt parameter, ``what`` one of ``"shape"``,
            ``"strides"``, ``"ndim"``, in scalar order (see :meth:`scalars`).
        ndims: each input's ndim (fixed by the unit: a scalar input has no shape parameters).
    """

    func_name: str
    source: str
    shape_args: tuple[tuple[int, str], ...]
    ndims: tuple[int, ...]

    def build(self, tc) -> tuple[bytes, dict]:
        """The cubin (and no extra note fields), compiled by ``tc``
        (``mlx_bricks.cuda.toolchain.Toolchain``)."""
        return tc.compile(self), {}

    def scalars(self, shapes) -> list[int]:
        """The int scalars of one launch: ``shapes`` are the inputs' shapes. Shape entries are
        ``ndim`` ints; strides (of row-contiguous inputs only) ``ndim`` (low, high) pairs of the
        int64 value; ndim one int.

        Raises:
            ValueError: an input's ndim differs from the unit's.
        """
        out: list[int] = []
        for i, what in self.shape_args:
            shape = tuple(shapes[i])
            if len(shape) != self.ndims[i]:
                raise ValueError(f"inputs[{i}] has ndim {len(shape)}, the unit {self.ndims[i]}")
            if what == "shape":
                out.extend(int(d) for d in shape)
            elif what == "strides":
                for s in row_contiguous_strides(shape):
                    lo = s & 0xFFFFFFFF
                    out.append(lo - (1 << 32) if lo >= 1 << 31 else lo)
                    out.append(s >> 32)
            else:
                out.append(len(shape))
        return out


def row_contiguous_strides(shape) -> list[int]:
    """Element strides of a row-contiguous array of ``shape`` (what MLX gives a kernel with
    ``ensure_row_contiguous=True``; a size-1 axis is never stepped along)."""
    strides, step = [], 1
    for d in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(d), 1)
    return strides[::-1]


def reads_view_strides(input_names, body: str, ensure_row_contiguous: bool) -> list[str]:
    """Inputs whose strides the body reads while MLX passes views uncopied
    (``ensure_row_contiguous=False``): such a kernel cannot be precompiled."""
    if ensure_row_contiguous:
        return []
    return [n for n in input_names if f"{n}_strides" in body]


def translation_unit(func_name: str, header: str, body: str, inputs, output_names,
                     output_dtypes, template=(), ensure_row_contiguous: bool = True) -> Unit:
    """The unit that runs ``body`` as ``mx.fast.cuda_kernel`` would, under the name
    ``func_name``, for ``precompiled_cuda_kernel`` (module docstring).

    Args:
        func_name: the kernel's C name (letters, digits, ``_``).
        header, body: as given to ``cuda_kernel``.
        inputs: ``[(name, dtype, ndim), ...]`` in launch order (dtype an ``mx.Dtype`` or its
            name).
        output_names, output_dtypes: the outputs.
        template: ``[(name, value), ...]``: int, bool or dtype.
        ensure_row_contiguous: as in ``cuda_kernel``.

    Raises:
        ValueError: a bad ``func_name``, a dtype CUDA has no type for, or a body that reads
            the strides of a view (:func:`reads_view_strides`).
    """
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", func_name):
        raise ValueError(f"func_name must be a C identifier, got {func_name!r}")
    views = reads_view_strides([n for n, _, _ in inputs], body, ensure_row_contiguous)
    if views:
        raise ValueError(f"the body reads the strides of views ({', '.join(views)}); "
                         "a precompiled kernel gets no strides")

    def ctype(dtype) -> str:
        try:
            return CUDA_TYPES[_dtype_name(dtype)]
        except KeyError:
            raise ValueError(f"no CUDA type for dtype {dtype}") from None

    params = [f"    const {ctype(d)}* {n}" for n, d, _ in inputs]
    params += [f"    {ctype(d)}* {n}" for n, d in zip(output_names, output_dtypes)]
    shape_args, locals_ = [], []
    for i, (name, _, ndim) in enumerate(inputs):
        if ndim <= 0:
            continue  # MLX passes no shape parameters for a scalar input
        if ndim > MAX_NDIM:
            raise ValueError(f"input {name!r} has ndim {ndim} > MAX_NDIM {MAX_NDIM}")
        if f"{name}_shape" in body:
            shape_args.append((i, "shape"))
            params += [f"    int {name}_shape_{j}" for j in range(ndim)]
            locals_.append(f"  Shape {name}_shape = {{}};\n" + "".join(
                f"  {name}_shape[{j}] = {name}_shape_{j};\n" for j in range(ndim)))
        if f"{name}_strides" in body:
            shape_args.append((i, "strides"))
            for j in range(ndim):
                params += [f"    int {name}_strides_lo{j}", f"    int {name}_strides_hi{j}"]
            locals_.append(f"  Strides {name}_strides = {{}};\n" + "".join(
                f"  {name}_strides[{j}] = int64_t((uint64_t(uint32_t({name}_strides_hi{j})) << 32)"
                f" | uint64_t(uint32_t({name}_strides_lo{j})));\n" for j in range(ndim)))
        if f"{name}_ndim" in body:
            shape_args.append((i, "ndim"))
            params.append(f"    int {name}_ndim_arg")
            locals_.append(f"  const int {name}_ndim = {name}_ndim_arg;\n")
    source = _kernel(header, f'extern "C" __global__ void {func_name}', params,
                     locals_ + template_lines(template, ctype), body)
    return Unit(func_name, source, tuple(shape_args), tuple(nd for _, _, nd in inputs))


# ---------------------------------------------------------------------------------------------
# The unit of MLX's own JIT disk cache, for bodies that read the strides of views

#: libstdc++'s ``std::hash<std::string>`` seed and multiplier (``std::_Hash_bytes``, 64-bit).
STD_HASH_SEED = 0xC70F6907
_MUL = 0xC6A4A7935BD1E995
_MASK = (1 << 64) - 1
#: MLX's ``get_type_string`` (``mlx/backend/common/compiled.cpp``), used in kernel names.
MLX_TYPE_STRINGS = {
    "float32": "float", "float16": "float16_t", "bfloat16": "bfloat16_t", "float64": "double",
    "complex64": "complex64_t", "bool": "bool", "int8": "int8_t", "int16": "int16_t",
    "int32": "int32_t", "int64": "int64_t", "uint8": "uint8_t", "uint16": "uint16_t",
    "uint32": "uint32_t", "uint64": "uint64_t",
}


def std_hash(data: bytes) -> int:
    """``std::hash<std::string>`` of libstdc++ on a 64-bit little-endian machine (what MLX's
    Linux wheels are built with): MurmurHash2-64A-like ``_Hash_bytes(data, len, 0xc70f6907)``."""
    n = len(data)
    h = (STD_HASH_SEED ^ (n * _MUL)) & _MASK
    aligned = n & ~7
    for (w,) in struct.iter_unpack("<Q", data[:aligned]):
        d = (w * _MUL) & _MASK
        d = ((d ^ (d >> 47)) * _MUL) & _MASK
        h = ((h ^ d) * _MUL) & _MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * _MUL) & _MASK
    h = ((h ^ (h >> 47)) * _MUL) & _MASK
    return h ^ (h >> 47)


def mlx_kernel_name(name: str, template) -> str:
    """The ``__global__`` name ``cuda_kernel(name=name)`` generates for ``template``:
    ``custom_kernel_<name>`` plus MLX's ``template_arguments_hash``."""
    return f"custom_kernel_{name}" + template_tag(
        template, lambda d: MLX_TYPE_STRINGS[_dtype_name(d)])


@dataclass(frozen=True)
class JitUnit:
    """One variant's source exactly as ``mx.fast.cuda_kernel`` builds it, compiled here for
    MLX's JIT disk cache: MLX reads ``<module>.ptx`` (the cubin) and ``<module>.txt`` (C++ name,
    tab, lowered name) for every module it loads, custom kernels included, though it writes
    none for them. ``func_name``: MLX's kernel name; ``module_name``: ``<func_name>_<hex of
    std::hash of the source>``."""

    func_name: str
    source: str

    @property
    def module_name(self) -> str:
        return f"{self.func_name}_{std_hash(self.source.encode()):x}"

    @property
    def expression(self) -> str:
        return f"mlx::core::cu::{self.func_name}"

    def build(self, tc) -> tuple[bytes, dict]:
        """The cubin and its lowered kernel name (``{"lowered": ...}``)."""
        data, lowered = tc.nvrtc.compile_named(
            self.source, tc.options, {DEVICE_HEADER_NAME: DEVICE_HEADER},
            name=f"{self.module_name}.cu", expressions=[self.expression])
        return data, {"lowered": lowered[self.expression]}


def jit_unit(stock_name: str, header: str, stock_body: str, inputs, output_names,
             output_dtypes, template=()) -> JitUnit:
    """The :class:`JitUnit` of a ``cuda_kernel(name=stock_name, source=stock_body, ...)``
    launch (``inputs``: ``[(name, dtype, ndim), ...]``)."""
    func = mlx_kernel_name(stock_name, template)
    return JitUnit(func, generated_source(func, header, stock_body, inputs, output_names,
                                          output_dtypes, template))
