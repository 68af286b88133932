"""The fast CUDA attention family on the GPU (marker ``gpu``; skipped without a CUDA GPU).

Every tile of ``cuda.fa_tiles`` the GPU runs (wgmma tiles on sm_90 only), per head_dim, causal;
each head_dim's first tile per engine with four flag sets (causal; full; window + soft-cap;
padded batch + sinks); shapes chosen by
rotation so lengths 1 .. 1000, Lk > Lq, GQA 1 / 4 / 8 and mlx-lm's layouts (transposed q,
KV-cache slices, a non-unit head_dim stride) all appear; plus Dv != Dq (192 / 128), and the op
path (``run_flash_attention(variant=)``, the attention kind's listing). Rule: tests.tolerance
against float64 (numpy) and the same-dtype naive MLX computation; the output buffer is
poisoned with NaN first (an unwritten element fails).
"""
from __future__ import annotations

import zlib

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks.attention import cuda as ac
from mlx_bricks.bricks.attention.kind import ATTENTION
from mlx_bricks.bricks.attention.op import run_flash_attention
from tests.gpu_support import gpu
from tests.test_attention_cuda import naive, reference64
from tests.test_attention_gpu import _layout
from tests.tolerance import assert_dtype_close, to_f64

SHAPES = [(1, 1), (7, 300), (33, 33), (100, 1000), (129, 129), (1000, 1000), (1, 777),
          (300, 300)]
HEADS = ((4, 4), (8, 2), (8, 1))
LAYOUTS = ("contiguous", "mlx_lm", "strided_d", "contiguous")
FLAGS = (dict(causal=True, window=None, softcap=None, padded=False, sinks=False),
         dict(causal=False, window=None, softcap=None, padded=False, sinks=False),
         dict(causal=True, window=64, softcap=20.0, padded=False, sinks=False),
         dict(causal=True, window=None, softcap=None, padded=True, sinks=True))


def _tiles_here(dqk, dv):
    from mlx_bricks.bricks.gemm.cuda import device_capability, max_shared_memory

    cc = device_capability()
    return [t for t in ac.fa_tiles(dqk, dv)
            if (not t.wg or cc[0] == 9) and t.smem_bytes(dqk, dv) <= max_shared_memory(cc)]


def _cases():
    """Each head_dim's first tile of each engine (what the tuner gets) with all four flag
    sets; the other tiles causal only (each flag set is one more build per tile)."""
    n = 0
    for dqk, dv in ((64, 64), (128, 128), (192, 192), (256, 256), (192, 128)):
        tiles = ac.fa_tiles(dqk, dv)
        firsts = {next(t for t in tiles if t.wg == wg) for wg in (True, False)
                  if any(t.wg == wg for t in tiles)}
        for tile in tiles:
            for fi, flags in enumerate(FLAGS if tile in firsts else FLAGS[:1]):
                i = n % len(SHAPES)
                lq, lk = SHAPES[i]
                c = dict(dqk=dqk, dv=dv, tile=tile.name, Lq=lq, Lk=lk, heads=HEADS[n % 3],
                         B=2 if flags["padded"] else 1, layout=LAYOUTS[n % 4],
                         dtype=("float16", "bfloat16")[n % 2], **flags)
                yield pytest.param(c, id=_cid(c))
                n += 1


def _cid(c):
    flags = [name for name, on in (("causal", c["causal"]), (f"w{c['window']}", c["window"]),
                                   (f"cap{c['softcap']:g}" if c["softcap"] else "", c["softcap"]),
                                   ("pad", c["padded"]), ("sinks", c["sinks"])) if on]
    return "-".join([c["dtype"], f"D{c['dqk']}x{c['dv']}", c["tile"], *(flags or ["full"]),
                     f"B{c['B']}", "h%dx%d" % c["heads"], f"L{c['Lq']}x{c['Lk']}", c["layout"]])


