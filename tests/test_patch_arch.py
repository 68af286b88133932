"""patch_model on tiny random models of the newer mlx-lm families vs stock mlx-lm.

Each family (tests/models.py) is built from mlx-lm's own classes: smollm3 (NoPE layers),
seed_oss (q/k/v biases), ministral3 (Llama-4 query scaling through ``attn_scale``, YaRN rope, a
sliding-window layer), mistral3 (the multimodal wrapper around llama or ministral3), olmo2 /
olmo3 (post-norm blocks, q/k norms over the full width, olmo3's sliding layers), exaone4
(post-norm, per-head q/k norms, sliding RoPE layers and a global NoPE layer), glm4_moe (partial
RoPE, q/k/v biases, q/k norms, a MoE layer with a shared expert), llama4_text (weightless inline
QK-norm, a NoPE layer). Prompts are longer than the windows (8), prefilled whole (no cache) and
in two chunks through the model's own caches. Logits follow the dtype-scaled rule against a
float64 run of the same weights, greedy tokens equal stock's, unpatching gives stock's logits
bit for bit, and the report says per layer what runs.

The safety net: a module whose forward is not one the table entry was vetted against (an extra
op in a subclass or a monkeypatched ``__call__``) stays stock and computes stock's output.
"""
from __future__ import annotations

import contextlib
import dataclasses

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_bricks import kernels
from mlx_bricks.nn import BricksAttention, BricksBlock, BricksPiece
from mlx_bricks.patch import patch_model, unpatch_model
from mlx_bricks.patch import table
from mlx_bricks.patch.vetted import forward_fingerprint
from tests.models import CONFIGS, build_model, clone, tokens
from tests.support import require_backend
from tests.test_patch import (
    DTYPES,
    assert_bricks_used,
    assert_same_greedy,
    greedy,
    run,
    run64,
    run_chunks,
)
from tests.tolerance import assert_dtype_close, to_f64

N_TOKENS = 20
CHUNKS = [(0, 13), (13, N_TOKENS)]  # both longer than the window (8); the second rotates it

# family -> per layer: the modules the report lists and their status ("P" patched, "F"
# fallback), the layers that slide, the NoPE layers.
BLOCK = {"block": "P"}
UNFUSED = {"block": "F", "self_attn": "P", "mlp": "P"}  # attention and MLP one by one
LLAMA4_MOE = {"self_attn": "F", "mlp": "F", "feed_forward.shared_expert": "P", "moe": "P"}
FAMILIES = {
    "smollm3": dict(layers=[BLOCK, BLOCK], nope=[1]),
    "seed_oss": dict(layers=[BLOCK, BLOCK]),
    "ministral3": dict(layers=[BLOCK, BLOCK], sliding=[0]),
    "mistral3": dict(layers=[BLOCK] * 3),
    "olmo2": dict(layers=[UNFUSED] * 2),
    "olmo3": dict(layers=[UNFUSED] * 4, sliding=[0, 1, 2]),
    "exaone4": dict(layers=[UNFUSED] * 4, sliding=[0, 1, 2], nope=[3]),
    "glm4_moe": dict(layers=[BLOCK, {"self_attn": "P", "mlp": "F", "mlp.shared_experts": "P",
                                     "moe": "P"}]),
    "llama4_text": dict(layers=[BLOCK] * 4, nope=[3]),
    "olmoe": dict(layers=[{"self_attn": "P", "mlp": "F", "moe": "P"}] * 2),
    "dots1": dict(layers=[BLOCK, {"self_attn": "P", "mlp": "F", "mlp.shared_experts": "P",
                                  "moe": "P"}]),
    "exaone_moe": dict(layers=[BLOCK, {"self_attn": "P", "mlp": "F", "mlp.shared_experts": "P",
                                       "moe": "P"}] * 2, sliding=[0, 1, 2], nope=[3]),
    "internlm3": dict(layers=[BLOCK, BLOCK]),
    "granite": dict(layers=[UNFUSED] * 2),
    "helium": dict(layers=[BLOCK, BLOCK]),
    "nanbeige": dict(layers=[BLOCK, BLOCK]),
    "mellum": dict(layers=[{"self_attn": "P", "mlp": "F", "moe": "P"}] * 2, sliding=[0]),
    # RoPE layers 0-2 attend in chunks of 16 (a call across a chunk boundary runs stock: the
    # whole 20-token prompt and the 13:20 chunk), layer 3 is NoPE and global
    "llama4": dict(layers=[UNFUSED, dict(LLAMA4_MOE, self_attn="P"),
                           UNFUSED, dict(LLAMA4_MOE, self_attn="P")],
                   nope=[3], runtime="across a chunk boundary"),
}
# the CPU's gather_mm takes float32 only: the MoE family runs float32 (tests/test_moe_patch.py)
FLOAT32_ONLY = ("glm4_moe", "llama4", "mellum", "olmoe", "dots1", "exaone_moe")


