"""The fast CUDA attention family (cuda_src/attention_fa.cu) without a GPU.

1. Compile: the source ``mx.fast.cuda_kernel`` builds, recorded from ``launch_attention_fa``,
   through nvcc (default suite, every feature on): the mma.sync engine for sm_80, sm_86, sm_89,
   sm_90a, sm_120 and sm_121, the wgmma engine for sm_90a (elsewhere a build error); on sm_80
   and sm_90a with ``ptxas -v``: no spills, no stack frame, and a block's registers fit the SM
   (no ``__launch_bounds__``). Every tile x flag set: ``slow``. Skipped without nvcc.
2. Numerics: the kernel body run on the CPU by ``tests/cuda_emu`` (mma.sync and wgmma from the
   PTX fragment layouts and matrix descriptors, cp.async and wgmma completing at their waits)
   against float64 with the dtype-scaled rule: ragged lengths, Lk > Lq (bottom-right causal),
   GQA 1/2/4/8, head_dim 64/128/192/256, Dv != Dq, window, soft-cap, sinks, padded batches,
   strided views (bit-identical to contiguous), rows without keys (0); the output buffer starts
   as NaN, so an unwritten element fails.
On the GPU: tests/test_attention_fa_gpu.py.
"""
import zlib

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import cudacheck, kernels
from mlx_bricks.bricks.attention import cuda as ac
from tests import cuda_emu
from tests.test_attention_cuda import (
    NAME,
    assert_no_local_memory,
    from_bits,
    naive,
    reference64,
    tensor,
    to_bits,
)
from tests.tolerance import EPS, assert_dtype_close

F16, BF16 = mx.float16, mx.bfloat16
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90a", "sm_120", "sm_121")
TILES = ac.FA_TILES_BY_NAME

needs_nvcc = pytest.mark.skipif(cudacheck.find_nvcc() is None, reason="nvcc not found")
needs_emu = pytest.mark.skipif(cuda_emu.toolchain() is None,
                               reason="no host C++ compiler or CUDA headers")


# ---------------------------------------------------------------------------------------------
# tile table

def test_tile_table_fits_and_is_named_by_its_parameters():
    for D in ac.FA_HEAD_DIMS:
        tiles = ac.fa_tiles(D)
        assert [t.wg for t in tiles] == sorted((t.wg for t in tiles), reverse=True)
        for t in tiles:
            assert t.smem_bytes(D, D) <= ac.HOPPER_SMEM_LIMIT, t
            assert t.bk % 16 == 0 and t.ns >= 2 and t.mt in (1, 2)
            assert not t.wg or (t.mt == 1 and t.nw % 4 == 0), t
            assert not t.lag or (t.wg and t.nw == 8), t
            assert TILES[t.name] == t
    assert ac.pick_fa_tile(128, 128, ac.FA_WGMMA, cc=(9, 0)).wg
    assert not ac.pick_fa_tile(128, 128, ac.FA_MMA, cc=(9, 0)).wg
    assert ac.fa_variant_names(128, 128, cc=(9, 0)) == (ac.FA_WGMMA, ac.FA_MMA)
    assert ac.fa_variant_names(128, 128, cc=(8, 0)) == (ac.FA_MMA,)  # wgmma: sm_90 only
    assert ac.fa_variant_names(256, 256, cc=(8, 6)) == ()  # 99 KB: nothing fits
    assert ac.fa_tiles(80) == [] and ac.fa_tiles(512) == []
    assert all(not t.wg for t in ac.fa_tiles(192, 512))
    with pytest.raises(ValueError, match="no fast attention tile"):
        ac.pick_fa_tile(128, 128, ac.FA_WGMMA, cc=(8, 0))


def test_fa_applies_only_to_16_bit_float_kv():
    q = mx.zeros((1, 2, 4, 128), F16)
    assert ac.fa_applies(q, q, q)
    assert not ac.fa_applies(q, q, q, kv_quant="q8_0")
    assert not ac.fa_applies(q.astype(mx.float32), q.astype(mx.float32), q.astype(mx.float32))
    assert not ac.fa_applies(q[..., :96], q[..., :96], q[..., :96])


# ---------------------------------------------------------------------------------------------
# 1. compile checks

