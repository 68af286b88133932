"""Q8_0 KV cache: mlx-lm's cache protocol, exact contents and bytes, and models running on it.

Contents are compared bit for bit with ggml's Q8_0 of the same K/V (``quantize_q8_0_reference``,
itself checked against gguf-py in tests/test_q8_0.py). Model runs go through
``mlx_bricks.tools.kv_driver`` (the patch is not wired to the cache yet): a Q8_0-cache run must
match a run whose float cache holds the Q8_0 round trip of the same K/V (the only difference
being float rounding), and stays within the Q8_0 error of the float-cache run.
"""
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models import llama

from mlx_bricks.cache import (
    LayerCache,
    Q8KVCache,
    load_prompt_cache,
    make_prompt_cache,
    plan_prompt_cache,
    q8_0_cache_attention,
    register_with_mlx_lm,
    route_attention,
)
from mlx_bricks.bricks.q8_0.op import dequantize_q8_0_reference, quantize_q8_0_reference
from mlx_bricks.tools.kv_driver import q8_0_attention

F16, F32 = mx.float16, mx.float32
#: Relative size of float32 rounding between two float32 computations of the same values; on
#: MLX CUDA stock float32 matmuls run in TF32 (MLX_ENABLE_TF32 defaults to 1: 10-bit
#: mantissa, unit roundoff 2^-11), so the comparison runs there are only that close.
F32_REL, TF32_REL = 2e-5, 2e-3


def f32_rel(backend: str) -> float:
    return TF32_REL if backend == "cuda" else F32_REL


def kv(L, seed, B=1, H=2, D=64, dtype=F16):
    rng = np.random.default_rng(seed)
    return tuple(mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32)).astype(dtype)
                 for _ in range(2))


def assert_holds(cache, k, v):
    """The cache's views equal ggml's Q8_0 of k, v (bit for bit) up to the offset."""
    (kq, kd), (vq, vd) = cache.keys_and_values()
    assert cache.offset == k.shape[2] == kq.shape[2]
    for (q, d), x in (((kq, kd), k), ((vq, vd), v)):
        rq, rd = quantize_q8_0_reference(x)
        assert np.array_equal(np.array(q), np.array(rq))
        assert np.array_equal(np.array(d).view(np.uint16), np.array(rd).view(np.uint16))


# ---------------------------------------------------------------------------------------------
# protocol


def test_append_across_chunks_quantizes_once_and_grows_by_steps():
    # Growth as mlx-lm's KVCache: step-sized chunks (after a partial step, the buffer is cut to
    # the offset first), so both caches hold the same capacity after every append.
    k, v = kv(600, 1)
    c, fp = Q8KVCache(backend="reference"), mlx_cache.KVCache()
    assert c.empty() and c.nbytes == 0 and c.size() == 0
    pos = 0
    for n in (1, 254, 1, 1, 300, 43):  # crosses 256 and 512 inside and at chunk edges
        out = c.update_and_fetch(k[:, :, pos:pos + n], v[:, :, pos:pos + n])
        fp.update_and_fetch(k[:, :, pos:pos + n], v[:, :, pos:pos + n])
        pos += n
        assert c.offset == c.size() == pos
        assert c.keys[0].shape[2] == fp.keys.shape[2] >= pos
        assert out[0][0].shape == (1, 2, pos, 64) and out[0][1].shape == (1, 2, pos, 2)
        assert out[0][0].dtype == mx.int8 and out[0][1].dtype == F16
    assert_holds(c, k, v)


@pytest.mark.parametrize("D", [64, 128, 256])
def test_bytes_per_token_are_34_of_64_of_float16(D):
    # Same appends into mlx-lm's float16 KVCache: same capacity, exactly 34/64 of its bytes.
    k, v = kv(300, 2, D=D)
    q8, fp = Q8KVCache(backend="reference"), mlx_cache.KVCache()
    for lo, hi in ((0, 100), (100, 300)):
        q8.update_and_fetch(k[:, :, lo:hi], v[:, :, lo:hi])
        fp.update_and_fetch(k[:, :, lo:hi], v[:, :, lo:hi])
        assert q8.keys[0].shape[2] == fp.keys.shape[2]
        assert q8.nbytes * 64 == fp.nbytes * 34


