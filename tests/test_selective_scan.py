"""Selective-scan brick: Mamba-1's selective state space against a float64 sequential reference.

The reference is the recurrence of mlx-lm's Mamba-1 mixers token by token in float64 numpy
(the time steps' softplus in float64 too); the naive same-dtype comparison is mlx-lm's own
token loop (jamba's ``ssm_step`` from the conv output on: ``selective_scan_stock``) with the
dtype-scaled rule of tests/tolerance.py.
"""
import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks.selective_scan.op import (
    CHUNK,
    gates,
    selective_scan,
    selective_scan_chunked,
    selective_scan_stock,
)
from tests.tolerance import assert_dtype_close

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32


def scan64(x, dt, A_log, B, C, D=None, state=None):
    """The recurrence in float64 numpy: h (batch, channels, N); per token delta = softplus(dt),
    h = exp(delta A) h + delta x B, y = h C + D x."""
    x, dt, A_log, B, C = (np.asarray(a, np.float64) for a in (x, dt, A_log, B, C))
    b, T, ch = x.shape
    N = A_log.shape[1]
    delta = np.logaddexp(dt, 0.0)
    A = -np.exp(A_log)
    h = np.zeros((b, ch, N)) if state is None else np.asarray(state, np.float64).copy()
    y = np.zeros((b, T, ch))
    for t in range(T):
        dl = delta[:, t, :, None]
        h = np.exp(dl * A) * h + dl * x[:, t, :, None] * B[:, t, None, :]
        y[:, t] = np.einsum("bdn,bn->bd", h, C[:, t])
    if D is not None:
        y = y + x * np.asarray(D, np.float64)
    return y, h


