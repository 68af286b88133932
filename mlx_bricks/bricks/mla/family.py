"""What each mlx-lm 0.32.2 multi-head latent attention (MLA) module computes: one
:class:`MLAFacts` per class, read from its ``__call__`` (the ``vetted`` fingerprint pins that
source: a changed forward stays stock).

Every MLA module projects the query (``q_proj``, or ``q_a_proj`` -> ``q_a_layernorm`` ->
``q_b_proj``) into ``n_heads`` heads of ``qk_nope_head_dim + qk_rope_head_dim`` columns, and the
input into a compressed latent of ``kv_lora_rank`` columns plus one shared rope key of
``qk_rope_head_dim`` (``kv_a_proj_with_mqa``, the latent through ``kv_a_layernorm``); the rope
parts get the module's rope at the cache offset. Then one of two cache forms:

* ``latent`` (DeepSeek-V3 and its followers): the cache holds the latent ``(B, 1, S, r)`` as
  keys and the rope key ``(B, 1, S, dr)`` as values; for L > 1 mlx-lm decompresses every
  cached latent per head, ``k_nope = latent @ embed_q`` ``(B, H, S, dn)`` and
  ``v = latent @ unembed_out^T`` ``(B, H, S, dv)``, and adds the rope scores as an additive
  mask: ``softmax(scale (q_nope . k_nope) + scale (q_pe . k_pe)) v`` (mistral4 concatenates
  q and k instead: the same function). Decode (L == 1) uses the absorbed form.
* ``kv`` (DeepSeek-V2, MiniCPM3, Youtu-LLM): ``kv_b_proj`` decompresses the chunk's latent,
  the cache holds full keys ``(B, H, S, dn + dr)`` (the rope key repeated per head) and values
  ``(B, H, S, dv)``: plain attention with a value head narrower than the key head.
"""
from __future__ import annotations

from dataclasses import dataclass

from mlx_bricks.runtime.classes import class_key


@dataclass(frozen=True)
class MLAFacts:
    """One mlx-lm MLA class's forward.

    Attributes:
        cls: ``"<module>.<Class>"`` under ``mlx_lm.models``.
        vetted: the ``patch.vetted`` fingerprint of its ``__call__`` (mlx-lm 0.32.2).
        cache: ``"latent"`` or ``"kv"`` (module docstring).
        stock_core: how mlx-lm attends in prefill: ``"pe_scores"`` (the rope scores as an
            additive mask of ``scaled_dot_product_attention(q_nope, k_nope, v)``),
            ``"concat"`` (mistral4: q and k concatenated), ``"kv"`` (the decompressed cache).
        out: the output projection's attribute (``o_proj``; Bailing: ``dense``).
        gate: None, ``"elementwise"`` (Kimi K3 with ``use_gate``: ``out * sigmoid(g_proj(x))``
            over ``n_heads * dv`` columns) or ``"per_head"`` (Bailing V3: one
            ``sigmoid(g_proj(x))`` per head, in float32, cast to the output's dtype).
        rope: the rope parts are rotated (Kimi's NoPE MLA: not, its rope columns still score).
        lora_scales: longcat's ``mla_scale_q_lora`` / ``mla_scale_kv_lora`` multipliers (the
            query after the head split, the latent after its norm; None: not applied).
        attn_scale: the call takes ``attn_scale`` (mistral4: the query times the per-position
            Llama-4 factor after RoPE).
        scale: the attribute holding the softmax scale (MiniCPM3: ``softmax_scale``).
        heads: the attribute holding the head count (LongCat: ``num_attention_heads``).
        indexer: DeepSeek sparse attention (V3.2): a lightning indexer (``indexer``) and a
            ``CacheList`` of (latent cache, indexer key cache).
    """

    cls: str
    vetted: str
    cache: str = "latent"
    stock_core: str = "pe_scores"
    out: str = "o_proj"
    gate: str | None = None
    rope: bool = True
    lora_scales: bool = False
    attn_scale: bool = False
    scale: str = "scale"
    heads: str = "num_heads"
    indexer: bool = False

    @property
    def call_names(self) -> tuple[str, ...]:
        return ("attn_scale", "mask", "cache") if self.attn_scale else ("mask", "cache")

    @property
    def fingerprint(self) -> str:
        return f"mlx_lm.models.{self.cls}.__call__={self.vetted}"


#: The MLA classes the piece follows, by ``"<module>.<Class>"``.
FAMILIES: dict[str, MLAFacts] = {f.cls: f for f in (
    MLAFacts("deepseek_v3.DeepseekV3Attention", "489e74e7383f"),
    MLAFacts("deepseek_v32.DeepseekV32Attention", "121ba4adb1c4", indexer=True),
    MLAFacts("glm4_moe_lite.Glm4MoeLiteAttention", "2caa33ba8a05"),
    MLAFacts("longcat_flash.LongcatFlashMLA", "43fbdd9d4dc4", lora_scales=True,
             heads="num_attention_heads"),
    MLAFacts("kimi_linear.KimiMLAAttention", "ec64f2abc3a1", rope=False),
    MLAFacts("kimi_k3.KimiK3MLAAttention", "7fde11a5d61f", rope=False, gate="elementwise"),
    MLAFacts("bailing_moe_v3.BailingMLA", "9d53459273c8", out="dense", gate="per_head"),
    MLAFacts("bailing_hybrid.MultiLatentAttention", "bb963b34e05f", out="dense"),
    MLAFacts("mistral4.Mistral4Attention", "2dda0f153b19", stock_core="concat",
             attn_scale=True),
    MLAFacts("deepseek_v2.DeepseekV2Attention", "6bfd53d0d1e0", cache="kv", stock_core="kv"),
    MLAFacts("minicpm3.Attention", "d55dc55cde70", cache="kv", stock_core="kv",
             scale="softmax_scale"),
    MLAFacts("youtu_llm.YoutuLLMAttention", "bac96fc1e7c9", cache="kv", stock_core="kv"),
)}


def facts_of(cls: type) -> MLAFacts | None:
    """The facts of an mlx-lm class (exact: a subclass is another forward), or None."""
    return FAMILIES.get(class_key(cls)) if cls.__module__.startswith("mlx_lm.models.") else None
