"""MLX's microscaling weight formats (``mxfp4``, ``nvfp4``, ``mxfp8``; ``formats/microscaling.py``)
through the bricks' composites: "dequantize the weight in row tiles under the cap, then the float
computation" (``bricks/dequantize/composite.py``, ``bricks/moe/composite.py``).

* the format: ``MicroscaledWeight.dequantize`` against float64 numpy decoding the packed bits
  (E2M1 / E4M3 elements, E8M0 / E4M3 scales, nvfp4's per-expert global scale), its key, stock
  and checks; no kernel lists it, the kernel ops refuse it with the argument's name;
* the linear, SwiGLU and MoE composites for every mode, odd shapes, float16 / bfloat16 /
  float32, with the default cap and a cap small enough for several tiles: float64 numpy of the
  decoded weights is the reference, stock MLX (``quantized_matmul`` / ``gather_qmm``) the
  same-dtype side of the tolerance rule (tests/tolerance.py);
* the patch: tiny llama models quantized with ``nn.quantize(mode=...)`` and a tiny gpt_oss with
  mxfp4 experts (``QuantizedSwitchLinear``, SwigluOAI with biases), patched where no kernel
  backend exists (the composites tuned against stock) and on ``reference``, against stock
  mlx-lm and a float64 clone of the decoded weights.
"""
from __future__ import annotations

import importlib
import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_bricks.bricks.dequantize import composite
from mlx_bricks.cpu import on_cpu
from mlx_bricks.bricks.gemm.kind import LINEAR
from mlx_bricks.bricks.gemm.op import linear
from mlx_bricks.bricks.moe.kind import MOE_MLP
from mlx_bricks.bricks.moe.op import SORT_THRESHOLD, moe_mlp, moe_mlp_reference
from mlx_bricks.bricks.norm_qkv.kind import RMS_NORM_QKV
from mlx_bricks.bricks.swiglu.kind import SWIGLU_MLP
from mlx_bricks.formats import format_of
from mlx_bricks.formats.affine import QuantizedWeight
from mlx_bricks.formats.microscaling import MODES, MicroscaledWeight
from mlx_bricks.patch import patch_model
from tests.quant_support import (
    DTYPES,
    dequant64,
    even_tiles,
    microscaled,
    mlp_case,
    product,
    randn,
    silu64,
    weight,
)
from tests.tolerance import assert_dtype_close, to_f64

MICRO = tuple(MODES)
SMALL_CAP = 40 << 10
Q4 = (4, 64)


pytestmark = pytest.mark.usefixtures("fresh_home")


def _composites(kind, args, backend="reference", cap=None, blas=False):
    """The kind's candidates on ``backend``: the ``mx.dequantize`` composites (and kernels), or
    with ``blas`` only their NumPy-BLAS twins (where MLX runs on the CPU)."""
    settings = {} if cap is None else {composite.CAP_SETTING: cap}
    out = kind.variants(backend, args=args, names=kind.listing(backend, kind.dtype(args), args),
                        settings=settings)
    return [v for v in out if v.name.startswith("blas") == blas]


# ---- the format -----------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MICRO)
@pytest.mark.parametrize("shape", [(40, 96), (3, 24, 160)])
def test_dequantize_is_the_decoded_bits(mode, shape):
    q = microscaled(shape, mode, mx.float32, sum(shape))
    q.check("w", ndim=len(shape))
    ref = dequant64(q)
    assert q.shape == shape and ref.shape == shape
    np.testing.assert_array_equal(to_f64(q.dequantize()), ref)  # exact in float32
    for dt in (mx.float16, mx.bfloat16):
        got = q.dequantize(dt)
        assert got.dtype == dt
        np.testing.assert_array_equal(to_f64(got), to_f64(mx.array(ref, mx.float32).astype(dt)))


def test_nvfp4_global_scale_per_expert():
    q = microscaled((4, 32, 64), "nvfp4", mx.float32, 3, global_scale=True)
    q.check("w", ndim=3)
    ref = dequant64(q)
    got = to_f64(q.dequantize())
    assert np.abs(got - ref).max() <= 2 ** -22 * np.abs(ref).max()
    # MLX's own scalar-global-scale dequantize, expert by expert
    for e in range(4):
        one = mx.dequantize(q.w[e], q.scales[e], mode="nvfp4", global_scale=q.global_scale[e],
                            dtype=mx.float32)
        assert np.abs(to_f64(one) - ref[e]).max() <= 2 ** -22 * np.abs(ref).max()


