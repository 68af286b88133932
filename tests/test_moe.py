"""The MoE MLP brick (``mlx_bricks.bricks.moe``) against float64 numpy and stock mlx-lm
``SwitchGLU``, on every backend.

* Ragged cases (experts with no rows, one expert taking every token, top-k 1 and 8, 1 / 63 / 64 /
  1,000 tokens, K and N not multiples of the tiles, all three dtypes) and mixed weight formats
  across gate / up / down run on every backend in the default suite.
* The sweep (tokens x top-k x dtype x weight formats x activation x biases) runs on ``reference``
  and ``emulator`` as a fixed hash-chosen sample (tests.support.sampled); the rest is ``slow``.
* Stock ``SwitchGLU`` / ``QuantizedSwitchLinear`` modules of mlx-lm with the same weights: the
  reference backend equals them bit for bit, the kernels pass the dtype-scaled rule with stock
  as the same-dtype computation.
* The route kernel against numpy, out-of-range indices (an error, or NaN rows with the check
  off), the argument errors, the tile rule.
* CUDA twins: compiled for sm_90a / sm_80 with ptxas (no spills), and run on the CPU through
  ``tests/cuda_emu``'s generic runner where it has one (``emulated_launches``); the ``cuda``
  backend runs everything above on a GPU.

The float64 reference decodes quantized weights from their packed bits (tests/quant_support).
"""
from __future__ import annotations

import functools
import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks.moe import cuda as moe_cuda
from mlx_bricks.bricks.moe import msl as moe_msl
from mlx_bricks.bricks.moe import op as moe_op
from mlx_bricks.bricks.moe.op import moe_mlp, moe_mlp_combine, moe_mlp_reference
from mlx_bricks.formats.affine import QuantizedWeight
from tests import quant_support
from tests.support import require_backend, sampled
from tests.tolerance import assert_dtype_close, to_f64

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
ACTIVATIONS = tuple(moe_op.ACTIVATIONS)

# Weight formats of (gate, up, down) and the expert shape (E, N, D) each is tested at: float
# experts get ragged N and D (no tile divides them, D odd for the 128-bit loads); an affine K
# must be a multiple of its group size.
FORMATS = {
    "float": ((None, None, None), (16, 40, 100)),
    "q4": (((4, 64), (4, 64), (4, 64)), (8, 192, 128)),
    # gate and up in different formats (the MSL stacked loader, the CUDA split pair), down float
    "mixed": (((4, 64), (8, 32), None), (8, 72, 128)),
    # a float gate beside an affine up (stacked float + affine loaders; the CUDA split pair)
    "float_q": ((None, (4, 32), (8, 32)), (8, 64, 96)),
    "q3q6": (((3, 32), (3, 32), (6, 64)), (8, 64, 96)),
    "q2q5": (((2, 128), (2, 128), (5, 32)), (8, 96, 128)),
    # the register-dequantizing (ws) tiles' widths: ragged N past the 64-column act tile and D
    # past the 128-column down tile
    "q8q4": (((8, 64), (8, 64), (4, 32)), (8, 160, 192)),
}


def _randn(shape, dtype, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def _experts(E, N, K, fmt, dtype, seed):
    """A stacked (E, N, K) expert weight: float, or ``mx.quantize``d along K (fmt = (bits,
    group_size)), scale 1 / sqrt(K)."""
    w = _randn((E, N, K), dtype, seed, 1.0 / math.sqrt(K))
    if fmt is None:
        return w
    q, s, b = mx.quantize(w, group_size=fmt[1], bits=fmt[0])
    return QuantizedWeight(q, s, b, fmt[1], fmt[0])


def _experts64(w) -> np.ndarray:
    """float64 (E, N, K) of a stacked weight; affine values decoded from the packed bits."""
    if not isinstance(w, QuantizedWeight):
        return to_f64(w)
    return np.stack([quant_support.dequant64(QuantizedWeight(w.w[e], w.scales[e], w.biases[e],
                                                             w.group_size, w.bits))
                     for e in range(w.w.shape[0])])


def _indices(T, k, E, kind, seed):
    """(T, k) int32 expert choices, distinct per token: ``random`` over all experts, ``half``
    from the even experts only (the odd ones get no rows), ``one``: expert E - 1 is in every
    token's slot 0 (it takes every token)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(0, E, 2) if kind == "half" else np.arange(E)
    out = np.stack([rng.permutation(pool)[:k] for _ in range(T)]) if T else \
        np.zeros((0, k), np.int64)
    if kind == "one" and T:
        for row in out:
            j = np.nonzero(row == E - 1)[0]
            row[j if len(j) else 0] = row[0]
            row[0] = E - 1
    return mx.array(out.astype(np.int32))


#: Test activations: name -> (the op's activation, its parameters). "situ_lb": Kimi K3's SiTU
#: with a beta and a linear_beta (the up squashed too).
ACTS = {"silu": ("silu", {}), "gelu_tanh": ("gelu_tanh", {}), "swiglu_oai": ("swiglu_oai", {}),
        "situ": ("situ", {}), "situ_lb": ("situ", {"beta": 0.8, "linear_beta": 2.0}),
        "relu2": ("relu2", {})}  # gate-less experts (SwitchMLP): w_gate None


def _act_kw(name) -> dict:
    """The op's keyword arguments of test activation ``name`` (:data:`ACTS`)."""
    activation, params = ACTS[name]
    return dict(activation=activation, **params)


def _act64(name, g, u, alpha=moe_op.SWIGLU_OAI_ALPHA, limit=moe_op.SWIGLU_OAI_LIMIT):
    def sigmoid(z):
        e = np.exp(-np.abs(z))
        return np.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))

    activation, params = ACTS[name]
    if activation == "relu2":
        return np.maximum(u, 0.0) ** 2
    if activation == "situ":  # mlx_lm.models.kimi_k3._situ
        beta = params.get("beta", 1.0)
        lb = params.get("linear_beta")
        return beta * np.tanh(g / beta) * sigmoid(g) * (u if lb is None else lb * np.tanh(u / lb))
    if activation == "silu":
        return g * sigmoid(g) * u
    if activation == "gelu_tanh":
        return 0.5 * g * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g ** 3))) * u
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1.0) * g * sigmoid(alpha * g)


