"""Decode attention brick (flash-decoding): against a float64 numpy attention, dtype-scaled rule.

The naive comparison is ``softmax((q @ k^T) * scale + mask) @ v`` in MLX ops in the input dtype
(with Q8_0: over K/V dequantized to that dtype). The float64 reference attends over the exact
K/V the kernel reads (with Q8_0: ``qs * d`` in float64). The default suite runs a covering
subset of the sweep (every value of every axis) plus a fixed hash-chosen sample; the full cross
product is ``@pytest.mark.slow``.
"""
import itertools
import zlib

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import cudacheck, kernels
from mlx_bricks.bricks.decode.op import (
    DECODE_NSG,
    MSL_MAX_ROWS,
    SUPPORTED_HEAD_DIMS,
    _threadgroup_bytes,
    decode_attention,
    launch_decode_attention,
    msl_threadgroup_bytes,
    plan_splits,
    rows_per_threadgroup,
)
from mlx_bricks.bricks.q8_0.op import quantize_q8_0_reference
from tests.attention_ref import (
    assert_q8_within_bound,
    attention64,
    make_qkv,
    naive_attention,
)
from tests.support import sampled
from tests.tolerance import assert_dtype_close, to_f64

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
DTYPES = (F16, BF16, F32)


# ---------------------------------------------------------------------------------------------
# references


def dequant64(qs, d):
    """Exact Q8_0 values qs * d in float64 (what the kernel multiplies in float32, exactly)."""
    qs, d = to_f64(qs), to_f64(d)
    return (qs.reshape(*qs.shape[:-1], -1, 32) * d[..., None]).reshape(qs.shape)


# ---------------------------------------------------------------------------------------------
# the sweep

AXES = dict(
    Lk=(1, 31, 32, 33, 1000),
    heads=((4, 4), (8, 2), (8, 1)),  # GQA 1, 4, 8
    D=(64, 128, 256),
    dtype=DTYPES,
    q8=(False, True),
    splits=(None, 3, 7),             # 3 and 7 divide none of the lengths but 33 (3)
    Lq=(1, 3, 8),                    # causal, bottom-right; capped at Lk
)

# (B, Lq, Lk, (Hq, Hkv), D, dtype, q8, splits, causal): every value of every axis appears, and
# the head dims outside the sweep (80, 96, 192, 512) and mask=None with Lq > 1 once each.
COVERING = [
    (1, 1, 1, (4, 4), 64, F16, True, 7, True),
    (1, 3, 31, (8, 2), 128, BF16, False, None, True),
    (2, 8, 32, (8, 1), 256, F32, True, 3, True),
    (1, 1, 33, (8, 1), 128, F16, False, 3, True),
    (1, 1, 1000, (8, 2), 64, F32, True, None, True),
    (1, 8, 1000, (4, 4), 256, BF16, True, 7, True),
    (1, 3, 33, (4, 4), 80, F16, False, 7, True),
    (1, 1, 100, (8, 2), 96, BF16, True, 3, True),
    (1, 2, 64, (8, 2), 192, F32, True, 5, True),
    (1, 1, 65, (8, 1), 512, F16, True, 2, True),
    (1, 4, 40, (8, 2), 128, F32, False, 3, False),
]

FULL_GROUPS = [(D, dtype, q8) for D in AXES["D"] for dtype in DTYPES for q8 in (False, True)]


def full_cases(D, dtype, q8):
    return [(1, min(Lq, Lk), Lk, heads, D, dtype, q8, splits, True)
            for Lk, heads, splits, Lq in itertools.product(
                AXES["Lk"], AXES["heads"], AXES["splits"], AXES["Lq"])
            if not (Lq > Lk and Lq != AXES["Lq"][0])]


def case_id(case):
    B, Lq, Lk, (Hq, Hkv), D, dtype, q8, splits, causal = case
    dt = str(dtype).split(".")[-1]
    return (f"B{B}-Lq{Lq}-Lk{Lk}-h{Hq}x{Hkv}-D{D}-{dt}{'-q8' if q8 else ''}-s{splits}"
            f"{'' if causal else '-full'}")


def test_covering_subset_covers_every_axis_value():
    index = dict(Lk=2, heads=3, D=4, dtype=5, q8=6, splits=7, Lq=1)
    for name, values in AXES.items():
        seen = {c[index[name]] for c in COVERING}
        assert set(values) <= seen, f"axis {name}: {set(values) - seen} missing"
    assert {c[4] for c in COVERING} == set(SUPPORTED_HEAD_DIMS)
    assert any(not c[8] and c[1] > 1 for c in COVERING)


