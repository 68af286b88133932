"""Where a patched model decides, per piece and call, between a brick and the stock path.

One :class:`Dispatch` per ``patch_model`` call, shared by every patched module of the model: the
modules (``mlx_bricks.nn``) describe each piece of their prefill (op kind and arguments) and ask
:meth:`Dispatch.choose`; the dispatch is the only code that consults the tuner and its cache.
:meth:`Dispatch.run` runs a chosen brick through the first-call guard.

How a piece is decided:

* tuning applies (``tune="auto"`` or ``"force"`` on a kernel backend, ``metal`` or ``cuda``):
  the decision for the piece's key (op kind, shape parameters, shape bucket, dtype, weight
  format) comes from this dispatch's memory, else (``auto``) the decision cache, else it is
  measured now (``mlx_bricks.tune.tuner.tune_op``) and written to the cache. A stock winner
  keeps the stock path, counted as ``"<piece>: tuned: stock faster (x0.93)"``.
* otherwise (``tune="off"``, or ``emulator`` / ``reference`` named by the caller): the bricks
  run as asked, tile and variant chosen by the ops' rules, as before the tuner existed.
* either way, a brick variant the guard disabled (build error, wrong first output) runs stock.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlx_bricks.backends import BackendChoice
from mlx_bricks.options import TUNE_MODES
from mlx_bricks.tune.guard import GUARD, guard_scope
from mlx_bricks.tune.kinds import Key, Variant, kind
from mlx_bricks.tune.tuner import Decision, tune_op

#: Backends where tuning applies (the kernel backends a user runs).
TUNED_BACKENDS = ("metal", "cuda")
#: Backends whose bricks run kernels, so the build and first-call guard applies.
GUARDED_BACKENDS = ("metal", "cuda", "emulator")
#: Why a model on a machine without a kernel backend stays stock.
NO_KERNEL_BACKEND = "no kernel backend on this machine (reference is the same math as stock)"


@dataclass(frozen=True)
class Choice:
    """What one piece runs for one call.

    Attributes:
        variant: the brick variant, or None for the stock path.
        reason: why stock (``"tuned: stock faster (x0.93)"``, ``"disabled: ..."``), or how the
            brick was chosen (``"tuned: 64x64 faster (x1.10)"``, ``"rule"``).
        key: the decision key (``mlx_bricks.tune.kinds.Key``).
        tuned: stock because tuning measured it faster (not a fallback).
    """

    variant: Variant | None
    reason: str
    key: Key
    tuned: bool = False

    @property
    def brick(self) -> bool:
        return self.variant is not None


class Dispatch:
    """The decisions of one patched model (module docstring).

    Args:
        backend: the resolved backend of the patch.
        tune: ``"auto"``, ``"off"`` or ``"force"``.
        mlp_variant: the SwiGLU variant the rules run (``fused`` / ``split``).
        mlp_variant_fixed: the caller asked for ``mlp_variant`` (argument or environment):
            tuning then only weighs that variant against stock.
        progress: show the tuner's progress bar (None: when stderr is a terminal).
    """

    def __init__(self, backend: BackendChoice, tune: str, *, mlp_variant: str,
                 mlp_variant_fixed: bool = False, progress: bool | None = None):
        if tune not in TUNE_MODES:
            raise ValueError(f"tune must be one of {', '.join(map(repr, TUNE_MODES))}, "
                             f"got {tune!r}")
        self.backend = backend.name
        self.mode = tune
        self.tuning = tune != "off" and backend.name in TUNED_BACKENDS
        self.guarded = backend.name in GUARDED_BACKENDS
        self.mlp_variant = mlp_variant
        self.mlp_variant_fixed = mlp_variant_fixed
        self.progress = progress
        #: ``"<backend>|<key>" -> Decision`` taken for this model (cached or measured).
        self.decisions: dict[str, Decision] = {}
        #: Guard reasons this model's pieces met (disabled variants), in order.
        self.failures: list[str] = []
        self._cache = None
        if self.tuning:
            self.why = (f"{tune}: each piece's brick variants timed against stock on this "
                        "device" + (" (cached decisions reused)" if tune == "auto" else
                                    " (re-measured, cache overwritten)"))
        elif tune == "off":
            self.why = "off: the ops' own tile and variant rules, no measurement"
        else:
            self.why = (f"not applied: backend {backend.name} was named "
                        f"({backend.source}); the bricks run as asked")

    @property
    def generation(self) -> int:
        """Changes whenever the guard disables a variant (modules then re-choose)."""
        return GUARD.generation if self.guarded else 0

    @property
    def cache(self):
        """The decision cache (opened on first use)."""
        if self._cache is None:
            from mlx_bricks.tune.cache import DecisionCache

            self._cache = DecisionCache()
        return self._cache

    def _mlp_variant(self, args) -> str:
        """The SwiGLU variant the rules run for these weights: ``mlp_variant``, except
        ``split`` when gate and up differ in format (the fused kernel stages both with one
        loader; ``ops.mlp.same_format``)."""
        from mlx_bricks.ops.mlp import same_format

        return self.mlp_variant if same_format(args["w_gate"], args["w_up"]) else "split"

    def _rule(self, k, dtype, args) -> Variant | None:
        kwargs = {"variant": self._mlp_variant(args)} if k.name == "swiglu_mlp" else {}
        if self.backend == "reference":
            return Variant("reference", kwargs)  # the ops' MLX implementations
        # The op's listing for these weights' formats (a CUDA tile may not take a width).
        if not k.variant_names_for(self.backend, dtype, args):
            return None
        return Variant(kwargs.get("variant", "rule"), kwargs)

    def _candidates(self, k, dtype, args) -> list[Variant]:
        cands = k.variants(self.backend, dtype, args)
        if k.name == "swiglu_mlp" and self.mlp_variant_fixed:
            cands = [v for v in cands if v.name == self.mlp_variant]
        return cands

    def decision(self, k, args) -> Decision:
        """The tuning decision for ``args`` of op kind ``k`` (memory, cache, or measured)."""
        full = f"{self.backend}|{k.key(args)}"
        if k.name == "swiglu_mlp" and self.mlp_variant_fixed:
            full += f"|only={self.mlp_variant}"
        d = self.decisions.get(full)
        if d is not None:
            return d
        cands = self._candidates(k, k.dtype(args), args)
        if self.mode == "auto":
            data = self.cache.get(full)
            if data is not None:
                try:
                    d = Decision.from_dict(full, data)
                except ValueError:
                    d = None
                if d is not None and d.brick and d.winner not in {v.name for v in cands}:
                    d = None  # the op no longer offers the winner: measure again
        if d is None:
            d = tune_op(k, args, self.backend, variants=cands, progress=self.progress)
            if d.stock_s is not None or d.variants:
                self.cache.put({full: d.to_dict()})
        self.decisions[full] = d
        return d

    def choose(self, kind_name: str, args: dict) -> Choice:
        """What the piece with op kind ``kind_name`` and arguments ``args`` runs (activations
        may be ``Act`` placeholders). May measure (tuning, first call of a key)."""
        k = kind(kind_name)
        key, dtype = k.key(args), k.dtype(args)
        # Q8_0 K/V is a requested change of the values: no stock op computes it.
        if not self.tuning or (k.name == "attention" and args.get("kv_quant")):
            v = self._rule(k, dtype, args)
            if v is None:
                return Choice(None, f"no {self.backend} kernel for {k.name} ({key.dtype}, "
                              f"w={key.weights})", key)
            reason = "rule"
        elif not self._candidates(k, dtype, args):
            return Choice(None, f"no {self.backend} kernel for {k.name} ({key.dtype}, "
                          f"w={key.weights})", key)
        else:
            d = self.decision(k, args)
            if not d.brick:
                return Choice(None, d.reason, key, tuned=d.ratio is not None)
            v, reason = Variant(d.winner, d.kwargs), d.reason
        if self.guarded:
            why = GUARD.disabled_reason(self.backend, k.name, v.name, guard_scope(key))
            if why is not None:
                return Choice(None, f"disabled: {why}", key)
        return Choice(v, reason, key)

    def run(self, choice: Choice, kind_name: str, args: dict, stock):
        """Run the brick of ``choice`` on ``args`` (real arrays) through the guard.

        Args:
            stock: zero-argument callable computing the piece the stock way (the module's
                own mlx-lm code), used when the brick is or becomes disabled.

        Returns:
            ``(output, None)``, or ``(stock output, "disabled: <reason>")``.
        """
        k = kind(kind_name)
        if not self.guarded:
            return k.run(choice.variant, args, self.backend), None
        out, reason = GUARD.run(k, choice.variant, args, self.backend, choice.key, stock)
        if reason is None:
            return out, None
        if reason not in self.failures:
            self.failures.append(reason)
        return out, f"disabled: {reason}"

    def summary(self) -> dict:
        """JSON-serialisable state: mode, whether tuning applies and why, the decisions taken
        and the guard's reasons met."""
        return {
            "mode": self.mode,
            "applies": self.tuning,
            "why": self.why,
            "decisions": [
                {"key": key, "winner": d.winner, "ratio": d.ratio, "reason": d.reason,
                 "source": d.source, "measured": d.measured}
                for key, d in self.decisions.items()],
            "disabled": list(self.failures),
        }
