"""Gated DeltaNet mixers patched by module: tiny random qwen3_5 / qwen3_next models, patched vs
stock (logits within the dtype rule against a float32 truth, greedy tokens equal, the cache
written as stock writes it, two prefills == one, unpatch exact), and the report."""
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from mlx_bricks.patch import patch_model, patch_report, unpatch_model
from tests.tolerance import assert_dtype_close

VOCAB = 256
TEXT = dict(hidden_size=64, num_hidden_layers=4, intermediate_size=96, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, vocab_size=VOCAB,
            linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
            tie_word_embeddings=False, max_position_embeddings=4096)


def build(model_type: str, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    if model_type == "qwen3_5_moe":
        from mlx_lm.models import qwen3_5_moe as mod

        args = mod.ModelArgs.from_dict({"model_type": model_type, "text_config": {
            **TEXT, "model_type": model_type, "num_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}})
    elif model_type == "qwen3_next":
        from mlx_lm.models import qwen3_next as mod

        args = mod.ModelArgs(model_type=model_type, **TEXT, num_experts=0,
                             num_experts_per_tok=0, decoder_sparse_step=1,
                             shared_expert_intermediate_size=0, mlp_only_layers=[],
                             moe_intermediate_size=0, rope_theta=10000.0,
                             partial_rotary_factor=0.25)
    else:
        from mlx_lm.models import qwen3_5 as mod

        args = mod.ModelArgs.from_dict({"model_type": model_type, "text_config": {
            **TEXT, "model_type": model_type}})
    model = mod.Model(args)
    # weights large enough that the recurrence matters (dt_bias / A_log as mlx-lm inits them)
    params = tree_map(lambda p: p * 2.0 if p.ndim == 2 else p, model.parameters())
    model.update(params)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tokens(n, batch=1, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, (batch, n)), dtype=mx.uint32)


def assert_same_greedy(out, stock, truth):
    """Greedy tokens equal wherever the float32 truth's top-2 gap exceeds four times stock's own
    error in that row: the dtype rule lets the patched model be twice as far from the truth as
    stock (attention and MLP patched too), and a random tiny model has near-ties that bfloat16
    rounding alone flips."""
    t = np.array(truth.astype(mx.float32))[0]
    noise = np.abs(np.array(stock.astype(mx.float32))[0] - t).max(-1)
    top2 = np.sort(t, -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 4 * noise
    a, b = np.array(mx.argmax(out, -1))[0], np.array(mx.argmax(stock, -1))[0]
    assert clear.sum() > 0 and (a[clear] == b[clear]).all()


def run(model, toks, cache=None):
    out = model(toks, cache=cache)
    mx.eval(out)
    return out


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_patched_matches_stock(model_type, dtype):
    model = build(model_type, dtype)
    truth_model = build(model_type, mx.float32)
    toks = tokens(70)
    truth = run(truth_model, toks)  # float32 stock: the truth for the half model
    stock_cache = model.make_cache()
    stock = run(model, toks, stock_cache)
    # the MLPs stay stock: the Gated DeltaNet layers then see stock's inputs, so their states
    # are compared with the recurrence's own error only (the full-attention layer is patched)
    report = patch_model(model, backend="reference", mlp=False)
    gdn = [m for m in report.modules if m.module == "linear_attn"]
    assert len(gdn) == 3 and all(m.status == "patched" for m in gdn), report
    assert "Gated DeltaNet" in gdn[0].variant
    cache = model.make_cache()
    out = run(model, toks, cache)
    assert sum(m.calls.get("gated_delta", 0) for m in gdn) == 3
    # the big projections ran as linear stages (qkv, z, out; qwen3_next: qkvz, out)
    assert sum(m.calls.get("linear", 0) for m in gdn) == 3 * (3 if model_type == "qwen3_5" else 2)
    if dtype == mx.float32:
        np.testing.assert_allclose(np.array(out), np.array(stock), atol=2e-4, rtol=2e-4)
    else:
        assert_dtype_close(out, truth, stock, dtype=dtype, what=f"{model_type} logits")
    assert_same_greedy(out, stock, truth)
    # the cache as stock writes it: conv state, recurrent state (float32), offset
    # (layer 0's conv state is its input's: bit-equal; later layers' inputs went through
    # the recurrence)
    for i, (c, s) in enumerate(zip(cache, stock_cache)):
        if hasattr(c, "keys"):
            continue
        if i == 0:
            assert mx.array_equal(c[0], s[0])
        np.testing.assert_allclose(np.array(c[0].astype(mx.float32)),
                                   np.array(s[0].astype(mx.float32)), atol=0.05, rtol=0.05)
        assert c[1].dtype == s[1].dtype == mx.float32
        np.testing.assert_allclose(np.array(c[1]), np.array(s[1]), atol=5e-4, rtol=1e-3)
    # decode: stock's own step, counted
    step = run(model, toks[:, -1:], cache)
    stock_step = run(build(model_type, dtype), toks[:, -1:], stock_cache)
    assert mx.array_equal(mx.argmax(step, -1), mx.argmax(stock_step, -1))
    assert sum(m.stock_calls.get("decode (L == 1): stock path by design", 0) for m in gdn) == 3
    assert unpatch_model(model) == report.n_patched
    again = run(model, toks, model.make_cache())
    assert mx.array_equal(again, stock)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_two_prefills_equal_one(model_type):
    model = build(model_type, mx.float32)
    report = patch_model(model, backend="reference")
    assert [m.status for m in report.modules if m.module == "linear_attn"] == ["patched"] * 3
    toks = tokens(90, seed=1)
    whole = run(model, toks, model.make_cache())
    stock_whole = run(build(model_type, mx.float32), toks, None)
    np.testing.assert_allclose(np.array(whole), np.array(stock_whole), atol=2e-4, rtol=2e-4)
    cache = model.make_cache()
    first = run(model, toks[:, :41], cache)
    second = run(model, toks[:, 41:], cache)
    np.testing.assert_allclose(np.array(mx.concatenate([first, second], 1)), np.array(whole),
                               atol=2e-4, rtol=2e-4)


def test_greedy_generation_equal():
    from mlx_lm.generate import generate_step

    model = build("qwen3_5", mx.bfloat16, seed=2)
    prompt = tokens(40, seed=3)[0]

    def greedy():
        out = []
        for tok, _ in generate_step(prompt, model, max_tokens=8, sampler=lambda x: mx.argmax(x, -1)):
            out.append(int(tok))
        return out

    stock = greedy()
    patch_model(model, backend="reference")
    assert greedy() == stock


def test_padded_batch():
    """mlx-lm's left-padded batch (ArraysCache left_padding, make_mask): the padded rows'
    logits match each prompt run alone."""
    from mlx_lm.models.cache import ArraysCache, BatchKVCache

    model = build("qwen3_5", mx.float32, seed=4)
    patch_model(model, backend="reference")
    a, b = tokens(20, seed=5), tokens(13, seed=6)
    alone_b = run(model, b, model.make_cache())
    batch = mx.concatenate([a, mx.concatenate([mx.zeros((1, 7), mx.uint32), b], 1)], 0)
    cache = [ArraysCache(size=2, left_padding=[0, 7]) if layer.is_linear
             else BatchKVCache(left_padding=[0, 7]) for layer in model.layers]
    out = run(model, batch, cache)
    gdn = [m for m in patch_report(model).modules if m.module == "linear_attn"]
    assert sum(m.calls.get("gated_delta", 0) for m in gdn) == 6  # alone, then the batch
    np.testing.assert_allclose(np.array(out[1, 7:]), np.array(alone_b[0]), atol=1e-3)


def test_report_and_no_kernel_backend_tuning(tmp_path, monkeypatch):
    """Auto backend on this CPU (no kernel backend): the mixers are patched and each shape is
    tuned (the chunked composite against stock's token loop); whichever wins runs."""
    from mlx_bricks.backends import active_backend

    if active_backend(None).name != "reference":
        pytest.skip("a kernel backend is available here")
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path))
    model = build("qwen3_5", mx.bfloat16)
    stock = run(model, tokens(64))
    report = patch_model(model)
    gdn = [m for m in report.modules if m.module == "linear_attn"]
    assert all(m.status == "patched" for m in gdn)
    out = run(model, tokens(64))
    assert (mx.argmax(out, -1) == mx.argmax(stock, -1)).mean().item() > 0.95
    decisions = report.dispatch.summary()["decisions"]
    assert any("gated_delta" in d["key"] for d in decisions)
    text = str(report)
    assert "linear_attn" in text


def test_unknown_mixer_stays_stock():
    """A Gated DeltaNet class whose forward the patch does not follow (here a subclass with its
    own __call__ that calls gated_delta_update) stays stock with the reason; attention=False
    disables the known ones."""
    from mlx_lm.models import qwen3_5
    from mlx_lm.models.gated_delta import gated_delta_update

    class Custom(qwen3_5.GatedDeltaNet):
        def __call__(self, inputs, mask=None, cache=None):
            assert gated_delta_update is not None
            return super().__call__(inputs, mask, cache)

    model = build("qwen3_5", mx.float32)
    model.layers[0].linear_attn.__class__ = Custom
    report = patch_model(model, backend="reference")
    entries = [m for m in report.modules if m.module == "linear_attn"]
    assert [m.status for m in entries] == ["fallback", "patched", "patched"]
    assert "forward the patch does not know" in entries[0].reason
    disabled = patch_model(model, backend="reference", attention=False)
    assert all(m.status == "disabled" for m in disabled.modules if m.module == "linear_attn")


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_emulator_runs_the_kernel(model_type):
    """backend='emulator': the Gated DeltaNet layers run the MSL kernel (launch counted) and
    the logits match stock (float32 model: the kernel's rounding only)."""
    from mlx_bricks import kernels

    model = build(model_type, mx.float32, seed=7)
    toks = tokens(45, seed=8)
    stock = run(model, toks, model.make_cache())
    before = kernels.LAUNCH_COUNTS[("gated_delta", "emulator")]
    report = patch_model(model, backend="emulator")
    out = run(model, toks, model.make_cache())
    assert kernels.LAUNCH_COUNTS[("gated_delta", "emulator")] - before == 3
    gdn = [m for m in report.modules if m.module == "linear_attn"]
    assert sum(m.calls.get("gated_delta", 0) for m in gdn) == 3
    np.testing.assert_allclose(np.array(out), np.array(stock), atol=2e-4, rtol=2e-4)


def test_cached_mode_prior_on_the_cpu(tmp_path, monkeypatch):
    """tune='cached' (mlx_lm.generate's default) on the CPU with an empty decision cache: the
    prior sends the recurrence to the chunked composite from 32 tokens, stock below."""
    from mlx_bricks.backends import active_backend

    if active_backend(None).name != "reference":
        pytest.skip("a kernel backend is available here")
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path))
    model = build("qwen3_5", mx.bfloat16)
    report = patch_model(model, tune="cached")
    run(model, tokens(40))
    run(model, tokens(9))
    gdn = [m for m in report.modules if m.module == "linear_attn"]
    assert sum(m.calls.get("gated_delta", 0) for m in gdn) == 3  # the 40-token prefill
    # the 9-token one: the recurrence and the three bfloat16 projection stages (Dispatch.admits)
    assert sum(sum(m.tuned_stock_calls.values()) for m in gdn) == 3 * 4, report


