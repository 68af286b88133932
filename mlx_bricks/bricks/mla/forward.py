"""The prefill forward of an mlx-lm MLA module (``family.MLAFacts`` says which), piece by
piece: every projection on the ``linear`` kind, the attention core on the ``attention`` kind
(query head ``dn + dr``, value head ``dv``), the rest (norms, RoPE, the cache write, the gates)
mlx-lm's own code in its order, so the cache holds exactly what the module writes.

``run(name, kind, args, stock)`` runs one piece (``nn.mixer.BricksMixer``): ``args()`` its
brick's arguments, ``stock()`` the module's own computation of it.
"""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention

from mlx_bricks.bricks.attention.op import causal_window_mask
from mlx_bricks.bricks.attention.piece import KIND as ATTENTION
from mlx_bricks.bricks.gemm import piece as linear_piece
from mlx_bricks.bricks.gemm.piece import run_linear, run_out
from mlx_bricks.bricks.mla.family import MLAFacts
from mlx_bricks.bricks.mla.op import ABSORBED, absorbed_attention, choose_form, joined_qk, \
    rope_scores

LINEAR = linear_piece.KIND


def dims(m, facts: MLAFacts) -> tuple[int, int, int, int, int]:
    """``(heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim)``."""
    return (getattr(m, facts.heads), m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
            m.v_head_dim)


def kv_cache_of(cache, facts: MLAFacts):
    """The latent (or K/V) cache of a call: ``cache[0]`` of DeepSeek-V3.2's ``CacheList``."""
    return cache[0] if facts.indexer and cache is not None else cache


def form_of(m, facts: MLAFacts, L: int, offset: int) -> str:
    """The form a latent-cache call attends in (``op.choose_form``); ``kv`` caches hold
    decompressed keys: always the decompressed form."""
    if facts.cache != "latent":
        return "decompressed"
    H, r, dn, dr, dv = dims(m, facts)
    return choose_form(L, offset + L, H, r, dn, dr, dv)


def value_weight(m, heads: int):
    """``unembed_out`` as one ``linear`` weight ``(heads * dv, r)`` (a free reshape: the
    product of every head's ``latent @ W_v[h]^T`` side by side), or None where its format is
    not one the linear brick reads as such (float or MLX affine)."""
    from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear

    from mlx_bricks.formats.affine import MODE, QuantizedWeight

    u = m.get("unembed_out")
    if type(u) is MultiLinear:
        return u.weight.reshape(-1, u.weight.shape[-1])
    if type(u) is QuantizedMultiLinear and u.mode == MODE and u.get("biases") is not None:
        rows = u.weight.shape[0] * u.weight.shape[1]
        return QuantizedWeight(u.weight.reshape(rows, -1), u.scales.reshape(rows, -1),
                               u.biases.reshape(rows, -1), u.group_size, u.bits)
    return None


def visible_of(mask, L: int, S: int):
    """The (L, S) boolean mask of a call (mlx-lm's array, or the causal one for ``"causal"``)."""
    return mask if isinstance(mask, mx.array) else causal_window_mask(L, S, S)


def _attention(run, scale, q, k, v, stock):
    """The attention piece over q (B, H, L, D), k (B, H, S, D), v (B, H, S, dv): causal,
    bottom-right aligned (mlx-lm's mask, checked at the call). ``q``/``k`` are callables (the
    concatenations are built only for the brick)."""
    return run("attention", ATTENTION,
               lambda: {"q": q(), "k": k(), "v": v, "scale": scale, "mask": "causal",
                        "kv_quant": None}, stock)


def mla_forward(m, facts: MLAFacts, x, mask, cache, run, attn_scale=None):
    """The module's output for a prefill call ``(x, [attn_scale,] mask, cache)`` (already
    admitted: ``piece.MLAPiece.call_reason``)."""
    B, L, _ = x.shape
    H, r, dn, dr, dv = dims(m, facts)
    qr = None
    if "q_proj" in m:
        q = run_linear(run, m, "q_proj", x)
    else:
        qr = m.q_a_layernorm(run_linear(run, m, "q_a_proj", x))
        q = run_linear(run, m, "q_b_proj", qr)
    q = q.reshape(B, L, H, dn + dr).transpose(0, 2, 1, 3)
    if facts.lora_scales and getattr(m, "mla_scale_q_lora", None) is not None:
        q = q * m.mla_scale_q_lora
    q_nope, q_pe = mx.split(q, [dn], axis=-1)
    latent, k_pe = mx.split(run_linear(run, m, "kv_a_proj_with_mqa", x), [r], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, dr).transpose(0, 2, 1, 3)
    scale = getattr(m, facts.scale)
    if facts.cache == "kv":
        o = _kv_core(run, m, facts, latent, q_nope, q_pe, k_pe, mask, cache, scale)
    else:
        o = _latent_core(run, m, facts, x, qr, latent, q_nope, q_pe, k_pe, mask, cache, scale,
                         attn_scale)
    o = o.transpose(0, 2, 1, 3)  # (B, L, H, dv)
    if facts.gate == "per_head":  # Bailing V3: sigmoid in float32, one factor per head
        o = o * mx.sigmoid(run_linear(run, m, "g_proj", x).astype(mx.float32)).astype(
            o.dtype)[..., None]
    o = o.reshape(B, L, -1)
    if facts.gate == "elementwise" and m.use_gate:  # Kimi K3
        o = o * mx.sigmoid(run_linear(run, m, "g_proj", x))
    return run_out(run, m, facts.out, o)


