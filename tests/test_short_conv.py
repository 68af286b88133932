"""Short-conv brick: causal depthwise short convolutions with state against float64 numpy.

The reference forms the convolution's input in the input dtype (``gate_in * x``, rounded as
mlx-lm's product; it is also the next conv state, which must be bit-equal to mlx-lm's) and the
rest in float64; the naive same-dtype comparison is mlx-lm's own ops (``nn.Conv1d`` with
``groups=channels`` on the concatenated state) with the dtype-scaled rule of tests/tolerance.py.
"""
import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks.short_conv.op import short_conv, short_conv_stock
from tests.tolerance import assert_dtype_close

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32


def conv64(x, weight, bias=None, state=None, mask=None, gate_in=None, gate_out=None,
           activation=None, lengths=None):
    """y (float64) and the next state (x's dtype) of the op, from mx arrays."""
    u = x if gate_in is None else gate_in * x  # rounded in x's dtype, as every path forms it
    if mask is not None:
        u = mx.where(mask[..., None], u, mx.zeros((), u.dtype))
    b, T, C = x.shape
    w = np.array(weight.astype(F32)).reshape(C, -1).astype(np.float64)
    K = w.shape[1]
    s = np.zeros((b, K - 1, C)) if state is None else np.array(state.astype(F32), np.float64)
    padded = np.concatenate([s, np.array(u.astype(F32), np.float64)], axis=1)
    y = sum(padded[:, k:k + T] * w[:, k] for k in range(K))
    if bias is not None:
        y = y + np.array(bias.astype(F32), np.float64)
    if activation == "silu":
        y = y / (1 + np.exp(-y))
    if gate_out is not None:
        y = y * np.array(gate_out.astype(F32), np.float64)
    ends = np.full(b, T) if lengths is None else np.clip(np.array(lengths), 0, T)
    nxt = np.stack([padded[i, e:e + K - 1] for i, e in enumerate(ends)])
    return y, mx.array(nxt.astype(np.float32)).astype(x.dtype)


def inputs(b=1, T=40, C=24, K=4, dtype=F32, *, gates=False, bias=False, state=True,
           activation=None, seed=0):
    rng = np.random.default_rng(seed)
    a = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)  # noqa
    return dict(x=a(b, T, C), weight=a(C, K, 1), bias=a(C) if bias else None,
                state=a(b, K - 1, C) if state else None, gate_in=a(b, T, C) if gates else None,
                gate_out=a(b, T, C) if gates else None, activation=activation)


def check(args, *, mask=None, lengths=None, backend="reference", what=""):
    y, S = short_conv(**args, mask=mask, lengths=lengths, backend=backend)
    y64, S64 = conv64(**args, mask=mask, lengths=lengths)
    ny, nS = short_conv_stock(**args, mask=mask, lengths=lengths)
    dtype = args["x"].dtype
    assert y.dtype == dtype and S.dtype == dtype and S.shape == S64.shape
    assert mx.array_equal(S, S64) and mx.array_equal(nS, S64), f"{what}: state"
    assert_dtype_close(y, y64, ny, dtype=dtype, what=f"{what} y")


@pytest.mark.parametrize("T", [1, 7, 33, 100])
def test_lengths(T):
    check(inputs(T=T), what=f"T={T}")


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("K", [2, 3, 4])
def test_dtypes_and_taps(dtype, K):
    check(inputs(T=37, K=K, dtype=dtype, gates=K == 3, bias=K == 4,
                 activation="silu" if K == 2 else None), what=f"{dtype} K={K}")


def test_lfm2_gates_and_mamba_silu():
    """LFM2's ShortConv (B * x in, C * y out, no activation) and a Mamba-2 mixer's conv (bias,
    SiLU, no gates), without a state (mlx-lm pads zeros)."""
    check(inputs(T=20, gates=True, state=False, dtype=BF16), what="lfm2")
    check(inputs(T=20, bias=True, activation="silu", dtype=BF16), what="mamba")


