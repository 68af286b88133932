"""CUDA kernels built once per machine: a persistent NVRTC build cache behind ``kernels.launch``.

``mx.fast.cuda_kernel`` compiles its source with NVRTC in every process (MLX 0.32's
``CustomKernel::eval_gpu`` asks ``get_jit_module(..., use_disk_cache=false)``), which cost a
fresh ``mlx_lm.generate --use-bricks`` about 9 s of rebuilding on an H100. This module compiles
each CUDA twin variant once per machine and loads it in later processes through
``mx.fast.precompiled_cuda_kernel``:

1. :func:`translation_unit` writes the complete source ``cuda_kernel`` would compile (MLX 0.32's
   ``build_kernel`` in ``mlx/backend/cuda/custom_kernel.cpp``: the default header, our header,
   ``namespace mlx::core::cu``, the body with the template values baked in as ``constexpr`` /
   ``using`` lines), with an ``extern "C" __global__`` signature (a precompiled kernel is looked
   up by its plain name). A precompiled kernel gets, in order, each input's and each output's
   device pointer, then the scalars; no ``<input>_shape`` / ``_strides`` / ``_ndim`` parameter.
   So those the body reads are passed as int scalars (shape entries, the int64 strides as low
   and high halves, ndim) and rebuilt in the kernel as the same ``Shape`` / ``Strides`` / ``int``
   locals, zero-padded to ``MAX_NDIM`` as MLX pads them.
2. :func:`compile_unit` compiles it with NVRTC through ``ctypes`` (the ``libnvrtc`` MLX itself
   loaded, else the ``nvidia-cuda-nvrtc`` wheel's, else the CUDA toolkit's) with MLX's options:
   ``--device-as-default-execution-space``, ``--gpu-architecture=sm_<cc>`` plus ``a`` for compute
   capability 9 and up, include paths of MLX's ``include/`` and ``include/cccl`` and the CUDA
   headers (``nvidia/cu13/include`` beside MLX, else ``$CUDA_HOME``/``$CUDA_PATH``/
   ``/usr/local/cuda``), to a cubin. MLX's own device headers are not installed with its wheel
   (they live inside ``libmlx.so``), so ``mlx/backend/cuda/device/utils.cuh`` is given to NVRTC as
   an in-memory header declaring what the twins use of it (:data:`DEVICE_HEADER`).
3. The cubin is stored under ``<mlx-bricks home>/cuda/<toolchain>/<kernel>/`` (toolchain: MLX
   version, NVRTC version, architecture), named by the template values and a SHA-256 of the
   whole unit, the NVRTC options and the in-memory header, with a JSON note (SHA-256 of the
   cubin, compile seconds) written last, so a half-written entry is never read.

Bodies that read ``<input>_strides`` with ``ensure_row_contiguous=False`` (attention, decode
attention: views without a copy) cannot be precompiled: a lazy array's strides are known only
when MLX evaluates it, and a precompiled kernel gets none. For them the exact source
``cuda_kernel`` builds (:class:`JitUnit`) is compiled once per machine the same way and put
where MLX's JIT looks before compiling (MLX 0.32's ``JitModule`` reads
``<MLX_PTX_CACHE_DIR or /tmp/mlx/<version>/ptx>/<module>.ptx`` and ``.txt`` for every module,
custom kernels included, though it writes none for custom kernels). The module name is
``<kernel name>_<hex std::hash of the source>``; :func:`std_hash` is libstdc++'s, which MLX's
Linux wheels use. If the name ever differs, MLX simply does not find the file and compiles as
before.

Any failure (no GPU, no ``libnvrtc``, a compile error, an unreadable entry) falls back to
``mx.fast.cuda_kernel`` as before, with a one-line note on stderr, once per cause. Set
``MLX_BRICKS_CUDA_CACHE=0`` to turn the cache off, ``=precompiled`` to load through
``precompiled_cuda_kernel`` (the default, ``mlx``, sends every kernel through MLX's JIT cache;
:func:`mode`). A cubin that fails to load surfaces when
MLX evaluates the launch, where the dispatch guard (``runtime/guard.py``) catches it.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import struct
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from mlx_bricks import home as _home
from mlx_bricks.cudacheck import CUDA_TYPES, DEFAULT_HEADER, template_lines

#: Environment switch: ``0`` / ``off`` / ``false`` / ``no`` turn the build cache off.
ENV_VAR = "MLX_BRICKS_CUDA_CACHE"
#: Environment variable naming a ``libnvrtc`` to use (as ``mlx_bricks.cudacheck`` reads it).
NVRTC_ENV_VAR = "MLX_BRICKS_NVRTC"
#: Bumped when the unit's layout or the entry format changes (old entries are then not read).
FORMAT = 1
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

#: Seconds each kernel variant's first call took to build in this process, by
#: ``(kernel, template tag)``: the NVRTC compile on a miss, the read of the entry on a hit.
BUILD_SECONDS: dict[tuple[str, str], float] = {}
#: How each cached variant was obtained in this process: ``"compiled"`` or ``"loaded"``, by
#: ``(kernel, template tag)``.
BUILD_SOURCES: dict[tuple[str, str], str] = {}

#: Which way each variant runs in this process, by ``(kernel, template tag)``:
#: ``"precompiled"``, ``"mlx-cache"`` or ``"cuda_kernel"`` (:class:`CudaKernel`).
BUILD_ROUTES: dict[tuple[str, str], str] = {}

_NOTED: set[str] = set()


class Unavailable(RuntimeError):
    """The cache cannot serve here (no GPU, no libnvrtc, ...); the message says why."""


class CompileError(RuntimeError):
    """NVRTC rejected a unit; the message holds its log."""


def mode() -> str:
    """``$MLX_BRICKS_CUDA_CACHE``, read at each call: ``"off"`` (``0`` / ``off`` / ``false`` /
    ``no``: ``mx.fast.cuda_kernel`` as before), ``"precompiled"`` (``precompiled_cuda_kernel``
    where it can run the kernel: it copies and hashes the cubin at every launch, unmeasured) or
    ``"mlx"`` (anything else, the default: every kernel through MLX's JIT disk cache, as the view
    kernels go: ``cuda_kernel``'s own launch path, no per-launch cost of ours)."""
    v = os.environ.get(ENV_VAR, "mlx").strip().lower()
    if v in ("0", "off", "false", "no"):
        return "off"
    return "precompiled" if v == "precompiled" else "mlx"


def enabled() -> bool:
    """Whether the build cache is on (:func:`mode` is not ``"off"``)."""
    return mode() != "off"


def note(key: str, message: str) -> None:
    """Print ``message`` on stderr once per ``key`` in this process."""
    if key not in _NOTED:
        _NOTED.add(key)
        print(f"mlx-bricks: {message}", file=sys.stderr)


def _mx():
    import mlx.core as mx

    return mx


def _dtype_name(dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def template_tag(template) -> str:
    """The template values as a name part, as MLX's ``template_arguments_hash`` writes them:
    ``_<int>``, ``_t`` / ``_f``, ``_<dtype>`` per value (``""`` for none)."""
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append(f"_{_dtype_name(value)}")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# The translation unit

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

    def build(self, tc: "Toolchain") -> tuple[bytes, dict]:
        """The cubin (and no extra note fields)."""
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
    consts = template_lines(template, ctype)
    source = "".join([
        DEFAULT_HEADER, header,
        "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
        f'extern "C" __global__ void {func_name}(\n', ",\n".join(params), ") {\n",
        *locals_, *consts, body, "\n}\n\n} // namespace mlx::core::cu\n",
    ])
    return Unit(func_name, source, tuple(shape_args), tuple(nd for _, _, nd in inputs))


# ---------------------------------------------------------------------------------------------
# NVRTC through ctypes

def _loaded_nvrtc() -> str | None:
    """Path of a ``libnvrtc`` already mapped into this process (MLX's own), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if re.search(r"/libnvrtc\.so[.0-9]*$", path):
                    return path
    except OSError:
        pass
    return None


def find_nvrtc() -> str | None:
    """The ``libnvrtc`` to compile with: ``$MLX_BRICKS_NVRTC``, the one MLX loaded, the
    ``nvidia-cuda-nvrtc`` wheel's on ``sys.path``, then the CUDA toolkit's (``$CUDA_HOME``,
    ``$CUDA_PATH``, ``/usr/local/cuda``); None if none is found."""
    env = os.environ.get(NVRTC_ENV_VAR)
    if env:
        return env if Path(env).is_file() else None
    loaded = _loaded_nvrtc()
    if loaded:
        return loaded
    for entry in sys.path:
        for sub in ("cu13", "cuda_nvrtc"):
            for p in sorted((Path(entry or ".") / "nvidia" / sub / "lib").glob("libnvrtc.so*")):
                if "alt" not in p.name and "builtins" not in p.name:
                    return str(p)
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            for p in sorted(Path(root, "lib64").glob("libnvrtc.so*")):
                if "builtins" not in p.name:
                    return str(p)
    return None


class Nvrtc:
    """A loaded ``libnvrtc`` (path, ``version`` as ``(major, minor)``)."""

    def __init__(self, path: str):
        # libnvrtc opens libnvrtc-builtins by name; the wheel's directory is on no loader path.
        for b in sorted(Path(path).parent.glob("libnvrtc-builtins.so*")):
            if "alt" not in b.name:
                ctypes.CDLL(str(b), mode=ctypes.RTLD_GLOBAL)
                break
        self.path = path
        lib = self.lib = ctypes.CDLL(path)
        P, S, I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [I]
        for fn, args in (
            ("nvrtcVersion", [ctypes.POINTER(I), ctypes.POINTER(I)]),
            ("nvrtcCreateProgram", [ctypes.POINTER(P), ctypes.c_char_p, ctypes.c_char_p, I,
                                    ctypes.POINTER(ctypes.c_char_p),
                                    ctypes.POINTER(ctypes.c_char_p)]),
            ("nvrtcCompileProgram", [P, I, ctypes.POINTER(ctypes.c_char_p)]),
            ("nvrtcDestroyProgram", [ctypes.POINTER(P)]),
            ("nvrtcGetProgramLogSize", [P, ctypes.POINTER(S)]),
            ("nvrtcGetProgramLog", [P, ctypes.c_char_p]),
            ("nvrtcGetCUBINSize", [P, ctypes.POINTER(S)]),
            ("nvrtcGetCUBIN", [P, ctypes.c_char_p]),
            ("nvrtcGetPTXSize", [P, ctypes.POINTER(S)]),
            ("nvrtcGetPTX", [P, ctypes.c_char_p]),
            ("nvrtcAddNameExpression", [P, ctypes.c_char_p]),
            ("nvrtcGetLoweredName", [P, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]),
        ):
            getattr(lib, fn).argtypes = args
            getattr(lib, fn).restype = I
        major, minor = I(), I()
        self._check(lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise CompileError(f"{what} failed: {self.lib.nvrtcGetErrorString(rc).decode()}")

    def compile(self, source: str, options, headers: dict[str, str] | None = None,
                name: str = "kernel.cu", ptx: bool = False) -> bytes:
        """Compile ``source`` with ``options`` (and in-memory ``headers``: include name to
        text); the cubin (the PTX with ``ptx=True``).

        Raises:
            CompileError: NVRTC failed (message: its log).
        """
        return self.compile_named(source, options, headers, name, ptx)[0]

    def compile_named(self, source: str, options, headers: dict[str, str] | None = None,
                      name: str = "kernel.cu", ptx: bool = False, expressions=()
                      ) -> tuple[bytes, dict[str, str]]:
        """As :meth:`compile`, also returning the lowered (mangled) name of each of
        ``expressions`` (C++ names of ``__global__`` functions, as MLX asks for them)."""
        lib, P = self.lib, ctypes.c_void_p
        headers = headers or {}
        hs = (ctypes.c_char_p * max(len(headers), 1))(*(t.encode() for t in headers.values()))
        ns = (ctypes.c_char_p * max(len(headers), 1))(*(n.encode() for n in headers))
        prog = P()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                           len(headers), hs, ns), "nvrtcCreateProgram")
        try:
            for e in expressions:
                self._check(lib.nvrtcAddNameExpression(prog, e.encode()),
                            "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            rc = lib.nvrtcCompileProgram(prog, len(options), opts)
            if rc != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                raise CompileError(f"NVRTC failed ({lib.nvrtcGetErrorString(rc).decode()}):\n"
                                   f"{log.value.decode(errors='replace')[-6000:]}")
            get_size, get = ((lib.nvrtcGetPTXSize, lib.nvrtcGetPTX) if ptx else
                             (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN))
            size = ctypes.c_size_t()
            self._check(get_size(prog, ctypes.byref(size)), "nvrtcGet*Size")
            buf = ctypes.create_string_buffer(size.value)
            self._check(get(prog, buf), "nvrtcGet*")
            lowered = {}
            for e in expressions:
                out = ctypes.c_char_p()
                self._check(lib.nvrtcGetLoweredName(prog, e.encode(), ctypes.byref(out)),
                            "nvrtcGetLoweredName")
                lowered[e] = out.value.decode()
            return buf.raw, lowered
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def arch_option(cc: tuple[int, int]) -> str:
    """MLX's ``--gpu-architecture`` for compute capability ``cc``: ``sm_<major><minor>``, with
    ``a`` (architecture-specific features, e.g. wgmma) from major 9 on."""
    return f"--gpu-architecture=sm_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}"


def include_options(nvrtc_major: int, mlx_root: Path | None = None) -> list[str]:
    """MLX's NVRTC include paths (``include_path_args`` in ``jit_module.cpp``): MLX's
    ``include/`` and ``include/cccl``, then the CUDA runtime headers: ``nvidia/cu13/include``
    (``cuda_runtime`` before CUDA 13) beside MLX, else ``$CUDA_HOME``, ``$CUDA_PATH`` or
    ``/usr/local/cuda``'s ``include``. Where MLX brings no ``cccl`` (its CPU wheel, in tests),
    the toolkit's ``include/cccl`` is added, as nvcc would."""
    if mlx_root is None:
        import mlx.core as mx

        mlx_root = Path(mx.__file__).resolve().parent
    opts = []
    inc = mlx_root / "include"
    if inc.is_dir():
        opts.append(f"--include-path={inc}")
    has_cccl = (inc / "cccl").is_dir()
    if has_cccl:
        opts.append(f"--include-path={inc / 'cccl'}")
    sub = "cu13" if nvrtc_major >= 13 else "cuda_runtime"
    cudart = mlx_root.parent / "nvidia" / sub / "include"
    if not cudart.is_dir():
        root = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        cudart = Path(root) / "include"
    if cudart.is_dir():
        opts.append(f"--include-path={cudart}")
        if not has_cccl and (cudart / "cccl").is_dir():
            opts.append(f"--include-path={cudart / 'cccl'}")
    return opts


@dataclass(frozen=True)
class Toolchain:
    """What a build depends on besides the source: the NVRTC library and version, the device's
    compute capability, MLX's version and the NVRTC options."""

    nvrtc: Nvrtc
    cc: tuple[int, int]
    mlx_version: str
    options: tuple[str, ...]

    @property
    def tag(self) -> str:
        """Directory name of this toolchain's entries."""
        arch = self.options[1].split("=", 1)[1]
        return f"mlx{self.mlx_version}-nvrtc{self.nvrtc.version[0]}.{self.nvrtc.version[1]}-{arch}"

    def compile(self, unit: Unit) -> bytes:
        """``unit`` compiled to a cubin (see :func:`compile_unit`)."""
        return self.nvrtc.compile(unit.source, self.options, {DEVICE_HEADER_NAME: DEVICE_HEADER},
                                  name=f"{unit.func_name}.cu")


def make_toolchain(cc: tuple[int, int], nvrtc_path: str | None = None,
                   mlx_root: Path | None = None) -> Toolchain:
    """The toolchain for a device of compute capability ``cc``.

    Raises:
        Unavailable: no libnvrtc, or it fails to load.
    """
    import mlx.core as mx

    path = nvrtc_path or find_nvrtc()
    if path is None:
        raise Unavailable("no libnvrtc found (install nvidia-cuda-nvrtc, or set MLX_BRICKS_NVRTC)")
    try:
        nv = Nvrtc(path)
    except (OSError, AttributeError, CompileError) as e:
        raise Unavailable(f"libnvrtc at {path} did not load: {e}") from None
    opts = ("--device-as-default-execution-space", arch_option(cc),
            *include_options(nv.version[0], mlx_root))
    return Toolchain(nv, tuple(cc), mx.__version__, opts)


@lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    """This process's toolchain (the default CUDA device).

    Raises:
        Unavailable: no CUDA device or no libnvrtc.
    """
    from mlx_bricks.backends import cuda_capability

    cc = cuda_capability()
    if cc is None:
        raise Unavailable("no CUDA device")
    return make_toolchain(cc)


def compile_unit(unit: Unit, tc: Toolchain) -> bytes:
    """``unit`` compiled by ``tc``'s NVRTC with MLX's options; the cubin.

    Raises:
        CompileError: NVRTC failed.
    """
    return tc.compile(unit)


# ---------------------------------------------------------------------------------------------
# The disk cache

def cache_root(override=None) -> Path:
    """``<mlx-bricks home>/cuda``: every toolchain's entries."""
    return _home.home(override) / "cuda"


def entry_key(unit, tc: Toolchain) -> str:
    """SHA-256 (hex) of everything the cubin depends on: the unit (its kind and source), the
    in-memory device header, the NVRTC options and version, MLX's version and the entry
    format."""
    h = hashlib.sha256()
    for part in (f"format {FORMAT}", type(unit).__name__, unit.source, DEVICE_HEADER,
                 "\0".join(tc.options), f"nvrtc {tc.nvrtc.version}", f"mlx {tc.mlx_version}"):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def entry_paths(kernel: str, tag: str, key: str, tc: Toolchain, root=None) -> tuple[Path, Path]:
    """``(cubin, note)`` paths of one entry."""
    d = cache_root(root) / tc.tag / kernel
    stem = f"{tag.lstrip('_') or 'none'}-{key[:16]}"
    return d / f"{stem}.cubin", d / f"{stem}.json"


def read_entry(cubin_path: Path, note_path: Path) -> tuple[bytes, dict] | None:
    """``(cubin, note)`` of a complete, intact entry, else None."""
    try:
        meta = json.loads(note_path.read_text())
        data = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    if meta.get("sha256") != hashlib.sha256(data).hexdigest() or not data.startswith(b"\x7fELF"):
        return None
    return data, meta


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_entry(cubin_path: Path, note_path: Path, cubin: bytes, seconds: float,
                unit, extra: dict | None = None) -> dict:
    """Store an entry: the cubin, then its note (so a reader never sees half of it); the
    note."""
    cubin_path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(cubin_path, cubin)
    meta = {"sha256": hashlib.sha256(cubin).hexdigest(), "compile_seconds": round(seconds, 4),
            "func_name": unit.func_name, "format": FORMAT, **(extra or {})}
    _write_atomic(note_path, json.dumps(meta).encode())
    return meta


def load_or_build(kernel: str, tag: str, unit, tc: Toolchain, root=None
                  ) -> tuple[bytes, float, str, dict]:
    """``(cubin, seconds, how, note)`` of ``unit`` (a :class:`Unit` or :class:`JitUnit`): read
    from the cache (``how`` ``"loaded"``) or compiled now and stored (``"compiled"``);
    ``seconds``: wall time of this step; ``note``: the entry's JSON fields.

    Raises:
        CompileError: NVRTC failed. A failed write is noted and the cubin still returned.
    """
    t0 = time.perf_counter()
    key = entry_key(unit, tc)
    cubin_path, note_path = entry_paths(kernel, tag, key, tc, root)
    found = read_entry(cubin_path, note_path)
    if found is not None:
        return found[0], time.perf_counter() - t0, "loaded", found[1]
    data, extra = unit.build(tc)
    seconds = time.perf_counter() - t0
    meta = {"func_name": unit.func_name, **extra}
    try:
        meta = write_entry(cubin_path, note_path, data, seconds, unit, extra)
    except OSError as e:
        note(f"write:{cubin_path.parent}", f"CUDA build cache not written ({e}); "
             "kernels are rebuilt in the next process")
    return data, seconds, "compiled", meta


# ---------------------------------------------------------------------------------------------
# MLX's own JIT cache, for bodies that read the strides of views

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
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append(f"_{MLX_TYPE_STRINGS[_dtype_name(value)]}")
    return f"custom_kernel_{name}{''.join(parts)}"


def mlx_ptx_cache_dir() -> Path:
    """MLX's JIT disk cache (``ptx_cache_dir`` in ``jit_module.cpp``): ``$MLX_PTX_CACHE_DIR``,
    else ``<temp dir>/mlx/<MLX version>/ptx`` (temp dir as ``std::filesystem::
    temp_directory_path``: ``$TMPDIR``, ``$TMP``, ``$TEMP``, ``$TEMPDIR``, else ``/tmp``)."""
    import mlx.core as mx

    env = os.environ.get("MLX_PTX_CACHE_DIR")
    if env:
        return Path(env)
    tmp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR")
                if os.environ.get(v)), "/tmp")
    return Path(tmp) / "mlx" / mx.__version__ / "ptx"


