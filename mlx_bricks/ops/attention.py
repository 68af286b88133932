"""Brick 4: FlashAttention prefill (online softmax, causal tile skipping, GQA, Q8_0 K/V).

The kernel (``metal_src/attention.metal``) follows FlashAttention-2 (Dao, 2023, "FlashAttention-2:
Faster Attention with Better Parallelism and Work Partitioning"): a threadgroup takes
``ATTENTION_BQ`` query rows of one head, each SIMD-group owns 8 of them, and K/V tiles of ``BK``
keys stream through threadgroup memory while the softmax is updated online in float32.
"""
from __future__ import annotations

import numbers

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.backends import resolve_backend
from mlx_bricks.ops._checks import check_array, check_float_dtype, dtype_name
from mlx_bricks.ops._variants import kernel_variants
from mlx_bricks.ops.q8_0 import (
    QK8_0,
    dequantize_q8_0_reference,
    quantize_q8_0,
    quantize_q8_0_reference,
)

#: Head dims the brick supports (all tested); others raise ValueError.
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
#: SIMD-groups per threadgroup (``ATTN_NSG`` in ``metal_src/attention.h``).
ATTENTION_NSG = 4
#: Query rows per threadgroup: 8 per SIMD-group.
ATTENTION_BQ = 8 * ATTENTION_NSG
#: Threadgroup memory limit of Apple GPUs, bytes.
THREADGROUP_MEMORY_LIMIT = 32768
KV_QUANTS = (None, "q8_0")

