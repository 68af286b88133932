"""Brick 4: FlashAttention prefill (online softmax, GQA, Q8_0 K/V) with causal, bottom-right and
sliding-window masks and logit soft-capping as kernel parameters (no score matrix).

The kernel (``metal_src/attention.metal``) follows FlashAttention-2 (Dao, 2023, "FlashAttention-2:
Faster Attention with Better Parallelism and Work Partitioning"): a threadgroup takes ``bq``
query rows of one head in 8-row blocks, and K/V tiles of ``bk`` keys stream through threadgroup
memory while the softmax is updated online in float32. For head_dim above 128 the SIMD-groups of
a row block split head_dim (``wd`` of them), so no SIMD-group keeps more than 128 columns of Q
and of the output accumulator in registers; see :func:`attention_tile_config`.
"""
from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.backends import kernel_backend
from mlx_bricks.ops._checks import check_array, check_float_dtype, dtype_name
from mlx_bricks.ops._variants import kernel_variants
from mlx_bricks.ops.q8_0 import (
    QK8_0,
    dequantize_q8_0_reference,
    quantize_q8_0,
    quantize_q8_0_reference,
)

#: Head dims the brick supports (all tested); others raise ValueError.
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 192, 256, 512)
#: Threadgroup memory limit of Apple GPUs, bytes (``ATTN_TG_LIMIT`` in ``attention.h``).
THREADGROUP_MEMORY_LIMIT = 32768
KV_QUANTS = (None, "q8_0")
#: Largest head_dim slice one SIMD-group keeps in registers (Q and O: 2 x slice / 4 floats a lane).
MAX_HEAD_DIM_PER_SIMDGROUP = 128

kernels.register(kernels.KernelSpec(
    name="flash_attention",
    body="attention.metal",
    input_names=("q", "k", "v", "k_scale", "v_scale", "fparams", "iparams"),
    output_names=("out",),
    headers=("q8_0.h", "gemm.h", "attention.h"),
    ensure_row_contiguous=False,
    cuda_body="attention.cu",
    cuda_headers=("mma.cuh", "attention.cuh"),
))


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


class AttentionTiles(NamedTuple):
    """Tile sizes of one attention kernel variant (template arguments and launch geometry).

    Attributes:
        bq: query rows per threadgroup (``8 * wq``).
        bk: keys per K/V tile.
        wq: 8-row query blocks per threadgroup.
        wd: SIMD-groups per row block splitting head_dim (each owns ``head_dim / wd`` columns).
        kv_shared: K and V take turns in one threadgroup buffer (only where two do not fit).
        threadgroup_bytes: threadgroup memory of the kernel, bytes.
    """

    bq: int
    bk: int
    wq: int
    wd: int
    kv_shared: bool
    threadgroup_bytes: int

    @property
    def threads(self) -> int:
        """Threads per threadgroup: 32 per SIMD-group, ``wq * wd`` SIMD-groups."""
        return 32 * self.wq * self.wd


