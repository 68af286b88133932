"""Multi-head latent attention (MLA, DeepSeek-V2: "DeepSeek-V2: A Strong, Economical, and
Efficient Mixture-of-Experts Language Model", 2024, section 2.1) over a latent cache, in prefill.

Each key is stored as a latent ``c (r)`` shared by all heads plus one rope key ``k_pe (dr)``;
head h's key is ``[c W_k[h], k_pe]`` and its value ``c W_v[h]^T`` (``W_k`` = mlx-lm's
``embed_q.weight`` (H, r, dn), ``W_v`` = ``unembed_out.weight`` (H, dv, r)). Two ways to
attend, with the same result in exact arithmetic:

* decompressed: K ``(B, H, S, dn + dr)`` and V ``(B, H, S, dv)`` for all ``S`` keys, then
  attention with a query head of ``dn + dr`` columns and a value head of ``dv`` (the attention
  brick with ``Dv < D``); what mlx-lm does for L > 1 (it adds the rope scores as a mask);
* absorbed: each query absorbs ``W_k`` (``q_nope W_k[h]^T``, r columns), attends over the
  latents themselves (one KV head: scores over ``r + dr`` columns, values of ``r``), then the
  output goes through ``W_v``; what mlx-lm does for decode (L == 1).

Per head, decompressing costs ``2 S r (dn + dv)`` FLOPs, absorbing ``2 L r (dn + dv)``; the core
costs ``2 (dn + dr + dv)`` per (query, visible key) pair decompressed and ``2 (2 r + dr)``
absorbed. :func:`choose_form` takes the cheaper: for DeepSeek-V3 (r 512, dn 128, dr 64,
dv 128) a prompt from an empty cache decompresses (the pairs grow as L^2 / 2), a short turn over
a long cache absorbs (a 16-token turn over 10,000 cached keys: 0.35 vs 2.7 GFLOP per head).
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.attention.op import causal_window_mask, flash_attention
from mlx_bricks.checks import check_array, check_float_dtype

DECOMPRESSED = "decompressed"
ABSORBED = "absorbed"
FORMS = (DECOMPRESSED, ABSORBED)


def visible_pairs(L: int, S: int) -> int:
    """(query, key) pairs a causal prefill of ``L`` queries over ``S`` keys scores (bottom-right
    aligned: the query at position ``S - L + i`` sees ``S - L + i + 1`` keys)."""
    return L * (S - L) + L * (L + 1) // 2


def form_flops(L: int, S: int, heads: int, rank: int, nope: int, rope: int, v: int) -> dict:
    """FLOPs of each form for ``L`` queries over ``S`` causal keys (module docstring):
    ``{"decompressed": F, "absorbed": F}``."""
    pairs = visible_pairs(L, S)
    return {DECOMPRESSED: 2 * heads * (S * rank * (nope + v) + (nope + rope + v) * pairs),
            ABSORBED: 2 * heads * (L * rank * (nope + v) + (2 * rank + rope) * pairs)}


def choose_form(L: int, S: int, heads: int, rank: int, nope: int, rope: int, v: int) -> str:
    """The cheaper form by :func:`form_flops` (decompressed on a tie)."""
    f = form_flops(L, S, heads, rank, nope, rope, v)
    return ABSORBED if f[ABSORBED] < f[DECOMPRESSED] else DECOMPRESSED


def joined_qk(q_nope, q_pe, k_nope, k_pe):
    """``q = [q_nope, q_pe]`` (B, H, L, dn + dr) and ``k = [k_nope, k_pe]`` (B, H, S, dn + dr)
    with the one rope key ``k_pe`` (B, 1, S, dr) broadcast to every head (as mistral4 builds
    them; deepseek_v2's cache holds the same keys)."""
    B, H, S, _ = k_nope.shape
    k_pe = mx.broadcast_to(k_pe, (B, H, S, k_pe.shape[-1]))
    return (mx.concatenate([q_nope, q_pe], axis=-1),
            mx.concatenate([k_nope, k_pe], axis=-1))


def rope_scores(q_pe, k_pe, scale, visible):
    """mlx-lm's rope scores ``(q_pe * scale) @ k_pe^T`` (B, H, L, S) in q's dtype, keys not
    ``visible`` set to the dtype's lowest value (an additive mask for the attention)."""
    pe = (q_pe * scale) @ k_pe.swapaxes(-1, -2)
    if visible is None:
        return pe
    return mx.where(visible, pe, mx.array(mx.finfo(pe.dtype).min, pe.dtype))


def absorbed_attention(q_nope, q_pe, latent, k_pe, absorb, unabsorb, *, scale, visible):
    """The absorbed form (module docstring) as mlx-lm's decode computes it, for any L:
    ``unabsorb(sdpa(absorb(q_nope), latent, latent, mask=rope_scores))``. ``absorb`` /
    ``unabsorb``: ``embed_q`` / ``unembed_out`` (an mlx-lm ``MultiLinear`` or its quantized
    twin, or the float product). ``visible``: (L, S) bool or None. Returns (B, H, L, dv)."""
    pe = rope_scores(q_pe, k_pe, scale, visible)
    out = mx.fast.scaled_dot_product_attention(absorb(q_nope), latent, latent, scale=scale,
                                               mask=pe)
    return unabsorb(out)


def mla_attention_reference(q_nope, q_pe, latent, k_pe, w_k, w_v, *, scale, causal=True):
    """mlx-lm's prefill MLA core in MLX ops (``deepseek_v3.DeepseekV3Attention`` for L > 1):
    K and V decompressed, ``scaled_dot_product_attention(q_nope, k_nope, v)`` with the rope
    scores as an additive mask. Arguments as :func:`mla_attention`."""
    L, S = q_nope.shape[2], latent.shape[2]
    visible = causal_window_mask(L, S, S) if causal else None
    k_nope = latent @ w_k
    v = latent @ w_v.swapaxes(-1, -2)
    return mx.fast.scaled_dot_product_attention(q_nope, k_nope, v, scale=scale,
                                               mask=rope_scores(q_pe, k_pe, scale, visible))


def _check(q_nope, q_pe, latent, k_pe, w_k, w_v, form):
    for name, a in (("q_nope", q_nope), ("q_pe", q_pe), ("latent", latent), ("k_pe", k_pe)):
        check_array(name, a, ndim=4)
    check_float_dtype("q_nope", q_nope)
    check_array("w_k", w_k, ndim=3)
    check_array("w_v", w_v, ndim=3)
    for name, a in (("q_pe", q_pe), ("latent", latent), ("k_pe", k_pe), ("w_k", w_k),
                    ("w_v", w_v)):
        if a.dtype != q_nope.dtype:
            raise TypeError(f"{name} has dtype {a.dtype} but q_nope has {q_nope.dtype}")
    B, H, L, dn = q_nope.shape
    S, r = latent.shape[2], latent.shape[3]
    if tuple(q_pe.shape[:3]) != (B, H, L):
        raise ValueError(f"q_pe must have shape (B, H, L, dr) = ({B}, {H}, {L}, dr), got "
                         f"{tuple(q_pe.shape)}")
    dr = q_pe.shape[3]
    if tuple(latent.shape) != (B, 1, S, r) or tuple(k_pe.shape) != (B, 1, S, dr):
        raise ValueError(f"latent must be (B, 1, S, r) and k_pe (B, 1, S, {dr}), got "
                         f"{tuple(latent.shape)} and {tuple(k_pe.shape)}")
    if S < L:
        raise ValueError(f"latent length ({S}) must be >= the query length ({L})")
    if tuple(w_k.shape) != (H, r, dn) or w_v.shape[0] != H or w_v.shape[2] != r:
        raise ValueError(f"w_k must be (H, r, dn) = ({H}, {r}, {dn}) and w_v (H, dv, r), got "
                         f"{tuple(w_k.shape)} and {tuple(w_v.shape)}")
    if form is not None and form not in FORMS:
        raise ValueError(f"form must be None, {DECOMPRESSED!r} or {ABSORBED!r}, got {form!r}")


def mla_attention(q_nope, q_pe, latent, k_pe, w_k, w_v, *, scale, causal=True, form=None,
                  backend=None):
    """Multi-head latent attention over a latent cache (module docstring):
    ``softmax(scale (q_nope . (c W_k[h]) + q_pe . k_pe)) (c W_v[h]^T)`` per head h.

    Args:
        q_nope: (B, H, L, dn) float16, bfloat16 or float32: the queries' non-rope columns.
        q_pe: (B, H, L, dr) of q_nope's dtype: the rope columns (already rotated).
        latent: (B, 1, S, r): the keys' latents (mlx-lm's MLA cache ``keys``), S >= L.
        k_pe: (B, 1, S, dr): the keys' rope parts (the cache's ``values``).
        w_k: (H, r, dn): ``embed_q.weight``; w_v: (H, dv, r): ``unembed_out.weight``.
        scale: the softmax scale (with YaRN's mscale folded in, as the module's ``scale``).
        causal: the causal mask aligned bottom-right (query i at position S - L + i).
        form: None (the cheaper by :func:`choose_form`), ``"decompressed"`` (the attention
            brick with ``D = dn + dr``, ``Dv = dv``; both in its head dims) or ``"absorbed"``
            (MLX ops, mlx-lm's decode computation).
        backend: as ``flash_attention``'s (``reference``: the decompressed form in MLX ops).

    Returns:
        (B, H, L, dv) of q_nope's dtype.

    Raises:
        TypeError: non-arrays, a non-float dtype, mixed dtypes.
        ValueError: shapes that do not match, S < L, an unknown form; the attention brick's
            own errors for head dims it lacks.
    """
    _check(q_nope, q_pe, latent, k_pe, w_k, w_v, form)
    B, H, L, dn = q_nope.shape
    S, r = latent.shape[2], latent.shape[3]
    if form is None:
        form = choose_form(L, S, H, r, dn, q_pe.shape[3], w_v.shape[1])
    if form == ABSORBED:
        visible = causal_window_mask(L, S, S) if causal else None
        return absorbed_attention(q_nope, q_pe, latent, k_pe, lambda x: x @ w_k.swapaxes(-1, -2),
                                  lambda o: o @ w_v.swapaxes(-1, -2), scale=scale,
                                  visible=visible)
    q, k = joined_qk(q_nope, q_pe, latent @ w_k, k_pe)
    v = latent @ w_v.swapaxes(-1, -2)
    return flash_attention(q, k, v, scale=float(scale), mask="causal" if causal else None,
                           backend=backend)