def check_case(backend, case):
    B, Lq, Lk, (Hq, Hkv), D, dtype, q8, splits, causal = case
    q, k, v = make_qkv(B, Lq, Lk, Hq, Hkv, D, dtype, seed=zlib.crc32(case_id(case).encode()))
    scale = D**-0.5
    mask = "causal" if causal else None
    if q8:
        kq, vq = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
        kd64, vd64 = dequant64(*kq), dequant64(*vq)
        k_in, v_in = kq, vq
        kn, vn = mx.array(kd64.astype(np.float32)).astype(dtype), mx.array(
            vd64.astype(np.float32)).astype(dtype)
    else:
        k_in, v_in, kd64, vd64, kn, vn = k, v, k, v, k, v
    before = {n: kernels.LAUNCH_COUNTS[(n, backend)]
              for n in ("decode_attention", "decode_attention_reduce")}
    out = decode_attention(q, k_in, v_in, scale=scale, mask=mask,
                           kv_quant="q8_0" if q8 else None, splits=splits, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    if backend != "reference":
        for n, c in before.items():
            assert kernels.LAUNCH_COUNTS[(n, backend)] == c + 1, n
    ref = attention64(q, kd64, vd64, scale, causal)
    assert_dtype_close(out, ref, naive_attention(q, kn, vn, scale, causal), dtype=dtype,
                       what=case_id(case))
    if q8:  # against full precision: the exact-arithmetic bound plus the kernel's own error
        assert_q8_within_bound(out, ref, attention64(q, k, v, scale, causal), q, k, v, kd64,
                               vd64, scale, dtype)


@pytest.mark.parametrize("case", COVERING, ids=case_id)
def test_decode_attention_matches_float64(kernel_backend, case):
    check_case(kernel_backend, case)


SAMPLE_ONE_IN = 60
SAMPLED = [c for g in FULL_GROUPS for c in full_cases(*g) if sampled(case_id(c), SAMPLE_ONE_IN)]


@pytest.mark.parametrize("case", SAMPLED, ids=case_id)
def test_decode_attention_sweep_sample(kernel_backend, case):
    check_case(kernel_backend, case)


@pytest.mark.slow
@pytest.mark.parametrize("group", FULL_GROUPS,
                         ids=lambda g: f"D{g[0]}-{str(g[1]).split('.')[-1]}{'-q8' if g[2] else ''}")
def test_decode_attention_full_sweep(kernel_backend, group):
    for case in full_cases(*group):  # a failure names its case
        check_case(kernel_backend, case)


# ---------------------------------------------------------------------------------------------
# launch plan


def test_rows_per_threadgroup_keeps_the_register_budget():
    # CUDA twin
    assert [rows_per_threadgroup(D, 64) for D in SUPPORTED_HEAD_DIMS] == [16, 8, 8, 8, 4, 4, 2]
    assert [rows_per_threadgroup(128, r) for r in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 8]
    for D in SUPPORTED_HEAD_DIMS:
        rt = rows_per_threadgroup(D, 64)
        assert rt * -(-D // 32) <= 32 and _threadgroup_bytes(D, rt) <= 32768
    # MSL kernel: at most 8 rows, and a small merge buffer (one row of O per SIMD-group)
    msl = [rows_per_threadgroup(D, 64, MSL_MAX_ROWS) for D in SUPPORTED_HEAD_DIMS]
    assert msl == [8, 8, 8, 8, 4, 4, 2]
    assert [msl_threadgroup_bytes(D, rt) for D, rt in zip(SUPPORTED_HEAD_DIMS, msl)] == [
        4 * (DECODE_NSG * D + 2 * DECODE_NSG * rt) for D, rt in zip(SUPPORTED_HEAD_DIMS, msl)]
    assert msl_threadgroup_bytes(128, 8) == 2304 and msl_threadgroup_bytes(512, 2) == 8256


def test_plan_splits():
    # 32k context, 8 KV heads: 64 splits of 512 keys fill TARGET_THREADGROUPS (512).
    assert plan_splits(32768, 8) == (64, 512)
    # Short contexts: no split shorter than one round of 32 keys per SIMD-group.
    assert plan_splits(1000, 8) == (8, 125)
    assert plan_splits(100, 8) == (1, 100)
    # A requested count is kept, also when it does not divide or exceeds the length.
    assert plan_splits(1000, 8, 7) == (7, 143)
    assert plan_splits(5, 8, 16) == (16, 1)


# ---------------------------------------------------------------------------------------------
# edge cases


def test_gqa_head_mapping(kernel_backend):
    # V of KV head j in batch b is the constant 10 b + j + 1, so every output row of query head
    # h must be 10 b + h // (Hq // Hkv) + 1 whatever the softmax weights are (rows of 12 query
    # heads over 3 KV heads, 2 query tokens: 8 rows per KV head, one threadgroup each).
    Hq, Hkv = 12, 3
    q, k, _ = make_qkv(2, 2, 50, Hq, Hkv, 64, F16, seed=5)
    const = 10 * np.arange(2)[:, None] + np.arange(Hkv)[None, :] + 1.0
    v = mx.array(np.broadcast_to(const[:, :, None, None], (2, Hkv, 50, 64))).astype(F16)
    out = to_f64(decode_attention(q, k, v, scale=0.125, mask="causal", splits=3,
                                  backend=kernel_backend))
    want = 10 * np.arange(2)[:, None] + np.arange(Hq)[None, :] // (Hq // Hkv) + 1.0
    np.testing.assert_allclose(out, np.broadcast_to(want[:, :, None, None], out.shape), rtol=2e-3)


def test_rows_without_visible_keys_are_zero(msl_backend):
    # Unreachable through decode_attention (Lk >= Lq): call the kernels with Lq > Lk, so causal
    # rows 0 .. Lq - Lk - 1 see no key in any split and must merge to 0, not NaN.
    q, _, _ = make_qkv(1, 6, 6, 8, 2, 64, F32, seed=6)
    _, k, v = make_qkv(1, 3, 3, 8, 2, 64, F32, seed=7)
    out = to_f64(launch_decode_attention(q, k, v, None, None, 0.125, True, 2, msl_backend))
    assert np.all(np.isfinite(out))
    assert not out[:, :, :3].any()
    np.testing.assert_allclose(out, attention64(q, k, v, 0.125, True), atol=1e-5)


def test_empty_splits_merge_as_nothing(kernel_backend):
    # 5 keys in 16 splits: 11 splits have no key at all.
    q, k, v = make_qkv(1, 1, 5, 4, 2, 128, F32, seed=11)
    out = decode_attention(q, k, v, scale=0.1, splits=16, backend=kernel_backend)
    np.testing.assert_allclose(to_f64(out), attention64(q, k, v, 0.1, False), atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_logits_of_magnitude_1e4_stay_finite(kernel_backend, dtype):
    # q, k entries of magnitude 12.5 (exact in every dtype), D = 64, scale 1: |logits| up to 1e4.
    rng = np.random.default_rng(8)
    sign = lambda *s: np.where(rng.random(s) < 0.5, -1.0, 1.0).astype(np.float32)  # noqa: E731
    q = mx.array(12.5 * sign(1, 4, 2, 64)).astype(dtype)
    k = mx.array(12.5 * sign(1, 2, 70, 64)).astype(dtype)
    k = mx.concatenate([k[:, :, :1] * 0 + q[:, ::2, :1], k[:, :, 1:]], axis=2)  # logit 1e4
    v = mx.array(rng.standard_normal((1, 2, 70, 64)).astype(np.float32)).astype(dtype)
    for scale in (1.0, -1.0):
        out = to_f64(decode_attention(q, k, v, scale=scale, mask="causal", splits=3,
                                      backend=kernel_backend))
        ref = attention64(q, k, v, scale, True)
        assert np.all(np.isfinite(out))
        np.testing.assert_allclose(out, ref, atol=1e-2 * np.abs(ref).max())


@pytest.mark.parametrize("q8", [False, True], ids=["fp", "q8"])
def test_views_are_read_in_place(msl_backend, q8):
    # q as mlx-lm makes it (a transposed (B, L, H, D) projection) and K/V as cache slices of
    # longer buffers whose stale tail holds NaN: the result is bit-identical to contiguous
    # copies, and the NaN past Lk is never read.
    B, Lq, Lk, cap, Hq, Hkv, D = 1, 2, 45, 64, 8, 2, 64
    rng = np.random.default_rng(12)
    qv = mx.array(rng.standard_normal((B, Lq, Hq, D)).astype(np.float32)).astype(F16)
    q = qv.transpose(0, 2, 1, 3)
    kbuf, vbuf = (mx.array(rng.standard_normal((B, Hkv, cap, D)).astype(np.float32)).astype(F16)
                  for _ in range(2))
    if q8:
        (kq, kd), (vq, vd) = quantize_q8_0_reference(kbuf), quantize_q8_0_reference(vbuf)
        stale = mx.arange(cap)[None, None, :, None] >= Lk
        kd = mx.where(stale, mx.array(float("nan"), F16), kd)
        vd = mx.where(stale, mx.array(float("nan"), F16), vd)
        k, v = (kq[:, :, :Lk], kd[:, :, :Lk]), (vq[:, :, :Lk], vd[:, :, :Lk])
        kc = tuple(mx.array(np.array(x)) for x in k)
        vc = tuple(mx.array(np.array(x)) for x in v)
    else:
        stale = mx.arange(cap)[None, None, :, None] >= Lk
        kbuf = mx.where(stale, mx.array(float("nan"), F16), kbuf)
        vbuf = mx.where(stale, mx.array(float("nan"), F16), vbuf)
        k, v = kbuf[:, :, :Lk], vbuf[:, :, :Lk]
        kc, vc = mx.array(np.array(k)), mx.array(np.array(v))
    kvq = "q8_0" if q8 else None
    a = decode_attention(q, k, v, scale=0.125, mask="causal", kv_quant=kvq, splits=3,
                         backend=msl_backend)
    b = decode_attention(mx.array(np.array(q)), kc, vc, scale=0.125, mask="causal",
                         kv_quant=kvq, splits=3, backend=msl_backend)
    assert np.all(np.isfinite(np.array(a.astype(F32))))
    assert np.array_equal(np.array(a), np.array(b))


@pytest.mark.parametrize("q8,D", [(False, 80), (True, 96)], ids=["fp-D80", "q8-D96"])
def test_kv_with_a_d_stride_take_the_strided_path(msl_backend, q8, D):
    # K/V (and Q8_0 quants) stored (B, Hkv, D, Lk) and seen transposed: d stride Lk, so the
    # kernel's scalar path runs; it computes what the chunk-load path computes on copies.
    B, Lq, Lk, Hq, Hkv = 1, 3, 37, 8, 2
    q, k, v = make_qkv(B, Lq, Lk, Hq, Hkv, D, BF16, seed=14)
    if q8:
        k, v = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
        kt = (mx.contiguous(k[0].swapaxes(-1, -2)).swapaxes(-1, -2), k[1])
        vt = (mx.contiguous(v[0].swapaxes(-1, -2)).swapaxes(-1, -2), v[1])
    else:
        kt = mx.contiguous(k.swapaxes(-1, -2)).swapaxes(-1, -2)
        vt = mx.contiguous(v.swapaxes(-1, -2)).swapaxes(-1, -2)
    kvq = "q8_0" if q8 else None
    a = decode_attention(q, kt, vt, scale=D**-0.5, mask="causal", kv_quant=kvq, splits=2,
                         backend=msl_backend)
    b = decode_attention(q, k, v, scale=D**-0.5, mask="causal", kv_quant=kvq, splits=2,
                         backend=msl_backend)
    assert np.array_equal(np.array(a.astype(F32)), np.array(b.astype(F32)))
    kd64 = dequant64(*k) if q8 else k
    vd64 = dequant64(*v) if q8 else v
    np.testing.assert_allclose(to_f64(a), attention64(q, kd64, vd64, D**-0.5, True), atol=2e-2)


def test_full_precision_kv_with_q8_0_is_quantized_first(kernel_backend):
    q, k, v = make_qkv(1, 1, 40, 4, 2, 64, F32, seed=13)
    a = decode_attention(q, k, v, scale=0.125, kv_quant="q8_0", backend=kernel_backend)
    b = decode_attention(q, quantize_q8_0_reference(k), quantize_q8_0_reference(v), scale=0.125,
                         kv_quant="q8_0", backend=kernel_backend)
    np.testing.assert_allclose(to_f64(a), to_f64(b), atol=1e-6)


def test_argument_errors():
    q, k, v = make_qkv(1, 1, 8, 4, 2, 64, F16, seed=1)
    with pytest.raises(TypeError, match="mixed dtypes"):
        decode_attention(q, k.astype(F32), v, scale=0.1)
    with pytest.raises(TypeError, match="only with kv_quant"):
        decode_attention(q, quantize_q8_0_reference(k), v, scale=0.1)
    with pytest.raises(ValueError, match="multiple of k/v's heads"):
        decode_attention(q[:, :3], k, v, scale=0.1)
    with pytest.raises(ValueError, match="must be >= q length"):
        decode_attention(mx.zeros((1, 4, 9, 64), F16), k, v, scale=0.1)
    with pytest.raises(ValueError, match="head_dim 48"):
        decode_attention(q[..., :48], k[..., :48], v[..., :48], scale=0.1)
    with pytest.raises(ValueError, match="head_dim % 32"):
        decode_attention(mx.zeros((1, 4, 1, 80), F16), mx.zeros((1, 2, 8, 80), F16),
                         mx.zeros((1, 2, 8, 80), F16), scale=0.1, kv_quant="q8_0")
    with pytest.raises(ValueError, match="array masks"):
        decode_attention(q, k, v, scale=0.1, mask=mx.ones((1, 8), mx.bool_))
    with pytest.raises(ValueError, match="splits"):
        decode_attention(q, k, v, scale=0.1, splits=0)
    with pytest.raises(ValueError, match="kv_quant"):
        decode_attention(q, k, v, scale=0.1, kv_quant="q4_0")
    with pytest.raises(TypeError, match="scale"):
        decode_attention(q, k, v, scale=mx.array(0.1))
    qs, d = quantize_q8_0_reference(k)
    with pytest.raises(ValueError, match=r"\(d\) must have shape"):
        decode_attention(q, (qs, d[..., :1]), (qs, d), scale=0.1, kv_quant="q8_0")


# ---------------------------------------------------------------------------------------------
# CUDA twins: the launches the op makes compile as MLX builds them, for sm_90a and sm_80, with
# no local memory (the pattern of tests/test_cuda_compile.py; correctness runs on the GPU).

import mlx_bricks.bricks.decode.op as decode_module  # noqa: E402


def _compile_launches(arch, dtype, q8, D, Lq, heads, Lk):
    if cudacheck.find_nvcc() is None:
        pytest.skip("nvcc not found")
    (Hq, Hkv) = heads
    q, k, v = make_qkv(1, Lq, Lk, Hq, Hkv, D, dtype, seed=0)
    ks = vs = None
    if q8:
        (k, ks), (v, vs) = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
    with cudacheck.recorded_launches(decode_module) as records:
        launch_decode_attention(q, k, v, ks, vs, D**-0.5, True, None, "cuda")
    assert [r.name for r in records] == ["decode_attention", "decode_attention_reduce"]
    rt = dict(records[0].template)["RT"]
    for rec in records:
        res = rec.compile(arch)
        assert res.stack == 0 and res.spill_stores == 0 and res.spill_loads == 0, (rec.name, res)
        # No __launch_bounds__ on generated kernels: the block must fit in any case.
        assert res.registers * rec.threadgroup[0] <= 65536, (rec.name, res)
        # MLX launches ceil(grid / threadgroup) blocks of min(threadgroup, grid) threads.
        assert all(g >= t and g % t == 0 for g, t in zip(rec.grid, rec.threadgroup)), rec.grid
        want_smem = _threadgroup_bytes(D, rt) if rec.name == "decode_attention" else 0
        assert res.smem == want_smem, (rec.name, res)


# (dtype, q8, D, Lq, (Hq, Hkv), Lk): the default suite compiles the llama-3-8B decode (Q8_0,
# GQA 4) and the register-heaviest tile of head_dim 256 (nvcc takes seconds per kernel); the
# slow one every (dtype, q8, head_dim) with its largest row tile.
CUDA_DEFAULT = [(F16, True, 128, 1, (32, 8), 100), (BF16, False, 256, 8, (8, 2), 50)]
CUDA_FULL = [(dt, q8, D, 8, (8, 1), 40) for dt in DTYPES for q8 in (False, True)
             for D in SUPPORTED_HEAD_DIMS if not (q8 and D % 32)]


def _cuda_id(c):
    dt, q8, D, Lq, (Hq, Hkv), Lk = c
    return f"{str(dt).split('.')[-1]}{'-q8' if q8 else ''}-D{D}-Lq{Lq}-h{Hq}x{Hkv}"


@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("case", CUDA_DEFAULT, ids=_cuda_id)
def test_cuda_twin_compiles_without_spills(arch, case):
    _compile_launches(arch, *case)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
@pytest.mark.parametrize("case", CUDA_FULL, ids=_cuda_id)
def test_cuda_twin_compiles_without_spills_full(arch, case):
    _compile_launches(arch, *case)


def test_nsg_matches_the_header():
    from mlx_bricks.kernels import read_source

    assert f"#define DEC_NSG {DECODE_NSG}" in read_source("decode_attention.h")
    assert f"constexpr int NSG = {DECODE_NSG};" in read_source(
        "decode_attention.cu", kernels.CUDA_SOURCE_PACKAGE)
