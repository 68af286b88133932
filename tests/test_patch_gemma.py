"""patch_model on a tiny random gemma3 (mlx-lm's ``gemma3_text``) and gemma2 vs stock mlx-lm.

The model (tests/models.py): head_dim 256, one KV head, layer 0 sliding-window (window 8, a
``RotatingKVCache``), layer 1 global; gemma's ``1 + w`` RMSNorms (q/k norms included), the
GELU-tanh MLP, ``query_pre_attn_scalar`` scale. Prompts are longer than the window, prefilled
whole (no cache: mlx-lm's array window mask) and in two chunks through the model's own caches
(the second chunk's keys come from a rotated ``RotatingKVCache``). gemma2: the same norms and
MLP, attention logit soft-capping, the causal mask passed as an array, every layer global.
Logits follow the design note's dtype-scaled rule against a float64 run of the same weights;
greedy tokens must be identical.
"""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlx_bricks import kernels
from mlx_bricks.nn import BricksAttention, BricksPiece
from mlx_bricks.patch import patch_model, unpatch_model
from tests.models import build_model, tokens
from tests.support import require_backend
from tests.test_patch import (
    DTYPES,
    assert_bricks_used,
    check_against_stock,
    run,
    run64,
    stock_side,
)
from tests.tolerance import assert_dtype_close

WINDOW = 8
N_TOKENS = 20
CHUNKS = [(0, 13), (13, N_TOKENS)]  # both longer than the window; the second rotates the cache


def _check_report(report, arch="gemma3_text"):
    assert report.architecture == arch
    by_module = {(m.layer, m.module): m for m in report.modules}
    for layer in (0, 1):
        assert by_module[(layer, "self_attn")].status == "patched"
        assert by_module[(layer, "mlp")].status == "patched"
        block = by_module[(layer, "block")]
        assert block.status == "fallback" and "post_feedforward_layernorm" in block.reason
    assert report.runtime_fallbacks() == {}
    assert_bricks_used(report)


def _case(backend, dtype, *, arch="gemma3_text", whole=True, n_greedy=16):
    """Patched vs stock and float64: whole prompt (no cache), chunked prefill, greedy."""
    dt = DTYPES[dtype]
    model = build_model(arch, dt)
    cache = make_prompt_cache(model)
    if arch == "gemma3_text":
        assert model.model.layers[0].self_attn.is_sliding
        assert not model.model.layers[1].self_attn.is_sliding
        assert [type(c) for c in cache] == [RotatingKVCache, KVCache]
        assert cache[0].max_size == WINDOW
    toks = tokens(N_TOKENS)
    side = stock_side(model, toks, CHUNKS, n_greedy=n_greedy, whole=whole)

    report = patch_model(model, backend=backend)
    try:
        what = f"{arch} {backend} {dtype}"
        check_against_stock(model, side, toks, CHUNKS, dt, what, n_greedy=n_greedy)
        _check_report(report, arch)
        return report
    finally:
        unpatch_model(model)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gemma3_reference(dtype):
    _case("reference", dtype)


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_gemma3_emulator(dtype):
    require_backend("emulator")
    before = dict(kernels.LAUNCH_COUNTS)
    _case("emulator", dtype, whole=False, n_greedy=16)
    launched = {k: n - before.get(k, 0) for k, n in kernels.LAUNCH_COUNTS.items()
                if k[1] == "emulator" and n > before.get(k, 0)}
    # the attention brick ran (sliding layer with its window, global layer) and the MLP's
    # GELU-tanh SwiGLU kernel
    assert launched.get(("flash_attention", "emulator"), 0) >= 4, launched
    assert launched.get(("swiglu_fused", "emulator"), 0) >= 4, launched


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float16"])
def test_gemma3_emulator_slow(dtype):
    # float32 end to end is not asserted with the 2x rule here: on this model stock's own
    # float32 error moves 3x between chunks (2.2e-5 / 6.0e-5 at |logit| 8), and the patched
    # model's (6.1e-5 / 1.7e-5) is as far on the other chunk; the bricks' float32 accuracy is
    # asserted per brick (test_attention, test_swiglu_activation) where the rule is not noise.
    require_backend("emulator")
    _case("emulator", dtype)


