"""Gated DeltaNet brick: the chunked gated delta rule against a float64 sequential reference.

The reference is the recurrence of mlx-lm's ``gated_delta_update`` token by token in float64
numpy; the naive same-dtype comparison is mlx-lm's own token loop (``gated_delta_ops``, which
computes in float32 from inputs of the given dtype) with the dtype-scaled rule of
tests/tolerance.py.
"""
import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks.gated_delta.op import (
    CHUNK,
    gated_delta,
    gated_delta_chunked,
    gated_delta_gates,
    gated_delta_stock,
)
from tests.tolerance import assert_dtype_close

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32


def gated_delta64(q, k, v, g, beta, state=None, mask=None):
    """The recurrence in float64 numpy: S (B, Hv, Dv, Dk); per token S *= g, S += beta (v - S
    k) k^T, y = S q; masked tokens keep S and give y = 0."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    r = Hv // Hk
    q, k = np.repeat(q, r, axis=2), np.repeat(k, r, axis=2)
    S = np.zeros((B, Hv, Dv, Dk)) if state is None else np.asarray(state, np.float64).copy()
    y = np.zeros((B, T, Hv, Dv))
    for t in range(T):
        keep = np.ones(B, bool) if mask is None else np.asarray(mask)[:, t]
        decay = g[:, t, :, None, None] if g.ndim == 3 else g[:, t, :, None, :]
        S1 = S * decay
        kv = np.einsum("bhvd,bhd->bhv", S1, k[:, t])
        delta = (v[:, t] - kv) * beta[:, t, :, None]
        S1 = S1 + delta[..., None] * k[:, t, :, None, :]
        yt = np.einsum("bhvd,bhd->bhv", S1, q[:, t])
        S = np.where(keep[:, None, None, None], S1, S)
        y[:, t] = np.where(keep[:, None, None], yt, 0.0)
    return y, S


def inputs(B=1, T=70, Hk=2, Hv=4, Dk=32, Dv=16, dtype=F32, vectorized=False, decay=(0.8, 1.0),
           beta=None, seed=0, state=True):
    """Model-like inputs: q, k L2-normalised (q scaled by Dk**-0.5, as normalize_qk), v normal,
    g uniform in ``decay``, beta sigmoid-distributed (or the constant ``beta``), a random
    float32 state."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Hk, Dk))
    k = rng.standard_normal((B, T, Hk, Dk))
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * Dk ** -0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, Dv))
    gshape = (B, T, Hv, Dk) if vectorized else (B, T, Hv)
    g = rng.uniform(*decay, gshape)
    b = 1 / (1 + np.exp(-rng.standard_normal((B, T, Hv)))) if beta is None else \
        np.full((B, T, Hv), float(beta))
    s = rng.standard_normal((B, Hv, Dv, Dk)) * 0.5 if state else None
    arr = lambda a, dt=dtype: mx.array(a.astype(np.float32)).astype(dt)
    return dict(q=arr(q), k=arr(k), v=arr(v), g=arr(g, F32), beta=arr(b, F32),
                state=None if s is None else arr(s, F32))


def check(args, *, chunk=CHUNK, mask=None, what=""):
    y, S = gated_delta(**args, mask=mask, chunk=chunk)
    np64 = {n: None if a is None else np.array(a.astype(F32)) for n, a in args.items()}
    y64, S64 = gated_delta64(**np64, mask=None if mask is None else np.array(mask))
    ny, nS = gated_delta_stock(**args, mask=mask)
    if mask is not None:  # mlx-lm's loop gives y at masked tokens anyway; compare the rest
        keep = np.array(mask)[:, :, None, None]
        y = mx.where(mx.array(keep), y, 0)
        ny = mx.where(mx.array(keep), ny, 0)
    dtype = args["q"].dtype
    assert y.dtype == dtype and S.dtype == mx.float32
    # float32 inputs: mlx-lm's loop is near-exact there; the chunked products and the
    # triangular inverse add a few float32 roundings per chunk (64 ulps of the output)
    assert_dtype_close(y, y64, ny, dtype=dtype, ulps=64 if dtype == F32 else 4,
                       what=f"{what} y")
    # the state is float32 whatever the inputs: the rule in float32
    assert_dtype_close(S, S64, nS, dtype=F32, factor=4.0, ulps=64, what=f"{what} state")