def _float64_context(arch):
    if arch in FLOAT32_ONLY:
        from tests.test_moe_patch import _gathered_switch

        return _gathered_switch()
    return contextlib.nullcontext()


def check_report(report, arch):
    """The report's modules and statuses per layer, the sliding and NoPE layers."""
    spec = FAMILIES[arch]
    assert report.n_layers == len(spec["layers"])
    for i, want in enumerate(spec["layers"]):
        got = {m.module: m.status[0].upper() for m in report.layer(i)}
        assert got == want, (i, got, [(m.module, m.reason) for m in report.layer(i)])
    for m in report.modules:
        if m.module in ("block", "self_attn") and m.status == "patched":
            assert m.state.sliding in (None, m.layer in spec.get("sliding", ()))
            assert ("NoPE" in m.rope) == (m.layer in spec.get("nope", ())), (m.layer, m.rope)
    allowed = spec.get("runtime")
    assert all(allowed is not None and allowed in r for r in report.runtime_fallbacks()), \
        report.runtime_fallbacks()
    assert_bricks_used(report)


def check_family(arch, backend, dtype, *, whole=True, n_greedy=8, factor=2.0):
    """Patched vs stock and float64 (whole prompt, two chunks), greedy tokens, unpatch;
    ``factor``: the dtype rule's (tests/tolerance.py)."""
    dt = DTYPES[dtype]
    model = build_model(arch, dt)
    toks = tokens(N_TOKENS)
    m64 = clone(model, mx.float64)
    with _float64_context(arch):
        refs = run_chunks(m64, run64, toks, CHUNKS)
        ref_whole = run64(m64, toks) if whole else None
    stock = run_chunks(model, run, toks, CHUNKS)
    stock_whole = run(model, toks)
    stock_greedy = greedy(model, toks[0], n=n_greedy, prefill_step_size=CHUNKS[0][1])

    report = patch_model(model, backend=backend)
    what = f"{arch} {backend} {dtype}"
    if whole:
        assert_dtype_close(run(model, toks), ref_whole, stock_whole, dtype=dt,
                           factor=factor, what=f"{what} whole prompt")
    for (a, b), p, s, r in zip(CHUNKS, run_chunks(model, run, toks, CHUNKS), stock, refs):
        assert_dtype_close(p, r, s, dtype=dt, factor=factor, what=f"{what} chunk {a}:{b}")
    got = greedy(model, toks[0], n=n_greedy, prefill_step_size=CHUNKS[0][1])
    if arch in FLOAT32_ONLY:  # assert_same_greedy's tie check needs a float64 run
        assert got == stock_greedy
    else:
        assert_same_greedy(model, dt, [toks[0].tolist()], [stock_greedy], [got])
    check_report(report, arch)
    assert report.calls()["flash_attention"] > 0
    unpatch_model(model)
    assert mx.array_equal(run(model, toks), stock_whole).item()
    assert not any(isinstance(m, (BricksBlock, BricksAttention, BricksPiece))
                   for m in model.modules())
    return report


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_family_reference(arch, dtype):
    if arch in FLOAT32_ONLY and dtype != "float32":
        pytest.skip("MLX's CPU gather_mm (stock MoE experts) takes float32 only")
    check_family(arch, "reference", dtype)


@pytest.mark.parametrize("arch", FAMILIES)
def test_family_emulator(arch):
    require_backend("emulator")
    dtype = "float32" if arch in FLOAT32_ONLY else "bfloat16"
    before = dict(kernels.LAUNCH_COUNTS)
    # The MoE families run float32 (stock's CPU gather_mm); through several layers both the
    # kernels' and stock's float32 errors are accumulation-order noise (a few 1e-5 at |logit|
    # ~10, moving 3x with the chunk; as in test_patch_gemma's float32 note): the rule's factor
    # is 4 there. The bricks' float32 accuracy is asserted per brick (test_attention,
    # test_gemm, test_moe), the 2x rule end to end in bfloat16 for the other families.
    check_family(arch, "emulator", dtype, whole=False, n_greedy=4,
                 factor=4.0 if arch in FLOAT32_ONLY else 2.0)
    launched = {k[0]: n - before.get(k, 0) for k, n in kernels.LAUNCH_COUNTS.items()
                if k[1] == "emulator" and n > before.get(k, 0)}
    attending = [layer for layer in FAMILIES[arch]["layers"]
                 if "P" in (layer.get("block"), layer.get("self_attn"))]
    assert launched.get("flash_attention", 0) >= 2 * len(attending), launched


