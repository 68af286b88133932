"""Kernel registry: every brick's ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` object,
built once, lazily.

A brick module registers a :class:`KernelSpec` at import time (cheap: no source is read and
nothing is compiled). The first :func:`launch` (or :func:`get_kernel`) of a spec on a backend
reads its sources through ``importlib.resources`` and builds the kernel object:

* ``metal``: ``mx.fast.metal_kernel`` from ``mlx_bricks.metal_src``;
* ``emulator``: ``mlx_bricks.emulator.metal_kernel`` (same MSL and arguments, runs on the CPU);
* ``cuda``: ``mx.fast.cuda_kernel`` from ``mlx_bricks.cuda_src`` (the spec's CUDA twin), one
  object per dynamic shared-memory size (a construction argument of ``cuda_kernel``), behind
  ``mlx_bricks.cuda.build.CudaKernel``: each variant is compiled once per machine and loaded
  from MLX's JIT disk cache where it can be (``MLX_BRICKS_CUDA_CACHE=0``: off).

The registry sits on the CUDA build cache (``mlx_bricks.cuda``), which knows nothing of it: the
registry hands each ``CudaKernel`` its sources and the factory of its ``cuda_kernel`` object.

Metal and the emulator get the same launch geometry and template arguments, so product code is
identical for both; a CUDA twin has its own geometry (``mlx_bricks/ops``) and the same inputs,
outputs and semantics. Each source variant gets a unique kernel name
(``mlx_bricks_<name>_<sha1 of header+body>``) because MLX < 0.32.1 could run the wrong kernel
when two shared a name, and a stale cache must never serve an edited source.
"""
from __future__ import annotations

import hashlib
import importlib.resources
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

SOURCE_PACKAGE = "mlx_bricks.metal_src"
CUDA_SOURCE_PACKAGE = "mlx_bricks.cuda_src"
#: Backends whose kernels are built from a spec's MSL; ``cuda`` uses the spec's CUDA twin.
MSL_BACKENDS = ("metal", "emulator")


@dataclass(frozen=True)
class KernelSpec:
    """What ``mx.fast.metal_kernel`` needs to build one brick kernel.

    Attributes:
        name: registry key, e.g. ``"gemm"``; used in the unique kernel name.
        body: file in ``metal_src/`` holding the kernel body (the part inside the braces), or
            None for a CUDA-only helper kernel (a twin's prologue the MSL brick does not need).
        input_names, output_names: buffer names, in launch order.
        headers: files in ``metal_src/`` concatenated (in order) into ``header=``.
        ensure_row_contiguous: as in ``mx.fast.metal_kernel``; False for kernels that read
            ``<input>_strides`` to take views without a copy (applies to the CUDA twin too).
        atomic_outputs: as in ``mx.fast.metal_kernel``.
        cuda_body: file in ``cuda_src/`` holding the CUDA twin's body, or None when the brick
            has no twin yet. Same outputs and semantics as the MSL kernel.
        cuda_headers: files in ``cuda_src/`` concatenated into the twin's ``header=``.
        cuda_input_names: the twin's inputs when they differ from ``input_names`` (the GEMM
            twins take every weight as a ``(w, scales, biases)`` triple, float or affine, so one
            body serves every weight format); None means ``input_names``.
    """

    name: str
    body: str | None
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    headers: tuple[str, ...] = ()
    ensure_row_contiguous: bool = True
    atomic_outputs: bool = False
    cuda_body: str | None = None
    cuda_headers: tuple[str, ...] = ()
    cuda_input_names: tuple[str, ...] | None = None

    def inputs_for(self, backend: str) -> tuple[str, ...]:
        """Input names of the kernel built for ``backend``."""
        if backend == "cuda" and self.cuda_input_names is not None:
            return self.cuda_input_names
        return self.input_names


_SPECS: dict[str, KernelSpec] = {}

#: How many kernel objects were built, per (name, backend). Each must stay at 1.
BUILD_COUNTS: Counter = Counter()
#: How many launches ran, per (name, backend): lets tests prove a brick really ran.
LAUNCH_COUNTS: Counter = Counter()