def test_trim_then_append_overwrites():
    k, v = kv(200, 3)
    c = Q8KVCache(backend="reference")
    c.update_and_fetch(k[:, :, :150], v[:, :, :150])
    assert c.is_trimmable() and c.trim(30) == 30 and c.offset == 120
    assert c.trim(1000) == 120 and c.offset == 0  # never more than it holds
    c.update_and_fetch(k[:, :, :100], v[:, :, :100])
    k2, v2 = kv(200, 4)
    c.trim(10)  # 90 valid
    c.update_and_fetch(k2[:, :, :200], v2[:, :, :200])  # grows past the old capacity
    assert_holds(c, mx.concatenate([k[:, :, :90], k2], axis=2),
                 mx.concatenate([v[:, :, :90], v2], axis=2))


def test_trim_prompt_cache_and_can_trim():
    caches = [Q8KVCache(backend="reference") for _ in range(2)]
    for c in caches:
        c.update_and_fetch(*kv(10, 5))
    assert mlx_cache.can_trim_prompt_cache(caches)
    assert mlx_cache.trim_prompt_cache(caches, 4) == 4
    assert [c.offset for c in caches] == [6, 6]


def test_make_mask_is_mlx_lms():
    c = Q8KVCache(backend="reference")
    c.update_and_fetch(*kv(7, 6))
    assert c.make_mask(1) is None
    assert c.make_mask(5) == "causal"
    got = c.make_mask(3, return_array=True)
    want = mlx_cache.create_attention_mask(3, offset=7, return_array=True, window_size=None)
    assert np.array_equal(np.array(got), np.array(want))


def test_state_is_evaluable_and_sliced_to_offset():
    c = Q8KVCache(backend="reference")
    assert c.state == (None, None, None, None, 0)
    c.update_and_fetch(*kv(10, 7))
    mx.eval(c.state)  # what mlx-lm's generate loop does after every prefill chunk
    kq, kd, vq, vd, off = c.state
    assert off == 10 and kq.shape[2] == kd.shape[2] == vq.shape[2] == vd.shape[2] == 10


def test_save_load_round_trip_through_mlx_lm(tmp_path):
    k, v = kv(300, 8, D=128)
    q8 = Q8KVCache(backend="reference")
    q8.update_and_fetch(k[:, :, :280], v[:, :, :280])
    q8.trim(5)
    fp = mlx_cache.KVCache()
    fp.update_and_fetch(k, v)
    empty = Q8KVCache()
    path = str(tmp_path / "cache.safetensors")
    mlx_cache.save_prompt_cache(path, [q8, fp, empty], metadata={"model": "x"})

    loaded, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"model": "x"}
    assert [type(c) for c in loaded] == [Q8KVCache, mlx_cache.KVCache, Q8KVCache]
    assert loaded[0].offset == 275 and loaded[2].empty() and loaded[2].offset == 0
    assert_holds(loaded[0], k[:, :, :275], v[:, :, :275])
    # The loaded cache keeps working: append past the loaded (unpadded) buffers.
    loaded[0].update_and_fetch(k[:, :, 275:], v[:, :, 275:])
    assert_holds(loaded[0], k, v)
    # After registration mlx-lm's own loader (mlx_lm.generate --prompt-cache-file) works too.
    register_with_mlx_lm()
    again = mlx_cache.load_prompt_cache(path)
    assert type(again[0]) is Q8KVCache and again[0].offset == 275


def test_register_refuses_a_foreign_class(monkeypatch):
    monkeypatch.setattr(mlx_cache, "Q8KVCache", type("Q8KVCache", (), {}), raising=False)
    with pytest.raises(RuntimeError, match="another Q8KVCache"):
        register_with_mlx_lm()


def test_append_errors():
    c = Q8KVCache(backend="reference")
    k, v = kv(4, 9)
    with pytest.raises(ValueError, match="head_dim % 32"):
        c.update_and_fetch(k[..., :48], v[..., :48])
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        c.update_and_fetch(k.astype(mx.int32), v)
    with pytest.raises(ValueError, match=r"agree in \(B, Hkv, L\)"):
        c.update_and_fetch(k, v[:, :, :3])
    c.update_and_fetch(k, v)
    k3, v3 = kv(4, 10, H=3)
    with pytest.raises(ValueError, match="does not match"):
        c.update_and_fetch(k3, v3)


