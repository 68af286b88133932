"""Decode attention brick: flash-decoding over a (Q8_0 or full-precision) KV cache.

For decode (one query token, or a few: speculative drafts) attention is memory-bound: every step
reads the whole KV cache once. The brick splits the KV length across threadgroups
(flash-decoding: Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context inference"),
each computing a partial softmax (row max ``m``, row sum ``l``, unnormalised output ``O``, float32)
of *all* the query rows that share one KV head, so each K/V element is read once per KV head
(GQA-aware), and one reduction kernel merges the splits. K/V may be Q8_0 ``(qs, d)`` blocks (a
Q8_0 KV cache, :mod:`mlx_bricks.cache`): 34 bytes per 32 values instead of 64.

Kernels: ``metal_src/decode_attention.metal`` (split: the lanes of a SIMD-group span head_dim,
as MLX's ``sdpa_vector``) and ``decode_attention_reduce.metal`` (reduction), header
``decode_attention.h``; CUDA twins in ``cuda_src/`` with the same inputs, outputs and grid shape
(their rows per threadgroup go up to ``MAX_ROWS``, the MSL kernel's to ``MSL_MAX_ROWS``).

Why a separate op from :func:`mlx_bricks.ops.flash_attention`: the prefill brick tiles 32 query
rows per threadgroup and parallelises over query blocks, which leaves a GPU idle for Lq = 1; this
one parallelises over the KV length and groups the GQA heads instead. The caller (the patch's
attention) picks by query length: ``decode_attention`` for ``Lq <= DECODE_MAX_LQ``.
"""
from __future__ import annotations

import numbers

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.backends import op_backend
from mlx_bricks.kernels import launch
from mlx_bricks.checks import check_array, check_float_dtype
from mlx_bricks.bricks.q8_0.op import quantize_q8_0
from mlx_bricks.formats.q8_0 import QK8_0, check_kv, check_kv_quant, kv_dense

#: Head dims the brick supports (all tested); others raise ValueError.
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 192, 256, 512)
#: Query lengths the patch should send here (above it, the prefill brick parallelises better).
DECODE_MAX_LQ = 8
#: SIMD-groups (warps) per threadgroup of the split kernel (``DEC_NSG`` in decode_attention.h,
#: ``NSG`` in the CUDA twin).
DECODE_NSG = 4
#: Keys of the shortest split: 32 per SIMD-group (one 32-key chunk of the CUDA twin's warps;
#: 32 key rows of each SIMD-group of the MSL kernel).
KEYS_PER_ROUND = 32 * DECODE_NSG
#: Per-lane register budget: query rows per threadgroup x column slabs (head_dim / 32) <= this.
ROW_SLAB_BUDGET = 32
#: Largest number of query rows in one threadgroup of the CUDA twin.
MAX_ROWS = 16
#: Largest number of query rows in one threadgroup of the MSL kernel (lanes across head_dim:
#: each lane keeps q and O of every row, ceil(head_dim / 32) columns each).
MSL_MAX_ROWS = 8
#: Threadgroups the automatic split count aims for (a few per core: 132 SMs on an H200, up to
#: 40 GPU cores on an M4 Max), so that long contexts fill the GPU.
TARGET_THREADGROUPS = 512

kernels.register(kernels.KernelSpec(
    name="decode_attention",
    body="decode_attention.metal",
    input_names=("q", "k", "v", "k_scale", "v_scale", "split_len", "sm_scale"),
    output_names=("o_part", "ml_part"),
    headers=("q8_0.h", "decode_attention.h"),
    ensure_row_contiguous=False,
    cuda_body="decode_attention.cu",
    cuda_headers=("mma.cuh",),
))
kernels.register(kernels.KernelSpec(
    name="decode_attention_reduce",
    body="decode_attention_reduce.metal",
    input_names=("o_part", "ml_part"),
    output_names=("out",),
    headers=("q8_0.h", "decode_attention.h"),
    ensure_row_contiguous=True,
    cuda_body="decode_attention_reduce.cu",
    cuda_headers=("mma.cuh",),
))


