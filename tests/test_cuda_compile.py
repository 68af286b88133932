"""The CUDA twins compile, as MLX would build them, and stay in registers (no GPU needed).

Each case drives an op's CUDA path (``mlx_bricks.bricks.gemm.cuda``) with launches recorded instead
of run (``cudacheck.recorded_launches``), then compiles every recorded launch's generated source
with nvcc for sm_90a (H100/H200, what MLX targets there) and sm_80 (A100): a template argument
the body does not know, a type error or a register array in local memory fails here, before any
GPU run. Whether the twins compute the right values is tested on the GPU machine by the kernel
tests parametrised over the ``cuda`` backend. Skipped without nvcc.
"""
from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_bricks import cudacheck
import mlx_bricks.bricks.gemm.msl  # noqa: F401  (the ops register the kernel specs)
import mlx_bricks.bricks.swiglu.msl  # noqa: F401
import mlx_bricks.bricks.norm_qkv.msl  # noqa: F401
from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
from mlx_bricks.bricks.norm_qkv import cuda as qkv_cuda
from mlx_bricks.formats.affine import QuantizedWeight

pytestmark = pytest.mark.skipif(cudacheck.find_nvcc() is None, reason="nvcc not found")


@pytest.fixture(autouse=True)
def _as_if_on_an_h200(monkeypatch):
    """Tile rules and shared-memory limits as on an sm_90 GPU (this machine has none)."""
    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (9, 0))

_compiled: dict = {}


def _quantized(N, K, bits, gs, dtype):
    w = mx.random.normal((N, K), key=mx.random.key(N + K)).astype(dtype)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return QuantizedWeight(q, s, b, gs, bits)


def _weight(N, K, fmt, dtype):
    if fmt is None:
        return mx.zeros((N, K), dtype=dtype)
    return _quantized(N, K, *fmt, dtype)


def _compile_all(records, arch):
    assert records, "the op recorded no CUDA launch"
    for rec in records:
        key = (rec.key(), arch)
        if key not in _compiled:
            _compiled[key] = rec.compile(arch)
        res = _compiled[key]
        assert res.stack == 0 and res.spill_stores == 0 and res.spill_loads == 0, (
            f"{rec.name} {rec.template}: {res} (local memory)")
        assert res.registers <= 255
        # No __launch_bounds__ on the generated kernel: the block must fit in any case.
        assert res.registers * rec.threadgroup[0] <= 65536, (rec.threadgroup, res)
        assert rec.shared_memory <= gemm_cuda.max_shared_memory((9, 0))
        # MLX launches ceil(grid / threadgroup) blocks of min(threadgroup, grid) threads.
        assert all(g >= t for g, t in zip(rec.grid, rec.threadgroup)), (rec.grid, rec.threadgroup)


LINEAR_CASES = [
    # (M, N, K, dtype, weight format (bits, group_size) or None, bias, residual, tile)
    (7, 72, 64, mx.float16, None, True, True, None),
    (300, 4096, 1024, mx.bfloat16, None, False, False, "128x128"),
    (100, 256, 200, mx.bfloat16, None, True, False, "128x64"),
    (64, 192, 9, mx.float16, None, False, True, "64x64"),
    (33, 256, 256, mx.bfloat16, (4, 64), True, True, "128x128"),
    (33, 256, 256, mx.float16, (8, 32), False, False, "128x64"),
    (5, 128, 384, mx.bfloat16, (3, 128), False, True, "64x64"),
    (5, 128, 320, mx.bfloat16, (5, 32), False, False, "128x128"),
    (5, 128, 384, mx.bfloat16, (6, 64), False, False, "128x128"),
    (5, 128, 256, mx.bfloat16, (2, 32), True, False, "128x128"),
    # wgmma tiles (sm_90a)
    (300, 512, 256, mx.bfloat16, None, True, True, "wg128x256"),
    (300, 512, 256, mx.float16, None, False, False, "wg128x128"),
    (300, 512, 256, mx.bfloat16, None, False, True, "wg128x128"),
    (300, 512, 256, mx.bfloat16, (4, 64), False, False, "wg128x256"),
    (300, 512, 256, mx.bfloat16, (6, 64), True, False, "wg128x256"),
    (300, 512, 256, mx.bfloat16, (8, 64), True, False, "wg128x128"),
    (300, 512, 384, mx.bfloat16, (3, 32), False, False, "wg128x128"),
    # one wgmma group in flight
    (300, 512, 256, mx.bfloat16, None, True, False, "wg128x256d"),
    (300, 512, 256, mx.bfloat16, (4, 64), False, True, "wg128x256d"),
    (300, 512, 256, mx.bfloat16, (4, 64), False, False, "wg128x256d5"),
    (300, 512, 256, mx.float16, (8, 32), False, False, "wg128x128d"),
    # 8-bit on the 128 x 256 wgmma tiles (the conversion of dequant.cuh fits them)
    (300, 512, 256, mx.bfloat16, (8, 64), True, True, "wg128x256"),
    # split-K: partial products, then the reduce (bias and residual there)
    (300, 512, 256, mx.bfloat16, (4, 64), True, True, "wg128x256k2"),
    (300, 512, 256, mx.float16, None, False, True, "wg128x128k4"),
    (100, 256, 320, mx.bfloat16, (8, 32), True, False, "128x128k2"),
]


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: f"M{c[0]}N{c[1]}K{c[2]}-{c[4]}-{c[7]}")
def test_linear_twin_compiles(case):
    M, N, K, dtype, fmt, bias, residual, tile = case
    x = mx.zeros((M, K), dtype=dtype)
    w = _weight(N, K, fmt, dtype)
    b = mx.zeros((N,), dtype=dtype) if bias else None
    r = mx.zeros((M, N), dtype=dtype) if residual else None
    with cudacheck.recorded_launches(gemm_cuda, swiglu_cuda, qkv_cuda) as rec:
        y = gemm_cuda.linear(x, w, b, r, tile=tile)
    assert y.shape == (M, N)
    split = gemm_cuda.LINEAR_TILES[tile].split_k if tile else 1
    assert [r.name for r in rec] == (["gemm"] if split == 1 else
                                     ["gemm_splitk", "gemm_splitk_reduce"])
    _compile_all(rec, "sm_90a")