def test_mistral3_wrapper_of_ministral3():
    """mistral3 around a ministral3 text model takes the ministral3 entry (attn_scale)."""
    text = dict(CONFIGS["ministral3"], model_type="ministral3", vocab_size=256)
    model = build_model("mistral3", mx.float16, text_config=text)
    toks = tokens(N_TOKENS)
    ref = run64(clone(model, mx.float64), toks)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert report.model_type == "mistral3" and report.architecture == "ministral3"
    assert_dtype_close(run(model, toks), ref, stock, dtype=mx.float16, what="mistral3/ministral3")
    assert [m.module for m in report.modules] == ["block", "block"]
    assert_bricks_used(report)


def test_wrapper_of_unknown_text_model_is_stock():
    model = build_model("mistral3")
    model.language_model.model_type = "unknown_text"  # a text model the table lacks
    report = patch_model(model, backend="reference")
    assert report.architecture is None and report.n_patched == 0
    assert "'mistral3' is not in the patch table" in report.fallbacks[0].reason


def test_ministral3_query_scale_reaches_the_attention():
    """Without the attn_scale argument (a direct call) the module runs stock, with the reason;
    with a wrong shape too."""
    model = build_model("ministral3", mx.float32)
    attn = model.layers[1].self_attn
    x = mx.random.normal((1, 6, 128), key=mx.random.key(5))
    scale = 1.0 + 0.1 * mx.arange(6, dtype=mx.float32)[:, None]
    stock = attn(x, scale, "causal", None)
    stock_none = attn(x, None, "causal", None)
    report = patch_model(model, fuse_block=False, backend="reference")
    assert_dtype_close(attn(x, scale, "causal", None), to_f64(stock), stock,
                       dtype=mx.float32, what="attn_scale")
    assert report.layer(1)[0].calls["flash_attention"] == 1
    assert mx.array_equal(attn(x, None, "causal", None), stock_none).item()
    assert mx.array_equal(attn(x, mask="causal", cache=None, attn_scale=None), stock_none).item()
    assert any("attn_scale is None" in r for r in report.runtime_fallbacks()), \
        report.runtime_fallbacks()


# ---------------------------------------------------------------------------------------------
# safety: forwards the table entry was not vetted against stay stock
# ---------------------------------------------------------------------------------------------

def test_every_entry_is_vetted_against_the_installed_mlx_lm():
    """Each family's modules have forwards their entry lists (so a new mlx-lm release whose
    forwards changed fails here, not silently stock)."""
    for arch in FAMILIES:
        report = patch_model(build_model(arch), backend="reference")
        assert not [m.reason for m in report.fallbacks if "vetted" in m.reason], arch
    for arch in ("llama", "qwen2", "qwen3", "gemma3_text", "gemma2", "gpt_oss", "qwen3_next",
                 "qwen3_5", "gemma4_text"):
        report = patch_model(build_model(arch), backend="reference")
        assert not [m.reason for m in report.fallbacks if "vetted" in m.reason], arch


