"""SSD brick: Mamba-2's chunked selective state space against a float64 sequential reference.

The reference is the recurrence of mlx-lm's ``ssm_update`` token by token in float64 numpy
(time steps formed in float64 too); the naive same-dtype comparison is mlx-lm's own
``ssm_attn`` (steps of 256, its C.B product in the input dtype) with the dtype-scaled rule of
tests/tolerance.py.
"""
import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks.ssd.op import CHUNK, ssd, ssd_chunked, ssd_gates, ssd_stock
from tests.tolerance import assert_dtype_close

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
INF = float("inf")


def ssd64(x, dt, A_log, B, C, D=None, dt_bias=None, state=None, mask=None,
          time_step_limit=(0.001, 100.0)):
    """The recurrence in float64 numpy: S (batch, H, P, N); per token dt = clip(softplus(dt +
    bias)), S = exp(dt A) S + dt x B^T, y = S C + D x; masked tokens keep S (dt = 0)."""
    x, dt, A_log, B, C = (np.asarray(a, np.float64) for a in (x, dt, A_log, B, C))
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    r = H // G
    B, C = np.repeat(B, r, axis=2), np.repeat(C, r, axis=2)
    if dt_bias is not None:
        dt = dt + np.asarray(dt_bias, np.float64)
    dt = np.clip(np.logaddexp(dt, 0.0), *time_step_limit)
    if mask is not None:
        dt = np.where(np.asarray(mask)[..., None], dt, 0.0)
    A = -np.exp(A_log)
    S = np.zeros((b, H, P, N)) if state is None else np.asarray(state, np.float64).copy()
    y = np.zeros((b, T, H, P))
    for t in range(T):
        S = np.exp(dt[:, t] * A)[..., None, None] * S + \
            (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        y[:, t] = np.einsum("bhpn,bhn->bhp", S, C[:, t])
    if D is not None:
        y = y + x * np.asarray(D, np.float64)[None, None, :, None]
    return y, S


def inputs(b=1, T=70, H=4, P=16, G=2, N=32, dtype=F32, seed=0, state=True, D=True,
           step=(0.001, 0.1)):
    """Model-like inputs: x, B, C normal; raw time steps normal around a dt_bias whose
    softplus is uniform in ``step``; A in [1, 16]; D normal; a random float32 state."""
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s)  # noqa: E731
    arr = lambda a, dt=dtype: mx.array(np.asarray(a, np.float32)).astype(dt)  # noqa: E731
    return dict(x=arr(f(b, T, H, P)), dt=arr(f(b, T, H) * 0.5, F32),
                A_log=arr(np.log(rng.uniform(1, 16, H)), F32),
                B=arr(f(b, T, G, N)), C=arr(f(b, T, G, N)),
                D=arr(f(H)) if D else None,
                dt_bias=arr(np.log(np.expm1(rng.uniform(*step, H))), F32),
                state=arr(f(b, H, P, N) * 0.5, F32) if state else None)


def to64(args):
    return {n: None if a is None else np.array(a.astype(F32)) for n, a in args.items()}


def check(args, *, chunk=CHUNK, mask=None, limit=(0.001, 100.0), backend="reference",
          what=""):
    y, S = ssd(**args, mask=mask, chunk=chunk, time_step_limit=limit, backend=backend)
    y64, S64 = ssd64(**to64(args), mask=None if mask is None else np.array(mask),
                     time_step_limit=limit)
    ny, nS = ssd_stock(**args, mask=mask, time_step_limit=limit)
    if mask is not None:  # y at masked tokens is not defined: compare the rest
        keep = mx.array(np.array(mask)[:, :, None, None])
        y, ny = mx.where(keep, y, 0), mx.where(keep, ny, 0)
        y64 = np.where(np.array(mask)[:, :, None, None], y64, 0.0)
    dtype = args["x"].dtype
    assert y.dtype == ny.dtype and S.dtype == F32, (y.dtype, ny.dtype, S.dtype)
    assert_dtype_close(y, y64, ny, dtype=dtype, ulps=64 if dtype == F32 else 4,
                       what=f"{what} y")
    assert_dtype_close(S, S64, nS, dtype=F32, factor=4.0, ulps=64, what=f"{what} state")