def attention_threadgroup_bytes(head_dim: int, itemsize: int, bk: int, wq: int, wd: int,
                                kv_shared: bool) -> int:
    """Threadgroup memory of the attention kernel, bytes: K and V tiles of ``bk`` keys with rows
    of ``head_dim`` elements padded by 16 bytes (one buffer when ``kv_shared``), plus
    ``wq * wd * 8 * bk`` float32 partial scores when ``wd > 1``."""
    tile = bk * (head_dim + 16 // itemsize) * itemsize
    partial = wq * wd * 8 * bk * 4 if wd > 1 else 0
    return (1 if kv_shared else 2) * tile + partial


def attention_tile_config(head_dim: int, dtype) -> AttentionTiles:
    """Tile sizes of the attention kernel for ``head_dim`` and the q dtype.

    Rule (not tuned on hardware): ``wd`` is the fewest SIMD-groups that keep each one's
    head_dim slice at most 128 (1 up to 128, 2 for 192 and 256, 4 for 512), ``wq`` 4 row blocks
    (2 at head_dim 512), so 128 threads up to head_dim 128 and 256 above. ``bk`` starts at 32
    for head_dim <= 96 and 16 above (as MLX's steel attention); where K and V tiles of that
    ``bk`` do not fit in 32 KB side by side, they share one buffer (``kv_shared``: 2 barriers
    per tile more, against halving ``bk``, which doubles every per-tile barrier: head_dim 512 in
    16 bits runs bk 16 shared, 4 barriers per 16 keys, where bk 8 took 3 per 8), and ``bk`` is
    halved, down to 8, only while even one buffer does not fit (float32, head_dim 512: bk 8
    shared).

    Raises:
        ValueError: head_dim not in ``SUPPORTED_HEAD_DIMS``.
    """
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    itemsize = dtype.size
    wd = 1
    while head_dim // wd > MAX_HEAD_DIM_PER_SIMDGROUP:
        wd *= 2
    wq = 4 if wd <= 2 else 2
    bk = 32 if head_dim <= 96 else 16
    shared = False

    def nbytes():
        return attention_threadgroup_bytes(head_dim, itemsize, bk, wq, wd, shared)

    if nbytes() > THREADGROUP_MEMORY_LIMIT:
        shared = True
    while nbytes() > THREADGROUP_MEMORY_LIMIT and bk > 8:
        bk //= 2
    size = nbytes()
    assert size <= THREADGROUP_MEMORY_LIMIT, (head_dim, dtype, bk, size)
    assert head_dim % (8 * wd) == 0
    return AttentionTiles(8 * wq, bk, wq, wd, shared, size)


def _kv_dequantized(k, v, dtype):
    """(k, v) as the kernel sees them with kv_quant="q8_0": the Q8_0 round trip of full-precision
    arrays, or the dequantized (qs, d) tuples, in ``dtype`` (MLX ops)."""
    def one(x):
        qs_d = x if isinstance(x, tuple) else quantize_q8_0_reference(x)
        return dequantize_q8_0_reference(*qs_d, dtype)
    return one(k), one(v)


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
                              kv_quant=None):
    """Reference of :func:`flash_attention` in MLX ops.

    Without ``softcap``: ``mx.fast.scaled_dot_product_attention`` (``mask="causal"``, or with
    ``window`` the boolean mask of :func:`causal_window_mask`). With ``softcap``: the explicit
    path of mlx-lm's gemma2 attention in q's dtype: ``s = (q * scale) @ k^T``,
    ``s = tanh(s / softcap) * softcap``, masked keys set to the dtype's lowest value,
    ``softmax(precise=True) @ v`` (GQA by broadcasting, no copies of k/v). With
    ``kv_quant="q8_0"`` the K/V go through Q8_0 first (quantized and dequantized to q's dtype,
    or dequantized if given as ``(qs, d)``), exactly the values the kernel attends over.

    On the CPU, where the score matrix is materialised, when it would exceed
    :data:`REFERENCE_SCORE_BLOCK_BYTES` the query rows go in blocks, each over only the keys
    its mask lets it see (rows are independent; bottom-right alignment is kept by slicing), so
    the peak is a few blocks' scores, not the whole matrix. Arguments as
    :func:`flash_attention` (not checked here).
    """
    if kv_quant == "q8_0":
        k, v = _kv_dequantized(k, v, q.dtype)
    B, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    # Only on the CPU, where MLX's attention always materialises the scores and the blocks were
    # measured (docs/kv_cache.md); a GPU's unfused cases (some head_dims and dtypes) would gain
    # memory too, at a launch cost per block not yet measured there.
    if mx.default_device() != mx.cpu or B * Hq * Lq * Lk == 0 or Lk < Lq:
        return _reference_attention(q, k, v, scale, mask, window, softcap)
    rows = max(16, REFERENCE_SCORE_BLOCK_BYTES // (4 * B * Hq * Lk))
    if Lq <= rows:
        return _reference_attention(q, k, v, scale, mask, window, softcap)
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
        blocks.append(_reference_attention(qb, k[:, :, k_start:k_end], v[:, :, k_start:k_end],
                                           scale, mask, window, softcap))
    return mx.concatenate(blocks, axis=2)


def _reference_attention(q, k, v, scale, mask, window, softcap):
    Lq, Lk = q.shape[2], k.shape[2]
    if window is not None and mask == "causal":
        mask = causal_window_mask(Lq, Lk, window)
    if softcap is None:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    qg = (q * scale).reshape(B, Hkv, Hq // Hkv, Lq, D)
    s = qg @ mx.expand_dims(k, 2).swapaxes(-1, -2)
    s = mx.tanh(s / softcap) * softcap
    if isinstance(mask, str):
        mask = causal_window_mask(Lq, Lk, Lk)
    if mask is not None:
        s = mx.where(mask, s, mx.array(mx.finfo(s.dtype).min, s.dtype))
    p = mx.softmax(s, axis=-1, precise=True)
    return (p @ mx.expand_dims(v, 2)).reshape(B, Hq, Lq, D)


def _check_kv_array(name, x, q, quantized):
    if quantized and isinstance(x, tuple):
        if len(x) != 2:
            raise TypeError(f"{name} as a Q8_0 tuple must be (qs, d), got {len(x)} items")
        qs, d = x
        check_array(f"{name}[0] (qs)", qs, ndim=4)
        check_array(f"{name}[1] (d)", d, ndim=4)
        if qs.dtype != mx.int8:
            raise TypeError(f"{name}[0] (qs) must be int8, got {dtype_name(qs.dtype)}")
        if d.dtype != mx.float16:
            raise TypeError(f"{name}[1] (d) must be float16, got {dtype_name(d.dtype)}")
        want = (*qs.shape[:-1], qs.shape[-1] // QK8_0)
        if tuple(d.shape) != want:
            raise ValueError(f"{name}[1] (d) must have shape {want}, got {tuple(d.shape)}")
        return tuple(qs.shape)
    check_array(name, x, ndim=4)
    if x.dtype != q.dtype:
        raise TypeError(
            f"{name} has dtype {dtype_name(x.dtype)} but q has {dtype_name(q.dtype)}; "
            "mixed dtypes are not supported"
        )
    return tuple(x.shape)


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


def _check_attention(q, k, v, scale, mask, window, softcap, kv_quant):
    check_array("q", q, ndim=4)
    check_float_dtype("q", q)
    if kv_quant not in KV_QUANTS:
        raise ValueError(f"kv_quant must be None or 'q8_0', got {kv_quant!r}")
    quantized = kv_quant == "q8_0"
    if not quantized and (isinstance(k, tuple) or isinstance(v, tuple)):
        raise TypeError("k and v may be (qs, d) tuples only with kv_quant='q8_0'")
    ks = _check_kv_array("k", k, q, quantized)
    vs = _check_kv_array("v", v, q, quantized)
    _check_real("scale", scale, "a Python float")
    _check_masking(mask, window, softcap)
    B, Hq, Lq, D = q.shape
    if ks != vs:
        raise ValueError(f"k and v must have the same shape, got {ks} and {vs}")
    if ks[0] != B or ks[3] != D:
        raise ValueError(
            f"k and v must have shape (B={B}, Hkv, Lk, D={D}) to match q {tuple(q.shape)}, got {ks}"
        )
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


def _launch_attention(q, k, v, k_scale, v_scale, *, scale, causal, window, softcap, backend):
    """Run the MSL attention kernel on ``backend`` (metal or emulator); returns (B, Hq, Lq, D)
    as a transposed view of a (B, Lq, Hq, D) buffer. k/v are T arrays, or int8 quants with
    their float16 scales k_scale/v_scale (else None). No argument checks: the caller has done
    them (tests reach the kernel's no-visible-key guard through here with Lq > Lk)."""
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    tiles = attention_tile_config(D, q.dtype)
    kv_q8 = k_scale is not None
    if not kv_q8:
        k_scale = v_scale = mx.zeros((1, 1, 1, 1), mx.float16)  # never read; 4-D strides
    # Query position p = Lk - Lq + i <= Lk - 1, so a window of Lk or more excludes no key.
    windowed = window is not None and window < Lk
    cap = 0.0 if softcap is None else float(softcap)
    fparams = mx.array([scale, cap, 1.0 / cap if cap else 0.0], mx.float32)
    iparams = mx.array([window if windowed else 0], mx.int32)
    n_qblocks = -(-Lq // tiles.bq)
    (out,) = kernels.launch(
        "flash_attention", backend,
        inputs=[q, k, v, k_scale, v_scale, fparams, iparams],
        grid=(tiles.threads * n_qblocks, Hq, B),
        threadgroup=(tiles.threads, 1, 1),
        output_shapes=[(B, Lq, Hq, D)],
        output_dtypes=[q.dtype],
        template=[("T", q.dtype), ("D", D), ("BK", tiles.bk), ("WQ", tiles.wq),
                  ("WD", tiles.wd), ("KV_SHARED", tiles.kv_shared), ("CAUSAL", bool(causal)),
                  ("WINDOW", windowed), ("SOFTCAP", softcap is not None), ("KV_Q8", kv_q8)],
    )
    return out.transpose(0, 2, 1, 3)


def flash_attention(q, k, v, *, scale, mask=None, window=None, softcap=None, kv_quant=None,
                    backend=None):
    """Softmax attention ``softmax(mask(softcap(q @ k.T * scale))) @ v`` on the attention brick.

    Args:
        q: (B, Hq, Lq, D) float16, bfloat16 or float32; D in ``SUPPORTED_HEAD_DIMS``
            (64, 80, 96, 128, 192, 256, 512).
        k, v: (B, Hkv, Lk, D) of q's dtype, ``Hq % Hkv == 0`` (GQA: query head h reads KV head
            ``h // (Hq // Hkv)``), ``Lk >= Lq``. With ``kv_quant="q8_0"`` each may instead be
            a Q8_0 tuple ``(qs, d)``: qs int8 (B, Hkv, Lk, D), d float16 (B, Hkv, Lk, D // 32)
            as :func:`quantize_q8_0` returns (a Q8_0 KV cache).
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
        backend: ``None`` (auto), ``"metal"``, ``"cuda"``, ``"emulator"`` or ``"reference"``.

    Returns:
        (B, Hq, Lq, D) array of q's dtype. On metal/emulator it is a transposed view of a
        row-contiguous (B, Lq, Hq, D) buffer, as MLX's SDPA returns it, so mlx-lm's
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
            tuples, tuples without kv_quant, a non-real scale or softcap, a non-int window.
        ValueError: shapes that do not match, Hq % Hkv != 0, Lk < Lq, unsupported head_dim,
            an array mask or unknown mask string, window < 1 or without mask="causal",
            softcap <= 0, a non-finite scale or softcap, unknown kv_quant, or a bad backend.
        NotImplementedError: ``backend="cuda"`` while the brick has no CUDA twin.
    """
    _check_attention(q, k, v, scale, mask, window, softcap, kv_quant)
    name = kernel_backend("flash_attention", backend)
    scale = float(scale)
    softcap = None if softcap is None else float(softcap)
    window = None if window is None else int(window)
    if name == "reference":
        return flash_attention_reference(q, k, v, scale=scale, mask=mask, window=window,
                                         softcap=softcap, kv_quant=kv_quant)
    B, Hq, Lq, D = q.shape
    if B == 0 or Hq == 0 or Lq == 0:
        return mx.zeros(q.shape, q.dtype)
    k_scale = v_scale = None
    if kv_quant == "q8_0":
        # Quantize with the backend's own kernel where it has one (the same ggml rounding).
        qb = name if kernels.has_kernel("q8_0_quantize", name) else "reference"
        k, k_scale = k if isinstance(k, tuple) else quantize_q8_0(k, backend=qb)
        v, v_scale = v if isinstance(v, tuple) else quantize_q8_0(v, backend=qb)
    if name == "cuda":
        from mlx_bricks.ops.attention_cuda import launch_attention_cuda

        return launch_attention_cuda(q, k, v, k_scale, v_scale, scale=scale,
                                     causal=mask == "causal", window=window, softcap=softcap)
    return _launch_attention(q, k, v, k_scale, v_scale, scale=scale, causal=mask == "causal",
                             window=window, softcap=softcap, backend=name)
