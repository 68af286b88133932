"""The gated-delta mixers of kimi_linear, kimi_k3, bailing_moe_v3 (Kimi Delta Attention: a decay
per key dim) and olmo_hybrid (Gated DeltaNet) patched by module: tiny random models of each
(tests/models.py), patched vs stock vs a float32 truth over two prompt turns (the second from the
filled cache), the cache as stock writes it, decode stock, unpatch exact, a padded batch, the
emulator, and a forward the patch does not know staying stock."""
import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.patch import patch_model, patch_report, unpatch_model
from tests.models import build_model, clone, tokens
from tests.test_gated_delta_patch import assert_same_greedy
from tests.tolerance import assert_dtype_close

FAMILIES = ["kimi_linear", "kimi_k3", "bailing_moe_v3", "olmo_hybrid"]
DECODE = "decode (L == 1): stock path by design"
#: Dense MLPs only: MLX 0.32.4's CPU gather_mm (stock MoE experts) takes float32 only.
DENSE = {"kimi_linear": dict(num_experts=0), "kimi_k3": dict(num_experts=0),
         "bailing_moe_v3": dict(first_k_dense_replace=4), "olmo_hybrid": {}}


def run(model, toks, cache=None):
    out = model(toks, cache=cache)
    mx.eval(out)
    return out


def mixers(report):
    return [m for m in report.modules if m.module == "linear_attn"]


def states(cache):
    """The recurrent caches' arrays (conv states, then the state), float32 numpy."""
    return [[np.array(a.astype(mx.float32)) for a in c.cache] for c in cache
            if not hasattr(c, "keys")]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_two_turns_bf16_against_float32_truth(model_type):
    """bf16: each turn's logits (the second from the filled cache) within the dtype rule of the
    float32 truth against stock's bf16 distance, greedy tokens equal where the truth is clear,
    the recurrent state and conv states close to stock's, decode the stock step (dense MLPs:
    :data:`DENSE`)."""
    model = build_model(model_type, mx.bfloat16, **DENSE[model_type])
    stock_model, truth_model = clone(model, mx.bfloat16), clone(model, mx.float32)
    report = patch_model(model, backend="reference")
    found = mixers(report)
    assert len(found) == 3 and all(m.status == "patched" for m in found), report
    caches = [m.make_cache() for m in (model, stock_model, truth_model)]
    for turn, toks in enumerate((tokens(45, seed=1), tokens(23, seed=2))):
        out, stock, truth = (run(m, toks, c) for m, c in
                             zip((model, stock_model, truth_model), caches))
        assert_dtype_close(out, truth, stock, dtype=mx.bfloat16,
                           what=f"{model_type} turn {turn} logits")
        assert_same_greedy(out, stock, truth)
    assert sum(m.calls.get("gated_delta", 0) for m in found) == 6
    assert sum(m.calls.get("linear", 0) for m in found) == 6 * STAGED[model_type]
    for ours, theirs in zip(states(caches[0]), states(caches[1])):
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a, b, atol=0.05, rtol=0.05)
    assert all(c.offset == 68 for c in caches[0] if hasattr(c, "offset"))
    step = run(model, tokens(1, seed=3), caches[0])
    stock_step = run(stock_model, tokens(1, seed=3), caches[1])
    assert mx.array_equal(mx.argmax(step, -1), mx.argmax(stock_step, -1))
    assert sum(m.stock_calls.get(DECODE, 0) for m in mixers(patch_report(model))) == 3


