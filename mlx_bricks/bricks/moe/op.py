"""The MoE MLP brick: the experts of a mixture-of-experts layer, as mlx-lm's ``SwitchGLU`` runs
them, on a grouped (ragged) GEMM.

``SwitchGLU`` (``mlx_lm/models/switch_layers.py``, used by qwen3_moe, qwen2_moe, mixtral, olmoe,
gpt_oss, deepseek_v2/v3 and about 40 other architectures) gets the tokens ``x (..., D)`` and the
router's choice ``indices (..., k)`` and returns ``(..., k, D)``: for every (token, slot) the
expert ``e = indices[token, slot]``'s ``down_e(act(gate_e(x), up_e(x)))``. The model's own router
picks ``indices`` and combines the k results with its scores afterwards; :func:`moe_mlp` replaces
exactly the ``SwitchGLU`` call, :func:`moe_mlp_combine` also the weighted sum over the k slots.

The kernel path (``metal``, ``emulator``, ``cuda``; docs/moe.md):

1. ``order = argsort(indices)``: the R = tokens * k rows sorted by expert (one argsort).
2. ``moe_route`` (one small kernel): per-expert row offsets and, for every row tile, its expert
   and first row, computed on the device from the sorted rows (no host sync, all lazy).
3. ``moe_gate_up``: one launch for all experts; each threadgroup (block) takes a tile of rows of
   one expert, gathers their tokens' rows of x, and computes gate and up from one activation
   tile with the activation in the epilogue (the fused SwiGLU kernel's structure); ``act``
   (R, N) in sorted order.
4. ``moe_down``: the down projection grouped the same way; its epilogue writes each sorted row to
   its (token, slot) row, so the result is in token order (the un-sort fused).
5. :func:`moe_mlp_combine` only: ``moe_combine``, ``sum_s scores[t, s] * y[t, s]`` in float32.

Weights are the stacked expert weights as ``SwitchLinear`` / ``QuantizedSwitchLinear`` hold
them: float ``(E, N, K)`` arrays of x's dtype, or MLX affine-quantized
(:class:`~mlx_bricks.formats.affine.QuantizedWeight` with 3-D fields: ``w`` uint32
``(E, N, K * bits / 32)``, ``scales`` / ``biases`` ``(E, N, K / group_size)``; bits 2-8, group
size 32/64/128); gate, up and down each in its own format.

:func:`moe_mlp_reference` is ``SwitchGLU`` itself in MLX ops (``gather_mm`` / ``gather_qmm``,
sorted when ``indices.size >= 64`` as mlx-lm does): the ``reference`` backend, and the stock
composite a tuner variant starts from.
"""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.checks import (
    check_array,
    check_float_dtype,
    check_k,
    dtype_name,
)
from mlx_bricks.bricks.moe import cuda, msl
from mlx_bricks.formats import format_of
from mlx_bricks.formats.affine import MODE, QuantizedWeight
from mlx_bricks.formats.microscaling import MicroscaledWeight, gather_matmul_t, is_microscaled_mode
from mlx_bricks.bricks.swiglu.variants import ACTIVATIONS as SWIGLU_ACTIVATIONS