@pytest.mark.parametrize("mode", MICRO)
def test_format_key_stock_and_no_kernel(mode):
    q = microscaled((48, 64), mode, mx.float16, 1)
    f = format_of(q)
    assert (f.key, str(f), f.quantized, f.microscaled, f.kernels) == (
        mode, f"{mode} gs{MODES[mode].group_size}", True, True, False)
    x = randn((5, 64), mx.float16, 2)
    assert mx.array_equal(f.matmul_t(x, q), product(x, q)).item()
    with pytest.raises(ValueError, match=f"no kernel reads {mode} weights"):
        f.msl_inputs(q)
    args = {"x": x, "weight": q, "bias": None, "residual": None}
    for backend in ("emulator", "cuda", "metal"):
        assert LINEAR.listing(backend, mx.float16, args) == ()
    # the composites: mx.dequantize only (the dequantize brick reads MLX affine)
    assert [v.name for v in LINEAR.variants("emulator", args=args, names=())
            if not v.name.startswith("blas")] == ["dequant"]
    with pytest.raises(ValueError, match=f"weight is {mode}: the kernels read float and MLX "
                                         "affine"):
        linear(x, q, backend="reference")


@pytest.mark.parametrize("field,make,err,message", [
    ("scales", lambda q: MicroscaledWeight(q.w, q.scales.astype(mx.float16), q.mode), TypeError,
     "w.scales must be uint8"),
    ("w", lambda q: MicroscaledWeight(q.w[:, :4], q.scales, q.mode), ValueError,
     "w.scales must have shape"),
    ("mode", lambda q: MicroscaledWeight(q.w, q.scales, "fp4"), ValueError,
     "w.mode must be one of"),
    ("global_scale", lambda q: MicroscaledWeight(q.w, q.scales, q.mode, mx.ones((1,))),
     ValueError, "w.global_scale applies to nvfp4 expert weights only"),
])
def test_check_names_the_field(field, make, err, message):
    q = make(microscaled((16, 64), "mxfp4", mx.float32, 0))
    with pytest.raises(err, match=message):
        q.check("w")


def test_check_k():
    q = microscaled((16, 64), "nvfp4", mx.float32, 0)
    with pytest.raises(ValueError, match="i.e. K=64 at 4 bits; expected K=96"):
        q.check("w", K=96)


# ---- linear ---------------------------------------------------------------------------------

LINEAR_CASES = [  # B, L, K, N, mode, dtype, bias, residual
    (1, 7, 96, 200, "mxfp4", "float16", True, True),
    (2, 5, 160, 72, "nvfp4", "bfloat16", False, True),
    (1, 9, 64, 130, "mxfp8", "float32", True, False),
    (1, 3, 48, 40, "nvfp4", "float16", False, False),
    (1, 6, 128, 96, "mxfp8", "bfloat16", True, False),
    (3, 2, 96, 33, "mxfp4", "float32", False, True),
]


@pytest.mark.parametrize("cap", [None, SMALL_CAP])
@pytest.mark.parametrize("B,L,K,N,mode,dtype,bias,residual", LINEAR_CASES)
def test_linear_composite(cap, B, L, K, N, mode, dtype, bias, residual):
    dt = DTYPES[dtype]
    s = B + L + K + N
    x = randn((B, L, K), dt, s)
    w = weight(N, K, mode, dt, s + 1)
    b = randn((N,), dt, s + 2) if bias else None
    r = randn((B, L, N), dt, s + 3) if residual else None
    ref, naive = to_f64(x) @ dequant64(w).T, product(x, w)
    if bias:
        ref, naive = ref + to_f64(b), naive + b
    if residual:
        ref, naive = ref + to_f64(r), r + naive
    args = {"x": x, "weight": w, "bias": b, "residual": r}
    assert_dtype_close(LINEAR.stock(args), ref, naive, dtype=dt, factor=1.0, what="stock")
    (v,) = _composites(LINEAR, args, "reference", cap)
    out = v.run(args, "reference")
    assert out.dtype == dt and out.shape == (B, L, N)
    assert_dtype_close(out, ref, naive, dtype=dt, what=f"linear {mode} {dtype} cap={cap}")