def mlx_ptx_path(cache_dir: Path, module_name: str) -> Path:
    """MLX's file of ``module_name`` (``get_ptx_path``: names over 245 characters are cut into
    directories of 245)."""
    path, rest = Path(cache_dir), module_name
    while len(rest) > 245:
        path, rest = path / rest[:245], rest[245:]
    return path / f"{rest}.ptx"


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

    def build(self, tc: Toolchain) -> tuple[bytes, dict]:
        """The cubin and its lowered kernel name (``{"lowered": ...}``)."""
        data, lowered = tc.nvrtc.compile_named(
            self.source, tc.options, {DEVICE_HEADER_NAME: DEVICE_HEADER},
            name=f"{self.module_name}.cu", expressions=[self.expression])
        return data, {"lowered": lowered[self.expression]}


def jit_unit(stock_name: str, header: str, stock_body: str, inputs, output_names,
             output_dtypes, template=()) -> JitUnit:
    """The :class:`JitUnit` of a ``cuda_kernel(name=stock_name, source=stock_body, ...)``
    launch (``inputs``: ``[(name, dtype, ndim), ...]``)."""
    from mlx_bricks.cudacheck import generated_source

    func = mlx_kernel_name(stock_name, template)
    return JitUnit(func, generated_source(func, header, stock_body, inputs, output_names,
                                          output_dtypes, template))