def test_mask_and_lengths():
    """A left-padded batch (mask) and a right-padded one (lengths: the state is taken before
    each row's length; a length 0 keeps the old state, one past T the last inputs)."""
    mask = np.ones((3, 12), bool)
    mask[1, :5] = False
    mask[2, :11] = False
    check(inputs(b=3, T=12, gates=True), mask=mx.array(mask), what="mask")
    check(inputs(b=3, T=12), lengths=mx.array([12, 4, 0]), what="lengths")
    check(inputs(b=2, T=12, K=3), lengths=mx.array([1, 30]), what="lengths out of range")


def test_two_prefills_equal_one():
    args = inputs(T=50, gates=True)
    y, S = short_conv(**args)
    cut = lambda s: {n: a[:, s] if n in ("x", "gate_in", "gate_out") else a  # noqa: E731
                     for n, a in args.items()}
    y1, S1 = short_conv(**cut(slice(0, 23)))
    y2, S2 = short_conv(**{**cut(slice(23, None)), "state": S1})
    assert mx.array_equal(mx.concatenate([y1, y2], 1), y) and mx.array_equal(S2, S)


def test_bad_arguments():
    args = inputs(T=4, gates=True)
    with pytest.raises(ValueError, match="weight must"):
        short_conv(**{**args, "weight": mx.zeros((3, 4))})
    with pytest.raises(ValueError, match="state must"):
        short_conv(**{**args, "state": args["state"][:, :1]})
    with pytest.raises(TypeError, match="gate_in must have dtype float32"):
        short_conv(**{**args, "gate_in": args["gate_in"].astype(F16)})
    with pytest.raises(ValueError, match="gate_out must"):
        short_conv(**{**args, "gate_out": args["gate_out"][:, :2]})
    with pytest.raises(TypeError, match="x must"):
        short_conv(**{**args, "x": np.zeros(3)})
    with pytest.raises(TypeError, match="mask must have dtype bool"):
        short_conv(**args, mask=mx.ones((1, 4)))
    with pytest.raises(TypeError, match="lengths must be integer"):
        short_conv(**args, lengths=mx.ones((1,)))
    with pytest.raises(ValueError, match="activation"):
        short_conv(**{**args, "activation": "gelu"})


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_kind_check(dtype):
    """The tuner kind's synthetic inputs and its check: the composite passes, a changed state
    fails (it must be a copy)."""
    from mlx_bricks.bricks.short_conv.kind import SHORT_CONV
    from mlx_bricks.runtime.kind import Act

    b, T, C, K = 1, 40, 32, 3
    args = {"x": Act((b, T, C), dtype), "weight": mx.random.normal((C, K, 1)).astype(dtype),
            "state": Act((b, K - 1, C), dtype), "gate_in": Act((b, T, C), dtype),
            "gate_out": Act((b, T, C), dtype)}
    synth = SHORT_CONV.synthetic(args, seed=1)
    naive = SHORT_CONV.stock(synth)
    (composite,) = SHORT_CONV.variants("reference", dtype, synth)
    y, S = composite.run(synth, "reference")
    assert SHORT_CONV.check((y, S), naive, synth).ok
    assert not SHORT_CONV.check((y, S * 1.01), naive, synth).ok


# ---------------------------------------------------------------------------------------------
# the kernels: the MSL kernel (metal, emulator), its CUDA twin (cuda; tests/cuda_emu on the CPU)

KERNEL_CASES = [  # (b, T, C, K, dtype, gates, bias, activation, state, mask, lengths)
    (1, 37, 40, 4, BF16, False, True, "silu", True, False, False),
    (2, 20, 16, 3, F32, True, False, None, True, True, True),
    (1, 1, 8, 2, F16, True, False, None, False, False, False),
]


def _case_args(case):
    b, T, C, K, dtype, gates, bias, act, state, masked, lengths = case
    args = inputs(b=b, T=T, C=C, K=K, dtype=dtype, gates=gates, bias=bias, state=state,
                  activation=act, seed=T)
    mask = lens = None
    if masked:
        m = np.ones((b, T), bool)
        m[1, :6] = False
        mask = mx.array(m)
    if lengths:
        lens = mx.array([T, 5][:b])
    return args, mask, lens


