"""Where a patched model decides, per piece and call, between a brick and the stock path.

One :class:`Dispatch` per ``patch_model`` call, shared by every patched module of the model: the
modules (``mlx_bricks.nn``) describe each piece of their prefill (op kind and arguments) and ask
:meth:`Dispatch.choose`; the dispatch is the only code that consults the tuner and its cache.
:meth:`Dispatch.run` runs a chosen brick through the first-call guard.

How a piece is decided:

* tuning applies (``tune="auto"`` or ``"force"`` on a kernel backend, ``metal`` or ``cuda``,
  and on ``reference`` when auto selection gave it, i.e. no kernel backend exists: there the
  candidates are the kinds' composites of stock ops): the decision for the piece's key (op
  kind, shape parameters, shape bucket, dtype, weight format) comes from this dispatch's
  memory, else (``auto``) the decision cache, else it is measured now
  (``mlx_bricks.tune.tuner.tune_op``) and written to the cache. A stock winner keeps the
  stock path, counted as ``"<piece>: tuned: stock faster (x0.93)"``.
* otherwise (``tune="off"``, or ``emulator`` / ``reference`` named by the caller): the bricks
  run as asked, tile and variant chosen by the ops' rules, as before the tuner existed.
* either way, a brick variant the guard disabled (build error, wrong first output) runs stock.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks.backends import BackendChoice, neural_accelerators
from mlx_bricks.kernels import is_built
from mlx_bricks.options import CAP_SETTING, CAP_STRICT_SETTING, TUNE_MODES, call_cap
from mlx_bricks.runtime.guard import GUARD
from mlx_bricks.runtime.kind import Key, Variant
from mlx_bricks.runtime.kind import kind as kind_of
from mlx_bricks.tune.prior import pays, prior_decision, without_builds
from mlx_bricks.tune.tuner import Decision, tune_op


def built(variant: Variant) -> bool:
    """Whether every kernel ``variant`` launches on ``cuda`` is compiled on this machine (the
    CUDA build cache, ``kernels.is_built``): running it then builds nothing in this process.
    False where its kernels are not known, and on any other backend (MLX builds Metal kernels
    in every process)."""
    return bool(variant.cuda_kernels) and all(is_built(k) for k in variant.cuda_kernels)


#: Backends where tuning applies (the kernel backends a user runs).
TUNED_BACKENDS = ("metal", "cuda")
#: Backends whose bricks run kernels, so the build and first-call guard applies.
GUARDED_BACKENDS = ("metal", "cuda", "emulator")
#: Backends where a block whose pieces chose a brick is timed whole against its stock
#: ``__call__`` before the choice stands (``block_decision``): the pieces are timed alone, and
#: leaving the all-stock path costs per-call Python that no piece's timing sees (H200,
#: 2026-12-04: an 8B-shaped bf16 prefill at M = 512 ran 0.85x stock with one piece x1.68).
BLOCK_CHECK_BACKENDS = ("metal", "cuda")
#: Why a model on a machine without a kernel backend stays stock.
NO_KERNEL_BACKEND = "no kernel backend on this machine (reference is the same math as stock)"


def no_kernel_backend(backend: BackendChoice) -> bool:
    """Whether ``backend`` is ``reference`` chosen automatically: no kernel backend here, so
    the only candidates are the kinds' composites of stock ops."""
    return backend.name == "reference" and backend.source == "auto"


def tunes(backend: BackendChoice, tune: str) -> bool:
    """Whether tuning applies to a patch on ``backend`` with ``tune``: on a kernel backend, and
    where there is none (:func:`no_kernel_backend`: the composites are weighed against stock);
    not with ``tune="off"`` nor on a backend the caller named for its own sake (``emulator``,
    ``reference``: the bricks run as asked)."""
    if tune == "off":
        return False
    return backend.name in TUNED_BACKENDS or no_kernel_backend(backend)