@pytest.mark.parametrize("T", [1, 7, 33, 63, 64, 65, 100])
def test_lengths_and_chunk_boundaries(T):
    check(inputs(T=T), what=f"T={T}")


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_dtypes(dtype):
    check(inputs(T=77, dtype=dtype), chunk=32, what=str(dtype))


@pytest.mark.parametrize("H,G", [(1, 1), (4, 4), (8, 2), (6, 1)])
def test_groups(H, G):
    check(inputs(b=2, T=40, H=H, G=G, P=8, N=16), chunk=16, what=f"{H}/{G}")


def test_no_state_no_skip_and_limits():
    """No initial state, no D, Nemotron-H's limit (0, inf) and large steps (decays to 0)."""
    check(inputs(T=50, state=False, D=False, step=(0.5, 8.0)), chunk=16, limit=(0.0, INF),
          what="bare")


def test_padding_mask():
    """Left padding (mlx-lm's ArraysCache mask): masked tokens keep the state."""
    mask = np.ones((3, 30), bool)
    mask[1, :7] = False
    mask[2, :29] = False
    check(inputs(b=3, T=30), chunk=8, mask=mx.array(mask), what="mask")


def test_two_prefills_equal_one():
    """A prompt continued over two prefills (the state handed over) == one prefill."""
    args = inputs(T=100)
    y, S = ssd(**args)
    cut = lambda a, s: a[:, s] if a is not None and a.ndim >= 3 else a  # noqa: E731
    y1, S1 = ssd(**{n: cut(a, slice(0, 37)) for n, a in args.items()})
    y2, S2 = ssd(**{**{n: cut(a, slice(37, None)) for n, a in args.items()}, "state": S1})
    np.testing.assert_allclose(np.array(mx.concatenate([y1, y2], 1)), np.array(y), atol=2e-5)
    np.testing.assert_allclose(np.array(S2), np.array(S), atol=2e-5, rtol=1e-5)


def test_chunk_sizes_agree():
    args = inputs(T=90)
    dtp, A = ssd_gates(args["dt"], args["A_log"], args["dt_bias"])
    rest = {n: args[n] for n in ("B", "C", "D", "state")}
    ref, Sref = ssd_chunked(args["x"], dtp, A, **rest, chunk=1)
    for c in (5, 32, 128):
        y, S = ssd_chunked(args["x"], dtp, A, **rest, chunk=c)
        np.testing.assert_allclose(np.array(y), np.array(ref), atol=2e-5)
        np.testing.assert_allclose(np.array(S), np.array(Sref), atol=2e-5)


def test_no_token_passes_the_state_through():
    args = inputs(T=0)
    y, S = ssd(**args)
    assert y.shape == (1, 0, 4, 16) and mx.array_equal(S, args["state"])


def test_bad_arguments():
    args = inputs(T=4)
    with pytest.raises(ValueError, match="C must"):
        ssd(**{**args, "C": args["C"][:, :3]})
    with pytest.raises(ValueError, match="multiple"):
        ssd(**{**args, "B": mx.zeros((1, 4, 3, 32)), "C": mx.zeros((1, 4, 3, 32))})
    with pytest.raises(ValueError, match="dt must"):
        ssd(**{**args, "dt": args["dt"][..., :2]})
    with pytest.raises(ValueError, match="state must"):
        ssd(**{**args, "state": args["state"][:, :1]})
    with pytest.raises(ValueError, match="D must"):
        ssd(**{**args, "D": mx.ones(3)})
    with pytest.raises(TypeError, match="x must"):
        ssd(**{**args, "x": np.zeros(3)})
    with pytest.raises(TypeError, match="B and C"):
        ssd(**{**args, "B": args["B"].astype(F16)})
    with pytest.raises(TypeError, match="mask must have dtype bool"):
        ssd(**args, mask=mx.ones((1, 4)))
    with pytest.raises(ValueError, match="chunk"):
        ssd(**args, chunk=0)
    with pytest.raises(ValueError, match="time_step_limit"):
        ssd(**args, time_step_limit=(1.0, 0.0))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_kind_check(dtype):
    """The tuner kind's synthetic inputs and its check: the composite passes against stock,
    a corrupted state fails."""
    from mlx_bricks.bricks.ssd.kind import SSD_KIND
    from mlx_bricks.runtime.kind import Act

    b, T, H, P, G, N = 1, 70, 4, 16, 2, 32
    args = {"x": Act((b, T, H, P), dtype), "dt": Act((b, T, H), dtype),
            "A_log": Act((H,), F32), "B": Act((b, T, G, N), dtype),
            "C": Act((b, T, G, N), dtype), "D": Act((H,), dtype), "dt_bias": Act((H,), dtype),
            "state": Act((b, H, P, N), F32), "time_step_limit": (0.0, INF)}
    synth = SSD_KIND.synthetic(args, seed=1)
    naive = SSD_KIND.stock(synth)
    (composite,) = SSD_KIND.variants("reference", dtype, synth)
    out = composite.run(synth, "reference")
    assert SSD_KIND.check(out, naive, synth).ok
    y, S = out
    assert not SSD_KIND.check((y, S + 1e-3 * mx.abs(S).max()), naive, synth).ok


