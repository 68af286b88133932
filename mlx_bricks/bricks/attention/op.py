"""The attention brick's public op (brick 4): FlashAttention prefill (online softmax, GQA,
Q8_0 K/V) with causal, bottom-right and sliding-window masks, logit soft-capping and attention
sinks as kernel parameters (no score matrix).

The kernel (``metal_src/attention.metal``) follows FlashAttention-2 (Dao, 2023, "FlashAttention-2:
Faster Attention with Better Parallelism and Work Partitioning"): a threadgroup takes ``bq``
query rows of one head in 8-row blocks, and K/V tiles of ``bk`` keys stream through threadgroup
memory while the softmax is updated online in float32. For head_dim above 128 the SIMD-groups of
a row block split head_dim (``wd`` of them), so no SIMD-group keeps more than 128 columns of Q
and of the output accumulator in registers; see ``msl.attention_tile_config``.

Attention sinks (gpt-oss; ``mx.fast.scaled_dot_product_attention(..., sinks=)``): head h has a
learned logit ``sink_h`` that joins every row's softmax as one more column without a value,
``out = sum_j e^(s_j - m) v_j / (e^(sink_h - m) + sum_j e^(s_j - m))``,
``m = max(sink_h, max_j s_j)``. The online softmax therefore starts each row from the sink
column already seen: ``m = sink_h`` and ``l = e^(sink_h - m) = 1``, ``O = 0``; every later tile
rescales that 1 with the rest of ``l``, so the final ``O / l`` is the formula above. A row with
no visible key keeps ``O = 0``, ``l > 0``: it gives 0, as MLX's SDPA does with sinks.
"""
from __future__ import annotations

import math
import numbers

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.backends import op_backend
from mlx_bricks.bricks.attention import cuda, msl
from mlx_bricks.bricks.attention.msl import SUPPORTED_HEAD_DIMS, attention_tile_config
from mlx_bricks.bricks.q8_0.op import quantize_q8_0
from mlx_bricks.checks import FLOAT_DTYPES, check_array, check_float_dtype, dtype_name
from mlx_bricks.formats.q8_0 import QK8_0, check_kv, check_kv_quant, kv_dense
from mlx_bricks.runtime.variants import kernel_variants


#: The attention kernel has one variant so far (tiles fixed by head_dim and dtype, see
#: :func:`attention_tile_config`); its name in the tuner's decisions.
DEFAULT_VARIANT = "default"