def test_tiles_of_a_microscaled_weight_stay_under_the_cap(monkeypatch):
    tiles = []
    d = composite.DEQUANTIZERS["mx"]

    def fn(q, dtype, backend):
        tiles.append((q.shape[0], q.mode))
        return d.fn(q, dtype, backend)

    monkeypatch.setitem(composite.DEQUANTIZERS, "mx", composite.Dequantizer(fn, d.peak))
    x = randn((1, 5, 256), mx.float16, 0)
    N = 301
    args = {"x": x, "weight": weight(N, 256, "mxfp4", mx.float16, 1), "bias": None,
            "residual": None}
    cap = 70 << 10
    (v,) = _composites(LINEAR, args, "reference", cap)
    mx.eval(v.run(args, "reference"))
    rows = int(cap // (256 * d.peak(4, mx.float16, "mxfp4")))
    assert rows * 256 * d.peak(4, mx.float16, "mxfp4") <= cap and N // rows >= 3
    assert tiles == [(r, "mxfp4") for r in even_tiles(N, rows)]
    assert max(r for r, _ in tiles) - min(r for r, _ in tiles) <= 1


@pytest.mark.parametrize("mode", MICRO)
def test_cpu_peak_memory_stays_under_the_cap(mode):
    """On the CPU the tiled mx.dequantize + GEMM of a microscaled weight holds at most the cap
    (the output aside): the per-mode peak bytes of ``MX_CPU_BYTES_MICRO`` hold."""
    dt = mx.bfloat16
    x = randn((16, 1024), dt, 0)
    w = weight(4096, 1024, mode, dt, 1)
    args = {"x": x, "weight": w, "bias": None, "residual": None}
    mx.eval(x, w.w, w.scales)
    cap = 1 << 20
    with mx.stream(mx.cpu):
        (v,) = _composites(LINEAR, args, "reference", cap)
        mx.eval(v.run(args, "reference"))
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        y = v.run(args, "reference")
        mx.eval(y)
        peak = mx.get_peak_memory() - base
    assert peak <= cap + 2 * y.nbytes, peak / cap


# ---- RMSNorm + QKV and SwiGLU ---------------------------------------------------------------

def test_rms_norm_qkv_composite_mixed_formats():
    dt, B, L, K, H, Hkv, hd, eps = mx.bfloat16, 1, 6, 128, 2, 1, 32, 1e-5
    x = randn((B, L, K), dt, 0)
    nw = randn((K,), dt, 1, scale=0.3) + 1.0
    ws = [weight(H * hd, K, "mxfp4", dt, 2), weight(Hkv * hd, K, "nvfp4", dt, 3),
          weight(Hkv * hd, K, Q4, dt, 4)]
    x64 = to_f64(x)
    h64 = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps) * to_f64(nw)
    h = mx.fast.rms_norm(x, nw, eps)
    args = {"x": x, "norm_weight": nw, "eps": eps, "wq": ws[0], "wk": ws[1], "wv": ws[2],
            "bq": None, "bk": None, "bv": None, "n_heads": H, "n_kv_heads": Hkv, "head_dim": hd}
    assert RMS_NORM_QKV.listing("emulator", dt, args) == ()
    (v,) = _composites(RMS_NORM_QKV, args, "emulator", SMALL_CAP)
    for o, w, n in zip(v.run(args, "emulator"), ws, (H, Hkv, Hkv)):
        ref = (h64 @ dequant64(w).T).reshape(B, L, n, hd).transpose(0, 2, 1, 3)
        naive = product(h, w).reshape(B, L, n, hd).transpose(0, 2, 1, 3)
        assert_dtype_close(o, ref, naive, dtype=dt, what=f"qkv {format_of(w)}")


MLP_CASES = [  # M, K, F, (gate, up, down formats), dtype, bias, residual
    (7, 128, 96, ("mxfp4", "mxfp4", "mxfp4"), "bfloat16", True, True),
    (9, 64, 160, ("nvfp4", "nvfp4", "mxfp8"), "float16", False, True),
    (5, 96, 64, ("mxfp8", "mxfp8", "mxfp8"), "float32", True, False),
    (6, 64, 96, ("mxfp4", Q4, None), "bfloat16", False, False),  # gate and up differ: split
]