def _moe64(x, indices, ws, biases, activation) -> np.ndarray:
    """float64 (..., k, D): every (token, slot) row through its expert, no rounding."""
    x64 = to_f64(x).reshape(-1, x.shape[-1])
    idx = np.array(indices).reshape(x64.shape[0], -1)
    wg, wu, wd = (None if w is None else _experts64(w) for w in ws)
    bg, bu, bd = (None if b is None else to_f64(b) for b in biases)
    out = np.zeros((*idx.shape, wd.shape[1]))
    for e in np.unique(idx):
        t, s = np.nonzero(idx == e)
        g, u = (None if wg is None else x64[t] @ wg[e].T), x64[t] @ wu[e].T
        if bg is not None:
            g = g + bg[e]
        if bu is not None:
            u = u + bu[e]
        y = _act64(activation, g, u) @ wd[e].T
        out[t, s] = y + (bd[e] if bd is not None else 0.0)
    return out.reshape(*indices.shape, wd.shape[1])


def _gated(activation, x, idx, ws, biases):
    """The operands of test activation ``activation``: a gate-less one (``moe_op.GATELESS``)
    drops w_gate and b_gate."""
    if ACTS[activation][0] in moe_op.GATELESS:
        ws, biases = (None, *ws[1:]), (None, *biases[1:])
    return x, idx, ws, biases


@functools.lru_cache(maxsize=8)
def _operands(T, k, fmt_name, dtype, bias, kind="random", seed=0):
    fmts, (E, N, D) = FORMATS[fmt_name]
    dt = DTYPES[dtype]
    s = seed + 31 * T + 7 * k
    x = _randn((T, D), dt, s)
    ws = tuple(_experts(E, *shape, fmt, dt, s + 1 + i)
               for i, (fmt, shape) in enumerate(zip(fmts, ((N, D), (N, D), (D, N)))))
    biases = tuple(_randn(shape, dt, s + 5 + i, 0.5) if bias else None
                   for i, shape in enumerate(((E, N), (E, N), (E, D))))
    idx = _indices(T, k, E, kind, s + 9)
    return x, idx, ws, biases


def run_case(backend, T, k, fmt_name, dtype, activation="silu", bias=False, kind="random",
             tile=None, combine=False):
    """One case against float64 under the dtype-scaled rule; the same-dtype computation is
    stock's (``moe_mlp_reference``: SwitchGLU in MLX ops)."""
    x, idx, ws, biases = _gated(activation, *_operands(T, k, fmt_name, dtype, bias, kind))
    dt = DTYPES[dtype]
    kw = dict(b_gate=biases[0], b_up=biases[1], b_down=biases[2], **_act_kw(activation))
    what = (f"{backend} T={T} k={k} {fmt_name} {dtype} {activation} bias={bias} {kind} "
            f"tile={tile} combine={combine}")
    ref64 = _moe64(x, idx, ws, biases, activation)
    if combine:
        scores = mx.softmax(_randn(idx.shape, mx.float32, T + 3), axis=-1).astype(dt)
        out = moe_mlp_combine(x, idx, scores, *ws, tile=tile, backend=backend, **kw)
        ref64 = (ref64 * to_f64(scores)[..., None]).sum(axis=-2)
        shape = x.shape
    else:
        out = moe_mlp(x, idx, *ws, tile=tile, backend=backend, **kw)
        shape = (*x.shape[:-1], k, x.shape[-1])
    if backend == "reference":  # the op is the same-dtype computation itself
        naive = out
    else:
        naive = moe_mlp_reference(x, idx, *ws, **kw)
        if combine:
            naive = moe_op.combine_reference(naive, scores, dt)
    assert out.dtype == dt and tuple(out.shape) == tuple(shape), what
    assert_dtype_close(out, ref64, naive, dtype=dt, what=what)


# ---- ragged cases, every backend -------------------------------------------------------------

RAGGED = [
    # (tokens, k, formats, dtype, activation, bias, kind): what it covers
    (1, 1, "float", "float32", "silu", False, "random"),       # one row, one tile
    (1, 8, "q4", "bfloat16", "silu", False, "random"),         # top-8: one token on 8 experts
    (63, 2, "float", "float16", "gelu_tanh", True, "half"),    # empty experts, unsorted stock
    (64, 1, "float", "bfloat16", "silu", False, "one"),        # one expert takes every token
    (64, 8, "mixed", "float16", "silu", True, "one"),          # expert 7 in every token, mixed
    (1000, 8, "float", "float32", "swiglu_oai", True, "random"),  # gpt-oss activation, biases
    (1000, 1, "q3q6", "float16", "silu", False, "one"),        # 1000 rows in one expert
    (200, 2, "q2q5", "bfloat16", "gelu_tanh", True, "half"),
    (63, 8, "float_q", "float32", "swiglu_oai", True, "one"),
    (1000, 2, "float", "bfloat16", "silu", False, "half"),     # bm64 tiles, empty experts
    (100, 4, "q4", "bfloat16", "situ_lb", False, "random"),    # Kimi K3's SiTU, linear_beta
    (40, 2, "float", "float16", "situ", True, "half"),         # SiTU, beta 1, biases
    (100, 4, "q4", "bfloat16", "relu2", True, "random"),       # gate-less (SwitchMLP), ReLU^2
    (63, 2, "mixed", "float32", "relu2", False, "half"),       # gate-less, empty experts
]


@pytest.mark.parametrize("T,k,fmt,dtype,act,bias,kind", RAGGED,
                         ids=["-".join(map(str, c)) for c in RAGGED])
def test_ragged(kernel_backend, T, k, fmt, dtype, act, bias, kind):
    run_case(kernel_backend, T, k, fmt, dtype, act, bias, kind)


@pytest.mark.parametrize("T,k,fmt,dtype", [(63, 2, "float", "float16"), (200, 8, "q4", "float32"),
                                           (1, 1, "mixed", "bfloat16")])
def test_combine(kernel_backend, T, k, fmt, dtype):
    run_case(kernel_backend, T, k, fmt, dtype, bias=True, combine=True)


