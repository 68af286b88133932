"""Compile checks for the CUDA twins without a GPU: the source MLX would build, through nvcc.

``mx.fast.cuda_kernel`` wraps a body in a generated ``__global__`` signature (MLX 0.32's
``build_kernel`` in ``mlx/backend/cuda/custom_kernel.cpp``: inputs as ``const T*`` plus
``<name>_shape`` / ``_strides`` / ``_ndim`` parameters when the body mentions them, outputs as
``T*``, template arguments as ``constexpr`` / ``using`` lines) and compiles it with NVRTC for the
device (``sm_90a`` on an H100/H200). :func:`twin_source` gives that text for a registered
kernel (``mlx_bricks.cuda.source.generated_source`` writes it, as the build cache does) and
:func:`compile_twin` compiles it with ``nvcc -cubin`` for a chosen architecture, returning the
resource report of ``ptxas -v`` (registers, spills, stack, shared memory);
:func:`compile_source_nvrtc` compiles it with NVRTC itself where ``libnvrtc`` is at hand (the
``nvidia-cuda-nvrtc`` wheel, or ``$MLX_BRICKS_NVRTC``).

It proves the twins compile and stay out of local memory on a machine with only the CUDA
toolkit (CI); whether they run correctly and fast is measured on the GPU machine. Headers MLX
provides are replaced by the stand-in in ``shim/`` (types only).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mlx_bricks import kernels
from mlx_bricks.cuda import toolchain as _toolchain
from mlx_bricks.cuda.source import (  # noqa: F401  (MLX's generator, re-exported)
    CUDA_TYPES,
    DEFAULT_HEADER,
    generated_source,
    template_lines,
)

SHIM_DIR = Path(__file__).resolve().parent / "shim"


@dataclass(frozen=True)
class Resources:
    """``ptxas -v`` report of one kernel: registers per thread, spill bytes, stack frame bytes
    and static shared memory bytes; ``perf_notes``: ptxas's "Potential Performance Loss" lines
    (e.g. wgmma instructions serialized)."""

    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    smem: int
    perf_notes: tuple = ()


def find_nvcc() -> str | None:
    """Path of nvcc (``$NVCC``, PATH, then ``/usr/local/cuda*/bin``), or None."""
    cand = os.environ.get("NVCC") or shutil.which("nvcc")
    if cand:
        return cand
    for root in sorted(Path("/usr/local").glob("cuda*"), reverse=True):
        p = root / "bin" / "nvcc"
        if p.is_file():
            return str(p)
    return None


_REG = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> Resources:
    """Resources of the (one) kernel in a ``ptxas -v`` log."""
    reg = _REG.search(log)
    spill = _SPILL.search(log)
    smem = _SMEM.search(log)
    return Resources(
        registers=int(reg.group(1)) if reg else 0,
        stack=int(spill.group(1)) if spill else 0,
        spill_stores=int(spill.group(2)) if spill else 0,
        spill_loads=int(spill.group(3)) if spill else 0,
        smem=int(smem.group(1)) if smem else 0,
        perf_notes=tuple(line.strip() for line in log.splitlines()
                         if "Potential Performance Loss" in line),
    )


class CompileError(RuntimeError):
    """nvcc rejected a generated source; the message holds its log."""


def compile_source(source: str, arch: str = "sm_90a", nvcc: str | None = None) -> Resources:
    """Compile ``source`` to a cubin for ``arch`` and return its resources.

    Raises:
        FileNotFoundError: no nvcc.
        CompileError: the compile failed (message: nvcc's log).
    """
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set NVCC or put the CUDA toolkit on PATH)")
    num = arch.removeprefix("sm_")
    gencode = f"-gencode=arch=compute_{num},code=sm_{num}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.cu"
        src.write_text(source)
        cmd = [nvcc, "-std=c++17", gencode, "-cubin", "-Xptxas", "-v", "-I", str(SHIM_DIR),
               "-o", str(Path(tmp) / "kernel.cubin"), str(src)]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise CompileError(f"nvcc failed for {arch}:\n{res.stderr[-6000:]}")
    return parse_ptxas(res.stderr)


def twin_source(name: str, inputs, output_dtypes, template=()) -> str:
    """The source ``mx.fast.cuda_kernel`` builds for the CUDA twin of registered kernel
    ``name`` (``mlx_bricks.kernels``); ``inputs``: ``[(dtype, ndim), ...]`` per input of the
    spec, in order; ``output_dtypes``: one per output; ``template``: the launch's.

    Raises:
        ValueError: unknown kernel; NotImplementedError: no CUDA twin.
    """
    spec = kernels.spec(name)
    kname, header, body = kernels.kernel_source(name, "cuda")
    ins = [(n, d, nd) for n, (d, nd) in zip(spec.inputs_for("cuda"), inputs)]
    return generated_source(f"custom_kernel_{kname}", header, body, ins, spec.output_names,
                            output_dtypes, template)


def compile_twin(name: str, inputs, output_dtypes, template=(), arch: str = "sm_90a",
                 nvcc: str | None = None) -> Resources:
    """Compile the CUDA twin of registered kernel ``name`` as MLX would build it
    (:func:`twin_source`) for ``arch``: ``sm_90a`` (H100/H200, what MLX targets there) or
    ``sm_80`` etc.

    Raises:
        FileNotFoundError, CompileError: see :func:`compile_source`.
    """
    return compile_source(twin_source(name, inputs, output_dtypes, template), arch, nvcc)


@dataclass
class Launch:
    """One recorded ``kernels.launch`` of a CUDA twin: what it would compile."""

    name: str
    inputs: list  # [(dtype, ndim), ...]
    output_dtypes: list
    template: list
    shared_memory: int = 0
    grid: tuple = ()
    threadgroup: tuple = ()
    output_shapes: list = field(default_factory=list)

    def key(self):
        return (self.name, tuple((str(d), n) for d, n in self.inputs),
                tuple(map(str, self.output_dtypes)),
                tuple((k, str(v)) for k, v in self.template))

    def compile(self, arch: str = "sm_90a", nvcc: str | None = None) -> Resources:
        """Compile this launch's generated source (see :func:`compile_twin`)."""
        return compile_twin(self.name, self.inputs, self.output_dtypes, self.template, arch, nvcc)

    def source(self) -> str:
        """The source ``mx.fast.cuda_kernel`` would build for this launch."""
        return twin_source(self.name, self.inputs, self.output_dtypes, self.template)


@contextlib.contextmanager
def launches_replaced(fake, *modules):
    """Within the block, ``launch`` in each of ``modules`` (modules that did
    ``from mlx_bricks.kernels import launch``) is ``fake`` (called as ``kernels.launch``);
    restored after it."""
    saved = [(m, m.launch) for m in modules]
    try:
        for m in modules:
            m.launch = fake
        yield
    finally:
        for m, orig in saved:
            m.launch = orig


@contextlib.contextmanager
def recorded_launches(*modules):
    """Within the block, ``launch`` in each of ``modules`` (modules that did
    ``from mlx_bricks.kernels import launch``) records its CUDA launches instead of running
    them and returns zero arrays of the output shapes, so an op's CUDA path can be driven on a
    machine without a GPU. Yields the list of :class:`Launch` records.
    """
    import mlx.core as mx

    records: list[Launch] = []

    def fake(name, backend, *, shared_memory=0, inputs, output_shapes, output_dtypes,
             grid, threadgroup, template=(), init_value=None):
        if backend != "cuda":
            raise ValueError(f"recorded_launches only records cuda launches, got {backend!r}")
        records.append(Launch(name, [(a.dtype, a.ndim) for a in inputs], list(output_dtypes),
                              list(template), shared_memory, tuple(grid), tuple(threadgroup),
                              [tuple(sh) for sh in output_shapes]))
        return [mx.zeros(sh, dtype=dt) for sh, dt in zip(output_shapes, output_dtypes)]

    with launches_replaced(fake, *modules):
        yield records


# ---------------------------------------------------------------------------------------------
# NVRTC: what mx.fast.cuda_kernel compiles with (nvcc accepts builtins NVRTC lacks)

def cuda_include_dir() -> Path | None:
    """The CUDA toolkit's include directory (beside nvcc, or under ``/usr/local/cuda*``)."""
    nvcc = find_nvcc()
    roots = ([Path(nvcc).resolve().parent.parent] if nvcc else []) + sorted(
        Path("/usr/local").glob("cuda*"), reverse=True)
    for root in roots:
        if (root / "include" / "cuda_fp16.h").is_file():
            return root / "include"
    return None


def find_nvrtc() -> str | None:
    """Path of the libnvrtc the build cache would use (``mlx_bricks.cuda.toolchain.find_nvrtc``:
    ``$MLX_BRICKS_NVRTC``, the wheel's, the toolkit's), or None."""
    try:
        return _toolchain.find_nvrtc()
    except _toolchain.Unavailable:
        return None


def compile_source_nvrtc(source: str, arch: str = "sm_90a", nvrtc: str | None = None) -> None:
    """Compile ``source`` with NVRTC for ``arch`` (to PTX; no resources), with the CUDA
    toolkit's headers and the stand-in for MLX's. ``libnvrtc-builtins`` must sit beside the
    library (the wheel ships both).

    Raises:
        FileNotFoundError: no libnvrtc or no CUDA headers.
        CompileError: the compile failed (message: NVRTC's log).
    """
    lib_path = nvrtc or find_nvrtc()
    inc = cuda_include_dir()
    if lib_path is None or inc is None:
        raise FileNotFoundError("libnvrtc or the CUDA toolkit headers not found")
    # -default-device as MLX's JIT compiles (unannotated helpers such as GemmSmem::round built
    # and ran on the H200).
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "-default-device", f"-I{inc}",
            f"-I{inc / 'cccl'}", f"-I{SHIM_DIR}"]
    try:
        _toolchain.Nvrtc(lib_path).compile(source, opts, ptx=True)
    except _toolchain.CompileError as e:
        raise CompileError(f"NVRTC failed for {arch}:\n{e}") from None
