"""Measure one op at one shape: every brick variant against stock, in the same process.

:func:`tune_op` builds synthetic activations of the call's shapes (the weights are the real
ones), runs stock once, runs every candidate variant once eagerly (a build error disables it, as
the guard does) and checks it against a high-precision reference with the dtype-scaled rule (a
variant that fails can never win), times stock and the passing variants interleaved
(``timing.time_interleaved``: several calls per evaluation, ``mx.synchronize``, median; the
check's calls are the warm-up, and a slow candidate's rounds are bounded by
:data:`ROUND_BUDGET_S`), and picks the winner: the fastest variant when it beats stock by at
least :data:`MIN_SPEEDUP`, else stock.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import mlx.core as mx

from mlx_bricks.tune.check import KERNEL_ERRORS, one_line
from mlx_bricks.tune.timing import time_interleaved

#: The winner's name when no brick variant beats stock.
STOCK = "stock"
#: A brick must be at least this much faster than stock (stock time / brick time) to win: below
#: it the difference is within the noise of a few timed rounds, and stock is the safe side.
MIN_SPEEDUP = 1.02
#: Timed rounds per candidate.
REPEATS = 5
#: Seconds of timed rounds one candidate may take (``timing.time_interleaved(budget_s=)``): a
#: call slower than ``ROUND_BUDGET_S / REPEATS`` gets fewer rounds, a call over it one, its
#: calibration call (e.g. MLX 0.32.4's float16 ``quantized_matmul`` on the CPU, seconds per
#: call, against tens of milliseconds for a composite: the decision is not close).
ROUND_BUDGET_S = 2.0


@dataclass
class Decision:
    """The tuner's answer for one (backend, decision key).

    Attributes:
        key: ``"<backend>|<Key>"``.
        winner: :data:`STOCK` or the winning variant's name.
        kwargs: the winner's op keyword arguments (``{}`` for stock).
        ratio: stock seconds / the fastest passing variant's seconds (above 1: the brick is
            faster); None when no variant passed or none exists.
        stock_s: median seconds per call of stock (None when nothing was timed).
        variants: name -> ``{"s": median seconds or None, "ok": passed the check,
            "error": why not, "calls": calls per evaluation, "rounds": timed rounds}``.
        measured: the shapes the timing ran at (``{"M": ...}`` or ``{"q_len", "kv_len"}``).
        source: ``"measured"`` in this process, ``"cache"``, or ``"prior"`` (nothing
            measured: ``tune.prior``; never cached).
        note: why nothing was measured (no variant on this backend), or that stock failed to
            run at these shapes (then a passing variant wins untimed against it), else empty.
        stock_rounds: timed rounds of stock (fewer than ``REPEATS`` for a slow stock under
            :data:`ROUND_BUDGET_S`), None when nothing was timed.
    """

    key: str
    winner: str
    kwargs: dict = field(default_factory=dict)
    ratio: float | None = None
    stock_s: float | None = None
    variants: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)
    source: str = "measured"
    note: str = ""
    stock_rounds: int | None = None

    @property
    def brick(self) -> bool:
        """True when a brick variant won."""
        return self.winner != STOCK

    @property
    def reason(self) -> str:
        """One phrase for reports: ``"tuned: stock faster (x0.93)"``, ``"tuned: 64x64 faster
        (x1.12)"``..."""
        if self.source == "prior":  # nothing measured: the rule says why
            return self.note
        if self.brick:
            if self.ratio is None:  # stock failed at this shape (note): the brick runs
                return f"tuned: {self.winner} ({self.note})"
            return f"tuned: {self.winner} faster (x{self.ratio:.2f})"
        if self.note:
            return f"tuned: {self.note}"
        if self.ratio is None:  # every variant failed a check: the first one's error says why
            errors = [f"{n}: {v['error']}" for n, v in self.variants.items()
                      if isinstance(v, dict) and v.get("error")]
            more = f"; {len(errors) - 1} more" if len(errors) > 1 else ""
            return ("tuned: no brick variant passed its checks"
                    + (f" ({errors[0]}{more})" if errors else ""))
        if self.ratio < 1:
            return f"tuned: stock faster (x{self.ratio:.2f})"
        return (f"tuned: stock kept (best brick x{self.ratio:.2f}, under the "
                f"x{MIN_SPEEDUP:.2f} margin)")

    def to_dict(self) -> dict:
        """JSON-serialisable form (what the cache stores; ``source`` is not stored)."""
        return {"winner": self.winner, "kwargs": dict(self.kwargs), "ratio": self.ratio,
                "stock_s": self.stock_s, "stock_rounds": self.stock_rounds,
                "variants": self.variants, "measured": self.measured, "note": self.note}

    @classmethod
    def from_dict(cls, key: str, data: dict, source: str = "cache") -> "Decision":
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: ``data`` is not a decision (missing or mistyped fields).
        """
        try:
            winner, kwargs = data["winner"], data.get("kwargs", {})
            ratio = data.get("ratio")
            if not isinstance(winner, str) or not isinstance(kwargs, dict) or not (
                    ratio is None or isinstance(ratio, (int, float))):
                raise TypeError("mistyped field")
            return cls(key, winner, dict(kwargs), ratio, data.get("stock_s"),
                       dict(data.get("variants", {})), dict(data.get("measured", {})),
                       source, str(data.get("note", "")), data.get("stock_rounds"))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not a tuning decision: {e}") from None


def _progress_bar(total: int, desc: str, progress: bool | None):
    from tqdm import tqdm

    show = sys.stderr.isatty() if progress is None else bool(progress)
    return tqdm(total=total, desc=desc, disable=not show, leave=False, file=sys.stderr,
                unit="step")


def _peak_of(fn):
    """``(fn()'s evaluated output, bytes allocated above the memory active before)``. Resets
    MLX's peak counter (the tuner runs before or between a command's timed work)."""
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fn()
    mx.eval(out)
    return out, max(0, mx.get_peak_memory() - before)


def tune_op(kind, args: dict, backend: str, *, variants: list | None = None,
            repeats: int = REPEATS, seed: int = 0, guard=None,
            progress: bool | None = None, budget_s: float | None = ROUND_BUDGET_S,
            memory_cap=None) -> Decision:
    """Time every variant of ``kind`` against stock for the shapes of ``args``.

    Args:
        kind: the op kind (a ``mlx_bricks.runtime.kind.OpKind``).
        args: the op's arguments; activations may be real arrays or ``Act`` placeholders (only
            their shapes and dtypes are used: the tuner times synthetic values), weights are
            used as they are.
        backend: the backend the variants run on.
        variants: the candidates (``runtime.kind.Variant``; default:
            ``kind.variants(backend, dtype, args)``: the brick's listing and composites).
        repeats: timed rounds per candidate.
        seed: seed of the synthetic activations.
        guard: where build and numeric failures are recorded, disabling the variant for the
            process (a ``runtime.guard.Guard``; the dispatch passes the process's), or None
            (recorded in the decision only).
        progress: show a tqdm bar on stderr (None: when stderr is a terminal).
        budget_s: seconds of timed rounds per candidate (``timing.time_interleaved``); None:
            ``repeats`` rounds whatever a call costs.
        memory_cap: bytes a variant's peak memory may exceed stock's by (the dequantize cap),
            or a function of stock's peak bytes (what its call allocates, its products
            included) giving them (a cap raised per call, ``options.call_cap``); a variant
            over it is no candidate (its ``error`` says by how much). None: no limit.

    Returns:
        The :class:`Decision` (``source="measured"``).
    """
    k = kind.key(args)
    key, scope = f"{backend}|{k}", k.scope
    candidates = (kind.variants(backend, kind.dtype(args), args) if variants is None
                  else list(variants))
    measured = kind.measured(args)
    if not candidates:
        return Decision(key, STOCK, measured=measured, note=f"no brick variant on {backend}")
    synth = kind.synthetic(args, seed)
    mx.eval([synth[n] for n in kind.activations if synth.get(n) is not None])
    results: dict[str, dict] = {}
    passing: dict = {}
    bar = _progress_bar(len(candidates) + 1, f"mlx-bricks tune {kind.key(args)}", progress)
    try:
        # Stock can fail where a brick runs (MLX 0.32.4 CUDA's gather_qmm at 8192 tokens top-8:
        # cuGraphAddKernelNode invalid argument): then the check is against the reference alone
        # and a passing variant wins without a race; a generation must not die in the tuner.
        stock_error = ""
        stock_peak = 0
        try:
            naive, stock_peak = _peak_of(lambda: kind.stock(synth))
        except KERNEL_ERRORS as e:
            naive, stock_error = None, f"stock failed: {one_line(e)}"
        if callable(memory_cap):  # (stock's peak holds its products: a grown cap's bound)
            memory_cap = None if stock_error else memory_cap(stock_peak)
        for v in candidates:
            bar.set_postfix_str(f"check {v.name}")
            reason = (None if guard is None
                      else guard.disabled_reason(backend, kind.name, v.name, scope))
            peak = None
            if reason is None:
                try:
                    out, peak = _peak_of(lambda v=v: kind.run(v, synth, backend))
                except KERNEL_ERRORS as e:
                    reason = f"{kind.name} variant {v.name} on {backend} failed to build or " \
                             f"run: {one_line(e)}"
                else:
                    check = kind.check(out, naive, synth)
                    if not check.ok:
                        reason = f"{kind.name} variant {v.name} on {backend}: numeric check " \
                                 f"failed ({check})"
                if reason is not None and guard is not None:
                    guard.disable(backend, kind.name, v.name, scope, reason)
                if reason is None and memory_cap is not None and not stock_error and (
                        peak > stock_peak + memory_cap):  # a measurement, not a fault: no guard
                    reason = (f"peak memory {peak / 2**20:.1f} MiB, more than stock's "
                              f"{stock_peak / 2**20:.1f} MiB + the cap {memory_cap / 2**20:g} MiB")
            results[v.name] = {"s": None, "ok": reason is None, "error": reason, "calls": 0,
                               "peak_bytes": peak}
            if reason is None:
                passing[v.name] = v
            bar.update(1)
        if not passing:
            return Decision(key, STOCK, variants=results, measured=measured, note=stock_error)
        bar.set_postfix_str("timing")
        fns = {} if stock_error else {STOCK: lambda: kind.stock(synth)}
        for name, v in passing.items():
            fns[name] = lambda v=v: kind.run(v, synth, backend)
        # every candidate ran once just now (stock's output, the checks): they are warm
        timing = time_interleaved(fns, repeats=repeats, warm=set(fns), budget_s=budget_s)
        bar.update(1)
    finally:
        bar.close()
    for name in passing:
        results[name].update(s=timing.median(name), calls=timing.calls[name],
                             rounds=len(timing.runs[name]))
    best = min(passing, key=timing.median)
    if stock_error:  # the fastest passing variant, no race against stock
        return Decision(key, best, dict(passing[best].kwargs), None, None, results, measured,
                        note=stock_error)
    stock_s, stock_rounds = timing.median(STOCK), len(timing.runs[STOCK])
    ratio = stock_s / timing.median(best)
    if ratio >= MIN_SPEEDUP:
        return Decision(key, best, dict(passing[best].kwargs), ratio, stock_s, results, measured,
                        stock_rounds=stock_rounds)
    return Decision(key, STOCK, {}, ratio, stock_s, results, measured, stock_rounds=stock_rounds)