#: The big projections each family runs as ``linear`` stages (kimi_k3's tiny config has the
#: low-rank output gate).
STAGED = {"kimi_linear": 4, "kimi_k3": 2, "bailing_moe_v3": 5, "olmo_hybrid": 5}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_projections_run_as_gemm_stages_on_the_cpu(model_type, tmp_path, monkeypatch):
    """No kernel backend, tune='cached' (mlx_lm.generate's default): the mixers' big
    projections, 4-bit, run the linear kind's composites as stages (the CPU prior's NumPy-BLAS
    ones), a gate's low-rank pair and few columns the module's own layers; the logits within
    the dtype rule of a float32 truth on the same 4-bit weights."""
    import mlx.nn as nn

    from mlx_bricks.backends import active_backend

    if active_backend(None).name != "reference":
        pytest.skip("a kernel backend is available here")
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path))

    def quantized(dtype):
        m = build_model(model_type, mx.bfloat16, **DENSE[model_type])
        nn.quantize(m, group_size=32, bits=4, class_predicate=lambda p, x: isinstance(
            x, nn.Linear) and p.startswith("model.layers.") and x.weight.shape[1] % 32 == 0)
        m.set_dtype(dtype)  # the scales and biases; the packed weights stay
        mx.eval(m.parameters())
        return m

    model = quantized(mx.bfloat16)
    toks = tokens(40, seed=8)
    truth = run(quantized(mx.float32), toks, None)
    stock = run(model, toks, None)
    report = patch_model(model, tune="cached", mlp=False)
    out = run(model, toks, None)
    found = mixers(report)
    assert len(found) == 3 and all(m.status == "patched" for m in found), report
    assert sum(m.calls.get("gated_delta", 0) for m in found) == 3
    assert sum(m.calls.get("linear", 0) for m in found) == 3 * STAGED[model_type], report
    assert_dtype_close(out, truth, stock, dtype=mx.bfloat16, what=f"4-bit {model_type} logits")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_float32_matches_stock_and_unpatch_is_exact(model_type):
    """float32: patched == stock up to the recurrence's rounding, over a prefill split in two
    (the state and conv states handed over in the cache); unpatch gives stock's exact logits."""
    model = build_model(model_type, mx.float32, seed=1)
    toks = tokens(50, seed=4)
    stock = run(model, toks, model.make_cache())
    report = patch_model(model, backend="reference")
    whole = run(model, toks, model.make_cache())
    np.testing.assert_allclose(np.array(whole), np.array(stock), atol=3e-4, rtol=3e-4)
    cache = model.make_cache()
    parts = [run(model, toks[:, :17], cache), run(model, toks[:, 17:], cache)]
    np.testing.assert_allclose(np.array(mx.concatenate(parts, 1)), np.array(stock), atol=3e-4,
                               rtol=3e-4)
    assert unpatch_model(model) == report.n_patched
    assert mx.array_equal(run(model, toks, model.make_cache()), stock)


@pytest.mark.parametrize("model_type", ["kimi_linear", "olmo_hybrid"])
def test_padded_batch(model_type, monkeypatch):
    """mlx-lm's left-padded batch (ArraysCache left_padding: the mixers' mask and conv
    ``lengths``): patched == stock on the batch, and kimi_linear's padded row == the prompt run
    alone. The brick gives y = 0 at padding tokens, as mlx-lm's Metal kernel; its CPU loop
    writes a value there, which olmo_hybrid's convolutions (they do not mask the padding) carry
    into the real tokens: stock runs here with the Metal kernel's zeros."""
    from mlx_lm.models import gated_delta as gd
    from mlx_lm.models.cache import ArraysCache, BatchKVCache

    ops = gd.gated_delta_ops

    def metal_like(q, k, v, g, beta, state=None, mask=None):
        y, s = ops(q, k, v, g, beta, state, mask)
        return (y if mask is None else mx.where(mask[:, :, None, None], y, 0)), s

    monkeypatch.setattr(gd, "gated_delta_ops", metal_like)
    model = build_model(model_type, mx.float32, seed=2)
    stock_model = clone(model, mx.float32)
    patch_model(model, backend="reference")
    a, b = tokens(20, seed=5), tokens(13, seed=6)
    alone = run(model, b, model.make_cache())
    batch = mx.concatenate([a, mx.concatenate([mx.zeros((1, 7), mx.int32), b], 1)], 0)

    def padded():
        return [ArraysCache(size=len(c.cache), left_padding=[0, 7]) if not hasattr(c, "keys")
                else BatchKVCache(left_padding=[0, 7]) for c in model.make_cache()]

    out = run(model, batch, padded())
    assert sum(m.calls.get("gated_delta", 0) for m in mixers(patch_report(model))) == 6
    stock = run(stock_model, batch, padded())
    for row, start in ((0, 0), (1, 7)):  # the real tokens (padding logits are nobody's)
        np.testing.assert_allclose(np.array(out[row, start:]), np.array(stock[row, start:]),
                                   atol=3e-4, rtol=3e-4)
    if model_type == "kimi_linear":
        np.testing.assert_allclose(np.array(out[1, 7:]), np.array(alone[0]), atol=1e-3)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_emulator(model_type):
    """backend='emulator' (every brick's MSL under the emulator): the mixers run the Gated
    DeltaNet kernel (a gate per key dim or per head), float32 logits match stock."""
    from mlx_bricks import kernels

    model = build_model(model_type, mx.float32, seed=3)
    toks = tokens(20, seed=7)
    stock = run(model, toks, model.make_cache())
    report = patch_model(model, backend="emulator")
    before = kernels.LAUNCH_COUNTS[("gated_delta", "emulator")]
    out = run(model, toks, model.make_cache())
    assert kernels.LAUNCH_COUNTS[("gated_delta", "emulator")] - before == 3
    assert sum(m.calls.get("gated_delta", 0) for m in mixers(report)) == 3
    np.testing.assert_allclose(np.array(out), np.array(stock), atol=3e-4, rtol=3e-4)