def seed_mlx_cache(unit: JitUnit, cubin: bytes, lowered: str, cache_dir: Path | None = None
                   ) -> Path:
    """Put ``cubin`` where MLX's JIT looks for ``unit``'s module (the name file first, so MLX
    never reads a cubin without it); returns the ``.ptx`` path. Nothing is written when the
    same cubin is there already.

    Raises:
        OSError: the directory is not writable.
    """
    ptx = mlx_ptx_path(cache_dir or mlx_ptx_cache_dir(), unit.module_name)
    try:
        if ptx.read_bytes() == cubin:
            return ptx
    except OSError:
        pass
    ptx.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(ptx.with_suffix(".txt"), f"{unit.expression}\t{lowered}\n".encode())
    _write_atomic(ptx, cubin)
    return ptx


# ---------------------------------------------------------------------------------------------
# Questions for the tuner

def _match(kernel: str, template) -> list[tuple[str, str]]:
    tag = None if template is None else template_tag(template)
    return [k for k in BUILD_SECONDS if k[0] == kernel and (tag is None or k[1] == tag)]


def build_cost(kernel: str, template=None) -> float | None:
    """Seconds this process spent building kernel ``kernel`` (a registered name) at its first
    calls: the variant of ``template`` (``[(name, value), ...]`` as given to ``launch``), or
    every variant built so far summed; None when none was built here through the cache (MLX's
    own ``cuda_kernel`` compiles lazily, at evaluation, where it is not measured)."""
    keys = _match(kernel, template)
    return sum(BUILD_SECONDS[k] for k in keys) if keys else None