def test_mlx_lm_quantized_kv_conversion_leaves_it_alone():
    # generate's --kv-bits calls to_quantized on caches that have it; this one must not, and it
    # must not look like mlx-lm's own quantized cache to its attention (hasattr(cache, "bits")).
    c = Q8KVCache()
    assert not hasattr(c, "to_quantized") and not hasattr(c, "bits")


# ---------------------------------------------------------------------------------------------
# building a model's cache


def tiny_llama(seed=0, head_dim=64, layers=2, dtype=F32, **extra):
    args = llama.ModelArgs(model_type="llama", hidden_size=4 * head_dim, num_hidden_layers=layers,
                           intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                           rms_norm_eps=1e-5, vocab_size=64, tie_word_embeddings=True, **extra)
    mx.random.seed(seed)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def test_plan_gives_q8_0_for_full_attention_layers():
    model = tiny_llama()
    plan = plan_prompt_cache(model)
    assert [p.kind for p in plan] == ["Q8KVCache", "Q8KVCache"]
    assert all(isinstance(p, LayerCache) and "34/64" in p.reason for p in plan)
    assert [type(c) for c in make_prompt_cache(model, "fp16")] == [mlx_cache.KVCache] * 2


def test_plan_keeps_rotating_and_unsupported_layers_with_reasons():
    # A model with sliding-window and full-attention layers (llama's layer_types, as gemma3's
    # local/global layers): the sliding layer keeps its RotatingKVCache, and the mix runs.
    model = tiny_llama(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    plan = plan_prompt_cache(model)
    assert [p.kind for p in plan] == ["RotatingKVCache", "Q8KVCache"]
    assert "sliding-window" in plan[0].reason and "no rotating Q8_0" in plan[0].reason
    cache = [p.cache for p in plan]
    ref = [mlx_cache.RotatingKVCache(max_size=8), RoundTripKVCache()]
    toks = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [13], [14]]
    np.testing.assert_allclose(np.array(run(model, cache, toks)),
                               np.array(run(model, ref, toks)), atol=1e-4)

    class NoMakeCache:  # mlx-lm gives every layer a RotatingKVCache for max_kv_size
        layers = model.layers

    rot = plan_prompt_cache(NoMakeCache(), max_kv_size=128)
    assert [p.kind for p in rot] == ["RotatingKVCache"] * 2
    odd = tiny_llama(head_dim=48)
    plan = plan_prompt_cache(odd)
    assert [p.kind for p in plan] == ["KVCache"] * 2 and "head_dim 48" in plan[0].reason
    with pytest.raises(ValueError, match="kv must be one of"):
        make_prompt_cache(model, "q4")


# ---------------------------------------------------------------------------------------------
# models on the cache


class RoundTripKVCache(mlx_cache.KVCache):
    """A float KVCache holding the Q8_0 round trip of the K/V (what a Q8_0 cache represents),
    attended by stock mlx-lm: the comparison run for the Q8_0 cache."""

    def update_and_fetch(self, keys, values):
        def rt(x):
            return dequantize_q8_0_reference(*quantize_q8_0_reference(x), F32).astype(x.dtype)
        return super().update_and_fetch(rt(keys), rt(values))


def run(model, cache, chunks):
    """Logits of each chunk (list of token lists) fed in turn through ``cache``."""
    outs = []
    with q8_0_attention(model):
        for toks in chunks:
            outs.append(model(mx.array([toks]), cache=cache)[0])
    return mx.concatenate(outs, axis=0)