def rows_per_threadgroup(head_dim: int, rows: int, max_rows: int = MAX_ROWS) -> int:
    """Query rows one threadgroup holds (template ``RT``): the smallest power of two >= ``rows``
    (the rows of one KV head, ``Hq / Hkv * Lq``), capped so that ``RT * ceil(head_dim / 32) <=
    ROW_SLAB_BUDGET`` (each lane keeps RT x head_dim / 32 output accumulators) and
    ``max_rows`` (``MAX_ROWS`` for the CUDA twin, ``MSL_MAX_ROWS`` for the MSL kernel).

    CUDA: head_dim 64: up to 16 rows; 80-128: 8; 192, 256: 4; 512: 2. MSL: 64-128: 8; 192, 256:
    4; 512: 2. More rows than that take several threadgroups per KV head (each re-reads the
    split's K/V).
    """
    slabs = -(-head_dim // 32)
    cap = max_rows
    while cap * slabs > ROW_SLAB_BUDGET:
        cap //= 2
    rt = 1
    while rt < min(rows, cap):
        rt *= 2
    return rt


def plan_splits(kv_len: int, n_groups: int, splits: int | None = None) -> tuple[int, int]:
    """``(S, split_len)``: how many splits of the KV length, and keys per split.

    Args:
        kv_len: Lk.
        n_groups: threadgroups per split (``B * Hkv * n_tiles``).
        splits: requested count, or None: enough to reach ``TARGET_THREADGROUPS`` threadgroups,
            but no split shorter than ``KEYS_PER_ROUND`` keys (32 per SIMD-group).

    A requested count is kept as given, even when it does not divide Lk (the last split is
    shorter) or exceeds it (trailing splits are empty and merge as zeros). ``split_len =
    ceil(Lk / S)``.
    """
    if splits is None:
        want = -(-TARGET_THREADGROUPS // max(1, n_groups))
        splits = max(1, min(want, -(-kv_len // KEYS_PER_ROUND)))
    return splits, max(1, -(-kv_len // splits))


def _threadgroup_bytes(head_dim: int, rt: int) -> int:
    """Shared memory of the CUDA twin's split kernel: q tile, probabilities, per-warp O, m, l."""
    return 4 * (rt * head_dim + DECODE_NSG * rt * (32 + head_dim + 2))


def msl_threadgroup_bytes(head_dim: int, rt: int) -> int:
    """Threadgroup memory of the MSL split kernel: one row of each SIMD-group's O (the merge
    goes row by row) and every row's m and l per SIMD-group (2.3 KB at head_dim 128, RT 8)."""
    return 4 * (DECODE_NSG * head_dim + 2 * DECODE_NSG * rt)


def decode_attention_reference(q, k, v, *, scale, mask=None, kv_quant=None):
    """Reference of :func:`decode_attention` in MLX ops: ``mx.fast.scaled_dot_product_attention``
    over the K/V the kernel attends (with ``kv_quant="q8_0"``: dequantized to q's dtype)."""
    if kv_quant == "q8_0":
        k, v = kv_dense(k, q.dtype), kv_dense(v, q.dtype)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _check(q, k, v, scale, mask, kv_quant, splits):
    check_array("q", q, ndim=4)
    check_float_dtype("q", q)
    quantized = check_kv_quant(kv_quant)
    ks = check_kv("k", k, q, quantized)
    vs = check_kv("v", v, q, quantized)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a Python float, got {type(scale).__name__}")
    if isinstance(mask, mx.array):
        raise ValueError("array masks are not supported by the decode attention brick "
                         "(only None and 'causal'); use mx.fast.scaled_dot_product_attention")
    if mask is not None and mask != "causal":
        raise ValueError(f"mask must be None or 'causal', got {mask!r}")
    if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                               or splits < 1):
        raise ValueError(f"splits must be None or a positive int, got {splits!r}")
    B, Hq, Lq, D = q.shape
    if ks != vs:
        raise ValueError(f"k and v must have the same shape, got {ks} and {vs}")
    if ks[0] != B or ks[3] != D:
        raise ValueError(f"k and v must have shape (B={B}, Hkv, Lk, D={D}) to match q "
                         f"{tuple(q.shape)}, got {ks}")
    Hkv, Lk = ks[1], ks[2]
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"q's heads ({Hq}) must be a multiple of k/v's heads ({Hkv}) for GQA")
    if Lk < Lq:
        raise ValueError(f"k/v length ({Lk}) must be >= q length ({Lq}): the causal mask is "
                         "aligned bottom-right")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported by the decode attention brick; "
                         f"supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if quantized and D % QK8_0:
        raise ValueError(f"kv_quant='q8_0' needs head_dim % {QK8_0} == 0, got {D}")


def launch_decode_attention(q, k, v, k_scale, v_scale, scale, causal, splits, backend):
    """Run the split and reduction kernels (no argument checks: :func:`decode_attention` does
    them). ``k_scale``/``v_scale`` None means full-precision k/v. Returns (B, Hq, Lq, D) as a
    transposed view of a row-contiguous (B, Lq, Hq, D) buffer."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    rows = (Hq // Hkv) * Lq
    if backend == "cuda":
        rt = rows_per_threadgroup(D, rows)
        assert _threadgroup_bytes(D, rt) <= 32768, (D, rt)
    else:
        rt = rows_per_threadgroup(D, rows, MSL_MAX_ROWS)
        assert msl_threadgroup_bytes(D, rt) <= 32768, (D, rt)
    n_tiles = -(-rows // rt)
    S, split_len = plan_splits(Lk, B * Hkv * n_tiles, splits)
    kv_q8 = k_scale is not None
    if not kv_q8:
        k_scale = v_scale = mx.zeros((1, 1, 1, 1), mx.float16)  # never read; 4-D strides
    nt = 32 * DECODE_NSG
    o_part, ml_part = launch(
        "decode_attention", backend,
        inputs=[q, k, v, k_scale, v_scale, mx.array([split_len], mx.int32),
                mx.array([scale], mx.float32)],
        grid=(nt * S, Hkv * n_tiles, B),
        threadgroup=(nt, 1, 1),
        output_shapes=[(B, Hq, Lq, S, D), (B, Hq, Lq, S, 2)],
        output_dtypes=[mx.float32, mx.float32],
        template=[("T", q.dtype), ("D", D), ("RT", rt), ("KV_Q8", kv_q8),
                  ("CAUSAL", bool(causal) and Lq > 1)],
    )
    (out,) = launch(
        "decode_attention_reduce", backend,
        inputs=[o_part, ml_part],
        grid=(32, Lq * Hq, B),
        threadgroup=(32, 1, 1),
        output_shapes=[(B, Lq, Hq, D)],
        output_dtypes=[q.dtype],
        template=[("T", q.dtype), ("D", D)],
    )
    return out.transpose(0, 2, 1, 3)


def decode_attention(q, k, v, *, scale, mask=None, kv_quant=None, splits=None, backend=None):
    """Attention of a few query tokens over a long KV cache: ``softmax(q @ k.T * scale) @ v``.

    Args:
        q: (B, Hq, Lq, D) float16, bfloat16 or float32; D in ``SUPPORTED_HEAD_DIMS`` (64, 80,
            96, 128, 192, 256, 512). Meant for ``Lq <= DECODE_MAX_LQ`` (decode, speculative
            drafts); correct for any Lq.
        k, v: (B, Hkv, Lk, D) of q's dtype, ``Hq % Hkv == 0`` (GQA: query head h reads KV head
            ``h // (Hq // Hkv)``), ``Lk >= Lq``. With ``kv_quant="q8_0"`` each may instead be a
            Q8_0 tuple ``(qs, d)``: qs int8 (B, Hkv, Lk, D), d float16 (B, Hkv, Lk, D // 32), as
            :class:`mlx_bricks.cache.Q8KVCache` returns them.
        scale: Python float multiplying ``q @ k.T``.
        mask: None or ``"causal"`` (bottom-right aligned: query i sees keys ``0 .. Lk - Lq + i``;
            for Lq = 1 both are the same). Array masks are not supported.
        kv_quant: None, or ``"q8_0"``: K/V are Q8_0 (full-precision k/v are quantized first
            with ggml's rounding; tuples are used as given). The kernel reads the int8 quants
            and scales directly: a score is ``sum_blocks d * (q . qs)``, an output column
            ``sum_keys p * (qs * d)``, i.e. attention over the dequantized K/V in float32.
        splits: number of KV splits (threadgroups along the KV length); None picks enough to
            fill the GPU (:func:`plan_splits`). Any positive count is valid, also one that does
            not divide Lk or exceeds it.
        backend: None (auto), ``"metal"``, ``"cuda"``, ``"emulator"`` or ``"reference"``.

    Returns:
        (B, Hq, Lq, D) of q's dtype; on kernel backends the transposed view of a row-contiguous
        (B, Lq, Hq, D) buffer (as MLX's SDPA), so mlx-lm's ``transpose(0, 2, 1, 3).reshape``
        before o_proj is free.

    Memory: q, k, v and the Q8_0 tuples are read in place through their strides (cache slices
    are not copied). The kernels write float32 partials ``(B, Hq, Lq, S, D + 2)``.

    Numerics: scores, softmax statistics and accumulators are float32 (scores in the log2
    domain, exp2); a row without visible keys gives 0.

    Raises:
        TypeError: non-array inputs, non-float q, k/v dtype different from q's, malformed Q8_0
            tuples, tuples without kv_quant, or a non-real scale.
        ValueError: mismatched shapes, Hq % Hkv != 0, Lk < Lq, unsupported head_dim, Q8_0 with
            head_dim % 32 != 0, an array or unknown mask, unknown kv_quant, bad splits, or a bad
            backend.
        NotImplementedError: never for this brick (it has a CUDA twin).
    """
    _check(q, k, v, scale, mask, kv_quant, splits)
    name = op_backend("decode_attention", backend)
    scale = float(scale)
    if name == "reference":
        return decode_attention_reference(q, k, v, scale=scale, mask=mask, kv_quant=kv_quant)
    B, Hq, Lq, D = q.shape
    if B == 0 or Hq == 0 or Lq == 0:
        return mx.zeros(q.shape, q.dtype)
    k_scale = v_scale = None
    if kv_quant == "q8_0":
        qbackend = "reference" if name == "cuda" else name  # the Q8_0 quantizer has no CUDA twin
        k, k_scale = k if isinstance(k, tuple) else quantize_q8_0(k, backend=qbackend)
        v, v_scale = v if isinstance(v, tuple) else quantize_q8_0(v, backend=qbackend)
    return launch_decode_attention(q, k, v, k_scale, v_scale, scale, mask == "causal", splits,
                                   name)