def register(spec: KernelSpec) -> KernelSpec:
    """Register ``spec`` under ``spec.name``.

    Raises:
        ValueError: another, different spec already uses that name.
    """
    old = _SPECS.get(spec.name)
    if old is not None and old != spec:
        raise ValueError(f"kernel name {spec.name!r} is already registered with another spec")
    _SPECS[spec.name] = spec
    return spec


def spec(name: str) -> KernelSpec:
    """The registered spec called ``name`` (ValueError listing the known names otherwise)."""
    try:
        return _SPECS[name]
    except KeyError:
        raise ValueError(
            f"unknown kernel {name!r}; registered: {', '.join(sorted(_SPECS)) or 'none'}"
        ) from None


def registered() -> list[str]:
    """Names of all registered kernels."""
    return sorted(_SPECS)


@lru_cache(maxsize=None)
def read_source(filename: str, package: str = SOURCE_PACKAGE) -> str:
    """Text of ``<package>/<filename>`` from the installed package (wheel or editable):
    ``metal_src`` by default, ``CUDA_SOURCE_PACKAGE`` for CUDA twins.

    Raises:
        FileNotFoundError: no such file in ``package``.
        ValueError: the file is not ASCII (MSL must be; the CUDA twins keep the same rule).
    """
    path = importlib.resources.files(package).joinpath(filename)
    if not path.is_file():
        raise FileNotFoundError(f"{filename!r} is not in package {package}")
    text = path.read_text(encoding="utf-8")
    if not text.isascii():
        raise ValueError(f"{filename}: kernel source must be ASCII")
    return text


def has_kernel(name: str, backend: str) -> bool:
    """Whether kernel ``name`` can be built for ``backend`` (``cuda``: the spec has a twin)."""
    s = spec(name)
    if backend in MSL_BACKENDS:
        return s.body is not None
    return backend == "cuda" and s.cuda_body is not None


def kernel_source(name: str, backend: str = "metal") -> tuple[str, str, str]:
    """``(unique_kernel_name, header, body)`` exactly as given to ``metal_kernel`` (``metal``,
    ``emulator``) or ``cuda_kernel`` (``cuda``).

    Raises:
        ValueError: unknown kernel name or backend.
        NotImplementedError: ``cuda`` for a brick without a CUDA twin.
    """
    s = spec(name)
    if backend in MSL_BACKENDS:
        if s.body is None:
            raise NotImplementedError(f"kernel {name!r} is CUDA-only (no MSL body)")
        header = "\n".join(read_source(h) for h in s.headers)
        body = read_source(s.body)
        prefix = "mlx_bricks_"
    elif backend == "cuda":
        if s.cuda_body is None:
            raise NotImplementedError(f"kernel {name!r} has no CUDA twin")
        header = "\n".join(read_source(h, CUDA_SOURCE_PACKAGE) for h in s.cuda_headers)
        body = read_source(s.cuda_body, CUDA_SOURCE_PACKAGE)
        prefix = "mlx_bricks_cu_"
    else:
        raise ValueError(
            f"backend {backend!r} has no kernels; expected 'metal', 'emulator' or 'cuda'"
        )
    digest = hashlib.sha1((header + "\0" + body).encode()).hexdigest()[:12]
    return f"{prefix}{s.name}_{digest}", header, body


