"""Sparse-attention brick: DeepSeek sparse attention's top-k attention over an MLA latent cache,
the gathered composite against a float64 numpy reference (each query's softmax over its
selected, causally visible keys) with stock's masked dense form as the same-dtype naive
comparison (tests/tolerance.py)."""
import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks.sparse_attention.op import (
    selection_mask,
    sparse_attention,
    sparse_attention_stock,
)
from tests.tolerance import assert_dtype_close

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32


def attention64(q, q_pe, latent, k_pe, indices, w_k, w_v, scale):
    """Per batch row, query and head: softmax over the selected keys with position <= the
    query's (bottom-right) of scale (q . K_j + q_pe . k_pe_j), times V_j, with K = c W_k[h],
    V = c W_v[h]^T decompressed; float64 numpy."""
    q, q_pe, latent, k_pe, w_k, w_v = (np.asarray(a.astype(F32), np.float64)
                                       for a in (q, q_pe, latent, k_pe, w_k, w_v))
    indices = np.asarray(indices)
    B, H, L, _ = q.shape
    S = latent.shape[2]
    out = np.zeros((B, H, L, w_v.shape[1]))
    for b in range(B):
        K = np.einsum("sr,hrd->hsd", latent[b, 0], w_k)
        V = np.einsum("sr,hvr->hsv", latent[b, 0], w_v)
        for i in range(L):
            keys = sorted(j for j in indices[b, 0, i] if j <= S - L + i)
            for h in range(H):
                s = scale * (K[h, keys] @ q[b, h, i] + k_pe[b, 0, keys] @ q_pe[b, h, i])
                p = np.exp(s - s.max())
                out[b, h, i] = (p / p.sum()) @ V[h, keys]
    return out


def inputs(B=1, H=4, L=9, S=30, r=32, dn=16, dr=8, dv=12, k=12, dtype=F32, seed=0):
    """Normal activations and weights (scaled as a model's) and a selection as the indexer
    makes one (each query's top k of random scores among its visible keys; early queries see
    fewer than k: some picks masked)."""
    rng = np.random.default_rng(seed)
    arr = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32)).astype(dtype)  # noqa
    scores = rng.uniform(size=(B, 1, L, S))
    pos = S - L + np.arange(L)
    scores[..., np.arange(S)[None, :] > pos[:, None]] = -np.inf
    idx = np.argpartition(scores, -k, axis=-1)[..., -k:]
    return dict(q=arr(B, H, L, dn), q_pe=arr(B, H, L, dr), latent=arr(B, 1, S, r),
                k_pe=arr(B, 1, S, dr), indices=mx.array(idx.astype(np.uint32)),
                w_k=arr(H, r, dn) * r ** -0.5, w_v=arr(H, dv, r) * r ** -0.5)


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
@pytest.mark.parametrize("shape", [dict(), dict(B=2, L=40, S=40, k=16),
                                   dict(L=3, S=70, k=70), dict(H=2, L=33, S=50, k=5)],
                         ids=["short turn", "prompt", "k = S", "chunk tail"])
def test_against_float64(shape, dtype):
    a = inputs(dtype=dtype, **shape)
    scale = 0.3
    out = sparse_attention(**a, scale=scale, chunk=16)
    naive = sparse_attention_stock(**a, scale=scale)
    assert out.dtype == dtype and out.shape == naive.shape
    assert_dtype_close(out, attention64(**a, scale=scale), naive, dtype=dtype)


def test_selection_mask_is_mlx_lm_s():
    a = inputs(L=5, S=12, k=6)
    m = np.array(selection_mask(a["indices"], 12))
    idx = np.array(a["indices"])
    for i in range(5):
        want = np.zeros(12, bool)
        want[idx[0, 0, i]] = True
        want[np.arange(12) > 12 - 5 + i] = False
        assert (m[0, 0, i] == want).all()


