"""The decode gate: one check per forward, not per module.

A patched module's own ``__call__`` sends decode (L == 1) to the stock code after its checks,
tens of microseconds of Python per module and token (H100, 2026-12-05: generation 0.65-0.85x
stock with 32-64 patched modules). The gate is a mixin on the top-level model: each forward
looks at the token count once; the first decode forward switches every patched module back to
its original class (the stock code, no bricks Python at all), the next prefill forward switches
them to the bricks classes again. Each switch costs one ``__class__`` assignment per module, twice
per generated sequence, and nothing per token.

Decode forwards are counted once, on the gate, and added to each gated module's
``stock[DECODE]`` counter when a report reads it (:meth:`DecodeGate.flush`), so reports count as
before.
"""
from __future__ import annotations

import mlx.nn as nn

from mlx_bricks.nn.calls import DECODE


class DecodeGate:
    """The patched modules of one model and which classes they run now.

    Args:
        modules: the patched modules (their current classes are the bricks classes).

    Attributes:
        prefill: True while the modules run their bricks classes.
        decode_forwards: decode forwards not yet added to the modules' counters.
        suspended: while True, forwards switch nothing (``patch.stock_path`` A/B timing).
    """

    def __init__(self, modules):
        self.modules = [(m, type(m), type(m)._bricks_base) for m in modules]
        self.prefill = True
        self.decode_forwards = 0
        self.suspended = False
        for m, _, _ in self.modules:
            m._bricks_state.gate = self

    def forward(self, inputs) -> None:
        """Called once per model forward with the model's first argument: token ids
        ``(B, L)`` (or embeddings ``(B, L, D)``); L == 1 is a decode step."""
        if self.suspended:
            return
        shape = getattr(inputs, "shape", None)
        decode = shape is not None and len(shape) >= 2 and shape[1] == 1
        if decode:
            self.decode_forwards += 1
            if self.prefill:
                self.switch(prefill=False)
        elif not self.prefill:
            self.switch(prefill=True)

    def switch(self, prefill: bool) -> None:
        """Give every gated module its bricks class (``prefill``) or its original class."""
        for m, bricks, base in self.modules:
            m.__class__ = bricks if prefill else base
        self.prefill = prefill

    def flush(self) -> None:
        """Add the decode forwards counted so far to each module's ``stock[DECODE]``."""
        n, self.decode_forwards = self.decode_forwards, 0
        if n:
            for m, _, _ in self.modules:
                m._bricks_state.stock[DECODE] += n


class BricksModel:
    """Mixin over an mlx-lm top-level model: the decode gate's check, then the model's own
    ``__call__`` (any signature; the first argument is the tokens or embeddings)."""

    def __call__(self, inputs, *args, **kwargs):
        self._bricks_gate.forward(inputs)
        return super().__call__(inputs, *args, **kwargs)


_CLASSES: dict[type, type] = {}


def gate_model(model: nn.Module, modules) -> DecodeGate | None:
    """Put the decode gate on ``model`` over its patched ``modules``; None (nothing done) when
    there are none. Undone by :func:`ungate_model`."""
    modules = list(modules)
    if not modules:
        return None
    base = type(model)
    if base not in _CLASSES:
        # the base's names: code that looks at type(model) (its module's Model class, its
        # name) sees the model it loaded
        _CLASSES[base] = type(base.__name__, (BricksModel, base),
                              {"_bricks_base": base, "__module__": base.__module__,
                               "__qualname__": base.__qualname__})
    gate = DecodeGate(modules)
    model.__class__ = _CLASSES[base]
    object.__setattr__(model, "_bricks_gate", gate)  # kept out of the parameter tree
    return gate


def model_gate(model) -> DecodeGate | None:
    """The gate on ``model``, or None."""
    return getattr(model, "__dict__", {}).get("_bricks_gate")


def ungate_model(model) -> None:
    """Remove the gate: every gated module back to its bricks class (the caller detaches them),
    counters flushed, the model's own class restored. Safe on a model without a gate."""
    gate = model.__dict__.pop("_bricks_gate", None)
    if gate is None:
        return
    gate.switch(prefill=True)
    gate.flush()
    if isinstance(model, BricksModel):
        model.__class__ = type(model)._bricks_base