def test_prefill_and_decode_match_the_q8_0_round_trip(kernel_backend):
    # Prefill 20 tokens in chunks of 12 + 8 (the second attends bottom-right over 20 keys),
    # then decode 3 single tokens and one 3-token draft (decode brick, causal Lq = 3).
    model = tiny_llama(seed=1)
    chunks = [list(range(1, 13)), list(range(20, 28)), [5], [9], [33], [7, 8, 40]]
    q8 = run(model, make_prompt_cache(model, backend=kernel_backend), chunks)
    rtc = run(model, [RoundTripKVCache() for _ in model.layers], chunks)
    fp = run(model, [mlx_cache.KVCache() for _ in model.layers], chunks)
    q8, rtc, fp = (np.array(x) for x in (q8, rtc, fp))
    # Same K/V values attended: only float32 rounding apart (TF32 on CUDA: TF32_REL).
    np.testing.assert_allclose(q8, rtc, atol=f32_rel(kernel_backend) * np.abs(fp).max())
    # Against the float cache: the Q8_0 error itself (measured by the round-trip run) bounds it.
    q8_err = np.abs(rtc - fp).max()
    assert 0 < np.abs(q8 - fp).max() <= 1.5 * q8_err + f32_rel(kernel_backend) * np.abs(fp).max()
    # And the greedy tokens agree where the float run's top-2 margin exceeds that error.
    top2 = np.sort(fp, axis=-1)[:, -2:]
    decided = top2[:, 1] - top2[:, 0] > 4 * q8_err
    assert decided.sum() >= len(fp) // 2
    assert np.array_equal(q8.argmax(-1)[decided], fp.argmax(-1)[decided])


def test_generate_loop_and_multi_turn_reuse():
    # mlx-lm's generate_step on the Q8_0 cache (it evaluates c.state, asks make_mask, ...);
    # then a second turn continues in the same cache, as a chat front end would reuse it.
    model = tiny_llama(seed=2)
    cache = make_prompt_cache(model, backend="reference")
    with q8_0_attention(model):
        turn1 = [t for t, _ in generate_step(mx.array([3, 1, 4, 1, 5, 9, 2, 6]), model,
                                             prompt_cache=cache, max_tokens=4)]
        # generate_step has fed every token it yielded (it computes one step ahead).
        assert cache[0].offset == 8 + 4
        turn2 = [t for t, _ in generate_step(mx.array([11, 12, 13]), model,
                                             prompt_cache=cache, max_tokens=3)]
    assert cache[0].offset == 8 + 4 + 3 + 3
    # The same two turns on the round-trip float cache give the same tokens.
    ref = [RoundTripKVCache() for _ in model.layers]
    r1 = [t for t, _ in generate_step(mx.array([3, 1, 4, 1, 5, 9, 2, 6]), model,
                                      prompt_cache=ref, max_tokens=4)]
    r2 = [t for t, _ in generate_step(mx.array([11, 12, 13]), model, prompt_cache=ref,
                                      max_tokens=3)]
    assert (turn1, turn2) == (r1, r2)


def test_cache_attention_dispatch(kernel_backend):
    # decode brick for L <= 8, prefill brick above, dequantize + stock SDPA for array masks:
    # all three attend the same Q8_0 K/V.
    rng = np.random.default_rng(14)
    k, v = kv(40, 15, D=64, dtype=F32)
    c = Q8KVCache(backend="reference")
    kq, vq = c.update_and_fetch(k, v)
    kd, vd = c.dequantized(F32)
    for L in (1, 8, 9):
        q = mx.array(rng.standard_normal((1, 4, L, 64)).astype(np.float32))
        got = q8_0_cache_attention(q, kq, vq, scale=0.125, mask="causal" if L > 1 else None,
                                   backend=kernel_backend)
        want = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125,
                                                    mask="causal" if L > 1 else None)
        np.testing.assert_allclose(np.array(got), np.array(want),
                                   atol=f32_rel(kernel_backend) * np.abs(np.array(want)).max())
    q = mx.array(rng.standard_normal((1, 4, 3, 64)).astype(np.float32))
    mask = mx.array(rng.random((3, 40)) < 0.7)
    got = q8_0_cache_attention(q, kq, vq, scale=0.125, mask=mask, backend=kernel_backend)
    want = mx.fast.scaled_dot_product_attention(q, kd, vd, scale=0.125, mask=mask)
    np.testing.assert_allclose(np.array(got), np.array(want),
                               atol=f32_rel(kernel_backend) * np.abs(np.array(want)).max())


