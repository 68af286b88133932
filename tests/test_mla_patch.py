"""Multi-head latent attention families patched by module (bricks/mla): tiny random models of
each (tests/models.py ``MLA_TYPES``) from mlx-lm's own classes, patched vs stock.

A 50-token prompt whole and in three chunks through the model's own cache: 0:5 and 5:47
decompress (the attention brick over the chunk's and the cached keys), 47:50 absorbs (a short
turn over the cache: ``op.choose_form``). Logits follow the dtype-scaled rule against a float64
run of the same weights (MoE experts through gathered weights), the cache holds what stock
writes, greedy tokens equal stock's (up to a float64 tie), decode is stock and counted,
unpatching gives stock's logits bit for bit, and the report says what runs.
"""
from __future__ import annotations

import contextlib
import importlib

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache

from mlx_bricks.bricks.mla.family import facts_of
from mlx_bricks.bricks.mla.forward import form_of
from mlx_bricks.runtime.classes import base_class
from mlx_bricks.nn.calls import DECODE
from mlx_bricks.patch import patch_model, unpatch_model
from tests.models import MLA_OVERRIDES, MLA_TYPES, build_model, tokens
from tests.test_patch import assert_same_greedy, greedy, run, run64
from tests.tolerance import assert_dtype_close

N_TOKENS = 50
CHUNKS = [(0, 5), (5, 47), (47, N_TOKENS)]
ABSORBED = "attention: absorbed form (fewer FLOPs than decompressing the cache)"
# overrides that leave every layer dense (the CPU's gather_mm is float32 only: half-precision
# runs of these families keep their MoE layers out)
DENSE = {"kimi_linear": dict(first_k_dense_replace=4), "kimi_k3": dict(first_k_dense_replace=4),
         "bailing_moe_v3": dict(first_k_dense_replace=4), "youtu_llm": {}, "minicpm3": {}}
# every layer of these has a MoE: they run float32 (the CPU's gather_mm)
MOE_ONLY = ("longcat_flash", "longcat_flash_ngram")
# MLA layers per family (the KDA hybrids: layers 0-2 Kimi Delta Attention, the gated-delta
# brick's; LongCat: two MLA modules a layer)
MLA_LAYERS = {"kimi_linear": [3], "kimi_k3": [3], "bailing_moe_v3": [3],
              "longcat_flash": [0, 0, 1, 1], "longcat_flash_ngram": [0, 0, 1, 1]}


def dense(arch):
    return DENSE.get(arch, dict(first_k_dense_replace=2))


def half(arch):
    """The half-precision test's dtype and overrides (float32 where every layer is MoE)."""
    if arch in MOE_ONLY:
        return mx.float32, {}
    return mx.bfloat16, dense(arch)


def clone64(model):
    """A float64 stock copy of ``model`` (same file and args: ``args`` or ``config``)."""
    module = importlib.import_module(type(model).__module__)
    args = getattr(model, "args", None) or model.config
    copy = module.Model(args)
    copy.update(tree_map(lambda a: a.astype(mx.float64), model.parameters()))
    mx.eval(copy.parameters())
    return copy


@contextlib.contextmanager
def float64_experts():
    from tests.test_moe_patch import _gathered_switch

    with _gathered_switch():
        yield


def chunks(model, runner, toks):
    cache = make_prompt_cache(model)
    return [runner(model, toks[:, a:b], cache) for a, b in CHUNKS], cache


def mla_modules(report):
    return [m for m in report.modules if m.module == "mla"]


def mla_module(model, entry):
    """The module of a report entry (its path leads its variant: ``self_attn.0: MLA, ...``)."""
    m = model.layers[entry.layer]
    for part in entry.variant.split(":")[0].split("."):
        m = m[int(part)] if part.isdigit() else m[part]
    return m


def form(module, L, offset):
    """The form a call of ``L`` tokens over ``offset`` cached ones attends in."""
    facts = facts_of(base_class(module))
    return form_of(module, facts, L, offset)