@lru_cache(maxsize=None)
def get_kernel(name: str, backend: str, shared_memory: int = 0):
    """The kernel object for ``name`` on ``backend``, built on first use and cached.

    Args:
        name: a registered kernel name.
        backend: ``"metal"``, ``"emulator"`` or ``"cuda"`` (``"reference"`` has no kernels).
        shared_memory: ``cuda`` only: bytes of dynamic shared memory every launch of this object
            gets (``mx.fast.cuda_kernel(shared_memory=...)``); each size is its own object,
            named apart so MLX's module cache never hands one size's function to another.

    Raises:
        ValueError: unknown kernel name or a backend without kernels; shared_memory on an MSL
            backend.
        NotImplementedError: ``cuda`` for a brick that has no CUDA twin.
    """
    s = spec(name)
    kname, header, body = kernel_source(name, backend)
    if backend in MSL_BACKENDS:
        if shared_memory:
            raise ValueError("shared_memory applies to the cuda backend only")
        if backend == "metal":
            import mlx.core as mx

            factory = mx.fast.metal_kernel
        else:
            from mlx_bricks import emulator

            factory = emulator.metal_kernel
        kernel = factory(
            name=kname,
            input_names=list(s.input_names),
            output_names=list(s.output_names),
            source=body,
            header=header,
            ensure_row_contiguous=s.ensure_row_contiguous,
            atomic_outputs=s.atomic_outputs,
        )
    else:
        from mlx_bricks.cuda import build

        stock_name, stock_body = kname, body
        if shared_memory:
            stock_name = f"{kname}_smem{shared_memory}"
            # The size is part of the source too: MLX keys its JIT module by name and source.
            stock_body = f"// dynamic shared memory: {shared_memory} bytes\n{body}"

        def stock():
            import mlx.core as mx

            return mx.fast.cuda_kernel(
                name=stock_name,
                input_names=list(s.inputs_for("cuda")),
                output_names=list(s.output_names),
                source=stock_body,
                header=header,
                ensure_row_contiguous=s.ensure_row_contiguous,
                shared_memory=shared_memory,
            )

        # Served from the per-machine build cache where it can, else by ``stock``.
        kernel = build.CudaKernel(name, kname, header, body, s.inputs_for("cuda"),
                                  s.output_names, s.ensure_row_contiguous, shared_memory,
                                  stock_name, stock_body, stock)
    BUILD_COUNTS[(name, backend)] += 1
    return kernel


def launch(name: str, backend: str, *, shared_memory: int = 0, **kwargs):
    """Launch kernel ``name`` on ``backend``; ``kwargs`` are those of the MLX kernel call
    (``inputs, grid, threadgroup, output_shapes, output_dtypes, template, init_value``);
    ``shared_memory`` is the CUDA twin's dynamic shared memory in bytes (0 elsewhere).

    Returns the list of output arrays.
    """
    outputs = get_kernel(name, backend, shared_memory)(**kwargs)
    LAUNCH_COUNTS[(name, backend)] += 1
    return outputs


def build_cost(kernel: str, template=None) -> float | None:
    """Seconds this process spent building CUDA kernel ``kernel`` at its first calls (one
    variant with ``template``, else all summed), or None when none was built through the build
    cache here (``mlx_bricks.cuda.build.build_cost``: the compile on a miss, the read of the
    stored cubin on a hit)."""
    from mlx_bricks.cuda import build

    return build.build_cost(kernel, template)


def is_built(kernel: str, template=None) -> bool:
    """Whether CUDA kernel ``kernel`` (its variant with ``template``, if given) is compiled on
    disk for this GPU and toolchain, so no process builds it again
    (``mlx_bricks.cuda.build.is_built``)."""
    from mlx_bricks.cuda import build

    return build.is_built(kernel, template)


def prebuild(launches, workers: int | None = None, root=None) -> list[tuple[str, str, float, str]]:
    """Compile the CUDA variants of ``launches`` that are not on disk yet, ``workers`` at a time
    in separate processes; later launches then load them (``mlx_bricks.cuda.build.prebuild``).

    Args:
        launches: objects with ``name`` (a registered kernel), ``inputs`` (``[(dtype, ndim),
            ...]``), ``output_dtypes``, ``template``, ``shared_memory``
            (``mlx_bricks.cudacheck.Launch``, e.g. from ``cudacheck.recorded_launches``).
        workers: processes (default: one per CPU).
        root: the home directory (default ``mlx_bricks.home``).

    Returns:
        ``(kernel, template tag, seconds, how)`` per distinct variant, ``how`` ``"loaded"``,
        ``"compiled"`` or ``"error: ..."``.

    Raises:
        mlx_bricks.cuda.toolchain.Unavailable: no CUDA device or libnvrtc.
    """
    from mlx_bricks.cuda import build

    return build.prebuild([(get_kernel(r.name, "cuda", r.shared_memory), r) for r in launches],
                          workers, root)