def test_quantized_projections_run_as_gemm_stages_on_the_cpu(tmp_path, monkeypatch):
    """No kernel backend, tune='cached': a 4-bit mixer's big projections run the linear kind's
    composites (the CPU prior's NumPy-BLAS ones) as stages, its gates' few columns the module's
    own layers; the logits within the dtype rule of a float32 truth on the same 4-bit weights.
    bfloat16 weights run as stages too, float16 ones stay the module's own."""
    import mlx.nn as nn

    from mlx_bricks.backends import active_backend

    if active_backend(None).name != "reference":
        pytest.skip("a kernel backend is available here")
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path))

    def quantized(dtype):
        m = build("qwen3_5", mx.bfloat16)
        nn.quantize(m, group_size=32, bits=4,
                    class_predicate=lambda p, x: isinstance(x, nn.Linear) and "linear_attn" in p)
        m.set_dtype(dtype)  # the scales and biases; the packed weights stay
        mx.eval(m.parameters())
        return m

    model = quantized(mx.bfloat16)
    toks = tokens(70)
    truth = run(quantized(mx.float32), toks)
    stock = run(model, toks)
    report = patch_model(model, tune="cached", mlp=False)
    out = run(model, toks)
    gdn = [m for m in report.modules if m.module == "linear_attn"]
    assert len(gdn) == 3 and all(m.status == "patched" for m in gdn), report
    assert sum(m.calls.get("gated_delta", 0) for m in gdn) == 3
    assert sum(m.calls.get("linear", 0) for m in gdn) == 9, report
    assert_dtype_close(out, truth, stock, dtype=mx.bfloat16, what="4-bit qwen3_5 logits")
    # float weights (Dispatch.admits): bfloat16 projections run as stages too (the prior's
    # NumPy-BLAS products), float16 ones stay the module's own layers
    for dtype, stage_calls in ((mx.bfloat16, 9), (mx.float16, 0)):
        float_model = build("qwen3_5", mx.bfloat16)
        float_model.set_dtype(dtype)
        truth_model = build("qwen3_5", mx.bfloat16)
        truth_model.set_dtype(mx.float32)
        truth, stock = run(truth_model, toks), run(float_model, toks)
        report = patch_model(float_model, tune="cached", mlp=False)
        out = run(float_model, toks)
        gdn = [m for m in report.modules if m.module == "linear_attn"]
        assert sum(m.calls.get("gated_delta", 0) for m in gdn) == 3
        assert sum(m.calls.get("linear", 0) for m in gdn) == stage_calls, report
        assert not any("in_proj" in k or "out_proj" in k
                       for m in gdn for k in m.tuned_stock_calls)
        assert_dtype_close(out, truth, stock, dtype=dtype, what=f"{dtype} qwen3_5 logits")
