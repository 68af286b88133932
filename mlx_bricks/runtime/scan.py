"""``ScanKind``: the common part of the op kinds of recurrent token mixers over a prefill (the
SSD scan, the short convolution; the Gated DeltaNet kind has the same shape), whose rows are
the tokens of a (batch, T, ...) activation and whose output is ``(y, next state)``."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.runtime.kind import OpKind, high_precision
from mlx_bricks.tune.check import dtype_close, worst

#: The kernel variant's name (the brick's MSL kernel, or its CUDA twin on cuda).
KERNEL = "kernel"
#: Backends with a kernel variant.
KERNEL_BACKENDS = ("metal", "emulator", "cuda")


class ScanKind(OpKind):
    """A kind whose first activation is (batch, T, ...) and whose output is ``(y, state)``.

    A brick fills in ``kernel_reason`` (why its kernel does not compute these arguments) and,
    for ``tune="cached"`` without a measurement, ``prior_min_tokens``: backend -> the fewest
    tokens (batch x T) from which the composite ``prior_composite`` runs (fewer: stock; a
    backend not listed: the generic rules of ``tune.prior``).
    """

    prior_min_tokens: dict[str, int] = {}
    prior_composite = ""

    def kernel_reason(self, args: dict) -> str | None:
        return None

    def reference(self, args: dict, dtype):
        """``(y, state)`` for ``args`` computed in ``dtype`` (the check's reference)."""
        raise NotImplementedError

    def reference_tail(self, args, rows):
        """The last ``rows`` tokens of :meth:`reference`'s y, and its state, in high precision
        (``runtime.kind.high_precision``), sliced inside its context: float64 lives on the
        CPU stream (no GPU has it)."""
        with high_precision(self.dtype(args)) as hp:
            y, state = self.reference(args, hp)
            return y[:, -rows:], state

    def prior(self, args, backend):
        min_tokens = self.prior_min_tokens.get(backend)
        if min_tokens is None:
            return None
        m = self.measured(args)
        return self.prior_composite if m["T"] * m["batch"] >= min_tokens else "stock"

    def listing(self, backend, dtype, args):
        """``("kernel",)`` on metal / emulator / cuda where the kernel computes the arguments
        (:meth:`kernel_reason` None), else none (the composites compete alone)."""
        if backend not in KERNEL_BACKENDS:
            return ()
        if args is not None and self.kernel_reason(args) is not None:
            return ()
        return (KERNEL,)

    def variant_kwargs(self, name):
        if name != KERNEL:
            raise ValueError(f"unknown {self.name} variant {name!r}")
        return {}

    def n_rows(self, args):
        return args[self.activations[0]].shape[1]

    def measured(self, args):
        b, T = args[self.activations[0]].shape[:2]
        return {"T": T, "batch": b}

    def tail(self, out, rows):
        y, state = out
        return y[:, -rows:], state

    def check(self, out, naive, args):
        """The dtype rule on y (float32 inputs: 64 ulps: chunked products round a few times
        per chunk where a token loop is near exact) and on the float32 state (factor 4, 64
        ulps), against the kind's ``reference_tail`` in high precision; ``naive``: stock's
        output."""
        rows = min(8, self.n_rows(args))
        (ry, rS), (oy, oS) = self.reference_tail(args, rows), self.tail(out, rows)
        ny = nS = None
        if naive is not None:
            ny, nS = self.tail(naive, rows)
        dtype = self.dtype(args)
        return worst([
            dtype_close(oy, ry, ny, dtype=dtype, ulps=64 if dtype == mx.float32 else 4),
            dtype_close(oS, rS, nS, dtype=mx.float32, factor=4.0, ulps=64)])


def mask_reason(mask, inputs) -> str | None:
    """Why a mixer call's mask is not mlx-lm's padding mask, a (B, L) bool array (None: it is
    one, or None)."""
    if mask is not None and (not isinstance(mask, mx.array) or mask.dtype != mx.bool_
                             or tuple(mask.shape) != tuple(inputs.shape[:2])):
        return "mask is not a (B, L) bool array"
    return None


def arrays_cache_reason(cache, entries: int, what: str) -> str | None:
    """Why a mixer call's cache is not mlx-lm's ``ArraysCache`` of ``entries`` arrays
    (``what`` names them in the reason; None: it is one, or None)."""
    if cache is None:
        return None
    from mlx_lm.models.cache import ArraysCache

    if not isinstance(cache, ArraysCache):
        return f"cache {type(cache).__name__} is not an ArraysCache"
    if len(cache.cache) != entries:
        return f"ArraysCache of {len(cache.cache)} entries, expected {entries} ({what})"
    return None