def test_route_attention_is_counted_and_undone():
    # Two routes on one architecture module (two models, or the patch and a driver): the
    # original comes back only when both are undone; undo is idempotent; float caches still take
    # mlx-lm's own attention meanwhile.
    a, b = tiny_llama(seed=3), tiny_llama(seed=4)
    original = llama.scaled_dot_product_attention
    undo_a, undo_b = route_attention(a), route_attention(b)
    assert llama.scaled_dot_product_attention is not original
    toks = mx.array([[1, 2, 3]])
    routed = np.array(a(toks, cache=[mlx_cache.KVCache() for _ in a.layers]))
    undo_a()
    undo_a()
    assert llama.scaled_dot_product_attention is not original
    undo_b()
    assert llama.scaled_dot_product_attention is original
    np.testing.assert_array_equal(routed, np.array(a(toks, cache=[mlx_cache.KVCache()
                                                                  for _ in a.layers])))
    with pytest.raises(ValueError, match="no scaled_dot_product_attention"):
        route_attention(type("M", (), {"__module__": "json"})())


# ---------------------------------------------------------------------------------------------
# measurement tools (their numbers are in docs/kv_cache.md)


def test_kld_summary():
    from mlx_bricks.tools.kv_accuracy import compare

    a = mx.array(np.random.default_rng(16).standard_normal((5, 50)).astype(np.float32))
    same = compare(a, a)
    assert same["mean_kld"] == pytest.approx(0.0, abs=1e-6) and same["top1_agreement"] == 1.0
    b = a.at[:, 0].add(100.0)  # token 0 becomes the certain prediction of `b`
    other = compare(a, b)
    assert other["mean_kld"] > 10 and other["top1_agreement"] == np.mean(
        np.array(mx.argmax(a, axis=-1)) == 0)


def test_outlier_study():
    # Q8_0 K error grows with a constant outlier channel; K smoothing removes the growth.
    from mlx_bricks.tools.kv_outlier import measure

    rows = measure(D=64, n_keys=128, n_queries=8)["rows"]
    kld = [r["weights_kld"] for r in rows]
    assert all(x < y for x, y in zip(kld[2:], kld[3:]))
    assert kld[-1] > 100 * kld[0]
    smooth = [r["smoothed_weights_kld"] for r in rows]
    assert max(smooth) < 2 * min(smooth)


@pytest.mark.slow
def test_default_model_answers_the_same_on_the_q8_0_cache():
    # The embedded default model through mlx-lm's stream_generate, stock cache vs Q8_0 cache
    # (route_attention, reference backend): the same greedy answer. About a minute on 2 cores.
    import mlx_bricks
    from mlx_lm import load, stream_generate

    model, tok = load(str(mlx_bricks.default_model()))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True)
    stock = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=10))
    undo = route_attention(model)
    try:
        cache = make_prompt_cache(model, backend="reference")
        q8 = "".join(r.text for r in stream_generate(model, tok, prompt, max_tokens=10,
                                                     prompt_cache=cache))
    finally:
        undo()
    assert type(cache[0]) is Q8KVCache and cache[0].offset > 10
    assert q8 == stock and "Paris" in q8


# ---------------------------------------------------------------------------------------------
# batching: BatchQ8KVCache against mlx-lm's own BatchKVCache


def _twins(L, seed, trim=0, H=2, D=64):
    """A Q8KVCache holding random K/V of L positions and a KVCache holding their Q8_0 round
    trip (float32), both trimmed by ``trim``: the same cache contents in the two formats."""
    q8, fp = Q8KVCache(backend="reference"), mlx_cache.KVCache()
    if L:
        k, v = kv(L, seed, H=H, D=D, dtype=F32)
        q8.update_and_fetch(k, v)
        fp.update_and_fetch(_round_trip(k), _round_trip(v))
    q8.trim(trim)
    fp.trim(trim)
    return q8, fp


def _round_trip(x):
    return dequantize_q8_0_reference(*quantize_q8_0_reference(x), dtype=F32)


def _append(q8, fp, L, seed, B):
    k, v = kv(L, seed, B=B, dtype=F32)
    q8.update_and_fetch(k, v)
    fp.update_and_fetch(_round_trip(k), _round_trip(v))