def is_built(kernel: str, template=None, root=None) -> bool:
    """Whether a variant of kernel ``kernel`` (of ``template``, if given) is on disk for this
    process's toolchain, so a new process loads it instead of compiling. False without a CUDA
    device or libnvrtc, or with the cache off."""
    if not enabled():
        return False
    try:
        tc = toolchain()
    except Unavailable:
        return False
    d = cache_root(root) / tc.tag / kernel
    stem = None if template is None else template_tag(template).lstrip("_") or "none"
    pattern = "*.json" if stem is None else f"{stem}-*.json"
    return any(p.with_suffix(".cubin").is_file() for p in d.glob(pattern))


# ---------------------------------------------------------------------------------------------
# The kernel object behind kernels.launch

class CudaKernel:
    """The ``cuda`` kernel object of one registered spec and dynamic shared-memory size, called
    like an ``mx.fast.cuda_kernel`` object. Each variant (template values, input dtypes and
    ndims, output dtypes) is compiled once per machine (:func:`load_or_build`) and then

    * ``precompiled``: run through ``mx.fast.precompiled_cuda_kernel`` (:class:`Unit`), or,
      for a body that reads the strides of views,
    * ``mlx-cache``: put where MLX's JIT looks for it (:class:`JitUnit`,
      :func:`seed_mlx_cache`) and run by the ``mx.fast.cuda_kernel`` object, which then loads it
      instead of compiling;

    or, when neither can serve, run by the ``mx.fast.cuda_kernel`` object as before.

    Args:
        kernel: the registered name (``mlx_bricks.kernels``).
        kname: the unique kernel name (``kernels.kernel_source``).
        header, body: the twin's sources.
        input_names, output_names, ensure_row_contiguous: as in ``cuda_kernel``.
        shared_memory: dynamic shared memory of every launch, bytes (part of the kernel's name:
            MLX sets a function's shared-memory limit once, at its first launch).
        stock_name, stock_body: ``name`` and ``source`` of the ``cuda_kernel`` object.
        stock: zero-argument factory of that ``mx.fast.cuda_kernel`` object.
    """

    def __init__(self, kernel: str, kname: str, header: str, body: str, input_names,
                 output_names, ensure_row_contiguous: bool, shared_memory: int,
                 stock_name: str, stock_body: str, stock):
        self.kernel, self.kname, self.header, self.body = kernel, kname, header, body
        self.input_names, self.output_names = tuple(input_names), tuple(output_names)
        self.ensure_row_contiguous = ensure_row_contiguous
        self.shared_memory = shared_memory
        self.stock_name, self.stock_body = stock_name, stock_body
        self._stock_factory, self._stock = stock, None
        #: variant key -> (Unit, cubin), or None (run by the cuda_kernel object)
        self.variants: dict = {}

    def stock(self):
        """The ``mx.fast.cuda_kernel`` object (built once)."""
        if self._stock is None:
            self._stock = self._stock_factory()
        return self._stock

    def unit(self, template, inputs, output_dtypes, route: str = "precompiled"):
        """The unit of one variant: a :class:`JitUnit` when the body reads the strides of
        views or ``route`` is ``"mlx"``, else a :class:`Unit`; ``inputs``:
        ``[(dtype, ndim), ...]``.

        Raises:
            ValueError: see :func:`translation_unit`.
        """
        ins = [(n, d, nd) for n, (d, nd) in zip(self.input_names, inputs)]
        if route == "mlx" or reads_view_strides(self.input_names, self.body,
                                                self.ensure_row_contiguous):
            return jit_unit(self.stock_name, self.header, self.stock_body, ins,
                            self.output_names, output_dtypes, template)
        smem = f"_smem{self.shared_memory}" if self.shared_memory else ""
        return translation_unit(f"{self.kname}{template_tag(template)}{smem}", self.header,
                                self.body, ins, self.output_names, output_dtypes, template,
                                self.ensure_row_contiguous)

    def _variant(self, template, arrays, output_dtypes, route):
        tag = template_tag(template)
        rec = (self.kernel, tag)
        BUILD_ROUTES[rec] = "cuda_kernel"
        try:
            tc = toolchain()
        except Unavailable as e:
            note("toolchain", f"CUDA build cache off: {e}; kernels are built by "
                 "mx.fast.cuda_kernel in each process")
            return None
        try:
            unit = self.unit(template, [(a.dtype, a.ndim) for a in arrays], output_dtypes,
                             route)
            if isinstance(unit, Unit) and not hasattr(_mx().fast, "precompiled_cuda_kernel"):
                note("precompiled", "this MLX has no mx.fast.precompiled_cuda_kernel; kernels "
                     "are built by mx.fast.cuda_kernel in each process")
                return None
            cubin, seconds, how, meta = load_or_build(self.kernel, tag, unit, tc)
            if isinstance(unit, JitUnit):
                seed_mlx_cache(unit, cubin, meta["lowered"])
        except (ValueError, KeyError, CompileError, OSError) as e:
            text = str(e).strip()
            first = text.splitlines()[0] if text else type(e).__name__
            note(f"build:{self.kernel}{tag}", f"CUDA kernel {self.kernel}{tag} not cached "
                 f"({first}); built by mx.fast.cuda_kernel")
            return None
        BUILD_SECONDS[rec] = BUILD_SECONDS.get(rec, 0.0) + seconds
        BUILD_SOURCES[rec] = how
        if isinstance(unit, JitUnit):
            BUILD_ROUTES[rec] = "mlx-cache"
            return None
        BUILD_ROUTES[rec] = "precompiled"
        return unit, cubin

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=(), init_value=None, verbose=False, stream=None):
        kw = dict(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                  grid=grid, threadgroup=threadgroup, template=template,
                  init_value=init_value, verbose=verbose, stream=stream)
        route = mode()
        if route == "off":
            return self.stock()(**kw)
        import mlx.core as mx

        arrays = [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]
        key = (route, tuple((n, v if isinstance(v, (bool, int)) else _dtype_name(v))
                            for n, v in template),
               tuple((a.dtype, a.ndim) for a in arrays), tuple(output_dtypes))
        if key not in self.variants:
            self.variants[key] = self._variant(template, arrays, output_dtypes, route)
        found = self.variants[key]
        if found is None:
            return self.stock()(**kw)
        unit, cubin = found
        return mx.fast.precompiled_cuda_kernel(
            name=unit.func_name, compiled_source=cubin, inputs=arrays,
            output_shapes=[tuple(s) for s in output_shapes], output_dtypes=list(output_dtypes),
            scalars=unit.scalars([a.shape for a in arrays]), grid=tuple(grid),
            threadgroup=tuple(threadgroup), shared_memory=self.shared_memory,
            init_value=init_value, ensure_row_contiguous=self.ensure_row_contiguous,
            stream=stream)


