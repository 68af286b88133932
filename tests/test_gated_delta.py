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
    gated_delta_blas,
    gated_delta_chunked,
    gated_delta_gates,
    gated_delta_stock,
)
from tests.tolerance import assert_dtype_close

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
#: The composites: the chunked form in MLX ops and in NumPy (float32 through its BLAS).
COMPOSITES = {"chunked": gated_delta_chunked, "blas": gated_delta_blas}


@pytest.fixture(params=list(COMPOSITES))
def composite(request):
    """The op's composites by name (the kernels: KERNEL_CASES below)."""
    return COMPOSITES[request.param]


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


def check(args, *, fn=gated_delta, chunk=CHUNK, mask=None, what=""):
    y, S = fn(**args, mask=mask, chunk=chunk)
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
def test_lengths_and_chunk_boundaries(T, composite):
    check(inputs(T=T), fn=composite, what=f"T={T}")


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("vectorized", [False, True])
def test_dtypes_and_gatings(dtype, vectorized, composite):
    check(inputs(T=77, dtype=dtype, vectorized=vectorized), fn=composite, chunk=32,
          what=f"{dtype} vec={vectorized}")


@pytest.mark.parametrize("decay", [(0.0, 1e-3), (0.999, 1.0), (1.0, 1.0)])
@pytest.mark.parametrize("vectorized", [False, True])
def test_decay_extremes(decay, vectorized, composite):
    check(inputs(T=45, decay=decay, vectorized=vectorized), fn=composite, chunk=16,
          what=f"decay {decay}")


@pytest.mark.parametrize("vectorized", [False, True])
def test_decay_exactly_zero(vectorized, composite):
    args = inputs(T=40, vectorized=vectorized)
    g = np.array(args["g"])
    g[:, ::7] = 0.0
    args["g"] = mx.array(g)
    check(args, fn=composite, chunk=16, what="g=0")


@pytest.mark.parametrize("beta", [0.0, 1.0, 2.0])
def test_beta_constants(beta):
    """beta 0 (no write: pure decay), 1 (the delta rule's projection), 2 (allow_neg_eigval's
    upper end: a reflection)."""
    check(inputs(T=50, beta=beta), chunk=16, what=f"beta={beta}")


@pytest.mark.parametrize("Hk,Hv", [(1, 1), (2, 2), (1, 4), (16, 32)])
def test_head_ratios(Hk, Hv, composite):
    check(inputs(B=2, T=20, Hk=Hk, Hv=Hv, Dk=16, Dv=8, vectorized=Hk == 1), fn=composite,
          chunk=8, what=f"{Hk}/{Hv}")


@pytest.mark.parametrize("vectorized", [False, True])
def test_no_initial_state(vectorized, composite):
    check(inputs(T=33, state=False, vectorized=vectorized), fn=composite, chunk=16,
          what="state=None")