@pytest.mark.parametrize("cap", [None, SMALL_CAP])
@pytest.mark.parametrize("M,K,F,fmts,dtype,bias,residual", MLP_CASES)
def test_swiglu_mlp_composites(cap, M, K, F, fmts, dtype, bias, residual):
    args, ref, naive, dt = mlp_case(M, K, F, fmts, dtype, bias, residual)
    wg, wu = args["w_gate"], args["w_up"]
    assert SWIGLU_MLP.listing("emulator", dt, args) == ()
    cands = _composites(SWIGLU_MLP, args, "emulator", cap)
    same = format_of(wg) == format_of(wu)
    assert [v.name for v in cands] == (["dequant_fused"] if same else []) + ["dequant_split"]
    blas = _composites(SWIGLU_MLP, args, "emulator", cap, blas=True)  # the CPU's BLAS twins
    assert [v.name for v in blas] == ([f"blas_{v.name[8:]}" for v in cands] if on_cpu() else [])
    for v in cands + blas:
        out = v.run(args, "emulator")
        assert out.dtype == dt and out.shape == (M, K)
        assert_dtype_close(out, ref, naive, dtype=dt, what=f"mlp {fmts} {v.name} cap={cap}")


# ---- MoE ------------------------------------------------------------------------------------

def _oai64(g, u, alpha=1.702, limit=7.0):
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))


MOE_CASES = [  # tokens, E, k, D, N, mode, dtype, activation, bias
    (13, 5, 2, 64, 96, "mxfp4", "bfloat16", "swiglu_oai", True),  # 26 rows: unsorted
    (40, 4, 2, 96, 64, "mxfp4", "float16", "swiglu_oai", True),  # 80 rows: sorted
    (37, 6, 3, 64, 48, "nvfp4", "float32", "silu", False),
    (33, 3, 2, 64, 32, "mxfp8", "bfloat16", "silu", True),
]
# both of SwitchGLU's paths: unsorted rows (below the threshold) and sorted
assert {c[0] * c[2] >= SORT_THRESHOLD for c in MOE_CASES} == {False, True}


def _experts(shape, mode, dt, seed, global_scale):
    """Stacked experts: microscaled (``mode`` a name) or MLX affine (``mode`` (bits, gs))."""
    if isinstance(mode, str):
        return microscaled(shape, mode, dt, seed, global_scale=global_scale)
    w = randn(shape, dt, seed, scale=1.0 / math.sqrt(shape[-1]))
    return QuantizedWeight(*mx.quantize(w, bits=mode[0], group_size=mode[1]), mode[1], mode[0])


def _moe_case(tokens, E, k, D, N, mode, dt, activation, bias, seed, global_scale=False):
    x = randn((1, tokens, D), dt, seed)
    rng = np.random.default_rng(seed)
    idx = mx.array(np.stack([rng.choice(E, k, replace=False) for _ in range(tokens)])
                   .reshape(1, tokens, k).astype(np.int32))
    wg = _experts((E, N, D), mode, dt, seed + 1, global_scale)
    wu = _experts((E, N, D), mode, dt, seed + 2, global_scale)
    wd = _experts((E, D, N), mode, dt, seed + 3, global_scale)
    bs = ((randn((E, N), dt, seed + 4, 0.1), randn((E, N), dt, seed + 5, 0.1),
           randn((E, D), dt, seed + 6, 0.1)) if bias else (None, None, None))
    args = {"x": x, "indices": idx, "w_gate": wg, "w_up": wu, "w_down": wd,
            "b_gate": bs[0], "b_up": bs[1], "b_down": bs[2]}
    if activation != "silu":
        args["activation"] = activation
    # float64: every (token, slot) row through its expert's decoded weights
    x64, flat = to_f64(x).reshape(tokens, D), np.array(idx).reshape(tokens, k)
    g64, u64, d64 = dequant64(wg), dequant64(wu), dequant64(wd)
    ref = np.zeros((tokens, k, D))
    for t in range(tokens):
        for s in range(k):
            e = flat[t, s]
            g, u = g64[e] @ x64[t], u64[e] @ x64[t]
            if bias:
                g, u = g + to_f64(bs[0])[e], u + to_f64(bs[1])[e]
            a = _oai64(g, u) if activation == "swiglu_oai" else silu64(g) * u
            y = d64[e] @ a
            ref[t, s] = y + to_f64(bs[2])[e] if bias else y
    return args, ref.reshape(1, tokens, k, D)