@pytest.mark.parametrize("how", ["subclass", "monkeypatch"])
@pytest.mark.parametrize("fuse_block", [True, False])
def test_unknown_op_in_a_known_forward_stays_stock(monkeypatch, how, fuse_block):
    """A qwen3 attention whose forward adds an op (queries * 1.5): stock, with the reason, and
    the model computes exactly what its stock modules compute."""
    from mlx_lm.models import qwen3

    original = qwen3.Attention.__call__

    def scaled_call(self, x, mask=None, cache=None):
        return 1.5 * original(self, x, mask, cache)

    model = build_model("qwen3", mx.float32)
    if how == "subclass":
        cls = type("ScaledAttention", (qwen3.Attention,), {"__call__": scaled_call})
        model.layers[0].self_attn.__class__ = cls
    else:
        monkeypatch.setattr(qwen3.Attention, "__call__", scaled_call)
    toks = tokens(N_TOKENS)
    stock = run(model, toks)
    report = patch_model(model, fuse_block=fuse_block, backend="reference")
    out = run(model, toks)
    layer0 = {m.module: m for m in report.layer(0)}
    assert not isinstance(model.layers[0].self_attn, BricksAttention)
    assert not isinstance(model.layers[0], BricksBlock)
    assert layer0["self_attn"].status == "fallback"
    assert "is not one this table entry was vetted against" in layer0["self_attn"].reason
    if how == "subclass":
        assert_dtype_close(out, run64(clone(model, mx.float64), toks), stock, dtype=mx.float32,
                           what="qwen3 with one unknown attention")
        assert isinstance(model.layers[1], BricksBlock if fuse_block else type(model.layers[1]))
    else:  # every layer's attention is unknown: nothing of it runs the bricks
        assert mx.array_equal(out, stock).item()
        assert all(m.status == "fallback" for m in report.modules if m.module == "self_attn")


def test_unknown_block_forward_is_not_fused(monkeypatch):
    """A block forward with an extra op: the block is not fused; attention and MLP (vetted)
    are patched one by one, and the extra op still runs (the block's own forward)."""
    from mlx_lm.models import llama

    original = llama.TransformerBlock.__call__

    def call(self, x, mask=None, cache=None):
        return 0.5 * original(self, x, mask, cache)

    model = build_model("llama", mx.float32)
    monkeypatch.setattr(llama.TransformerBlock, "__call__", call)
    toks = tokens(N_TOKENS)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert [m.status for m in report.layer(0)] == ["fallback", "patched", "patched"]
    assert "block forward TransformerBlock.__call__" in report.layer(0)[0].reason
    assert_dtype_close(run(model, toks), run64(clone(model, mx.float64), toks), stock,
                       dtype=mx.float32, what="llama with an unknown block forward")


def test_llama4_text_under_a_llama_entry_is_refused_and_would_be_wrong(monkeypatch):
    """llama4_text's inline weightless QK-norm is not in llama's layout: under the llama entry
    every module stays stock (its forwards are not llama's). Forcing the llama layout onto it
    (vetting its forwards by hand) skips the norm and the logits leave the dtype rule by far:
    what the fingerprints prevent."""
    model = build_model("llama4_text", mx.float32)
    toks = tokens(N_TOKENS)
    stock = run(model, toks)
    ref = run64(clone(model, mx.float64), toks)
    monkeypatch.setitem(table.ALIASES, "llama4_text", "llama")
    monkeypatch.delitem(table.ARCHITECTURES, "llama4_text")
    report = patch_model(model, backend="reference")
    assert report.architecture == "llama" and report.n_patched == 0
    assert mx.array_equal(run(model, toks), stock).item()

    layer = model.layers[0]
    forced = dataclasses.replace(table.ARCHITECTURES["llama"], mlp="feed_forward", vetted=tuple(
        forward_fingerprint(m) for m in (layer, layer.self_attn, layer.feed_forward)))
    monkeypatch.setitem(table.ARCHITECTURES, "llama", forced)
    report = patch_model(model, backend="reference")
    # the three RoPE layers' blocks (the NoPE layer's attention has no rope object: stock)
    assert [m.module for m in report.modules if m.status == "patched"][:3] == ["block"] * 3
    wrong = run(model, toks)
    assert float(mx.abs(wrong - stock).max()) > 0.1
    with pytest.raises(AssertionError, match="exceeds budget"):
        assert_dtype_close(wrong, ref, stock, dtype=mx.float32, what="llama layout")


# ---------------------------------------------------------------------------------------------
# the report names each layer's mixer
# ---------------------------------------------------------------------------------------------

def test_report_names_the_mixers_of_an_unlisted_model():
    """A model_type outside the table: each layer's entries name its mixer (attention here) by
    its attribute and kind; a SwitchMLP MoE is said to stay stock."""
    from mlx_bricks.patch.core import moe_block_reason
    from mlx_bricks.patch.modules import layer_mixers

    model = build_model("llama")
    model.model_type = "llama_like"
    model.args.model_type = "llama_like"
    report = patch_model(model, backend="reference")
    assert report.n_patched == 0
    assert report.modules[0].layer is None  # no experts: one model-level entry
    assert layer_mixers(model.layers[0]) == [("self_attn", "attention", "Attention")]

    from mlx_lm.models.switch_layers import SwitchMLP
    import mlx.nn as nn

    class SparseBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = SwitchMLP(8, 16, 4)

    reason = moe_block_reason(SparseBlock())  # mlx-lm's default activation, GELU
    assert "SwitchMLP experts stay stock (SwitchMLP activation GELU" in reason
    assert "patched by module" not in reason
    block = SparseBlock()
    block.experts.activation = nn.ReLU2()  # nemotron_h's: the MoE brick's gate-less path
    assert "its SwitchMLP experts are patched by module" in moe_block_reason(block)


