"""MoE MLP benchmarks: mlx-lm's stock ``SwitchGLU`` vs the MoE brick (``moe_mlp``) on the same
weights and routing, in one process.

Shapes: Qwen3-30B-A3B's expert layer (hidden 2048, 128 experts, top-8, expert intermediate 768,
SiLU) and gpt-oss-20b's (hidden 2880, 32 experts, top-4, intermediate 2880, the clamped SwiGLU
with expert biases), M = 512 / 2048 / 8192 tokens, bf16 weights and MLX affine 4-bit gs64
(``to_quantized``, what ``nn.quantize`` does to a ``SwitchLinear``), bf16 activations. The
routing is a random router's top-k (distinct experts per token, about uniform load: M * k / E
rows per expert on average); real routers are skewed, which the brick's tiles absorb but the
numbers here do not show.

The brick runs with ``check_indices=False`` (no host sync), as the patch will call it; the
result reports the rule's tile, the mean rows per expert, and ``tile_s``: seconds per call of
every tile the device runs (timed after the main rounds), for the tile rule / tuner. Where
stock raises (no implementation on this backend for the shape), ``stock_error`` says so and the
stock side is the brick's own call, and the result holds no stock figure (``ratio``, ``stock_s``,
its runs, ``stock_tflops``, ``max_abs_diff`` null; ``bench.core.run_one``): the brick runs where
stock does not.

On the H200 (bf16 activations, the lead's GPU session)::

    python -m mlx_bricks.bench --only moe --repeats 10 --out bench/results/h200-moe.json
"""
from __future__ import annotations

from dataclasses import dataclass

#: Token counts (prefill chunks).
M_SIZES = (512, 2048, 8192)
#: Weight formats: None (bf16) or (bits, group_size).
FORMATS = {"bf16": None, "q4g64": (4, 64)}


@dataclass(frozen=True)
class MoeShape:
    """One model's expert layer (``SwitchGLU(hidden, intermediate, experts)``)."""

    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    activation: str = "silu"
    bias: bool = False

    def describe(self) -> str:
        extra = ", expert biases" if self.bias else ""
        return (f"hidden {self.hidden}, {self.experts} experts, top-{self.top_k}, expert "
                f"intermediate {self.intermediate}, {self.activation}{extra}")

    def flops(self, M: int) -> float:
        """Multiply-adds x 2 of the three projections over M * top_k rows."""
        return 6.0 * M * self.top_k * self.intermediate * self.hidden


QWEN3_30B_A3B = MoeShape("qwen3_30b_a3b", hidden=2048, intermediate=768, experts=128, top_k=8)
GPT_OSS_20B = MoeShape("gpt_oss_20b", hidden=2880, intermediate=2880, experts=32, top_k=4,
                       activation="swiglu_oai", bias=True)
SHAPES = (QWEN3_30B_A3B, GPT_OSS_20B)


def _stock_module(shape: MoeShape, fmt, dtype, seed: int = 0):
    """mlx-lm's SwitchGLU of ``shape`` with random weights (and biases), quantized when fmt."""
    import mlx.core as mx
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwitchGLU, SwiGLU

    act = SwigluOAI() if shape.activation == "swiglu_oai" else SwiGLU()
    glu = SwitchGLU(shape.hidden, shape.intermediate, shape.experts, activation=act,
                    bias=shape.bias)
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        lin = getattr(glu, name)
        k = mx.random.key(seed + i)
        lin.weight = (mx.random.normal(lin.weight.shape, key=k)
                      * lin.weight.shape[-1] ** -0.5).astype(dtype)
        if shape.bias:
            lin.bias = (mx.random.normal(lin.bias.shape, key=mx.random.key(seed + 10 + i))
                        * 0.1).astype(dtype)
        if fmt is not None:
            setattr(glu, name, lin.to_quantized(group_size=fmt[1], bits=fmt[0]))
    mx.eval(glu.parameters())
    return glu


def build(shape: MoeShape, M: int, fmt, *, dtype_name: str = "bfloat16", backend=None,
          timed_tiles: bool = True):
    """``(brick, stock, info)`` for one case: callables returning the lazy (M, top_k, hidden)
    result of the brick (with the tile rule; ``brick(tile)`` forces one) and of stock
    ``SwitchGLU`` on the same inputs, and ``info() -> dict``: flop, rows per expert, the rule's
    tile, ``tile_s`` (seconds per call of every tile this device runs, when ``timed_tiles``)
    and ``stock_error`` when stock cannot run."""
    import mlx.core as mx

    from mlx_bricks.backends import resolve_backend
    from mlx_bricks.bricks.moe import cuda as moe_cuda
    from mlx_bricks.bricks.moe import msl as moe_msl
    from mlx_bricks.bricks.moe.op import moe_mlp

    dtype = getattr(mx, dtype_name)
    glu = _stock_module(shape, fmt, dtype)
    x = mx.random.normal((M, shape.hidden), key=mx.random.key(100)).astype(dtype)
    router = mx.random.normal((M, shape.experts), key=mx.random.key(101))
    k = shape.top_k
    indices = mx.argpartition(-router, kth=k - 1, axis=-1)[..., :k]
    mx.eval(x, indices)
    projs = (glu.gate_proj, glu.up_proj, glu.down_proj)
    biases = [p.bias if shape.bias else None for p in projs]

    def brick(tile=None):
        return moe_mlp(x, indices, *projs, b_gate=biases[0], b_up=biases[1], b_down=biases[2],
                       activation=shape.activation, tile=tile, check_indices=False,
                       backend=backend)

    def stock():
        return glu(x, indices)

    facts = {"flop": shape.flops(M), "rows_per_expert": M * k / shape.experts,
             "weights": "bf16" if fmt is None else f"affine {fmt[0]}-bit gs{fmt[1]}"}
    name = resolve_backend(backend)
    R = M * k
    bits = (fmt[0] if fmt else 0,) * 3
    if name == "cuda":
        facts["tile"] = moe_cuda.select_tile(R, shape.experts, bits=bits)
        tiles = moe_cuda.tile_names(bits=bits)
    else:
        facts["tile"] = moe_msl.select_tile(R, shape.experts)
        tiles = tuple(moe_msl.TILES)
    try:
        mx.eval(stock())
    except RuntimeError as e:  # stock has no implementation for this shape on this backend
        facts["stock_error"] = str(e)[:500]
        stock = brick

    def info():
        """The facts, and seconds per call of every tile this device runs (after the timed
        rounds, so the rule's choice can be compared with the others in the same process)."""
        from mlx_bricks.bench.gpu import time_op

        if timed_tiles:
            facts["tile_s"] = {t: time_op(lambda t=t: brick(t)) for t in tiles}
        return facts

    return brick, stock, info


def benchmarks() -> dict:
    """The MoE benchmarks by name (``moe_<model>_<format>_m<M>``), for ``bench.core``."""
    from mlx_bricks.bench.case import KERNEL, Benchmark

    table = {}
    for shape in SHAPES:
        for fname, fmt in FORMATS.items():
            for M in M_SIZES:
                name = f"moe_{shape.name}_{fname}_m{M}"
                weights = "bf16" if fmt is None else f"affine {fmt[0]}-bit gs{fmt[1]}"
                table[name] = Benchmark(
                    name, KERNEL,
                    f"MoE MLP (SwitchGLU), {shape.name} shapes ({shape.describe()}), M={M} "
                    f"tokens, bf16 activations, {weights} experts: stock mlx-lm SwitchGLU vs "
                    "the MoE brick (moe_mlp), random router top-k",
                    lambda shape=shape, M=M, fmt=fmt: build(shape, M, fmt))
    return table