@pytest.mark.parametrize("cap", [None, SMALL_CAP])
@pytest.mark.parametrize("tokens,E,k,D,N,mode,dtype,activation,bias", MOE_CASES)
def test_moe_composite(cap, tokens, E, k, D, N, mode, dtype, activation, bias):
    dt = DTYPES[dtype]
    args, ref = _moe_case(tokens, E, k, D, N, mode, dt, activation, bias, tokens + E + D)
    naive = MOE_MLP.stock(args)  # SwitchGLU in MLX ops: gather_qmm with the mode
    assert_dtype_close(naive, ref, naive, dtype=dt, what="stock")
    for backend in ("emulator", "cuda", "metal"):
        assert MOE_MLP.listing(backend, dt, args) == ()
    (v,) = _composites(MOE_MLP, args, "emulator", cap)
    assert v.name == "dequant"
    out = v.run(args, "emulator")
    assert out.dtype == dt and out.shape == ref.shape
    assert_dtype_close(out, ref, naive, dtype=dt, what=f"moe {mode} {dtype} cap={cap}")
    # the kind's high-precision reference (the tuner's check) agrees with float64 numpy
    rows = 8
    tail = MOE_MLP.reference_tail(args, rows)
    np.testing.assert_allclose(to_f64(tail), ref.reshape(-1, D)[-rows:], rtol=1e-5, atol=1e-6)
    assert MOE_MLP.check(out, naive, args).ok
    # the reference backend's brick is stock's computation (no kernel reads the weights)
    assert mx.array_equal(MOE_MLP.brick(args, "reference"), naive).item()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_moe_composite_serves_affine_experts(dtype):
    """The MoE composite also takes MLX affine experts (where no kernel backend exists it is
    their only candidate); the kernels' tiles are still listed for them."""
    dt = DTYPES[dtype]
    args, ref = _moe_case(40, 4, 2, 64, 128, Q4, dt, "swiglu_oai", True, 11)
    assert MOE_MLP.listing("emulator", dt, args)
    names = [v.name for v in MOE_MLP.variants("reference", args=args, names=())]
    assert names == ["dequant"]
    (v,) = _composites(MOE_MLP, args, "reference", SMALL_CAP)
    assert_dtype_close(v.run(args, "reference"), ref, MOE_MLP.stock(args), dtype=dt,
                       what=f"moe q4g64 {dtype}")


def test_moe_composite_nvfp4_global_scale():
    """nvfp4 experts with per-expert global scales (QuantizedSwitchLinear(global_scale=True));
    MLX 0.32's gather_qmm takes them on the GPU only, so the same-dtype side here is the decoded
    weights rounded to the dtype, gathered and multiplied."""
    dt = mx.bfloat16
    args, ref = _moe_case(40, 4, 2, 64, 96, "nvfp4", dt, "swiglu_oai", True, 7,
                          global_scale=True)
    (v,) = _composites(MOE_MLP, args, "reference", SMALL_CAP)
    out = v.run(args, "reference")
    dense = {w: args[w].dequantize(dt) for w in ("w_gate", "w_up", "w_down")}
    naive = moe_mlp_reference(args["x"], args["indices"], dense["w_gate"], dense["w_up"],
                              dense["w_down"], b_gate=args["b_gate"], b_up=args["b_up"],
                              b_down=args["b_down"], activation="swiglu_oai")
    assert_dtype_close(out, ref, naive, dtype=dt, what="nvfp4 global scale")


def test_moe_kernel_op_refuses_microscaled_experts():
    args, _ = _moe_case(5, 3, 2, 64, 32, "mxfp4", mx.float16, "silu", False, 0)
    with pytest.raises(ValueError, match="w_gate is mxfp4: the MoE kernels read float and MLX "
                                         "affine experts"):
        moe_mlp(args["x"], args["indices"], args["w_gate"], args["w_up"], args["w_down"],
                backend="reference")


# ---- the patch ------------------------------------------------------------------------------