def _kv_core(run, m, facts, latent, q_nope, q_pe, k_pe, mask, cache, scale):
    """DeepSeek-V2 / MiniCPM3 / Youtu-LLM: ``kv_b_proj`` decompresses the chunk, the cache
    holds the full keys (rope key repeated per head) and values."""
    B, H, L, dn = q_nope.shape
    kv = run_linear(run, m, "kv_b_proj", m.kv_a_layernorm(latent))
    k_nope, values = mx.split(kv.reshape(B, L, H, -1).transpose(0, 2, 1, 3), [dn], axis=-1)
    if cache is not None:
        q_pe, k_pe = m.rope(q_pe, cache.offset), m.rope(k_pe, cache.offset)
    else:
        q_pe, k_pe = m.rope(q_pe), m.rope(k_pe)
    queries, keys = joined_qk(q_nope, q_pe, k_nope, k_pe)
    if cache is not None:
        keys, values = cache.update_and_fetch(keys, values)
    return _attention(run, scale, lambda: queries, lambda: keys, values,
                      lambda: scaled_dot_product_attention(queries, keys, values, cache=cache,
                                                           scale=scale, mask=mask))


def _sparse_core(run, m, q_nope, q_pe, latent, k_pe, indices, mask, kv_cache, scale):
    """DeepSeek sparse attention (more keys than the indexer's ``index_topk``): the
    ``sparse_attention`` piece over each query's selected keys (stock: the module's own masked
    dense attention over every key, ``sparse_attention.piece.sparse_stock``)."""
    from mlx_bricks.bricks.sparse_attention.kind import SPARSE_ATTENTION
    from mlx_bricks.bricks.sparse_attention.piece import sparse_args, sparse_stock

    return run("sparse_attention", SPARSE_ATTENTION,
               lambda: sparse_args(m, q_nope, q_pe, latent, k_pe, indices, scale),
               lambda: sparse_stock(m, q_nope, q_pe, latent, k_pe, indices, mask, kv_cache,
                                    scale))


def _latent_core(run, m, facts, x, qr, latent, q_nope, q_pe, k_pe, mask, cache, scale,
                 attn_scale):
    """The latent-cache families: norm (and LongCat's scale) of the latent, RoPE at the
    cache offset, mistral4's query scaling, the cache write of (latent, rope key), DeepSeek-
    V3.2's indexer step, then the cheaper form (``op.choose_form``)."""
    latent = m.kv_a_layernorm(latent)
    if facts.lora_scales and getattr(m, "mla_scale_kv_lora", None) is not None:
        latent = latent * m.mla_scale_kv_lora
    kv_cache = kv_cache_of(cache, facts)
    offset = kv_cache.offset if kv_cache is not None else 0
    if facts.rope:
        q_pe, k_pe = m.rope(q_pe, offset), m.rope(k_pe, offset)
    if facts.attn_scale:  # the Llama-4 factor scales the whole query
        q_nope, q_pe = q_nope * attn_scale, q_pe * attn_scale
    latent = mx.expand_dims(latent, axis=1)
    if kv_cache is not None:
        latent, k_pe = kv_cache.update_and_fetch(latent, k_pe)
    if facts.indexer:
        from mlx_bricks.bricks.sparse_attention.piece import indexer_step

        picked = indexer_step(m, x, qr, mask, cache)
        if picked is not None:
            return _sparse_core(run, m, q_nope, q_pe, latent, k_pe, picked, mask, kv_cache,
                                scale)
    L, S = q_nope.shape[2], latent.shape[2]
    H, r, dn, dr, dv = dims(m, facts)
    if form_of(m, facts, L, S - L) == ABSORBED:
        return absorbed_attention(q_nope, q_pe, latent, k_pe, m.embed_q, m.unembed_out,
                                  scale=scale, visible=visible_of(mask, L, S))
    k_nope = m.embed_q(latent, transpose=False)
    w = value_weight(m, H)
    if w is None:
        v = m.unembed_out(latent)
    else:
        lat = latent.reshape(latent.shape[0], S, r)
        args = {"x": lat, "weight": w, "bias": None, "residual": None}
        v = run("unembed_out", LINEAR, lambda: args, lambda: LINEAR.stock(args))
        v = v.reshape(latent.shape[0], S, H, dv).transpose(0, 2, 1, 3)

    def stock():
        if facts.stock_core == "concat":  # mistral4: q and k concatenated
            qq, kk = joined_qk(q_nope, q_pe, k_nope, k_pe)
            return scaled_dot_product_attention(qq, kk, v, cache=kv_cache, scale=scale,
                                                mask=mask)
        pe = rope_scores(q_pe, k_pe, scale, visible_of(mask, L, S))
        return scaled_dot_product_attention(q_nope, k_nope, v, cache=kv_cache, scale=scale,
                                            mask=pe)

    joined = []  # q and k concatenated once, for the brick only

    def qk(i):
        if not joined:
            joined.extend(joined_qk(q_nope, q_pe, k_nope, k_pe))
        return joined[i]

    return _attention(run, scale, lambda: qk(0), lambda: qk(1), v, stock)
