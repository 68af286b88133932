"""The SwiGLU brick's tuner kind: the whole MLP ``down(act(gate(x)) * up(x)) (+ residual)``
against mlx-lm's ``MLP`` (``down(swiglu(gate(x), up(x)))``, gemma's ``gelu_approx(gate) * up``).
Arguments: ``x, w_gate, w_up, w_down, b_gate, b_up, b_down, residual`` and optionally
``activation`` (``"silu"`` when absent, or ``"gelu_tanh"``).

Settings (``patch_model(mlp_variant=...)``): ``{"variant": "fused" | "split", "fixed": bool}``:
the variant the untuned rules run, and whether the caller asked for it (tuning then weighs only
that variant against stock).

Composites (any of gate/up/down quantized, affine or microscaled;
``bricks/dequantize/composite.py``), each on ``mx.dequantize`` and (affine) on the dequantize
brick: ``dequant_fused`` / ``dequant_brick_fused``, one
float GEMM per row tile on gate and up dequantized side by side (gate and up of one format),
and ``dequant_split`` / ``dequant_brick_split``, a GEMM per projection; then the activation and
the down projection the same way. They record ``{"variant": style}``, so a fixed
``mlp_variant`` keeps its style's composites.

Variants ``qfused_<tile>`` (cuda, gate / up affine 4- or 8-bit of one format): the fused SwiGLU
on a ``ws`` tile of ``swiglu.cuda.SWIGLU_TILES`` (weights dequantized in registers, qgemm.cuh)
and the down projection on the ``ws`` linear tile of the same token rows (:data:`WS_DOWN`; the
linear rule's tile when down is in another format). They count as ``fused``.
"""
from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.dequantize.composite import dequant_composites, quantized
from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.gemm.op import run_linear
from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
from mlx_bricks.bricks.swiglu.op import run_swiglu, run_swiglu_mlp, variant_for, variant_names
from mlx_bricks.checks import dtype_name
from mlx_bricks.formats import dense, format_of, formats_key, kernel_readable, same_format
from mlx_bricks.runtime.kind import Key, TokenRowsKind, flags, high_precision, register_kind
from mlx_bricks.tune.buckets import m_bucket


def _activation(gate, up, activation):
    """mlx-lm's gated activation: ``swiglu(gate, up)``, or gemma's ``gelu_approx(gate) * up``
    (``mlx_lm.models.gemma3_text.MLP``)."""
    from mlx_lm.models.activations import swiglu

    if activation == "gelu_tanh":
        return nn.gelu_approx(gate) * up
    return swiglu(gate, up)


def _down(args, tiles, act):
    y = tiles.linear(act, (args["w_down"],), (args.get("b_down"),))
    res = args.get("residual")
    return y if res is None else res + y


def _dequant_fused(args, tiles):
    activation = args.get("activation", "silu")
    act = tiles.linear(args["x"], (args["w_gate"], args["w_up"]),
                       (args.get("b_gate"), args.get("b_up")),
                       finish=lambda g, u: _activation(g, u, activation))
    return _down(args, tiles, act)


def _dequant_split(args, tiles):
    x = args["x"]
    gate = tiles.linear(x, (args["w_gate"],), (args.get("b_gate"),))
    up = tiles.linear(x, (args["w_up"],), (args.get("b_up"),))
    return _down(args, tiles, _activation(gate, up, args.get("activation", "silu")))


def _mlp_quantized(args) -> bool:
    return quantized(args["w_gate"], args["w_up"], args["w_down"])


#: Prefix of the register-dequantizing variants' names (``qfused_<swiglu tile>``).
WS_PREFIX = "qfused_"
#: The down projection's ``ws`` linear tile for each fused ``ws`` tile (same token rows).
WS_DOWN = {"qwg256x64": "qwg256x128", "qwg128x128": "qwg128x256", "qwg128x64": "qwg128x128",
           "qmma128x64": "qmma128x128"}


def _ws_bits(w) -> int | None:
    """The width of an affine weight the ``ws`` kernels take, else None."""
    fmt = format_of(w)
    ok = fmt.quantized and not fmt.microscaled and fmt.bits in gemm_cuda.WS_BITS
    return fmt.bits if ok else None


def _ws_variants(backend, dtype, args) -> tuple[str, ...]:
    """``qfused_<tile>`` for each ``ws`` fused tile this GPU runs on these weights."""
    if backend != "cuda" or args is None or not same_format(args["w_gate"], args["w_up"]):
        return ()
    bits = _ws_bits(args["w_gate"])
    if bits is None:
        return ()
    tiles = swiglu_cuda.SWIGLU_TILES
    return tuple(WS_PREFIX + n for n in gemm_cuda.dtype_tile_names(tiles, dtype, 2, bits)
                 if tiles[n].ws)


