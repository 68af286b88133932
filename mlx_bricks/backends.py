"""Backend selection: which implementation of the bricks runs, and why.

Backends
--------
``metal``
    The MSL bricks through ``mx.fast.metal_kernel``; needs ``mx.metal.is_available()``.
``cuda``
    CUDA twins through ``mx.fast.cuda_kernel``; needs ``mx.cuda.is_available()`` and twins for
    the bricks (see ``mlx_bricks.kernels.CUDA_TWINS``).
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

import os
from dataclasses import dataclass

BACKENDS = ("metal", "cuda", "emulator", "reference")
ENV_VAR = "MLX_BRICKS_BACKEND"


class BackendError(ValueError):
    """An unknown backend name, or a backend that was asked for but cannot run here."""


@dataclass(frozen=True)
class Availability:
    """Whether something can run here, and why (not).

    Truthy exactly when ``available`` is True, and unpacks as ``ok, reason = ...``.
    """

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available

    def __iter__(self):
        return iter((self.available, self.reason))

    def __getitem__(self, i):
        return (self.available, self.reason)[i]


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
    from mlx_bricks.kernels import CUDA_TWINS

    if not CUDA_TWINS:
        return False, "a CUDA GPU is present but no brick has a CUDA twin yet"
    return True, "mx.cuda.is_available() is True"


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
    """Forget probed availability (for tests that change the environment)."""
    _status_cache.clear()


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
    elif os.environ.get(ENV_VAR):
        backend, source, what = os.environ[ENV_VAR].strip(), "env", f"{ENV_VAR} value"
    else:
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