def test_layer_without_attention_is_not_called_self_attn():
    """A layer of a listed family whose mixer is not attention (a Mamba-like module in place of
    self_attn) is reported under its own name and kind."""
    import mlx.nn as nn

    class ToyMambaMixer(nn.Module):
        def __call__(self, x, mask=None, cache=None):
            return x

    model = build_model("llama")
    layer = model.layers[1]
    del layer["self_attn"]
    layer.mixer = ToyMambaMixer()
    report = patch_model(model, backend="reference")
    entries = {m.module: m for m in report.layer(1)}
    assert "self_attn" not in entries
    assert entries["mixer"].status == "fallback"
    assert entries["mixer"].reason.startswith("Mamba (ToyMambaMixer)")


# ---------------------------------------------------------------------------------------------
# coverage: the share of prefill FLOPs in bricks
# ---------------------------------------------------------------------------------------------

def test_prefill_flops_counts_by_hand():
    """llama (3 layers): q/o 2*128*256, k/v 2*128*128, MLP 3*2*128*320, attention core
    4*4*64*(20+1)/2 per token and layer; an unvetted attention's FLOPs count as stock."""
    from mlx_lm.models import llama

    from mlx_bricks.patch.coverage import prefill_flops

    per_layer = 2 * 65536 + 2 * 32768 + 245760 + 4 * 4 * 64 * 21 // 2
    attention = 2 * 65536 + 2 * 32768 + 4 * 4 * 64 * 21 // 2
    model = build_model("llama")
    stock = prefill_flops(model, 20)
    assert (stock["bricks"], stock["stock"]) == (0, 3 * per_layer)
    assert stock["lm_head"] == 2 * 128 * 256  # tied: the embedding as the head
    model.layers[1].self_attn.__class__ = type(
        "OwnAttention", (llama.Attention,), {"__call__": lambda s, x, mask=None, cache=None:
                                             llama.Attention.__call__(s, x, mask, cache)})
    patch_model(model, backend="reference")
    got = prefill_flops(model, 20)
    assert got["layers"] == [(per_layer, 0), (per_layer - attention, attention),
                             (per_layer, 0)]
    assert got["share"] == pytest.approx(1 - attention / (3 * per_layer))
    with pytest.raises(ValueError, match="tokens"):
        prefill_flops(model, 0)


def test_prefill_flops_window_and_experts():
    """A sliding layer's keys are the window's; a MoE layer counts top_k experts."""
    from mlx_bricks.patch.coverage import prefill_flops

    model = build_model("olmo3")  # layers 0-2 window 8, layer 3 global; 4 heads of 64
    patch_model(model, backend="reference")
    tokens = 20
    got = prefill_flops(model, tokens)
    core = [b - got["layers"][3][0] for b, _ in got["layers"][:3]]
    window_keys, causal_keys = 8 - 8 * 7 / (2 * tokens), (tokens + 1) / 2
    assert core == [int(4 * 4 * 64 * window_keys) - int(4 * 4 * 64 * causal_keys)] * 3
    # glm4_moe: 4 experts of width 64 on hidden 128; top 2 vs top 1 adds one expert's
    # gate, up and down per token
    top = {}
    for k in (1, 2):
        moe = build_model("glm4_moe", num_experts_per_tok=k)
        patch_model(moe, backend="reference")
        top[k] = prefill_flops(moe, tokens)["layers"][1]
    assert top[2][0] - top[1][0] == 3 * 2 * 128 * 64 and top[1][1] == top[2][1] == 0


