"""Decode never does more than stock: after a prefill through the bricks, a patched model's
decode step builds exactly stock's graph (the same primitives, as many of each) on the cache
the bricks wrote, and every patched module runs its original class during decode (one check
per forward, on the model: ``nn.gate``).

Families: Llama (the unified block), Qwen3-Next and Qwen3.5 (Gated DeltaNet mixers, MoE
experts, gated attention), gpt-oss (mxfp4 MoE experts, attention sinks, sliding windows),
Gemma 3 and Gemma 4 (sliding windows, shared K/V), all with 4-bit weights where the format
allows (the composites then run in prefill on the reference backend).
"""
from __future__ import annotations

import collections
import os
import re
import tempfile

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_bricks.nn import is_patched
from mlx_bricks.nn.gate import model_gate
from mlx_bricks.patch import patch_model, unpatch_model
from tests.models import build_model, tokens

FAMILIES = ("llama", "qwen3_next", "qwen3_5", "gpt_oss", "gemma3_text", "gemma4_text")
PROMPT = 24


def _quantize(model, model_type: str) -> None:
    mode, gs = ("mxfp4", 32) if model_type == "gpt_oss" else ("affine", 64)
    nn.quantize(model, group_size=gs, bits=4, mode=mode, class_predicate=lambda p, m: (
        hasattr(m, "to_quantized") and "layers" in p and m.weight.shape[-1] % gs == 0))


def primitives(y) -> collections.Counter:
    """The primitives of ``y``'s lazy graph, counted by name (``mx.export_to_dot``)."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, y)
        text = open(path).read()
    finally:
        os.remove(path)
    return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', text))


def decode_graph(model, prompt):
    """Prefill ``prompt`` into a fresh cache (everything evaluated), then one decode step:
    ``(primitives of its logits' graph, the logits)``, counted before evaluation."""
    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)
    mx.eval(logits, [a for c in cache for _, a in tree_flatten(c.state)
                     if isinstance(a, mx.array)])
    step = model(prompt[:, -1:], cache=cache)
    return primitives(step), step


@pytest.mark.parametrize("model_type", FAMILIES)
def test_decode_step_is_stock_work_after_a_bricks_prefill(model_type):
    model = build_model(model_type, mx.float16)
    _quantize(model, model_type)
    prompt = tokens(PROMPT, seed=1)
    stock_ops, _ = decode_graph(model, prompt)
    report = patch_model(model, backend="reference")
    patched = [m for m in model.modules() if is_patched(m)]
    assert patched, report
    ops, _ = decode_graph(model, prompt)
    gate = model_gate(model)
    # the decode forward switched every patched module to its original class
    assert not gate.prefill and all(not is_patched(m) for m in patched)
    assert ops == stock_ops, (ops - stock_ops, stock_ops - ops)
    assert sum(report.calls().values()) > 0  # the prefill did run bricks
    unpatch_model(model)
