"""Backend selection: which implementation of the bricks runs, and why.

Backends
--------
``metal``
    The MSL bricks through ``mx.fast.metal_kernel``; needs ``mx.metal.is_available()``.
``cuda``
    CUDA twins (``cuda_src/``) through ``mx.fast.cuda_kernel``; needs ``mx.cuda.is_available()``
    and a GPU of compute capability >= 8.0 (the twins use ``mma.sync`` tensor-core
    instructions). A brick without a twin keeps the stock path on this backend.
``emulator``
    The same MSL run on the CPU by ``mlx_bricks.emulator`` (clang + a Metal shim). Slow; for
    tests and for debugging Metal code on a machine without a Mac.
``reference``
    MLX ops only. Correct everywhere, not faster than stock.

Selection order: explicit argument > ``MLX_BRICKS_BACKEND`` > auto (metal, then cuda, then
reference). The emulator is never chosen automatically. A backend that is asked for but cannot
run is an error that says why; nothing switches silently.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlx_bricks import env
from mlx_bricks._availability import Availability  # noqa: F401  (re-exported)
from mlx_bricks.cuda.toolchain import MIN_CUDA_CAPABILITY, cuda_capability  # noqa: F401
from mlx_bricks.options import BACKENDS  # noqa: F401  (re-exported)

ENV_VAR = "MLX_BRICKS_BACKEND"


class BackendError(ValueError):
    """An unknown backend name, or a backend that was asked for but cannot run here."""


@dataclass(frozen=True)
class BackendChoice:
    """The backend that runs, and why it was chosen.

    Attributes:
        name: one of ``BACKENDS``.
        source: ``"argument"``, ``"env"`` (``MLX_BRICKS_BACKEND``) or ``"auto"``.
        reason: a human-readable sentence (e.g. why auto skipped metal and cuda).
    """

    name: str
    source: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.source}: {self.reason})"


def _metal_status() -> tuple[bool, str]:
    import mlx.core as mx

    if mx.metal.is_available():
        return True, "mx.metal.is_available() is True"
    return False, "mx.metal.is_available() is False (no Apple GPU / MLX built without Metal)"


def _cuda_status() -> tuple[bool, str]:
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return False, "mx.cuda.is_available() is False (no NVIDIA GPU / mlx[cuda13] not installed)"
    cc = cuda_capability()
    name = mx.device_info(mx.gpu).get("device_name", "CUDA GPU")
    if cc is None:
        return False, f"{name}: MLX reports no compute capability"
    if cc < MIN_CUDA_CAPABILITY:
        return False, (f"{name} is sm_{cc[0]}{cc[1]}; the CUDA twins need sm_80 or newer "
                       "(mma.sync bf16)")
    return True, f"mx.cuda.is_available() is True ({name}, sm_{cc[0]}{cc[1]})"


#: First Apple GPU generation with per-core neural accelerators (M5: ``applegpu_g17*``), and the
#: macOS release from which MLX routes matmul, quantized matmul and attention to them.
NEURAL_ACCELERATOR_GENERATION = 17
NEURAL_ACCELERATOR_MACOS = (26, 2)


def neural_accelerators(architecture: str | None = None, macos: str | None = None
                        ) -> str | None:
    """Why MLX itself runs GEMMs and attention on this Metal GPU's neural accelerators (M5 and
    newer on macOS 26.2+: MLX's ``steel`` NAX kernels), or None. The bricks run on the SIMD ALUs
    (``simdgroup_matrix``), about 4x below the accelerators' peak, so the tuner keeps stock
    there without measuring (issue 28; MLX gates its NAX kernels the same way).

    Args:
        architecture: ``mx.device_info()["architecture"]`` (default: this device's; empty
            without Metal), e.g. ``"applegpu_g17s"``.
        macos: the macOS version (default ``platform.mac_ver()[0]``; empty off macOS).
    """
    import platform
    import re

    if architecture is None:
        if not backend_status("metal"):
            return None
        import mlx.core as mx

        architecture = str(mx.device_info().get("architecture", ""))
    m = re.match(r"applegpu_g(\d+)", architecture or "")
    if m is None or int(m.group(1)) < NEURAL_ACCELERATOR_GENERATION:
        return None
    macos = platform.mac_ver()[0] if macos is None else macos
    try:
        version = tuple(int(x) for x in macos.split(".")[:2])
    except ValueError:
        version = ()
    if version and version < NEURAL_ACCELERATOR_MACOS:
        return None
    return (f"{architecture}: MLX runs matmul, quantized matmul and attention on the GPU's "
            "neural accelerators, which the bricks' simdgroup_matrix kernels do not use")


def _emulator_status() -> tuple[bool, str]:
    try:
        from mlx_bricks import emulator
    except ImportError as e:  # a broken install; report it rather than crash selection
        return False, f"mlx_bricks.emulator cannot be imported: {e}"
    return emulator.is_available()


def _reference_status() -> tuple[bool, str]:
    return True, "MLX ops run on every device"


_STATUS = {
    "metal": _metal_status,
    "cuda": _cuda_status,
    "emulator": _emulator_status,
    "reference": _reference_status,
}


_status_cache: dict[str, tuple[bool, str]] = {}


def backend_status(name: str) -> Availability:
    """Whether backend ``name`` can run here, with the reason (probed once per process).

    Returns an :class:`Availability`: truthy when available; unpacks as ``ok, reason``.

    Raises:
        BackendError: ``name`` is not one of ``BACKENDS``.
    """
    _check_name(name, "backend")
    if name not in _status_cache:
        _status_cache[name] = Availability(*_STATUS[name]())
    return _status_cache[name]


def clear_status_cache() -> None:
    """Forget probed availability and the device's compute capability (for tests that change
    the environment)."""
    _status_cache.clear()
    cuda_capability.cache_clear()


def available_backends() -> dict[str, Availability]:
    """``{name: Availability(available, reason)}`` for every backend."""
    return {name: backend_status(name) for name in BACKENDS}


def _check_name(name, what: str) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise BackendError(
            f"unknown {what} {name!r}; expected one of: {', '.join(BACKENDS)}"
        )
    return name


def active_backend(backend: str | None = None) -> BackendChoice:
    """Resolve the backend for a call and say why.

    Args:
        backend: explicit choice (one of ``BACKENDS``) or None.

    Returns:
        BackendChoice with the name, where the choice came from and the reason.

    Raises:
        BackendError: unknown name (argument or ``MLX_BRICKS_BACKEND``), or a backend that was
            asked for explicitly but is unavailable here (the message says why).
    """
    if backend is not None:
        source, what = "argument", "backend"
    else:
        try:
            backend = env.get(ENV_VAR)
        except env.EnvError as e:
            raise BackendError(str(e)) from None
        source, what = "env", f"{ENV_VAR} value"
    if backend is None:
        skipped = []
        for name in ("metal", "cuda"):
            ok, why = backend_status(name)
            if ok:
                return BackendChoice(name, "auto", why)
            skipped.append(f"{name}: {why}")
        return BackendChoice("reference", "auto", "; ".join(skipped))
    _check_name(backend, what)
    ok, why = backend_status(backend)
    if not ok:
        raise BackendError(f"backend {backend!r} ({source}) is unavailable: {why}")
    return BackendChoice(backend, source, why)


def resolve_backend(backend: str | None = None) -> str:
    """Name of the backend a call runs on (see ``active_backend`` for the rules and errors)."""
    return active_backend(backend).name


def op_backend(kernel: str, backend: str | None = None, *,
               cuda_unsupported: str | None = None) -> str:
    """The backend an op built on brick kernel ``kernel`` runs on, resolved once per call:
    :func:`active_backend`, except that an automatic (or ``MLX_BRICKS_BACKEND``) choice of
    ``cuda`` runs ``reference`` (the same math as stock) where the brick has no CUDA twin, or
    where ``cuda_unsupported`` says why this call has none (e.g. float32 activations on the
    GEMM twins' tensor cores).

    Raises:
        BackendError: see :func:`active_backend`.
        NotImplementedError: ``backend="cuda"`` given explicitly where there is no twin (the
            message says "has no CUDA twin").
    """
    from mlx_bricks.kernels import has_kernel

    choice = active_backend(backend)
    if choice.name != "cuda":
        return choice.name
    reason = cuda_unsupported
    if not has_kernel(kernel, "cuda"):
        reason = f"the {kernel!r} brick has no CUDA twin yet; use backend='reference'"
    if reason is None:
        return "cuda"
    if choice.source == "argument":
        raise NotImplementedError(reason)
    return "reference"