def check_family(arch, backend, dtype, **overrides):
    model = build_model(arch, dtype, **MLA_OVERRIDES.get(arch, {}), **overrides)
    toks = tokens(N_TOKENS)
    with float64_experts():
        m64 = clone64(model)
        refs, _ = chunks(m64, run64, toks)
        ref_whole = run64(m64, toks)
    stock, stock_cache = chunks(model, run, toks)
    stock_whole = run(model, toks)
    stock_greedy = greedy(model, toks[0], n=6, prefill_step_size=CHUNKS[1][1])

    report = patch_model(model, backend=backend)
    mla = mla_modules(report)
    want = MLA_LAYERS.get(arch, list(range(len(model.layers))))
    assert [m.layer for m in mla] == want and all(m.status == "patched" for m in mla), report
    what = f"{arch} {backend} {dtype}"
    assert_dtype_close(run(model, toks), ref_whole, stock_whole, dtype=dtype,
                       what=f"{what} whole prompt")
    got, cache = chunks(model, run, toks)
    for (a, b), p, s, r in zip(CHUNKS, got, stock, refs):
        assert_dtype_close(p, r, s, dtype=dtype, what=f"{what} chunk {a}:{b}")
    # the cache holds what stock writes (same layout; values within the dtype's rounding of
    # the inputs the patched layers passed on)
    for c, s in zip(cache, stock_cache):
        for (name, a), (_, b) in zip(tree_flatten(c.state), tree_flatten(s.state)):
            if isinstance(a, mx.array):
                assert a.shape == b.shape and a.dtype == b.dtype, (what, name)
                scale = max(1.0, float(mx.abs(b.astype(mx.float32)).max()))
                err = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
                assert err <= 0.05 * scale, (what, name, err)
    for m in mla:
        attn = mla_module(model, m)
        forms = [form(attn, b - a, a) for a, b in [(0, N_TOKENS), *CHUNKS]]
        latent = facts_of(base_class(attn)).cache == "latent"  # kv caches are decompressed already
        assert forms == ["decompressed"] * 3 + ["absorbed" if latent else "decompressed"]
        assert m.calls["flash_attention"] == forms.count("decompressed"), m.calls
        assert m.calls["linear"] > 0 and m.stock_calls.get(ABSORBED, 0) == forms.count(
            "absorbed"), m.stock_calls
    # decode: mlx-lm's absorbed step, counted
    step = run(model, toks[:, -1:], cache)
    assert step.shape[1] == 1
    assert all(m.stock_calls.get(DECODE) == 1 for m in mla_modules(report))
    patched_greedy = greedy(model, toks[0], n=6, prefill_step_size=CHUNKS[1][1])
    if dtype == mx.float32:
        assert patched_greedy == stock_greedy
    else:
        assert_same_greedy(model, dtype, [toks[0].tolist()], [stock_greedy], [patched_greedy])
    assert unpatch_model(model) == report.n_patched
    assert mx.array_equal(run(model, toks), stock_whole).item()
    return report


@pytest.mark.parametrize("arch", MLA_TYPES)
def test_family_float32_reference(arch):
    check_family(arch, "reference", mx.float32)


@pytest.mark.parametrize("arch", MLA_TYPES)
def test_family_bfloat16_reference(arch):
    dtype, overrides = half(arch)
    check_family(arch, "reference", dtype, **overrides)


@pytest.mark.parametrize("arch", MLA_TYPES)
def test_family_bfloat16_emulator(arch):
    dtype, overrides = half(arch)
    check_family(arch, "emulator", dtype, **overrides)