# ---------------------------------------------------------------------------------------------
# the kernels: the MSL kernels (metal, emulator), their CUDA twins (cuda; tests/cuda_emu on the
# CPU). Chunks are 64 tokens (32 where P = 128: threadgroup memory), N walked in slices of 32
# (16 on Metal where the 64-token chunk needs it; 64 on the twin's tensor-core path)

KERNEL_CASES = [  # (b, T, H, P, G, N, dtype, state, D (True, False or F32), mask)
    (1, 1, 2, 8, 1, 8, F32, True, True, False),
    (1, 37, 4, 16, 2, 16, BF16, True, True, False),  # one partial chunk
    (2, 20, 2, 24, 1, 32, F16, False, False, True),  # padded batch
    (1, 150, 4, 12, 2, 40, F32, True, True, False),  # 3 chunks, N past a slice, P of 4s
    (1, 70, 2, 128, 1, 8, BF16, False, True, False),  # chunks of 32
    # the CUDA twin's tensor-core products (bf16, P and N multiples of 16): 3 chunks, N past a
    # slice, a state; a padded batch
    (1, 150, 4, 32, 2, 48, BF16, True, True, False),
    (2, 90, 2, 16, 1, 32, BF16, False, False, True),
    # Metal: step 1 on scalar tiles (N of 4s), step 3 on simdgroup matrices
    (1, 40, 2, 8, 1, 12, F16, True, True, False),
    # bf16 inputs with a float32 D: y in float32 (mlx-lm's x * D promotes; the twin's
    # tensor-core path writes OutT)
    (1, 80, 4, 16, 2, 32, BF16, True, F32, False),
]


def _kernel_check(run, case):
    b, T, H, P, G, N, dtype, state, D, masked = case
    args = inputs(b=b, T=T, H=H, P=P, G=G, N=N, dtype=dtype, state=state, D=D is not False,
                  seed=T)
    if D is F32:
        args["D"] = args["D"].astype(F32)
    mask = None
    if masked:
        m = np.ones((b, T), bool)
        m[1, :6] = False
        mask = mx.array(m)
    dtp, A = ssd_gates(args["dt"], args["A_log"], args["dt_bias"], mask)
    y, S = run(args, dtp, A, mask)
    y64, S64 = ssd64(**to64(args), mask=None if mask is None else np.array(mask))
    ny, nS = ssd_stock(**args, mask=mask)
    if mask is not None:
        keep = mx.array(np.array(mask)[:, :, None, None])
        y, ny = mx.where(keep, y, 0), mx.where(keep, ny, 0)
        y64 = np.where(np.array(mask)[:, :, None, None], y64, 0.0)
    assert S.dtype == F32 and S.shape == (b, H, P, N) and y.dtype == ny.dtype
    assert_dtype_close(y, y64, ny, dtype=dtype, ulps=64 if dtype == F32 else 4, what=f"{case} y")
    assert_dtype_close(S, S64, nS, dtype=F32, factor=4.0, ulps=64, what=f"{case} state")