def record(D, Dv, variant, arch_cc=(9, 0)):
    """The launch launch_attention_fa makes with every feature on (window, soft-cap, kv_start,
    sinks), recorded."""
    B, Hq, Hkv, Lq, Lk = 1, 8, 2, 100, 300
    q = mx.zeros((B, Lq, Hq, D), BF16).transpose(0, 2, 1, 3)  # mlx-lm's layout
    k = mx.zeros((B, Hkv, Lk, D), BF16)
    v = mx.zeros((B, Hkv, Lk, Dv), BF16)
    tile = ac.pick_fa_tile(D, Dv, variant, cc=arch_cc)
    with cudacheck.recorded_launches(kernels) as records:
        out = ac.launch_attention_fa(q, k, v, scale=0.1, causal=True, window=64, softcap=30.0,
                                     variant=tile.name, kv_start=mx.zeros((B,), mx.int32),
                                     sinks=mx.zeros((Hq,), BF16))
    assert out.shape == (B, Hq, Lq, Dv) and len(records) == 1
    rec = records[0]
    assert rec.shared_memory == tile.smem_bytes(D, Dv)
    assert rec.threadgroup == (tile.threads, 1, 1)
    assert rec.grid == (tile.threads * -(-Lq // tile.bq), Hq, B)
    return rec, tile


_compiled: dict = {}


def _compile(rec, arch):
    key = (rec.key(), arch)
    if key not in _compiled:
        _compiled[key] = rec.compile(arch)
    return _compiled[key]


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
def test_launcher_compiles_for_every_architecture(arch):
    # The mma.sync engine on every architecture, with every feature on.
    rec, tile = record(128, 128, ac.FA_MMA)
    res = _compile(rec, arch)
    if arch in ("sm_80", "sm_90a"):
        assert_no_local_memory(res, f"{tile.name} {arch}")
        assert res.registers * tile.threads <= 65536, (tile.name, arch, res)


@needs_nvcc
def test_wgmma_engine_compiles_for_sm90a_only():
    # wgmma exists on sm_90a only: elsewhere the variant is a build error (never a trap at
    # run time); the tuner offers it on sm_90 only (fa_variant_names).
    rec, tile = record(128, 128, ac.FA_WGMMA)
    res = _compile(rec, "sm_90a")
    assert_no_local_memory(res, f"{tile.name} sm_90a")
    assert res.registers * tile.threads <= 65536, (tile.name, res)
    with pytest.raises(cudacheck.CompileError, match="need sm_90a"):
        rec.compile("sm_80")


def _all_compile_cases():
    flag_sets = {"causal": (True, False, False, False, False),
                 "all": (True, True, True, True, True)}
    for name, tile in TILES.items():
        D = next(d for d in ac.FA_HEAD_DIMS if tile in ac.fa_tiles(d))
        for fname, flags in flag_sets.items():
            for arch in ("sm_90a",) if tile.wg else ("sm_90a", "sm_80"):
                yield pytest.param(D, tile, flags, arch, id=f"D{D}-{name}-{fname}-{arch}")
    mla = ac.fa_tiles(192, 128)
    for tile in mla:
        yield pytest.param((192, 128), tile, flag_sets["all"], "sm_90a",
                           id=f"D192x128-{tile.name}-all-sm_90a")


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("D, tile, flags, arch", list(_all_compile_cases()))
def test_every_tile_compiles_without_local_memory(D, tile, flags, arch):
    dqk, dv = D if isinstance(D, tuple) else (D, D)
    inputs = [(BF16, 4), (BF16, 4), (BF16, 4), (mx.float32, 1), (mx.int32, 1), (mx.int32, 1),
              (mx.float32, 1)]
    res = cudacheck.compile_twin("flash_attention_fa", inputs, [BF16],
                                 ac.fa_template(BF16, dqk, dv, tile, *flags), arch=arch)
    assert_no_local_memory(res, f"D{D} {tile.name} {flags} {arch}")
    assert res.registers * tile.threads <= 65536, (tile.name, res)


# ---------------------------------------------------------------------------------------------
# 2. the kernel on the CPU

def run_fa(case, tile, views=("contiguous",) * 3, kv_start=None, sinks=None):
    """Run case ``(dtype, Dq, Dv, (B, Hq, Hkv, Lq, Lk), causal, window, softcap)`` on the
    emulated kernel with ``tile``; returns (out64 (B, Hq, Lq, Dv), q64, k64, v64)."""
    dtype, D, Dv, (B, Hq, Hkv, Lq, Lk), causal, window, softcap = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    qb = to_bits(rng.standard_normal((B, Hq, Lq, D)), dtype)
    kb = to_bits(rng.standard_normal((B, Hkv, Lk, D)), dtype)
    vb = to_bits(rng.standard_normal((B, Hkv, Lk, Dv)), dtype)
    name = NAME[dtype]
    has_window = window is not None and window < Lk
    fparams, iparams = (np.array(a) for a in ac.attention_params(
        D**-0.5, softcap, window if has_window else None))
    tmpl = [(n, NAME[v] if isinstance(v, mx.Dtype) else v) for n, v in ac.fa_template(
        dtype, D, Dv, tile, bool(causal) or window is not None, has_window,
        softcap is not None, kv_start is not None, sinks is not None)]
    raw = cuda_emu.run_attention(
        tensor(qb, name, views[0]), tensor(kb, name, views[1]), tensor(vb, name, views[2]),
        None, None, fparams, iparams, tmpl, (-(-Lq // tile.bq), Hq, B), tile.threads,
        tile.smem_bytes(D, Dv), B * Lq * Hq * Dv, kv_start=kv_start, sinks=sinks,
        kernel="flash_attention_fa")
    out = from_bits(raw, dtype).reshape(B, Lq, Hq, Dv).transpose(0, 2, 1, 3)
    return out, from_bits(qb, dtype), from_bits(kb, dtype), from_bits(vb, dtype)


def check_fa(case, tile, kv_start=None, sinks=None, **kw):
    dtype, D, _, _, causal, window, softcap = case
    out, q, k, v = run_fa(case, tile, kv_start=kv_start, sinks=sinks, **kw)
    assert not np.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    args = (q, k, v, D**-0.5, causal, window, softcap)
    assert_dtype_close(out, reference64(*args, kv_start, sinks),
                       naive(*args, dtype, kv_start, sinks), dtype=dtype,
                       what=f"{tile.name} {case!r} kv_start={kv_start} sinks={sinks}")
    return out


def fa_id(x):
    if isinstance(x, ac.FaTile):
        return x.name
    if isinstance(x, str):
        return x
    if isinstance(x, tuple) and len(x) == 7:
        dtype, D, Dv, (B, Hq, Hkv, Lq, Lk), causal, window, softcap = x
        return (f"{NAME[dtype]}-D{D}{f'x{Dv}' if Dv != D else ''}-B{B}-h{Hq}x{Hkv}-L{Lq}x{Lk}-"
                f"{'causal' if causal else 'full'}{f'-w{window}' if window else ''}"
                f"{f'-cap{softcap:g}' if softcap else ''}")
    return "none" if x is None else "_".join(f"{v:g}" for v in x)


# (case, tile): both engines, every head_dim, lengths 1 / 7 / 33 / 100, Lk > Lq, GQA 1-8,
# window, soft-cap, Dv != Dq; Lk spans several tiles so the ring wraps.
EMU_DEFAULT = [
    ((BF16, 128, 128, (1, 4, 1, 100, 300), True, 70, None), "fa_wg_bk128_w8_s2_iwo"),
    ((BF16, 128, 128, (1, 4, 1, 100, 300), True, None, None), "fa_wg_bk128_w8_s2_lag_ffma"),
    ((F16, 256, 256, (1, 2, 2, 70, 200), False, None, None), "fa_wg_bk64_w8_s2_lag_ffma"),
    ((F16, 64, 64, (2, 2, 2, 33, 300), True, 20, 5.0), "fa_wg_bk128_w8_s2_lag"),
    ((BF16, 256, 256, (1, 2, 1, 7, 300), True, None, None), "fa_wg_bk64_w8_s2_iwo"),
    ((F16, 128, 128, (1, 8, 1, 1, 129), True, None, None), "fa_mma_bk64_w8_s2"),
    ((BF16, 192, 128, (1, 2, 1, 40, 200), True, None, None), "fa_wg_bk64_w8_s2_iwo"),
    ((F16, 64, 64, (1, 4, 2, 100, 100), False, None, None), "fa_mma_bk64_w4_mt2_s2"),
]


@needs_emu
@pytest.mark.parametrize("case, tile", EMU_DEFAULT, ids=fa_id)
def test_emulated_fa_matches_float64(case, tile):
    check_fa(case, TILES[tile])


def _sweep():
    """The brief's sweep, sampled by hash (one case in 6): lengths 1 / 7 / 33 / 100 with
    Lk = Lq and Lk > Lq, GQA 1 / 2 / 4 / 8, head_dim 64 / 128 / 256, causal / window / full,
    soft-cap on some, each on its head_dim's first wgmma and first mma.sync tile."""
    for D in (64, 128, 256):
        for Lq in (1, 7, 33, 100):
            for extra in (0, 157):
                for gqa in (1, 2, 4, 8):
                    for mode in ("causal", "window", "full"):
                        case = ((F16, BF16)[(Lq + gqa) % 2], D, D, (1, gqa, 1, Lq, Lq + extra),
                                mode != "full", 24 if mode == "window" else None,
                                8.0 if (Lq + extra) % 3 == 0 else None)
                        if zlib.crc32(repr(case).encode()) % 6:
                            continue
                        for variant in (ac.FA_WGMMA, ac.FA_MMA):
                            yield pytest.param(case, ac.pick_fa_tile(D, D, variant, cc=(9, 0)),
                                               id=f"{fa_id(case)}-{variant}")


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("case, tile", list(_sweep()))
def test_emulated_fa_sweep_matches_float64(case, tile):
    check_fa(case, tile)


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("tile", list(TILES.values()), ids=fa_id)
def test_emulated_every_tile_matches_float64(tile):
    D = next(d for d in ac.FA_HEAD_DIMS if tile in ac.fa_tiles(d))
    check_fa((BF16, D, D, (1, 2, 1, 150, 5 * tile.bk + 37), True, None, None), tile)


# (case, tile, kv_start, sinks): padded batches (padding inside a tile, whole tiles, rows that
# see no key), sinks below and above the scores, both engines.
EMU_FEATURES = [
    ((F16, 128, 128, (2, 4, 2, 33, 300), True, None, None), "fa_wg_bk128_w8_s2_iwo",
     (0, 150), (-3.0, 0.5, 2.0, 40.0)),
    ((BF16, 64, 64, (2, 2, 1, 20, 140), True, 16, 5.0), "fa_mma_bk64_w4_mt2_s2",
     (130, 3), None),
    ((F16, 256, 256, (1, 2, 1, 33, 100), True, None, None), "fa_wg_bk64_w8_s2_iwo",
     None, (1.0, -20.0)),
]


@needs_emu
@pytest.mark.parametrize("case, tile, kv_start, sinks", EMU_FEATURES, ids=fa_id)
def test_emulated_fa_padding_and_sinks_match_float64(case, tile, kv_start, sinks):
    out = check_fa(case, TILES[tile], kv_start=kv_start, sinks=sinks)
    if kv_start is not None:  # rows that see no key are exactly 0
        _, _, _, (B, _, _, Lq, Lk), *_ = case
        pos = np.arange(Lk - Lq, Lk)
        for b, st in enumerate(kv_start):
            assert not out[b][:, pos < st].any()


@needs_emu
@pytest.mark.parametrize("tile", ["fa_wg_bk128_w8_s2_iwo", "fa_mma_bk64_w8_s2"])
def test_emulated_views_equal_contiguous(tile):
    # A transposed q (mlx-lm's projections), a KV-cache slice at a non-zero start, a non-unit
    # head_dim stride and a misaligned start (element-wise paths) give bit-identical results.
    case = (F16, 128, 128, (1, 4, 2, 20, 150), True, None, None)
    want = check_fa(case, TILES[tile])
    for views in (("transposed", "cache", "strided_d"), ("misaligned", "strided_d", "cache")):
        got, *_ = run_fa(case, TILES[tile], views=views)
        np.testing.assert_array_equal(got, want, err_msg=str(views))


@needs_emu
def test_emulated_rows_without_visible_key_are_zero():
    # Lq > Lk (not reachable through flash_attention): causal rows 0 .. Lq - Lk - 1 see no key.
    case = (F16, 64, 64, (1, 2, 1, 150, 20), True, None, None)
    out, q, k, v = run_fa(case, TILES["fa_wg_bk128_w8_s2_iwo"])
    assert np.isfinite(out).all() and not out[:, :, :130].any()
    np.testing.assert_allclose(out, reference64(q, k, v, 64**-0.5, True, None, None),
                               atol=4 * EPS[F16])
