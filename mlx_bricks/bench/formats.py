"""CPU benchmarks of the microscaled formats (``mxfp4``, ``nvfp4``, ``mxfp8``): each kind's
``dequant`` composite (the weight dequantized in row tiles under the default cap, then the float
computation) against the stock op it replaces, on the same inputs.

* ``formats_cpu_linear_<mode>_<dtype>``: ``x @ W.T`` with M=128 tokens, N=K=1024: the linear
  kind's composite vs ``mx.quantized_matmul(..., mode=...)`` (``nn.QuantizedLinear``);
* ``formats_cpu_moe_mxfp4_bf16``: gpt-oss-like experts (32 experts, top-4, D=N=512,
  SwigluOAI with biases) at 128 tokens: the MoE kind's composite vs ``SwitchGLU`` in MLX ops
  (``gather_qmm``).

Where no kernel backend exists the patch weighs exactly these against each other
(``patch_model(tune="auto")``); the figures say what it finds.
"""
from __future__ import annotations

from mlx_bricks.bench.case import CPU, Benchmark

MODES = ("mxfp4", "nvfp4", "mxfp8")
DTYPES = ("fp16", "bf16")
LINEAR_SHAPE = (128, 1024, 1024)  # M, N, K
MOE_SHAPE = (128, 32, 4, 512, 512)  # tokens, E, k, D, N


def _dtype(name: str):
    import mlx.core as mx

    return {"fp16": mx.float16, "bf16": mx.bfloat16, "fp32": mx.float32}[name]


def _composite(kind, args):
    (v,) = [c for c in kind.variants("reference", args=args, names=())
            if c.name == "dequant"]
    return v


def _linear_setup(mode: str, dtype: str):
    import mlx.core as mx

    from mlx_bricks.bricks.gemm.kind import LINEAR
    from mlx_bricks.formats.microscaling import MicroscaledWeight

    M, N, K = LINEAR_SHAPE
    dt = _dtype(dtype)
    x = mx.random.normal((M, K), key=mx.random.key(0)).astype(dt)
    w = MicroscaledWeight(*mx.quantize(
        mx.random.normal((N, K), key=mx.random.key(1)) * K ** -0.5, mode=mode), mode)
    mx.eval(x, w.w, w.scales)
    args = {"x": x, "weight": w, "bias": None, "residual": None}
    v = _composite(LINEAR, args)
    return (lambda: v.run(args, "reference"), lambda: LINEAR.stock(args),
            lambda: {"flop": 2 * M * N * K, "shape": {"M": M, "N": N, "K": K}})


def _moe_setup():
    import mlx.core as mx

    from mlx_bricks.bricks.moe.kind import MOE_MLP
    from mlx_bricks.formats.microscaling import MicroscaledWeight

    T, E, k, D, N = MOE_SHAPE
    dt = mx.bfloat16
    keys = mx.random.split(mx.random.key(2), 8)
    x = mx.random.normal((1, T, D), key=keys[0]).astype(dt)
    idx = mx.argsort(mx.random.uniform(shape=(1, T, E), key=keys[1]), axis=-1)[..., :k]

    def experts(rows, cols, key):
        w = mx.random.normal((E, rows, cols), key=key) * cols ** -0.5
        return MicroscaledWeight(*mx.quantize(w, mode="mxfp4"), "mxfp4")

    args = {"x": x, "indices": idx.astype(mx.int32), "w_gate": experts(N, D, keys[2]),
            "w_up": experts(N, D, keys[3]), "w_down": experts(D, N, keys[4]),
            "b_gate": (0.1 * mx.random.normal((E, N), key=keys[5])).astype(dt),
            "b_up": (0.1 * mx.random.normal((E, N), key=keys[6])).astype(dt),
            "b_down": (0.1 * mx.random.normal((E, D), key=keys[7])).astype(dt),
            "activation": "swiglu_oai"}
    mx.eval(args)
    v = _composite(MOE_MLP, args)
    return (lambda: v.run(args, "reference"), lambda: MOE_MLP.stock(args),
            lambda: {"flop": 2 * T * k * 3 * N * D,
                     "shape": {"tokens": T, "E": E, "k": k, "D": D, "N": N}})


def benchmarks() -> dict[str, Benchmark]:
    """The microscaled-format CPU benchmarks, by name (module docstring)."""
    M, N, K = LINEAR_SHAPE
    out = {}
    for mode in MODES:
        for dtype in DTYPES:
            name = f"formats_cpu_linear_{mode}_{dtype}"
            out[name] = Benchmark(
                name, CPU,
                f"linear on the CPU, M={M}, N={N}, K={K}, {dtype}, weight {mode}: the dequant "
                "composite (row tiles under the default cap, then x @ W.T) vs stock "
                f"mx.quantized_matmul(mode={mode!r})",
                lambda mode=mode, dtype=dtype: _linear_setup(mode, dtype))
    T, E, k, D, Nm = MOE_SHAPE
    out["formats_cpu_moe_mxfp4_bf16"] = Benchmark(
        "formats_cpu_moe_mxfp4_bf16", CPU,
        f"MoE experts on the CPU, {T} tokens, E={E}, top-{k}, D={D}, N={Nm}, bf16, mxfp4 "
        "experts with biases, SwigluOAI (gpt-oss's): the dequant composite (experts dequantized "
        "in tiles, then gather_mm) vs stock SwitchGLU (gather_qmm)", _moe_setup)
    return out
