"""patch_model on tiny random gpt_oss, qwen3_next, qwen3_5 and gemma4_text models vs stock
mlx-lm: the attention brick's sinks, sliding windows chosen per layer (gpt_oss's layer_types),
the sigmoid output gate (qwen3_next / qwen3_5) and gemma4's attention (head_dim 256 sliding
and 512 global layers, values = keys, weightless v_norm, scale 1, K/V shared across layers).

The models (tests/models.py): gpt_oss with layer 0 sliding (window 8, a ``RotatingKVCache``)
and layer 1 global, sinks drawn N(0, 16) per head, q/k/v/o biases, MoE MLPs; qwen3_next with
Gated DeltaNet layers 0 and 2 (stock) and gated full-attention layers 1 (dense MLP) and 3
(MoE with a gated shared expert); qwen3_5 (text_config) with dense MLPs; gemma4_text with
sliding layers 0, 2 and global 1, 3, layers 2 and 3 attending over layer 0's and 1's K/V,
per-layer inputs. Prompts are longer
than the window, prefilled whole (no cache) and in two chunks through the model's own caches.
Logits follow the dtype-scaled rule against a float64 run of the same weights; greedy tokens
must equal stock's (up to a rounding tie); unpatching gives stock back bit for bit.
"""
from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlx_bricks import kernels
from mlx_bricks.nn import is_patched
from mlx_bricks.patch import patch_model, unpatch_model
from tests.models import build_model, clone, tokens
from tests.support import require_backend
from tests.test_moe_patch import _gathered_switch
from tests.test_patch import (
    DTYPES,
    assert_bricks_used,
    check_against_stock,
    run,
    run_chunks,
    stock_side,
)
from tests.test_patch import run64 as _run64
from tests.tolerance import assert_dtype_close

N_TOKENS = 20
CHUNKS = [(0, 13), (13, N_TOKENS)]  # both longer than gpt_oss's window 8


def run64(model64, toks, cache=None):
    """Float64 logits on the CPU; MoE experts through gathered weights (MLX's gather_mm is
    float32 only)."""
    with _gathered_switch():
        return _run64(model64, toks, cache)



def _expect(report, arch):
    """Which modules the report must show patched / stock for each tiny model."""
    by = {(m.layer, m.module): m for m in report.modules}
    assert report.architecture == ("qwen3_5" if arch == "qwen3_5" else arch)
    if arch == "gemma4_text":
        for layer in range(4):
            assert by[(layer, "self_attn")].status == "patched"
            assert by[(layer, "mlp")].status == "patched"
            assert by[(layer, "block")].status == "fallback"
    elif arch == "gpt_oss":
        for layer in (0, 1):
            assert by[(layer, "self_attn")].status == "patched"
            assert by[(layer, "mlp")].status == "fallback"  # MoE: experts by module
    else:
        attention = (1, 3) if arch == "qwen3_next" else (1,)
        for layer in attention:
            assert by[(layer, "self_attn")].status == "patched"
        assert "gated" in by[(1, "block")].reason  # dense layer: the block would fuse but
        if arch == "qwen3_next":
            assert by[(3, "mlp.shared_expert")].status == "patched"
    assert report.runtime_fallbacks() == {}
    assert_bricks_used(report)


def _case(backend, dtype, arch, *, whole=True, n_greedy=12):
    # MLX's CPU gather_mm (SwitchLinear, stock MoE) is float32 only: the experts of every
    # model here, stock and float64 alike, multiply gathered weights instead
    with _gathered_switch():
        return _case_body(backend, dtype, arch, whole=whole, n_greedy=n_greedy)


def _case_body(backend, dtype, arch, *, whole, n_greedy):
    dt = DTYPES[dtype]
    model = build_model(arch, dt)
    cache = make_prompt_cache(model)
    if arch in ("gpt_oss", "gemma4_text"):  # gemma4: layers 2, 3 have no cache (shared)
        assert [type(c) for c in cache] == [RotatingKVCache, KVCache]
        assert cache[0].max_size == 8
    toks = tokens(N_TOKENS)
    side = stock_side(model, toks, CHUNKS, n_greedy=n_greedy, whole=whole, runner64=run64)

    report = patch_model(model, backend=backend)
    what = f"{arch} {backend} {dtype}"
    try:
        check_against_stock(model, side, toks, CHUNKS, dt, what, n_greedy=n_greedy)
        _expect(report, arch)
    finally:
        n = report.n_patched
        assert unpatch_model(model) == n
    assert not any(is_patched(m) for m in model.modules())
    # unpatched: stock again, bit for bit
    again = run_chunks(model, run, toks, CHUNKS)
    for a, b in zip(again, side["stock"]):
        assert mx.array_equal(a, b)
    return report