@pytest.mark.parametrize("T", [1, 2, 3, 63, 64, 65, 130])
def test_lengths_and_chunk_boundaries(T):
    check(inputs(T=T), what=f"T={T}")


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("vectorized", [False, True])
def test_dtypes_and_gatings(dtype, vectorized):
    check(inputs(T=77, dtype=dtype, vectorized=vectorized), chunk=32,
          what=f"{dtype} vec={vectorized}")


@pytest.mark.parametrize("decay", [(0.0, 1e-3), (0.999, 1.0), (1.0, 1.0)])
@pytest.mark.parametrize("vectorized", [False, True])
def test_decay_extremes(decay, vectorized):
    check(inputs(T=45, decay=decay, vectorized=vectorized), chunk=16, what=f"decay {decay}")


def test_decay_exactly_zero():
    args = inputs(T=40)
    g = np.array(args["g"])
    g[:, ::7] = 0.0
    args["g"] = mx.array(g)
    check(args, chunk=16, what="g=0")


@pytest.mark.parametrize("beta", [0.0, 1.0, 2.0])
def test_beta_constants(beta):
    """beta 0 (no write: pure decay), 1 (the delta rule's projection), 2 (allow_neg_eigval's
    upper end: a reflection)."""
    check(inputs(T=50, beta=beta), chunk=16, what=f"beta={beta}")


@pytest.mark.parametrize("Hk,Hv", [(1, 1), (2, 2), (1, 4), (16, 32)])
def test_head_ratios(Hk, Hv):
    check(inputs(B=2, T=20, Hk=Hk, Hv=Hv, Dk=16, Dv=8), chunk=8, what=f"{Hk}/{Hv}")


def test_no_initial_state():
    check(inputs(T=33, state=False), chunk=16, what="state=None")