def test_bad_arguments():
    a = inputs()
    with pytest.raises(ValueError, match="indices must"):
        sparse_attention(**{**a, "indices": a["indices"][:, :, :3]}, scale=1.0)
    with pytest.raises(TypeError, match="indices must be an integer"):
        sparse_attention(**{**a, "indices": a["indices"].astype(F32)}, scale=1.0)
    with pytest.raises(TypeError, match="latent has dtype"):
        sparse_attention(**{**a, "latent": a["latent"].astype(F16)}, scale=1.0)
    with pytest.raises(ValueError, match="latent must"):
        sparse_attention(**{**a, "k_pe": a["k_pe"][..., :3]}, scale=1.0)
    with pytest.raises(ValueError, match="w_k must"):
        sparse_attention(**{**a, "w_k": a["w_k"][:2]}, scale=1.0)
    with pytest.raises(ValueError, match="chunk"):
        sparse_attention(**a, scale=1.0, chunk=0)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_kind_check(dtype):
    """The tuner kind's synthetic inputs (an indexer-like selection) and its check: the
    composite passes against stock, a corrupted output fails."""
    from mlx_bricks.bricks.sparse_attention.kind import SPARSE_ATTENTION as K
    from mlx_bricks.runtime.kind import Act

    w = inputs(H=4, r=32, dn=16, dv=12, dtype=dtype)
    args = {"q": Act((1, 4, 20, 16), dtype), "q_pe": Act((1, 4, 20, 8), dtype),
            "latent": Act((1, 1, 60, 32), dtype), "k_pe": Act((1, 1, 60, 8), dtype),
            "indices": Act((1, 1, 20, 16), mx.uint32), "w_k": w["w_k"], "w_v": w["w_v"],
            "scale": 0.2}
    synth = K.synthetic(args, seed=2)
    naive = K.stock(synth)
    (composite,) = K.variants("reference", dtype, synth)
    out = composite.run(synth, "reference")
    assert K.check(out, naive, synth).ok
    assert not K.check(out * 1.1 + 0.05, naive, synth).ok
    # the prior: the gathered form where it costs fewer FLOPs (many keys, few selected)
    assert K.prior({**args, "latent": Act((1, 1, 20, 32), dtype),  # k close to S: dense
                    "indices": Act((1, 1, 20, 18), mx.uint32)}, "reference") == "stock"
    assert K.prior({**args, "latent": Act((1, 1, 4000, 32), dtype)}, "reference") == "gathered"
    # the key tells long caches apart (every sparse call has S > k)
    keys = {str(K.key({**args, "latent": Act((1, 1, S, 32), dtype)})) for S in (60, 3000, 4000, 5000)}
    assert len(keys) == 3  # <= 64, <= 4096 (two), <= 8192


def test_flops():
    from mlx_bricks.bricks.sparse_attention.op import flops

    # DeepSeek-V3.2 (H 128, dn 128, dr 64, r 512, dv 128, top 2,048): a 2,048-token turn
    # over 30,720 cached keys: the gathered form far cheaper; the second 2,048-token chunk of
    # a prompt (4,096 keys) and a 4,096-token prompt in one chunk: dense cheaper; 8,192 in one
    # chunk: gathered (the dense side scores every (query, key) pair)
    dims = (2048, 128, 128, 64, 512, 128)
    f = flops(2048, 32768, *dims)
    assert f["gathered"] * 5 < f["stock"]
    for L, S in ((2048, 4096), (4096, 4096)):
        f = flops(L, S, *dims)
        assert f["gathered"] > f["stock"], (L, S)
    f = flops(8192, 8192, *dims)
    assert f["gathered"] < f["stock"]
    # every visible key selected: the visible pairs; the dense side all L x S
    f = flops(4, 10, 10, 1, 1, 1, 1, 1)
    assert f["gathered"] == 2 * (4 * 2 + 3 * (7 + 8 + 9 + 10))
    assert f["stock"] == 2 * (10 * 2 + 3 * 4 * 10)
