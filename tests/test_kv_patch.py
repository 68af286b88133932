"""``patch_model(kv_cache="q8_0")``: the patched model (bricks and stock code) runs on the Q8_0
cache built by ``mlx_bricks.make_prompt_cache``, prefill and decode.

The comparison run is the stock model on a float cache holding the Q8_0 round trip of the same
K/V (tests/test_cache.py's ``RoundTripKVCache``): the same values attended, so only float
rounding (and the bricks' own dtype-scaled error) separates the two.
"""
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base, llama

import mlx_bricks
from mlx_bricks.cache import Q8KVCache
from mlx_bricks.nn import DECODE
from mlx_bricks.patch import patch_model, unpatch_model
from tests.test_cache import TF32_REL, RoundTripKVCache, tiny_llama

CHUNKS = [list(range(1, 13)), list(range(20, 28)), [5], [9], [7, 8, 40]]


def _run(model, cache, chunks):
    return np.array(mx.concatenate([model(mx.array([t]), cache=cache)[0] for t in chunks], 0))


@pytest.mark.parametrize("fuse_block", [True, False])
def test_patched_model_reads_the_q8_0_cache(kernel_backend, fuse_block):
    # Prefill in two chunks (the second bottom-right over 20 keys), then two decode steps and a
    # 3-token draft: the bricks' prefill and the routed stock decode both read Q8KVCache.
    model, stock = tiny_llama(seed=3), tiny_llama(seed=3)
    report = patch_model(model, kv_cache="q8_0", backend=kernel_backend, fuse_block=fuse_block)
    cache = mlx_bricks.make_prompt_cache(model)
    assert all(type(c) is Q8KVCache and c.backend == kernel_backend for c in cache)
    got = _run(model, cache, CHUNKS)
    want = _run(stock, [RoundTripKVCache() for _ in stock.layers], CHUNKS)
    # float32: the bricks' and stock's rounding apart (TF32 on CUDA, see tests/test_cache.py)
    rel = 1e-4 if kernel_backend != "cuda" else TF32_REL
    np.testing.assert_allclose(got, want, atol=rel * np.abs(want).max())
    assert cache[0].offset == sum(map(len, CHUNKS))
    calls = report.calls()
    # the two prefill chunks and the draft (L = 3: the brick path, the decode brick inside)
    assert calls["q8_0_cache_attention"] == 3 * len(model.layers)
    assert calls["rms_norm_qkv" if fuse_block else "linear"] > 0
    assert report.stock_calls()[DECODE] >= 2 * len(model.layers)
    assert [k for _, k, _ in report.kv_caches] == ["Q8KVCache"] * len(model.layers)
    assert "KV cache per layer (kv_cache=q8_0): Q8KVCache x 2" in str(report)
    unpatch_model(model)


def test_generation_on_the_q8_0_cache_without_a_kernel_backend(monkeypatch):
    # Auto backend on a CPU-only machine: no module is patched (reference is stock math), but
    # the asked-for Q8_0 cache is used (it saves memory on any backend): mlx-lm's generate_step
    # over two turns gives the round-trip cache's tokens.
    if mx.default_device() != mx.cpu and mx.metal.is_available():
        pytest.skip("needs a machine where auto selection gives reference")
    monkeypatch.delenv("MLX_BRICKS_BACKEND", raising=False)
    model, stock = tiny_llama(seed=4), tiny_llama(seed=4)
    report = patch_model(model, kv_cache="q8_0")
    if report.backend.name != "reference":
        pytest.skip(f"auto selected {report.backend.name}")
    assert report.all_stock
    prompt = mx.array([3, 1, 4, 1, 5, 9, 2, 6])

    def turns(m, cache):
        a = [t for t, _ in generate_step(prompt, m, prompt_cache=cache, max_tokens=4)]
        return a, [t for t, _ in generate_step(mx.array([11, 12]), m, prompt_cache=cache,
                                               max_tokens=3)]

    cache = mlx_bricks.make_prompt_cache(model)
    assert turns(model, cache) == turns(stock, [RoundTripKVCache() for _ in stock.layers])
    assert type(cache[0]) is Q8KVCache and cache[0].offset == 8 + 4 + 2 + 3
    unpatch_model(model)


def _routes() -> int:
    from mlx_bricks.cache import _ROUTES

    return _ROUTES.get(llama.__name__, [None, 0])[1]


def test_unpatch_gives_mlx_lm_attention_back():
    # Routes are counted per model file (other live models may hold some): each patch adds one,
    # re-patching or unpatching takes it back, and the last one restores mlx-lm's function.
    before = _routes()
    model = tiny_llama(seed=5)
    patch_model(model, kv_cache="q8_0", backend="reference")
    assert _routes() == before + 1
    assert llama.scaled_dot_product_attention is not base.scaled_dot_product_attention
    patch_model(model, kv_cache="fp16", backend="reference")  # re-patching undoes the route
    assert _routes() == before
    patch_model(model, kv_cache="q8_0", backend="reference")
    assert unpatch_model(model) > 0 and _routes() == before
    assert mlx_bricks.patch.patch_report(model) is None
    if before == 0:
        assert llama.scaled_dot_product_attention is base.scaled_dot_product_attention


def test_kv_cache_bad_input():
    model = tiny_llama(seed=6)
    with pytest.raises(ValueError, match="kv_cache must be 'fp16' or 'q8_0', got 'q4_0'"):
        patch_model(model, kv_cache="q4_0", backend="reference")
    with pytest.raises(ValueError, match="kv_quant and kv_cache='q8_0' exclude each other"):
        patch_model(model, kv_cache="q8_0", kv_quant="q8_0", backend="reference")


def test_a_dropped_model_gives_its_route_back():
    # A model discarded without unpatch_model (a server swapping models) must not leave its
    # route on mlx-lm's model file.
    import gc

    before = _routes()
    model = tiny_llama(seed=6)
    patch_model(model, kv_cache="q8_0", backend="reference")
    assert _routes() == before + 1
    del model
    gc.collect()
    assert _routes() == before
