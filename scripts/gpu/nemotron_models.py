"""The 4-layer Nemotron-3-Nano-shaped model (bench.ssm.NEMOTRON3_4LAYER) the GPU diagnostics
time: bf16, stock and patched (tune auto) on the same parameters, a T-token prompt, and one
forward as a single call (what ``bench.e2e.prefill`` evaluates in mlx-lm's prefill step: the
layers into a fresh cache, no LM head), for scripts that time or split one graph.
``MODEL=lfm2_q4`` (environment): the LFM2-1.2B-shaped model (bench.ssm.LFM2_1B_4LAYER) with
4-bit gs64 linears instead; ``MODEL=nemotron_q4`` the Nemotron one in 4-bit."""
import os

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_bricks.bench.e2e import _models
from mlx_bricks.bench.ssm import LFM2_1B_4LAYER, NEMOTRON3_4LAYER
from mlx_bricks.patch import patch_model

SHAPE, FMT = {"nemotron": (NEMOTRON3_4LAYER, None), "nemotron_q4": (NEMOTRON3_4LAYER, (4, 64)),
              "lfm2_q4": (LFM2_1B_4LAYER, (4, 64))}[os.environ.get("MODEL", "nemotron")]


def models(T):
    """``(stock, patched, tokens)``: the two models and a (1, T) prompt."""
    stock, patched = _models(SHAPE, "bf16", FMT)
    patch_model(patched, tune="auto")
    return stock, patched, mx.random.randint(0, SHAPE.vocab, (1, T), key=mx.random.key(T))


def forward(model, tokens):
    """A zero-argument forward of ``model`` on ``tokens``: the cache states' arrays (a tuple,
    lazy; unset entries and offsets left out)."""
    def fwd():
        cache = make_prompt_cache(model)
        model(tokens, cache=cache)
        states = tree_flatten([c.state for c in cache])
        return tuple(a for _, a in states if isinstance(a, mx.array))
    return fwd