def test_two_prefills_equal_one():
    """A prompt continued over two prefills (the state handed over) == one prefill."""
    args = inputs(T=100)
    y, S = gated_delta(**args)
    first = {n: a[:, :37] if n != "state" else a for n, a in args.items()}
    y1, S1 = gated_delta(**first)
    second = {n: a[:, 37:] if n != "state" else S1 for n, a in args.items()}
    y2, S2 = gated_delta(**second)
    np.testing.assert_allclose(np.array(mx.concatenate([y1, y2], 1)), np.array(y), atol=2e-5)
    np.testing.assert_allclose(np.array(S2), np.array(S), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("vectorized", [False, True])
def test_padding_mask(vectorized):
    """Left padding (mlx-lm's ArraysCache mask): masked tokens keep the state, give y = 0."""
    args = inputs(B=3, T=30, vectorized=vectorized)
    mask = np.ones((3, 30), bool)
    mask[1, :7] = False
    mask[2, :29] = False
    m = mx.array(mask)
    check(args, chunk=8, mask=m, what="mask")
    y, _ = gated_delta(**args, mask=m, chunk=8)
    assert float(mx.abs(y[1, :7]).max()) == 0.0


def test_gates_match_mlx_lm():
    """gated_delta_gates + gated_delta == mlx-lm's gated_delta_update (its CPU loop)."""
    from mlx_lm.models.gated_delta import gated_delta_update

    rng = np.random.default_rng(3)
    args = inputs(T=25, dtype=BF16)
    a = mx.array(rng.standard_normal((1, 25, 4)).astype(np.float32)).astype(BF16)
    b = mx.array(rng.standard_normal((1, 25, 4)).astype(np.float32)).astype(BF16)
    A_log = mx.array(np.log(rng.uniform(1, 16, 4)).astype(np.float32))
    dt_bias = mx.ones(4)
    for neg in (False, True):
        g, beta = gated_delta_gates(a, b, A_log, dt_bias, allow_neg_eigval=neg)
        y, S = gated_delta(args["q"], args["k"], args["v"], g, beta, args["state"])
        ys, Ss = gated_delta_update(args["q"], args["k"], args["v"], a, b, A_log, dt_bias,
                                    args["state"], allow_neg_eigval=neg)
        np.testing.assert_allclose(np.array(y.astype(F32)), np.array(ys.astype(F32)),
                                   atol=2e-2, rtol=2e-2)
        np.testing.assert_allclose(np.array(S), np.array(Ss), atol=1e-4, rtol=1e-4)


def test_chunk_sizes_agree():
    args = inputs(T=90)
    ref, Sref = gated_delta_chunked(**args, chunk=1)
    for c in (5, 32, 128):
        y, S = gated_delta_chunked(**args, chunk=c)
        np.testing.assert_allclose(np.array(y), np.array(ref), atol=2e-5)
        np.testing.assert_allclose(np.array(S), np.array(Sref), atol=2e-5)


def test_bad_arguments():
    args = inputs(T=4)
    with pytest.raises(ValueError, match="k must"):
        gated_delta(**{**args, "k": args["k"][:, :3]})
    with pytest.raises(ValueError, match="g must"):
        gated_delta(**{**args, "g": args["g"][..., None, None]})
    with pytest.raises(ValueError, match="state must"):
        gated_delta(**{**args, "state": args["state"][:, :1]})
    with pytest.raises(TypeError, match="q must"):
        gated_delta(**{**args, "q": np.zeros(3)})
    with pytest.raises(TypeError, match="mask must be bool"):
        gated_delta(**args, mask=mx.ones((1, 4)))
    with pytest.raises(ValueError, match="chunk"):
        gated_delta(**args, chunk=0)
    with pytest.raises(ValueError, match="multiple"):
        gated_delta(**{**args, "v": mx.zeros((1, 4, 3, 16))}, )


@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize("vectorized", [False, True])
def test_kind_check_on_model_like_gates(dtype, vectorized):
    """The tuner kind's synthetic inputs (mlx-lm's gate formula with A in [1, 16]: decays down
    to ~1e-9 per token) and its check: the composite passes against stock's loop, and a
    corrupted output fails."""
    from mlx_bricks.bricks.gated_delta.kind import GATED_DELTA
    from mlx_bricks.runtime.kind import Act

    B, T, Hk, Hv, D = 1, 70, 2, 4, 32
    gshape = (B, T, Hv, D) if vectorized else (B, T, Hv)
    args = {"q": Act((B, T, Hk, D), dtype), "k": Act((B, T, Hk, D), dtype),
            "v": Act((B, T, Hv, D), dtype), "g": Act(gshape, F32), "beta": Act((B, T, Hv), dtype),
            "state": Act((B, Hv, D, D), F32)}
    synth = GATED_DELTA.synthetic(args, seed=1)
    assert float(synth["g"].min()) < 1e-3 and float(synth["g"].max()) <= 1.0
    naive = GATED_DELTA.stock(synth)
    (composite,) = GATED_DELTA.variants("reference", dtype, synth)
    out = composite.run(synth, "reference")
    assert GATED_DELTA.check(out, naive, synth).ok
    y, S = out
    bad = (y, S + 1e-3 * mx.abs(S).max())
    assert not GATED_DELTA.check(bad, naive, synth).ok


# ---------------------------------------------------------------------------------------------
# the kernels: the MSL kernel (metal, emulator), its CUDA twin (cuda; tests/cuda_emu on the CPU)


KERNEL_CASES = [  # (B, T, Hk, Hv, Dk, Dv, dtype, state, mask)
    (1, 1, 1, 1, 32, 8, F32, True, False),
    (1, 3, 1, 2, 32, 16, F16, False, False),
    (1, 37, 2, 4, 32, 16, BF16, True, False),  # two full chunks and a partial one
    (2, 20, 1, 2, 64, 24, F32, True, True),  # a padded batch, Dv of 8-column blocks
]


def _kernel_check(run, case):
    B, T, Hk, Hv, Dk, Dv, dtype, state, masked = case
    args = inputs(B=B, T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, dtype=dtype, state=state,
                  decay=(0.5, 1.0), seed=T)
    mask = None
    if masked:
        m = np.ones((B, T), bool)
        m[1, :6] = False
        mask = mx.array(m)
    y, S = run(args, mask)
    np64 = {n: None if a is None else np.array(a.astype(F32)) for n, a in args.items()}
    y64, S64 = gated_delta64(**np64, mask=None if mask is None else np.array(mask))
    ny, nS = gated_delta_stock(**args, mask=mask)
    if mask is not None:
        keep = mx.array(np.array(mask)[:, :, None, None])
        ny = mx.where(keep, ny, 0)
        assert float(mx.abs(mx.where(keep, 0, y.astype(F32))).max()) == 0.0
    assert y.dtype == dtype and S.dtype == F32 and S.shape == (B, Hv, Dv, Dk)
    assert_dtype_close(y, y64, ny, dtype=dtype, ulps=64 if dtype == F32 else 4, what=f"{case} y")
    assert_dtype_close(S, S64, nS, dtype=F32, factor=4.0, ulps=64, what=f"{case} state")


@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel(kernel_backend, case):
    """The op on every backend (reference: the composite) against the float64 recurrence."""
    _kernel_check(lambda a, m: gated_delta(**a, mask=m, backend=kernel_backend), case)


def test_kernel_reasons():
    from mlx_bricks.bricks.gated_delta import msl

    a = inputs(T=4, vectorized=True)
    assert "per-key-dim" in msl.kernel_reason(a["q"], a["v"], a["g"])
    a = inputs(T=4, Dk=256, Dv=16)
    assert "Dk 256" in msl.kernel_reason(a["q"], a["v"], a["g"])
    a = inputs(T=4, Dv=12)
    assert "multiple of 8" in msl.kernel_reason(a["q"], a["v"], a["g"])
    # the op computes them anyway (the composite)
    y, _ = gated_delta(**a, backend="emulator")
    assert y.shape == (1, 4, 4, 12)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_cuda_twin_emulated(case):
    """The CUDA twin on the CPU (tests/cuda_emu: the exact body, threads as OS threads)."""
    from tests import cuda_emu
    from mlx_bricks.bricks.gated_delta import msl as gdn_kernel

    if cuda_emu.toolchain() is None:
        pytest.skip("no host C++ compiler or CUDA headers")

    def run(args, mask):
        from mlx_bricks.bricks.gated_delta.op import run_kernel

        with cuda_emu.emulated_launches(gdn_kernel) as names:
            out = run_kernel(**args, mask=mask, backend="cuda")
            mx.eval(out)
        assert names == ["gated_delta"]
        return out

    _kernel_check(run, case)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_cuda_twin_compiles(dtype):
    """The twin compiles with nvcc for sm_90a and sm_80 as MLX would build it (Qwen3.5's
    shapes), in registers (no local memory), its shared memory within the 48 KB a block gets
    without opting in."""
    from mlx_bricks import cudacheck
    from mlx_bricks.bricks.gated_delta import msl as gdn_kernel
    from mlx_bricks.bricks.gated_delta.op import run_kernel

    if cudacheck.find_nvcc() is None:
        pytest.skip("nvcc not found")
    args = {n: mx.zeros(s, dt) for n, s, dt in (
        ("q", (1, 64, 16, 128), dtype), ("k", (1, 64, 16, 128), dtype),
        ("v", (1, 64, 32, 128), dtype), ("g", (1, 64, 32), F32), ("beta", (1, 64, 32), F32))}
    with cudacheck.recorded_launches(gdn_kernel) as rec:
        run_kernel(**args, backend="cuda")
    assert [r.name for r in rec] == ["gated_delta"]
    for arch in ("sm_90a", "sm_80"):
        res = rec[0].compile(arch)
        assert res.stack == 0 and res.spill_stores == 0 and res.spill_loads == 0, res
        assert res.registers * rec[0].threadgroup[0] <= 65536, res
    assert rec[0].shared_memory <= 48 * 1024
    if cudacheck.find_nvrtc() is not None:  # what MLX compiles with
        cudacheck.compile_source_nvrtc(rec[0].source())


def test_no_token_passes_the_state_through():
    """T == 0 (from the kernel review): an empty output and the state unchanged."""
    from mlx_bricks.bricks.gated_delta.op import gated_delta_chunked

    B, Hk, Hv, Dk, Dv = 1, 2, 4, 16, 8
    q = mx.zeros((B, 0, Hk, Dk))
    k = mx.zeros((B, 0, Hk, Dk))
    v = mx.zeros((B, 0, Hv, Dv))
    g = mx.zeros((B, 0, Hv))
    beta = mx.zeros((B, 0, Hv))
    state = mx.random.normal((B, Hv, Dv, Dk))
    y, s = gated_delta_chunked(q, k, v, g, beta, state)
    assert y.shape == (B, 0, Hv, Dv) and mx.array_equal(s, state)
    y, s = gated_delta_chunked(q, k, v, g, beta)
    assert s.shape == (B, Hv, Dv, Dk) and not mx.any(s).item()