#: The experts' activations by name, and the kernels' ``ACT`` template value: the SwiGLU brick's
#: ``"silu"`` (SwiGLU, ``SwitchGLU``'s default: qwen, mixtral, olmoe, deepseek) and
#: ``"gelu_tanh"`` (GeGLU with GELU's tanh approximation: gemma4's ``GeGLU``), and
#: ``"swiglu_oai"`` (gpt-oss's clamped SwiGLU, ``mlx_lm.models.activations.swiglu_oai``, with
#: ``alpha`` and ``limit``; ``ACT_SWIGLU_OAI`` in moe.h / moe.cuh), and ``"situ"`` (Kimi K3's
#: SiTU, ``mlx_lm.models.kimi_k3.SiTU``, with ``beta`` and ``linear_beta``; ``ACT_SITU``).
ACTIVATIONS = {**SWIGLU_ACTIVATIONS, "swiglu_oai": 2, "situ": 3, "relu2": 4}
#: The activations of gate-less experts (mlx-lm's ``SwitchMLP``: fc1, activation, fc2; no
#: ``w_gate``): ``"relu2"`` (nemotron_h's ``nn.ReLU2``; ``ACT_RELU2``, kernel ``moe_up``).
GATELESS = ("relu2",)
#: ``swiglu_oai``'s defaults (gpt-oss; mlx-lm's ``SwigluOAI``).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0
#: ``situ``'s default beta (mlx-lm's ``SiTU``; its ``linear_beta`` defaults to none).
SITU_BETA = 1.0
#: The parametrised activations' parameters in the kernels' order (``act_params``), with their
#: defaults (None: absent, 0 for the kernels).
ACTIVATION_PARAMS = {"swiglu_oai": (("alpha", SWIGLU_OAI_ALPHA), ("limit", SWIGLU_OAI_LIMIT)),
                     "situ": (("beta", SITU_BETA), ("linear_beta", None))}
#: ``SwitchGLU`` sorts the rows by expert when ``indices.size`` is at least this.
SORT_THRESHOLD = 64


# ---------------------------------------------------------------------------------------------
# Stacked expert weights
# ---------------------------------------------------------------------------------------------


def expert_shape(weight) -> tuple[int, int, int]:
    """``(E, N, K)`` of a stacked float or affine expert weight (K: the input width)."""
    if format_of(weight).quantized:
        E, N, P = weight.w.shape
        return E, N, P * 32 // weight.bits
    return tuple(weight.shape)


def _check_quantized_experts(name: str, q: QuantizedWeight) -> None:
    """The expert axis of a 3-D affine weight, then the format checks of ``QuantizedWeight``
    on its (E * N)-row view (mode, bits, group_size, dtypes, packed width, scales width)."""
    if q.mode != MODE:
        raise ValueError(f"{name}.mode must be 'affine' for the bricks, got {q.mode!r} "
                         "(mxfp4 / nvfp4 / mxfp8 keep the stock path)")
    if q.biases is None:
        raise ValueError(f"{name}.biases is missing (affine mode has scales and biases)")
    for field in ("w", "scales", "biases"):
        check_array(f"{name}.{field}", getattr(q, field), ndim=3)
    E, N, P = q.w.shape
    for field in ("scales", "biases"):
        got = tuple(getattr(q, field).shape)
        if got[:2] != (E, N):
            raise ValueError(f"{name}.{field} must have shape (E={E}, N={N}, K // group_size) "
                             f"as {name}.w {tuple(q.w.shape)}, got {got}")
    QuantizedWeight(q.w.reshape(E * N, P), q.scales.reshape(E * N, -1),
                    q.biases.reshape(E * N, -1), q.group_size, q.bits, q.mode).check(
                        name, rows="E * N")


def as_expert_weight(value, name: str = "weight"):
    """``value`` as the MoE brick takes a stacked expert weight: a float ``(E, N, K)``
    ``mx.array`` (returned as it is), a :class:`~mlx_bricks.formats.affine.QuantizedWeight` with
    3-D fields, or mlx-lm's ``SwitchLinear`` / ``QuantizedSwitchLinear`` (its weight is taken,
    not its bias: pass that as ``b_gate`` etc.).

    Raises:
        TypeError: anything else, or a field that is not an ``mx.array`` / has the wrong dtype
            (the message names the argument and field, e.g. ``w_up.scales``).
        ValueError: a float array that is not 3-D, or an affine weight the format does not
            describe (mode, bits, group_size, packed width, scales / biases shapes).
    """
    if isinstance(value, mx.array):
        check_array(name, value, ndim=3)
        return value
    if isinstance(value, MicroscaledWeight):
        raise ValueError(f"{name} is {value.mode}: the MoE kernels read float and MLX affine "
                         "experts (microscaled experts reach the brick through its dequant "
                         "composite)")
    if not isinstance(value, QuantizedWeight):
        from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

        if isinstance(value, QuantizedSwitchLinear):
            value = QuantizedWeight.from_module(value)
        elif isinstance(value, SwitchLinear):
            return as_expert_weight(value.weight, name)
        else:
            raise TypeError(f"{name} must be an mx.array (E, N, K), a QuantizedWeight, a "
                            f"SwitchLinear or a QuantizedSwitchLinear, got {type(value).__name__}")
    _check_quantized_experts(name, value)
    return value