# ---------------------------------------------------------------------------------------------
# Building ahead, in parallel

def _build_entry(args) -> tuple[str, str, float, str]:
    """Worker of :func:`prebuild` (a fresh process: NVRTC only, no CUDA context)."""
    kernel, tag, unit, nvrtc_path, cc, mlx_version, options, root = args
    tc = Toolchain(Nvrtc(nvrtc_path), cc, mlx_version, options)
    try:
        _, seconds, how, _ = load_or_build(kernel, tag, unit, tc, root)
    except CompileError as e:
        return kernel, tag, 0.0, f"error: {str(e).strip().splitlines()[0]}"
    return kernel, tag, seconds, how


def prebuild(launches, workers: int | None = None, root=None) -> list[tuple[str, str, float, str]]:
    """Compile the variants of ``launches`` that are not on disk yet, ``workers`` at a time in
    separate processes (NVRTC is CPU-bound); later launches then load them. ``launches``:
    objects with ``name``, ``inputs`` (``[(dtype, ndim), ...]``), ``output_dtypes``,
    ``template``, ``shared_memory`` (``mlx_bricks.cudacheck.Launch``, e.g. from
    ``cudacheck.recorded_launches``). Returns ``(kernel, template tag, seconds, how)`` per
    distinct variant, ``how`` ``"loaded"`` (on disk already), ``"compiled"`` or
    ``"error: ..."``.

    Raises:
        Unavailable: no CUDA device or libnvrtc.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from mlx_bricks import kernels

    tc = toolchain()
    jobs, seen = [], set()
    for rec in launches:
        obj = kernels.get_kernel(rec.name, "cuda", rec.shared_memory)
        unit = obj.unit(rec.template, rec.inputs, rec.output_dtypes, mode())
        tag = template_tag(rec.template)
        key = entry_key(unit, tc)
        if key in seen:
            continue
        seen.add(key)
        jobs.append((rec.name, tag, unit, tc.nvrtc.path, tc.cc, tc.mlx_version, tc.options,
                     root))
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1, mp_context=ctx) as ex:
        return list(ex.map(_build_entry, jobs))
