"""The MoE brick's tuner kind: the experts of a MoE layer, what mlx-lm's ``SwitchGLU(x, indices)``
returns (``mlx_lm/models/switch_layers.py``), against ``SwitchGLU`` itself in MLX ops
(:func:`~mlx_bricks.bricks.moe.op.moe_mlp_reference`: ``gather_mm`` / ``gather_qmm``, sorted by
expert from 64 rows on, as mlx-lm 0.32).

Arguments: ``x`` (..., D), ``indices`` (..., k), ``w_gate``, ``w_up``, ``w_down`` (stacked expert
weights, float ``(E, N, D)`` arrays or 3-D ``QuantizedWeight``), ``b_gate``, ``b_up``, ``b_down``
(optional expert biases; ``w_gate`` None for gate-less experts, activation ``"relu2"``), and
optionally ``activation`` (``"silu"`` when absent,
``"gelu_tanh"``, ``"swiglu_oai"`` with ``alpha`` / ``limit``, ``"situ"`` with ``beta`` /
``linear_beta``).

The key: E, N, D, top-k, biases and the activation; the bucket of the tokens
(``tune.buckets.m_bucket``) and of the mean rows per expert ``tokens * k / E`` (the same edges,
``rpe``): a grouped GEMM's tile choice follows the rows per expert, stock's ``gather_mm`` the
tokens; dtype; the three weight formats. Kernel variants: the brick's tiles (``moe.msl.TILES`` on
metal / emulator, ``moe.cuda.tile_names`` on cuda); on ``reference`` none; none either where an
expert weight is microscaled (``mxfp4``, ``nvfp4``, ``mxfp8``: no kernel reads them). Composite:
``dequant`` (any expert weight quantized, affine or microscaled; ``bricks/moe/composite.py``),
the experts dequantized in tiles under the cap, then ``gather_mm``.
"""
from __future__ import annotations

import dataclasses
import math

import mlx.core as mx

from mlx_bricks.bricks.moe import cuda, msl
from mlx_bricks.bricks.moe.composite import COMPOSITES
from mlx_bricks.bricks.moe.op import (
    ACTIVATION_PARAMS,
    activation_params,
    expert_shape,
    moe_mlp,
    moe_mlp_reference,
    weight_format,
)
from mlx_bricks.checks import dtype_name
from mlx_bricks.formats import dense, format_of, formats_key, kernel_readable
from mlx_bricks.formats.microscaling import MicroscaledWeight
from mlx_bricks.runtime.kind import (Key, OpKind, check_rows, flags, high_precision,
                                     register_kind)
from mlx_bricks.tune.buckets import M_EDGES, m_bucket

_WEIGHTS = ("w_gate", "w_up", "w_down")


def _present(args) -> list:
    """The expert weights of ``args`` (w_gate None for gate-less experts: left out)."""
    return [args[w] for w in _WEIGHTS if args.get(w) is not None]
_BIASES = ("b_gate", "b_up", "b_down")