def inputs(b=1, T=70, ch=24, N=16, dtype=F32, seed=0, state=True, D=True, shift=-2.0):
    """Model-like inputs: x, B, C normal; raw time steps normal around ``shift`` (softplus
    about 0.13 at -2; large steps decay the state to 0); A = 1..N per channel, jittered; D
    normal; a random state of the inputs' dtype."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s)  # noqa: E731
    arr = lambda a, dt=dtype: mx.array(np.asarray(a, np.float32)).astype(dt)  # noqa: E731
    A = np.arange(1, N + 1)[None, :] * rng.uniform(0.5, 1.5, (ch, 1))
    return dict(x=arr(f(b, T, ch)), dt=arr(f(b, T, ch) + shift), A_log=arr(np.log(A), F32),
                B=arr(f(b, T, N)), C=arr(f(b, T, N)), D=arr(f(ch)) if D else None,
                state=arr(f(b, ch, N) * 0.5) if state else None)


def to64(args):
    return {n: None if a is None else np.array(a.astype(F32)) for n, a in args.items()}


def check(args, *, chunk=CHUNK, backend="reference", what=""):
    y, S = selective_scan(**args, chunk=chunk, backend=backend)
    y64, S64 = scan64(**to64(args))
    ny, nS = selective_scan_stock(**args)
    dtype = args["x"].dtype
    assert y.dtype == ny.dtype and S.dtype == F32, (y.dtype, ny.dtype, S.dtype)
    assert y.shape == ny.shape and S.shape == nS.shape
    assert_dtype_close(y, y64, ny, dtype=dtype, ulps=64 if dtype == F32 else 4,
                       what=f"{what} y")
    assert_dtype_close(S, S64, nS.astype(F32), dtype=F32, factor=4.0, ulps=64,
                       what=f"{what} state")


@pytest.mark.parametrize("T", [1, 7, 31, 32, 33, 100])
def test_lengths_and_chunk_boundaries(T):
    check(inputs(T=T), what=f"T={T}")


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_dtypes(dtype):
    check(inputs(T=77, dtype=dtype), chunk=16, what=str(dtype))


@pytest.mark.parametrize("N", [1, 5, 16, 64])
def test_state_sizes(N):
    check(inputs(b=2, T=40, N=N), chunk=8, what=f"N={N}")


def test_no_state_no_skip_and_large_steps():
    """No initial state, no D, large time steps (decays to 0)."""
    check(inputs(T=50, state=False, D=False, shift=3.0), chunk=16, what="bare")


def test_two_prefills_equal_one():
    """A prompt continued over two prefills (the state handed over) == one prefill."""
    args = inputs(T=100)
    y, S = selective_scan(**args)
    cut = lambda a, s: a[:, s] if a is not None and a.ndim == 3 and a.shape[1] == 100 \
        else a  # noqa: E731
    y1, S1 = selective_scan(**{n: cut(a, slice(0, 37)) for n, a in args.items()})
    y2, S2 = selective_scan(**{**{n: cut(a, slice(37, None)) for n, a in args.items()},
                               "state": S1})
    np.testing.assert_allclose(np.array(mx.concatenate([y1, y2], 1)), np.array(y), atol=2e-5)
    np.testing.assert_allclose(np.array(S2), np.array(S), atol=2e-5, rtol=1e-5)


def test_chunk_sizes_agree():
    args = inputs(T=90)
    delta, A = gates(args["dt"], args["A_log"])
    rest = {n: args[n] for n in ("B", "C", "D", "state")}
    ref, Sref = selective_scan_chunked(args["x"], delta, A, **rest, chunk=1)
    for c in (5, 32, 128):
        y, S = selective_scan_chunked(args["x"], delta, A, **rest, chunk=c)
        np.testing.assert_allclose(np.array(y), np.array(ref), atol=2e-5)
        np.testing.assert_allclose(np.array(S), np.array(Sref), atol=2e-5)


def test_no_token_passes_the_state_through():
    args = inputs(T=0)
    y, S = selective_scan(**args)
    assert y.shape == (1, 0, 24) and mx.array_equal(S, args["state"])


def test_bad_arguments():
    args = inputs(T=4)
    with pytest.raises(ValueError, match="A_log must"):
        selective_scan(**{**args, "A_log": args["A_log"][:3]})
    with pytest.raises(ValueError, match="dt must"):
        selective_scan(**{**args, "dt": args["dt"][..., :2]})
    with pytest.raises(ValueError, match="C must"):
        selective_scan(**{**args, "C": args["C"][..., :3]})
    with pytest.raises(ValueError, match="state must"):
        selective_scan(**{**args, "state": args["state"][:, :1]})
    with pytest.raises(ValueError, match="D must"):
        selective_scan(**{**args, "D": mx.ones(3)})
    with pytest.raises(TypeError, match="x must"):
        selective_scan(**{**args, "x": np.zeros(3)})
    with pytest.raises(TypeError, match="B must"):
        selective_scan(**{**args, "B": args["B"].astype(mx.int32)})
    with pytest.raises(ValueError, match="chunk"):
        selective_scan(**args, chunk=0)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_kind_check(dtype):
    """The tuner kind's synthetic inputs and its check: the composite passes against stock,
    a corrupted state fails (by 5 % of its scale: stock keeps a bfloat16 model's state in
    bfloat16, whose rounding sets the budget)."""
    from mlx_bricks.bricks.selective_scan.kind import SELECTIVE_SCAN_KIND as K
    from mlx_bricks.runtime.kind import Act

    b, T, ch, N = 1, 70, 32, 16
    args = {"x": Act((b, T, ch), dtype), "dt": Act((b, T, ch), dtype),
            "A_log": Act((ch, N), F32), "B": Act((b, T, N), dtype), "C": Act((b, T, N), dtype),
            "D": Act((ch,), dtype), "state": Act((b, ch, N), dtype)}
    synth = K.synthetic(args, seed=1)
    naive = K.stock(synth)
    (composite,) = K.variants("reference", dtype, synth)
    out = composite.run(synth, "reference")
    assert K.check(out, naive, synth).ok
    y, S = out
    assert not K.check((y, S + 0.05 * mx.abs(S).max()), naive, synth).ok


# ---------------------------------------------------------------------------------------------
# the kernels: the MSL kernel (metal, emulator), its CUDA twin (cuda; tests/cuda_emu on the CPU)

KERNEL_CASES = [  # (b, T, ch, N, dtype, state, D): lanes 8 / 4 / 1 / 2 / 8 (16 entries a
    (1, 1, 8, 16, F32, True, True),    # lane); channels not filling a threadgroup (its tail
    (1, 37, 40, 12, BF16, True, True),  # threads repeat the last one); no token
    (2, 20, 300, 5, F16, False, False),
    (1, 9, 7, 6, F32, True, False),
    (2, 5, 9, 128, BF16, True, True),
    (1, 0, 24, 16, F32, True, True),
]


def _kernel_check(run, case):
    b, T, ch, N, dtype, state, D = case
    args = inputs(b=b, T=T, ch=ch, N=N, dtype=dtype, state=state, D=D, seed=T)
    delta, A = gates(args["dt"], args["A_log"])
    y, S = run(args, delta, A)
    if T == 0:  # no launch: the state passes through
        assert y.shape == (b, 0, ch) and mx.array_equal(S, args["state"])
        return
    y64, S64 = scan64(**to64(args))
    ny, nS = selective_scan_stock(**args)
    assert S.dtype == F32 and S.shape == (b, ch, N) and y.dtype == ny.dtype
    assert_dtype_close(y, y64, ny, dtype=dtype, ulps=64 if dtype == F32 else 4, what=f"{case} y")
    assert_dtype_close(S, S64, nS.astype(F32), dtype=F32, factor=4.0, ulps=64,
                       what=f"{case} state")


@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel(kernel_backend, case):
    """The op on every backend (reference: the composite) against the float64 recurrence."""
    _kernel_check(lambda a, delta, A: selective_scan(**a, backend=kernel_backend), case)


def test_kernel_reason_and_lanes():
    from mlx_bricks.bricks.selective_scan import msl

    assert [msl.lanes(n) for n in (16, 12, 6, 5, 128)] == [8, 4, 2, 1, 8]
    assert msl.kernel_reason(128) is None and msl.kernel_reason(16) is None
    assert "17 state entries" in msl.kernel_reason(17)
    a = inputs(T=4, N=17)
    y, _ = selective_scan(**a, backend="emulator")  # the op computes it anyway (the composite)
    assert y.shape == (1, 4, 24)


@pytest.mark.parametrize("case", KERNEL_CASES[1:], ids=str)
def test_cuda_twin_emulated(case):
    """The CUDA twin on the CPU (tests/cuda_emu: the exact body, threads as OS threads)."""
    from tests import cuda_emu
    from mlx_bricks.bricks.selective_scan import cuda as sc_cuda
    from mlx_bricks.bricks.selective_scan.op import out_dtype, run_kernel

    if cuda_emu.toolchain() is None:
        pytest.skip("no host C++ compiler or CUDA headers")

    def run(args, delta, A):
        with cuda_emu.emulated_launches(sc_cuda) as names:
            out = run_kernel(args["x"], delta, A, args["B"], args["C"], args["D"],
                             args["state"], backend="cuda",
                             dtype=out_dtype(args["x"], args["dt"], args["B"], args["C"],
                                             args["D"]))
            mx.eval(out)
        assert names == (["selective_scan"] if args["x"].shape[1] else [])  # T = 0: none
        return out

    _kernel_check(run, case)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_cuda_twin_compiles(dtype):
    """The twin compiles with nvcc for sm_80, sm_90a and sm_120 as MLX would build it
    (Jamba's shapes: 8192 channels, N = 16; and N = 128, 16 state entries a thread), in
    registers (no local memory)."""
    from mlx_bricks import cudacheck
    from mlx_bricks.bricks.selective_scan import cuda as sc_cuda
    from mlx_bricks.bricks.selective_scan.op import run_kernel

    if cudacheck.find_nvcc() is None:
        pytest.skip("nvcc not found")
    b, T, ch = 1, 64, 8192
    x = mx.zeros((b, T, ch), dtype)
    with cudacheck.recorded_launches(sc_cuda) as rec:
        for N in (16, 128):
            run_kernel(x, mx.zeros((b, T, ch)), mx.zeros((ch, N)), mx.zeros((b, T, N)),
                       mx.zeros((b, T, N)), mx.ones((ch,), dtype), backend="cuda")
    assert [r.name for r in rec] == ["selective_scan"] * 2
    for launch, most in zip(rec, (64, 128)):
        for arch in ("sm_80", "sm_90a", "sm_120"):
            res = launch.compile(arch)
            assert res.stack == 0 and res.spill_stores == 0 and res.spill_loads == 0, res
            assert res.registers <= most, res
    if cudacheck.find_nvrtc() is not None:  # what MLX compiles with
        cudacheck.compile_source_nvrtc(rec[0].source())