def stacked_weight(value, name: str = "weight"):
    """``value`` as the MoE kind takes a stacked expert weight: :func:`as_expert_weight`, and
    also a ``QuantizedSwitchLinear`` in a microscaling mode (``mxfp4``, ``nvfp4``, ``mxfp8``),
    or a 3-D :class:`~mlx_bricks.formats.microscaling.MicroscaledWeight`, checked (what the
    kind's ``dequant`` composite and stock read; no kernel does).

    Raises:
        TypeError, ValueError: as :func:`as_expert_weight`, or a microscaled weight that
            ``MicroscaledWeight.check`` refuses (3-D).
    """
    if not isinstance(value, MicroscaledWeight) and is_microscaled_mode(
            getattr(value, "mode", None)) and not isinstance(value, QuantizedWeight):
        value = MicroscaledWeight.from_module(value)
    if isinstance(value, MicroscaledWeight):
        value.check(name, ndim=3)
        return value
    return as_expert_weight(value, name)


def expert_inputs(weight) -> tuple[list, int, int]:
    """``([w, scales, biases], bits, group_size)`` as the kernels take a stacked weight,
    row-contiguous; a float weight is ``[w, w, w]`` with bits 0 (the placeholders are never
    read) and group_size 0."""
    arrays, flags = format_of(weight).msl_inputs(weight)
    return arrays, flags["BITS"], flags["GROUP_SIZE"]


def weight_format(weight) -> tuple[int, int]:
    """``(bits, group_size)`` of a stacked weight, ``(0, 0)`` for float (the tuner's key)."""
    fmt = format_of(weight)
    return fmt.bits, fmt.group_size


# ---------------------------------------------------------------------------------------------
# Reference: SwitchGLU in MLX ops
# ---------------------------------------------------------------------------------------------


