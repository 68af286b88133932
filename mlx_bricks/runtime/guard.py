"""The build and first-call guard: a brick variant that fails to build or run, or whose first
output disagrees with stock beyond the dtype-scaled tolerance, is disabled for the process, and
the computation continues on stock.

MLX builds a custom kernel lazily, when its output is first evaluated (``mx.fast.metal_kernel``
compiles the MSL, ``mx.fast.cuda_kernel`` runs NVRTC), so an error would surface far from the
call, inside the model's evaluation. The guard therefore evaluates the first call of each
(backend, op kind, variant, decision key) eagerly and checks the brick's last rows against a
high-precision reference and stock (``OpKind.check``). The check costs a few rows, not a second
call: stock runs on the rows the check reads (``OpKind.check_stock``: a GEMM's last rows, the
attention's last queries), and a kind whose check would need the whole call (a recurrence's
final state) checks a cheaper call of the same variant on a prefix of the inputs
(``OpKind.check_call``). A one-shot process pays it once per key, a few milliseconds, where a
full stock call per key cost 0.1-0.4 s in a fresh process (H100, 2026-12-06). Later calls of a
checked key run lazily as usual.
"""
from __future__ import annotations

from typing import Callable

import mlx.core as mx

from mlx_bricks.runtime.kind import Key, OpKind, Variant
from mlx_bricks.tune.check import KERNEL_ERRORS, one_line

#: The errors the guard catches (``tune.check.KERNEL_ERRORS``).
GUARD_ERRORS = KERNEL_ERRORS


class Guard:
    """Process-wide record of disabled and checked brick variants (module docstring).

    Attributes:
        disabled: ``(backend, kind, variant, scope) -> reason`` of every disabled variant
            (scope: ``Key.scope``).
        passed: ``(backend, kind, variant, key)`` whose first call was checked.
        generation: changes whenever ``disabled`` does.
    """

    def __init__(self):
        self.disabled: dict[tuple[str, str, str, str], str] = {}
        self.passed: set[tuple[str, str, str, str]] = set()
        #: Incremented by every change of ``disabled`` (remembered choices are then stale).
        self.generation = 0

    def reset(self) -> None:
        """Forget everything (tests; a process that changed its kernels)."""
        self.disabled.clear()
        self.passed.clear()
        self.generation += 1

    def disabled_reason(self, backend: str, kind: str, variant: str, scope: str
                        ) -> str | None:
        """Why ``variant`` of ``kind`` on ``backend`` is disabled for ``scope``, or None."""
        return self.disabled.get((backend, kind, variant, scope))

    def disable(self, backend: str, kind: str, variant: str, scope: str, reason: str) -> None:
        """Disable ``variant`` for ``scope`` for the rest of the process (the first reason is
        kept)."""
        k = (backend, kind, variant, scope)
        if k not in self.disabled:
            self.disabled[k] = reason
            self.generation += 1

    def run(self, kind: OpKind, variant: Variant, args: dict, backend: str, key: Key,
            stock: Callable[[], object]) -> tuple[object, str | None]:
        """The brick's output for ``args``, or stock's with the reason it replaced the brick.

        Args:
            kind: the op kind.
            variant: the brick variant chosen.
            args: the op's arguments (real arrays).
            backend: the backend the brick runs on.
            key: the decision key (the first call of each key is checked; a failure disables
                the variant for the key's dtype and weight format).
            stock: zero-argument callable computing the same values the stock way (the
                patch passes mlx-lm's own modules).

        Returns:
            ``(output, None)`` when the brick ran, ``(stock output, reason)`` when it is, or
            just became, disabled.
        """
        scope = key.scope
        reason = self.disabled_reason(backend, kind.name, variant.name, scope)
        if reason is not None:
            return stock(), reason
        gk = (backend, kind.name, variant.name, str(key))
        if gk in self.passed:
            return kind.run(variant, args, backend), None
        what = f"{kind.name} variant {variant.name} on {backend}"
        small = kind.check_call(args)
        try:
            out = kind.run(variant, args, backend)
            mx.eval(out)
            checked = out if small is args else kind.run(variant, small, backend)
            mx.eval(checked)
        except GUARD_ERRORS as e:
            reason = f"{what} failed to build or run: {one_line(e)}"
            self.disable(backend, kind.name, variant.name, scope, reason)
            return stock(), reason
        try:  # stock can fail where the brick runs (the tuner's note): check the reference
            naive = kind.check_stock(small)
            mx.eval(naive)
        except GUARD_ERRORS as e:
            naive, stock_error = None, e
        result = kind.check(checked, naive, small)
        if not result.ok:
            against = "stock" if naive is not None else "the reference (stock failed)"
            reason = f"{what}: first output disagrees with {against} beyond tolerance ({result})"
            self.disable(backend, kind.name, variant.name, scope, reason)
            if naive is None:  # nothing correct to return: what stock alone would do
                raise stock_error
            return stock(), reason
        self.passed.add(gk)
        return out, None


#: The process's guard (decisions and disabled variants are per process).
GUARD = Guard()
