"""DeepSeek sparse attention's top-k attention (DSA, "DeepSeek-V3.2-Exp: Boosting Long-Context
Efficiency with DeepSeek Sparse Attention", 2025) over an MLA latent cache, in prefill.

Each query attends only over the keys its lightning indexer selected (``indices``: the top
``k`` per query, shared by every head) that are also causally visible. mlx-lm 0.32.2
(``deepseek_v32.DeepseekV32Attention``, L > 1) decompresses every key and value (``K_h = c
W_k[h]``, ``V_h = c W_v[h]^T``) and attends over all S keys with a (B, H, L, S) additive mask of
the selection (:func:`sparse_attention_stock`). The op works in MLA's absorbed form
(``bricks/mla/op.py``): every head then reads the same keys, the latents ``c (r)`` and rope keys
``k_pe (dr)``, so for query i, head h, its absorbed query ``q_h = q_nope_h W_k[h]^T`` (r
columns) and its selected, visible keys ``J_i``::

    s_hj = scale (q_h . c_j + q_pe_h . k_pe_j),   o_h = (sum_{j in J_i} softmax_j(s_h) c_j) W_v[h]^T

gathering each query's k latents: ``2 H (2 r + dr)`` FLOPs per selected key against ``2 H (dn
+ dr + dv)`` per visible key (and the decompression) densely, and no (L, S) arrays. Source of
the form: DeepSeek-V3.2-Exp's FlashMLA sparse kernels (one query's heads over its gathered
latents, the softmax in float32).
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.checks import check_array, check_float_dtype

#: Queries per chunk of the gathered composite: a chunk gathers ``chunk * k`` latents and
#: holds ``chunk * H * k`` float32 scores (32 x 128 x 2,048: 32 MiB at DeepSeek-V3.2's sizes).
CHUNK = 32


def check_sparse_args(q, q_pe, latent, k_pe, indices, w_k, w_v) -> tuple:
    """Validate the op's arguments (``q``: the non-rope query columns ``q_nope``); returns
    ``(B, H, L, dn, dr, S, r, k, dv)``.

    Raises:
        TypeError: non-arrays, non-float q / latent, mixed dtypes, non-integer indices.
        ValueError: shapes that do not match, S < L, k > S.
    """
    for name, a in (("q", q), ("q_pe", q_pe), ("latent", latent), ("k_pe", k_pe),
                    ("indices", indices)):
        check_array(name, a, ndim=4)
    check_array("w_k", w_k, ndim=3)
    check_array("w_v", w_v, ndim=3)
    check_float_dtype("q", q)
    for name, a in (("q_pe", q_pe), ("latent", latent), ("k_pe", k_pe), ("w_k", w_k),
                    ("w_v", w_v)):
        if a.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {a.dtype} but q has {q.dtype}")
    if not mx.issubdtype(indices.dtype, mx.integer):
        raise TypeError(f"indices must be an integer array, got {indices.dtype}")
    B, H, L, dn = q.shape
    dr = q_pe.shape[3]
    S, r = latent.shape[2], latent.shape[3]
    if tuple(q_pe.shape[:3]) != (B, H, L):
        raise ValueError(f"q_pe must be (B, H, L, dr) = ({B}, {H}, {L}, dr), got "
                         f"{tuple(q_pe.shape)}")
    if tuple(latent.shape) != (B, 1, S, r) or tuple(k_pe.shape) != (B, 1, S, dr):
        raise ValueError(f"latent must be (B, 1, S, r) and k_pe (B, 1, S, {dr}), got "
                         f"{tuple(latent.shape)} and {tuple(k_pe.shape)}")
    if S < L:
        raise ValueError(f"latent length ({S}) must be >= the query length ({L})")
    k = indices.shape[3]
    if tuple(indices.shape[:3]) != (B, 1, L) or not 0 < k <= S:
        raise ValueError(f"indices must be (B, 1, L, k) = ({B}, 1, {L}, k) with 0 < k <= {S}, "
                         f"got {tuple(indices.shape)}")
    if tuple(w_k.shape) != (H, r, dn) or w_v.shape[0] != H or w_v.shape[2] != r:
        raise ValueError(f"w_k must be (H, r, dn) = ({H}, {r}, {dn}) and w_v (H, dv, {r}), got "
                         f"{tuple(w_k.shape)} and {tuple(w_v.shape)}")
    return B, H, L, dn, dr, S, r, k, w_v.shape[1]


def selection_mask(indices, S: int):
    """The (B, 1, L, S) boolean mask of each query's selected and causally visible keys (query
    i at position ``S - L + i``, bottom-right), as mlx-lm builds it (``put_along_axis`` of the
    indices, ``&`` the causal mask)."""
    B, _, L, _ = indices.shape
    picked = mx.put_along_axis(mx.zeros((B, 1, L, S), dtype=mx.bool_), indices,
                               mx.array(True), axis=-1)
    pos = S - L + mx.arange(L)
    return picked & (mx.arange(S)[None, :] <= pos[:, None])


def sparse_attention_stock(q, q_pe, latent, k_pe, indices, w_k, w_v, *, scale):
    """mlx-lm's computation (``DeepseekV32Attention`` for L > 1, from the indexer's selection
    on): keys and values decompressed, the rope scores ``(q_pe * scale) @ k_pe^T`` where
    selected and visible and the dtype's lowest value elsewhere as the additive mask of
    ``scaled_dot_product_attention(q_nope, K, V)``. Returns (B, H, L, dv)."""
    S = latent.shape[2]
    pe = (q_pe * scale) @ k_pe.swapaxes(-1, -2)
    pe = mx.where(selection_mask(indices, S), pe, mx.array(mx.finfo(pe.dtype).min, pe.dtype))
    return mx.fast.scaled_dot_product_attention(q, latent @ w_k, latent @ w_v.swapaxes(-1, -2),
                                               scale=scale, mask=pe)


def sparse_attention_gathered(q, q_pe, latent, k_pe, indices, w_k, w_v, *, scale,
                              chunk: int = CHUNK):
    """The op in MLX ops (the brick's composite): the queries absorbed (``q W_k^T``); per
    chunk of queries, each query's k latents and rope keys gathered, its (H x k) scores as two
    batched products, masked to the visible keys, a float32 softmax, the product with the
    gathered latents; the outputs through ``W_v``. Returns (B, H, L, dv) in q's dtype.
    Arguments checked by :func:`sparse_attention`."""
    B, H, L, _ = q.shape
    S, r = latent.shape[2], latent.shape[3]
    k = indices.shape[3]
    f32 = mx.float32
    qa = q @ w_k.swapaxes(-1, -2)                                       # (B, H, L, r)
    pos = S - L + mx.arange(L)
    rows = []
    for b in range(B):
        lat, kpe = latent[b, 0], k_pe[b, 0]
        outs = []
        for l0 in range(0, L, chunk):
            l1 = min(L, l0 + chunk)
            ix = indices[b, 0, l0:l1]                                   # (c, k)
            flat = ix.reshape(-1)
            g_lat = mx.take(lat, flat, axis=0).reshape(l1 - l0, k, r)   # (c, k, r)
            g_pe = mx.take(kpe, flat, axis=0).reshape(l1 - l0, k, -1)
            qc = qa[b, :, l0:l1].swapaxes(0, 1)                         # (c, H, r)
            qp = q_pe[b, :, l0:l1].swapaxes(0, 1)
            s = (qc @ g_lat.swapaxes(-1, -2)).astype(f32) + \
                (qp @ g_pe.swapaxes(-1, -2)).astype(f32)                # (c, H, k)
            visible = (ix <= pos[l0:l1, None])[:, None, :]
            s = mx.where(visible, s * scale, -mx.inf)
            p = mx.softmax(s, axis=-1, precise=True).astype(q.dtype)
            outs.append((p @ g_lat).swapaxes(0, 1))                     # (H, c, r)
        rows.append(mx.concatenate(outs, axis=1))
    return mx.stack(rows) @ w_v.swapaxes(-1, -2)


def flops(L: int, S: int, k: int, H: int, dn: int, dr: int, r: int, dv: int) -> dict:
    """FLOPs of ``L`` queries over ``S`` keys (bottom-right causal), ``k`` selected a query:
    ``{"gathered": F, "stock": F}`` (the absorption and the output projection against the
    decompression; the core over each query's visible selected keys against every (query,
    key) pair: mlx-lm's additive (B, H, L, S) mask leaves SDPA no block to skip)."""
    pos = S - L + 1  # the first query's visible keys
    last = pos + L - 1
    if last <= k:  # every visible key is selected
        picked = L * (pos - 1) + L * (L + 1) // 2
    elif pos >= k:
        picked = L * k
    else:  # queries pos .. k - 1 see fewer than k keys
        picked = (pos + k - 1) * (k - pos) // 2 + (L - (k - pos)) * k
    return {"gathered": 2 * H * (L * r * (dn + dv) + (2 * r + dr) * picked),
            "stock": 2 * H * (S * r * (dn + dv) + (dn + dr + dv) * L * S)}


def sparse_attention(q, q_pe, latent, k_pe, indices, w_k, w_v, *, scale, chunk: int = CHUNK,
                     backend: str | None = None):
    """Top-k sparse attention over an MLA latent cache (module docstring).

    Args:
        q: (B, H, L, dn) float16 / bfloat16 / float32: the queries' non-rope columns
            (``q_nope``).
        q_pe: (B, H, L, dr), q's dtype: the queries' rope columns (rotated).
        latent: (B, 1, S, r), k_pe: (B, 1, S, dr), q's dtype: the cache's latents and rope
            keys (mlx-lm's MLA cache ``keys`` / ``values``), S >= L.
        indices: (B, 1, L, k) integer: each query's selected keys (the indexer's top k:
            distinct, in [0, S)); those past the query's causal position are not attended.
        w_k: (H, r, dn): ``embed_q``'s weight; w_v: (H, dv, r): ``unembed_out``'s (float;
            the piece dequantizes quantized ones), q's dtype.
        scale: the softmax scale (the module's ``scale``).
        chunk: queries per chunk of the gathered composite (> 0).
        backend: ``None`` (auto) or a name of ``mlx_bricks.backends.BACKENDS``; every
            backend runs the gathered composite (MLX ops; no kernel yet).

    Returns:
        (B, H, L, dv) in q's dtype.

    Raises:
        TypeError, ValueError: see :func:`check_sparse_args`; ``chunk`` not a positive int.
    """
    from mlx_bricks.backends import active_backend

    check_sparse_args(q, q_pe, latent, k_pe, indices, w_k, w_v)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    active_backend(backend)  # a bad backend name fails as for every op
    return sparse_attention_gathered(q, q_pe, latent, k_pe, indices, w_k, w_v,
                                     scale=float(scale), chunk=chunk)