def assert_same_batch(q8, fp):
    """The Q8_0 batch holds what mlx-lm's BatchKVCache holds: K/V (dequantized, bit for bit),
    offsets, padding, write index and the masks it gives attention."""
    assert type(q8).__name__ == "BatchQ8KVCache" and type(fp) is mlx_cache.BatchKVCache
    assert q8._idx == fp._idx and q8.size() == fp.size()
    assert q8.offset.tolist() == fp.offset.tolist()
    assert q8.left_padding.tolist() == fp.left_padding.tolist()
    if fp.keys is None:
        assert q8.keys is None
        return
    for (qs, d), x in zip(q8.keys_and_values(), fp.keys_and_values()):
        assert np.array_equal(np.array(dequantize_q8_0_reference(qs, d, dtype=F32)), np.array(x))
    for N in (1, 4):
        m_q8, m_fp = q8.make_mask(N), fp.make_mask(N)
        assert m_q8.dtype == m_fp.dtype == mx.bool_ and m_q8.shape == m_fp.shape
        assert np.array_equal(np.array(m_q8), np.array(m_fp))


def test_batch_protocol_matches_mlx_lms_batch_kv_cache():
    """merge (an empty and a trimmed sequence among them), a right-padded prefill chunk
    (prepare / finalize), decode steps, filter, extend, trim and extract: step by step the
    same state as mlx-lm's BatchKVCache fed the same values."""
    twins = [_twins(5, 1), _twins(0, 2), _twins(20, 3, trim=3), _twins(9, 4)]
    q8 = Q8KVCache.merge([t[0] for t in twins])
    fp = mlx_cache.KVCache.merge([t[1] for t in twins])
    assert_same_batch(q8, fp)
    lengths, padding = [3, 1, 3, 2], [0, 2, 0, 1]
    for c in (q8, fp):
        c.prepare(lengths=lengths, right_padding=padding)
    _append(q8, fp, 3, 10, B=4)
    assert_same_batch(q8, fp)
    for c in (q8, fp):
        c.finalize()
    assert_same_batch(q8, fp)
    for step in range(2):
        _append(q8, fp, 1, 20 + step, B=4)
        assert_same_batch(q8, fp)
    for c in (q8, fp):
        c.filter([0, 2, 3])
    assert_same_batch(q8, fp)
    more = [_twins(2, 5), _twins(30, 6)]
    for c, others in ((q8, Q8KVCache.merge([t[0] for t in more])),
                      (fp, mlx_cache.KVCache.merge([t[1] for t in more]))):
        c.extend(others)
    assert_same_batch(q8, fp)
    _append(q8, fp, 1, 30, B=5)
    assert_same_batch(q8, fp)
    assert q8.trim(2) == fp.trim(2) == 2
    assert_same_batch(q8, fp)
    assert q8.nbytes > 0 and q8.is_trimmable()
    for i in range(5):
        one_q8, one_fp = q8.extract(i), fp.extract(i)
        assert type(one_q8) is Q8KVCache and one_q8.backend == "reference"
        assert one_q8.offset == one_fp.offset
        (kq, kd), (vq, vd) = one_q8.keys_and_values()
        for (qs, d), x in (((kq, kd), one_fp.keys), ((vq, vd), one_fp.values)):
            assert np.array_equal(np.array(dequantize_q8_0_reference(qs, d, dtype=F32)),
                                  np.array(x))


def test_batch_merge_of_empty_caches_and_errors():
    q8 = Q8KVCache.merge([Q8KVCache(), Q8KVCache()])
    fp = mlx_cache.KVCache.merge([mlx_cache.KVCache(), mlx_cache.KVCache()])
    assert_same_batch(q8, fp)
    assert q8.empty() and q8.nbytes == 0
    _append(q8, fp, 4, 1, B=2)  # the first prefill of a new batch
    assert_same_batch(q8, fp)
    with pytest.raises(TypeError, match="expected Q8KVCache elements, got KVCache"):
        Q8KVCache.merge([Q8KVCache(), mlx_cache.KVCache()])
    with pytest.raises(ValueError, match="empty BatchQ8KVCache"):
        q8.prepare(left_padding=[1, 0])
    with pytest.raises(ValueError, match=r"\(B, Hkv, D\)"):
        q8.update_and_fetch(*kv(1, 2, B=3, dtype=F32))