@pytest.mark.parametrize("variant,fmt_g,fmt_u,tile", [
    ("fused", None, None, "128x64"), ("fused", (4, 64), (4, 64), "64x64"),
    ("split", None, None, "128x128"),
    ("fused", (4, 64), (8, 64), None),  # mixed formats run split
    ("fused", None, None, "wg128x64"), ("fused", (4, 64), (4, 64), "wg128x64"),
    ("fused", (8, 32), (8, 32), "wg128x64"),
    ("fused", (4, 64), (4, 64), "wg128x64d"),
    ("fused", None, None, "wg128x128"), ("fused", (4, 64), (4, 64), "wg128x128"),
    ("fused", (2, 32), (2, 32), "wg128x128"),
])
def test_swiglu_twins_compile(variant, fmt_g, fmt_u, tile):
    M, N, K, dtype = 70, 384, 256, mx.bfloat16
    x = mx.zeros((M, K), dtype=dtype)
    with cudacheck.recorded_launches(gemm_cuda, swiglu_cuda, qkv_cuda) as rec:
        act = swiglu_cuda.swiglu(x, _weight(N, K, fmt_g, dtype), _weight(N, K, fmt_u, dtype),
                               mx.zeros((N,), dtype=dtype), None, variant=variant, tile=tile)
    assert act.shape == (M, N)
    names = [r.name for r in rec]
    mixed = fmt_g != fmt_u
    assert names == (["swiglu_fused"] if variant == "fused" and not mixed else ["gemm", "gemm"])
    _compile_all(rec, "sm_90a")


@pytest.mark.parametrize("variant,fmt,tile,arch", [
    ("fused", None, "128x64", "sm_90a"), ("fused", (4, 64), "wg128x64", "sm_90a"),
    ("split", None, "128x128", "sm_90a"), ("fused", (4, 64), "64x64", "sm_80"),
])
def test_swiglu_gelu_tanh_twins_compile(monkeypatch, variant, fmt, tile, arch):
    """The GELU-tanh activation (ACT = 1) of both twins: the fused kernel's GateUp op and the
    split variant's gate GEMM epilogue (GateTimesUp), each the same kernel with ACT set."""
    if arch == "sm_80":
        monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (8, 0))
    M, N, K, dtype = 70, 384, 256, mx.bfloat16
    x = mx.zeros((M, K), dtype=dtype)
    with cudacheck.recorded_launches(gemm_cuda, swiglu_cuda, qkv_cuda) as rec:
        act = swiglu_cuda.swiglu(x, _weight(N, K, fmt, dtype), _weight(N, K, fmt, dtype), None,
                               None, variant=variant, tile=tile, act=1)
    assert act.shape == (M, N)
    acts = [dict(r.template)["ACT"] for r in rec]
    # split: the up GEMM (plain epilogue, ACT 0) then the gate GEMM with the activation
    assert acts == ([1] if variant == "fused" else [0, 1]), acts
    _compile_all(rec, arch)


