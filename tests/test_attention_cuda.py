"""The CUDA attention twin without a GPU: compile checks, its tile logic, and runs on the CPU.

1. Compile: the exact source ``mx.fast.cuda_kernel`` builds, through nvcc for sm_90a (H100/H200)
   and sm_80, with ``ptxas -v``: no spills and no stack frame for every variant (default suite: a
   representative set; every variant x flag set x arch: ``slow``). Skipped without nvcc.
2. Tile logic: the ``__host__`` helpers of attention.cuh that choose the loaded K/V tiles, the
   tiles a warp computes and the tiles it masks, checked exhaustively against brute-force
   visibility on the CPU (compiled by nvcc as host code).
3. Numerics: the kernel body run on the CPU by ``tests/cuda_emu`` (every CUDA thread an OS
   thread, warp collectives from the PTX fragment layouts, cp.async landing at its wait) against
   float64 numpy with the dtype-scaled rule; strided and misaligned views against contiguous
   inputs bit for bit; every output element written (the buffer starts as NaN bits).

On the GPU machine the numeric tests of tests/test_attention.py run on ``cuda`` as well.
"""
import subprocess
import tempfile
import zlib
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlx_bricks.bricks.attention.msl  # noqa: F401  (registers the kernel)
from mlx_bricks import cudacheck, kernels
from mlx_bricks.bricks.attention.cuda import (
    CUDA_HEAD_DIMS,
    HOPPER_SMEM_LIMIT,
    CudaTile,
    attention_params,
    launch_attention_cuda,
    pick_tile,
    smem_bytes,
    threads,
    variants,
)
from tests import cuda_emu
from tests.attention_ref import attention64, naive_attention
from tests.tolerance import EPS, assert_dtype_close

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
DTYPES = (F16, BF16, F32)
NAME = {F16: "float16", BF16: "bfloat16", F32: "float32"}

needs_nvcc = pytest.mark.skipif(cudacheck.find_nvcc() is None, reason="nvcc not found")
needs_emu = pytest.mark.skipif(cuda_emu.toolchain() is None,
                               reason="no host C++ compiler or CUDA headers")

# (CAUSAL, WINDOW, SOFTCAP, KV_Q8[, KV_START[, SINKS]]) flag sets of the compile checks; the
# last one has the most live registers.
FLAG_SETS = {
    "plain": (False, False, False, False),
    "causal_q8": (True, False, False, True),
    "causal_start": (True, False, False, False, True),
    "window_softcap": (True, True, True, False),
    "window_softcap_q8": (True, True, True, True),
    "window_softcap_q8_start": (True, True, True, True, True),
    "window_sinks": (True, True, False, False, False, True),
    "window_softcap_q8_start_sinks": (True, True, True, True, True, True),
}


def template(dtype, D, tile: CudaTile, causal, window, softcap, q8, kv_start=False,
             sinks=False):
    return [("T", dtype), ("D", D), ("BK", tile.bk), ("MT", tile.mt), ("QREG", tile.qreg),
            ("CAUSAL", causal or window), ("WINDOW", window), ("SOFTCAP", softcap),
            ("KV_Q8", q8), ("KV_START", kv_start), ("SINKS", sinks)]


def compile_variant(dtype, D, tile, flags, arch):
    causal, window, softcap, q8, *extra = flags
    start, sinks = (list(extra) + [False, False])[:2]
    kt = mx.int8 if q8 else dtype
    inputs = [(dtype, 4), (kt, 4), (kt, 4), (F16, 4), (F16, 4), (F32, 1), (mx.int32, 1),
              (mx.int32, 1), (F32, 1)]
    return cudacheck.compile_twin("flash_attention", inputs, [dtype],
                                  template(dtype, D, tile, causal, window, softcap, q8,
                                           bool(start), bool(sinks)), arch=arch)