class SwigluMLP(TokenRowsKind):
    """The SwiGLU MLP kind (module docstring)."""

    name = "swiglu_mlp"
    op_name = name
    activations = ("x", "residual")
    # split: the GEMM twins' SwiGLU epilogue; down: a GEMM
    cuda_kernels = ("swiglu_fused", "gemm", "qgemm_swiglu", "qgemm")
    composites = (
        *dequant_composites(_dequant_fused, lambda a: _mlp_quantized(a) and same_format(
            a["w_gate"], a["w_up"]), suffix="_fused", kwargs={"variant": "fused"},
            blas_applies=lambda a: same_format(a["w_gate"], a["w_up"])),
        *dequant_composites(_dequant_split, _mlp_quantized, suffix="_split",
                            kwargs={"variant": "split"}))

    def key(self, args):
        x, wg = args["x"], args["w_gate"]
        N, K = wg.shape
        values = dict(K=K, N=N, bias=args.get("b_gate") is not None,
                      res=args.get("residual") is not None)
        if args.get("activation", "silu") != "silu":  # SiLU keys stay as they were
            values["act"] = args["activation"]
        return Key(self.name, flags(**values), m_bucket(math.prod(x.shape[:-1])),
                   dtype_name(x.dtype), formats_key(wg, args["w_up"], args["w_down"]))

    def brick(self, args, backend, **kwargs):
        if "tile" in kwargs:  # a qfused_<tile> variant
            return self._ws_brick(args, backend, kwargs["tile"])
        if "variant" not in kwargs:  # the brick's own rule, as ops.swiglu_mlp(variant=None)
            kwargs["variant"] = variant_for(None, args["w_gate"], args["w_up"])
        return run_swiglu_mlp(args["x"], args["w_gate"], args["w_up"], args["w_down"],
                              args.get("residual"), args.get("b_gate"), args.get("b_up"),
                              args.get("b_down"), activation=args.get("activation", "silu"),
                              backend=backend, **kwargs)

    @staticmethod
    def _ws_brick(args, backend, tile):
        act = run_swiglu(args["x"], args["w_gate"], args["w_up"], args.get("b_gate"),
                         args.get("b_up"), activation=args.get("activation", "silu"),
                         variant="fused", tile=tile, backend=backend)
        down = WS_DOWN[tile] if _ws_bits(args["w_down"]) else None
        return run_linear(act, args["w_down"], args.get("b_down"), args.get("residual"),
                          tile=down, backend=backend)

    def stock(self, args):
        x = args["x"]

        def lin(a, w, b):
            return format_of(w).linear(a, w, b)

        gate = lin(x, args["w_gate"], args.get("b_gate"))
        up = lin(x, args["w_up"], args.get("b_up"))
        act = _activation(gate, up, args.get("activation", "silu"))
        y = lin(act, args["w_down"], args.get("b_down"))
        res = args.get("residual")
        return y if res is None else res + y

    def listing(self, backend, dtype, args):
        """The variants, without ``fused`` when gate and up differ in format: the fused kernel
        stages both with one loader; none when a weight is microscaled (no kernel reads it)."""
        if args is not None and not kernel_readable(args["w_gate"], args["w_up"],
                                                    args["w_down"]):
            return ()
        names = variant_names(backend, dtype)
        if args is None or same_format(args["w_gate"], args["w_up"]):
            return names + _ws_variants(backend, dtype, args)
        return tuple(n for n in names if n != "fused")

    def variant_kwargs(self, name):
        if name.startswith(WS_PREFIX):
            return {"variant": "fused", "tile": name[len(WS_PREFIX):]}
        return {"variant": name}

    def rule_kwargs(self, args, settings):
        """The patch's variant, except ``split`` when gate and up differ in format."""
        variant = settings.get("variant", "fused")
        return {"variant": variant if same_format(args["w_gate"], args["w_up"]) else "split"}

    def restrict(self, variants, settings):
        if settings.get("fixed"):  # kernel variants and composites of the asked style
            return [v for v in variants
                    if v.kwargs.get("variant", v.name) == settings.get("variant")]
        return variants

    def settings_suffix(self, settings):
        return f"|only={settings['variant']}" if settings.get("fixed") else ""

    def reference_tail(self, args, rows):
        x, res = args["x"], args.get("residual")
        with high_precision(x.dtype) as hp:
            x2 = x.reshape(-1, x.shape[-1])[-rows:].astype(hp)

            def lin(a, w, b):
                y = a @ dense(w).astype(hp).T
                return y if b is None else y + b.astype(hp)

            g = lin(x2, args["w_gate"], args.get("b_gate"))
            u = lin(x2, args["w_up"], args.get("b_up"))
            if args.get("activation", "silu") == "gelu_tanh":
                a = 0.5 * g * (1 + mx.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
            else:
                a = g * mx.sigmoid(g)
            y = lin(a * u, args["w_down"], args.get("b_down"))
            if res is not None:
                y = y + res.reshape(-1, res.shape[-1])[-rows:].astype(hp)
        return y


SWIGLU_MLP = register_kind(SwigluMLP())
