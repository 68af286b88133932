"""Kernel registry: every brick's ``mx.fast.metal_kernel`` object, built once, lazily.

A brick module registers a :class:`KernelSpec` at import time (cheap: no source is read and
nothing is compiled). The first :func:`launch` (or :func:`get_kernel`) of a spec on a backend
reads the MSL from ``mlx_bricks.metal_src`` through ``importlib.resources`` and builds the kernel
object for that backend:

* ``metal``: ``mx.fast.metal_kernel``;
* ``emulator``: ``mlx_bricks.emulator.metal_kernel`` (same arguments, runs on the CPU);
* ``cuda``: ``mx.fast.cuda_kernel`` from ``CUDA_TWINS`` (none yet).

The same launch geometry and template arguments are passed to every backend, so product code
is identical for Metal and the emulator. Each source variant gets a unique kernel name
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


@dataclass(frozen=True)
class KernelSpec:
    """What ``mx.fast.metal_kernel`` needs to build one brick kernel.

    Attributes:
        name: registry key, e.g. ``"gemm"``; used in the unique kernel name.
        body: file in ``metal_src/`` holding the kernel body (the part inside the braces).
        input_names, output_names: buffer names, in launch order.
        headers: files in ``metal_src/`` concatenated (in order) into ``header=``.
        ensure_row_contiguous: as in ``mx.fast.metal_kernel``; False for kernels that read
            ``<input>_strides`` to take views without a copy.
        atomic_outputs: as in ``mx.fast.metal_kernel``.
    """

    name: str
    body: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    headers: tuple[str, ...] = ()
    ensure_row_contiguous: bool = True
    atomic_outputs: bool = False


_SPECS: dict[str, KernelSpec] = {}
# brick name -> CUDA twin spec (filled by the CUDA-twin issue); empty means "no twins yet".
CUDA_TWINS: dict[str, object] = {}

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
def read_source(filename: str) -> str:
    """Text of ``metal_src/<filename>`` from the installed package (wheel or editable).

    Raises:
        FileNotFoundError: no such file in ``mlx_bricks.metal_src``.
    """
    path = importlib.resources.files(SOURCE_PACKAGE).joinpath(filename)
    if not path.is_file():
        raise FileNotFoundError(f"{filename!r} is not in package {SOURCE_PACKAGE}")
    text = path.read_text(encoding="utf-8")
    if not text.isascii():
        raise ValueError(f"{filename}: Metal source must be ASCII")
    return text


def kernel_source(name: str) -> tuple[str, str, str]:
    """``(unique_kernel_name, header, body)`` exactly as given to ``metal_kernel``."""
    s = spec(name)
    header = "\n".join(read_source(h) for h in s.headers)
    body = read_source(s.body)
    digest = hashlib.sha1((header + "\0" + body).encode()).hexdigest()[:12]
    return f"mlx_bricks_{s.name}_{digest}", header, body


@lru_cache(maxsize=None)
def get_kernel(name: str, backend: str):
    """The kernel object for ``name`` on ``backend``, built on first use and cached.

    Args:
        name: a registered kernel name.
        backend: ``"metal"``, ``"emulator"`` or ``"cuda"`` (``"reference"`` has no kernels).

    Raises:
        ValueError: unknown kernel name or a backend without kernels.
        NotImplementedError: ``cuda`` for a brick that has no CUDA twin yet.
    """
    s = spec(name)
    if backend in ("metal", "emulator"):
        kname, header, body = kernel_source(name)
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
    elif backend == "cuda":
        if name not in CUDA_TWINS:
            raise NotImplementedError(f"kernel {name!r} has no CUDA twin yet")
        kernel = CUDA_TWINS[name]
    else:
        raise ValueError(
            f"backend {backend!r} has no kernels; expected 'metal', 'emulator' or 'cuda'"
        )
    BUILD_COUNTS[(name, backend)] += 1
    return kernel


def launch(name: str, backend: str, **kwargs):
    """Launch kernel ``name`` on ``backend``; ``kwargs`` are those of the MLX kernel call
    (``inputs, grid, threadgroup, output_shapes, output_dtypes, template, init_value``).

    Returns the list of output arrays.
    """
    outputs = get_kernel(name, backend)(**kwargs)
    LAUNCH_COUNTS[(name, backend)] += 1
    return outputs