def test_row_sharded_projection_is_not_a_stage():
    """A tensor-parallel o_proj (``ShardedToAllLinear``: its output an ``all_sum`` of partial
    products) runs the module's own layer, which reduces it; the other projections stay
    stages, and the logits are the unsharded model's (a group of one)."""
    from mlx.nn.layers.distributed import shard_linear

    from mlx_bricks.patch.modules import mixer_piece

    model = build_model("kimi_linear", mx.float32)
    toks = tokens(20, seed=9)
    stock = run(model, toks, model.make_cache())
    patch_model(model, backend="reference")
    group = mx.distributed.init()
    for layer in model.layers[:3]:
        layer.self_attn.o_proj = shard_linear(layer.self_attn.o_proj, "sharded-to-all",
                                              group=group)
    attn = model.layers[0].self_attn
    assert mixer_piece(attn).stage_names(attn, mx.float32) == ("q_proj", "k_proj", "v_proj")
    np.testing.assert_allclose(np.array(run(model, toks, model.make_cache())), np.array(stock),
                               atol=3e-4, rtol=3e-4)


def test_unknown_forward_stays_stock():
    """A subclass of a known class with its own forward (calling gated_delta_update) stays stock
    with the reason; attention=False disables the known ones."""
    from mlx_lm.models import kimi_linear
    from mlx_lm.models.gated_delta import gated_delta_update

    class Custom(kimi_linear.KimiDeltaAttention):
        def __call__(self, x, mask=None, cache=None):
            assert gated_delta_update is not None
            return super().__call__(x, mask, cache)

    model = build_model("kimi_linear", mx.float32)
    model.layers[1].self_attn.__class__ = Custom
    report = patch_model(model, backend="reference")
    assert [m.status for m in mixers(report)] == ["patched", "fallback", "patched"]
    assert "forward the patch does not know" in mixers(report)[1].reason
    disabled = patch_model(model, backend="reference", attention=False)
    assert {m.status for m in mixers(disabled)} == {"disabled"}


def test_coverage_counts_the_mixers():
    """patch.coverage: a patched KDA mixer's recurrence (6 Hv Dk Dv per token) is in bricks,
    its q/k/v/o projections on the GEMM brick (stages), its other projections in bricks with
    it and also apart (mixer_linears); the MLA layer stays stock."""
    import mlx.nn as nn

    from mlx_bricks.patch.coverage import prefill_flops

    model = build_model("kimi_linear")
    patch_model(model, backend="reference")
    f = prefill_flops(model, 20)
    kda = [layer.self_attn for layer in model.layers[:3]]

    def flops(names):
        return sum(2 * m.weight.shape[0] * m.weight.shape[1] for a in kda
                   for n, m in a.named_modules() if isinstance(m, nn.Linear) and names(n))

    staged = ("q_proj", "k_proj", "v_proj", "o_proj")
    linears = flops(lambda n: True)
    assert f["mixer_linears"] == flops(lambda n: n not in staged) < linears
    assert f["by_class"]["KimiDeltaAttention"] == [linears + 3 * 6 * 2 * 32 * 32, 0]
    assert f["by_class"]["KimiMLAAttention"][0] == 0 < f["by_class"]["KimiMLAAttention"][1]


def test_coverage_command(capsys):
    """``python -m mlx_bricks.patch.coverage MODEL_TYPE``: a real-size model (never evaluated),
    its share in bricks and what stays stock."""
    from mlx_bricks.patch.coverage import _main

    assert _main(["Bailing-MoE-V3 (mlx-lm)", "--tokens", "128"]) == 0
    out = capsys.readouterr().out
    assert "bailing_moe_v3" in out and "own proj" in out and "stock: BailingMLA" in out


@pytest.mark.parametrize("model_type", FAMILIES)
def test_decode_step_is_stock_work(model_type):
    """After a bricks prefill the decode step builds exactly stock's graph (tests/
    test_decode_parity.py's check; 4-bit weights, dense MLPs: the CPU's gather_mm takes float32
    only) and runs the original classes."""
    from tests.test_decode_parity import _quantize, decode_graph

    model = build_model(model_type, mx.float16, **DENSE[model_type])
    _quantize(model, model_type)
    prompt = tokens(24, seed=1)
    stock_ops, _ = decode_graph(model, prompt)
    report = patch_model(model, backend="reference")
    ops, _ = decode_graph(model, prompt)
    assert ops == stock_ops, (ops - stock_ops, stock_ops - ops)
    assert sum(m.calls.get("gated_delta", 0) for m in mixers(report)) == 3