@pytest.mark.parametrize("vectorized", [False, True])
def test_two_prefills_equal_one(vectorized, composite):
    """A prompt continued over two prefills (the state handed over) == one prefill."""
    args = inputs(T=100, vectorized=vectorized)
    y, S = composite(**args)
    first = {n: a[:, :37] if n != "state" else a for n, a in args.items()}
    y1, S1 = composite(**first)
    second = {n: a[:, 37:] if n != "state" else S1 for n, a in args.items()}
    y2, S2 = composite(**second)
    np.testing.assert_allclose(np.array(mx.concatenate([y1, y2], 1)), np.array(y), atol=2e-5)
    np.testing.assert_allclose(np.array(S2), np.array(S), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("vectorized", [False, True])
def test_padding_mask(vectorized, composite):
    """Left padding (mlx-lm's ArraysCache mask): masked tokens keep the state, give y = 0."""
    args = inputs(B=3, T=30, vectorized=vectorized)
    mask = np.ones((3, 30), bool)
    mask[1, :7] = False
    mask[2, :29] = False
    m = mx.array(mask)
    check(args, fn=composite, chunk=8, mask=m, what="mask")
    y, _ = composite(**args, mask=m, chunk=8)
    assert float(mx.abs(y[1, :7]).max()) == 0.0


GATE_CASES = [  # (Hk, Hv, Dk, gate per key dim, gated_delta_update keyword arguments)
    (2, 4, 32, False, {}),
    (2, 4, 32, False, {"allow_neg_eigval": True}),  # olmo_hybrid: beta in [0, 2]
    (2, 2, 16, True, {}),  # kimi_linear: A_log (H, 1), dt_bias (H, Dk)
    (2, 2, 16, True, {"lower_bound": -5.0}),  # bailing_moe_v3, kimi_k3's gate_lower_bound
]


@pytest.mark.parametrize("case", GATE_CASES, ids=str)
def test_gates_match_mlx_lm(case, composite):
    """gated_delta_gates + the composite == mlx-lm's gated_delta_update (its CPU loop), for a
    gate per head (qwen3_5, olmo_hybrid) and per key dim (Kimi Delta Attention)."""
    from mlx_lm.models.gated_delta import gated_delta_update

    Hk, Hv, Dk, vec, kwargs = case
    rng = np.random.default_rng(3)
    args = inputs(T=25, Hk=Hk, Hv=Hv, Dk=Dk, Dv=16, dtype=BF16)
    a_shape, A_shape = ((1, 25, Hv, Dk), (Hv, 1)) if vec else ((1, 25, Hv), (Hv,))
    a = mx.array(rng.standard_normal(a_shape).astype(np.float32)).astype(BF16)
    b = mx.array(rng.standard_normal((1, 25, Hv)).astype(np.float32)).astype(BF16)
    A_log = mx.array(np.log(rng.uniform(1, 16, A_shape)).astype(np.float32))
    dt_bias = mx.array(rng.standard_normal((Hv, Dk) if vec else (Hv,)).astype(np.float32))
    g, beta = gated_delta_gates(a, b, A_log, dt_bias, **kwargs)
    assert g.shape == a_shape
    y, S = composite(args["q"], args["k"], args["v"], g, beta, args["state"])
    ys, Ss = gated_delta_update(args["q"], args["k"], args["v"], a, b, A_log, dt_bias,
                                args["state"], **kwargs)
    np.testing.assert_allclose(np.array(y.astype(F32)), np.array(ys.astype(F32)), atol=2e-2,
                               rtol=2e-2)
    np.testing.assert_allclose(np.array(S), np.array(Ss), atol=1e-4, rtol=1e-4)


def test_chunk_sizes_agree(composite):
    for vectorized in (False, True):
        args = inputs(T=90, vectorized=vectorized)
        ref, Sref = composite(**args, chunk=1)
        for c in (5, 32, 128):
            y, S = composite(**args, chunk=c)
            np.testing.assert_allclose(np.array(y), np.array(ref), atol=2e-5)
            np.testing.assert_allclose(np.array(S), np.array(Sref), atol=2e-5)


def mixed_decays(args, seed=0):
    """``args`` (a gate per key dim) with a quarter of the key dims decaying hard (g in
    [0, 0.05]), a quarter moderately ([0.5, 0.7]: a chunk of 128 spans e^-60 there), half
    barely ([0.99, 1])."""
    rng = np.random.default_rng(seed)
    g = np.array(args["g"])
    Dk = g.shape[-1]
    parts = (0.0, 0.05), (0.5, 0.7), (0.99, 1.0), (0.99, 1.0)
    for i, lohi in enumerate(parts):
        sl = slice(i * Dk // 4, (i + 1) * Dk // 4)
        g[..., sl] = rng.uniform(*lohi, g[..., sl].shape)
    return {**args, "g": mx.array(g.astype(np.float32))}


@pytest.mark.parametrize("chunk", [64, 128])
def test_per_key_dim_strong_decay_long_chunks(chunk, composite):
    """Long chunks with key dims decaying at very different rates (the per-dim cumulative decay
    spans e^-3000 to ~1 inside one chunk) against float64."""
    check(mixed_decays(inputs(B=1, T=200, Dk=32, vectorized=True)), fn=composite, chunk=chunk,
          what=f"mixed decays C={chunk}")


@pytest.mark.parametrize("leaf", [1, 4, 64])
@pytest.mark.parametrize("namespace", ["MLX", "NUMPY"])
def test_decayed_products_against_pairs(leaf, namespace):
    """``chunked.decayed_products`` (recursive halving, factors <= 1) == the products formed
    pair by pair in float64, with log decays down to -3000 inside the block."""
    from mlx_bricks.bricks.gated_delta import chunked

    o = getattr(chunked, namespace)
    rng = np.random.default_rng(leaf)
    n, D = 64, 12
    x, k = rng.standard_normal((2, 3, n, D)), rng.standard_normal((2, 3, n, D))
    lg = np.concatenate([rng.uniform(-60, -1, (2, 3, n, D // 3)),
                         rng.uniform(-0.05, 0, (2, 3, n, D - D // 3))], axis=-1)
    L = np.cumsum(lg, axis=-2)
    causal = np.tril(np.ones((n, n), bool))[:, :, None]
    d = np.exp(np.where(causal, L[..., :, None, :] - L[..., None, :, :], -np.inf))
    want = (x[..., :, None, :] * k[..., None, :, :] * np.where(d < np.exp(-16.0), 0.0, d)).sum(-1)
    arr = (lambda a: mx.array(a.astype(np.float32))) if namespace == "MLX" else \
        (lambda a: a.astype(np.float32))
    got = np.array(chunked.decayed_products(o, arr(x), arr(k), arr(L), leaf))
    np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=1e-4)


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
    composites = GATED_DELTA.variants("reference", dtype, synth)
    assert [c.name for c in composites] == ["chunked", "blas"]  # the CPU: both apply
    for composite in composites:
        out = composite.run(synth, "reference")
        assert GATED_DELTA.check(out, naive, synth).ok, composite.name
    y, S = out
    bad = (y, S + 1e-3 * mx.abs(S).max())
    assert not GATED_DELTA.check(bad, naive, synth).ok


# ---------------------------------------------------------------------------------------------
# the kernels: the MSL kernel (metal, emulator), its CUDA twin (cuda; tests/cuda_emu on the CPU)


KERNEL_CASES = [  # (B, T, Hk, Hv, Dk, Dv, dtype, state, mask, a gate per key dim)
    (1, 1, 1, 1, 32, 8, F32, True, False, False),
    (1, 3, 1, 2, 32, 16, F16, False, False, False),
    (1, 37, 2, 4, 32, 16, BF16, True, False, False),  # two full chunks and a partial one
    (2, 20, 1, 2, 64, 24, F32, True, True, False),  # a padded batch, Dv of 8-column blocks
    (1, 19, 1, 2, 32, 16, BF16, True, False, True),  # per key dim: chunks of 8
    (2, 13, 2, 2, 64, 8, F32, True, True, True),  # per key dim, a padded batch
]


def _kernel_check(run, case):
    B, T, Hk, Hv, Dk, Dv, dtype, state, masked, vec = case
    args = inputs(B=B, T=T, Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, dtype=dtype, state=state,
                  decay=(0.5, 1.0), seed=T, vectorized=vec)
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


def test_kernel_per_key_dim_mixed_decays(kernel_backend):
    """The kernel with key dims decaying at very different rates, against float64."""
    import functools

    check(mixed_decays(inputs(T=40, Dk=32, vectorized=True)),
          fn=functools.partial(gated_delta, backend=kernel_backend), what="kernel, mixed decays")


def test_kernel_reasons():
    from mlx_bricks.bricks.gated_delta import msl

    a = inputs(T=4, vectorized=True)
    assert msl.kernel_reason(a["q"], a["v"], a["g"]) is None  # a gate per key dim runs it
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
@pytest.mark.parametrize("vec", [False, True])
def test_cuda_twin_compiles(dtype, vec):
    """The twin compiles with nvcc for sm_90a and sm_80 as MLX would build it (Qwen3.5's
    shapes; ``vec``: Kimi-Linear's, 32 heads of 128 with a gate per key dim), in registers (no
    local memory), its shared memory within the 48 KB a block gets without opting in."""
    from mlx_bricks import cudacheck
    from mlx_bricks.bricks.gated_delta import msl as gdn_kernel
    from mlx_bricks.bricks.gated_delta.op import run_kernel

    if cudacheck.find_nvcc() is None:
        pytest.skip("nvcc not found")
    hk = 32 if vec else 16
    args = {n: mx.zeros(s, dt) for n, s, dt in (
        ("q", (1, 64, hk, 128), dtype), ("k", (1, 64, hk, 128), dtype),
        ("v", (1, 64, 32, 128), dtype), ("g", (1, 64, 32, 128) if vec else (1, 64, 32), F32),
        ("beta", (1, 64, 32), F32))}
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


def test_one_blas_thread_restores_the_count():
    """The blas composite runs NumPy's OpenBLAS on one thread and gives the count back."""
    from mlx_bricks.cpu import _openblas_threads, one_blas_thread

    fns = _openblas_threads()
    if fns is None:
        pytest.skip("NumPy has no bundled OpenBLAS here")
    before = fns[0]()
    with one_blas_thread():
        assert fns[0]() == 1
    assert fns[0]() == before