def rows_bucket(tokens: int, k: int, E: int) -> str:
    """The bucket of the mean rows per expert ``ceil(tokens * k / E)`` (at least 1), on the M
    edges: ``"rpe<=32"`` ... ``"rpe>2048"``."""
    rpe = max(1, -(-tokens * k // max(1, E)))
    for edge in M_EDGES:
        if rpe <= edge:
            return f"rpe<={edge}"
    return f"rpe>{M_EDGES[-1]}"


def _param_names(act: str) -> tuple[str, ...]:
    """The names of activation ``act``'s parameters (:data:`ACTIVATION_PARAMS`)."""
    return tuple(n for n, _ in ACTIVATION_PARAMS.get(act, ()))


def _act_kwargs(args) -> dict:
    """The activation and its parameters among ``args`` (None where absent)."""
    act = args.get("activation", "silu")
    return {"activation": act, **{n: args.get(n) for n in _param_names(act)}}


def _activation_hp(act: str, g, u, alpha=None, limit=None, beta=None, linear_beta=None):
    """The activation in the reference's precision (formulas of mlx-lm's ``swiglu``, gemma4's
    ``geglu``, ``swiglu_oai``, kimi_k3's ``_situ``; ``relu2`` of a gate-less expert: g None)."""
    p = activation_params(act, alpha=alpha, limit=limit, beta=beta, linear_beta=linear_beta)
    if act == "relu2":
        return mx.square(mx.maximum(u, 0))
    if act == "situ":
        beta, linear_beta = p["beta"], p["linear_beta"]
        a = beta * mx.tanh(g / beta) * mx.sigmoid(g)
        return a * (u if linear_beta is None else linear_beta * mx.tanh(u / linear_beta))
    if act == "gelu_tanh":
        return 0.5 * g * (1 + mx.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u
    if act == "swiglu_oai":
        alpha, limit = p["alpha"], p["limit"]
        g = mx.minimum(g, limit)
        u = mx.clip(u, -limit, limit)
        return (u + 1.0) * (g * mx.sigmoid(alpha * g))
    return g * mx.sigmoid(g) * u


def _experts_dense(weight, experts):
    """The float ``(rows, N, K)`` weights of ``experts`` (one per row): a quantized weight's
    fields are gathered before ``mx.dequantize``, so only the experts the rows use are
    dequantized (a microscaled one in float32, where its values are exact)."""
    if isinstance(weight, MicroscaledWeight):
        return dense(weight.take(experts))
    if format_of(weight).quantized:
        weight = dataclasses.replace(weight, w=weight.w[experts], scales=weight.scales[experts],
                                     biases=None if weight.biases is None
                                     else weight.biases[experts])
        return dense(weight)
    return weight[experts]


class MoeMLP(OpKind):
    """The MoE MLP kind (module docstring). Its rows are the (token, slot) pairs: the output
    ``(..., k, D)`` flattened to ``(tokens * k, D)``."""

    name = "moe_mlp"
    op_name = name
    activations = ("x",)
    cuda_kernels = ("moe_route", "moe_gate_up", "moe_down", "moe_combine", "qmoe_gate_up",
                    "qmoe_down")
    composites = COMPOSITES

    def key(self, args):
        x, idx = args["x"], args["indices"]
        E, N, D = expert_shape(args["w_up"])
        k = idx.shape[-1]
        tokens = math.prod(x.shape[:-1])
        gated = args.get("w_gate") is not None  # a gate-less expert's bias is b_up's
        values = dict(E=E, N=N, D=D, k=k,
                      bias=args.get("b_gate" if gated else "b_up") is not None)
        act = args.get("activation", "silu")
        if act != "silu":
            values["act"] = act
            values.update(activation_params(act, **{n: args.get(n) for n in _param_names(act)}))
        return Key(self.name, flags(**values),
                   f"{m_bucket(max(1, tokens))},{rows_bucket(tokens, k, E)}",
                   dtype_name(x.dtype), formats_key(*_present(args)))

    def brick(self, args, backend, **kwargs):
        if backend == "reference" and not kernel_readable(*_present(args)):
            return self.stock(args)  # moe_mlp's reference path, which takes no microscaled one
        return moe_mlp(args["x"], args["indices"], *(args[w] for w in _WEIGHTS),
                       **{b: args.get(b) for b in _BIASES}, **_act_kwargs(args),
                       check_indices=False, backend=backend, **kwargs)

    def stock(self, args):
        """``SwitchGLU.__call__`` in MLX ops (:func:`moe_mlp_reference`)."""
        return moe_mlp_reference(args["x"], args["indices"], *(args[w] for w in _WEIGHTS),
                                 **{b: args.get(b) for b in _BIASES}, **_act_kwargs(args))

    def listing(self, backend, dtype, args):
        """The brick's tiles on ``backend``: every MSL tile on metal / emulator; on cuda the
        tiles this GPU runs for the weights' widths (none for float32: no CUDA twin); none on
        ``reference`` or any other backend, nor for a microscaled expert weight."""
        if args is not None and not kernel_readable(*_present(args)):
            return ()
        if backend in ("metal", "emulator"):
            return tuple(msl.TILES)
        if backend == "cuda" and dtype != mx.float32:
            if args is None:
                return cuda.tile_names()
            bits = tuple(weight_format(w)[0] for w in _present(args))
            gated = args.get("w_gate") is not None
            return cuda.tile_names(bits=bits if gated else (bits[0], *bits), gated=gated)
        return ()

    def variant_kwargs(self, name):
        return {"tile": name}

    def n_rows(self, args):
        return math.prod(args["indices"].shape)

    def measured(self, args):
        return {"M": math.prod(args["x"].shape[:-1]), "R": self.n_rows(args)}

    def tail(self, out, rows):
        return out.reshape(-1, out.shape[-1])[-rows:]

    def check_stock(self, args):
        """Stock on the tokens whose (token, slot) rows :meth:`tail` reads (tokens are
        independent), not on the whole call."""
        idx = args["indices"]
        k = idx.shape[-1]
        tokens = -(-check_rows(self.n_rows(args)) // k)
        x = args["x"]
        cut = dict(args, x=x.reshape(-1, x.shape[-1])[-tokens:],
                   indices=idx.reshape(-1, k)[-tokens:])
        return self.stock(cut)

    def reference_tail(self, args, rows):
        """The last ``rows`` (token, slot) rows, each expert's MLP in high precision."""
        x, idx = args["x"], args["indices"]
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        R = flat.size
        r = mx.arange(R - rows, R)
        experts = flat[r]
        with high_precision(x.dtype) as hp:
            xs = x.reshape(-1, x.shape[-1])[r // k].astype(hp)[:, None, :]

            def lin(a, w, b):
                y = a @ _experts_dense(w, experts).astype(hp).swapaxes(-1, -2)
                return y if b is None else y + b[experts].astype(hp)[:, None, :]

            g = None if args.get("w_gate") is None else lin(xs, args["w_gate"],
                                                            args.get("b_gate"))
            u = lin(xs, args["w_up"], args.get("b_up"))
            act = _act_kwargs(args)
            a = _activation_hp(act.pop("activation"), g, u, **act)
            y = lin(a, args["w_down"], args.get("b_down"))
        return y[:, 0, :]


MOE_MLP = register_kind(MoeMLP())