def variant_names(backend: str, dtype=None) -> tuple[str, ...]:
    """Variants of :func:`flash_attention` on ``backend`` (what the tuner times against stock):
    ``("default",)``, the one kernel (called without variant arguments), where it runs; ``()``
    on ``reference`` and on ``cuda`` without a twin. ``dtype`` (of q) is accepted for the
    tuner's uniform call; every float dtype runs on the MSL backends.

    Raises:
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    return kernel_variants(backend, "flash_attention", (DEFAULT_VARIANT,))


def causal_window_mask(Lq: int, Lk: int, window: int) -> mx.array:
    """Boolean (Lq, Lk) mask of a bottom-right aligned causal sliding window: query i (at
    position ``p = Lk - Lq + i``) sees key j iff ``p - window < j <= p``, i.e. ``window`` keys
    including its own, as ``mlx_lm.models.base.create_causal_mask(Lq, Lk - Lq, window)``."""
    pos = mx.arange(Lk - Lq, Lk)[:, None]
    keys = mx.arange(Lk)[None]
    return (keys <= pos) & (keys > pos - window)


#: Bytes of float32 scores above which :func:`flash_attention_reference` attends in blocks of
#: query rows on the CPU (where MLX's attention is unfused): that matrix is an unfused
#: attention's peak memory, e.g. 604 MB for a 2,048-token chunk over 8,192 keys with 9 heads,
#: against 6.7 MB of Q8_0 cache (docs/kv_cache.md). A few blocks are alive at once on MLX's
#: CPU stream, hence a small budget.
REFERENCE_SCORE_BLOCK_BYTES = 16 << 20


def flash_attention_reference(q, k, v, *, scale, mask=None, window=None, softcap=None,
                              kv_quant=None, kv_start=None, sinks=None):
    """Reference of :func:`flash_attention` in MLX ops.

    Without ``softcap``: ``mx.fast.scaled_dot_product_attention`` (``mask="causal"``, or with
    ``window`` the boolean mask of :func:`causal_window_mask`). With ``softcap``: the explicit
    path of mlx-lm's gemma2 attention in q's dtype: ``s = (q * scale) @ k^T``,
    ``s = tanh(s / softcap) * softcap``, masked keys set to the dtype's lowest value,
    ``softmax(precise=True) @ v`` (GQA by broadcasting, no copies of k/v). With
    ``kv_quant="q8_0"`` the K/V go through Q8_0 first (quantized and dequantized to q's dtype,
    or dequantized if given as ``(qs, d)``), exactly the values the kernel attends over.
    With ``kv_start`` ((B,) integer) the mask is the boolean (B, 1, Lq, Lk) array of
    :func:`batch_visible_mask` (keys ``j < kv_start[b]`` hidden on top of the causal / window
    mask) and rows that see no key give 0 (as the kernel; MLX's SDPA would give NaN or the
    mean of V there). With ``sinks`` ((Hq,) float): the SDPA path passes them to
    ``mx.fast.scaled_dot_product_attention(..., sinks=)`` (in q's dtype where they are wider:
    MLX refuses sinks that do not promote to it), the explicit path appends each head's sink
    as one more score column (no value) before the softmax.

    On the CPU, where the score matrix is materialised, when it would exceed
    :data:`REFERENCE_SCORE_BLOCK_BYTES` the query rows go in blocks, each over only the keys
    its mask lets it see (rows are independent; bottom-right alignment is kept by slicing), so
    the peak is a few blocks' scores, not the whole matrix. Arguments as
    :func:`flash_attention` (not checked here).
    """
    if kv_quant == "q8_0":
        k, v = kv_dense(k, q.dtype), kv_dense(v, q.dtype)
    B, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    if kv_start is not None:  # in int32 range before any arithmetic (uint8 wraps, int64 too)
        kv_start = mx.clip(kv_start, 0, Lk).astype(mx.int32)
    # Only on the CPU, where MLX's attention always materialises the scores and the blocks were
    # measured (docs/kv_cache.md); a GPU's unfused cases (some head_dims and dtypes) would gain
    # memory too, at a launch cost per block not yet measured there.
    if mx.default_device() != mx.cpu or B * Hq * Lq * Lk == 0 or Lk < Lq:
        return _reference_attention(q, k, v, scale, mask, window, softcap, kv_start, sinks)
    rows = max(16, REFERENCE_SCORE_BLOCK_BYTES // (4 * B * Hq * Lk))
    if Lq <= rows:
        return _reference_attention(q, k, v, scale, mask, window, softcap, kv_start, sinks)
    causal = mask == "causal"
    blocks = []
    for lo in range(0, Lq, rows):
        hi = min(lo + rows, Lq)
        # keys the rows lo .. hi-1 (positions Lk - Lq + row) can see
        k_end = Lk - Lq + hi if causal else Lk
        k_start = max(0, Lk - Lq + lo - window + 1) if causal and window is not None else 0
        qb = q[:, :, lo:hi]
        if blocks:  # a block starts once the one before is done: none runs ahead
            qb = mx.depends(qb, blocks[-1])
        # keys are sliced from k_start: a row's first valid key moves with them
        ks = None if kv_start is None else kv_start - k_start
        blocks.append(_reference_attention(qb, k[:, :, k_start:k_end], v[:, :, k_start:k_end],
                                           scale, mask, window, softcap, ks, sinks))
    return mx.concatenate(blocks, axis=2)


def batch_visible_mask(Lq: int, Lk: int, kv_start, causal: bool, window=None) -> mx.array:
    """Boolean (B, 1, Lq, Lk) mask of a left-padded batch: query i of row b (position
    ``p = Lk - Lq + i``) sees key j iff ``j >= kv_start[b]``, and ``j <= p`` when ``causal``,
    and ``j > p - window`` with a ``window``. With ``kv_start = cache.left_padding`` and
    ``causal`` it is mlx-lm 0.32's ``BatchKVCache.make_mask(Lq)`` (``create_causal_mask(Lq,
    offset=Lk - Lq, left_padding=kv_start)``). ``kv_start``: (B,) integer mx.array."""
    keys = mx.arange(Lk)
    vis = keys[None, None, None, :] >= kv_start.astype(mx.int32)[:, None, None, None]
    if causal:
        vis = vis & causal_window_mask(Lq, Lk, Lk if window is None else window)
    return vis


def _reference_attention(q, k, v, scale, mask, window, softcap, kv_start=None, sinks=None):
    Lq, Lk = q.shape[2], k.shape[2]
    if kv_start is not None:
        vis = batch_visible_mask(Lq, Lk, kv_start, mask == "causal", window)
        out = _reference_attention(q, k, v, scale, vis, None, softcap, sinks=sinks)
        # a row with no visible key is 0 (the kernel's guard)
        return mx.where(vis.any(axis=-1, keepdims=True), out, mx.array(0, out.dtype))
    if window is not None and mask == "causal":
        mask = causal_window_mask(Lq, Lk, window)
    if softcap is None:
        if sinks is None:
            return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        if not promotes_to(sinks.dtype, q.dtype):
            sinks = sinks.astype(q.dtype)  # MLX's SDPA takes only sinks that promote to q's
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask,
                                                    sinks=sinks)
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qg = (q * scale).reshape(B, Hkv, Hq // Hkv, Lq, D)
    s = qg @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    s = mx.tanh(s / softcap) * softcap
    if isinstance(mask, str):
        mask = causal_window_mask(Lq, Lk, Lk)
    if mask is not None:
        if mask.ndim == 4:  # (B, 1, Lq, Lk): broadcast over the KV heads' query groups
            mask = mx.expand_dims(mask, 2)
        s = mx.where(mask, s, mx.array(mx.finfo(s.dtype).min, s.dtype))
    if sinks is not None:  # one more column per head, no value: it only adds to the sum
        col = sinks.astype(s.dtype).reshape(1, Hkv, Hq // Hkv, 1, 1)
        s = mx.concatenate([mx.broadcast_to(col, (*s.shape[:-1], 1)), s], axis=-1)
        p = mx.softmax(s, axis=-1, precise=True)[..., 1:]
    else:
        p = mx.softmax(s, axis=-1, precise=True)
    return (p @ mx.expand_dims(v, 2)).reshape(B, Hq, Lq, v.shape[-1])


def _check_real(name, value, what):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def _check_masking(mask, window, softcap):
    if isinstance(mask, mx.array):
        raise ValueError(
            "array masks are not supported by the attention brick (only None and 'causal', "
            "with window= for a sliding window): an arbitrary mask would have to be read as a "
            "score-sized array; use mx.fast.scaled_dot_product_attention for them"
        )
    if mask is not None and mask != "causal":
        raise ValueError(f"mask must be None or 'causal', got {mask!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be None or an int, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be >= 1 (keys each query sees, itself included), "
                             f"got {window}")
        if mask != "causal":
            raise ValueError("window needs mask='causal' (a sliding window is causal)")
    if softcap is not None:
        _check_real("softcap", softcap, "None or a Python float")
        if softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {softcap!r}")


def _check_kv_start(kv_start, B: int):
    if kv_start is None:
        return
    if not isinstance(kv_start, mx.array):
        raise TypeError(f"kv_start must be None or an mx.array of shape (B,), got "
                        f"{type(kv_start).__name__}")
    if kv_start.dtype == mx.bool_ or not mx.issubdtype(kv_start.dtype, mx.integer):
        raise TypeError(f"kv_start must have an integer dtype (int32: a batch row's first "
                        f"valid key), got {kv_start.dtype}")
    if tuple(kv_start.shape) != (B,):
        raise ValueError(f"kv_start must have shape (B,) = ({B},) (one first valid key per "
                         f"batch row), got {tuple(kv_start.shape)}")


def promotes_to(a, b) -> bool:
    """Whether float dtype ``a`` promotes to ``b`` under MLX's rules (``a == b``, or ``b`` is
    float32; float16 with bfloat16 promotes to float32)."""
    return a == b or b == mx.float32


def _check_sinks(sinks, q):
    if sinks is None:
        return
    if not isinstance(sinks, mx.array):
        raise TypeError(f"sinks must be None or an mx.array of shape (Hq,), got "
                        f"{type(sinks).__name__}")
    if sinks.dtype not in FLOAT_DTYPES:
        raise TypeError(f"sinks must be float16, bfloat16 or float32, got "
                        f"{dtype_name(sinks.dtype)}")
    if not promotes_to(sinks.dtype, q.dtype):
        raise TypeError(f"sinks ({dtype_name(sinks.dtype)}) must promote to q's dtype "
                        f"({dtype_name(q.dtype)}), as in mx.fast.scaled_dot_product_attention")
    if tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"sinks must have shape (Hq,) = ({q.shape[1]},) (one logit per query "
                         f"head), got {tuple(sinks.shape)}")


def check_value_dim(Dv: int, D: int, quantized: bool):
    """v's head_dim: D, or (multi-head latent attention) a smaller one the kernel's SIMD-groups
    split as they split D (``Dv`` in ``SUPPORTED_HEAD_DIMS``, a multiple of ``8 * wd``)."""
    if Dv == D:
        return
    wd = attention_tile_config(D, mx.float16).wd if D in SUPPORTED_HEAD_DIMS else 1
    if Dv not in SUPPORTED_HEAD_DIMS or Dv > D or Dv % (8 * wd):
        raise ValueError(
            f"v's head_dim {Dv} differs from q/k's {D}: it must be one of "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}, at most {D} and a multiple of "
            f"{8 * wd}")
    if quantized and Dv % QK8_0:
        raise ValueError(f"kv_quant='q8_0' needs v's head_dim % {QK8_0} == 0, got {Dv}")


def _check_attention(q, k, v, scale, mask, window, softcap, kv_quant, kv_start=None,
                     sinks=None):
    check_array("q", q, ndim=4)
    check_float_dtype("q", q)
    quantized = check_kv_quant(kv_quant)
    ks = check_kv("k", k, q, quantized)
    vs = check_kv("v", v, q, quantized)
    _check_real("scale", scale, "a Python float")
    _check_masking(mask, window, softcap)
    B, Hq, Lq, D = q.shape
    if ks[:3] != vs[:3]:
        raise ValueError(f"k and v must have the same shape but for v's head_dim "
                         f"(B, Hkv, Lk equal), got {ks} and {vs}")
    if ks[0] != B or ks[3] != D:
        raise ValueError(
            f"k must have shape (B={B}, Hkv, Lk, D={D}) to match q {tuple(q.shape)}, got {ks}"
        )
    check_value_dim(vs[3], D, quantized)
    Hkv, Lk = ks[1], ks[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of k/v's heads ({Hkv}) for GQA")
    if Lk < Lq:
        raise ValueError(
            f"k/v length ({Lk}) must be >= q length ({Lq}): the causal mask is aligned "
            "bottom-right, so a shorter k/v would leave query rows without keys"
        )
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim {D} is not supported by the attention brick; supported: "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )
    if quantized and D % QK8_0:
        raise ValueError(f"kv_quant='q8_0' needs head_dim % {QK8_0} == 0, got {D}")
    _check_kv_start(kv_start, B)
    _check_sinks(sinks, q)


def flash_attention(q, k, v, *, scale, mask=None, window=None, softcap=None, kv_quant=None,
                    kv_start=None, sinks=None, backend=None):
    """Softmax attention ``softmax(mask(softcap(q @ k.T * scale))) @ v`` on the attention brick
    (with ``sinks``, each head's softmax has one more column, the sink, whose value is 0).

    Args:
        q: (B, Hq, Lq, D) float16, bfloat16 or float32; D in ``SUPPORTED_HEAD_DIMS``
            (64, 80, 96, 128, 192, 256, 512).
        k: (B, Hkv, Lk, D), v: (B, Hkv, Lk, Dv), of q's dtype, ``Hq % Hkv == 0`` (GQA: query
            head h reads KV head ``h // (Hq // Hkv)``), ``Lk >= Lq``. ``Dv`` is D, or a
            smaller head_dim of ``SUPPORTED_HEAD_DIMS`` that is a multiple of 8 times the
            kernel's head_dim split (multi-head latent attention: D = 192 = 128 + 64 rope
            columns, Dv = 128). With ``kv_quant="q8_0"`` each may instead be a Q8_0 tuple
            ``(qs, d)``: qs int8 (B, Hkv, Lk, D), d float16 (B, Hkv, Lk, D // 32) as
            :func:`quantize_q8_0` returns (a Q8_0 KV cache).
        scale: Python float multiplying ``q @ k.T`` (any finite value: ``D ** -0.5``, or
            Gemma's ``query_pre_attn_scalar ** -0.5``).
        mask: None or ``"causal"``, aligned bottom-right as in
            ``mx.fast.scaled_dot_product_attention``: query i sits at position
            ``p = Lk - Lq + i`` and sees keys ``0 .. p`` (chunked prefill against a KV cache).
            Array masks are not supported (ValueError with the reason).
        window: None, or an int >= 1 with ``mask="causal"``: a sliding window, the query at
            position p sees keys j with ``p - window < j <= p`` (``window`` keys including
            itself), as ``mlx_lm.models.base.create_causal_mask(..., window_size=window)``.
            K/V tiles wholly outside every row's window are never loaded.
        softcap: None, or a float > 0: attention logit soft-capping (Gemma 2),
            ``s = softcap * tanh(s / softcap)`` applied to the scaled score ``s = q.k * scale``
            before masking and softmax.
        kv_quant: None, or ``"q8_0"``: K/V are consumed as Q8_0. Full-precision k/v are
            quantized first (:func:`quantize_q8_0`, ggml semantics); tuples are used as given.
            The kernel dequantizes into threadgroup memory (in q's dtype), so the result is
            attention over ``dequantize_q8_0(quantize_q8_0(k))`` etc. Needs ``D % 32 == 0``.
        kv_start: None, or a (B,) integer mx.array (int32; other integer dtypes are clipped
            to ``0 .. Lk`` and cast): batch row b's first valid key. Keys ``j < kv_start[b]``
            are masked for every head and query of row b, on top of ``mask``/``window``/
            ``softcap`` (a left-padded batch: ``kv_start = BatchKVCache.left_padding``, the
            mask mlx-lm's ``make_mask`` builds; see :func:`batch_visible_mask`). Values past
            Lk hide every key (clamped, never read). Whole K/V tiles below it are never
            loaded; a row that sees no key gives 0. Read on the device (no host sync).
        sinks: None, or a (Hq,) float array whose dtype promotes to q's (float16 or bfloat16
            sinks with a float32 q; q's own dtype): attention sinks (gpt-oss), head h's logit
            ``sinks[h]`` joins the softmax of every row of that head as a column with value
            0, compared with the final (scaled, capped) scores and itself neither scaled nor
            capped, as ``mx.fast.scaled_dot_product_attention(..., sinks=)``. Read in float32
            (module docstring: the online softmax starts from m = sink, l = 1).
        backend: ``None`` (auto), ``"metal"``, ``"cuda"``, ``"emulator"`` or ``"reference"``.

    Returns:
        (B, Hq, Lq, Dv) array of q's dtype. On metal/emulator it is a transposed view of a
        row-contiguous (B, Lq, Hq, Dv) buffer, as MLX's SDPA returns it, so mlx-lm's
        ``out.transpose(0, 2, 1, 3).reshape(B, L, -1)`` before o_proj needs no copy. The
        reference backend returns whatever :func:`flash_attention_reference` returns.

    Memory: q, k, v (and Q8_0 tuples) are read in place through their strides, so mlx-lm's
    transposed projections and KV cache slices ``keys[..., :offset, :]`` are not copied. With
    ``kv_quant="q8_0"`` and full-precision k/v, the quantized copies (qs, d) are new arrays.

    Numerics: the raw dot products, the running max/sum (FlashAttention-2 online softmax,
    ``exp2(fma(s, log2 e, -m log2 e))`` with s the scaled, capped score) and the output
    accumulators are float32; a row with no visible key gives 0 (unreachable through this
    function since Lk >= Lq and a window includes the query's own key).

    Raises:
        TypeError: non-array inputs, non-float q, k/v dtype different from q's, malformed Q8_0
            tuples, tuples without kv_quant, a non-real scale or softcap, a non-int window, a
            kv_start that is not an integer mx.array, sinks that are not a float mx.array
            promoting to q's dtype.
        ValueError: shapes that do not match, Hq % Hkv != 0, Lk < Lq, unsupported head_dim
            (of q/k, or of v: see ``v`` above),
            an array mask or unknown mask string, window < 1 or without mask="causal",
            softcap <= 0, a non-finite scale or softcap, unknown kv_quant, a kv_start not of
            shape (B,), sinks not of shape (Hq,), or a bad backend.
        NotImplementedError: ``backend="cuda"`` while the brick has no CUDA twin.
    """
    _check_attention(q, k, v, scale, mask, window, softcap, kv_quant, kv_start, sinks)
    return run_flash_attention(q, k, v, scale=scale, mask=mask, window=window, softcap=softcap,
                               kv_quant=kv_quant, kv_start=kv_start, sinks=sinks,
                               backend=op_backend("flash_attention", backend))


def _int32_start(kv_start, k):
    """kv_start as int32, clipped to 0 .. Lk first (a wide or unsigned value must not wrap to
    a small int32)."""
    if kv_start is not None and kv_start.dtype != mx.int32:
        kv_start = mx.clip(kv_start, 0, k[0].shape[2] if isinstance(k, tuple) else k.shape[2])
        kv_start = kv_start.astype(mx.int32)
    return kv_start


def run_flash_attention(q, k, v, *, scale, mask=None, window=None, softcap=None, kv_quant=None,
                        kv_start=None, sinks=None, backend: str, variant: str | None = None):
    """:func:`flash_attention` after its checks, on the resolved ``backend`` (what the tuner
    and the Q8_0 cache call). ``variant``: None (the kernel of ``attention.cu``), or on
    ``cuda`` one of the fast family's (``cuda.FA_WGMMA``, ``cuda.FA_MMA`` or a tile name of
    ``cuda.fa_tiles``: 16-bit q/k/v, no Q8_0 K/V; ValueError otherwise)."""
    name = backend
    if variant is not None:
        if name != "cuda" or not cuda.fa_applies(q, k, v, kv_quant):
            raise ValueError(f"attention variant {variant!r} runs on cuda with 16-bit q/k/v of "
                             f"head_dim in {cuda.FA_HEAD_DIMS} and no kv_quant")
        return cuda.launch_attention_fa(q, k, v, scale=float(scale), causal=mask == "causal",
                                        window=None if window is None else int(window),
                                        softcap=None if softcap is None else float(softcap),
                                        variant=variant, kv_start=_int32_start(kv_start, k),
                                        sinks=sinks)
    scale = float(scale)
    softcap = None if softcap is None else float(softcap)
    window = None if window is None else int(window)
    kv_start = _int32_start(kv_start, k)
    if name == "reference":
        return flash_attention_reference(q, k, v, scale=scale, mask=mask, window=window,
                                         softcap=softcap, kv_quant=kv_quant, kv_start=kv_start,
                                         sinks=sinks)
    B, Hq, Lq, D = q.shape
    if B == 0 or Hq == 0 or Lq == 0:
        Dv = (v[0] if isinstance(v, tuple) else v).shape[3]
        return mx.zeros((B, Hq, Lq, Dv), q.dtype)
    k_scale = v_scale = None
    if kv_quant == "q8_0":
        # Quantize with the backend's own kernel where it has one (the same ggml rounding).
        qb = name if kernels.has_kernel("q8_0_quantize", name) else "reference"
        k, k_scale = k if isinstance(k, tuple) else quantize_q8_0(k, backend=qb)
        v, v_scale = v if isinstance(v, tuple) else quantize_q8_0(v, backend=qb)
    if name == "cuda":
        Dv = v.shape[3]
        if Dv != D:  # the CUDA twin takes one head_dim: V padded with zero columns, cut after
            v = mx.pad(v, [(0, 0), (0, 0), (0, 0), (0, D - Dv)])
            if v_scale is not None:
                v_scale = mx.pad(v_scale, [(0, 0), (0, 0), (0, 0), (0, (D - Dv) // QK8_0)])
        out = cuda.launch_attention_cuda(q, k, v, k_scale, v_scale, scale=scale,
                                         causal=mask == "causal", window=window,
                                         softcap=softcap, kv_start=kv_start, sinks=sinks)
        return out if Dv == D else out[..., :Dv]
    return msl.launch_attention(q, k, v, k_scale, v_scale, scale=scale, causal=mask == "causal",
                                window=window, softcap=softcap, backend=name, kv_start=kv_start,
                                sinks=sinks)