@pytest.mark.parametrize("case", KERNEL_CASES, ids=str)
def test_kernel(kernel_backend, case):
    args, mask, lens = _case_args(case)
    check(args, mask=mask, lengths=lens, backend=kernel_backend, what=str(case))


def _view_args(dtype=BF16, b=2, T=21, C=40, K=3):
    """LFM2's layout: x and both gates the column blocks of one in-projection output (views,
    row stride 3 C), the state a slice of a wider array, the taps a (C, K, 1) weight."""
    rng = np.random.default_rng(5)
    a = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)  # noqa
    Bg, Cg, x = mx.split(a(b, T, 3 * C), 3, axis=-1)
    state = a(b, K + 1, C)[:, 2:]
    return dict(x=x, weight=a(C, K, 1), bias=None, state=state, gate_in=Bg, gate_out=Cg,
                activation=None)


def _mixed_layouts(dtype=BF16, b=2, T=19, C=24, K=8):
    """Every input in a layout of its own: gate_in transposed, gate_out broadcast over the
    batch (stride 0), the taps transposed, the bias every other element, the state
    transposed; a mask and lengths."""
    rng = np.random.default_rng(7)
    a = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)  # noqa
    m = np.ones((b, T), bool)
    m[-1, :4] = False
    args = dict(x=a(b, T, C), weight=a(K, C).T[..., None], bias=a(2 * C)[::2],
                state=a(b, C, K - 1).transpose(0, 2, 1),
                gate_in=a(T, b, C).transpose(1, 0, 2),
                gate_out=mx.broadcast_to(a(1, T, C), (b, T, C)), activation="silu")
    return args, mx.array(m), mx.array([T, 7][:b])


def test_kernel_reads_views(kernel_backend):
    check(_view_args(), backend=kernel_backend, what="views")
    check(_view_args(F32, b=1, T=5, C=8, K=4), lengths=mx.array([3]), backend=kernel_backend,
          what="views, lengths")
    args, mask, lens = _mixed_layouts()
    check(args, mask=mask, lengths=lens, backend=kernel_backend, what="mixed layouts")


def test_cuda_twin_emulated_reads_views():
    """The twin on the CPU with the views passed as MLX passes them (their own strides)."""
    from tests import cuda_emu
    from mlx_bricks.bricks.short_conv import cuda as conv_cuda
    from mlx_bricks.bricks.short_conv.op import run_kernel

    if cuda_emu.toolchain() is None:
        pytest.skip("no host C++ compiler or CUDA headers")
    order = ("x", "weight", "bias", "state", "mask", "gate_in", "gate_out", "activation",
             "lengths")
    args, mask, lens = _mixed_layouts()
    for what, a in (("views", _view_args()),
                    ("mixed layouts", dict(args, mask=mask, lengths=lens))):
        with cuda_emu.emulated_launches(conv_cuda):
            y, S = run_kernel(*(a.get(n) for n in order), backend="cuda")
            mx.eval(y, S)
        y64, S64 = conv64(**a)
        assert mx.array_equal(S, S64), what
        assert_dtype_close(y, y64, short_conv_stock(**a)[0], dtype=BF16, what=what)


def test_grid_limits_fall_back():
    from mlx_bricks.bricks.short_conv import msl

    w = mx.zeros((8, 3, 1))
    assert msl.kernel_reason(w, (1, 16 * 65535, 8)) is None
    assert "grid" in msl.kernel_reason(w, (1, 16 * 65535 + 1, 8))
    assert "grid" in msl.kernel_reason(w, (65536, 4, 8))


def test_kernel_reason_and_fallback():
    from mlx_bricks.bricks.short_conv import msl

    args = inputs(T=9, K=9)
    assert "K 9" in msl.kernel_reason(args["weight"])
    check(args, backend="emulator", what="K=9 composite")