def test_batch_state_round_trip():
    q8 = Q8KVCache.merge([_twins(3, 1)[0], _twins(6, 2)[0]])
    mx.eval(q8.state)  # what BatchGenerator evaluates after each chunk
    copy = type(q8).from_state(q8.state)
    assert copy._idx == q8._idx and copy.offset.tolist() == q8.offset.tolist()
    for a, b in zip((*copy.keys, *copy.values), (*q8.keys, *q8.values)):
        assert np.array_equal(np.array(a), np.array(b))


def _batch_generate(model, prompts, caches, n):
    """Greedy tokens of each prompt through mlx-lm's BatchGenerator (continuous batching, the
    server's path), prefill batch 8."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n, prefill_batch_size=8, completion_batch_size=8)
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts), caches=caches)
    out = {u: [] for u in uids}
    while any(len(t) < n for t in out.values()):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
    gen.close()
    return [out[u] for u in uids]


def _alone(model, prompt, cache, n):
    from mlx_lm.sample_utils import greedy_sampler

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n,
                                             sampler=greedy_sampler, prompt_cache=cache)]


@pytest.mark.parametrize("kv_cache", ["fp16", "q8_0"])
def test_batched_generation_of_a_patched_model_equals_each_prompt_alone(kv_cache):
    """8 prompts of different lengths batched by BatchGenerator through a patched model give
    each prompt's own greedy tokens. With fp16 caches (``BatchKVCache``) the padded batch runs
    the attention brick (``kv_start = left_padding``); the Q8_0 cache's batch runs the stock
    attention, and the report says so."""
    from mlx_bricks.patch import patch_model
    from tests.models import build_model

    model = build_model("llama", F32, num_hidden_layers=2)
    report = patch_model(model, backend="reference", kv_cache=kv_cache)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, size=n).tolist() for n in (3, 17, 1, 9, 30, 5, 12, 2)]
    n = 6
    batched = _batch_generate(model, prompts, [make_prompt_cache(model, kv_cache)
                                               for _ in prompts], n)
    alone = [_alone(model, p, make_prompt_cache(model, kv_cache), n) for p in prompts]
    assert batched == alone
    reasons = report.runtime_fallbacks()
    if kv_cache == "q8_0":
        assert any("mask is an array" in r for r in reasons), reasons
    else:
        assert not any("mask" in r for r in reasons), reasons
        assert report.calls()["flash_attention"] > 0


def _batch_generate_logprobs(model, prompts, caches, n):
    """:func:`_batch_generate` with each step's log-probabilities (float64 numpy)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n, prefill_batch_size=8, completion_batch_size=8)
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts), caches=caches)
    out = {u: [] for u in uids}
    while any(len(t) < n for t in out.values()):
        for r in gen.next_generated():
            out[r.uid].append((r.token, np.array(r.logprobs.astype(mx.float32), np.float64)))
    gen.close()
    return [out[u] for u in uids]


def _alone_logprobs(model, prompt, cache, n):
    from mlx_lm.sample_utils import greedy_sampler

    return [(int(t), np.array(lp.astype(mx.float32), np.float64))
            for t, lp in generate_step(mx.array(prompt), model, max_tokens=n,
                                       sampler=greedy_sampler, prompt_cache=cache)]


