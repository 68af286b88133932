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
    if shape_key is not None:
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
