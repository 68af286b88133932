"""The attention brick's piece for attention modules that are a layer's one token mixer
(nemotron_h's ``NemotronHAttention``, plamo2's ``Attention``: their layers hold a single
``mixer`` that may be Mamba-2, attention, an MLP or a MoE block, so the patch table's block
layout has no slot for them): patched by module (``patch.modules.MIXERS``), the prefill split
into pieces: the projections on the ``linear`` kind and the causal GQA core on the
``attention`` kind; norms, RoPE and the cache write (``update_and_fetch``) are the module's
own code in its order.

The forms it follows (:data:`FORMS`, mlx-lm 0.32.2): nemotron_h's q/k/v/o projections with no
positional encoding (NoPE) and mlx-lm's ``scaled_dot_product_attention``; plamo2's fused
``qkv_proj``, per-head q/k RMS norms (weightless, times ``q_weight`` / ``k_weight``), RoPE at
the cache offset and ``mx.fast.scaled_dot_product_attention``. A call with a mask other than
``"causal"`` or a cache other than ``KVCache`` runs stock with the reason; decode (L == 1) is
the module's own step.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.attention.msl import SUPPORTED_HEAD_DIMS
from mlx_bricks.bricks.attention.piece import KIND as ATTENTION
from mlx_bricks.bricks.gemm import piece as linear_piece
from mlx_bricks.bricks.gemm.piece import run_linear, run_out
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.runtime.kind import Act
from mlx_bricks.runtime.classes import base_class, class_key

LINEAR = linear_piece.KIND
#: The mixer's name in reports.
MIXER = "attention (a layer's one mixer)"
@dataclass(frozen=True)
class Form:
    """How a known attention mixer computes (read in mlx-lm 0.32.2).

    Attributes:
        heads, kv_heads, head_dim: its attributes holding them.
        fused: q, k and v from one ``qkv_proj`` (split in that order), else ``q_proj``,
            ``k_proj``, ``v_proj``.
        plamo2: per-head weightless RMS norms of q and k (eps 1e-6) times ``q_weight`` /
            ``k_weight``, then ``rope`` at the cache offset, the core
            ``mx.fast.scaled_dot_product_attention``; else none of these and mlx-lm's
            ``scaled_dot_product_attention``.
        fingerprint: the vetted ``__call__`` (``patch.vetted``).
    """

    heads: str
    kv_heads: str
    head_dim: str
    fused: bool
    plamo2: bool
    fingerprint: str

    @property
    def projections(self) -> tuple[str, ...]:
        return ("qkv_proj", "o_proj") if self.fused else ("q_proj", "k_proj", "v_proj", "o_proj")


#: ``"<module>.<Class>"`` -> its form.
FORMS = {
    "nemotron_h.NemotronHAttention": Form(
        "num_heads", "num_key_value_heads", "head_dim", fused=False, plamo2=False,
        fingerprint="mlx_lm.models.nemotron_h.NemotronHAttention.__call__=338df09262ad"),
    "plamo2.Attention": Form(
        "q_num_heads", "k_num_heads", "qk_dim", fused=True, plamo2=True,
        fingerprint="mlx_lm.models.plamo2.Attention.__call__=b06b446eed8b"),
}
#: Every linear child the piece may read (the structure fingerprint).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")


def form_of(m) -> Form | None:
    """The :data:`FORMS` entry of ``m``'s exact class, or None."""
    return FORMS.get(class_key(base_class(m)))


def heads(m) -> tuple[int, int, int]:
    """``(heads, kv heads, head_dim)`` of module ``m``."""
    f = form_of(m)
    return getattr(m, f.heads), getattr(m, f.kv_heads), getattr(m, f.head_dim)


class AttentionMixerPiece:
    """An attention module as a mixer of several pieces (``nn.mixer``'s protocol; module
    docstring)."""

    name = MIXER
    role = "attention"
    kind = ATTENTION
    bricks = (LINEAR.op_name, ATTENTION.op_name)
    watched = ()
    call_names = ("mask", "cache")
    input_name = "hidden_states"  # plamo2's layers call their mixer by keywords
    vetted = tuple(f.fingerprint for f in FORMS.values())
    #: Its attention core is counted by ``patch.coverage`` as any q/k/v attention's.
    attention_core = True

    def core_dims(self, module) -> tuple[int, int]:
        """``(query heads, head_dim)`` of the core (``patch.coverage``)."""
        H, _, D = heads(module)
        return H, D

    def matches(self, module) -> bool:
        """A module of a :data:`FORMS` class or derived from one (a subclass is reported stock:
        its forward is not vetted)."""
        return isinstance(module, nn.Module) and any(
            class_key(c) in FORMS for c in base_class(module).__mro__)

    def reason(self, module, layout=None, dtype=None) -> str | None:
        cls = base_class(module)
        form = form_of(module)
        if form is None:
            return f"{cls.__module__}.{cls.__name__}: an attention forward the patch does not know"
        for n in form.projections:
            if not isinstance(module.get(n), nn.Module):
                return f"{n} is missing"
        for n in (form.heads, form.kv_heads, form.head_dim):
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
        if form.plamo2:
            if getattr(module, "v_dim", None) != D:
                return "v_dim is not the head_dim"
            for n, rows in (("q_weight", H), ("k_weight", kv)):
                w = module.get(n)
                if not isinstance(w, mx.array) or tuple(w.shape) != (rows, D):
                    return f"{n} is not a ({rows}, {D}) array"
            if not callable(module.get("rope")):
                return "rope is missing"
        if dtype is not None and dtype not in FLOAT_DTYPES:
            return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
        return None

    def linears(self, layout=None, module=None) -> tuple[str, ...]:
        return PROJECTIONS

    def stage_names(self, module, dtype) -> tuple[str, ...]:
        """The projections, all ``linear`` pieces (for ``patch.coverage``)."""
        return form_of(module).projections

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
               for n in form_of(module).projections}
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

        form = form_of(m)
        if form.fused:
            q, k, v = mx.split(run_linear(run, m, "qkv_proj", x), [H * D, (H + kv) * D], axis=-1)
        else:
            q, k, v = (run_linear(run, m, n, x) for n in ("q_proj", "k_proj", "v_proj"))
        q = q.reshape(B, L, H, D).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, kv, D).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, kv, D).transpose(0, 2, 1, 3)
        if form.plamo2:
            q = mx.fast.rms_norm(q, weight=None, eps=1e-6) * m.q_weight[:, None]
            k = mx.fast.rms_norm(k, weight=None, eps=1e-6) * m.k_weight[:, None]
            offset = 0 if cache is None else cache.offset
            q, k = m.rope(q, offset=offset), m.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)

        def stock():
            if form.plamo2:
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=m.scale, mask=mask)
            return scaled_dot_product_attention(q, k, v, cache=cache, scale=m.scale, mask=mask)

        o = run("attention", ATTENTION,
                lambda: {"q": q, "k": k, "v": v, "scale": m.scale, "mask": "causal",
                         "kv_quant": None}, stock)
        return run_out(run, m, "o_proj", o.transpose(0, 2, 1, 3).reshape(B, L, -1))


ATTENTION_MIXER_PIECE = AttentionMixerPiece()