def assert_no_local_memory(res, what):
    assert res.spill_stores == 0 and res.spill_loads == 0, f"{what}: spills {res}"
    assert res.stack == 0, f"{what}: stack frame {res}"
    assert res.registers <= 255, f"{what}: {res}"


# ---------------------------------------------------------------------------------------------
# 1. compile checks

# Default suite: launches recorded from launch_attention_cuda itself (so its template and
# inputs must match the body), the heaviest flag set, on three code paths (Q in registers with
# MT = 2, Q re-read from shared memory, the D = 512 warp-pair split) and both architectures.
REPRESENTATIVE = [
    (F16, 64, "sm_90a"),
    (BF16, 256, "sm_80"),
    (F16, 512, "sm_90a"),
]


@needs_nvcc
@pytest.mark.parametrize("dtype, D, arch", REPRESENTATIVE,
                         ids=lambda x: NAME.get(x, str(x)) if not isinstance(x, int) else f"D{x}")
def test_launcher_compiles_without_local_memory(dtype, D, arch):
    B, Hq, Hkv, Lq, Lk = 1, 8, 2, 100, 300
    q = mx.zeros((B, Lq, Hq, D), dtype).transpose(0, 2, 1, 3)  # mlx-lm's layout
    kq = mx.zeros((B, Hkv, Lk, D), mx.int8)
    ks = mx.zeros((B, Hkv, Lk, D // 32), F16)
    with cudacheck.recorded_launches(kernels) as records:
        out = launch_attention_cuda(q, kq, kq, ks, ks, scale=0.1, causal=True, window=64,
                                    softcap=30.0, kv_start=mx.zeros((B,), mx.int32),
                                    sinks=mx.zeros((Hq,), dtype))
    assert out.shape == (B, Hq, Lq, D) and len(records) == 1
    rec = records[0]
    tile = variants(D, dtype)[0]
    assert rec.shared_memory == smem_bytes(D, dtype, tile, True)
    assert rec.threadgroup == (threads(D), 1, 1)
    assert rec.grid == (threads(D) * -(-Lq // (64 * tile.mt)), Hq, B)
    res = rec.compile(arch)
    assert_no_local_memory(res, f"{NAME[dtype]} D={D} {tile.name} {arch}")
    assert res.registers * threads(D) <= 65536  # no __launch_bounds__: the block must fit


def _all_compile_cases():
    for D in CUDA_HEAD_DIMS:
        for dtype in DTYPES:
            for i, tile in enumerate(variants(D, dtype)):
                for fname, flags in FLAG_SETS.items():
                    if flags[3] and D % 32:
                        continue
                    for arch in ("sm_90a", "sm_80"):
                        yield pytest.param(dtype, D, tile, fname, arch,
                                           id=f"{NAME[dtype]}-D{D}-{tile.name}-{fname}-{arch}")


@needs_nvcc
@pytest.mark.slow
@pytest.mark.parametrize("dtype, D, tile, flags, arch", list(_all_compile_cases()))
def test_every_variant_compiles_without_local_memory(dtype, D, tile, flags, arch):
    res = compile_variant(dtype, D, tile, FLAG_SETS[flags], arch)
    assert_no_local_memory(res, f"{NAME[dtype]} D={D} {tile.name} {flags} {arch}")


@pytest.mark.parametrize("D", CUDA_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: NAME[d])
def test_every_variant_fits_hopper_shared_memory(D, dtype):
    for q8 in (False, True) if D % 32 == 0 else (False,):
        for tile in variants(D, dtype):
            assert smem_bytes(D, dtype, tile, q8) <= HOPPER_SMEM_LIMIT, (D, dtype, tile, q8)
            assert tile.bk % 16 == 0 and tile.mt in (1, 2)
            assert not (tile.qreg and (dtype == F32 or D > 128))
        assert pick_tile(D, dtype, q8, smem_limit=HOPPER_SMEM_LIMIT) == variants(D, dtype)[0]


def test_pick_tile_names_what_does_not_fit():
    with pytest.raises(ValueError, match="float32 needs 231936 bytes of shared memory"):
        pick_tile(512, F32, True, smem_limit=166912)
    with pytest.raises(ValueError, match="is not one of"):
        pick_tile(128, F16, False, variant="bk48_mt3")
    assert pick_tile(512, F16, False, smem_limit=166912).name == "bk32_mt1"


def test_parameter_inputs_match_the_msl_brick():
    f, i = attention_params(0.125, 30.0, 4096)
    assert f.dtype == F32 and i.dtype == mx.int32
    assert np.array(f).tolist() == [np.float32(0.125), 30.0, np.float32(1 / 30.0)]
    assert np.array(i).tolist() == [4096]
    f, i = attention_params(1.0, None, None)
    assert np.array(f).tolist() == [1.0, 0.0, 0.0] and np.array(i).tolist() == [0]


# ---------------------------------------------------------------------------------------------
# 2. tile logic, exhaustively on the CPU

TILE_LOGIC_MAIN = r"""
#include "mma.cuh"
#include "attention.cuh"
#include <cstdio>
using namespace bricks::attn;
int main() {
  long checked = 0;
  const int BQs[] = {64, 128}, WRs[] = {16, 32}, BKs[] = {16, 32, 64};
  const int windows[] = {1, 2, 7, 8, 33, 64, 100};
  for (int Lq = 1; Lq <= 140; Lq += (Lq < 20 ? 1 : 7))
  for (int off = -5; off <= 150; off += (off < 10 ? 1 : 23)) {
    const int Lk = Lq + off;
    if (Lk < 0) continue;
    const int diag = Lk - Lq;
    for (int mode = 0; mode < 3; ++mode)    // none, causal, window (implies causal)
    for (int window : windows)
    for (int lo_i = 0; lo_i < 4; ++lo_i) {  // kv_lo (KV_START, clamped to 0 .. Lk)
      if (mode < 2 && window != 1) continue;
      const int los[] = {0, 3, 33, Lk};
      const int kv_lo = los[lo_i] < Lk ? los[lo_i] : Lk;
      if (lo_i > 0 && window > 8) continue;  // keep the run short: windows 1, 2, 7, 8 only
      const bool upper = mode >= 1, hw = mode == 2;
      for (int bi = 0; bi < 2; ++bi) for (int BK : BKs) {
        const int BQ = BQs[bi], WR = WRs[bi];
        for (int q0 = 0; q0 < Lq; q0 += BQ) {
          const int qlast = (q0 + BQ < Lq ? q0 + BQ : Lq) - 1;
          const TileRange tr = block_tiles(q0, qlast, diag, Lk, BK, upper, hw, window, kv_lo);
          if (tr.t_begin < 0 || tr.t_begin > tr.t_end || tr.t_end > (Lk + BK - 1) / BK) {
            printf("FAIL bounds Lq=%d Lk=%d mode=%d w=%d BK=%d\n", Lq, Lk, mode, window, BK);
            return 1;
          }
          for (int row = q0; row <= qlast; ++row)
            for (int key = 0; key < Lk; ++key)
              if (key_visible(key, row + diag, Lk, upper, hw, window, kv_lo) &&
                  (key < tr.t_begin * BK || key >= tr.t_end * BK)) {
                printf("FAIL range Lq=%d Lk=%d mode=%d w=%d BK=%d row=%d key=%d\n", Lq, Lk,
                       mode, window, BK, row, key);
                return 1;
              }
          for (int w0 = q0; w0 < q0 + BQ && w0 < Lq; w0 += WR) {
            const int wl = (w0 + WR < Lq ? w0 + WR : Lq) - 1;
            for (int t = tr.t_begin; t < tr.t_end; ++t) {
              const int kv0 = t * BK;
              const bool act = tile_active(kv0, BK, w0, wl, diag, upper, hw, window, kv_lo);
              const bool nm =
                  tile_needs_mask(kv0, BK, w0, wl, diag, Lk, upper, hw, window, kv_lo);
              for (int row = w0; row <= wl; ++row)
                for (int key = kv0; key < kv0 + BK; ++key, ++checked) {
                  const bool vis = key_visible(key, row + diag, Lk, upper, hw, window, kv_lo);
                  if ((act && (nm ? vis : true)) != vis) {
                    printf("FAIL tile Lq=%d Lk=%d mode=%d w=%d BK=%d row=%d key=%d\n", Lq, Lk,
                           mode, window, BK, row, key);
                    return 1;
                  }
                }
            }
          }
        }
      }
    }
  }
  printf("OK %ld\n", checked);
  return 0;
}
"""


@needs_nvcc
def test_tile_range_skip_and_mask_logic_is_exact():
    # Every visible (row, key) pair lies in a loaded tile, every computed pair is either
    # visible or masked, and unmasked tiles hold only visible pairs: Lq 1..134, Lk - Lq in
    # -5..150, no mask / causal / 7 windows, BQ 64 and 128, BK 16/32/64, first valid key
    # (kv_lo, KV_START) 0, 3, 33 and Lk (clamped).
    src_dir = Path(cuda_emu.CUDA_SRC)
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "tiles.cu"
        cu.write_text(TILE_LOGIC_MAIN)
        exe = Path(tmp) / "tiles"
        subprocess.run([cudacheck.find_nvcc(), "-std=c++17", "-O2", "-I", str(src_dir), "-o",
                        str(exe), str(cu)], check=True, capture_output=True)
        res = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.startswith("OK"), res.stdout


# ---------------------------------------------------------------------------------------------
# 3. the kernel on the CPU (tests/cuda_emu)


def to_bits(x: np.ndarray, dtype) -> np.ndarray:
    a = mx.array(x.astype(np.float32)).astype(dtype)
    return np.array(a) if dtype == F32 else np.array(a.view(mx.uint16))


def from_bits(b: np.ndarray, dtype) -> np.ndarray:
    if dtype == F32:
        return b.astype(np.float64)
    return np.array(mx.array(b).view(dtype).astype(F32)).astype(np.float64)


def reference64(q, k, v, scale, causal, window, softcap, kv_start=None, sinks=None):
    """float64 attention with the twin's semantics (``tests/attention_ref.py``): a window
    (``p - window < j <= p``) implies the causal bound."""
    return attention64(q, k, v, scale, causal or window is not None, window, softcap,
                       kv_start, sinks)


def naive(q, k, v, scale, causal, window, softcap, dtype, kv_start=None, sinks=None):
    """The same-dtype MLX computation (CPU) of numpy inputs the tolerance rule compares with,
    as float64 numpy."""
    q, k, v = (mx.array(a.astype(np.float32)).astype(dtype) for a in (q, k, v))
    out = naive_attention(q, k, v, scale, causal or window is not None, window, softcap,
                          kv_start, sinks)
    return np.array(out.astype(F32)).astype(np.float64)


def tensor(x: np.ndarray, dtype_name: str, view="contiguous") -> cuda_emu.Tensor:
    """Lay (B, H, L, D) data ``x`` (already bits) out in memory as ``view`` says:
    ``contiguous``; ``transposed`` (a (B, L, H, D) buffer, as mlx-lm's projections);
    ``cache`` (rows 3 .. 3 + L of a longer (B, H, L + 9, D) buffer, a KV-cache slice at a
    non-zero start); ``strided_d`` (every other element of a (B, H, L, 2D) buffer: the
    element-wise path); ``misaligned`` (one element past a 16-byte boundary: element-wise)."""
    B, H, L, D = x.shape
    if view == "contiguous":
        return cuda_emu.Tensor(dtype_name, x.ravel(), x.shape, (H * L * D, L * D, D, 1))
    if view == "transposed":
        buf = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        return cuda_emu.Tensor(dtype_name, buf.ravel(), x.shape, (L * H * D, D, H * D, 1))
    if view == "cache":
        buf = np.zeros((B, H, L + 9, D), x.dtype)
        buf[:, :, 3:3 + L] = x
        return cuda_emu.Tensor(dtype_name, buf.ravel(), x.shape,
                               (H * (L + 9) * D, (L + 9) * D, D, 1), offset=3 * D)
    if view == "strided_d":
        buf = np.zeros((B, H, L, 2 * D), x.dtype)
        buf[..., ::2] = x
        return cuda_emu.Tensor(dtype_name, buf.ravel(), x.shape,
                               (H * L * 2 * D, L * 2 * D, 2 * D, 2))
    if view == "misaligned":
        flat = np.concatenate([np.zeros(1, x.dtype), x.ravel()])
        return cuda_emu.Tensor(dtype_name, flat, x.shape, (H * L * D, L * D, D, 1), offset=1)
    raise ValueError(view)


def quantize_q8(x: np.ndarray):
    """ggml Q8_0 of float data along D: (codes int8, scales float16)."""
    *lead, D = x.shape
    blocks = x.reshape(*lead, D // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(-1)
    d = (amax / 127).astype(np.float32)
    inv = np.where(d != 0, 1 / np.where(d != 0, d, 1), 0).astype(np.float32)
    v = blocks * inv[..., None]
    qs = np.clip(np.trunc(v) + np.where(np.abs(v - np.trunc(v)) >= 0.5, np.sign(v), 0), -127, 127)
    return qs.astype(np.int8).reshape(*lead, D), d.astype(np.float16)


def run_emulated(case, views=("contiguous",) * 3, variant=None, with_tile=False, kv_start=None,
                 nan_padding=False, sinks=None):
    """Run one case on the emulated kernel; returns (out64 (B, Hq, Lq, D), q64, k64, v64).
    ``kv_start``: None, or B ints (the KV_START instantiation); ``nan_padding``: K/V of the keys
    below ``kv_start[b]`` are NaN (float K/V only); ``sinks``: None, or Hq float32 sink
    logits (the SINKS instantiation)."""
    dtype, D, (B, Hq, Hkv, Lq, Lk), causal, window, softcap, q8 = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    qx = rng.standard_normal((B, Hq, Lq, D))
    kx = rng.standard_normal((B, Hkv, Lk, D))
    vx = rng.standard_normal((B, Hkv, Lk, D))
    if nan_padding:
        pad = np.arange(Lk)[None, None, :, None] < np.asarray(kv_start)[:, None, None, None]
        kx, vx = np.where(pad, np.nan, kx), np.where(pad, np.nan, vx)
    name = NAME[dtype]
    qb = to_bits(qx, dtype)
    tile = pick_tile(D, dtype, q8, variant, smem_limit=HOPPER_SMEM_LIMIT)
    if q8:
        (kq, kd), (vq, vd) = quantize_q8(kx), quantize_q8(vx)
        k_t = tensor(kq, "int8", views[1])
        v_t = tensor(vq, "int8", views[2])
        ks_t, vs_t = tensor(kd.view(np.uint16), "float16"), tensor(vd.view(np.uint16), "float16")

        def deq(c, d):  # T(q * d), as dequantize_q8_0_reference
            f = (c.reshape(*c.shape[:-1], -1, 32).astype(np.float32)
                 * d.astype(np.float32)[..., None]).reshape(c.shape)
            return from_bits(to_bits(f, dtype), dtype)

        k64, v64 = deq(kq, kd), deq(vq, vd)
    else:
        kb, vb = to_bits(kx, dtype), to_bits(vx, dtype)
        k_t, v_t = tensor(kb, name, views[1]), tensor(vb, name, views[2])
        ks_t = vs_t = None
        k64, v64 = from_bits(kb, dtype), from_bits(vb, dtype)
    q_t = tensor(qb, name, views[0])
    scale = D**-0.5
    has_window = window is not None and window < Lk
    fparams, iparams = (np.array(a) for a in attention_params(
        scale, softcap, window if has_window else None))
    tmpl = [(n, NAME[v] if isinstance(v, mx.Dtype) else v) for n, v in template(
        dtype, D, tile, causal, has_window, softcap is not None, q8, kv_start is not None,
        sinks is not None)]
    tmpl[5] = ("CAUSAL", bool(causal) or window is not None)
    nt = threads(D)
    raw = cuda_emu.run_attention(q_t, k_t, v_t, ks_t, vs_t, fparams, iparams, tmpl,
                                 (-(-Lq // (64 * tile.mt)), Hq, B), nt,
                                 smem_bytes(D, dtype, tile, q8), B * Lq * Hq * D,
                                 kv_start=kv_start, sinks=sinks)
    out = from_bits(raw, dtype).reshape(B, Lq, Hq, D).transpose(0, 2, 1, 3)
    result = (out, from_bits(qb, dtype), k64, v64)
    return (result, tile) if with_tile else result


def check_emulated(case, kv_start=None, sinks=None, **kw):
    dtype, D, _, causal, window, softcap, _ = case
    out, q, k, v = run_emulated(case, kv_start=kv_start, sinks=sinks, **kw)
    assert not np.isnan(out).any(), "unwritten (NaN-poisoned) output elements"
    scale = D**-0.5
    ref = reference64(q, k, v, scale, causal, window, softcap, kv_start, sinks)
    assert_dtype_close(out, ref, naive(q, k, v, scale, causal, window, softcap, dtype, kv_start,
                                       sinks),
                       dtype=dtype, what=f"{case!r} kv_start={kv_start} sinks={sinks}")
    return out


# (dtype, D, (B, Hq, Hkv, Lq, Lk), causal, window, softcap, q8)
EMU_DEFAULT = [
    (BF16, 64, (1, 2, 1, 33, 100), True, 8, 20.0, True),
]
EMU_SLOW = [
    (F16, 64, (2, 4, 2, 40, 70), True, None, None, False),
    (BF16, 80, (1, 2, 1, 7, 7), False, None, None, False),
    (F32, 96, (1, 2, 2, 70, 75), True, 8, None, True),
    (F16, 128, (1, 4, 2, 33, 100), True, 33, 5.0, False),
    (BF16, 128, (1, 2, 1, 129, 129), True, None, None, True),
    (F16, 192, (1, 2, 1, 20, 90), False, None, 3.0, False),
    (BF16, 256, (1, 2, 2, 65, 300), True, None, None, False),
    (F16, 256, (1, 2, 1, 1, 300), True, 33, 30.0, True),
    (F16, 512, (1, 2, 1, 70, 80), True, 40, None, True),
    (BF16, 512, (1, 2, 2, 129, 129), True, None, 50.0, False),
    (F32, 512, (1, 2, 1, 5, 40), False, None, None, False),
    (F32, 64, (1, 8, 1, 17, 50), True, None, 2.0, False),
    (F32, 256, (1, 2, 1, 33, 33), True, None, None, True),
]


def emu_id(case):
    dtype, D, (B, Hq, Hkv, Lq, Lk), causal, window, softcap, q8 = case
    return (f"{NAME[dtype]}-D{D}-B{B}-h{Hq}x{Hkv}-L{Lq}x{Lk}-{'causal' if causal else 'full'}"
            f"{f'-w{window}' if window else ''}{f'-cap{softcap:g}' if softcap else ''}"
            f"{'-q8' if q8 else ''}")


@needs_emu
@pytest.mark.parametrize("case", EMU_DEFAULT, ids=emu_id)
def test_emulated_kernel_matches_float64(case):
    check_emulated(case)


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("case", EMU_SLOW, ids=emu_id)
def test_emulated_kernel_matches_float64_sweep(case):
    check_emulated(case)


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("case", [
    (F16, 64, (1, 2, 1, 70, 90), True, None, 10.0, True),
    (F16, 80, (1, 2, 2, 33, 40), False, None, None, False),
    (BF16, 96, (1, 2, 1, 70, 90), True, 20, None, True),
    (F16, 128, (1, 2, 1, 70, 90), True, None, None, False),
    (F16, 256, (1, 2, 1, 33, 90), True, 16, None, False),
    (F16, 512, (1, 2, 1, 20, 40), True, None, None, False),
], ids=emu_id)
def test_emulated_alternative_variants_match_float64(case):
    for tile in variants(case[1], case[0])[1:]:
        check_emulated(case, variant=tile.name)


@needs_emu
def test_emulated_strided_and_misaligned_views_equal_contiguous():
    # A transposed q, a KV-cache slice at a non-zero start and a non-unit head_dim stride (the
    # element-wise path) give bit-identical results to contiguous inputs.
    case = (F16, 64, (1, 4, 2, 20, 40), True, None, None, False)
    want = check_emulated(case)  # and against float64, dtype-scaled
    got, *_ = run_emulated(case, views=("transposed", "cache", "strided_d"))
    np.testing.assert_array_equal(got, want)


@needs_emu
@pytest.mark.slow
def test_emulated_misaligned_and_q8_views_equal_contiguous():
    case = (F16, 64, (1, 2, 1, 20, 40), True, None, None, False)
    want, *_ = run_emulated(case)
    got, *_ = run_emulated(case, views=("misaligned", "strided_d", "misaligned"))
    np.testing.assert_array_equal(got, want)
    q8 = (BF16, 64, (1, 2, 1, 33, 100), True, 8, 20.0, True)
    want, *_ = run_emulated(q8)
    for views in (("transposed", "strided_d", "cache"), ("misaligned", "misaligned", "cache")):
        got, *_ = run_emulated(q8, views=views)
        np.testing.assert_array_equal(got, want, err_msg=str(views))


@needs_emu
def test_emulated_rows_without_visible_key_are_zero():
    # Lq > Lk (not reachable through flash_attention): causal rows 0 .. Lq - Lk - 1 see no key.
    case = (F16, 64, (1, 2, 1, 45, 20), True, None, None, False)
    out, q, k, v = run_emulated(case)
    assert np.isfinite(out).all()
    assert not out[:, :, :25].any()
    ref = reference64(q, k, v, 64**-0.5, True, None, None)
    np.testing.assert_allclose(out, ref, atol=4 * EPS[F16])


# ---------------------------------------------------------------------------------------------
# 4. kv_start: a left-padded batch (KV_START)

# (case, kv_start): paddings 0, partial and whole tiles, a row padded to all but its last key,
# a row whose first queries see no key, kv_start past Lk (clamped); one-row and multi-row.
EMU_PADDED = [
    ((F16, 64, (3, 4, 2, 7, 70), True, None, None, False), (0, 37, 66)),
    ((BF16, 128, (2, 2, 1, 1, 40), True, None, None, False), (39, 0)),
]
EMU_PADDED_SLOW = [
    ((F32, 64, (2, 2, 2, 40, 90), True, 16, 5.0, False), (5, 200)),
    ((BF16, 256, (2, 2, 1, 70, 100), True, None, None, True), (33, 64)),
    ((F16, 128, (2, 4, 1, 33, 33), False, None, None, False), (0, 20)),
    ((F16, 512, (2, 2, 1, 20, 40), True, None, None, False), (17, 3)),
]


@needs_emu
@pytest.mark.parametrize("case, kv_start", EMU_PADDED,
                         ids=lambda x: emu_id(x) if len(x) == 7 else "start" + "_".join(map(str, x)))
def test_emulated_kv_start_matches_float64(case, kv_start):
    out = check_emulated(case, kv_start=kv_start)
    _, _, (B, _, _, Lq, Lk), causal, *_ = case
    pos = np.arange(Lk - Lq, Lk)
    for b, s in enumerate(kv_start):  # rows that see no key are exactly 0
        assert not out[b][:, pos < s].any()


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("case, kv_start", EMU_PADDED_SLOW,
                         ids=lambda x: emu_id(x) if len(x) == 7 else "start" + "_".join(map(str, x)))
def test_emulated_kv_start_matches_float64_sweep(case, kv_start):
    check_emulated(case, kv_start=kv_start)


@needs_emu
def test_emulated_kv_start_zero_equals_no_kv_start():
    case = (F16, 64, (2, 2, 1, 20, 40), True, None, None, False)
    want, *_ = run_emulated(case)
    got, *_ = run_emulated(case, kv_start=(0, 0))
    np.testing.assert_array_equal(got, want)


@needs_emu
def test_emulated_kv_start_padding_is_never_read():
    # NaN in every padding key and value (partial tile included): every row stays finite and
    # equals attention over the valid keys.
    case = (F16, 64, (2, 2, 1, 8, 45), True, None, None, False)
    starts = (21, 3)
    out, q, k, v = run_emulated(case, kv_start=starts, nan_padding=True)
    assert np.isfinite(out).all()
    ref = reference64(q, np.nan_to_num(k), np.nan_to_num(v), 64**-0.5, True, None, None, starts)
    np.testing.assert_allclose(out, ref, atol=8 * EPS[F16] * max(1.0, np.abs(ref).max()))


# ---------------------------------------------------------------------------------------------
# 5. attention sinks (SINKS): one more softmax column per head, value 0 (gpt-oss)

# (case, kv_start, sinks): sinks below, near and far above the scores (a sink that takes
# nearly all the weight), GQA, a window, partial tiles, the D = 512 warp-pair split, float32's
# FFMA path, a padded batch whose first rows see only the sink.
EMU_SINKS = [
    ((F16, 64, (1, 4, 2, 33, 100), True, 8, None, False), None, (-3.0, 0.5, 2.0, 40.0)),
    ((BF16, 128, (2, 2, 1, 20, 40), True, None, None, False), (0, 30), (1.0, -20.0)),
]
EMU_SINKS_SLOW = [
    ((F32, 64, (1, 2, 1, 17, 50), True, None, 2.0, False), None, (0.0, 5.0)),
    ((F16, 512, (1, 2, 1, 70, 80), True, 40, None, True), None, (3.0, -1.0)),
    ((BF16, 256, (1, 2, 2, 65, 300), False, None, None, False), None, (0.25, 1.5)),
]


def _sinks_id(x):
    if isinstance(x, tuple) and len(x) == 7:
        return emu_id(x)
    return "none" if x is None else "_".join(f"{v:g}" for v in x)


@needs_emu
@pytest.mark.parametrize("case, kv_start, sinks", EMU_SINKS, ids=_sinks_id)
def test_emulated_sinks_match_float64(case, kv_start, sinks):
    out = check_emulated(case, kv_start=kv_start, sinks=sinks)
    if kv_start is not None:  # rows that see no key (only the sink) are exactly 0
        _, _, (B, _, _, Lq, Lk), *_ = case
        pos = np.arange(Lk - Lq, Lk)
        for b, st in enumerate(kv_start):
            assert not out[b][:, pos < st].any()


@needs_emu
@pytest.mark.slow
@pytest.mark.parametrize("case, kv_start, sinks", EMU_SINKS_SLOW, ids=_sinks_id)
def test_emulated_sinks_match_float64_sweep(case, kv_start, sinks):
    check_emulated(case, kv_start=kv_start, sinks=sinks)


@needs_emu
def test_emulated_sinks_of_minus_infinity_equal_no_sinks():
    # exp(-inf - m) = 0: the sink column adds nothing, bit for bit.
    case = (F16, 64, (1, 2, 1, 20, 40), True, None, None, False)
    want, *_ = run_emulated(case)
    got, *_ = run_emulated(case, sinks=(-np.inf, -np.inf))
    np.testing.assert_array_equal(got, want)