@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel(kernel_backend, case):
    """The op on every backend (reference: the composite) against the float64 recurrence; on
    the kernel backends each of the three steps launched once (one segment)."""
    from mlx_bricks import kernels

    steps = ("ssd_chunk_state", "ssd_state_pass", "ssd_chunk_out")
    before = [kernels.LAUNCH_COUNTS[(k, kernel_backend)] for k in steps]
    _kernel_check(lambda a, dtp, A, m: ssd(**a, mask=m, backend=kernel_backend), case)
    launched = [kernels.LAUNCH_COUNTS[(k, kernel_backend)] - n for k, n in zip(steps, before)]
    assert launched == ([0, 0, 0] if kernel_backend == "reference" else [1, 1, 1])


def test_kernel_reasons():
    from mlx_bricks.bricks.ssd import msl

    a = inputs(T=4, N=4096)
    assert "accumulators" in msl.kernel_reason(a["x"], a["B"])
    a = inputs(T=4, P=4, N=4096)
    assert "threadgroup memory" in msl.kernel_reason(a["x"], a["B"])
    a = inputs(T=4, N=6)
    assert "multiples of 4" in msl.kernel_reason(a["x"], a["B"])
    a = inputs(T=4, P=10)
    assert "P 10" in msl.kernel_reason(a["x"], a["B"])
    y, _ = ssd(**a, backend="emulator")  # the op computes them anyway (the composite)
    assert y.shape == (1, 4, 4, 10)
    assert msl.tiles(128, 128, "cuda") == (32, 32) and msl.tiles(64, 128, "cuda") == (64, 32)