def _dtype_for(backend: str) -> str:
    """float32, or bfloat16 on cuda (its twins take 16-bit activations only)."""
    return "bfloat16" if backend == "cuda" else "float32"


def test_empty_input(kernel_backend):
    x, idx, ws, _ = _operands(1, 2, "float", _dtype_for(kernel_backend), False)
    out = moe_mlp(x[:0], idx[:0], *ws, backend=kernel_backend)
    assert out.shape == (0, 2, x.shape[-1])
    out = moe_mlp_combine(x[:0], idx[:0], mx.zeros((0, 2)), *ws, backend=kernel_backend)
    assert out.shape == (0, x.shape[-1])


def test_tiny_operands_in_the_constant_address_space(kernel_backend):
    """Inputs of fewer than 8 elements reach MSL kernels as constant pointers (x, biases, order,
    act, act_params here); K = 4 is below one K step."""
    E, N, D = 2, 3, 4
    dt = DTYPES[_dtype_for(kernel_backend)]
    x = _randn((1, D), dt, 1)
    ws = (_randn((E, N, D), dt, 2), _randn((E, N, D), dt, 3), _randn((E, D, N), dt, 4))
    biases = (_randn((E, N), dt, 5), _randn((E, N), dt, 6), _randn((E, D), dt, 7))
    idx = mx.array([[1, 0]], dtype=mx.int32)
    kw = dict(b_gate=biases[0], b_up=biases[1], b_down=biases[2], activation="swiglu_oai")
    out = moe_mlp(x, idx, *ws, backend=kernel_backend, **kw)
    assert_dtype_close(out, _moe64(x, idx, ws, biases, "swiglu_oai"),
                       moe_mlp_reference(x, idx, *ws, **kw), dtype=dt, what="tiny")


def test_leading_dims_and_views(kernel_backend):
    """x (B, L, D) as SwitchGLU gets it, and a strided view of x (copied to rows)."""
    x, idx, ws, _ = _operands(70, 2, "float", _dtype_for(kernel_backend), False)
    x3 = x.reshape(2, 35, -1)
    out = moe_mlp(x3, idx.reshape(2, 35, 2), *ws, backend=kernel_backend)
    flat = moe_mlp(x, idx, *ws, backend=kernel_backend)
    assert out.shape == (2, 35, 2, x.shape[-1])
    assert mx.array_equal(out.reshape(flat.shape), flat)
    wide = mx.concatenate([x, x], axis=-1)[:, 1::2]  # strided, then rows gathered
    view = moe_mlp(wide, idx, *ws, backend=kernel_backend)
    assert mx.array_equal(view, moe_mlp(mx.contiguous(wide), idx, *ws, backend=kernel_backend))


# ---- tiles ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tile", sorted(moe_cuda.TILES))
def test_cuda_tiles(tile):
    """Every CUDA tile forced (the wgmma ones run on sm_90 only; not emulated)."""
    require_backend("cuda")
    if tile not in moe_cuda.tile_names(bits=(4, 4, 4)):
        pytest.skip(f"this GPU does not run tile {tile}")
    if moe_cuda.TILES[tile].ws:  # 4 / 8-bit affine, gate and up of one format
        run_case("cuda", 300, 8, "q4", "float16", "swiglu_oai", True, "one", tile=tile)
        run_case("cuda", 70, 4, "q8q4", "bfloat16", "gelu_tanh", True, "random", tile=tile)
        run_case("cuda", 90, 4, "q4", "bfloat16", "situ_lb", False, "random", tile=tile)
        return
    run_case("cuda", 100, 2, "float", "bfloat16", "silu", True, "half", tile=tile)
    run_case("cuda", 300, 8, "q4", "float16", "swiglu_oai", True, "one", tile=tile)
    run_case("cuda", 90, 4, "q4", "bfloat16", "situ_lb", False, "random", tile=tile)
    run_case("cuda", 90, 4, "q4", "float16", "relu2", True, "random", tile=tile)
    run_case("cuda", 70, 4, "mixed", "bfloat16", "gelu_tanh", False, "random", tile=tile)


@pytest.mark.parametrize("tile", sorted(moe_msl.TILES))
def test_msl_tiles(msl_backend, tile):
    run_case(msl_backend, 100, 2, "float", "float16", "silu", True, "half", tile=tile)
    run_case(msl_backend, 33, 1, "q4", "float32", "gelu_tanh", False, "one", tile=tile)
    run_case(msl_backend, 50, 2, "float_q", "bfloat16", "swiglu_oai", True, "random", tile=tile)
    run_case(msl_backend, 40, 4, "q4", "float16", "situ_lb", False, "half", tile=tile)
    run_case(msl_backend, 70, 2, "q4", "bfloat16", "relu2", True, "random", tile=tile)


def test_tile_rules():
    assert moe_msl.select_tile(4096, 128) == "bm32"   # 32 rows per expert
    assert moe_msl.select_tile(16384, 128) == "bm64"
    assert moe_msl.select_tile(8, 128) == "bm32"      # fewer rows than experts
    cc = (9, 0)
    assert moe_cuda.select_tile(4096, 128, cc) == "bm32"
    assert moe_cuda.select_tile(16384, 128, cc) == "wg128"
    assert moe_cuda.select_tile(8192, 128, cc) == "wg64"
    assert moe_cuda.select_tile(8192, 128, (8, 0)) == "bm64"
    assert not any(moe_cuda.TILES[n].wgmma for n in moe_cuda.tile_names((8, 0)))
    # 8-bit gate and up fused would spill on bm64; split (two widths) they do not
    assert "bm64" not in moe_cuda.tile_names(cc, (8, 8, 0))
    assert "bm64" in moe_cuda.tile_names(cc, (8, 4, 8))


@pytest.mark.parametrize("R,E,bm", [(1, 1, 32), (7, 128, 64), (64, 8, 64), (8000, 8, 64),
                                    (65, 1, 32), (4096, 128, 32)])
