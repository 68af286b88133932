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

The same switch serves a one-shot process's prompt that the bricks would make later (the
first-token guard, ``tune.prior.min_prompt_tokens``): :meth:`DecodeGate.expect_prompt` tells the
gate how long the coming prompt is; below ``min_prompt`` tokens, while the backend has not yet
run a bricks prefill in this process, that prompt's prefill runs the stock classes too.
"""
from __future__ import annotations

import mlx.nn as nn

from mlx_bricks.nn.calls import DECODE

#: Stock-call reason of a prompt the first-token guard kept stock.
FIRST_TOKEN = ("prompt kept stock: the bricks' first prefill in this process would cost more "
               "than it saves (first-token guard, tune/prior.py)")
#: Backends that have run a bricks prefill in this process: their one-off first-use cost is
#: paid, so the first-token guard no longer applies to them.
WARM: set[str] = set()


class DecodeGate:
    """The patched modules of one model and which classes they run now.

    Args:
        modules: the patched modules (their current classes are the bricks classes).
        backend: the name of the backend their bricks run on (the first-token guard's key).

    Attributes:
        prefill: True while the modules run their bricks classes.
        decode_forwards: decode forwards not yet added to the modules' counters.
        suspended: while True, forwards switch nothing (``patch.stock_path`` A/B timing).
        min_prompt: the first-token guard (0: off): a prompt announced by
            :meth:`expect_prompt` with fewer tokens runs stock while ``backend`` is not
            :data:`WARM` (``float("inf")``: every such prompt).
        stock_prompt: True while the announced prompt runs stock.
        stock_prompt_forwards: its prefill forwards not yet added to the counters.
    """

    def __init__(self, modules, backend: str | None = None):
        self.modules = [(m, type(m), type(m)._bricks_base) for m in modules]
        self.backend = backend
        self.prefill = True
        self.decode_forwards = 0
        self.suspended = False
        self.min_prompt = 0
        self.stock_prompt = False
        self.stock_prompt_forwards = 0
        for m, _, _ in self.modules:
            m._bricks_state.gate = self

    def expect_prompt(self, tokens: int) -> bool:
        """Announce the next prompt's length in tokens (``generate_step`` does, through the
        session); returns True when its prefill will run the stock classes (the guard)."""
        self.stock_prompt = bool(self.min_prompt) and self.backend not in WARM and (
            tokens < self.min_prompt)
        return self.stock_prompt

    def forward(self, inputs) -> None:
        """Called once per model forward with the model's first argument: token ids
        ``(B, L)`` (or embeddings ``(B, L, D)``); L == 1 is a decode step."""
        if self.suspended:
            return
        shape = getattr(inputs, "shape", None)
        decode = shape is not None and len(shape) >= 2 and shape[1] == 1
        if decode:
            self.decode_forwards += 1
        elif self.stock_prompt:
            self.stock_prompt_forwards += 1
        else:
            WARM.add(self.backend)
        bricks = not decode and not self.stock_prompt
        if bricks != self.prefill:
            self.switch(prefill=bricks)

    def switch(self, prefill: bool) -> None:
        """Give every gated module its bricks class (``prefill``) or its original class."""
        for m, bricks, base in self.modules:
            m.__class__ = bricks if prefill else base
        self.prefill = prefill

    def flush(self) -> None:
        """Add the decode (and guarded prefill) forwards counted so far to each module's stock
        counters."""
        for reason, n in ((DECODE, self.decode_forwards),
                          (FIRST_TOKEN, self.stock_prompt_forwards)):
            if n:
                for m, _, _ in self.modules:
                    m._bricks_state.stock[reason] += n
        self.decode_forwards = self.stock_prompt_forwards = 0


class BricksModel:
    """Mixin over an mlx-lm top-level model: the decode gate's check, then the model's own
    ``__call__`` (any signature; the first argument is the tokens or embeddings)."""

    def __call__(self, inputs, *args, **kwargs):
        self._bricks_gate.forward(inputs)
        return super().__call__(inputs, *args, **kwargs)


_CLASSES: dict[type, type] = {}


def gate_model(model: nn.Module, modules, backend: str | None = None) -> DecodeGate | None:
    """Put the decode gate on ``model`` over its patched ``modules`` (bricks on ``backend``);
    None (nothing done) when there are none. Undone by :func:`ungate_model`."""
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
    gate = DecodeGate(modules, backend)
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