ARCHS = ("gpt_oss", "qwen3_next", "qwen3_5", "gemma4_text")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_reference(arch, dtype):
    _case("reference", dtype, arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_emulator(arch):
    require_backend("emulator")
    before = dict(kernels.LAUNCH_COUNTS)
    _case("emulator", "bfloat16", arch, whole=False, n_greedy=8)
    launched = {k: n - before.get(k, 0) for k, n in kernels.LAUNCH_COUNTS.items()
                if k[1] == "emulator" and n > before.get(k, 0)}
    # the attention kernel ran on every attention layer of both chunks (gpt_oss: with its
    # sinks, the sliding layer with its window)
    assert launched.get(("flash_attention", "emulator"), 0) >= 4, launched


def test_gpt_oss_sinks_and_windows_reach_the_brick(monkeypatch):
    """The brick gets each head's sinks on both layers and the window on layer 0 only
    (layer_types), whole prompt and chunks (without them the logits move by O(1))."""
    from mlx_bricks.bricks.attention import kind as attention
    seen = []
    real = attention.run_flash_attention

    def spy(*a, **kw):
        seen.append((kw.get("window"), kw.get("sinks")))
        return real(*a, **kw)

    monkeypatch.setattr(attention, "run_flash_attention", spy)
    model = build_model("gpt_oss", mx.float32)
    patch_model(model, backend="reference")
    run(model, tokens(12))
    assert [w for w, _ in seen] == [8, None]
    for (_, sinks), layer in zip(seen, model.layers):
        assert sinks is layer.self_attn.sinks


def test_gpt_oss_unknown_layer_types_stay_stock():
    """Without per-layer types the sliding layers are unknown: every attention stays stock,
    with the reason, and the logits are stock's."""
    model = build_model("gpt_oss", mx.float32)
    toks = tokens(12)
    stock = run(model, toks)
    class Types:  # iterable for the model's own loop, but no list the patch can read
        def __init__(self, types):
            self.types = list(types)

        def __iter__(self):
            return iter(self.types)

    model.args.layer_types = None
    model.model.layer_types = Types(model.model.layer_types)
    report = patch_model(model, backend="reference")
    out = run(model, toks)
    assert mx.array_equal(out, stock)
    # decided at patch time (which layers slide is structure): every attention stays stock
    attn = [m for m in report.modules if m.module == "self_attn"]
    assert attn and all(m.status == "fallback" for m in attn), attn
    assert all("per-layer attention types" in m.reason for m in attn), attn


def test_qwen3_next_gate_and_partial_rope_are_the_modules():
    """The gate is read from the second half of each head's q_proj rows: with only those rows
    flipped and doubled (the gates change, the queries do not) the patched model still
    follows the float64 model; partial RoPE is the module's own (25% of head_dim)."""
    model = build_model("qwen3_next", mx.float32)
    attn = model.layers[1].self_attn
    assert attn.rope.dims == 16  # partial RoPE: 25% of head_dim 64
    toks = tokens(N_TOKENS)
    w = attn.q_proj.weight
    H, hd = attn.num_attention_heads, attn.head_dim
    gate_rows = (mx.arange(2 * H * hd).reshape(H, 2 * hd)[:, hd:]).reshape(-1)
    scaled = w.at[gate_rows].multiply(-2.0)
    attn.q_proj.weight = scaled
    stock = run(model, toks)
    patch_model(model, backend="reference")
    got = run(model, toks)
    assert_dtype_close(got, run64(clone(model, mx.float64), toks), stock, dtype=mx.float32,
                       what="qwen3_next gate rows changed")
    unpatch_model(model)


def test_gemma4_wrapper_alias():
    """mlx-lm's multimodal ``gemma4`` wrapper: its ``layers`` are gemma4_text's, patched as
    such (window from ``language_model.args``), logits by the rule against float64."""
    from mlx.utils import tree_map
    from mlx_lm.models import gemma4

    from mlx_bricks.nn.shared_kv import BricksSharedKVAttention
    from tests.models import CONFIGS, VOCAB

    args = gemma4.ModelArgs(model_type="gemma4", vocab_size=VOCAB,
                            text_config=dict(CONFIGS["gemma4_text"], model_type="gemma4_text"))
    mx.random.seed(0)
    model = gemma4.Model(args)
    mx.eval(model.parameters())
    copy = gemma4.Model(args)
    copy.update(tree_map(lambda a: a.astype(mx.float64), model.parameters()))
    toks = tokens(N_TOKENS)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert report.architecture == "gemma4_text" and report.model_type == "gemma4"
    assert all(isinstance(layer.self_attn, BricksSharedKVAttention) for layer in model.layers)
    assert_dtype_close(run(model, toks), run64(copy, toks), stock, dtype=mx.float32,
                       what="gemma4 wrapper")
    _expect(report, "gemma4_text")
    # the sliding layers ran the window of language_model.args (8 < 20 tokens)
    assert model.layers[0].self_attn._bricks_state.layout.sliding_window == 8


def test_gemma4_shared_layer_fallbacks_at_call_time():
    """A shared-K/V layer called with a cache as well (not mlx-lm's call) and a layer that
    owns no K/V called without shared_kv run the module's own code (the latter raises
    mlx-lm's own error)."""
    model = build_model("gemma4_text", mx.float32)
    patch_model(model, backend="reference")
    owner, shared = model.layers[0].self_attn, model.layers[2].self_attn
    x = mx.random.normal((1, 12, 64))
    out, kv, offset = owner(x, "causal", None)
    cache = KVCache()
    got = shared(x, "causal", cache, shared_kv=kv, offset=offset)
    assert any("shared_kv and a cache both given" in r for r in shared._bricks_state.stock)
    unpatch_model(model)
    want = shared(x, "causal", KVCache(), shared_kv=kv, offset=offset)
    assert mx.array_equal(got[0], want[0])
    patch_model(model, backend="reference")
    with pytest.raises(ValueError, match="KV-shared layer but received no shared_kv"):
        model.layers[2].self_attn(x, "causal", None)
    unpatch_model(model)
