"""Re-encode GGUF Q4_0 / Q4_1 / Q8_0 blocks as MLX affine-quantized tensors, bit for bit.

A GGUF block covers 32 consecutive values of one row (along the input dimension) and stores a
float16 scale ``d`` (Q4_1 also a float16 minimum ``m``) and 32 small integers ``q``:

    Q4_0  18 bytes: d, 16 bytes of nibbles        value = d * (q - 8)    q in 0..15
    Q4_1  20 bytes: d, m, 16 bytes of nibbles     value = d * q + m       q in 0..15
    Q8_0  34 bytes: d, 32 int8                    value = d * q           q in -128..127

Nibble ``j`` of a Q4 block is the low half of byte ``j`` for j < 16 and the high half of byte
``j - 16`` otherwise. MLX affine quantization (``mx.quantize(w, group_size=32, bits=b)``) stores
per group a scale ``s``, a bias ``z`` and unsigned integers ``u`` (value ``s * u + z``), packed
low bits first into uint32 words. The same numbers fit exactly:

    Q4_0  u = q,       s = d, z = -8 d
    Q4_1  u = q,       s = d, z = m
    Q8_0  u = q + 128, s = d, z = -128 d

``-8 d`` and ``-128 d`` are products by powers of two, so they are exact in float16 unless they
overflow (|d| above 8188 or 511.9), which :func:`to_affine` reports instead of rounding. So
``s * u + z`` is exactly the GGUF's value; evaluated in float32 (``mx.dequantize`` with float32
scales) it is bit-identical to ``gguf.quants.dequantize``. A float16 kernel rounds ``s * u`` and
the sum to float16 as it goes: at most half a float16 ulp of each, as for any float16 model.

Shapes: ``blocks`` is the raw GGUF tensor data, ``(rows, n_blocks * block_bytes)`` uint8. The
result is ``weight`` ``(rows, cols * bits / 32)`` uint32, ``scales`` and ``biases``
``(rows, cols / 32)`` float16, with ``cols = 32 * n_blocks``.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

GROUP_SIZE = 32

# ggml type -> (bits, block bytes, bytes before the quants)
KEEPABLE = {
    GGMLQuantizationType.Q4_0: (4, 18, 2),
    GGMLQuantizationType.Q4_1: (4, 20, 4),
    GGMLQuantizationType.Q8_0: (8, 34, 2),
}


def to_affine(
    blocks: np.ndarray, qtype: GGMLQuantizationType
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """``(weight, scales, biases)`` holding exactly the values of ``blocks``, or None when a bias
    would overflow float16 (the caller then dequantizes that tensor instead).

    Raises ``ValueError`` for a type not in :data:`KEEPABLE` or a byte count that is not a whole
    number of blocks.
    """
    if qtype not in KEEPABLE:
        raise ValueError(f"qtype: {qtype.name} cannot be kept quantized; keepable: "
                         f"{', '.join(t.name for t in KEEPABLE)}")
    bits, block_bytes, header = KEEPABLE[qtype]
    if blocks.ndim != 2 or blocks.dtype != np.uint8 or blocks.shape[1] % block_bytes:
        raise ValueError(f"blocks: expected (rows, k * {block_bytes}) uint8 for {qtype.name}, "
                         f"got {blocks.shape} {blocks.dtype}")
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, block_bytes)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0]
    quants = np.ascontiguousarray(b[..., header:])

    if qtype == GGMLQuantizationType.Q8_0:
        packed_bytes = (quants.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias = d.astype(np.float32) * np.float32(-128)
    else:
        low, high = quants & 0x0F, quants >> 4
        q = np.concatenate([low, high], axis=-1)  # (rows, n_blocks, 32): element order
        packed_bytes = q[..., 0::2] | (q[..., 1::2] << 4)  # two elements per byte, low first
        if qtype == GGMLQuantizationType.Q4_1:
            bias = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        else:
            bias = d.astype(np.float32) * np.float32(-8)

    with np.errstate(over="ignore"):
        biases = bias.astype(np.float16)
    if not np.all(np.isfinite(biases) | ~np.isfinite(bias)):
        return None
    weight = np.ascontiguousarray(packed_bytes).reshape(rows, -1).view(np.uint32)
    return weight, d, biases


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order for one projection (weight, bias, or a quantized tensor's
    packed weight / scales / biases: only the first axis moves).

    llama.cpp's converter stores each head's rows as interleaved pairs (the layout its default
    RoPE rotates); Hugging Face and mlx-lm's default RoPE want the first half of the head's rows,
    then the second half. For K, ``n_head`` is the number of KV heads.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"w: {rows} rows do not split into {n_head} heads of even size")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
