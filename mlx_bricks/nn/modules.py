"""Drop-in prefill modules for mlx-lm decoder blocks: BricksAttention, BricksMLP, BricksBlock.

Each is a mixin that is put in front of a module's own class *on one instance*
(``module.__class__ = bricks_class(BricksAttention, type(module))``): the instance keeps its
parameters, its parameter names and every other attribute, ``isinstance`` checks against the
original class still hold, and other instances of the class are untouched. This is the MLX
counterpart of Liger-Kernel's per-instance method binding: MLX looks ``__call__`` up on the type,
so binding a method on the instance would not take effect.

Prefill (L > 1) is split into pieces (the unified block: RMSNorm + QKV, attention, the
out-projection with the residual, the SwiGLU MLP with the residual). For each piece the model's
dispatcher (``state.dispatch``, ``mlx_bricks.runtime.dispatch``) chooses a brick variant
(``mlx_bricks.ops``) or the stock path, which is mlx-lm's own computation: the module's own
submodules (``input_layernorm``, ``q_proj``, ``mlp``...) and mlx-lm's attention function, not the
ops' ``*_reference`` functions. When every piece goes stock the module's original ``__call__``
runs. Decode (L == 1) and every case the bricks do not cover call the original ``__call__``
unchanged, and the reason is counted in the module's :class:`BricksState`. The bricks write K/V
into mlx-lm's ``KVCache`` with ``cache.update_and_fetch`` exactly as stock does, so decode
continues on the stock path.

Tensor-parallel models (mlx-lm's ``Model.shard()``; ``mlx_bricks.nn.sharding``): column-sharded
q/k/v and gate/up run the bricks on the local shard (the attention's local ``n_heads`` /
``n_kv_heads``); for a row-sharded o/down the piece computes the local partial product (no bias,
no residual), then ``_finish`` applies the layer's ``all_sum``, its bias and the residual once.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from mlx_lm.models.activations import swiglu
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_bricks.nn.sharding import (
    QUANTIZED_SHARDED,
    is_float_sharded,
    is_row_sharded,
    reduce_partial,
    role_reason,
)
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.runtime.kind import Act

# Stock-call reason for single-token steps: decode is stock by design, not a fallback.
DECODE = "decode (L == 1): stock path by design"


@dataclass(frozen=True)
class BlockLayout:
    """Where an mlx-lm pre-norm decoder block keeps its parts (attribute names).

    The block computes ``h = x + attn(input_norm(x)); out = h + mlp(post_attention_norm(h))``;
    the attention projects with q/k/v/o ``nn.Linear`` or ``nn.QuantizedLinear`` (MLX affine)
    layers (biases optional), optionally
    applies per-head RMSNorms (``qk_norm``, qwen3) before RoPE, and the MLP is
    ``down(act(gate(x)) * up(x))`` with ``act`` the layout's ``activation``.

    Gemma-style fields:
        activation: the MLP's gate activation, ``"silu"`` or ``"gelu_tanh"`` (gemma's
            ``nn.gelu_approx``; ``ops.swiglu_variants.ACTIVATIONS``).
        sliding: attribute of the attention module that is True on sliding-window layers
            (gemma3: ``is_sliding``); None: no sliding-window layers.
        window_arg: field of the model's args that holds the window length
            (``sliding_window``); :func:`mlx_bricks.patch.table.lookup` copies its value into
            ``sliding_window`` for one model.
        sliding_window: the window length (keys each query sees, itself included), or None
            while unknown (sliding layers then run stock, with the reason).
        unfused: why the unified block (``BricksBlock``) does not apply to this architecture
            (None: it does); attention and MLP are then patched one by one.
        softcap: attribute of the attention module that holds the logit soft-cap
            (gemma2: ``attn_logit_softcapping``, ``cap * tanh(s / cap)``); None: no soft-cap.
        causal_array: the model passes its causal mask as mlx-lm's boolean
            ``create_causal_mask`` array (gemma2: ``return_array=True``), taken as causal.
    """

    source: str
    attention: str = "self_attn"
    mlp: str = "mlp"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"
    q_proj: str = "q_proj"
    k_proj: str = "k_proj"
    v_proj: str = "v_proj"
    o_proj: str = "o_proj"
    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    qk_norm: tuple[str, str] | None = None
    activation: str = "silu"
    sliding: str | None = None
    window_arg: str | None = None
    sliding_window: int | None = None
    unfused: str | None = None
    softcap: str | None = None
    causal_array: bool = False

    @property
    def attention_linears(self) -> tuple[str, str, str, str]:
        return (self.q_proj, self.k_proj, self.v_proj, self.o_proj)

    @property
    def mlp_linears(self) -> tuple[str, str, str]:
        return (self.gate_proj, self.up_proj, self.down_proj)


@dataclass(eq=False)
class BricksState:
    """Settings and live counters of one patched module instance.

    Attributes:
        backend: resolved backend name passed to every op (``metal``/``emulator``/...).
        layer: index of the decoder layer.
        role: ``"block"``, ``"self_attn"`` or ``"mlp"``.
        layout: the architecture's :class:`BlockLayout`.
        head_dim: attention head size (0 for an MLP).
        kv_quant: None or ``"q8_0"`` (K/V of the attention brick).
        mlp_variant: SwiGLU brick variant (None = the brick's own rule).
        dispatch: the model's dispatcher (``mlx_bricks.runtime.dispatch.Dispatch``): chooses
            brick or stock per piece and runs bricks through the first-call guard.
        calls: brick op name -> number of calls (prefill through the bricks).
        stock: reason -> number of calls that took the stock path because the bricks do not
            cover the call (decode included; a piece's reason starts with its name).
        tuned: ``"<piece>: tuned: stock faster (x0.93)"`` -> calls where a piece ran stock
            because tuning measured stock faster (a decision, not a fallback).
        memo: call shape -> the dispatcher's choices for it (see ``_choose``).
        structure: the last structure check, ``(fingerprint, reason)`` (``_structure_reason``).
        all_stock: call shape -> ``(guard generation, [(counter, reason)])`` for shapes whose
            pieces all run stock (``_stock_fast``).
    """

    backend: str
    layer: int
    role: str
    layout: BlockLayout
    head_dim: int = 0
    kv_quant: str | None = None
    mlp_variant: str | None = None
    dispatch: object = field(default=None, repr=False)
    calls: Counter = field(default_factory=Counter)
    stock: Counter = field(default_factory=Counter)
    tuned: Counter = field(default_factory=Counter)
    memo: dict = field(default_factory=dict, repr=False)
    structure: tuple | None = field(default=None, repr=False)
    all_stock: dict = field(default_factory=dict, repr=False)


# ---------------------------------------------------------------------------------------------
# Structure checks (shared by patch time and call time)
# ---------------------------------------------------------------------------------------------

def quantized_reason(name: str, module) -> str | None:
    """Why the bricks cannot read the ``nn.QuantizedLinear`` ``module`` (None if they can).

    The bricks read MLX's affine format (``mlx_bricks.formats.affine``): bits 2, 3, 4, 5, 6, 8 and
    group_size 32, 64, 128. The other modes (``mxfp4``, ``nvfp4``, ``mxfp8``: shared exponents,
    no biases) keep the stock path.
    """
    from mlx_bricks.formats.affine import MODE, QuantizedWeight

    mode = getattr(module, "mode", MODE)
    cls = "nn.QuantizedLinear" if type(module) is nn.QuantizedLinear else type(module).__name__
    what = f"{name} is {cls} ({format_name(module)})"
    if mode != MODE:
        return (f"{what}: the bricks read MLX affine weights only (mxfp4 / nvfp4 / mxfp8 keep "
                "the stock path)")
    try:
        QuantizedWeight.from_module(module).check(name)
    except (TypeError, ValueError) as e:
        return f"{what}: {e}"
    return None


def linear_reason(name: str, module, dtype=None) -> str | None:
    """Why ``module`` cannot feed a brick (None if it can).

    It can when it is a plain ``nn.Linear``, or an ``nn.QuantizedLinear`` in MLX's affine
    format (:func:`quantized_reason`), whose arrays have the input's ``dtype`` (when given):
    the bricks compute in one dtype, so a quantized weight's ``scales`` and ``biases`` (the
    dtype its tiles are dequantized to) and a layer's ``bias`` must be the activations' dtype
    (``ops.quant.check_weight``). MLX's tensor-parallel linears (``AllToShardedLinear``,
    ``ShardedToAllLinear`` and their quantized variants) count as their unsharded kinds: the
    bricks run on the local shard (``mlx_bricks.nn.sharding``). LoRA/DoRA adapters
    (``mlx_lm.tuner``), also over quantized layers, and every other layer type keep the stock
    path.
    """
    if type(module) is nn.QuantizedLinear or type(module) in QUANTIZED_SHARDED:
        r = quantized_reason(name, module)
        if r is not None:
            return r
        arrays = ("scales", "biases", "bias")
    elif type(module) is nn.Linear or is_float_sharded(module):
        arrays = ("weight", "bias")
    elif module is None:
        return f"{name} is missing"
    elif type(module).__module__.startswith("mlx_lm.tuner"):
        inner = getattr(module, "linear", None)
        over = (f" over nn.QuantizedLinear ({format_name(inner)})"
                if isinstance(inner, nn.QuantizedLinear) else "")
        return (f"{name} is {type(module).__name__}{over} (LoRA/DoRA adapter): the bricks do not "
                "apply adapters")
    else:
        return f"{name} is {type(module).__name__}, not nn.Linear or nn.QuantizedLinear"
    if dtype is not None:
        for what in arrays:
            if what in module and module[what].dtype != dtype:
                return (f"{name}.{what} is {dtype_name(module[what].dtype)} but the input is "
                        f"{dtype_name(dtype)}")
    return None


def format_name(linear) -> str:
    """A linear layer's weight format in words: ``"q4 gs64"`` for an MLX affine
    ``nn.QuantizedLinear`` (``"mxfp4 gs32"`` for another mode), the dtype name
    (``"float16"``) for an ``nn.Linear``, the class name for anything else."""
    if isinstance(linear, nn.QuantizedLinear) or type(linear) in QUANTIZED_SHARDED:
        mode = getattr(linear, "mode", "affine")
        head = f"q{linear.bits}" if mode == "affine" else mode
        return f"{head} gs{linear.group_size}"
    if isinstance(linear, nn.Linear) or is_float_sharded(linear):
        return dtype_name(linear.weight.dtype)
    return "missing" if linear is None else type(linear).__name__


def weight_formats(module, role: str, layout: "BlockLayout") -> dict[str, str]:
    """``{projection name: format_name(...)}`` of the linear layers a module of ``role``
    (``"block"``, ``"self_attn"``, ``"mlp"``) feeds its bricks from, attention ones first."""
    def child(parent, n):  # nn.Module is a dict of its children
        return parent.get(n) if isinstance(parent, dict) else None

    out = {}
    if role in ("block", "self_attn"):
        attn = child(module, layout.attention) if role == "block" else module
        out.update({n: format_name(child(attn, n)) for n in layout.attention_linears})
    if role in ("block", "mlp"):
        mlp = child(module, layout.mlp) if role == "block" else module
        out.update({n: format_name(child(mlp, n)) for n in layout.mlp_linears})
    return out


#: mlx-lm's gemma RMSNorm classes: ``mx.fast.rms_norm(x, 1 + weight, eps)`` (the checkpoint
#: stores ``w - 1``), by (module, class name).
OFFSET_RMS_NORMS = frozenset(
    (f"mlx_lm.models.{m}", "RMSNorm") for m in ("gemma", "gemma2", "gemma3_text"))


def is_offset_rms_norm(module) -> bool:
    """True for mlx-lm's gemma RMSNorm (``rms_norm(x, 1 + weight, eps)``, see
    :data:`OFFSET_RMS_NORMS`)."""
    cls = type(module)
    return (cls.__module__, cls.__name__) in OFFSET_RMS_NORMS


def norm_weight(norm):
    """The weight ``mx.fast.rms_norm`` takes for ``norm``: ``norm.weight`` for ``nn.RMSNorm``,
    ``1 + norm.weight`` (in the weight's dtype, as the gemma module computes it) for a gemma
    RMSNorm."""
    return 1.0 + norm.weight if is_offset_rms_norm(norm) else norm.weight


def rms_norm_reason(name: str, module, dtype=None) -> str | None:
    """Why ``module`` cannot be fused as an RMSNorm (None if it is a plain ``nn.RMSNorm`` or a
    gemma RMSNorm, whose weight the bricks take as ``1 + weight``: :func:`norm_weight`)."""
    if type(module) is not nn.RMSNorm and not is_offset_rms_norm(module):
        return f"{name} is {type(module).__name__}, not nn.RMSNorm"
    if dtype is not None and module.weight.dtype != dtype:
        return (f"{name}.weight is {dtype_name(module.weight.dtype)} but the input is "
                f"{dtype_name(dtype)}")
    return None


def _bias(linear):
    return linear["bias"] if "bias" in linear else None


def _first_reason(*reasons):
    for r in reasons:
        if r is not None:
            return r
    return None


_Q8KVCache: list = []  # mlx_bricks.cache.Q8KVCache, imported late (that module imports the ops)


def _is_q8_cache(cache) -> bool:
    if not _Q8KVCache:
        from mlx_bricks.cache import Q8KVCache

        _Q8KVCache.append(Q8KVCache)
    return type(cache) is _Q8KVCache[0]


def layer_window(attn, layout: BlockLayout) -> tuple[int | None, str | None]:
    """``(window, reason)`` of an attention module: ``(None, None)`` on a global layer,
    ``(layout.sliding_window, None)`` on a sliding-window layer (``layout.sliding`` set on the
    module), ``(None, reason)`` when the window length is unknown."""
    if layout.sliding is None or not getattr(attn, layout.sliding, False):
        return None, None
    if layout.sliding_window is None:
        return None, (f"sliding-window layer ({layout.sliding}=True): the model's args have no "
                      f"{layout.window_arg or 'window length'}")
    return layout.sliding_window, None


def _kv_length(cache, L: int) -> int:
    """Keys ``cache.update_and_fetch`` returns for L new tokens (``RotatingKVCache`` with
    ``keep == 0``: at most ``max_size - 1`` earlier ones, in temporal order)."""
    if cache is None:
        return L
    if type(cache) is RotatingKVCache:
        return min(cache.offset, cache.max_size - 1) + L
    return cache.offset + L


def _array_mask_reason(mask, cache, L: int, window) -> str | None:
    """On a sliding-window layer (``window`` set) or a model that passes its causal mask as an
    array (``BlockLayout.causal_array``): None when the brick's causal mask (with ``window``,
    bottom-right aligned over the keys the cache returns) computes what mlx-lm's mask does.

    mlx-lm (``base.create_attention_mask``, ``RotatingKVCache.make_mask``) gives a sliding layer
    ``"causal"`` while the window cannot exclude a key, else the 2-D boolean
    ``create_causal_mask(L, offset, window_size)`` of shape (L, keys); ``return_array=True``
    gives the same without a window. Batch padding masks are 4-D and fall back. A
    ``RotatingKVCache`` (sliding layers only) returns its keys in temporal order when
    ``keep == 0`` (``_update_concat``), which the bottom-right alignment needs."""
    caches = (KVCache, RotatingKVCache) if window is not None else (KVCache,)
    if cache is not None and type(cache) not in caches:
        names = " or ".join(c.__name__ for c in caches)
        return f"cache is {type(cache).__name__}, not {names}"
    if type(cache) is RotatingKVCache and cache.keep:
        return f"RotatingKVCache keeps {cache.keep} leading tokens: keys are not contiguous"
    if isinstance(mask, str) and mask == "causal":
        return None
    if (isinstance(mask, mx.array) and mask.dtype == mx.bool_
            and tuple(mask.shape) == (L, _kv_length(cache, L))):
        return None
    what = f"an array {tuple(mask.shape)}" if isinstance(mask, mx.array) else repr(mask)
    kind = "sliding-window" if window is not None else "causal"
    return f"mask is {what}: not mlx-lm's (L, keys) {kind} mask"


def _mask_key(mask, cache, L: int):
    """The mask as a call-shape key: an accepted array mask by its key count."""
    return ("array", _kv_length(cache, L)) if isinstance(mask, mx.array) else mask


def _call_reason(x, mask, cache, args, kwargs, window=None, causal_array=False) -> str | None:
    """Per-call conditions shared by attention and block (cheap checks first); ``window``:
    the layer's sliding window (:func:`layer_window`), ``causal_array``: the layout's (both
    accept mlx-lm's array masks, :func:`_array_mask_reason`)."""
    if args or kwargs:
        extra = [f"{len(args)} extra positional"] if args else []
        extra += sorted(kwargs)
        return f"extra call arguments ({', '.join(extra)}): passed to the stock path"
    if not isinstance(x, mx.array) or x.ndim != 3:
        return "input is not a (B, L, D) array"
    if x.shape[1] == 1:
        return DECODE
    if x.dtype not in FLOAT_DTYPES:
        return f"input dtype {dtype_name(x.dtype)} is not float16/bfloat16/float32"
    if window is not None or causal_array:
        return _array_mask_reason(mask, cache, x.shape[1], window)
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        what = "an array" if isinstance(mask, mx.array) else repr(mask)
        return f"mask is {what} (sliding window or padding): the attention brick takes causal only"
    if cache is not None and type(cache) is not KVCache and not _is_q8_cache(cache):
        return f"cache is {type(cache).__name__}, not KVCache or Q8KVCache"
    return None


def sharding_reason(module, layout: BlockLayout, part: str) -> str | None:
    """Why the tensor-parallel sharding of an attention (``part="attention"``) or MLP
    (``"mlp"``) module's linears is not mlx-lm's (None: plain, or q/k/v and gate/up
    column-sharded and o/down row-sharded; ``mlx_bricks.nn.sharding.role_reason``)."""
    if part == "attention":
        return role_reason((layout.q_proj, layout.k_proj, layout.v_proj), (layout.o_proj,),
                           module)
    return role_reason((layout.gate_proj, layout.up_proj), (layout.down_proj,), module)


def _attention_reason(attn, layout: BlockLayout, dtype) -> str | None:
    reasons = (linear_reason(n, getattr(attn, n, None), dtype) for n in layout.attention_linears)
    r = _first_reason(*reasons) or sharding_reason(attn, layout, "attention")
    if r is None and layout.qk_norm is not None:
        r = _first_reason(*(rms_norm_reason(n, getattr(attn, n, None), dtype)
                            for n in layout.qk_norm))
    return r


def _mlp_reason(mlp, layout: BlockLayout, dtype) -> str | None:
    return _first_reason(*(linear_reason(n, getattr(mlp, n, None), dtype)
                           for n in layout.mlp_linears)) or sharding_reason(mlp, layout, "mlp")


def _block_reason(block, layout: BlockLayout, dtype) -> str | None:
    return _first_reason(
        rms_norm_reason(layout.input_norm, getattr(block, layout.input_norm), dtype),
        rms_norm_reason(layout.post_attention_norm, getattr(block, layout.post_attention_norm),
                        dtype),
        _attention_reason(getattr(block, layout.attention), layout, dtype),
        _mlp_reason(getattr(block, layout.mlp), layout, dtype),
    )


_STRUCTURE_CHECKS = {"block": _block_reason, "self_attn": _attention_reason,
                     "mlp": _mlp_reason}
def _fingerprint(module, names, out: list) -> None:
    """Append the identity of each child ``names`` of ``module`` and of its weight array (and
    scales: ``set_dtype`` casts a quantized layer's scales but not its packed uint32 weight)
    to ``out`` (plain dict lookups: ``nn.Module`` is a dict of its children and arrays). A
    layer swapped (LoRA, ``nn.quantize``) or its arrays replaced (``set_dtype``,
    ``load_weights``) changes it."""
    get = module.get
    for n in names:
        child = get(n)
        out.append(id(child))
        if child is not None:
            out.append(id(child.get("weight")))
            out.append(id(child.get("scales")))


def _structure_reason(module, state: "BricksState", dtype) -> str | None:
    """Why the module's current structure cannot run the bricks for ``dtype`` (None: it can).

    The full check (module types, weight dtypes) runs again only when the layers or arrays it
    looked at are other objects than last time (LoRA adapters attached, ``nn.quantize``,
    ``set_dtype``, ``load_weights``): comparing their identities costs a few microseconds per
    call, the checks themselves far more.
    """
    lay = state.layout
    token: list = [dtype]
    if state.role == "block":
        _fingerprint(module, (lay.input_norm, lay.post_attention_norm, lay.attention, lay.mlp),
                     token)
        attn, mlp = module.get(lay.attention), module.get(lay.mlp)
    else:
        attn = mlp = module
    if state.role != "mlp" and isinstance(attn, dict):
        _fingerprint(attn, lay.attention_linears + (lay.qk_norm or ()), token)
    if state.role != "self_attn" and isinstance(mlp, dict):
        _fingerprint(mlp, lay.mlp_linears, token)
    token = tuple(token)
    if state.structure is not None and state.structure[0] == token:
        return state.structure[1]
    reason = _STRUCTURE_CHECKS[state.role](module, lay, dtype)
    state.structure = (token, reason)
    return reason


# ---------------------------------------------------------------------------------------------
# The prefill computation, piece by piece
# ---------------------------------------------------------------------------------------------

def _heads(y, B, L, n):
    return y.reshape(B, L, n, -1).transpose(0, 2, 1, 3)


def _weight(linear):
    """The weight a brick takes from a linear layer: the array, or a ``QuantizedWeight`` for an
    ``nn.QuantizedLinear`` or a quantized tensor-parallel linear (the tuner keys and times it
    by its format; the stock path calls the layer itself)."""
    if isinstance(linear, nn.QuantizedLinear) or type(linear) in QUANTIZED_SHARDED:
        from mlx_bricks.formats.affine import QuantizedWeight

        return QuantizedWeight.from_module(linear)
    return linear.weight


def _linear_args(linear, x, residual=None) -> dict:
    """The ``linear`` piece's arguments. For a row-sharded layer the brick computes the local
    partial product only: bias and residual come after the ``all_sum`` (:func:`_finish`)."""
    if is_row_sharded(linear):
        return {"x": x, "weight": _weight(linear), "bias": None, "residual": None}
    return {"x": x, "weight": _weight(linear), "bias": _bias(linear), "residual": residual}


def _finish(linear, y, residual=None):
    """The output of an output projection (o, down) from its piece's output ``y``: for a
    row-sharded layer ``y`` is this rank's partial product, reduced as the stock layer does
    (``all_sum``, bias, then the residual once); otherwise ``y`` is already complete."""
    return reduce_partial(linear, y, residual) if is_row_sharded(linear) else y


def _partial(linear, x):
    """A row-sharded layer's local product as its stock forward computes it (``x @ W.T`` on
    the local shard, before the ``all_sum``; ``mx.quantized_matmul`` for a quantized one)."""
    if "scales" in linear:
        return mx.quantized_matmul(x, linear["weight"], scales=linear["scales"],
                                   biases=linear.get("biases"), transpose=True,
                                   group_size=linear.group_size, bits=linear.bits,
                                   mode=linear.mode)
    return x @ linear["weight"].T


def _out_stock(linear, x, residual=None):
    """The stock path of an output-projection piece: mlx-lm's ``residual + linear(x)``; for a
    row-sharded layer the piece's value is the local partial product (:func:`_finish` reduces
    it)."""
    if is_row_sharded(linear):
        return _partial(linear, x)
    y = linear(x)
    return y if residual is None else residual + y


def _mlp_stock(mlp, layout: BlockLayout, x, residual=None, call=None):
    """The stock path of the MLP piece: mlx-lm's ``residual + mlp(x)`` (``call``: the MLP's
    stock ``__call__``, default ``mlp`` itself); with a row-sharded down projection, mlx-lm's
    ``swiglu(gate_proj(x), up_proj(x))`` (``gelu_approx(gate) * up`` for the layout's
    ``gelu_tanh``, as mlx-lm's gemma MLPs) times the local down shard, before the ``all_sum``
    (:func:`_finish`)."""
    down = getattr(mlp, layout.down_proj)
    if is_row_sharded(down):
        g, u = getattr(mlp, layout.gate_proj)(x), getattr(mlp, layout.up_proj)(x)
        act = nn.gelu_approx(g) * u if layout.activation == "gelu_tanh" else swiglu(g, u)
        return _partial(down, act)
    y = (call or mlp)(x)
    return y if residual is None else residual + y


def _softcap(attn, layout: BlockLayout):
    return getattr(attn, layout.softcap) if layout.softcap is not None else None


def _masking(attn, layout: BlockLayout, mask, window) -> dict:
    """The brick's masking arguments for mlx-lm's ``mask`` (already accepted by
    :func:`_call_reason`): an array mask is causal (with the layer's ``window``, if any), plus
    the layout's soft-cap."""
    out = {"mask": "causal" if isinstance(mask, mx.array) else mask}
    if window is not None:
        out["window"] = window
    softcap = _softcap(attn, layout)
    if softcap is not None:
        out["softcap"] = softcap
    return out


def _attention_args(attn, state: BricksState, B, L, cache, dtype, mask, window=None) -> dict:
    """Arguments of the attention piece before q/k/v exist (shapes only): keys are the ones
    the cache returns (the cached ones plus this chunk's); masking by :func:`_masking`."""
    hd = state.head_dim
    kv = Act((B, attn.n_kv_heads, _kv_length(cache, L), hd), dtype)
    args = {"q": Act((B, attn.n_heads, L, hd), dtype), "k": kv, "v": kv, "scale": attn.scale,
            "kv_quant": state.kv_quant}
    args.update(_masking(attn, state.layout, mask, window))
    return args


def _mlp_args(mlp, layout: BlockLayout, x, residual=None) -> dict:
    gate, up, down = (getattr(mlp, n) for n in layout.mlp_linears)
    if is_row_sharded(down):  # partial product only: b_down and residual after the all_sum
        b_down, residual = None, None
    else:
        b_down = _bias(down)
    args = {"x": x, "w_gate": _weight(gate), "w_up": _weight(up), "w_down": _weight(down),
            "b_gate": _bias(gate), "b_up": _bias(up), "b_down": b_down,
            "residual": residual}
    if layout.activation != "silu":  # SiLU MLPs keep their arguments (and tuning keys)
        args["activation"] = layout.activation
    return args


#: Call shapes whose choices a module remembers (chunked prefill adds one per chunk offset).
_MEMO_SIZE = 64


def _choose(state: BricksState, shape_key: tuple, pieces) -> dict:
    """``{piece: Choice}`` for the call shape ``shape_key``; ``pieces()`` builds
    ``{piece: (op kind, args)}`` (activations may be ``Act`` placeholders) when the choices are
    not remembered yet. Remembered per module and call shape, so a prefill call pays a dict
    lookup, not the dispatcher; forgotten when the guard disables a variant."""
    d = state.dispatch
    hit = state.memo.get(shape_key)
    if hit is not None and hit[0] == d.generation:
        return hit[1]
    choices = {name: d.choose(kind, args) for name, (kind, args) in pieces().items()}
    if len(state.memo) >= _MEMO_SIZE:
        state.memo.clear()
    state.memo[shape_key] = (d.generation, choices)
    return choices


def _stock_count(state: BricksState, name: str, choice) -> tuple:
    """``(counter, reason)`` a stock run of piece ``name`` is counted under."""
    return (state.tuned if choice.tuned else state.stock), f"{name}: {choice.reason}"


def _count_stock(state: BricksState, name: str, choice) -> None:
    counter, reason = _stock_count(state, name, choice)
    counter[reason] += 1


def _all_stock(state: BricksState, choices: dict, shape_key=None) -> bool:
    """True (and every piece counted) when no piece runs a brick; remembered for
    ``_stock_fast`` under ``shape_key``."""
    if any(c.brick for c in choices.values()):
        return False
    counts = [_stock_count(state, name, c) for name, c in choices.items()]
    for counter, reason in counts:
        counter[reason] += 1
    if shape_key is not None:
        if len(state.all_stock) >= _MEMO_SIZE:
            state.all_stock.clear()
        state.all_stock[shape_key] = (state.dispatch.generation, counts)
    return True


def _stock_fast(state: BricksState, shape_key) -> bool:
    """True (and counted as before) when every piece of this call shape ran stock last time:
    the module's own code then runs without the structure check or the dispatcher, whose
    Python cost (tens of microseconds per layer) would otherwise make an all-stock model
    measurably slower than stock at short prompts. The stock path is right for any structure;
    a guard change (new generation) or re-patching forgets it."""
    hit = state.all_stock.get(shape_key)
    if hit is None or hit[0] != state.dispatch.generation:
        return False
    for counter, reason in hit[1]:
        counter[reason] += 1
    return True


def _piece(state: BricksState, name: str, choice, kind: str, args, stock, brick: str):
    """One piece: its brick on ``args()`` (through the dispatcher's guard) or ``stock()``,
    counted. ``args`` builds the op's arguments; it is called only when the brick runs."""
    if not choice.brick:
        _count_stock(state, name, choice)
        return stock()
    out, failed = state.dispatch.run(choice, kind, args(), stock)
    if failed is None:
        state.calls[brick] += 1
    else:
        state.stock[f"{name}: {failed}"] += 1
    return out


def _attend(attn, state: BricksState, choice, args, q, k, v, mask, cache, window=None):
    """Per-head norms, RoPE, KV-cache update and the attention piece; q/k/v in head layout;
    ``args()`` builds the piece's arguments without q/k/v (called only for the brick);
    ``window``: the layer's sliding window (the stock path uses mlx-lm's ``mask`` as given).

    Returns (B, L, n_heads * head_dim), ready for the out-projection.
    """
    B, _, L, _ = q.shape
    if state.layout.qk_norm is not None:
        # RMSNorm over head_dim: the same rows whether heads come before or after L.
        q_norm, k_norm = (getattr(attn, n) for n in state.layout.qk_norm)
        q, k = q_norm(q), k_norm(k)
    # The module's own rope object with mlx-lm's offset keeps every rope class correct.
    if cache is not None:
        q = attn.rope(q, offset=cache.offset)
        k = attn.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        if _is_q8_cache(cache):  # k, v are (qs, d): only the Q8_0 readers take them
            from mlx_bricks.cache import q8_0_cache_attention

            state.calls["q8_0_cache_attention"] += 1
            o = q8_0_cache_attention(q, k, v, scale=attn.scale, mask=mask, backend=cache.backend)
            return o.transpose(0, 2, 1, 3).reshape(B, L, -1)
    else:
        q = attn.rope(q)
        k = attn.rope(k)

    def stock():
        if state.kv_quant is not None or state.layout.softcap is not None:
            # the requested Q8_0 K/V, or a soft-cap mlx-lm's attention function does not
            # apply: the brick's MLX-ops reference
            from mlx_bricks.bricks.attention.msl import flash_attention_reference

            return flash_attention_reference(q, k, v, scale=attn.scale, kv_quant=state.kv_quant,
                                             **_masking(attn, state.layout, mask, window))
        return scaled_dot_product_attention(q, k, v, cache=cache, scale=attn.scale, mask=mask)

    o = _piece(state, "attention", choice, "attention", lambda: dict(args(), q=q, k=k, v=v),
               stock, "flash_attention")
    return o.transpose(0, 2, 1, 3).reshape(B, L, -1)


# ---------------------------------------------------------------------------------------------
# The mixins
# ---------------------------------------------------------------------------------------------

def _admit(module, state: BricksState, attn, x, mask, cache, args, kwargs):
    """The call checks shared by the attention and block mixins (``attn``: the attention
    module, ``module`` itself for the attention mixin).

    Returns ``(stock, window, shape_key, q8)``: ``stock`` True when the call runs the module's
    own code, either counted with its reason here or through the all-stock fast path
    (:func:`_stock_fast`); otherwise the layer's sliding window, the call-shape key of the
    dispatcher's memos and whether the cache is a ``Q8KVCache`` (whose attention is the Q8_0
    readers, untuned).
    """
    window, reason = layer_window(attn, state.layout)
    reason = reason or _call_reason(x, mask, cache, args, kwargs, window,
                                    state.layout.causal_array)
    shape_key = q8 = None
    if reason is None:
        offset = cache.offset if cache is not None else 0
        q8 = cache is not None and _is_q8_cache(cache)
        shape_key = (x.shape, x.dtype, offset, _mask_key(mask, cache, x.shape[1]), q8)
        if _stock_fast(state, shape_key):
            return True, window, shape_key, q8
        reason = _structure_reason(module, state, x.dtype)
    if reason is not None:
        state.stock[reason] += 1
        return True, window, shape_key, q8
    return False, window, shape_key, q8


class BricksAttention:
    """Attention with prefill on the GEMM and attention bricks (mixin over mlx-lm's Attention).

    Prefill pieces: ``q_proj``/``k_proj``/``v_proj`` (``linear``, biases kept), per-head q/k
    RMSNorm when the layout has it, the module's rope at ``cache.offset``,
    ``cache.update_and_fetch``, ``attention`` (``flash_attention``, causal, bottom-right aligned
    when the cache already holds tokens), ``o_proj`` (``linear``). Each linear piece and the
    attention piece run brick or stock (the module's own layer, mlx-lm's attention function)
    as the dispatcher decides; all stock runs the original ``__call__``.
    Call signature as mlx-lm's: ``(x: (B, L, D), mask=None | "causal" | array, cache=None)``.
    """

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        state = self._bricks_state
        lay = state.layout
        stock, window, shape_key, q8 = _admit(self, state, self, x, mask, cache, args, kwargs)
        if stock:
            return super().__call__(x, mask, cache, *args, **kwargs)
        B, L, _ = x.shape
        qp, kp, vp, op = (self[n] for n in lay.attention_linears)

        def attention_args():
            return _attention_args(self, state, B, L, cache, x.dtype, mask, window)

        def pieces():
            o = Act((B, L, self.n_heads * state.head_dim), x.dtype)
            return {"q_proj": ("linear", _linear_args(qp, x)),
                    "k_proj": ("linear", _linear_args(kp, x)),
                    "v_proj": ("linear", _linear_args(vp, x)),
                    **({} if q8 else {"attention": ("attention", attention_args())}),
                    "o_proj": ("linear", _linear_args(op, o))}

        choices = _choose(state, shape_key, pieces)
        if _all_stock(state, choices, shape_key):
            return super().__call__(x, mask, cache)

        def proj(name, layer, n):
            y = _piece(state, name, choices[name], "linear", lambda: _linear_args(layer, x),
                       lambda: layer(x), "linear")
            return _heads(y, B, L, n)

        q = proj("q_proj", qp, self.n_heads)
        k = proj("k_proj", kp, self.n_kv_heads)
        v = proj("v_proj", vp, self.n_kv_heads)
        o = _attend(self, state, choices.get("attention"), attention_args, q, k, v, mask,
                    cache, window)
        y = _piece(state, "o_proj", choices["o_proj"], "linear", lambda: _linear_args(op, o),
                   lambda: _out_stock(op, o), "linear")
        return _finish(op, y)


class BricksMLP:
    """SwiGLU MLP with prefill on the SwiGLU brick (mixin over mlx-lm's MLP).

    Prefill: one piece, ``swiglu_mlp(x, gate, up, down)`` with biases when the layers have
    them, or the original ``__call__`` when the dispatcher chooses stock.
    Call signature as mlx-lm's: ``(x: (..., L, D))``.
    """

    def __call__(self, x, *args, **kwargs):
        state = self._bricks_state
        if args or kwargs:
            reason = f"extra call arguments ({len(args)} positional, {sorted(kwargs)}): stock"
        elif not isinstance(x, mx.array) or x.ndim < 2:
            reason = "input is not a (..., L, D) array"
        elif x.shape[-2] == 1:
            reason = DECODE
        elif x.dtype not in FLOAT_DTYPES:
            reason = f"input dtype {dtype_name(x.dtype)} is not float16/bfloat16/float32"
        elif _stock_fast(state, (x.shape, x.dtype)):
            return super().__call__(x)
        else:
            reason = _structure_reason(self, state, x.dtype)
        if reason is not None:
            state.stock[reason] += 1
            return super().__call__(x, *args, **kwargs)
        choices = _choose(state, (x.shape, x.dtype),
                          lambda: {"mlp": ("swiglu_mlp", _mlp_args(self, state.layout, x))})
        if _all_stock(state, choices, (x.shape, x.dtype)):
            return super().__call__(x)
        down = getattr(self, state.layout.down_proj)
        y = _piece(state, "mlp", choices["mlp"], "swiglu_mlp",
                   lambda: _mlp_args(self, state.layout, x),
                   lambda: _mlp_stock(self, state.layout, x,
                                      call=super(BricksMLP, self).__call__), "swiglu_mlp")
        return _finish(down, y)


class BricksBlock:
    """The unified prefill block (mixin over a standard pre-norm mlx-lm TransformerBlock).

    Prefill, for x (B, L, D), in four pieces::

        qkv:       q, k, v = rms_norm_qkv(x, input_norm, Wq, Wk, Wv)   # head layout (B, H, L, hd)
                   q, k    = q_norm(q), k_norm(k)                       # qwen3 only
                   q, k    = rope(q, k, offset=cache.offset); k, v = cache.update_and_fetch(k, v)
        attention: o       = flash_attention(q, k, v, causal)
        o_proj:    h       = linear(o, Wo, residual=x)
        mlp:       out     = swiglu_mlp(rms_norm(h, post_attention_norm), W_gate, W_up, W_down,
                                        residual=h)

    Each piece runs its brick or the stock path as the dispatcher decides; the stock path of a
    piece is mlx-lm's: ``input_layernorm`` then ``q_proj``/``k_proj``/``v_proj``; mlx-lm's
    ``scaled_dot_product_attention``; ``x + o_proj(o)``; ``h + mlp(post_attention_layernorm(h))``.
    When every piece is stock the block's own ``__call__`` runs. Decode, array masks, caches
    other than ``KVCache`` and modules that are not plain ``nn.Linear`` / affine
    ``nn.QuantizedLinear`` / ``nn.RMSNorm`` run the block's own ``__call__`` (counted with the
    reason). A quantized projection reaches its brick as a ``QuantizedWeight`` (packed weight,
    scales, biases, group_size, bits); q, k and v may each have their own format.
    Source: ``TransformerBlock``/``Attention``/``MLP`` of mlx-lm 0.32's ``models/llama.py``,
    ``qwen2.py``, ``qwen3.py``; the same math with the pieces fused into the bricks.
    """

    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        state = self._bricks_state
        lay = state.layout
        attn = self[lay.attention]
        stock, window, shape_key, q8 = _admit(self, state, attn, x, mask, cache, args, kwargs)
        if stock:
            return super().__call__(x, mask, cache, *args, **kwargs)

        B, L, D = x.shape
        mlp = self[lay.mlp]
        qp, kp, vp, op = (attn[n] for n in lay.attention_linears)
        norm, post = self[lay.input_norm], self[lay.post_attention_norm]

        def qkv_args():
            return {"x": x, "norm_weight": norm_weight(norm), "eps": norm.eps, "wq": _weight(qp),
                    "wk": _weight(kp), "wv": _weight(vp), "bq": _bias(qp), "bk": _bias(kp),
                    "bv": _bias(vp), "n_heads": attn.n_heads, "n_kv_heads": attn.n_kv_heads,
                    "head_dim": state.head_dim}

        def attention_args():
            return _attention_args(attn, state, B, L, cache, x.dtype, mask, window)

        def pieces():
            h = Act((B, L, D), x.dtype)
            o = Act((B, L, attn.n_heads * state.head_dim), x.dtype)
            return {"qkv": ("rms_norm_qkv", qkv_args()),
                    **({} if q8 else {"attention": ("attention", attention_args())}),
                    "o_proj": ("linear", _linear_args(op, o, residual=x)),
                    "mlp": ("swiglu_mlp", _mlp_args(mlp, lay, h, h))}

        choices = _choose(state, shape_key, pieces)
        if _all_stock(state, choices, shape_key):
            return super().__call__(x, mask, cache)

        def stock_qkv():
            h = norm(x)
            return (_heads(qp(h), B, L, attn.n_heads), _heads(kp(h), B, L, attn.n_kv_heads),
                    _heads(vp(h), B, L, attn.n_kv_heads))

        q, k, v = _piece(state, "qkv", choices["qkv"], "rms_norm_qkv", qkv_args, stock_qkv,
                         "rms_norm_qkv")
        o = _attend(attn, state, choices.get("attention"), attention_args, q, k, v, mask,
                    cache, window)
        # A row-sharded o/down: the piece gives the local partial product; _finish all-sums
        # it, adds the bias, then the residual once (as the stock layer and block do).
        h = _finish(op, _piece(state, "o_proj", choices["o_proj"], "linear",
                               lambda: _linear_args(op, o, residual=x),
                               lambda: _out_stock(op, o, x), "linear"), x)
        hn = post(h)  # nn.RMSNorm: mx.fast.rms_norm(h, weight, eps), as the brick path needs
        y = _piece(state, "mlp", choices["mlp"], "swiglu_mlp",
                   lambda: _mlp_args(mlp, lay, hn, h), lambda: _mlp_stock(mlp, lay, hn, h),
                   "swiglu_mlp")
        return _finish(mlp[lay.down_proj], y, h)


MIXINS = (BricksAttention, BricksMLP, BricksBlock)

_CLASSES: dict[tuple[type, type], type] = {}


def bricks_class(mixin: type, base: type) -> type:
    """The class ``(mixin, base)`` an instance of ``base`` is switched to (built once per pair).

    Raises:
        TypeError: ``mixin`` is not one of ``MIXINS`` or ``base`` is not an ``nn.Module`` class.
    """
    if mixin not in MIXINS:
        raise TypeError(f"mixin must be one of {[m.__name__ for m in MIXINS]}, got {mixin!r}")
    if not (isinstance(base, type) and issubclass(base, nn.Module)):
        raise TypeError(f"base must be an nn.Module subclass, got {base!r}")
    if issubclass(base, MIXINS):
        raise TypeError(f"base {base.__name__} is already a bricks class")
    key = (mixin, base)
    if key not in _CLASSES:
        short = base.__module__.rsplit(".", 1)[-1]
        _CLASSES[key] = type(f"{mixin.__name__}_{short}_{base.__name__}", (mixin, base),
                             {"_bricks_base": base, "__module__": __name__})
    return _CLASSES[key]


def is_patched(module) -> bool:
    """True if ``module``'s class was switched to a bricks class."""
    return isinstance(module, MIXINS)


def attach(module: nn.Module, mixin: type, state: BricksState) -> nn.Module:
    """Switch ``module`` (this instance only) to ``bricks_class(mixin, type(module))``.

    Parameters stay the same arrays under the same names. Returns ``module``.

    Raises:
        TypeError: ``state`` is not a :class:`BricksState`, or see :func:`bricks_class`.
        ValueError: ``module`` is already patched (call :func:`detach` first).
    """
    if not isinstance(state, BricksState):
        raise TypeError(f"state must be a BricksState, got {type(state).__name__}")
    if is_patched(module):
        raise ValueError(f"module {type(module).__name__} is already patched; detach it first")
    cls = bricks_class(mixin, type(module))
    module.__class__ = cls
    # object.__setattr__: keep the state out of the parameter tree (nn.Module is a dict).
    object.__setattr__(module, "_bricks_state", state)
    return module


def detach(module: nn.Module) -> bool:
    """Give ``module`` back its original class; returns False if it was not patched."""
    if not is_patched(module):
        return False
    module.__class__ = type(module)._bricks_base
    module.__dict__.pop("_bricks_state", None)
    return True
