"""The CUDA attention twin on the GPU (marker ``gpu``; skipped without a CUDA GPU).

What scripts/gpu/attention_cuda_check.py checked, as tests on the helpers of
tests/test_attention.py: every head_dim x dtype x tile variant with three flag sets (plain;
causal + Q8_0; window + soft-cap), each over shapes chosen by rotation so every length (1 ..
1000), GQA factor (1, 4, 8) and memory layout mlx-lm passes (transposed q, KV-cache slices at
a non-zero start, a non-unit head_dim stride) appears for every head_dim; one shape per case has
scores of several hundred. Rule: tests.tolerance (float64 reference, same-dtype naive MLX on the
GPU); the output must be fully written (no NaN). The benchmark half of the script is
``mlx_bricks.bench.gpu.attention_cases`` (``python -m mlx_bricks.bench --only cuda_attention``).
"""
from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks.attention import msl as _attention  # noqa: F401  (registers the kernel)
from mlx_bricks.bricks.attention.cuda import CUDA_HEAD_DIMS, launch_attention_cuda, variants
from mlx_bricks.bricks.q8_0.op import quantize_q8_0_reference
from tests.gpu_support import gpu
from tests.attention_ref import attention64, naive_attention, q8_round_trip
from tests.tolerance import assert_dtype_close, to_f64

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
SHAPES = [(1, 1), (7, 7), (33, 300), (129, 129), (300, 1000), (1000, 1000), (1, 1000), (7, 33),
          (129, 300), (33, 33), (300, 300)]
HEADS = ((4, 4), (8, 2), (8, 1))
LAYOUTS = ("contiguous", "mlx_lm", "contiguous", "strided_d")


def _cases():
    n = 0
    for D in CUDA_HEAD_DIMS:
        for dname in DTYPES:
            flag_sets = [dict(causal=False, window=None, softcap=None, q8=False),
                         dict(causal=True, window=None, softcap=None, q8=D % 32 == 0),
                         dict(causal=True, window=(8, 33, 100)[n % 3],
                              softcap=(30.0, 5.0)[n % 2], q8=False)]
            tiles = [t.name for t in variants(D, DTYPES[dname])]
            for fi, flags in enumerate(flag_sets):
                for j in range(4):
                    i = (n * 4 + j) % len(SHAPES)
                    lq, lk = SHAPES[i]
                    if dname == "float32" and D >= 256 and lk >= 1000:
                        lq, lk = min(lq, 129), 300  # keep the float64 reference cheap
                    case = dict(D=D, dtype=dname, Lq=lq, Lk=lk, heads=HEADS[i % 3], B=1 + (j == 1),
                                layout=LAYOUTS[j], tile=tiles[(fi + j) % len(tiles)],
                                scale=D ** -0.5 if j != 2 else 0.0625,
                                big=j == 3 and D in (64, 128) and flags["window"] is None,
                                **flags)
                    yield pytest.param(case, id=_case_id(case))
                n += 1


def _case_id(c):
    return (f"{c['dtype']}-D{c['D']}-{c['tile']}-{'causal' if c['causal'] else 'full'}"
            f"{'-w%d' % c['window'] if c['window'] else ''}"
            f"{'-cap%g' % c['softcap'] if c['softcap'] else ''}{'-q8' if c['q8'] else ''}"
            f"-B{c['B']}-h{c['heads'][0]}x{c['heads'][1]}-L{c['Lq']}x{c['Lk']}-{c['layout']}"
            f"{'-big' if c['big'] else ''}")


def _layout(x, layout):
    """x (B, H, L, D) as the view mlx-lm would pass (values unchanged)."""
    B, H, L, D = x.shape
    if layout == "mlx_lm":  # a KV-cache slice at a non-zero start of a longer buffer
        buf = mx.zeros((B, H, L + 9, D), x.dtype)
        buf[:, :, 3:3 + L] = x
        return buf[:, :, 3:3 + L]
    if layout == "strided_d":  # every other element: the element-wise load path
        buf = mx.zeros((B, H, L, 2 * D), x.dtype)
        buf[..., ::2] = x
        return buf[..., ::2]
    return x


@gpu
@pytest.mark.parametrize("c", list(_cases()))
def test_gpu_attention_twin_matches_float64(c):
    dtype = DTYPES[c["dtype"]]
    B, (Hq, Hkv), Lq, Lk, D = c["B"], c["heads"], c["Lq"], c["Lk"], c["D"]
    rng = np.random.default_rng(zlib.crc32(_case_id(c).encode()))
    qn = rng.standard_normal((B, Hq, Lq, D)).astype(np.float32)
    kn = rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32)
    vn = rng.standard_normal((B, Hkv, Lk, D)).astype(np.float32)
    if c["big"]:  # one channel with q 8 and k +-40: scores of several hundred
        qn[..., 0] = 8.0
        kn[..., 0] = 40.0 * np.sign(rng.standard_normal((B, Hkv, Lk)))
    q = mx.array(qn).astype(dtype)
    if c["layout"] == "mlx_lm":  # (B, L, H, D) projection transposed, as mlx-lm passes q
        q = mx.array(np.ascontiguousarray(qn.transpose(0, 2, 1, 3))).astype(dtype)
        q = q.transpose(0, 2, 1, 3)
    k, v = mx.array(kn).astype(dtype), mx.array(vn).astype(dtype)
    ks = vs = None
    if c["q8"]:
        (kq, ks), (vq, vs) = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
        k, v = q8_round_trip(k), q8_round_trip(v)
        kin, vin = _layout(kq, c["layout"]), _layout(vq, c["layout"])
        ks, vs = _layout(ks, c["layout"]), _layout(vs, c["layout"])
    else:
        kin, vin = _layout(k, c["layout"]), _layout(v, c["layout"])
    poison = mx.full((B * Lq * Hq * D,), float("nan"), dtype)  # freed, then reused by the output
    mx.eval(poison, q, kin, vin)
    del poison
    out = launch_attention_cuda(q, kin, vin, ks, vs, scale=c["scale"], causal=c["causal"],
                                window=c["window"], softcap=c["softcap"], variant=c["tile"])
    args = (c["scale"], c["causal"], c["window"], c["softcap"])
    assert not np.isnan(to_f64(out)).any(), "unwritten (NaN) output elements"
    assert_dtype_close(out, attention64(q, k, v, *args), naive_attention(q, k, v, *args),
                       dtype=dtype, what=_case_id(c))