@pytest.mark.parametrize("backend,dtype", [("reference", "float32"), ("reference", "bfloat16"),
                                           ("emulator", "float16")])
def test_gemma2(backend, dtype):
    require_backend(backend)
    _case(backend, dtype, arch="gemma2", whole=backend == "reference")


def test_gemma2_soft_cap_reaches_the_brick(monkeypatch):
    """The attention brick gets the module's soft-cap (without it the logits move by O(1))."""
    from mlx_bricks.bricks.attention import kind as attention
    seen = []
    real = attention.run_flash_attention

    def spy(*a, **kw):
        seen.append(kw.get("softcap"))
        return real(*a, **kw)

    monkeypatch.setattr(attention, "run_flash_attention", spy)
    model = build_model("gemma2", mx.float32)
    patch_model(model, backend="reference")
    run(model, tokens(12))
    assert seen == [5.0, 5.0]


def _clone_wrapper64(model):
    """A float64 copy of a gemma3 wrapper model (same args and weights)."""
    from mlx.utils import tree_map
    from mlx_lm.models import gemma3

    copy = gemma3.Model(model.args)
    copy.update(tree_map(lambda a: a.astype(mx.float64), model.parameters()))
    return copy


def test_gemma3_wrapper_alias():
    """mlx-lm's multimodal ``gemma3`` wrapper exposes the text model's layers as ``layers``."""
    from mlx_lm.models import gemma3

    from tests.models import CONFIGS, VOCAB

    args = gemma3.ModelArgs(model_type="gemma3", vocab_size=VOCAB,
                            text_config=dict(CONFIGS["gemma3_text"], model_type="gemma3_text"))
    mx.random.seed(0)
    model = gemma3.Model(args)
    toks = tokens(N_TOKENS)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert report.architecture == "gemma3_text" and report.model_type == "gemma3"
    layers = model.language_model.model.layers
    assert isinstance(layers[0].self_attn, BricksAttention)
    assert isinstance(layers[1].mlp, BricksPiece)
    assert_dtype_close(run(model, toks), run64(_clone_wrapper64(model), toks), stock,
                       dtype=mx.float32, what="gemma3 wrapper")
    _check_report(report)


def test_sliding_layer_fallbacks_at_call_time():
    """What the window path does not take runs stock, counted with the reason."""
    model = build_model("gemma3_text", mx.float32)
    toks = tokens(12)
    patch_model(model, backend="reference")
    attn = model.model.layers[0].self_attn
    state = attn._bricks_state
    x = mx.random.normal((1, 12, 64))
    # a RotatingKVCache that keeps leading tokens: its keys are not contiguous in time
    keep = RotatingKVCache(max_size=WINDOW, keep=4)
    stock_keep = RotatingKVCache(max_size=WINDOW, keep=4)
    mask = keep.make_mask(12, window_size=WINDOW)
    out = attn(x, mask, keep)
    unpatch_model(model)
    ref = attn(x, mask, stock_keep)
    assert mx.allclose(out, ref).item()
    assert any("keeps 4 leading tokens" in r for r in state.stock), dict(state.stock)
    # a mask that is not the window's (a 4-D padding mask) falls back too
    patch_model(model, backend="reference")
    state = model.model.layers[0].self_attn._bricks_state
    pad = mx.ones((1, 1, 12, 12), mx.bool_)
    model.model.layers[0].self_attn(x, pad, None)
    assert any("not mlx-lm's (L, keys) sliding-window mask" in r for r in state.stock)
    # a model whose args lost the window length: sliding layers stock, global layer bricks
    model.args.sliding_window = None  # the model keeps its own copy (window_size)
    patch_model(model, backend="reference")
    run(model, toks)
    s0 = model.model.layers[0].self_attn._bricks_state
    s1 = model.model.layers[1].self_attn._bricks_state
    assert any("args have no sliding_window" in r for r in s0.stock), dict(s0.stock)
    assert s1.calls["flash_attention"] == 1 and not s1.stock
    unpatch_model(model)
