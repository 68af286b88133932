"""DeepSeek sparse attention (DSA, DeepSeek-V3.2-Exp: "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", 2025) in a patched MLA module: the lightning
indexer's step of mlx-lm 0.32.2's ``deepseek_v32`` (also ``glm_moe_dsa``, built from it).

mlx-lm's indexer (``deepseek_v32.Indexer``) projects indexer queries (``wq_b`` of the MLA's
query latent) and one indexer key per token (``wk``, LayerNorm, RoPE), appends the keys to its
own cache (``CacheList`` entry 1), and returns None while the keys seen (the cache's plus the
chunk's) are at most ``index_topk``: every causal key is then selected and the module attends
densely (the MLA piece's decompressed or absorbed form is exact). With more keys it scores them
(``sum_h w_h relu(q_h . k)``), takes each query's top ``index_topk`` by ``argpartition`` and
attends only over those (an array mask): such a call runs stock, with the reason, so the
selection (ties included) is mlx-lm's own.
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


def sparse_reason(m, keys: int) -> str | None:
    """None while the call's ``keys`` (cached plus new) are at most the indexer's
    ``index_topk`` (dense attention is exact); else why it runs stock."""
    top = m.indexer.index_topk
    if keys <= top:
        return None
    return (f"DSA: {keys} keys > index_topk {top}: each query attends over its top-k keys "
            "(mlx-lm's selection and masked attention run stock)")


def indexer_step(m, x, qr, mask, cache) -> None:
    """The indexer's part of ``DeepseekV32Attention.__call__`` for a call with at most
    ``index_topk`` keys, after the latent cache's update: the indexer module itself (its keys
    appended to ``cache[1]``; it returns None there), then the latent cache's keys made to
    depend on the indexer cache, as the module does (so both are evaluated together).

    Raises:
        RuntimeError: the indexer selected keys (a call with more than ``index_topk`` keys
            must have been sent to the stock path by :func:`sparse_reason`).
    """
    picked = m.indexer(x, qr, mask, cache=cache[1] if cache is not None else None)
    if picked is not None:
        raise RuntimeError("DSA indexer selected keys in a call admitted as dense")
    if cache is not None and cache[0] is not None:
        cache[0].keys = mx.depends(cache[0].keys, (cache[1].keys, cache[1].values))
