"""The sparse-attention brick's tuner kind: DeepSeek sparse attention's top-k attention over an
MLA latent cache (:func:`~mlx_bricks.bricks.sparse_attention.op.sparse_attention`, its gathered
composite) against mlx-lm's masked dense computation over every key, decompressed
(:func:`~mlx_bricks.bricks.sparse_attention.op.sparse_attention_stock`).

Arguments: ``q, q_pe, latent, k_pe, indices, w_k, w_v, scale``. The key: H, dn, dr, r, dv, k,
the keys S rounded up to a power of two (the dense side grows with S, the gathered one with k);
the bucket of the queries; q's dtype. No kernel variant yet; one composite, ``gathered``, on every backend.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.sparse_attention.op import (
    CHUNK,
    flops,
    selection_mask,
    sparse_attention,
    sparse_attention_gathered,
    sparse_attention_stock,
)
from mlx_bricks.checks import dtype_name
from mlx_bricks.runtime.kind import Composite, Key, OpKind, flags, high_precision, \
    register_kind
from mlx_bricks.tune.buckets import m_bucket

_ARRAYS = ("q", "q_pe", "latent", "k_pe", "indices", "w_k", "w_v")


def _gathered(args, backend, settings):
    return sparse_attention_gathered(*(args[n] for n in _ARRAYS), scale=float(args["scale"]),
                                     chunk=settings.get("chunk", CHUNK))


def reference(q, q_pe, latent, k_pe, indices, w_k, w_v, *, scale, dtype=mx.float32):
    """The attention in ``dtype``, decompressed, over the full (B, H, L, S) scores masked to
    the selected and visible keys (the check's reference). Returns (B, H, L, dv) in ``dtype``."""
    S = latent.shape[2]
    q, q_pe, latent, k_pe, w_k, w_v = (a.astype(dtype) for a in (q, q_pe, latent, k_pe, w_k,
                                                                 w_v))
    s = scale * (q @ (latent @ w_k).swapaxes(-1, -2) + q_pe @ k_pe.swapaxes(-1, -2))
    s = mx.where(selection_mask(indices, S), s, -mx.inf)
    return mx.softmax(s, axis=-1) @ (latent @ w_v.swapaxes(-1, -2))


class SparseAttention(OpKind):
    """The sparse-attention kind (module docstring): rows are the queries (axis 2)."""

    name = "sparse_attention"
    op_name = "sparse_attention"
    activations = ("q", "q_pe", "latent", "k_pe")
    composites = (Composite("gathered", _gathered),)

    def key(self, args):
        B, H, L, dn = args["q"].shape
        S, r = args["latent"].shape[2:]
        # S by powers of two: every sparse call has S > k (2,048 on DeepSeek-V3.2), so the
        # GEMM buckets (top "M>2048") would give all of them one decision
        values = dict(H=H, dn=dn, dr=args["q_pe"].shape[3], r=r, dv=args["w_v"].shape[1],
                      k=args["indices"].shape[3], S=f"<={1 << max(0, S - 1).bit_length()}")
        return Key(self.name, flags(**values), m_bucket(max(1, B * L)),
                   dtype_name(args["q"].dtype), "-")

    def brick(self, args, backend, **kwargs):
        return sparse_attention(*(args[n] for n in _ARRAYS), scale=args["scale"],
                                backend=backend, **kwargs)

    def stock(self, args):
        """The masked dense computation over every key (``sparse_attention_stock``)."""
        return sparse_attention_stock(*(args[n] for n in _ARRAYS), scale=args["scale"])

    def listing(self, backend, dtype, args):
        return ()

    def variant_kwargs(self, name):
        raise ValueError(f"unknown {self.name} variant {name!r}")

    def prior(self, args, backend):
        """The gathered composite where it costs fewer FLOPs than mlx-lm's dense form
        (``op.flops``: at DeepSeek-V3.2's sizes a 2,048-token chunk from about 6,000 keys, a
        prompt in one chunk from about 6,000 tokens; the dense side also holds (H, L, S)
        scores), else stock."""
        B, H, L, dn = args["q"].shape
        S, r = args["latent"].shape[2:]
        f = flops(L, S, args["indices"].shape[3], H, dn, args["q_pe"].shape[3], r,
                  args["w_v"].shape[1])
        return "gathered" if f["gathered"] < f["stock"] else "stock"

    def n_rows(self, args):
        return args["q"].shape[2]

    def measured(self, args):
        B, _, L, _ = args["q"].shape
        return {"L": L, "S": args["latent"].shape[2], "batch": B}

    def tail(self, out, rows):
        return out[:, :, -rows:]

    def synthetic(self, args, seed=0):
        """Normal activations (the latents scaled by r^-1/2 so the scores spread as a
        model's; weights kept) and a selection as the indexer makes one: each query's top k of
        random scores among its visible keys."""
        out = super().synthetic(args, seed)
        B, H, L, _ = args["q"].shape
        S, r = args["latent"].shape[2:]
        k = args["indices"].shape[3]
        out["latent"] = (out["latent"].astype(mx.float32) * r ** -0.5).astype(
            args["latent"].dtype)
        scores = mx.random.uniform(shape=(B, 1, L, S), key=mx.random.key(seed + 7))
        visible = mx.arange(S)[None, :] <= (S - L + mx.arange(L))[:, None]
        scores = mx.where(visible, scores, -mx.inf)
        out["indices"] = mx.argpartition(scores, kth=-k, axis=-1)[..., -k:].astype(
            args["indices"].dtype)
        return out

    def reference_tail(self, args, rows):
        cut = {n: args[n] for n in _ARRAYS}
        cut["q"], cut["q_pe"] = args["q"][:, :, -rows:], args["q_pe"][:, :, -rows:]
        cut["indices"] = args["indices"][:, :, -rows:]  # the last queries over the same keys
        with high_precision(args["q"].dtype) as hp:
            return reference(**cut, scale=float(args["scale"]), dtype=hp)


SPARSE_ATTENTION = register_kind(SparseAttention())
