"""DeepSeek sparse attention (deepseek_v32, glm_moe_dsa): while a call's keys fit the indexer's
``index_topk`` every causal key is selected and the MLA piece runs (the indexer's cache written
by the indexer itself); beyond it the indexer module selects (mlx-lm's own top-k) and the
sparse-attention brick attends over each query's selected keys. Tiny random models from
mlx-lm's classes (tests/models.py), float32, reference."""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from mlx_bricks.patch import patch_model, unpatch_model
from tests.models import CONFIGS, build_model, tokens
from tests.test_mla_patch import clone64, float64_experts
from tests.test_patch import run, run64
from tests.tolerance import assert_dtype_close

TOP = 24
CHUNKS = [(0, 20), (20, 50)]  # 20 keys (dense) then 50 (> TOP: the indexer selects)


@pytest.mark.parametrize("chunks", [CHUNKS, [(0, 50)]], ids=["two turns", "one prefill"])
def test_calls_beyond_index_topk_run_the_sparse_brick(chunks):
    """A turn within ``index_topk`` (dense: the attention brick), then one beyond it (the
    indexer's selection, the sparse brick), or one prefill beyond it: logits within the dtype
    rule of a float64 truth, both caches as stock wrote them."""
    model = build_model("deepseek_v32", mx.float32, index_topk=TOP)
    toks = tokens(50)
    with float64_experts():
        m64 = clone64(model)
        c64 = make_prompt_cache(m64)
        refs = [run64(m64, toks[:, a:b], c64) for a, b in chunks]
    stock_cache = make_prompt_cache(model)
    stock = [run(model, toks[:, a:b], stock_cache) for a, b in chunks]
    report = patch_model(model, backend="reference")
    mla = [m for m in report.modules if m.module == "mla"]
    assert len(mla) == 2 and all(m.status == "patched" for m in mla)
    cache = make_prompt_cache(model)
    got = [run(model, toks[:, a:b], cache) for a, b in chunks]
    for (a, b), p, s, r in zip(chunks, got, stock, refs):
        assert_dtype_close(p, r, s, dtype=mx.float32, what=f"chunk {a}:{b}")
    for m in mla:
        dense = sum(b <= TOP for _, b in chunks)
        assert m.calls.get("flash_attention", 0) == dense, m.calls
        assert m.calls["sparse_attention"] == len(chunks) - dense, m.calls
        assert not any(k.startswith("DSA") for k in m.stock_calls), m.stock_calls
    # both caches (latent + rope key; indexer keys) as stock wrote them
    for c, s in zip(cache, stock_cache):
        for (name, a), (_, b) in zip(tree_flatten(c.state), tree_flatten(s.state)):
            if not isinstance(a, mx.array):
                continue
            assert a.shape == b.shape, name
            assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), name
    unpatch_model(model)


def test_glm_moe_dsa_is_deepseek_v32():
    """GLM-5's model_type builds DeepSeek-V3.2's classes: the same entry and MLA piece."""
    from mlx_lm.models import glm_moe_dsa

    fields = dict(CONFIGS["deepseek_v32"], model_type="glm_moe_dsa", vocab_size=256,
                  routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
                  norm_topk_prob=True, n_group=1, topk_group=1, moe_layer_freq=1,
                  attention_bias=False, num_key_value_heads=4,
                  rope_parameters={"rope_theta": 10000.0, "type": "default"})
    fields.pop("rope_scaling")
    fields.pop("rope_theta")
    model = glm_moe_dsa.Model(glm_moe_dsa.ModelArgs(**fields))
    mx.eval(model.parameters())
    toks = tokens(12)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert report.architecture == "deepseek_v32"
    assert [m.status for m in report.modules if m.module == "mla"] == ["patched"] * 2
    out = run(model, toks)
    assert mx.allclose(out, stock, atol=2e-4, rtol=2e-4).item()
    assert report.calls()["flash_attention"] == 2


def test_an_indexer_of_another_forward_stays_stock():
    from mlx_lm.models import deepseek_v32

    class OwnIndexer(deepseek_v32.Indexer):
        def __call__(self, x, qr, mask, cache=None):
            return super().__call__(x, qr, mask, cache)

    model = build_model("deepseek_v32", mx.float32)
    model.layers[0].self_attn.indexer.__class__ = OwnIndexer
    report = patch_model(model, backend="reference")
    statuses = [(m.layer, m.status) for m in report.modules if m.module == "mla"]
    assert statuses == [(0, "fallback"), (1, "patched")]
    entry = next(m for m in report.layer(0) if m.module == "mla")
    assert "indexer forward OwnIndexer.__call__ is not the one vetted" in entry.reason


@pytest.mark.parametrize("arch", ["deepseek_v32"])
def test_index_topk_of_the_tiny_model_keeps_the_default_prompt_dense(arch):
    assert CONFIGS[arch]["index_topk"] >= 50  # tests/test_mla_patch.py's prompt: dense path


def test_coverage_beyond_index_topk():
    """DeepSeek-V3.2 at 8,192 tokens (past its index_topk of 2,048): the projections and the
    sparse attention in bricks, >= 90% of the prefill FLOPs (the indexer, the queries'
    absorption and the outputs' unembed_out stay mlx-lm's)."""
    from mlx_bricks.patch.coverage import prefill_flops
    from mlx_bricks.patch.real_configs import build as build_real

    model = build_real("DeepSeek-V3.2 (671B)")
    patch_model(model, backend="reference")
    assert prefill_flops(model, 8192)["share"] >= 0.9
    assert prefill_flops(model, 2048)["share"] >= 0.98  # dense: every key selected


def test_stock_choice_is_the_module_s_own(tmp_path, monkeypatch):
    """Auto backend on this CPU, tune='cached' with nothing measured (mlx_lm.generate's
    default): the sparse kind's prior keeps stock for a prompt whose dense form costs fewer
    FLOPs (50 keys, 24 selected) and the module's own masked dense attention runs (the
    projections on the bricks: bfloat16 weights); logits within the dtype rule of a float64
    truth."""
    from mlx_bricks.backends import active_backend

    if active_backend(None).name != "reference":
        pytest.skip("a kernel backend is available here")
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path))
    model = build_model("deepseek_v32", mx.bfloat16, index_topk=TOP,
                        first_k_dense_replace=2)  # dense MLPs: CPU gather_mm is float32 only
    toks = tokens(50)
    with float64_experts():
        truth = run64(clone64(model), toks, None)
    stock = run(model, toks, make_prompt_cache(model))
    report = patch_model(model, tune="cached")
    out = run(model, toks, make_prompt_cache(model))
    mla = [m for m in report.modules if m.module == "mla"]
    assert all(m.status == "patched" for m in mla), report
    assert all(m.calls.get("sparse_attention", 0) == 0 and m.calls.get("linear", 0) > 0
               for m in mla), [m.calls for m in mla]
    assert_dtype_close(out, truth, stock, dtype=mx.bfloat16, what="logits")