@pytest.mark.parametrize("fmts", [(None, None, None), ((4, 64), (4, 64), (8, 64))])
def test_rms_norm_qkv_twin_compiles(fmts):
    B, L, K, H, Hkv, D, dtype = 2, 9, 256, 4, 2, 64, mx.float16
    x = mx.zeros((B, L, K), dtype=dtype)
    ws = [_weight(h * D, K, f, dtype) for h, f in zip((H, Hkv, Hkv), fmts)]
    bias = [mx.zeros((h * D,), dtype=dtype) for h in (H, Hkv, Hkv)]
    with cudacheck.recorded_launches(gemm_cuda, swiglu_cuda, qkv_cuda) as rec:
        q, k, v = qkv_cuda.rms_norm_qkv(x, mx.ones((K,), dtype=dtype), 1e-5, *ws, *bias,
                                         n_heads=H, n_kv_heads=Hkv, head_dim=D)
    assert q.shape == (B, H, L, D) and k.shape == v.shape == (B, Hkv, L, D)
    assert [r.name for r in rec] == ["rms_norm_qkv"]
    _compile_all(rec, "sm_90a")


def test_sm80_portable_path_compiles(monkeypatch):
    """The mma.sync path is the portable one (sm_80+): an A100 gets no wgmma tile and the affine
    GEMM builds for it."""
    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (8, 0))
    assert not any(gemm_cuda.TILES[n].wgmma for n in gemm_cuda.tile_names())
    x = mx.zeros((1000, 256), dtype=mx.bfloat16)
    with cudacheck.recorded_launches(gemm_cuda, swiglu_cuda, qkv_cuda) as rec:
        gemm_cuda.linear(x, _quantized(1024, 256, 4, 64, mx.bfloat16))
    assert not dict(rec[0].template)["WGMMA"]
    _compile_all(rec, "sm_80")


def test_tile_rule_prefers_wgmma_on_sm90():
    assert gemm_cuda.TILES[gemm_cuda.select_tile(2048, 4096)].wgmma


def test_float32_has_no_cuda_twin():
    with pytest.raises(NotImplementedError, match="has no CUDA twin"):
        gemm_cuda.linear(mx.zeros((4, 64), dtype=mx.float32), mx.zeros((8, 64), dtype=mx.float32))


def test_a_compile_error_is_reported_with_the_log():
    with pytest.raises(cudacheck.CompileError, match="nvcc failed"):
        cudacheck.compile_source("__global__ void k() { this is not cuda; }")


#: Compiler builtins nvcc accepts but NVRTC (what ``mx.fast.cuda_kernel`` compiles with) does not
#: define. ``mlx_bricks.cudacheck`` compiles with nvcc, so it cannot catch them: an H200 run on
#: 2026-12-01 failed with 'identifier "__builtin_memcpy" is undefined' in a twin that had passed
#: every nvcc check here.
NVRTC_MISSING = ("__builtin_memcpy", "__builtin_memset", "__builtin_memmove")


def test_cuda_sources_avoid_builtins_nvrtc_lacks():
    from importlib import resources

    bad = []
    for f in resources.files("mlx_bricks.cuda_src").iterdir():
        if f.name.endswith((".cu", ".cuh")):
            text = f.read_text()
            bad += [f"{f.name}: {b}" for b in NVRTC_MISSING if b in text]
    assert not bad, f"NVRTC does not define these (use a union, memcpy-free loads): {bad}"


@pytest.mark.skipif(cudacheck.find_nvrtc() is None,
                    reason="libnvrtc not found (pip install nvidia-cuda-nvrtc, or MLX_BRICKS_NVRTC)")
def test_gemm_family_compiles_under_nvrtc():
    """NVRTC (what MLX compiles with) on one launch of each GEMM-family body and the dequantize
    brick: nvcc accepts builtins NVRTC lacks."""
    import mlx_bricks.bricks.dequantize.msl  # noqa: F401  (registers the dequantize spec)
    from mlx_bricks.bricks.dequantize import cuda as dqc

    x = mx.zeros((300, 256), dtype=mx.bfloat16)
    with cudacheck.recorded_launches(gemm_cuda, swiglu_cuda, qkv_cuda, dqc) as rec:
        gemm_cuda.linear(x, _quantized(512, 256, 3, 64, mx.bfloat16), tile="wg128x256k2")
        swiglu_cuda.swiglu(x, _quantized(512, 256, 4, 64, mx.bfloat16),
                         _quantized(512, 256, 4, 64, mx.bfloat16), tile="wg128x128")
        qkv_cuda.rms_norm_qkv(x.reshape(1, 300, 256), mx.ones((256,), mx.bfloat16), 1e-5,
                               *(_quantized(n, 256, 4, 64, mx.bfloat16) for n in (512, 128, 128)),
                               n_heads=8, n_kv_heads=2, head_dim=64)
        w = _quantized(64, 256, 5, 64, mx.float16)
        dqc.dequantize_cuda(w.w, w.scales, w.biases, bits=5, group_size=64, dtype=mx.float32)
    assert [r.name for r in rec] == ["gemm_splitk", "gemm_splitk_reduce", "swiglu_fused",
                                     "rms_norm_qkv", "dequantize"]
    for r in rec:
        cudacheck.compile_source_nvrtc(r.source())