def switch_linear_reference(x, weight, bias, indices, sorted_indices: bool):
    """One projection as ``SwitchLinear`` / ``QuantizedSwitchLinear`` computes it:
    ``gather_mm(x, weight.T)`` or ``gather_qmm(..., transpose=True)`` with ``rhs_indices``,
    then ``+ bias[indices]``. x: (..., 1, K) rows; returns (..., 1, N). On the CPU, whose
    ``gather_mm`` takes float32 only, a float16 / bfloat16 float weight is gathered
    (``weight[indices]``) and multiplied instead: the same products. A microscaled weight:
    ``gather_qmm`` with its mode and global scale (``formats.microscaling``)."""
    if isinstance(weight, MicroscaledWeight):
        y = gather_matmul_t(x, weight, indices, sorted_indices)
    elif format_of(weight).quantized:
        y = mx.gather_qmm(x, weight.w, weight.scales, weight.biases, rhs_indices=indices,
                          transpose=True, group_size=weight.group_size, bits=weight.bits,
                          mode=weight.mode, sorted_indices=sorted_indices)
    elif weight.dtype != mx.float32 and mx.default_device() == mx.cpu:
        # MLX 0.32's CPU gather_mm takes float32 only: the same products through the gathered
        # weights (one dot product per output in x's dtype, as gather_mm computes them).
        y = x @ weight[indices].swapaxes(-1, -2)
    else:
        y = mx.gather_mm(x, weight.swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
    if bias is not None:
        y = y + mx.expand_dims(bias[indices], -2)
    return y


def activation_params(activation: str, **given) -> dict:
    """``{name: value}`` of ``activation``'s parameters (:data:`ACTIVATION_PARAMS`): each of
    ``given`` that is not None, else its default (None: absent); {} for an activation without
    parameters. Not validated (:func:`check_moe_args` does that)."""
    return {n: d if given.get(n) is None else given[n]
            for n, d in ACTIVATION_PARAMS.get(activation, ())}


def activation_reference(activation: str, up, gate, alpha=None, limit=None, beta=None,
                        linear_beta=None):
    """``SwitchGLU``'s ``self.activation(x_up, x_gate)`` for the MoE activations, with mlx-lm's
    own functions: ``swiglu`` (``SwiGLU``), gemma4's ``geglu`` (``GeGLU``: ``gelu_approx(gate) *
    up``), ``swiglu_oai`` (``SwigluOAI(alpha, limit)``), kimi_k3's ``_situ`` (``SiTU(beta,
    linear_beta)``); parameters left None take their defaults (:func:`activation_params`)."""
    from mlx_lm.models import activations

    p = activation_params(activation, alpha=alpha, limit=limit, beta=beta,
                          linear_beta=linear_beta)
    if activation == "situ":
        from mlx_lm.models.kimi_k3 import _situ

        return _situ(up, gate, p["beta"], p["linear_beta"])
    if activation == "relu2":  # a gate-less expert (gate None): mlx's nn.ReLU2
        import mlx.nn as nn

        return nn.relu2(up)
    if activation == "silu":
        return activations.swiglu(gate, up)
    if activation == "gelu_tanh":
        from mlx_lm.models.gemma4_text import geglu

        return geglu(gate, up)
    return activations.swiglu_oai(gate, up, alpha=p["alpha"], limit=p["limit"])


def moe_mlp_reference(x, indices, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None,
                      activation="silu", alpha=None, limit=None, beta=None, linear_beta=None):
    """``SwitchGLU.__call__`` (mlx-lm 0.32) in MLX ops: x expanded to rows, sorted by expert
    with ``argsort`` when ``indices.size >= 64`` (two argsorts: order and its inverse), three
    gathered projections (``gather_mm`` / ``gather_qmm``, ``sorted_indices`` then), the
    activation, the un-sort. Arguments as :func:`moe_mlp` (weights already as
    :func:`as_expert_weight` returns them); ``alpha`` / ``limit`` None take gpt-oss's defaults
    for ``swiglu_oai``. Returns (..., k, D) of x's dtype."""
    xe = mx.expand_dims(x, (-2, -3))
    do_sort = indices.size >= SORT_THRESHOLD
    idx = indices
    inv_order = None
    if do_sort:
        k = indices.shape[-1]
        flat = indices.flatten()
        order = mx.argsort(flat)
        inv_order = mx.argsort(order)
        xe, idx = xe.flatten(0, -3)[order // k], flat[order]
    up = switch_linear_reference(xe, w_up, b_up, idx, do_sort)
    gate = None if w_gate is None else switch_linear_reference(xe, w_gate, b_gate, idx, do_sort)
    act = activation_reference(activation, up, gate, alpha, limit, beta, linear_beta)
    y = switch_linear_reference(act, w_down, b_down, idx, do_sort)
    if do_sort:
        y = mx.unflatten(y[inv_order], 0, indices.shape)
    return y.squeeze(-2)


def combine_reference(y, scores, dtype):
    """The models' combine, ``(y * scores[..., None]).sum(axis=-2)``, cast to ``dtype`` (as
    qwen3_moe / deepseek_v3 cast it back to the activations' dtype)."""
    return (y * scores[..., None]).sum(axis=-2).astype(dtype)


def moe_mlp_combine_reference(x, indices, scores, w_gate, w_up, w_down, **kw):
    """:func:`moe_mlp_reference` followed by :func:`combine_reference`: (..., D)."""
    y = moe_mlp_reference(x, indices, w_gate, w_up, w_down, **kw)
    return combine_reference(y, scores, x.dtype)


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def activation_code(activation) -> int:
    """The kernels' ``ACT`` value of ``activation`` (a key of :data:`ACTIVATIONS`).

    Raises:
        TypeError: not a str. ValueError: an unknown activation.
    """
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str, got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                         f"got {activation!r}")
    return ACTIVATIONS[activation]


def _activation_params(activation, **given) -> tuple[float, float]:
    """The kernels' ``act_params`` of ``activation`` from its parameters ``given`` (``alpha``,
    ``limit``, ``beta``, ``linear_beta``; None: the default, :data:`ACTIVATION_PARAMS`); (0, 0)
    for an activation without parameters. A parameter of another activation, a non-finite one
    or one <= 0 where it divides or bounds (limit, beta, linear_beta) is an error."""
    params = dict(ACTIVATION_PARAMS.get(activation, ()))
    for pname, v in given.items():
        if v is not None and pname not in params:
            owner = next(a for a, ps in ACTIVATION_PARAMS.items() if pname in dict(ps))
            raise ValueError(f"{pname} applies to activation {owner!r} only, "
                             f"got {pname}={v!r} with activation {activation!r}")
    out = []
    for pname, default in ACTIVATION_PARAMS.get(activation, ()):
        v = given.get(pname)
        v = default if v is None else v
        if v is None:  # absent (situ's linear_beta)
            out.append(0.0)
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise TypeError(f"{pname} must be a finite float, got {v!r}")
        if pname != "alpha" and v <= 0:
            raise ValueError(f"{pname} must be > 0, got {float(v)}")
        out.append(float(v))
    return (out[0], out[1]) if out else (0.0, 0.0)


def _expert_weight(name, value, x):
    weight = as_expert_weight(value, name)
    wdt = weight.dtype
    if wdt != x.dtype:
        field = f"{name}.scales" if format_of(weight).quantized else name
        raise TypeError(f"{field} has dtype {dtype_name(wdt)} but x has {dtype_name(x.dtype)}; "
                        "expert weights (a quantized weight's scales) must have x's dtype")
    return weight


def _check_bias(name, bias, shape, x):
    if bias is None:
        return
    check_array(name, bias)
    if bias.dtype != x.dtype:
        raise TypeError(f"{name} has dtype {dtype_name(bias.dtype)} but x has "
                        f"{dtype_name(x.dtype)}")
    if tuple(bias.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(bias.shape)}")


def _check_indices_values(indices, E) -> None:
    # a host sync: the values are data
    lo, hi = mx.min(indices).item(), mx.max(indices).item()
    if lo < 0 or hi >= E:
        raise ValueError(f"indices must be expert numbers in [0, E={E}), got values in "
                         f"[{lo}, {hi}]")


def check_moe_args(x, indices, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None,
                   activation="silu", alpha=None, limit=None, scores=None,
                   check_indices=True, beta=None, linear_beta=None) -> dict:
    """Validate the arguments of :func:`moe_mlp` / :func:`moe_mlp_combine` and return them as
    the kernels take them: ``dict(w_gate, w_up, w_down, E, N, D, k, act, act_params)``
    (``act_params``: the activation's two parameters, :data:`ACTIVATION_PARAMS`).

    Raises: see :func:`moe_mlp`.
    """
    check_array("x", x, min_ndim=1)
    check_float_dtype("x", x)
    D = check_k(x)
    check_array("indices", indices, min_ndim=1)
    if not mx.issubdtype(indices.dtype, mx.integer):
        raise TypeError(f"indices must have an integer dtype, got {dtype_name(indices.dtype)}")
    if tuple(indices.shape[:-1]) != tuple(x.shape[:-1]):
        raise ValueError(f"indices must have shape (*x.shape[:-1], k) = "
                         f"({', '.join(map(str, x.shape[:-1]))}, k), got {tuple(indices.shape)}")
    k = indices.shape[-1]
    if k < 1:
        raise ValueError(f"indices must choose at least one expert per token (k >= 1), "
                         f"got shape {tuple(indices.shape)}")
    act = activation_code(activation)
    if (w_gate is None) != (activation in GATELESS):
        raise ValueError(f"w_gate must be None exactly for a gate-less activation "
                         f"({', '.join(map(repr, GATELESS))}), got "
                         f"{'None' if w_gate is None else 'a weight'} with {activation!r}")
    first = "w_gate" if w_gate is not None else "w_up"
    if w_gate is not None:
        w_gate = _expert_weight("w_gate", w_gate, x)
    w_up = _expert_weight("w_up", w_up, x)
    E, N, Kg = expert_shape(w_gate if w_gate is not None else w_up)
    if Kg != D:
        raise ValueError(f"{first} must have shape (E, N, D={D}) (D = x.shape[-1]), got "
                         f"(E, N, K) = {(E, N, Kg)}")
    if expert_shape(w_up) != (E, N, D):
        raise ValueError(f"w_up must have w_gate's shape (E, N, D) = {(E, N, D)}, got "
                         f"{expert_shape(w_up)}")
    w_down = _expert_weight("w_down", w_down, x)
    if expert_shape(w_down) != (E, D, N):
        raise ValueError(f"w_down must have shape (E, D, N) = {(E, D, N)} (the transpose of "
                         f"{first}'s last two), got {expert_shape(w_down)}")
    if E < 1 or N < 1:
        raise ValueError(f"the expert weights must have E >= 1 experts of N >= 1 rows, got "
                         f"(E, N) = {(E, N)}")
    if k > E:
        raise ValueError(f"indices chooses top-k = {k} experts per token, more than the "
                         f"E = {E} experts of the weights")
    _check_bias("b_gate", b_gate, (E, N), x)
    _check_bias("b_up", b_up, (E, N), x)
    _check_bias("b_down", b_down, (E, D), x)
    if w_gate is None and b_gate is not None:
        raise ValueError("b_gate must be None for a gate-less activation (no w_gate)")
    act_params = _activation_params(activation, alpha=alpha, limit=limit, beta=beta,
                                    linear_beta=linear_beta)
    if scores is not None:
        check_array("scores", scores)
        check_float_dtype("scores", scores)
        if tuple(scores.shape) != tuple(indices.shape):
            raise ValueError(f"scores must have indices' shape {tuple(indices.shape)}, got "
                             f"{tuple(scores.shape)}")
    if not isinstance(check_indices, bool):
        raise TypeError(f"check_indices must be a bool, got {type(check_indices).__name__}")
    if check_indices and indices.size:
        _check_indices_values(indices, E)
    return dict(w_gate=w_gate, w_up=w_up, w_down=w_down, E=E, N=N, D=D, k=k, act=act,
                act_params=act_params)


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------


def _resolve(backend, dtype) -> str:
    """The backend of one call, resolved once (``backends.op_backend``: float32 has no CUDA
    twin, as for the GEMM family)."""
    from mlx_bricks.backends import op_backend
    from mlx_bricks.bricks.gemm.cuda import unsupported_reason

    return op_backend(msl.GATE_UP_SPEC.name, backend, cuda_unsupported=unsupported_reason(dtype))


def _backend_module(name: str):
    """The launch module of a kernel backend: ``cuda`` or ``msl`` (metal, emulator)."""
    return cuda if name == "cuda" else msl


def _check_tile(name: str, tile) -> None:
    if tile is None or name == "reference":
        return
    valid = _backend_module(name).TILES
    if tile not in valid:
        raise ValueError(f"tile must be None or, on {name}, one of {sorted(valid)}, "
                         f"got {tile!r}")


def sort_rows(indices):
    """``(idx, order)``: the flattened indices as uint32 (a negative index wraps to a large
    value, so out-of-range rows sort last) and ``order = argsort(idx)``, uint32 (R,)."""
    idx = indices.reshape(-1).astype(mx.uint32)
    return idx, mx.argsort(idx).astype(mx.uint32)


def _kernel_rows(x, indices, a, biases, tile, name):
    """The grouped GEMMs on the kernel backend ``name``: y (R, D) in (token, slot) order."""
    x2 = mx.contiguous(x.reshape(-1, a["D"]))
    idx, order = sort_rows(indices)
    weights = [None if a[w] is None else expert_inputs(a[w])
               for w in ("w_gate", "w_up", "w_down")]
    return _backend_module(name).moe_rows(x2, idx, order, *weights, biases, a["E"], a["act"],
                                          a["act_params"], tile=tile, backend=name)


def moe_mlp(x, indices, w_gate, w_up, w_down, *, b_gate=None, b_up=None, b_down=None,
            activation="silu", alpha=None, limit=None, beta=None, linear_beta=None, tile=None,
            check_indices=True, backend=None):
    """What mlx-lm's ``SwitchGLU(x, indices)`` returns, on the MoE brick: for every token t and
    slot s, ``down_e(act(gate_e(x_t) + b_gate[e], up_e(x_t) + b_up[e])) + b_down[e]`` with
    ``e = indices[t, s]``.

    Algorithm: the rows (token, slot) sorted by expert (one argsort), per-expert offsets and a
    row-tile table computed on the device (``moe_route``), then two grouped GEMMs of one launch
    each over all experts (every row tile belongs to one expert): gate and up from one gathered
    activation tile with the activation in float registers (the fused SwiGLU kernel's pipeline,
    ``metal_src/gemm.h``), then the down projection whose epilogue writes each row back to its
    (token, slot) position. Grouped GEMM as in MegaBlocks (Gale et al. 2022) / vLLM's fused MoE;
    the activations are mlx-lm's (SwiGLU: Shazeer 2020; gpt-oss: OpenAI 2025). docs/moe.md.

    Args:
        x: (..., D) float16, bfloat16 or float32: the tokens (any leading dims; rows copied to
            a contiguous (tokens, D) matrix only when they are not already).
        indices: (..., k) integer, the same leading dims as x: each token's k experts (the
            router's top-k, as ``SwitchGLU`` gets it), values in [0, E).
        w_gate, w_up: (E, N, D) stacked expert weights (``SwitchLinear.weight``): float of x's
            dtype, or MLX affine (:class:`~mlx_bricks.formats.affine.QuantizedWeight` with 3-D
            fields, scales of x's dtype), or the ``SwitchLinear`` / ``QuantizedSwitchLinear``
            module itself; each in its own format. ``w_gate`` None for gate-less experts
            (``SwitchMLP``: ``down_e(act(up_e(x)))``, activation ``"relu2"``; b_gate None).
        w_down: (E, D, N), the same choices.
        b_gate, b_up: optional (E, N) expert biases, x's dtype (gpt-oss); b_down: (E, D).
        activation: ``"silu"`` (default), ``"gelu_tanh"``, ``"swiglu_oai"``, ``"situ"``, or
            for gate-less experts ``"relu2"`` (:data:`ACTIVATIONS`, :data:`GATELESS`).
        alpha, limit: ``swiglu_oai``'s parameters (None: gpt-oss's 1.702 and 7.0); beta,
            linear_beta: ``situ``'s (None: 1.0 and none). Each an error with another
            activation.
        tile: None (the tile rule of the backend) or a key of ``msl.TILES`` (metal, emulator)
            / ``cuda.TILES`` (cuda).
        check_indices: check that every index is in [0, E) (a host sync: ``mx.min`` /
            ``mx.max`` are evaluated). With False nothing is evaluated; a row with an
            out-of-range index then gives NaN on the kernel backends (never a memory fault),
            and whatever ``gather_mm`` gives on ``reference``. The router's top-k is always in
            range, so a patched model passes False.
        backend: None (auto), ``"metal"``, ``"cuda"``, ``"emulator"``, ``"reference"``
            (:func:`moe_mlp_reference`); float32 on an automatic ``cuda`` runs ``reference``.

    Returns:
        (..., k, D) of x's dtype, in token order (``SwitchGLU``'s output). Gate and up are summed
        in float32 with their biases, the activation is applied in float32 and rounded once to
        x's dtype (``act``); the down projection sums in float32 and adds its bias before one
        rounding. Stock rounds gate and up to x's dtype before the activation.

    Raises:
        TypeError: non-array arguments, non-float x, non-integer indices, weights (scales) or
            biases of another dtype than x, a non-str activation, a non-bool check_indices.
        ValueError: indices' leading dims unlike x's, k < 1, top-k above the expert count,
            expert shapes that do not match (the message names w_up, w_down, b_gate...), an
            affine weight the format does not describe, an index out of [0, E) (with
            check_indices), an unknown activation or tile, an activation parameter of
            another activation (or one <= 0: limit, beta, linear_beta), a bad backend.
        NotImplementedError: backend ``"cuda"`` asked for with float32 (no CUDA twin).
    """
    a = check_moe_args(x, indices, w_gate, w_up, w_down, b_gate, b_up, b_down, activation,
                       alpha, limit, check_indices=check_indices, beta=beta,
                       linear_beta=linear_beta)
    name = _resolve(backend, x.dtype)
    _check_tile(name, tile)
    out_shape = (*x.shape[:-1], a["k"], a["D"])
    if name == "reference":
        return moe_mlp_reference(x, indices, a["w_gate"], a["w_up"], a["w_down"], b_gate=b_gate,
                                 b_up=b_up, b_down=b_down, activation=activation,
                                 alpha=alpha, limit=limit, beta=beta, linear_beta=linear_beta)
    if indices.size == 0:
        return mx.zeros(out_shape, dtype=x.dtype)
    y = _kernel_rows(x, indices, a, (b_gate, b_up, b_down), tile, name)
    return y.reshape(out_shape)


def moe_mlp_combine(x, indices, scores, w_gate, w_up, w_down, *, b_gate=None, b_up=None,
                    b_down=None, activation="silu", alpha=None, limit=None, beta=None,
                    linear_beta=None, tile=None, check_indices=True, backend=None):
    """The MoE layer's expert part with the router-weighted combine:
    ``sum_s scores[..., s] * moe_mlp(x, indices, ...)[..., s, :]``, (..., D).

    The models write it ``(switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)`` (qwen3_moe,
    mixtral, olmoe, gpt_oss, deepseek_v3, ...). Here the down projection's rows (rounded to x's
    dtype, as stock's) are combined by one small kernel (``moe_combine``) that sums the k
    weighted slots in float32 and rounds once to x's dtype.

    Args:
        scores: (..., k), indices' shape, float16 / bfloat16 / float32 (any of them, whatever
            x's dtype): the router weights of the chosen experts.
        the others: as :func:`moe_mlp`.

    Returns:
        (..., D) of x's dtype.

    Raises:
        As :func:`moe_mlp`; also TypeError / ValueError for scores that are not a float array
        of indices' shape.
    """
    a = check_moe_args(x, indices, w_gate, w_up, w_down, b_gate, b_up, b_down, activation,
                       alpha, limit, scores=scores, check_indices=check_indices, beta=beta,
                       linear_beta=linear_beta)
    name = _resolve(backend, x.dtype)
    _check_tile(name, tile)
    if name == "reference":
        return moe_mlp_combine_reference(x, indices, scores, a["w_gate"], a["w_up"],
                                         a["w_down"], b_gate=b_gate, b_up=b_up, b_down=b_down,
                                         activation=activation, alpha=alpha, limit=limit,
                                         beta=beta, linear_beta=linear_beta)
    if indices.size == 0:
        return mx.zeros(x.shape, dtype=x.dtype)
    y = _kernel_rows(x, indices, a, (b_gate, b_up, b_down), tile, name)
    scores2 = mx.contiguous(scores.reshape(-1, a["k"]))
    return _backend_module(name).combine(y, scores2, name).reshape(x.shape)