def test_padded_batch_prefill_runs_the_attention_brick(kernel_backend, monkeypatch):
    """8 prompts whose cached prefixes differ in length (the server's prompt-cache reuse):
    BatchGenerator merges the caches into a left-padded ``BatchKVCache`` and prefills the
    rest of every prompt in one padded batch. The patched model's attention brick runs it with
    ``kv_start = left_padding`` (nonzero rows seen by the launcher, launch counter and report),
    nothing falls back for the mask, and each sequence's greedy tokens and log-probabilities
    equal that prompt run alone (float32 model: within 1e-4 of the log-probabilities' scale,
    8 TF32 ulps on CUDA; the batch changes only the order of the reductions)."""
    from mlx_bricks import kernels
    from mlx_bricks.bricks.attention import cuda as attention_cuda
    from mlx_bricks.bricks.attention import msl as attention_msl
    from mlx_bricks.patch import patch_model
    from tests.models import build_model

    starts = []
    for mod, name in ((attention_msl, "launch_attention"),
                      (attention_cuda, "launch_attention_cuda")):
        def spy(*a, _orig=getattr(mod, name), **kw):
            if kw.get("kv_start") is not None:
                starts.append(kw["kv_start"].tolist())
            return _orig(*a, **kw)
        monkeypatch.setattr(mod, name, spy)
    model = build_model("llama", F32, num_hidden_layers=2)
    # the tile rule: on a tuned backend (cuda) the tuner's own launches would count too
    report = patch_model(model, backend=kernel_backend, tune="off")
    rng = np.random.default_rng(1)
    rest = (3, 17, 2, 9, 30, 5, 12, 2)
    prefix = (2, 20, 1, 5, 9, 33, 1, 4)
    prompts = [rng.integers(0, 64, size=n + p).tolist() for n, p in zip(rest, prefix)]
    caches = []
    for p, n in zip(prompts, prefix):
        c = make_prompt_cache(model, "fp16")
        model(mx.array(p[:n])[None], cache=c)
        mx.eval([x.state for x in c])
        caches.append(c)
    n = 4
    before = report.calls()["flash_attention"]
    launches = kernels.LAUNCH_COUNTS[("flash_attention", kernel_backend)]
    batched = _batch_generate_logprobs(model, [p[k:] for p, k in zip(prompts, prefix)], caches,
                                       n)
    assert report.calls()["flash_attention"] == before + 2  # one padded chunk, 2 layers
    if kernel_backend != "reference":
        assert kernels.LAUNCH_COUNTS[("flash_attention", kernel_backend)] == launches + 2
        assert len(starts) == 2 and max(starts[0]) > 0 and min(starts[0]) == 0, starts
    reasons = report.runtime_fallbacks()
    assert not any("mask" in r for r in reasons), reasons
    # MLX's CUDA backend runs float32 GEMMs in TF32 (10-bit mantissa, MLX_ENABLE_TF32 on by
    # default): the batch's other GEMM shapes move the log-probabilities by ~1e-3 of their
    # scale there (H200, 2026-12-04: 5.7e-4), so the rule is 8 TF32 ulps; 1e-4 elsewhere
    rel = 8 * 2.0**-11 if kernel_backend == "cuda" else 1e-4
    for p, got in zip(prompts, batched):
        want = _alone_logprobs(model, p, make_prompt_cache(model, "fp16"), n)
        assert [t for t, _ in got] == [t for t, _ in want]
        for (_, a), (_, b) in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=0, atol=rel * max(1.0, np.abs(b).max()))


def test_padded_batch_admission_reasons():
    """A ``BatchKVCache`` call is taken when its mask has ``make_mask``'s type and shape
    (decided without reading values), and keyed as its own mask kind; other masks, a sliding
    window and a cache without left padding stay stock with their reason."""
    from mlx_bricks.nn.calls import cache_offset, call_reason, mask_key, track_batch_masks

    track_batch_masks()  # what patch_model does
    cache = mlx_cache.BatchKVCache([2, 0, 5])
    cache.update_and_fetch(mx.zeros((3, 2, 6, 8)), mx.zeros((3, 2, 6, 8)))
    x = mx.zeros((3, 4, 16))
    mask = cache.make_mask(4)
    assert mask.shape == (3, 1, 4, 10)
    assert call_reason(x, mask, cache, (), {}) is None
    # a mask of the same type and shape that make_mask did not make without a window: stock
    own = mx.ones((3, 1, 4, 10), dtype=mx.bool_)
    assert "did not make" in call_reason(x, own, cache, (), {})
    windowed = cache.make_mask(4, window_size=3)
    assert windowed.shape == mask.shape and "did not make" in call_reason(x, windowed, cache,
                                                                         (), {})
    assert mask_key(mask, cache, 4) == ("padded", 10) and cache_offset(cache) == 6
    assert "sliding-window" in call_reason(x, mask, cache, (), {}, window=4)
    assert "not BatchKVCache.make_mask" in call_reason(x, mask[:, :, :, 1:], cache, (), {})
    assert "not BatchKVCache.make_mask" in call_reason(x, "causal", cache, (), {})
    assert "not BatchKVCache.make_mask" in call_reason(x, mask.astype(mx.float32), cache, (),
                                                       {})