def test_tiles_max_bounds_every_routing(R, E, bm):
    """The grid's row tiles bound the real count for the worst routings: one row per expert,
    all rows in one expert, and the out-of-range tail."""
    bound = moe_msl.tiles_max(R, E, bm)
    rng = np.random.default_rng(R + E)
    for counts in (np.bincount(np.arange(R) % (E + 1), minlength=E + 1),
                   np.bincount(np.zeros(R, int), minlength=E + 1),
                   np.bincount(rng.integers(0, E + 1, R), minlength=E + 1)):
        assert int(np.sum(-(-counts // bm))) <= bound


# ---- the route kernel -----------------------------------------------------------------------


def _route64(idx: np.ndarray, E: int, bm: int) -> np.ndarray:
    """The route array of moe.h in numpy: offsets (E + 2), tile experts, tile first rows."""
    R = idx.size
    sorted_e = np.minimum(np.sort(idx.astype(np.uint32)), E)
    offs = np.searchsorted(sorted_e, np.arange(E + 2), side="left")
    offs[E + 1] = R
    tiles = moe_msl.tiles_max(R, E, bm)
    te, tm = np.full(tiles, -1), np.zeros(tiles, int)
    t = 0
    for e in range(E + 1):
        for m0 in range(offs[e], offs[e + 1], bm):
            te[t], tm[t] = e, m0
            t += 1
    return np.concatenate([offs, te, tm]).astype(np.int32)


ROUTE_CASES = [(1, 1, 32, "random"), (9, 4, 32, "random"), (300, 16, 64, "skewed"),
               (2000, 8, 32, "oob"), (1025, 600, 64, "random"), (64, 128, 32, "oob")]


@pytest.mark.parametrize("R,E,bm,kind", ROUTE_CASES)
def test_route_kernel(kernel_backend, R, E, bm, kind):
    if kernel_backend == "reference":
        pytest.skip("the route is a kernel (reference runs SwitchGLU's own sort)")
    idx = _route_indices(R, E, kind)
    idx_u, order = moe_op.sort_rows(mx.array(idx))
    if kernel_backend == "cuda":
        got = moe_cuda.route(idx_u, order, E, bm)
    else:
        got = moe_msl.route(idx_u, order, E, bm, kernel_backend, moe_msl.route_threads(R, E))
    assert np.array_equal(np.array(got), _route64(idx, E, bm)), (R, E, bm, kind)


def _route_indices(R, E, kind):
    rng = np.random.default_rng(R * 7 + E)
    if kind == "skewed":  # most rows in a few experts, some experts empty
        return (rng.zipf(1.5, R) % E).astype(np.int32)
    idx = rng.integers(0, E, R).astype(np.int32)
    if kind == "oob":  # out-of-range values on both sides form the tail
        idx[rng.integers(0, R, max(1, R // 10))] = E + 3
        idx[0] = -1
    return idx


# ---- out-of-range indices -------------------------------------------------------------------


def test_out_of_range_indices_raise(kernel_backend):
    x, idx, ws, _ = _operands(9, 2, "float", _dtype_for(kernel_backend), False)
    E = ws[0].shape[0]
    for bad in (E, -1):
        with pytest.raises(ValueError, match=r"indices must be expert numbers in \[0, E=16\)"):
            moe_mlp(x, mx.where(mx.arange(18).reshape(9, 2) == 5, bad, idx), *ws,
                    backend=kernel_backend)


def test_out_of_range_rows_are_nan_without_the_check(kernel_backend):
    """check_indices=False evaluates nothing; the kernels never read out of bounds (the emulator
    checks) and give NaN exactly in the rows of the bad indices."""
    if kernel_backend == "reference":
        pytest.skip("stock gather_mm with out-of-range indices is undefined")
    x, idx, ws, _ = _operands(100, 2, "q4", "float16", False)
    bad = np.array(idx)
    bad[3, 1], bad[50, 0], bad[99, 1] = 8, -1, 1000
    out = np.array(moe_mlp(x, mx.array(bad), *ws, check_indices=False,
                           backend=kernel_backend).astype(mx.float32))
    nan_rows = np.isnan(out).any(axis=-1)
    assert np.array_equal(np.argwhere(nan_rows), [[3, 1], [50, 0], [99, 1]])
    assert np.isnan(out[nan_rows]).all()
    good = np.array(moe_mlp(x, idx, *ws, backend=kernel_backend).astype(mx.float32))
    ok = ~nan_rows
    # the other rows as with good indices: equal but for what Metal may vary between launches
    # (the emulator's perturbed mode: fast:: errors), a few float16 ulps
    np.testing.assert_allclose(out[ok], good[ok], rtol=0,
                               atol=4 * 2.0**-10 * max(1.0, np.abs(good[ok]).max()))


# ---- against stock mlx-lm modules -----------------------------------------------------------


def _stock_module(D, N, E, fmts, dtype, activation, bias, seed):
    """mlx-lm's SwitchGLU with random weights, each projection quantized (to_quantized) in its
    own format; for gelu_tanh gemma4's GeGLU, for swiglu_oai gpt-oss's SwigluOAI, for situ /
    situ_lb kimi_k3's SiTU."""
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.gemma4_text import GeGLU
    from mlx_lm.models.kimi_k3 import SiTU
    from mlx_lm.models.switch_layers import SwitchGLU, SwiGLU

    params = ACTS[activation][1]
    act = {"silu": SwiGLU(), "gelu_tanh": GeGLU(), "swiglu_oai": SwigluOAI(),
           "situ": SiTU(), "situ_lb": SiTU(params.get("beta", 1.0), params.get("linear_beta"))
           }[activation]
    glu = SwitchGLU(D, N, E, activation=act, bias=bias)
    for i, (name, fmt) in enumerate(zip(("gate_proj", "up_proj", "down_proj"), fmts)):
        lin = getattr(glu, name)
        lin.weight = _randn(lin.weight.shape, dtype, seed + i, lin.weight.shape[-1] ** -0.5)
        if bias:
            lin.bias = _randn(lin.bias.shape, dtype, seed + 10 + i, 0.5)
        if fmt is not None:
            setattr(glu, name, lin.to_quantized(group_size=fmt[1], bits=fmt[0]))
    return glu


STOCK_CASES = [
    # (tokens, k, formats, dtype, activation, bias): the model it stands for
    (70, 8, "q4", "bfloat16", "silu", False),        # qwen3_moe / olmoe, 4-bit
    (40, 2, "float", "float32", "silu", False),      # mixtral, unsorted stock (40 * 2 < 64)
    (100, 4, "q4", "float16", "swiglu_oai", True),   # gpt-oss: clamped SwiGLU, expert biases
    (33, 6, "mixed", "float32", "silu", False),      # deepseek with a mixed-bits recipe
    (50, 2, "float", "bfloat16", "gelu_tanh", False),  # gemma4's GeGLU experts
    (60, 4, "q4", "bfloat16", "situ_lb", False),     # kimi_k3's SiTU experts
]


@pytest.mark.parametrize("fmt,dtype", [("q4", "bfloat16"), ("float", "float32")])
def test_matches_stock_switch_mlp(kernel_backend, fmt, dtype):
    """A gate-less SwitchMLP (nemotron_h's experts: fc1, ReLU^2, fc2) against mlx-lm's own
    module and float64: w_gate None, activation "relu2"."""
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import SwitchMLP

    fmts, (E, N, D) = FORMATS[fmt]
    dt = DTYPES[dtype]
    mlp = SwitchMLP(D, N, E, activation=nn.ReLU2())
    for i, name in enumerate(("fc1", "fc2")):
        lin = getattr(mlp, name)
        lin.weight = _randn(lin.weight.shape, dt, 40 + i, lin.weight.shape[-1] ** -0.5)
        if fmts[0] is not None:
            setattr(mlp, name, lin.to_quantized(group_size=fmts[0][1], bits=fmts[0][0]))
    x = _randn((2, 35, D), dt, 41)
    idx = _indices(70, 4, E, "random", 42).reshape(2, 35, 4)
    if mx.default_device() == mx.cpu and fmts[0] is None and dt != mx.float32:
        pytest.skip("stock SwitchLinear's gather_mm takes float32 only on the CPU (MLX 0.32)")
    stock = mlp(x, idx)
    out = moe_mlp(x, idx, None, mlp.fc1, mlp.fc2, activation="relu2", backend=kernel_backend)
    if kernel_backend == "reference":  # the reference is SwitchMLP itself
        assert mx.array_equal(out, stock)
    ws = (None, moe_op.as_expert_weight(mlp.fc1), moe_op.as_expert_weight(mlp.fc2))
    assert_dtype_close(out, _moe64(x, idx, ws, (None, None, None), "relu2"), stock, dtype=dt,
                       what=f"{kernel_backend} vs stock SwitchMLP {fmt} {dtype}")


@pytest.mark.parametrize("T,k,fmt,dtype,act,bias", STOCK_CASES,
                         ids=["-".join(map(str, c)) for c in STOCK_CASES])
def test_matches_stock_switch_glu(kernel_backend, T, k, fmt, dtype, act, bias):
    fmts, (E, N, D) = FORMATS[fmt]
    dt = DTYPES[dtype]
    glu = _stock_module(D, N, E, fmts, dt, act, bias, seed=T)
    x = _randn((2, T // 2, D), dt, T + 1)
    idx = _indices(T // 2 * 2, k, E, "random", T + 2).reshape(2, T // 2, k)
    if mx.default_device() == mx.cpu and fmts.count(None) and dt != mx.float32:
        pytest.skip("stock SwitchLinear's gather_mm takes float32 only on the CPU (MLX 0.32)")
    stock = glu(x, idx)
    projs = (glu.gate_proj, glu.up_proj, glu.down_proj)
    biases = tuple(p.bias if bias else None for p in projs)
    out = moe_mlp(x, idx, *projs, b_gate=biases[0], b_up=biases[1], b_down=biases[2],
                  **_act_kw(act), backend=kernel_backend)
    if kernel_backend == "reference":  # the reference is SwitchGLU itself
        assert mx.array_equal(out, stock)
    ws = tuple(moe_op.as_expert_weight(p) for p in projs)
    assert_dtype_close(out, _moe64(x, idx, ws, biases, act), stock, dtype=dt,
                       what=f"{kernel_backend} vs stock SwitchGLU {fmt} {dtype} {act}")


# ---- the sweep ------------------------------------------------------------------------------

SWEEP_T = (1, 7, 63, 64, 200, 1000)
SWEEP_K = (1, 2, 8)
#: Emulator cases of the default suite: about one in EMULATOR_ONE_IN, reference one in
#: REFERENCE_ONE_IN (fixed hash-chosen samples); `-m slow` runs the rest.
EMULATOR_ONE_IN = 60
REFERENCE_ONE_IN = 30


def _sweep_params():
    for case in itertools.product(SWEEP_T, SWEEP_K, FORMATS, DTYPES, ACTIVATIONS,
                                  (False, True)):
        ident = "-".join(map(str, case))
        T, k, fmt = case[:3]
        # stock's gather_qmm on the CPU takes tens of seconds at 1600+ rows: slow only
        cpu_heavy = T * k >= 1600 and fmt != "float"
        for backend, one_in in (("reference", REFERENCE_ONE_IN), ("emulator", EMULATOR_ONE_IN),
                                ("metal", 1), ("cuda", 1)):
            pid = f"{backend}-{ident}"
            fast = sampled(pid, one_in) and not (cpu_heavy and backend in ("reference",
                                                                           "emulator"))
            yield pytest.param(backend, *case, id=pid, marks=[] if fast else [pytest.mark.slow])


@pytest.mark.parametrize("backend,T,k,fmt,dtype,act,bias", list(_sweep_params()))
def test_sweep(backend, T, k, fmt, dtype, act, bias):
    require_backend(backend)
    run_case(backend, T, k, fmt, dtype, act, bias)


# ---- argument errors ------------------------------------------------------------------------


def _error_cases():
    x, idx, (wg, wu, wd), _ = _operands(5, 2, "float", "float32", False)
    q = _operands(5, 2, "q4", "float32", False)[2][0]
    E, N, D = wg.shape
    half = wg.astype(mx.float16)
    yield "int x", dict(x=x.astype(mx.int32)), TypeError, "x must be float16"
    yield "float indices", dict(indices=idx.astype(mx.float32)), TypeError, \
        "indices must have an integer dtype"
    yield "indices rows", dict(indices=idx[:4]), ValueError, r"= \(5, k\), got \(4, 2\)"
    yield "top-k 0", dict(indices=idx[:, :0]), ValueError, "at least one expert"
    yield "top-k > E", dict(indices=mx.zeros((5, E + 1), mx.int32)), ValueError, \
        f"top-k = {E + 1} experts per token, more than the E = {E}"
    yield "2-D w_gate", dict(w_gate=wg[0]), ValueError, "w_gate must have 3 dimensions"
    yield "w_gate K", dict(w_gate=wg[..., :-1]), ValueError, \
        r"w_gate must have shape \(E, N, D=100\)"
    yield "w_up experts", dict(w_up=wu[:-1]), ValueError, "w_up must have w_gate's shape"
    yield "w_up N", dict(w_up=wu[:, :-1]), ValueError, "w_up must have w_gate's shape"
    yield "w_down layout", dict(w_down=wu), ValueError, r"w_down must have shape \(E, D, N\)"
    yield "w_down experts", dict(w_down=wd[:3]), ValueError, r"w_down must have shape"
    yield "w_up dtype", dict(w_up=half), TypeError, "w_up has dtype float16 but x has float32"
    yield "scales dtype", dict(w_gate=QuantizedWeight(q.w, q.scales.astype(mx.float16),
                                                      q.biases.astype(mx.float16), 64, 4)), \
        TypeError, "w_gate.scales has dtype float16"
    yield "q scales experts", dict(w_gate=QuantizedWeight(q.w, q.scales[:3], q.biases, 64, 4)), \
        ValueError, r"w_gate.scales must have shape \(E=8"
    yield "q bits", dict(w_gate=QuantizedWeight(q.w, q.scales, q.biases, 64, 7)), ValueError, \
        "w_gate.bits must be one of"
    yield "q mode", dict(w_gate=QuantizedWeight(q.w, q.scales, q.biases, 64, 4, "mxfp4")), \
        ValueError, "w_gate.mode must be 'affine'"
    yield "q 2-D", dict(w_gate=QuantizedWeight(q.w[0], q.scales[0], q.biases[0], 64, 4)), \
        ValueError, "w_gate.w must have 3 dimensions"
    yield "weight type", dict(w_down=np.zeros((E, D, N))), TypeError, "w_down must be an mx.array"
    yield "b_gate shape", dict(b_gate=mx.zeros((E, N + 1))), ValueError, \
        rf"b_gate must have shape \({E}, {N}\)"
    yield "b_down dtype", dict(b_down=mx.zeros((E, D), mx.float16)), TypeError, \
        "b_down has dtype float16"
    yield "activation", dict(activation="relu"), ValueError, "activation must be one of"
    yield "activation type", dict(activation=0), TypeError, "activation must be a str"
    yield "alpha with silu", dict(alpha=1.0), ValueError, "alpha applies to activation"
    yield "limit", dict(activation="swiglu_oai", limit=0.0), ValueError, "limit must be > 0"
    yield "no gate with silu", dict(w_gate=None), ValueError, "w_gate must be None exactly"
    yield "a gate with relu2", dict(activation="relu2"), ValueError, \
        "w_gate must be None exactly"
    yield "beta with swiglu_oai", dict(activation="swiglu_oai", beta=1.0), ValueError, \
        "beta applies to activation 'situ' only"
    yield "linear_beta", dict(activation="situ", linear_beta=0.0), ValueError, \
        "linear_beta must be > 0"
    yield "beta type", dict(activation="situ", beta=float("nan")), TypeError, \
        "beta must be a finite float"
    yield "tile", dict(tile="bm7"), ValueError, "tile must be None or"
    yield "check_indices", dict(check_indices=1), TypeError, "check_indices must be a bool"


ERROR_CASES = list(_error_cases())


@pytest.mark.parametrize("what,override,exc,match", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_argument_errors(what, override, exc, match):
    x, idx, (wg, wu, wd), _ = _operands(5, 2, "float", "float32", False)
    args = dict(x=x, indices=idx, w_gate=wg, w_up=wu, w_down=wd, backend="emulator"
                if "tile" in override else "reference")
    args.update(override)
    if "tile" in override:
        require_backend("emulator")
    with pytest.raises(exc, match=match):
        moe_mlp(**args)


def test_scores_errors():
    x, idx, ws, _ = _operands(5, 2, "float", "float32", False)
    with pytest.raises(ValueError, match=r"scores must have indices' shape \(5, 2\)"):
        moe_mlp_combine(x, idx, mx.zeros((5, 3)), *ws, backend="reference")
    with pytest.raises(TypeError, match="scores must be float16"):
        moe_mlp_combine(x, idx, mx.zeros((5, 2), mx.int32), *ws, backend="reference")


def test_modules_are_accepted():
    """SwitchLinear / QuantizedSwitchLinear give their weights (as_expert_weight)."""
    from mlx_lm.models.switch_layers import SwitchLinear

    lin = SwitchLinear(64, 32, 4, bias=True)
    assert moe_op.as_expert_weight(lin) is lin.weight
    qlin = lin.to_quantized(group_size=32, bits=4)
    qw = moe_op.as_expert_weight(qlin)
    assert isinstance(qw, QuantizedWeight) and moe_op.expert_shape(qw) == (4, 32, 64)


# ---- CUDA twins: compile checks and the CPU emulation ---------------------------------------


def _cuda_records(tile, fmts, act=0, bias=False, T=64, k=8, E=4, N=256, D=512):
    from mlx_bricks import cudacheck

    dt = mx.bfloat16
    ws = [mx.zeros(sh, dt) if f is None else
          QuantizedWeight(*mx.quantize(mx.zeros(sh, dt), group_size=f[1], bits=f[0]), f[1], f[0])
          for sh, f in zip(((E, N, D), (E, N, D), (E, D, N)), fmts)]
    biases = tuple(mx.zeros(sh, dt) if bias else None for sh in ((E, N), (E, N), (E, D)))
    x, idx = mx.zeros((T, D), dt), mx.zeros((T * k,), mx.uint32)
    inputs = [moe_op.expert_inputs(w) for w in ws]
    if act == moe_op.ACTIVATIONS["relu2"]:  # gate-less experts: no gate operand
        inputs[0], biases = None, (None, *biases[1:])
    with cudacheck.recorded_launches(moe_cuda) as rec:
        y = moe_cuda.moe_rows(x, idx, idx, *inputs, biases, E, act, (1.702, 7.0), tile=tile)
    assert y.shape == (T * k, D)
    return rec


#: Compile-only weight formats (no sweep): 8-bit everywhere, the register maximum.
CUDA_COMPILE_FORMATS = {**{f: fmts for f, (fmts, _) in FORMATS.items()},
                        "q8": ((8, 32), (8, 32), (8, 64))}
CUDA_COMPILE_CASES = [
    # (tile, formats, act, bias, arch): the register maximum, a refusal, the split pair, sm_80
    ("wg64", "q8", 0, False, "sm_90a"),
    ("bm64", "q8", 0, False, "sm_90a"),       # refused: fused 8-bit gate/up would spill
    ("bm64", "mixed", 2, True, "sm_90a"),      # split pair (MODE 1, 2), gpt-oss activation
    ("bm32", "q3q6", 1, False, "sm_80"),
    ("qwg256", "q8", 2, True, "sm_90a"),      # weights dequantized in registers (qmoe_*.cu)
    ("qmma128", "q4", 0, False, "sm_80"),
    ("qmma128", "q4", 3, False, "sm_90a"),    # SiTU
    ("wg64", "q4", 4, True, "sm_90a"),        # gate-less experts (MODE 3, ReLU^2)
    ("bm32", "mixed", 4, False, "sm_80"),
]
CUDA_COMPILE_SLOW = [(t, f, a, b, arch) for t in moe_cuda.TILES for f in CUDA_COMPILE_FORMATS
                     for a, b in ((0, False), (2, True)) for arch in ("sm_90a", "sm_80")
                     if not (arch == "sm_80" and moe_cuda.TILES[t].wgmma)
                     and (t, f, a, b, arch) not in CUDA_COMPILE_CASES]


@pytest.mark.parametrize("tile,fmt,act,bias,arch", CUDA_COMPILE_CASES + [
    pytest.param(*c, marks=pytest.mark.slow) for c in CUDA_COMPILE_SLOW])
def test_cuda_twins_compile(monkeypatch, tile, fmt, act, bias, arch):
    from mlx_bricks import cudacheck
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda

    if cudacheck.find_nvcc() is None:
        pytest.skip("nvcc not found")
    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (int(arch[3]), 0))
    fmts = CUDA_COMPILE_FORMATS[fmt]
    bits = tuple(f[0] if f else 0 for f in fmts)
    if tile not in moe_cuda.tile_names(bits=bits):
        with pytest.raises(ValueError, match="tile must be None or, on this GPU"):
            _cuda_records(tile, fmts, act, bias)
        return
    rec = _cuda_records(tile, fmts, act, bias)
    names = [r.name for r in rec]
    split = fmts[0] != fmts[1] and act != moe_op.ACTIVATIONS["relu2"]
    if act == moe_op.ACTIVATIONS["relu2"]:
        assert names == ["moe_route", "moe_gate_up", "moe_down"]
        assert dict(rec[1].template)["MODE"] == 3
    elif moe_cuda.TILES[tile].ws:
        assert names == ["moe_route", "qmoe_gate_up", "qmoe_down"]
    else:
        assert names == ["moe_route"] + ["moe_gate_up"] * (1 + split) + ["moe_down"]
    if split:
        assert [dict(r.template)["MODE"] for r in rec[1:3]] == [1, 2]
    for r in rec:
        res = r.compile(arch)
        assert res.stack == 0 and res.spill_stores == 0 and res.spill_loads == 0, (r.name, res)
        assert res.registers * r.threadgroup[0] <= 65536, (r.name, res)
        assert r.shared_memory <= gemm_cuda.max_shared_memory((int(arch[3]), 0))


def test_cuda_combine_compiles():
    from mlx_bricks import cudacheck

    if cudacheck.find_nvcc() is None:
        pytest.skip("nvcc not found")
    with cudacheck.recorded_launches(moe_cuda) as rec:
        moe_cuda.combine(mx.zeros((16, 72), mx.bfloat16), mx.zeros((8, 2), mx.float32))
    res = rec[0].compile("sm_90a")
    assert res.spill_stores == 0 and res.stack == 0


def _cuda_emu():
    """tests/cuda_emu's generic runner (``emulated_launches``), or a skip while it has none."""
    from tests import cuda_emu

    if cuda_emu.toolchain() is None:
        pytest.skip("no host compiler / CUDA headers for the CUDA emulation")
    if not hasattr(cuda_emu, "emulated_launches"):
        pytest.skip("tests/cuda_emu has no generic runner yet (emulated_launches: the GEMM "
                    "mma.sync path is being added on another branch); the cuda backend runs "
                    "these on a GPU")
    return cuda_emu


CUDA_EMU_CASES = [
    # (tile, tokens, k, formats, dtype, activation, bias, kind); mma.sync tiles only (wgmma is
    # not emulated), the 16-bit dtypes of the twins
    ("bm32", 9, 2, "float", "bfloat16", "silu", False, "random"),
    ("bm64", 70, 2, "q4", "float16", "swiglu_oai", True, "half"),
    ("bm64", 20, 8, "mixed", "bfloat16", "silu", True, "one"),
    ("bm32", 64, 1, "q3q6", "float16", "gelu_tanh", False, "one"),
    ("bm32", 40, 4, "float_q", "float16", "swiglu_oai", True, "random"),  # split: float gate
    # weights dequantized in registers (qmoe_*.cu): gathered rows in, scattered rows out
    ("qmma128", 70, 2, "q4", "float16", "swiglu_oai", True, "half"),
    ("qmma128", 40, 8, "q8q4", "bfloat16", "silu", False, "random"),
    ("bm32", 30, 2, "q4", "bfloat16", "situ_lb", False, "random"),  # Kimi K3's SiTU
    ("qmma128", 30, 4, "q4", "float16", "situ", False, "half"),
    ("bm32", 30, 2, "q4", "bfloat16", "relu2", True, "random"),  # gate-less: MODE 3
    ("bm64", 40, 4, "float", "float16", "relu2", False, "half"),
]


@pytest.mark.parametrize("tile,T,k,fmt,dtype,act,bias,kind", CUDA_EMU_CASES)
def test_cuda_twins_in_the_cpu_emulation(monkeypatch, tile, T, k, fmt, dtype, act, bias, kind):
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda

    emu = _cuda_emu()
    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (8, 0))
    x, idx, ws, biases = _gated(act, *_operands(T, k, fmt, dtype, bias, kind))
    a = moe_op.check_moe_args(x, idx, *ws, *biases, **_act_kw(act))
    idx_u, order = moe_op.sort_rows(idx)
    with emu.emulated_launches(moe_cuda) as names:
        y = moe_cuda.moe_rows(x, idx_u, order, *(None if w is None else moe_op.expert_inputs(w)
                                                 for w in ws), biases,
                              a["E"], a["act"], a["act_params"], tile=tile)
        route = moe_cuda.route(idx_u, order, a["E"], moe_cuda.TILES[tile].bm)
        mx.eval(y, route)
    assert names[0] == "moe_route"
    if moe_cuda.TILES[tile].ws:
        assert names[1:3] == ["qmoe_gate_up", "qmoe_down"]
    assert np.array_equal(np.array(route), _route64(np.array(idx).reshape(-1), a["E"],
                                                    moe_cuda.TILES[tile].bm))
    dt = DTYPES[dtype]
    kw = dict(b_gate=biases[0], b_up=biases[1], b_down=biases[2], **_act_kw(act))
    out = y.reshape(T, k, -1)
    assert_dtype_close(out, _moe64(x, idx, ws, biases, act),
                       moe_mlp_reference(x, idx, *ws, **kw), dtype=dt,
                       what=f"cuda emu {tile} {fmt} {dtype} {act}")


@pytest.mark.parametrize("R,E,bm,kind", ROUTE_CASES)
def test_cuda_route_in_the_cpu_emulation(R, E, bm, kind):
    emu = _cuda_emu()
    idx = _route_indices(R, E, kind)
    idx_u, order = moe_op.sort_rows(mx.array(idx))
    with emu.emulated_launches(moe_cuda):
        got = moe_cuda.route(idx_u, order, E, bm)
        mx.eval(got)
    assert np.array_equal(np.array(got), _route64(idx, E, bm)), (R, E, bm, kind)


def test_cuda_out_of_range_rows_in_the_cpu_emulation(monkeypatch):
    """The twins' NaN rows for out-of-range indices (their fill path) on the CPU."""
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda

    emu = _cuda_emu()
    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (8, 0))
    x, idx, ws, biases = _operands(20, 2, "float", "bfloat16", False)
    bad = np.array(idx)
    bad[3, 1], bad[7, 0] = 16, -1
    idx_u, order = moe_op.sort_rows(mx.array(bad))
    with emu.emulated_launches(moe_cuda):
        y = moe_cuda.moe_rows(x, idx_u, order, *(moe_op.expert_inputs(w) for w in ws), biases,
                              16, 0, (0.0, 0.0), tile="bm32")
        mx.eval(y)
    nan_rows = np.isnan(np.array(y.astype(mx.float32))).any(axis=-1)
    assert np.array_equal(np.nonzero(nan_rows)[0], [7 * 2 + 0, 3 * 2 + 1][::-1])


def test_cuda_combine_in_the_cpu_emulation():
    emu = _cuda_emu()
    y = _randn((30, 72), mx.bfloat16, 1)
    scores = mx.softmax(_randn((10, 3), mx.float32, 2), axis=-1)
    with emu.emulated_launches(moe_cuda):
        out = moe_cuda.combine(y, scores)
        mx.eval(out)
    ref64 = (to_f64(y).reshape(10, 3, 72) * to_f64(scores)[..., None]).sum(axis=1)
    naive = moe_op.combine_reference(y.reshape(10, 3, 72), scores, mx.bfloat16)
    assert_dtype_close(out, ref64, naive, dtype=mx.bfloat16, what="cuda emu combine")


# ---- MSL source rules -----------------------------------------------------------------------

MOE_SOURCES = ("moe.h", "moe_route.metal", "moe_gate_up.metal", "moe_down.metal",
               "moe_combine.metal")


@pytest.mark.parametrize("filename", MOE_SOURCES)
def test_metal_source_rules(filename):
    """The pipeline rules of tests/test_metal_src_rules.py (register-array loops unrolled, no
    const method reading thread_elements) hold for the MoE sources too."""
    from tests import test_metal_src_rules as rules

    rules.test_register_array_loops_are_unrolled(filename)
    rules.test_no_const_method_reads_thread_elements(filename)


# ---- the benchmark cases --------------------------------------------------------------------


def test_bench_cases_are_registered():
    from mlx_bricks.bench import core, moe as bench_moe

    names = core.GROUPS["moe"]
    assert len(names) == len(bench_moe.SHAPES) * len(bench_moe.FORMATS) * len(bench_moe.M_SIZES)
    assert "moe_qwen3_30b_a3b_q4g64_m2048" in names and "moe_gpt_oss_20b_bf16_m512" in names
    assert all(core.BENCHMARKS[n].backend == core.KERNEL for n in names)


@pytest.mark.parametrize("fmt", [None, (4, 32)])
@pytest.mark.parametrize("act,bias", [("silu", False), ("swiglu_oai", True)])
def test_bench_case_brick_matches_stock(fmt, act, bias):
    """A benchmark case at a tiny shape on the emulator: brick and stock agree, info is filled."""
    from mlx_bricks.bench import moe as bench_moe

    require_backend("emulator")
    shape = bench_moe.MoeShape("tiny", hidden=64, intermediate=64, experts=8, top_k=2,
                               activation=act, bias=bias)
    brick, stock, info = bench_moe.build(shape, 40, fmt, dtype_name="float32",
                                         backend="emulator", timed_tiles=False)
    b, s = brick(), stock()
    assert b.shape == s.shape == (40, 2, 64)
    assert mx.abs(b - s).max().item() <= 1e-4 * max(1.0, mx.abs(s).max().item())
    facts = info()
    assert facts["flop"] == 6.0 * 40 * 2 * 64 * 64 and "stock_error" not in facts
    assert facts["tile"] in moe_msl.TILES
    assert mx.array_equal(brick("bm32_sb"), b)  # a forced tile computes the same rows
