"""The attention brick with v narrower than q/k (multi-head latent attention: D = 192 = 128 nope
+ 64 rope columns, Dv = 128): against a float64 softmax attention under the dtype-scaled rule,
on every backend; the tile configuration, the tuner key and the argument checks."""
from __future__ import annotations

import numpy as np
import pytest
import mlx.core as mx

from mlx_bricks.bricks.attention.kind import ATTENTION
from mlx_bricks.bricks.attention.msl import (
    THREADGROUP_MEMORY_LIMIT,
    attention_threadgroup_bytes,
    attention_tile_config,
)
from mlx_bricks.bricks.attention.op import flash_attention
from mlx_bricks.formats.q8_0 import kv_dense
from tests.test_attention import attention64, naive_attention
from tests.tolerance import assert_dtype_close

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32

# B, Lq, Lk, (Hq, Hkv), D, Dv, dtype, mask, window, q8: the MLA shapes (192/128: DeepSeek-V3,
# Kimi, LongCat; 96/64: MiniCPM3), a split head_dim with a narrower V (WD 2 and 4), the shared
# K/V buffer (float32 256/128), ragged lengths, chunked prefill (Lk > Lq), GQA, Q8_0 K/V.
CASES = [
    (1, 33, 33, (4, 4), 192, 128, BF16, "causal", None, False),
    (1, 7, 40, (4, 1), 192, 128, F16, "causal", None, True),
    (2, 9, 9, (2, 2), 192, 128, F32, None, None, False),
    (1, 20, 37, (2, 1), 96, 64, F16, "causal", 8, False),
    (1, 17, 17, (2, 2), 256, 128, F32, "causal", None, False),
    (1, 5, 12, (2, 1), 512, 128, BF16, "causal", None, False),
]


def case_id(c):
    B, Lq, Lk, (Hq, Hkv), D, Dv, dtype, mask, window, q8 = c
    return (f"B{B}-Lq{Lq}-Lk{Lk}-h{Hq}x{Hkv}-D{D}-Dv{Dv}-{str(dtype).split('.')[-1]}-{mask}"
            f"{'-w' + str(window) if window else ''}{'-q8' if q8 else ''}")


def make(B, Lq, Lk, Hq, Hkv, D, Dv, dtype, seed):
    rng = np.random.default_rng(seed)

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    return rand(B, Hq, Lq, D), rand(B, Hkv, Lk, D), rand(B, Hkv, Lk, Dv)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_narrow_values_match_float64(kernel_backend, case):
    B, Lq, Lk, (Hq, Hkv), D, Dv, dtype, mask, window, q8 = case
    q, k, v = make(B, Lq, Lk, Hq, Hkv, D, Dv, dtype, seed=Lq * D + Dv)
    scale = D**-0.5
    out = flash_attention(q, k, v, scale=scale, mask=mask, window=window,
                          kv_quant="q8_0" if q8 else None, backend=kernel_backend)
    assert out.shape == (B, Hq, Lq, Dv) and out.dtype == dtype
    if q8:
        k, v = kv_dense(k, dtype), kv_dense(v, dtype)
    causal = mask == "causal"
    ref = attention64(q, k, v, scale, causal, window)
    assert_dtype_close(out, ref, naive_attention(q, k, v, scale, causal, window), dtype=dtype,
                       what=case_id(case), factor=4.0 if kernel_backend == "reference" else 2.0)


def test_narrow_values_equal_the_same_attention_with_zero_padded_values(msl_backend):
    """The kernel with Dv = 128 computes the first 128 columns of the Dv = D kernel over V
    padded with zeros, bit for bit (the softmax does not depend on V; each column is its own
    sum in the same order)."""
    q, k, v = make(1, 24, 30, 4, 2, 192, 128, F16, seed=7)
    narrow = flash_attention(q, k, v, scale=0.1, mask="causal", backend=msl_backend)
    padded = mx.pad(v, [(0, 0), (0, 0), (0, 0), (0, 64)])
    wide = flash_attention(q, k, padded, scale=0.1, mask="causal", backend=msl_backend)
    assert mx.array_equal(narrow, wide[..., :128])


@pytest.mark.parametrize("D, Dv", [(192, 128), (192, 64), (96, 64), (512, 128), (256, 128)])
@pytest.mark.parametrize("dtype", [F16, F32], ids=["float16", "float32"])
def test_tile_config_with_narrow_values(D, Dv, dtype):
    """A narrower V tile never needs smaller tiles than Dv = D, and fits 32 KB."""
    wide, narrow = attention_tile_config(D, dtype), attention_tile_config(D, dtype, Dv)
    assert (narrow.bk, narrow.wq, narrow.wd) >= (wide.bk, wide.wq, wide.wd)
    assert narrow.threadgroup_bytes <= THREADGROUP_MEMORY_LIMIT
    assert narrow.threadgroup_bytes == attention_threadgroup_bytes(
        D, dtype.size, narrow.bk, narrow.wq, narrow.wd, narrow.kv_shared, Dv)
    assert attention_threadgroup_bytes(D, dtype.size, 16, 4, 1, False, Dv) < \
        attention_threadgroup_bytes(D, dtype.size, 16, 4, 1, False)


def test_tuner_key_names_the_value_width():
    from mlx_bricks.runtime.kind import Act

    args = {"q": Act((1, 8, 64, 192), F16), "k": Act((1, 8, 64, 192), F16),
            "v": Act((1, 8, 64, 128), F16), "scale": 0.1, "mask": "causal"}
    key = ATTENTION.key(args)
    assert "dv=128" in key.params and "head_dim=192" in key.params
    assert "dv" not in ATTENTION.key(dict(args, v=Act((1, 8, 64, 192), F16))).params


@pytest.mark.parametrize("D, Dv, q8, match", [
    (192, 256, False, "at most 192"),
    (192, 72, False, "one of"),
    (512, 80, False, "multiple of 32"),
    (192, 80, True, "q8_0"),  # a width the kernel splits, but not whole Q8_0 blocks
])
def test_bad_value_widths_raise(D, Dv, q8, match):
    q, k, v = make(1, 4, 4, 2, 2, D, Dv, F16, seed=1)
    with pytest.raises(ValueError, match=match):
        flash_attention(q, k, v, scale=0.1, kv_quant="q8_0" if q8 else None,
                        backend="reference")


def test_values_of_another_length_raise():
    q, k, _ = make(1, 4, 6, 2, 2, 192, 128, F16, seed=2)
    with pytest.raises(ValueError, match="same shape but for"):
        flash_attention(q, k, mx.zeros((1, 2, 5, 128), F16), scale=0.1, backend="reference")
