"""The compiler the build cache uses, as MLX's JIT uses it: NVRTC through ``ctypes``, MLX's
options, and the device they target.

:class:`Nvrtc` loads the ``libnvrtc`` MLX itself loaded, else the ``nvidia-cuda-nvrtc`` wheel's,
else the CUDA toolkit's (:func:`find_nvrtc`). :func:`make_toolchain` gives MLX's options:
``--device-as-default-execution-space``, ``--gpu-architecture=sm_<cc>`` plus ``a`` from compute
capability 9 on, include paths of MLX's ``include/`` and ``include/cccl`` and the CUDA headers
(``nvidia/cu13/include`` beside MLX, else ``$CUDA_HOME`` / ``$CUDA_PATH`` / ``/usr/local/cuda``).
MLX's own device headers are not installed with its wheel (they live inside ``libmlx.so``), so
``mlx/backend/cuda/device/utils.cuh`` is given to NVRTC as an in-memory header
(``source.DEVICE_HEADER``).
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from mlx_bricks import env
from mlx_bricks.cuda.source import DEVICE_HEADER, DEVICE_HEADER_NAME

#: Environment variable naming a ``libnvrtc`` to use.
NVRTC_ENV_VAR = "MLX_BRICKS_NVRTC"


class Unavailable(RuntimeError):
    """The build cache cannot serve here (no GPU, no libnvrtc, ...); the message says why."""


class CompileError(RuntimeError):
    """NVRTC rejected a unit; the message holds its log."""


#: Oldest compute capability the CUDA twins are built for (mma.sync bf16 needs sm_80).
MIN_CUDA_CAPABILITY = (8, 0)


@functools.lru_cache(maxsize=1)
def cuda_capability() -> tuple[int, int] | None:
    """``(major, minor)`` of the default CUDA device as MLX reports it, or None without one.
    Asked once per process (``mx.device_info`` costs ~12 us and the GEMM twins ask per launch);
    ``cuda_capability.cache_clear()`` forgets it."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return None
    info = mx.device_info(mx.gpu)
    try:
        return int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    except (KeyError, TypeError, ValueError):
        return None


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
    ``$CUDA_PATH``, ``/usr/local/cuda``); None if none is found.

    Raises:
        Unavailable: ``$MLX_BRICKS_NVRTC`` names no file.
    """
    try:
        path = env.get(NVRTC_ENV_VAR)
    except env.EnvError as e:
        raise Unavailable(str(e)) from None
    if path:
        return path
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

    def compile(self, unit) -> bytes:
        """``unit`` (a ``source.Unit``) compiled to a cubin with the in-memory device header."""
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


def compile_unit(unit, tc: Toolchain) -> bytes:
    """``unit`` compiled by ``tc``'s NVRTC with MLX's options; the cubin.

    Raises:
        CompileError: NVRTC failed.
    """
    return tc.compile(unit)