def _inputs(c, seed):
    dtype = getattr(mx, c["dtype"])
    B, (Hq, Hkv), Lq, Lk = c["B"], c["heads"], c["Lq"], c["Lk"]
    rng = np.random.default_rng(seed)
    qn = rng.standard_normal((B, Hq, Lq, c["dqk"])).astype(np.float32)
    kn = rng.standard_normal((B, Hkv, Lk, c["dqk"])).astype(np.float32)
    vn = rng.standard_normal((B, Hkv, Lk, c["dv"])).astype(np.float32)
    q = mx.array(np.ascontiguousarray(qn.transpose(0, 2, 1, 3))).astype(dtype).transpose(
        0, 2, 1, 3) if c["layout"] == "mlx_lm" else mx.array(qn).astype(dtype)
    k, v = mx.array(kn).astype(dtype), mx.array(vn).astype(dtype)
    kv_start = mx.array([0, Lk // 2 + 3][:B], mx.int32) if c["padded"] else None
    sinks = mx.array(rng.standard_normal(Hq) * 2, mx.float32) if c["sinks"] else None
    return dtype, q, k, v, kv_start, sinks


def _check(c, out, q, k, v, kv_start, sinks, dtype):
    scale = c["dqk"] ** -0.5
    assert not np.isnan(to_f64(out)).any(), "unwritten (NaN) output elements"
    args = (to_f64(q), to_f64(k), to_f64(v), scale, c["causal"], c["window"], c["softcap"])
    ks = None if kv_start is None else np.array(kv_start)
    sk = None if sinks is None else np.array(sinks)
    assert_dtype_close(out, reference64(*args, ks, sk), naive(*args, dtype, ks, sk),
                       dtype=dtype, what=_cid(c))


@gpu
@pytest.mark.parametrize("c", list(_cases()))
def test_gpu_fa_tile_matches_float64(c):
    tile = ac.FA_TILES_BY_NAME[c["tile"]]
    if tile not in _tiles_here(c["dqk"], c["dv"]):
        pytest.skip(f"{tile.name} does not run on this GPU")
    dtype, q, k, v, kv_start, sinks = _inputs(c, zlib.crc32(_cid(c).encode()))
    kin, vin = _layout(k, c["layout"]), _layout(v, c["layout"])
    poison = mx.full((c["B"] * c["Lq"] * c["heads"][0] * c["dv"],), float("nan"), dtype)
    mx.eval(poison, q, kin, vin)
    del poison  # freed, then reused by the output
    out = ac.launch_attention_fa(q, kin, vin, scale=c["dqk"] ** -0.5, causal=c["causal"],
                                 window=c["window"], softcap=c["softcap"], variant=tile.name,
                                 kv_start=kv_start, sinks=sinks)
    _check(c, out, q, k, v, kv_start, sinks, dtype)


@gpu
@pytest.mark.parametrize("variant", (ac.FA_WGMMA, ac.FA_MMA))
def test_gpu_fa_through_the_op_and_the_kind(variant):
    c = dict(dqk=128, dv=128, Lq=2048, Lk=2048, heads=(32, 8), B=1, layout="mlx_lm",
             dtype="bfloat16", causal=True, window=None, softcap=None, padded=False,
             sinks=False, tile=variant)
    dtype, q, k, v, _, _ = _inputs(c, 7)
    args = dict(q=q, k=k, v=v, scale=128 ** -0.5, mask="causal")
    names = ATTENTION.listing("cuda", dtype, args)
    if variant not in names:
        pytest.skip(f"{variant} not offered on this GPU ({names})")
    out = run_flash_attention(q, k, v, scale=args["scale"], mask="causal", backend="cuda",
                              variant=variant)
    q, k, v = q[:, :, -64:], k, v  # the last 64 rows against float64 (Lk = 2048)
    _check(dict(c, Lq=64), out[:, :, -64:], q, k, v, None, None, dtype)
