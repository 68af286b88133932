"""Q8_0 K/V attention in prefill as a tuned kind: every candidate of the ``attention`` kind
for ``kv_quant="q8_0"`` (the kernel reading Q8_0 blocks, ``dequant_kv``: the round trip once
then the float kernel, the composite ``dequant_kv_sdpa``: the round trip once then the stock
float attention) computes attention over exactly the Q8_0 round trip's values, checked against
float64 over those values with the tolerance rule, on every backend; the round trip itself is
bit for bit the format's reference."""
from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_bricks.bricks.attention.kind import ATTENTION, DEQUANT_KV, dense_kv
from mlx_bricks.formats.q8_0 import kv_dense, quantize_q8_0_reference
from tests.attention_ref import attention64, make_qkv, naive_attention
from tests.tolerance import assert_dtype_close

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32

CASES = [  # B, Lq, Lk, (Hq, Hkv), D, dtype, mask, window, softcap, K/V as (qs, d) pairs
    (1, 9, 9, (4, 2), 64, F16, "causal", None, None, False),
    (2, 7, 20, (4, 1), 128, BF16, "causal", 8, None, True),
    (1, 5, 5, (2, 2), 96, F32, None, None, 2.0, False),
]


@pytest.mark.parametrize("B,Lq,Lk,heads,D,dtype,mask,window,softcap,pairs", CASES)
def test_every_candidate_attends_over_the_round_trip(kernel_backend, B, Lq, Lk, heads, D, dtype,
                                                     mask, window, softcap, pairs):
    Hq, Hkv = heads
    q, k, v = make_qkv(B, Lq, Lk, Hq, Hkv, D, dtype, seed=B * Lq + D)
    kd, vd = kv_dense(k, dtype), kv_dense(v, dtype)
    if pairs:  # a Q8_0 cache's blocks
        k, v = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
    args = {"q": q, "k": k, "v": v, "scale": D ** -0.5, "mask": mask, "kv_quant": "q8_0"}
    args.update({o: val for o, val in (("window", window), ("softcap", softcap)) if val})
    assert ATTENTION.untuned_reason(args) is None  # tuned like float K/V
    cands = ATTENTION.variants(kernel_backend, dtype, args)
    names = [c.name for c in cands]
    if kernel_backend == "reference":
        assert names == []  # its round trip is stock's own MLX ops
    elif kernel_backend in ("metal", "emulator"):
        assert names == ["default", DEQUANT_KV, "dequant_kv_sdpa"]
    causal = mask == "causal"
    ref = attention64(q, kd, vd, args["scale"], causal, window, softcap)
    naive = naive_attention(q, kd, vd, args["scale"], causal, window, softcap)
    stock = ATTENTION.stock(args)
    assert_dtype_close(stock, ref, naive, dtype=dtype, what="stock", factor=4.0)
    for c in cands:
        out = ATTENTION.run(c, args, kernel_backend)
        assert out.shape == q.shape and out.dtype == dtype
        assert_dtype_close(out, ref, naive, dtype=dtype, what=f"{kernel_backend} {c.name}")


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_round_trip_is_the_formats(kernel_backend, dtype):
    _, k, _ = make_qkv(2, 1, 37, 1, 3, 64, dtype, seed=5)
    want = kv_dense(k, dtype)
    assert mx.array_equal(dense_kv(k, dtype, kernel_backend), want).item()
    pair = quantize_q8_0_reference(k)
    assert mx.array_equal(dense_kv(pair, dtype, kernel_backend), want).item()
