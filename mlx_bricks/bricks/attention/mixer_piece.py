"""The attention brick's piece for attention modules that are a layer's one token mixer
(nemotron_h's ``NemotronHAttention``: its layers hold a single ``mixer`` that is Mamba-2,
attention, an MLP or a MoE block, so the patch table's block layout has no slot for it):
patched by module (``patch.modules.MIXERS``), its prefill split into pieces: ``q_proj``,
``k_proj``, ``v_proj`` and ``o_proj`` on the ``linear`` kind and the causal GQA core on the
``attention`` kind; the cache write is the module's own (``update_and_fetch``).

The forms it follows (:data:`FORMS`, mlx-lm 0.32.2): q/k/v/o projections into heads of one
width, no positional encoding (NoPE: Nemotron-H's attention layers), no norms, the
``scale`` attribute, ``scaled_dot_product_attention`` with the model's mask. A call with a
mask other than ``"causal"`` or a cache other than ``KVCache`` runs stock with the reason;
decode (L == 1) is the module's own step.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.attention.msl import SUPPORTED_HEAD_DIMS
from mlx_bricks.bricks.attention.piece import KIND as ATTENTION
from mlx_bricks.bricks.gemm import piece as linear_piece
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.runtime.kind import Act

LINEAR = linear_piece.KIND
#: The mixer's name in reports.
MIXER = "attention (NoPE, q/k/v/o)"
#: ``"<module>.<Class>"`` -> ``(heads attribute, kv heads attribute)``.
FORMS = {"nemotron_h.NemotronHAttention": ("num_heads", "num_key_value_heads")}
#: The forwards this piece was read against (``patch.vetted`` fingerprints).
VETTED = ("mlx_lm.models.nemotron_h.NemotronHAttention.__call__=338df09262ad",)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def base_class(module) -> type:
    """``module``'s mlx-lm class (a patched module's class is the bricks class over it)."""
    return getattr(type(module), "_bricks_base", type(module))


def _name(cls) -> str:
    return f"{cls.__module__.removeprefix('mlx_lm.models.')}.{cls.__qualname__}"


def heads(m) -> tuple[int, int, int]:
    """``(heads, kv heads, head_dim)`` of module ``m``."""
    h, kv = FORMS[_name(base_class(m))]
    return getattr(m, h), getattr(m, kv), m.head_dim


class AttentionMixerPiece:
    """An attention module as a mixer of several pieces (``nn.mixer``'s protocol; module
    docstring)."""

    name = MIXER
    role = "attention"
    kind = ATTENTION
    bricks = (LINEAR.op_name, ATTENTION.op_name)
    watched = ()
    call_names = ("mask", "cache")
    vetted = VETTED
    #: Its attention core is counted by ``patch.coverage`` as any q/k/v attention's.
    attention_core = True

    def matches(self, module) -> bool:
        """A module of a :data:`FORMS` class or derived from one (a subclass is reported stock:
        its forward is not vetted)."""
        return isinstance(module, nn.Module) and any(
            _name(c) in FORMS for c in base_class(module).__mro__)

    def reason(self, module, layout=None, dtype=None) -> str | None:
        cls = base_class(module)
        if _name(cls) not in FORMS:
            return f"{cls.__module__}.{cls.__name__}: an attention forward the patch does not know"
        for n in PROJECTIONS:
            if not isinstance(module.get(n), nn.Module):
                return f"{n} is missing"
        for n in (*FORMS[_name(cls)], "head_dim"):
            v = getattr(module, n, None)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                return f"{n} is not a positive int"
        H, kv, D = heads(module)
        if H % kv:
            return f"heads {H} are not a multiple of the key/value heads {kv}"
        if D not in SUPPORTED_HEAD_DIMS:
            return (f"head_dim {D} is not one of the attention brick's "
                    f"({', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
        if not isinstance(getattr(module, "scale", None), (int, float)):
            return "scale is not a number"
        if dtype is not None and dtype not in FLOAT_DTYPES:
            return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
        return None

    def linears(self, layout=None, module=None) -> tuple[str, ...]:
        return PROJECTIONS

    def stage_names(self, module, dtype) -> tuple[str, ...]:
        """The projections, all ``linear`` pieces (for ``patch.coverage``)."""
        return PROJECTIONS

    def call_reason(self, module, inputs, call) -> str | None:
        """Why this call's mask or cache is not one the piece follows (None: it is)."""
        from mlx_lm.models.cache import KVCache

        mask, cache = call["mask"], call["cache"]
        if not (isinstance(mask, str) and mask == "causal"):
            what = f"an array {tuple(mask.shape)}" if isinstance(mask, mx.array) else repr(mask)
            return f"mask is {what}, not \"causal\""
        if cache is not None and type(cache) is not KVCache:
            return f"cache is {type(cache).__name__}, not KVCache"
        return None

    def shape_key(self, module, inputs, call) -> tuple:
        cache = call["cache"]
        return (inputs.shape, inputs.dtype, 0 if cache is None else cache.offset)

    def pieces(self, module, inputs, call) -> dict:
        """Every piece of this call shape with its arguments as shapes."""
        B, L, _ = inputs.shape
        dt = inputs.dtype
        H, kv, D = heads(module)
        cache = call["cache"]
        S = L + (0 if cache is None else cache.offset)
        ins = {"o_proj": Act((B, L, H * D), dt)}
        out = {n: (LINEAR, linear_piece.linear_args(module[n], ins.get(n, inputs)))
               for n in PROJECTIONS}
        out["attention"] = (ATTENTION, {
            "q": Act((B, H, L, D), dt), "k": Act((B, kv, S, D), dt), "v": Act((B, kv, S, D), dt),
            "scale": module.scale, "mask": "causal", "kv_quant": None})
        return out

    def forward(self, module, inputs, call, run):
        """The module's output for a prefill call (admitted by :meth:`call_reason`): its
        ``__call__`` with each projection and the core through ``run``."""
        from mlx_lm.models.base import scaled_dot_product_attention

        m, x = module, inputs
        mask, cache = call["mask"], call["cache"]
        B, L, _ = x.shape
        H, kv, D = heads(m)

        def linear(name, a):
            layer = m[name]
            return run(name, LINEAR, lambda: linear_piece.linear_args(layer, a),
                       lambda: layer(a))

        q = linear("q_proj", x).reshape(B, L, H, -1).transpose(0, 2, 1, 3)
        k = linear("k_proj", x).reshape(B, L, kv, -1).transpose(0, 2, 1, 3)
        v = linear("v_proj", x).reshape(B, L, kv, -1).transpose(0, 2, 1, 3)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        o = run("attention", ATTENTION,
                lambda: {"q": q, "k": k, "v": v, "scale": m.scale, "mask": "causal",
                         "kv_quant": None},
                lambda: scaled_dot_product_attention(q, k, v, cache=cache, scale=m.scale,
                                                     mask=mask))
        o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
        layer = m.o_proj
        y = run("o_proj", LINEAR, lambda: linear_piece.linear_args(layer, o),
                lambda: linear_piece.out_stock(layer, o))
        return linear_piece.finish(layer, y)


ATTENTION_MIXER_PIECE = AttentionMixerPiece()