@dataclass(frozen=True)
class Choice:
    """What one piece runs for one call.

    Attributes:
        variant: the brick variant, or None for the stock path.
        reason: why stock (``"tuned: stock faster (x0.93)"``, ``"disabled: ..."``), or how the
            brick was chosen (``"tuned: 64x64 faster (x1.10)"``, ``"rule"``).
        key: the decision key (``mlx_bricks.runtime.kind.Key``).
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
        settings: per op kind name, the patch's settings for that kind (e.g. the SwiGLU
            variant asked for); the kind interprets them (``OpKind.rule_kwargs``,
            ``restrict``, ``settings_suffix``, its composites), the dispatch only hands them
            over.
        common: settings every kind receives (under its own, which win on a clash), e.g.
            the dequantize cap of the composites.
        progress: show the tuner's progress bar (None: when stderr is a terminal).
    """

    def __init__(self, backend: BackendChoice, tune: str, *, settings: dict | None = None,
                 common: dict | None = None, progress: bool | None = None):
        if tune not in TUNE_MODES:
            raise ValueError(f"tune must be one of {', '.join(map(repr, TUNE_MODES))}, "
                             f"got {tune!r}")
        self.backend = backend.name
        self.mode = tune
        self.tuning = tunes(backend, tune)
        self.composites_only = no_kernel_backend(backend)
        self.guarded = backend.name in GUARDED_BACKENDS
        self.settings = dict(settings or {})
        self.common = dict(common or {})
        #: The settings as one stable string (part of a whole-block decision's key).
        self.settings_key = json.dumps({**self.common, **self.settings}, sort_keys=True,
                                       default=str, separators=(",", ":"))
        #: Why kernel variants are no candidates on this device (MLX's own kernels use its
        #: neural accelerators), or None.
        self.accelerated = neural_accelerators() if backend.name == "metal" else None
        self.progress = progress
        #: Calls of one piece a forward makes (the layers sharing its key): what a kernel's
        #: build is weighed against in ``cached`` mode (``tune.prior.pays``).
        self.calls_hint = 1
        #: ``"<backend>|<key>" -> Decision`` taken for this model (cached or measured).
        self.decisions: dict[str, Decision] = {}
        #: Guard reasons this model's pieces met (disabled variants), in order.
        self.failures: list[str] = []
        self._cache = None
        if self.tuning and tune == "cached":
            self.why = ("cached: decisions measured earlier on this device, else the prior "
                        "(tune.prior); nothing is measured in this process, and a kernel runs "
                        "only where its gain pays its build")
        elif self.tuning:
            what = ("composites of stock ops (no kernel backend)" if self.composites_only
                    else "brick variants")
            self.why = (f"{tune}: each piece's {what} timed against stock on this "
                        "device" + (" (cached decisions reused)" if tune == "auto" else
                                    " (re-measured, cache overwritten)"))
        elif tune == "off":
            self.why = "off: the ops' own tile and variant rules, no measurement"
        else:
            self.why = (f"not applied: backend {backend.name} was named "
                        f"({backend.source}); the bricks run as asked")

    def admits(self, weights) -> bool:
        """Whether a module whose bricks read ``weights`` (what ``formats.layers.weight_of``
        gives for each of its linears) is patched: always with a kernel backend; with
        composites only, where any weight is quantized or all are bfloat16 arrays and MLX runs
        on the CPU. There MLX's GEMM is tens of times behind the composites' NumPy float32 BLAS
        products (512 x 512 x 8192, 2-core x86, 2026-12-07: MLX bf16 5.6 GFLOP/s, float16 4.4,
        float32 2.3, NumPy float32 145), and a bf16 product rounded once from float32 is as
        close to the truth as stock's; float16 and float32 models stay exactly stock (the
        default model's greedy text is stock's, tests/test_patch_cpu.py)."""
        from mlx_bricks.cpu import on_cpu
        from mlx_bricks.formats import format_of

        weights = [w for w in weights if w is not None]
        if not self.composites_only or any(format_of(w).quantized for w in weights):
            return True
        return bool(weights) and on_cpu() and all(
            getattr(w, "dtype", None) == mx.bfloat16 for w in weights)

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

    def _memory_cap(self):
        """The tuner's memory bound: the dequantize cap, raised per call as the composites
        raise it (``options.call_cap``), to stock's peak for the call (which holds the
        products a composite's tiles are bounded by); None without a cap."""
        cap = self.common.get(CAP_SETTING)
        if cap is None:
            return None
        strict = self.common.get(CAP_STRICT_SETTING, True)
        return lambda stock_peak: call_cap(cap, strict, self.backend, stock_peak)

    def _settings(self, k) -> dict:
        return {**self.common, **self.settings.get(k.name, {})}

    def _candidates(self, k, names: tuple[str, ...], args) -> list[Variant]:
        """The kind's candidates for the kernel variants ``names`` of its listing (and its
        composites), as the patch's settings allow."""
        s = self._settings(k)
        return k.restrict(k.variants(self.backend, args=args, names=names, settings=s), s)

    def _rule(self, k, names: tuple[str, ...], args) -> Variant | None:
        """The untuned choice: the brick by its own rules (``reference``: its MLX ops), or None
        where the brick has no kernel for these arguments on this backend (``names``: its
        listing)."""
        kwargs = k.rule_kwargs(args, self._settings(k))
        if self.backend == "reference":
            return k.variant("reference", kwargs)
        if not names:
            return None
        return k.variant(kwargs.get("variant", "rule"), kwargs)

    def _decided(self, full: str, measure, usable=None) -> Decision | None:
        """The decision stored under ``full``: this dispatch's memory, else (``auto``) the
        decision cache (unless ``usable(decision)`` is False), else ``measure()`` written to
        the cache when it timed something. None when there is none and ``measure`` is None or
        returns None."""
        d = self.decisions.get(full)
        if d is not None:
            return d
        if self.mode in ("auto", "cached"):
            data = self.cache.get(full)
            if data is not None:
                try:
                    d = Decision.from_dict(full, data)
                except ValueError:
                    d = None
                if d is not None and usable is not None and not usable(d):
                    d = None
        if d is None:
            d = None if measure is None else measure()
            if d is None:
                return None
            if d.stock_s is not None or d.variants:
                self.cache.put({full: d.to_dict()})
        self.decisions[full] = d
        return d

    def decision(self, k, args, cands: list[Variant] | None = None) -> Decision:
        """The tuning decision for ``args`` of op kind ``k`` (memory, cache, or measured);
        ``cands``: its candidates if the caller has them already."""
        full = f"{self.backend}|{k.key(args)}{k.settings_suffix(self._settings(k))}"

        def candidates() -> list[Variant]:
            nonlocal cands
            if cands is None:
                cands = self._candidates(k, k.listing(self.backend, k.dtype(args), args), args)
            return cands

        def usable(d):  # a cached brick winner the op no longer offers is decided again
            return not d.brick or d.winner in {v.name for v in candidates()}

        if self.mode != "cached":
            return self._decided(
                full, lambda: tune_op(k, args, self.backend, variants=candidates(),
                                      guard=GUARD, progress=self.progress,
                                      memory_cap=self._memory_cap()), usable=usable)
        d = self._decided(full, lambda: prior_decision(k, args, candidates(), self.backend,
                                                       full), usable=usable)
        if d.brick and d.source == "cache":
            v = next(c for c in candidates() if c.name == d.winner)
            if v.builds and not pays(d, self.backend, self.calls_hint, built=built(v)):
                d = without_builds(d, {c.name for c in candidates() if not c.builds}, full)
                self.decisions[full] = d
        return d

    def block_decision(self, key: str, measure) -> Decision | None:
        """The whole-block decision stored under ``key`` (``"<backend>|block[...]"``: the
        pieces' keys and winners): this dispatch's memory, else (``auto``) the decision cache,
        else ``measure()`` (a :class:`Decision` whose winner is ``"bricks"`` or stock, or None
        when the call cannot be timed), written to the cache; ``cached`` mode never measures.
        None: no decision (yet)."""
        return self._decided(key, None if self.mode == "cached" else measure)

    def choose(self, kind, args: dict) -> Choice:
        """What one piece runs for one call: ``kind`` is the piece's op kind (an ``OpKind``, or
        a registered kind name), ``args`` its arguments (activations may be ``Act``
        placeholders). May measure (tuning, first call of a key). The kind's candidates are
        computed once here and serve the rule, the decision and the winner's variant."""
        k = kind_of(kind) if isinstance(kind, str) else kind
        key, dtype = k.key(args), k.dtype(args)
        names = k.listing(self.backend, dtype, args)
        if self.accelerated is not None and self.tuning:
            names = ()  # stock is MLX on the accelerators: only composites of stock ops compete
        cands = self._candidates(k, names, args)
        if not self.tuning or k.untuned_reason(args) is not None:
            v = self._rule(k, names, args)
            if v is None:
                return Choice(None, f"no {self.backend} kernel for {k.name} ({key.dtype}, "
                              f"w={key.weights})", key)
            reason = "rule"
        elif not cands:
            if self.accelerated is not None:
                return Choice(None, f"stock kept: {self.accelerated}", key, tuned=True)
            what = ("no kernel backend on this machine and no composite" if
                    self.composites_only else f"no {self.backend} kernel")
            return Choice(None, f"{what} for {k.name} ({key.dtype}, w={key.weights})", key)
        else:
            d = self.decision(k, args, cands)
            if not d.brick:
                return Choice(None, d.reason, key,
                              tuned=d.ratio is not None or d.source == "prior")
            v = next(c for c in cands if c.name == d.winner)
            reason = d.reason
        if self.guarded:
            why = GUARD.disabled_reason(self.backend, k.name, v.name, key.scope)
            if why is not None:
                return Choice(None, f"disabled: {why}", key)
        return Choice(v, reason, key)

    def run(self, choice: Choice, kind, args: dict, stock):
        """Run the brick of ``choice`` on ``args`` (real arrays) through the guard.

        Args:
            stock: zero-argument callable computing the piece the stock way (the module's
                own mlx-lm code), used when the brick is or becomes disabled.

        Returns:
            ``(output, None)``, or ``(stock output, "disabled: <reason>")``.
        """
        k = kind_of(kind) if isinstance(kind, str) else kind
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
            "settings": dict(self.common),
            "decisions": [
                {"key": key, "winner": d.winner, "ratio": d.ratio, "reason": d.reason,
                 "source": d.source, "measured": d.measured, "stock_rounds": d.stock_rounds}
                for key, d in self.decisions.items()],
            "disabled": list(self.failures),
        }
