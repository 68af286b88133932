"""The MLA op (bricks/mla/op.py) against a float64 numpy multi-head latent attention: both forms,
ragged lengths, chunked prefill (S > L), DeepSeek-V3's head widths 192 / 128 and MiniCPM3's
96 / 64, on every backend; the FLOP rule that picks the form; argument errors."""
from __future__ import annotations

import numpy as np
import pytest
import mlx.core as mx

from mlx_bricks.bricks.mla.op import (
    ABSORBED,
    DECOMPRESSED,
    choose_form,
    form_flops,
    mla_attention,
    mla_attention_reference,
    visible_pairs,
)
from tests.tolerance import assert_dtype_close, to_f64

F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32


def mla64(q_nope, q_pe, latent, k_pe, w_k, w_v, scale, causal=True):
    """Float64: head h's keys [c W_k[h], k_pe], values c W_v[h]^T, bottom-right causal."""
    qn, qp, c, kp, wk, wv = (to_f64(a) for a in (q_nope, q_pe, latent, k_pe, w_k, w_v))
    k = np.concatenate([c @ wk, np.broadcast_to(kp, (*qn.shape[:2], *kp.shape[2:]))], -1)
    v = c @ np.swapaxes(wv, -1, -2)
    s = np.concatenate([qn, qp], -1) @ np.swapaxes(k, -1, -2) * scale
    L, S = qn.shape[2], c.shape[2]
    if causal:
        vis = np.arange(S)[None] <= np.arange(S - L, S)[:, None]
        s = np.where(vis, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def make(B, H, L, S, r, dn, dr, dv, dtype, seed):
    rng = np.random.default_rng(seed)

    def rand(*shape, s=1.0):
        return mx.array((s * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    # latents are normalised in the models (kv_a_layernorm): unit scale; W_k / W_v ~ r^-1/2
    return (rand(B, H, L, dn), rand(B, H, L, dr), rand(B, 1, S, r), rand(B, 1, S, dr),
            rand(H, r, dn, s=r**-0.5), rand(H, dv, r, s=r**-0.5))


# B, H, L, S, r, dn, dr, dv, dtype
CASES = [
    (1, 4, 33, 33, 128, 128, 64, 128, BF16),  # DeepSeek-V3's widths, prompt from empty
    (2, 2, 7, 40, 64, 128, 64, 128, F16),     # chunked prefill over a cache
    (1, 3, 20, 37, 96, 64, 32, 64, F32),      # MiniCPM3's widths
    (1, 2, 1, 9, 64, 64, 32, 64, BF16),       # one query
]


def case_id(c):
    B, H, L, S, r, dn, dr, dv, dtype = c
    return f"B{B}-H{H}-L{L}-S{S}-r{r}-{dn}+{dr}/{dv}-{str(dtype).split('.')[-1]}"


@pytest.mark.parametrize("form", [DECOMPRESSED, ABSORBED])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_mla_matches_float64(kernel_backend, case, form):
    B, H, L, S, r, dn, dr, dv, dtype = case
    args = make(B, H, L, S, r, dn, dr, dv, dtype, seed=L * S + r)
    scale = (dn + dr) ** -0.5
    out = mla_attention(*args, scale=scale, form=form, backend=kernel_backend)
    assert out.shape == (B, H, L, dv) and out.dtype == dtype
    ref = mla64(*args, scale)
    naive = mla_attention_reference(*args, scale=scale)  # mlx-lm's computation, same dtype
    factor = 4.0 if kernel_backend == "reference" or form == ABSORBED else 2.0
    assert_dtype_close(out, ref, naive, dtype=dtype, factor=factor,
                       what=f"{case_id(case)} {form}")


def test_reference_is_mlx_lm_deepseek_v3_core():
    """The op's reference computes what DeepseekV3Attention does after its cache update (the
    rope scores as an additive mask), bit for bit."""
    from mlx_lm.models.base import scaled_dot_product_attention

    qn, qp, c, kp, wk, wv = make(1, 2, 5, 9, 32, 64, 32, 64, BF16, seed=3)
    scale = 0.11
    mask = mx.arange(9)[None] <= mx.arange(4, 9)[:, None]
    pe = (qp * scale) @ kp.swapaxes(-1, -2)
    pe = mx.where(mask, pe, mx.array(mx.finfo(pe.dtype).min, pe.dtype))
    want = scaled_dot_product_attention(qn, c @ wk, c @ wv.swapaxes(-1, -2), cache=None,
                                        scale=scale, mask=pe)
    assert mx.array_equal(mla_attention_reference(qn, qp, c, kp, wk, wv, scale=scale),
                          want).item()


def test_form_rule_counts_flops():
    """DeepSeek-V3 (r 512, 128 + 64 / 128, 128 heads): a prompt from an empty cache
    decompresses, a short turn over a long cache absorbs; the counts by hand."""
    H, r, dn, dr, dv = 128, 512, 128, 64, 128
    assert choose_form(2048, 2048, H, r, dn, dr, dv) == DECOMPRESSED
    assert choose_form(2048, 10240, H, r, dn, dr, dv) == DECOMPRESSED
    assert choose_form(16, 10000, H, r, dn, dr, dv) == ABSORBED
    assert visible_pairs(3, 5) == 3 * 2 + 6
    f = form_flops(3, 5, 2, 8, 4, 2, 4)
    assert f[DECOMPRESSED] == 2 * 2 * (5 * 8 * 8 + 10 * 12)
    assert f[ABSORBED] == 2 * 2 * (3 * 8 * 8 + 18 * 12)


def test_default_form_is_the_cheaper(monkeypatch):
    calls = []
    from mlx_bricks.bricks.mla import op

    monkeypatch.setattr(op, "absorbed_attention", lambda *a, **k: calls.append(1) or mx.zeros(1))
    args = make(1, 2, 2, 40, 256, 64, 32, 64, F32, seed=1)
    assert choose_form(2, 40, 2, 256, 64, 32, 64) == ABSORBED
    mla_attention(*args, scale=0.1, backend="reference")
    assert calls == [1]


@pytest.mark.parametrize("change, exc, match", [
    (dict(q_pe=mx.zeros((1, 2, 4, 32), F16)), TypeError, "q_pe has dtype"),
    (dict(latent=mx.zeros((1, 2, 9, 64), F32)), ValueError, r"latent must be \(B, 1, S, r\)"),
    (dict(latent=mx.zeros((1, 1, 3, 64), F32), k_pe=mx.zeros((1, 1, 3, 32), F32)), ValueError,
     "must be >= the query length"),
    (dict(w_k=mx.zeros((2, 64, 32), F32)), ValueError, "w_k must be"),
    (dict(form="sparse"), ValueError, "form must be"),
    (dict(q_nope=mx.zeros((2, 4, 64), F32)), ValueError, "q_nope must have 4"),
])
def test_bad_arguments(change, exc, match):
    qn, qp, c, kp, wk, wv = make(1, 2, 4, 9, 64, 64, 32, 64, F32, seed=2)
    kw = dict(q_nope=qn, q_pe=qp, latent=c, k_pe=kp, w_k=wk, w_v=wv)
    form = change.pop("form", None)
    kw.update(change)
    with pytest.raises(exc, match=match):
        mla_attention(*kw.values(), scale=0.1, form=form, backend="reference")