def _dense64_model(qmodel):
    """A float64 copy of ``qmodel`` whose microscaled layers (linear, embedding or switch) hold
    their decoded weights (float64 numpy of the packed bits)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    module = importlib.import_module(type(qmodel).__module__)
    copy = module.Model(qmodel.args)
    owners = {p: m for p, m in qmodel.named_modules()
              if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear))
              and m.mode in MODES}
    out = []
    for name, a in tree_flatten(qmodel.parameters()):
        owner, leaf = name.rsplit(".", 1)
        if owner in owners:
            if leaf in ("scales", "biases", "global_scale"):
                continue
            if leaf == "weight":
                m = owners[owner]
                q = MicroscaledWeight.from_module(m)
                out.append((name, mx.array(dequant64(q), dtype=mx.float64)))
                continue
        out.append((name, a.astype(mx.float64)))
    copy.update(tree_unflatten(out))
    mx.eval(copy.parameters())
    return copy


def _run(model, toks):
    y = model(toks)
    mx.eval(y)
    return y


def _run64(model, toks, gathered):
    with mx.stream(mx.cpu):
        if gathered is None:
            return _run(model, toks)
        with gathered():
            return _run(model, toks)


@pytest.mark.parametrize("mode", MICRO)
def test_llama_microscaled_on_the_composites(mode):
    """A llama quantized whole in ``mode``: where no kernel backend exists every module is
    patched and tuned (the composites against stock); the logits pass the rule against the
    float64 model of the decoded weights, stock in the same dtype the naive side."""
    from mlx_bricks.backends import backend_status
    from tests.models import build_model, tokens

    if backend_status("metal")[0] or backend_status("cuda")[0]:
        pytest.skip("this machine has a kernel backend (the test is for the composites alone)")
    dt = mx.bfloat16
    model = build_model("llama", dt, num_hidden_layers=2)
    spec = MODES[mode]
    nn.quantize(model, group_size=spec.group_size, bits=spec.bits, mode=mode)
    toks = tokens(24)
    ref = _run64(_dense64_model(model), toks, None)
    stock = _run(model, toks)
    report = patch_model(model, tune="force", progress=False)
    assert report.n_fallback == 0 and report.n_patched == len(model.layers)
    for m in report.modules:
        assert set(m.weights.values()) == {f"{mode} gs{spec.group_size}"}
    out = _run(model, toks)
    assert out.dtype == dt
    assert_dtype_close(out, ref, stock, dtype=dt, what=f"llama {mode}")
    decisions = report.dispatch.summary()["decisions"]
    assert decisions and all(f"w={mode}" in d["key"] for d in decisions)
    assert all(d["winner"] in ("stock", "dequant", "dequant_fused", "dequant_split", "blas",
                               "blas_fused", "blas_split")
               for d in decisions)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_gpt_oss_mxfp4_experts_patched(backend, dtype):
    """gpt_oss with its experts in mxfp4 (as gpt-oss ships them; SwigluOAI with expert biases):
    each layer's SwitchGLU is patched by module (attention stays stock: not in the patch
    table), runs the MoE piece; the logits pass the rule against the float64 clone, greedy
    tokens are stock's; on ``reference`` the brick is stock's computation (bit-equal)."""
    from tests.test_moe_patch import _gathered_switch, build, greedy, moe_entries, tokens

    dt = DTYPES[dtype]
    model = build("gpt_oss", hidden_size=64, intermediate_size=64)
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and ".experts." in p)
    model.set_dtype(dt)
    toks = tokens(70)  # 140 (token, slot) rows: the sorted path
    ref = _run64(_dense64_model(model), toks, _gathered_switch)
    stock = _run(model, toks)
    stock_tokens = greedy(model, toks)
    kwargs = {"backend": "reference"} if backend == "reference" else {"tune": "force"}
    report = patch_model(model, progress=False, **kwargs)
    entries = moe_entries(report)
    assert len(entries) == len(model.layers)
    assert all(m.status == "patched" and m.weights == {
        "gate_proj": "mxfp4 gs32", "up_proj": "mxfp4 gs32", "down_proj": "mxfp4 gs32"}
        for m in entries)
    out = _run(model, toks)
    assert_dtype_close(out, ref, stock, dtype=dt, what=f"gpt_oss {backend} {dtype}")
    if backend == "reference":
        assert mx.array_equal(out, stock).item()
        assert report.calls()[MOE_MLP.op_name] == len(model.layers)
    else:
        (d,) = {d["key"]: d for d in report.dispatch.summary()["decisions"]}.values()
        assert "moe_mlp[" in d["key"] and "act=swiglu_oai" in d["key"] and "w=mxfp4" in d["key"]
        assert d["winner"] in ("stock", "dequant")
        assert report.calls()[MOE_MLP.op_name] == (len(model.layers)
                                                   if d["winner"] == "dequant" else 0)
    assert greedy(model, toks) == stock_tokens