kernels.register(kernels.KernelSpec(
    name="flash_attention",
    body="attention.metal",
    input_names=("q", "k", "v", "k_scale", "v_scale", "sm_scale"),
    output_names=("out",),
    headers=("q8_0.h", "attention.h"),
    ensure_row_contiguous=False,
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


def attention_tile_config(head_dim: int, dtype) -> tuple[int, int, int]:
    """Tile sizes of the attention kernel for ``head_dim`` and the q dtype.

    Returns:
        ``(BQ, BK, threadgroup_bytes)``: query rows per threadgroup, keys per K/V tile and the
        threadgroup memory of the kernel, ``(D * (BK + pad) + BK * (D + pad)) * itemsize`` with
        ``pad = 16 / itemsize`` (K^T and V tiles, rows padded by 16 bytes). BK is 32 for
        D <= 96 and 16 above (as MLX's steel attention), halved until the tiles fit in 32 KB:
        fp32 with D = 256 gets BK = 8.
    """
    itemsize = dtype.size
    pad = 16 // itemsize
    bk = 32 if head_dim <= 96 else 16

    def tg_bytes(bk):
        return (head_dim * (bk + pad) + bk * (head_dim + pad)) * itemsize

    while tg_bytes(bk) > THREADGROUP_MEMORY_LIMIT and bk > 8:
        bk //= 2
    nbytes = tg_bytes(bk)
    assert nbytes <= THREADGROUP_MEMORY_LIMIT, (head_dim, dtype, bk, nbytes)
    return ATTENTION_BQ, bk, nbytes


def _kv_dequantized(k, v, dtype):
    """(k, v) as the kernel sees them with kv_quant="q8_0": the Q8_0 round trip of full-precision
    arrays, or the dequantized (qs, d) tuples, in ``dtype`` (MLX ops)."""
    def one(x):
        qs_d = x if isinstance(x, tuple) else quantize_q8_0_reference(x)
        return dequantize_q8_0_reference(*qs_d, dtype)
    return one(k), one(v)


def flash_attention_reference(q, k, v, *, scale, mask=None, kv_quant=None):
    """Reference of :func:`flash_attention` in MLX ops: ``mx.fast.scaled_dot_product_attention``.

    ``mask`` is None or "causal" (bottom-right aligned when Lk > Lq). With ``kv_quant="q8_0"``
    the K/V go through Q8_0 first (quantized and dequantized to q's dtype, or dequantized if
    given as ``(qs, d)``), exactly the values the kernel attends over.
    """
    if kv_quant == "q8_0":
        k, v = _kv_dequantized(k, v, q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


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


def _check_attention(q, k, v, scale, mask, kv_quant):
    check_array("q", q, ndim=4)
    check_float_dtype("q", q)
    if kv_quant not in KV_QUANTS:
        raise ValueError(f"kv_quant must be None or 'q8_0', got {kv_quant!r}")
    quantized = kv_quant == "q8_0"
    if not quantized and (isinstance(k, tuple) or isinstance(v, tuple)):
        raise TypeError("k and v may be (qs, d) tuples only with kv_quant='q8_0'")
    ks = _check_kv_array("k", k, q, quantized)
    vs = _check_kv_array("v", v, q, quantized)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if isinstance(mask, mx.array):
        raise ValueError(
            "array masks are not supported by the attention brick (only None and 'causal'); "
            "use mx.fast.scaled_dot_product_attention for them"
        )
    if mask is not None and mask != "causal":
        raise ValueError(f"mask must be None or 'causal', got {mask!r}")
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


def _launch_attention(q, k, v, k_scale, v_scale, scale, causal, backend):
    """Run the attention kernel; returns (B, Hq, Lq, D) as a transposed view of a
    (B, Lq, Hq, D) buffer. No argument checks: the caller has done them (tests reach the
    kernel's no-visible-key guard through here with Lq > Lk)."""
    B, Hq, Lq, D = q.shape
    _, bk, _ = attention_tile_config(D, q.dtype)
    kv_q8 = k_scale is not None
    if not kv_q8:
        k_scale = v_scale = mx.zeros((1, 1, 1, 1), mx.float16)  # never read; 4-D strides
    nt = 32 * ATTENTION_NSG
    n_qblocks = -(-Lq // ATTENTION_BQ)
    (out,) = kernels.launch(
        "flash_attention", backend,
        inputs=[q, k, v, k_scale, v_scale, mx.array([scale], mx.float32)],
        grid=(nt * n_qblocks, Hq, B),
        threadgroup=(nt, 1, 1),
        output_shapes=[(B, Lq, Hq, D)],
        output_dtypes=[q.dtype],
        template=[("T", q.dtype), ("D", D), ("BK", bk), ("CAUSAL", bool(causal)),
                  ("KV_Q8", kv_q8)],
    )
    return out.transpose(0, 2, 1, 3)


def flash_attention(q, k, v, *, scale, mask=None, kv_quant=None, backend=None):
    """Softmax attention ``softmax(q @ k.T * scale + mask) @ v`` on the attention brick.

    Args:
        q: (B, Hq, Lq, D) float16, bfloat16 or float32; D in ``SUPPORTED_HEAD_DIMS``
            (64, 80, 96, 128, 256).
        k, v: (B, Hkv, Lk, D) of q's dtype, ``Hq % Hkv == 0`` (GQA: query head h reads KV head
            ``h // (Hq // Hkv)``), ``Lk >= Lq``. With ``kv_quant="q8_0"`` each may instead be
            a Q8_0 tuple ``(qs, d)``: qs int8 (B, Hkv, Lk, D), d float16 (B, Hkv, Lk, D // 32)
            as :func:`quantize_q8_0` returns (a Q8_0 KV cache).
        scale: Python float multiplying ``q @ k.T`` (usually ``D ** -0.5``).
        mask: None or ``"causal"``, aligned bottom-right as in
            ``mx.fast.scaled_dot_product_attention``: query i sees keys ``0 .. Lk - Lq + i``
            (chunked prefill against a KV cache). Array masks are not supported.
        kv_quant: None, or ``"q8_0"``: K/V are consumed as Q8_0. Full-precision k/v are
            quantized first (:func:`quantize_q8_0`, ggml semantics); tuples are used as given.
            The kernel dequantizes into threadgroup memory (in q's dtype), so the result is
            attention over ``dequantize_q8_0(quantize_q8_0(k))`` etc. Needs ``D % 32 == 0``.
        backend: ``None`` (auto), ``"metal"``, ``"emulator"`` or ``"reference"``.

    Returns:
        (B, Hq, Lq, D) array of q's dtype. On metal/emulator it is a transposed view of a
        row-contiguous (B, Lq, Hq, D) buffer, as MLX's SDPA returns it, so mlx-lm's
        ``out.transpose(0, 2, 1, 3).reshape(B, L, -1)`` before o_proj needs no copy. The
        reference backend returns whatever ``mx.fast.scaled_dot_product_attention`` returns.

    Memory: q, k, v (and Q8_0 tuples) are read in place through their strides, so mlx-lm's
    transposed projections and KV cache slices ``keys[..., :offset, :]`` are not copied. With
    ``kv_quant="q8_0"`` and full-precision k/v, the quantized copies (qs, d) are new arrays.

    Numerics: scores, the running max/sum (FlashAttention-2 online softmax, exp2 with the scale
    folded with log2(e)) and the output accumulators are float32; a row with no visible key
    gives 0 (unreachable through this function since Lk >= Lq).

    Raises:
        TypeError: non-array inputs, non-float q, k/v dtype different from q's, malformed Q8_0
            tuples, tuples without kv_quant, or a non-real scale.
        ValueError: shapes that do not match, Hq % Hkv != 0, Lk < Lq, unsupported head_dim,
            an array mask or unknown mask string, unknown kv_quant, or a bad backend.
    """
    _check_attention(q, k, v, scale, mask, kv_quant)
    name = resolve_backend(backend)
    scale = float(scale)
    if name == "reference":
        return flash_attention_reference(q, k, v, scale=scale, mask=mask, kv_quant=kv_quant)
    B, Hq, Lq, D = q.shape
    if B == 0 or Hq == 0 or Lq == 0:
        return mx.zeros(q.shape, q.dtype)
    k_scale = v_scale = None
    if kv_quant == "q8_0":
        k, k_scale = k if isinstance(k, tuple) else quantize_q8_0(k, backend=name)
        v, v_scale = v if isinstance(v, tuple) else quantize_q8_0(v, backend=name)
    return _launch_attention(q, k, v, k_scale, v_scale, scale, mask == "causal", name)