def test_q8_0_cache_routes_the_attention_file_of_a_family_built_on_llama():
    """smollm3's and the mistral3 wrapper's attention is llama.py's: kv_cache="q8_0" routes
    that file's attention (decode reads the Q8_0 cache) and unpatching restores it."""
    from mlx_lm.models import llama

    from mlx_bricks import make_prompt_cache
    from mlx_bricks.cache import Q8KVCache

    from mlx_lm.models import base

    from mlx_bricks.cache import _ROUTES

    def routes() -> int:  # other live models (earlier tests in this process) may hold some
        return _ROUTES.get(llama.__name__, [None, 0])[1]

    before = routes()
    for arch in ("smollm3", "mistral3"):
        model = build_model(arch, mx.float32)
        toks = tokens(N_TOKENS)
        report = patch_model(model, backend="reference", kv_cache="q8_0")
        assert routes() == before + 1
        assert llama.scaled_dot_product_attention is not base.scaled_dot_product_attention
        cache = make_prompt_cache(model)
        assert all(type(c) is Q8KVCache for c in cache)
        prefill = run(model, toks, cache)
        step = run(model, toks[:, -1:], cache)
        assert cache[0].offset == N_TOKENS + 1
        ref = run64(clone(model, mx.float64), mx.concatenate([toks, toks[:, -1:]], axis=1))
        # Q8_0 K/V: within a loose bound of float64 (the rounding of K and V is the error)
        assert float(mx.abs(step[:, -1] - ref[:, -1].astype(mx.float32)).max()) < 1.0
        assert report.calls()["q8_0_cache_attention"] == len(model.layers)
        assert prefill.shape == (1, N_TOKENS, 256)
        unpatch_model(model)
        assert routes() == before
        if before == 0:
            assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_llama4_chunked_attention_runs_the_brick_within_one_chunk():
    """llama4's RoPE layers attend in chunks of 16 (tiny config): a call whose queries and keys
    lie in one chunk is plain causal and runs the attention brick; one across a boundary (12:20,
    and every call once the cache holds a previous chunk) runs mlx-lm's block-diagonal mask."""
    from mlx_lm.models.cache import ChunkedKVCache

    model = build_model("llama4", mx.float32)
    toks = tokens(40)
    with _float64_context("llama4"):
        m64 = clone(model, mx.float64)
        chunks = [(0, 12), (12, 20), (20, 32), (32, 40)]
        refs = run_chunks(m64, run64, toks, chunks)
    stock = run_chunks(model, run, toks, chunks)
    report = patch_model(model, backend="reference")
    chunked = [m for m in report.modules if m.module == "self_attn" and m.layer != 3]
    cache = make_prompt_cache(model)
    assert type(cache[0]) is ChunkedKVCache
    calls = []
    for (a, b), s, r in zip(chunks, stock, refs):
        out = run(model, toks[:, a:b], cache)
        assert_dtype_close(out, r, s, dtype=mx.float32, what=f"llama4 chunk {a}:{b}")
        calls.append([m.state.calls["flash_attention"] for m in chunked])
    assert calls == [[1] * 3, [1] * 3, [1] * 3, [1] * 3]  # only the first chunk's call
    boundary = [r for r in report.runtime_fallbacks() if "across a chunk boundary" in r]
    assert sum(report.runtime_fallbacks()[r] for r in boundary) == 3 * 3
    # the NoPE global layer runs the brick on every chunk
    (nope,) = [m for m in report.modules if m.module == "self_attn" and m.layer == 3]
    assert nope.state.calls["flash_attention"] == len(chunks)
    unpatch_model(model)


def test_chunked_reason():
    from mlx_lm.models.cache import ChunkedKVCache, KVCache

    from mlx_bricks.nn.calls import chunked_reason

    def cache_at(offset, start=0):
        c = ChunkedKVCache(16)
        c.offset, c.start_position = offset, start
        return c

    mask = lambda L, n: mx.ones((L, n), dtype=mx.bool_)  # noqa: E731
    assert chunked_reason(mask(16, 16), None, 16, 16) is None
    assert "boundary" in chunked_reason(mask(17, 17), None, 17, 16)
    assert chunked_reason(mask(4, 14), cache_at(10), 4, 16) is None
    assert "boundary" in chunked_reason(mask(4, 16), cache_at(13), 4, 16)
    assert "boundary" in chunked_reason(mask(2, 18), cache_at(32, start=16), 2, 16)
    assert "not mlx-lm's (4, 14)" in chunked_reason(mask(4, 13), cache_at(10), 4, 16)
    assert "not mlx-lm's" in chunked_reason("causal", cache_at(10), 4, 16)
    assert "not ChunkedKVCache" in chunked_reason(mask(4, 4), KVCache(), 4, 16)