def test_q8_0_cache_option_keeps_the_latent_cache():
    """kv_cache="q8_0" gives MLA layers mlx-lm's KVCache (latents and rope keys are not K/V
    the Q8_0 readers take), so prefill and decode compute what stock does."""
    from mlx_bricks import make_prompt_cache as bricks_cache

    model = build_model("deepseek_v3", mx.float32)
    toks = tokens(12)
    stock_cache = make_prompt_cache(model)
    stock = run(model, toks, stock_cache)
    stock_step = run(model, toks[:, -1:], stock_cache)
    report = patch_model(model, backend="reference", kv_cache="q8_0")
    assert all(kind == "KVCache" and "latent" in why for _, kind, why in report.kv_caches)
    cache = bricks_cache(model)
    assert all(type(c).__name__ == "KVCache" for c in cache)
    assert mx.allclose(run(model, toks, cache), stock, atol=2e-4, rtol=2e-4).item()
    assert mx.allclose(run(model, toks[:, -1:], cache), stock_step, atol=2e-4,
                       rtol=2e-4).item()
    unpatch_model(model)


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_quantized_mla_reads_every_projection_quantized(backend):
    """nn.quantize (4-bit gs64) on the tiny deepseek_v3, MultiLinear included: every linear
    piece and the value decompression get a QuantizedWeight (the latter as one (H * dv, r)
    weight), the key decompression stays the module's quantized product; logits within the
    dtype rule of stock's against a float64 run of the dequantized weights."""
    import mlx.nn as nn
    from mlx_lm.models.mla import QuantizedMultiLinear

    from mlx_bricks.bricks.mla.forward import value_weight
    from mlx_bricks.formats.affine import QuantizedWeight

    model = build_model("deepseek_v3", mx.bfloat16, q_lora_rank=128, **dense("deepseek_v3"))
    nn.quantize(model, group_size=64, bits=4)
    attn = model.layers[0].self_attn
    assert isinstance(attn.unembed_out, QuantizedMultiLinear)
    w = value_weight(attn, 4)
    assert isinstance(w, QuantizedWeight) and w.shape == (4 * 128, 512)
    dense64 = model.__class__(model.args)  # float64 of the dequantized weights
    dense64.update(dequantized(model))
    mx.eval(dense64.parameters())
    toks = tokens(20)
    ref = run64(dense64, toks)
    stock = run(model, toks)
    report = patch_model(model, backend=backend)
    out = run(model, toks)
    assert_dtype_close(out, ref, stock, dtype=mx.bfloat16, what=f"q4 {backend}")
    for m in mla_modules(report):
        assert m.calls["linear"] == 5 and m.calls["flash_attention"] == 1, m.calls
    unpatch_model(model)


def dequantized(model):
    """``model``'s parameters with every quantized layer (linears, MultiLinear, experts)
    replaced by its float64 dequantized weight (as a float model of the same class has)."""
    from mlx.utils import tree_unflatten

    flat = dict(tree_flatten(model.parameters()))
    out = {}
    for name, a in flat.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith(".scales") or name.endswith(".biases") and f"{base}.scales" in flat:
            continue
        if name.endswith(".weight") and f"{base}.scales" in flat:
            layer = dict(model.named_modules())[base]
            a = mx.dequantize(a, flat[f"{base}.scales"], flat.get(f"{base}.biases"),
                              group_size=layer.group_size, bits=layer.bits)
        out[name] = a.astype(mx.float64)
    return tree_unflatten(list(out.items()))


def test_batch_of_two_and_a_cache_with_earlier_turns():
    """Two sequences at once, and a prompt cache holding an earlier turn (prefill continues
    from mlx-lm's own cache state): logits by the dtype rule against float64."""
    model = build_model("deepseek_v3", mx.float32)
    toks = tokens(30, batch=2)
    m64 = clone64(model)
    with float64_experts():
        c64 = make_prompt_cache(m64)
        ref = [run64(m64, toks[:, :18], c64), run64(m64, toks[:, 18:], c64)]
    c = make_prompt_cache(model)
    stock = [run(model, toks[:, :18], c), run(model, toks[:, 18:], c)]
    report = patch_model(model, backend="reference")
    c = make_prompt_cache(model)
    got = [run(model, toks[:, :18], c), run(model, toks[:, 18:], c)]
    for p, s, r in zip(got, stock, ref):
        assert_dtype_close(p, r, s, dtype=mx.float32, what="batch 2")
    # the first turn on the bricks, the second (12 over 18 cached) absorbed: fewer FLOPs
    assert all(m.calls["flash_attention"] == 1 and m.stock_calls[ABSORBED] == 1
               for m in mla_modules(report))
    unpatch_model(model)