@pytest.mark.parametrize("case", KERNEL_CASES[:2], ids=str)
def test_cuda_twin_emulated(case):
    """The CUDA twin on the CPU (tests/cuda_emu: the exact body, threads as OS threads)."""
    from tests import cuda_emu
    from mlx_bricks.bricks.short_conv import cuda as conv_cuda
    from mlx_bricks.bricks.short_conv.op import run_kernel

    if cuda_emu.toolchain() is None:
        pytest.skip("no host C++ compiler or CUDA headers")
    args, mask, lens = _case_args(case)
    a = dict(args, mask=mask, lengths=lens)
    order = ("x", "weight", "bias", "state", "mask", "gate_in", "gate_out", "activation",
             "lengths")
    with cuda_emu.emulated_launches(conv_cuda) as names:
        y, S = run_kernel(*(a[n] for n in order), backend="cuda")
        mx.eval(y, S)
    assert names == ["short_conv"]
    y64, S64 = conv64(**a)
    ny, _ = short_conv_stock(**a)
    assert mx.array_equal(S, S64)
    assert_dtype_close(y, y64, ny, dtype=args["x"].dtype, what=str(case))


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_cuda_twin_compiles(dtype):
    """The twin compiles with nvcc for sm_80, sm_90a and sm_120 (LFM2's conv: 2,048 channels,
    3 taps, both gates; a Mamba-2 conv: bias and SiLU), in registers."""
    from mlx_bricks import cudacheck
    from mlx_bricks.bricks.short_conv import cuda as conv_cuda
    from mlx_bricks.bricks.short_conv.op import run_kernel

    if cudacheck.find_nvcc() is None:
        pytest.skip("nvcc not found")
    x = mx.zeros((1, 64, 2048), dtype)
    with cudacheck.recorded_launches(conv_cuda) as rec:
        run_kernel(x, mx.zeros((2048, 3, 1), dtype), None, None, None, x, x, None, None,
                   backend="cuda")
        run_kernel(x, mx.zeros((2048, 4, 1), dtype), mx.zeros((2048,), dtype), None,
                   mx.ones((1, 64), mx.bool_), None, None, "silu", None, backend="cuda")
    assert [r.name for r in rec] == ["short_conv"] * 2
    for r in rec:
        for arch in ("sm_80", "sm_90a", "sm_120"):
            res = r.compile(arch)
            assert res.stack == 0 and res.spill_stores == 0 and res.spill_loads == 0, res
        if cudacheck.find_nvrtc() is not None:
            cudacheck.compile_source_nvrtc(r.source())


def test_cuda_twin_under_the_sanitizers(monkeypatch):
    """The CUDA emulation under ASan + UBSan (tests/cuda_emu ``MLX_BRICKS_CUDA_EMU_SANITIZE``,
    the kernel review's bounds check of the twins, which the plain build lacks): a ragged case
    (130 channels: a partial block; lengths and mask) runs clean, and the same body with its
    store moved one row down (the last run writes past y) fails the run."""
    from tests import cuda_emu
    from mlx_bricks.bricks.short_conv import cuda as conv_cuda
    from mlx_bricks.bricks.short_conv.op import run_kernel

    if cuda_emu.toolchain() is None:
        pytest.skip("no host C++ compiler or CUDA headers")
    monkeypatch.setenv("MLX_BRICKS_CUDA_EMU_SANITIZE", "1")
    a = inputs(b=2, T=33, C=130, K=4, dtype=BF16, gates=True, bias=True, activation="silu",
               seed=33)
    m = np.ones((2, 33), bool)
    m[1, :6] = False
    a.update(mask=mx.array(m), lengths=mx.array([33, 5]))
    order = ("x", "weight", "bias", "state", "mask", "gate_in", "gate_out", "activation",
             "lengths")

    def run():
        with cuda_emu.emulated_launches(conv_cuda):
            out = run_kernel(*(a[n] for n in order), backend="cuda")
            mx.eval(out)
        return out

    y, S = run()
    assert mx.array_equal(S, conv64(**a)[1])
    generic = cuda_emu._generic_source

    def shifted(*args):
        src = generic(*args)
        assert src.count("y[iy] = ") == 1
        return src.replace("y[iy] = ", "y[iy + CH] = ")

    monkeypatch.setattr(cuda_emu, "_generic_source", shifted)
    with pytest.raises(RuntimeError, match="AddressSanitizer"):
        run()
