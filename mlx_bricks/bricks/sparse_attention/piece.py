"""DeepSeek sparse attention (DSA, DeepSeek-V3.2-Exp: "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", 2025) in a patched MLA module: the lightning
indexer's step of mlx-lm 0.32.2's ``deepseek_v32`` (also ``glm_moe_dsa``, built from it).

mlx-lm's indexer (``deepseek_v32.Indexer``) projects indexer queries (``wq_b`` of the MLA's
query latent) and one indexer key per token (``wk``, LayerNorm, RoPE), appends the keys to its
own cache (``CacheList`` entry 1), and returns None while the keys seen (the cache's plus the
chunk's) are at most ``index_topk``: every causal key is then selected and the module attends
densely (the MLA piece's decompressed or absorbed form is exact). With more keys it scores them
(``sum_h w_h relu(q_h . k)``) and returns each query's top ``index_topk`` (``argpartition``):
the piece calls the indexer module itself, so the selection (ties included) is mlx-lm's own, and
attends over the selected keys with the sparse-attention brick (``op.sparse_attention``: the
absorbed form over each query's gathered latents) instead of mlx-lm's masked dense attention
over every key.
"""
from __future__ import annotations

import hashlib
import inspect
import textwrap

import mlx.core as mx

#: The indexer forward the step follows (``patch.vetted`` fingerprint, mlx-lm 0.32.2).
INDEXER_VETTED = "mlx_lm.models.deepseek_v32.Indexer.__call__=bdb264f615cd"


def _source_digest(fn) -> str | None:
    """``<module>.<qualname>=<sha256[:12]>`` of ``fn``'s dedented source, as
    ``patch.vetted`` fingerprints forwards (that floor is above the bricks)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    return f"{fn.__module__}.{fn.__qualname__}={hashlib.sha256(source.encode()).hexdigest()[:12]}"


def indexer_reason(m) -> str | None:
    """Why module ``m``'s indexer is not the one the step follows (None: it is)."""
    indexer = m.get("indexer")
    if indexer is None:
        return "indexer is missing"
    fp = _source_digest(type(indexer).__call__)
    if fp != INDEXER_VETTED:
        return (f"indexer forward {type(indexer).__name__}.__call__ is not the one vetted "
                f"({fp}): stock")
    if not isinstance(getattr(indexer, "index_topk", None), int):
        return "indexer.index_topk is not an int"
    return None


def is_sparse(m, keys: int) -> bool:
    """Whether a call with ``keys`` keys (cached plus new) selects: more than the indexer's
    ``index_topk`` (at most that many, dense attention is exact)."""
    return keys > m.indexer.index_topk


def indexer_step(m, x, qr, mask, cache):
    """The indexer's part of ``DeepseekV32Attention.__call__`` after the latent cache's update:
    the indexer module itself (its keys appended to ``cache[1]``), then the latent cache's keys
    made to depend on the indexer cache, as the module does (so both are evaluated together).
    Returns the indexer's selection, (B, 1, L, index_topk) indices, or None (at most
    ``index_topk`` keys: every causal key)."""
    picked = m.indexer(x, qr, mask, cache=cache[1] if cache is not None else None)
    if picked is not None:
        picked = mx.stop_gradient(picked)
    if cache is not None and cache[0] is not None:
        cache[0].keys = mx.depends(cache[0].keys, (cache[1].keys, cache[1].values))
    return picked


def multilinear_weight(layer, dtype):
    """An mlx-lm ``MultiLinear``'s (H, out, in) weight in ``dtype``; a ``QuantizedMultiLinear``'s
    dequantized (lazy: computed only where the sparse brick runs)."""
    from mlx_lm.models.mla import MultiLinear

    if type(layer) is MultiLinear:
        return layer.weight.astype(dtype)
    return mx.dequantize(layer.weight, layer.scales, layer.get("biases"), layer.group_size,
                         layer.bits, mode=layer.mode).astype(dtype)


def sparse_args(m, q_nope, q_pe, latent, k_pe, indices, scale) -> dict:
    """The sparse-attention kind's arguments of a call (indices: the indexer's selection, or
    their shape as a placeholder)."""
    dt = q_nope.dtype
    return {"q": q_nope, "q_pe": q_pe, "latent": latent, "k_pe": k_pe, "indices": indices,
            "w_k": multilinear_weight(m.embed_q, dt), "w_v": multilinear_weight(m.unembed_out, dt),
            "scale": scale}


def sparse_stock(m, q_nope, q_pe, latent, k_pe, indices, mask, kv_cache, scale):
    """``DeepseekV32Attention.__call__``'s own code from the indexer's selection on (L > 1):
    the selection as a boolean mask (``&`` the call's mask), the rope scores masked by it, the
    keys and values decompressed by the module's ``embed_q`` / ``unembed_out``, mlx-lm's
    ``scaled_dot_product_attention``. Returns (B, H, L, dv)."""
    from mlx_lm.models.base import scaled_dot_product_attention

    shape = list(indices.shape)
    shape[-1] = latent.shape[2]
    sparse_mask = mx.put_along_axis(mx.zeros(shape, dtype=mx.bool_), indices, mx.array(True),
                                    axis=-1)
    if mask is not None:
        sparse_mask = sparse_mask & mask
    pe_scores = (q_pe * scale) @ k_pe.swapaxes(-1, -2)
    pe_scores = mx.where(sparse_mask, pe_scores,
                         mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
    k = m.embed_q(latent, transpose=False)
    v = m.unembed_out(latent)
    return scaled_dot_product_attention(q_nope, k, v, cache=kv_cache, scale=scale,
                                        mask=pe_scores)
