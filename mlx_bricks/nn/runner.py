"""How a patched module runs its prefill pieces: its live state (:class:`BricksState`), the
dispatch's choices for a call shape (remembered), one piece run brick-or-stock and counted,
and the all-stock fast path.

A piece is ``(op kind, arguments, stock path)``: the kind and argument builders come from the
bricks' ``piece`` modules, the stock path is the module's own mlx-lm computation.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

#: Call shapes whose choices a module remembers (chunked prefill adds one per chunk offset).
MEMO_SIZE = 64


@dataclass(eq=False)
class BricksState:
    """Settings and live counters of one patched module instance.

    Attributes:
        backend: resolved backend name passed to every op (``metal``/``emulator``/...).
        layer: index of the decoder layer.
        role: ``"block"``, ``"self_attn"`` or a single piece's role (``"mlp"``).
        layout: the architecture's ``nn.layout.BlockLayout``.
        head_dim: attention head size (0 for an MLP).
        kv_quant: None or ``"q8_0"`` (K/V of the attention brick).
        piece: the piece a single-piece module runs (``bricks.swiglu.piece.MLP_PIECE``), None
            for attention and block modules.
        dispatch: the model's dispatcher (``mlx_bricks.runtime.dispatch.Dispatch``): chooses
            brick or stock per piece and runs bricks through the first-call guard.
        calls: brick op name -> number of calls (prefill through the bricks).
        stock: reason -> number of calls that took the stock path because the bricks do not
            cover the call (decode included; a piece's reason starts with its name).
        tuned: ``"<piece>: tuned: stock faster (x0.93)"`` -> calls where a piece ran stock
            because tuning measured stock faster (a decision, not a fallback).
        memo: call shape -> the dispatcher's choices for it (see :func:`choose`).
        structure: the last structure check, ``(fingerprint, reason)``
            (``nn.structure.structure_reason``).
        all_stock: call shape -> ``(guard generation, [(counter, reason)])`` for shapes whose
            pieces all run stock (:func:`stock_fast`).
        checked: call shape -> ``(guard generation, choices, pending key)`` after the
            whole-block check (:func:`check_block`); the key of a decision still to be taken
            for a call that could not be timed, else None.
        checking: True while :func:`check_block` times this module (its own calls then run
            the remembered choices, uncounted).
        gate: the model's ``nn.gate.DecodeGate`` (decode forwards run this module's original
            class and are counted there until :meth:`DecodeGate.flush`), or None.
        sliding: whether the module's layer is a sliding-window layer, where the patch decided
            it from the layer or the model's args (``nn.calls.layer_window``); None: from the
            attention module's ``layout.sliding`` attribute.
    """

    backend: str
    layer: int
    role: str
    layout: object
    head_dim: int = 0
    kv_quant: str | None = None
    piece: object = None
    dispatch: object = field(default=None, repr=False)
    calls: Counter = field(default_factory=Counter)
    stock: Counter = field(default_factory=Counter)
    tuned: Counter = field(default_factory=Counter)
    memo: dict = field(default_factory=dict, repr=False)
    structure: tuple | None = field(default=None, repr=False)
    all_stock: dict = field(default_factory=dict, repr=False)
    checked: dict = field(default_factory=dict, repr=False)
    checking: bool = False
    gate: object = field(default=None, repr=False)
    sliding: bool | None = None


def choose(state: BricksState, shape_key: tuple, pieces) -> dict:
    """``{piece: Choice}`` for the call shape ``shape_key``; ``pieces()`` builds
    ``{piece: (op kind, args)}`` (activations may be ``Act`` placeholders) when the choices are
    not remembered yet. Remembered per module and call shape, so a prefill call pays a dict
    lookup, not the dispatcher; forgotten when the guard disables a variant."""
    d = state.dispatch
    hit = state.memo.get(shape_key)
    if hit is not None and hit[0] == d.generation:
        return hit[1]
    choices = {name: d.choose(kind, args) for name, (kind, args) in pieces().items()}
    if len(state.memo) >= MEMO_SIZE:
        state.memo.clear()
    state.memo[shape_key] = (d.generation, choices)
    return choices


def _stock_count(state: BricksState, name: str, choice) -> tuple:
    """``(counter, reason)`` a stock run of piece ``name`` is counted under."""
    return (state.tuned if choice.tuned else state.stock), f"{name}: {choice.reason}"


def all_stock(state: BricksState, choices: dict, shape_key=None) -> bool:
    """True (and every piece counted) when no piece runs a brick; remembered for
    :func:`stock_fast` under ``shape_key``."""
    if any(c.brick for c in choices.values()):
        return False
    counts = [_stock_count(state, name, c) for name, c in choices.items()]
    for counter, reason in counts:
        counter[reason] += 1
    if shape_key is not None and not state.checking:  # the check's calls count apart
        if len(state.all_stock) >= MEMO_SIZE:
            state.all_stock.clear()
        state.all_stock[shape_key] = (state.dispatch.generation, counts)
    return True


def stock_fast(state: BricksState, shape_key) -> bool:
    """True (and counted as before) when every piece of this call shape ran stock last time:
    the module's own code then runs without the structure check or the dispatcher, whose
    Python cost (tens of microseconds per layer) would otherwise make an all-stock model
    measurably slower than stock at short prompts. The stock path is right for any structure;
    a guard change (new generation) or re-patching forgets it."""
    hit = state.all_stock.get(shape_key)
    if hit is None or hit[0] != state.dispatch.generation:
        return False
    for counter, reason in hit[1]:
        counter[reason] += 1
    return True


def run_piece(state: BricksState, name: str, choice, kind, args, stock):
    """One piece: its brick on ``args()`` (through the dispatcher's guard) or ``stock()``,
    counted under the kind's op name. ``args`` builds the op's arguments; it is called only
    when the brick runs."""
    if not choice.brick:
        counter, reason = _stock_count(state, name, choice)
        counter[reason] += 1
        return stock()
    out, failed = state.dispatch.run(choice, kind, args(), stock)
    if failed is None:
        state.calls[kind.op_name] += 1
    else:
        state.stock[f"{name}: {failed}"] += 1
    return out


def _scratch_cache(cache):
    """A factory of empty caches like ``cache`` (None: no cache), or None when the call cannot
    be repeated on a scratch cache (a cache already holding tokens, another cache type)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if cache is None:
        return lambda: None
    # the type first: a BatchKVCache's offset is an array (one per sequence)
    if type(cache) is KVCache and cache.offset == 0:
        return KVCache
    if type(cache) is RotatingKVCache and cache.offset == 0:
        return lambda: RotatingKVCache(max_size=cache.max_size, keep=cache.keep)
    return None


def check_block(state: BricksState, shape_key, choices: dict, cache, run_patched, run_stock,
                tokens: int, repeatable: bool = True) -> dict:
    """The choices a block (or an attention module: the same applies) runs for ``shape_key``
    once the whole module has been weighed.

    The pieces are tuned one by one; leaving the block's all-stock path also costs per-call
    Python that no piece's timing sees, so where tuning applies on a backend of
    ``runtime.dispatch.BLOCK_CHECK_BACKENDS`` and a piece chose a brick, the block is timed
    whole (``run_patched(cache)``: the block with these choices; ``run_stock(cache)``: its
    mlx-lm ``__call__``; on the call's own input and mask, each call on an empty scratch
    cache, interleaved, median) and the bricks stand only when the block is faster
    (stock time / block time >= ``MIN_SPEEDUP``, as for a piece). Otherwise every piece runs
    stock, counted as ``"<piece>: tuned: block stock faster (x0.85)"``, and the all-stock fast
    path takes the shape. The decision is stored like a piece's (``Dispatch.block_decision``;
    key: the model file, cache use, the pieces' keys and winners, the settings), so a model
    pays it once per device. A call that cannot be repeated (a cache holding tokens, another
    cache type, under ``mx.compile``) keeps the pieces' choices unweighed until a call that
    can be repeated has decided the same key; a guard change while timing discards the
    timing. Counters are left as they were. ``tokens``: the call's L, recorded as measured;
    ``repeatable`` False (a row-sharded block, whose all-sums every rank must run alike):
    never timed here, a cached decision still applies.

    Source: this project's measurement (docs/tuning.md, "The whole block").
    """
    from mlx_bricks.runtime.dispatch import BLOCK_CHECK_BACKENDS, Choice
    from mlx_bricks.tune.check import KERNEL_ERRORS
    from mlx_bricks.tune.timing import time_interleaved
    from mlx_bricks.tune.tuner import MIN_SPEEDUP, REPEATS, STOCK, Decision

    d = state.dispatch
    if (state.checking or not d.tuning or d.backend not in BLOCK_CHECK_BACKENDS
            or not any(c.brick for c in choices.values())):
        return choices
    generation = d.generation
    hit = state.checked.get(shape_key)
    if hit is not None and hit[0] == generation and (hit[2] is None
                                                     or hit[2] not in d.decisions):
        return hit[1]  # weighed, or not weighable and still undecided (a dict lookup)
    scratch = _scratch_cache(cache) if repeatable else None
    pieces = "; ".join(f"{name}: {c.key} {c.variant.name if c.brick else STOCK}"
                       for name, c in choices.items())
    key = (f"{d.backend}|block[{state.layout.module} cache={int(cache is not None)}; "
           f"{pieces}; settings={d.settings_key}]")

    def measure():
        saved = (state.calls, state.stock, state.tuned)
        state.calls, state.stock, state.tuned = Counter(), Counter(), Counter()
        state.checking = True
        try:
            t = time_interleaved({"bricks": lambda: run_patched(scratch()),
                                  STOCK: lambda: run_stock(scratch())}, repeats=REPEATS)
        except KERNEL_ERRORS:  # under a transformation (mx.compile), out of memory...
            return None
        finally:
            state.checking = False
            state.calls, state.stock, state.tuned = saved
        if d.generation != generation:  # the guard disabled a variant while timing: the
            return None  # timing is not of these choices (they are chosen again next call)
        b, s = t.median("bricks"), t.median(STOCK)
        return Decision(key, "bricks" if s >= MIN_SPEEDUP * b else STOCK, ratio=s / b,
                        stock_s=s, variants={"bricks": {
                            "s": b, "ok": True, "calls": t.calls["bricks"],
                            "rounds": len(t.runs["bricks"])}},
                        measured={"L": tokens}, stock_rounds=len(t.runs[STOCK]))

    verdict = d.block_decision(key, None if scratch is None else measure)
    if d.generation != generation:
        return choices  # chosen again at the next call
    if len(state.checked) >= MEMO_SIZE:
        state.checked.clear()
    if verdict is None:  # not weighable now: remembered until the key is decided
        state.checked[shape_key] = (generation, choices, key)
        return choices
    if not verdict.brick:
        ratio = "" if verdict.ratio is None else f" (x{verdict.ratio:.2f})"
        why = f"tuned: block stock faster{ratio}"
        choices = {name: Choice(None, why, c.key, tuned=True) for name, c in choices.items()}
        state.memo[shape_key] = (generation, choices)
    state.checked[shape_key] = (generation, choices, None)
    return choices