@pytest.mark.parametrize("segment", [None, 64])
@pytest.mark.parametrize("case", KERNEL_CASES[1:], ids=str)
def test_cuda_twin_emulated(case, segment, monkeypatch):
    """The CUDA twin on the CPU (tests/cuda_emu: the exact bodies, threads as OS threads); with
    a 64-token segment, the prompt in several launch sets, the state chained between them."""
    from tests import cuda_emu
    from mlx_bricks.bricks.ssd import cuda as ssd_cuda
    from mlx_bricks.bricks.ssd.op import run_kernel

    if cuda_emu.toolchain() is None:
        pytest.skip("no host C++ compiler or CUDA headers")
    if segment is not None:
        if case[1] <= segment:
            pytest.skip("one segment")
        monkeypatch.setattr(ssd_cuda.msl, "SEGMENT", segment)

    def run(args, dtp, A, mask):
        with cuda_emu.emulated_launches(ssd_cuda) as names:
            out = run_kernel(args["x"], dtp, A, args["B"], args["C"], args["D"],
                             args["state"], backend="cuda")
            mx.eval(out)
        n_seg = 1 if segment is None else -(-args["x"].shape[1] // segment)
        assert names == list(ssd_cuda.msl.KERNELS) * n_seg
        return out

    _kernel_check(run, case)


# the tensor-core cases (bf16, P and N multiples of 16) and the slices steps 1 and 3 take (step
# 1: the largest dividing the chunk; step 3: the fewest columns past N, then the largest) under
# MMA_SLICE_MAX (16, 16), (32, 32) and the default (64, 64)
MMA_SLICE_CASES = {
    KERNEL_CASES[1]: ((16, 16), (32, 16), (64, 16)),     # N 16
    KERNEL_CASES[5]: ((16, 16), (32, 16), (64, 48)),     # N 48
    KERNEL_CASES[6]: ((16, 16), (32, 32), (64, 32)),     # a padded batch
    KERNEL_CASES[8]: ((16, 16), (32, 32), (64, 32)),     # float32 D
    (1, 150, 2, 32, 1, 80, BF16, True, True, False): ((16, 16), (32, 16), (64, 16)),
    (1, 130, 2, 16, 1, 128, BF16, False, True, False): ((16, 16), (32, 32), (64, 64)),
    (1, 70, 2, 128, 1, 96, BF16, True, True, False): ((16, 16), (32, 32), (32, 48)),  # chunk 32
    (1, 45, 1, 128, 1, 128, BF16, True, True, False): ((16, 16), (32, 32), (32, 64)),  # 46 KB
    # chunks of 16, step 3's tensor-core slices too large: its scalar tiles (slice 16)
    (1, 40, 1, 496, 1, 16, BF16, True, True, False): ((16, 16), (16, 16), (16, 16)),
}


@pytest.mark.parametrize("which", range(3), ids=["max16", "max32", "default"])
@pytest.mark.parametrize("case", list(MMA_SLICE_CASES), ids=str)
def test_cuda_twin_mma_slices(case, which, monkeypatch):
    """The tensor-core steps with the slices msl.mma_slice picks (as launched) under three
    MMA_SLICE_MAX settings, against the float64 recurrence: 16 to 64 tokens in step 1, 16 to
    64 state columns in step 3 (the last slice partial where it does not divide N)."""
    from tests import cuda_emu
    from mlx_bricks.bricks.ssd import cuda as ssd_cuda
    from mlx_bricks.bricks.ssd.op import run_kernel

    if cuda_emu.toolchain() is None:
        pytest.skip("no host C++ compiler or CUDA headers")
    msl = ssd_cuda.msl
    if which < 2:
        top = (16, 32)[which]
        monkeypatch.setattr(msl, "MMA_SLICE_MAX", dict.fromkeys(msl.KERNELS[::2], top))
    launched = []

    def run(args, dtp, A, mask):
        with cuda_emu.emulated_launches(ssd_cuda):
            fake = ssd_cuda.launch

            def spy(name, backend, **kw):  # the slices the launches asked for
                launched.extend(v for k, v in kw["template"] if k == "KT")
                return fake(name, backend, **kw)

            ssd_cuda.launch = spy
            try:
                out = run_kernel(args["x"], dtp, A, args["B"], args["C"], args["D"],
                                 args["state"], backend="cuda")
                mx.eval(out)
            finally:
                ssd_cuda.launch = fake
        return out

    _kernel_check(run, case)
    assert launched == list(MMA_SLICE_CASES[case][which])


def test_mma_slices_fit():
    """Over every P, N (multiples of 16, P x N within MAX_STATE) the slices picked fit the
    48 KB a CUDA block gets and step 1's divide its chunk; up to P = 256 neither step is left
    without one (past it step 3's may not fit: scalar tiles)."""
    from mlx_bricks.bricks.ssd import msl

    for P in range(16, 1025, 16):
        for N in range(16, msl.MAX_STATE // P + 1, 16):
            t = msl.tiles(P, N, "cuda")
            if t is None:
                continue
            chunk = t[0]
            s1, s3 = (msl.mma_slice(P, N, chunk, "cuda", k) for k in msl.KERNELS[::2])
            assert P > 256 or (s1 is not None and s3 is not None), (P, N)
            if s1 is not None:
                assert chunk % s1 == 0, (P, N, s1)
                assert 4 * msl.mma_floats(P, N, chunk, s1)[0] <= 48 * 1024, (P, N, s1)
            if s3 is not None:
                assert 4 * msl.mma_floats(P, N, chunk, s3)[1] <= 48 * 1024, (P, N, s3)


def _shifted_inputs_bit_equal(case, shift):
    """The emulated twin on ``case`` as launched and with the inputs of ``shift`` (kernel name
    -> {input name: bytes past a 64-byte boundary}) moved, each against the float64
    recurrence (``_kernel_check``); the two runs' outputs bit-equal."""
    from tests import cuda_emu
    from mlx_bricks.bricks.ssd import cuda as ssd_cuda
    from mlx_bricks.bricks.ssd.op import run_kernel

    outs = []
    for offsets in (None, shift):
        def run(args, dtp, A, mask, offsets=offsets):
            with cuda_emu.emulated_launches(ssd_cuda, offsets=offsets):
                out = run_kernel(args["x"], dtp, A, args["B"], args["C"], args["D"],
                                 args["state"], backend="cuda")
                mx.eval(out)
            outs.append(out)
            return out
        _kernel_check(run, case)
    (y0, s0), (y1, s1) = outs
    assert mx.array_equal(y0, y1) and mx.array_equal(s0, s1)


@pytest.mark.parametrize("case", [KERNEL_CASES[1], KERNEL_CASES[3], KERNEL_CASES[6]], ids=str)
def test_state_pass_vec4(case, monkeypatch):
    """Step 2 with four state elements a thread (msl.STATE_VEC) on the MSL emulator and the
    CUDA twin (emulated), against the float64 recurrence; the twin's element-wise fallback
    (dS 4 bytes past a 16-byte boundary, under ASan + UBSan) bit-equal to its 16-byte path."""
    from tests import cuda_emu
    from mlx_bricks.bricks.ssd import cuda as ssd_cuda

    monkeypatch.setattr(ssd_cuda.msl, "STATE_VEC", {"cuda": 4, "emulator": 4, "metal": 4})
    _kernel_check(lambda a, dtp, A, m: ssd(**a, mask=m, backend="emulator"), case)
    if cuda_emu.toolchain() is None:
        pytest.skip("no host C++ compiler or CUDA headers")
    monkeypatch.setenv("MLX_BRICKS_CUDA_EMU_SANITIZE", "1")
    _shifted_inputs_bit_equal(case, {"ssd_state_pass": {"dS": 4}})


def test_cuda_twin_unaligned_rows(monkeypatch):
    """The tensor-core steps' 16-byte row loads where x, B and C start 2 bytes past a 16-byte
    boundary, and S0 4 bytes past one (the element-wise fallbacks), give the aligned run's
    outputs bit for bit; under ASan + UBSan, so a vector load on a misaligned row fails."""
    from tests import cuda_emu

    if cuda_emu.toolchain() is None:
        pytest.skip("no host C++ compiler or CUDA headers")
    monkeypatch.setenv("MLX_BRICKS_CUDA_EMU_SANITIZE", "1")
    case = (1, 150, 4, 32, 2, 48, BF16, True, True, False)  # 3 chunks, N past a slice
    shift = {"ssd_chunk_state": {"x": 2, "Bm": 2},
             "ssd_chunk_out": {"x": 2, "Bm": 2, "Cm": 2, "S0": 4}}
    _shifted_inputs_bit_equal(case, shift)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_cuda_twin_compiles(dtype):
    """The twin's three steps compile with nvcc for sm_80, sm_90a and sm_120 as MLX would
    build them (Nemotron-3's shapes: 64 heads of 64, 8 groups, N = 128; a head dim of 128; a
    small shape whose tensor-core branch has no whole unit but is compiled), in registers (no
    local memory), their shared memory within the 48 KB a block gets without opting in."""
    from mlx_bricks import cudacheck
    from mlx_bricks.bricks.ssd import cuda as ssd_cuda
    from mlx_bricks.bricks.ssd.op import run_kernel

    if cudacheck.find_nvcc() is None:
        pytest.skip("nvcc not found")
    for b, T, H, P, G, N in ((1, 64, 64, 64, 8, 128), (1, 64, 8, 128, 1, 128),
                             (1, 16, 2, 8, 1, 8)):
        x, Bm = mx.zeros((b, T, H, P), dtype), mx.zeros((b, T, G, N), dtype)
        dtp, A = mx.zeros((b, T, H)), mx.zeros((H,))
        with cudacheck.recorded_launches(ssd_cuda) as rec:
            run_kernel(x, dtp, A, Bm, Bm, mx.ones((H,), dtype), backend="cuda")
        assert [r.name for r in rec] == list(ssd_cuda.msl.KERNELS)
        for r in rec:
            for arch in ("sm_80", "sm_90a", "sm_120"):
                res = r.compile(arch)
                assert res.stack == 0 and res.spill_stores == 0 and res.spill_loads == 0, \
                    (r.name, res)
                assert res.registers * r.threadgroup[0] <= 65536, (r.name, res)
            assert r.shared_memory <= 48 * 1024, r.name
            if cudacheck.find_nvrtc() is not None:  # what MLX compiles with
                cudacheck.compile_source_nvrtc(r.source())
