"""Read GGUF block-quantized tensors as affine sub-blocks: unsigned codes, one scale and one bias
per sub-block, with ``value = scale * code + bias`` exactly.

Every "legacy" and K-quant ggml type is affine inside a sub-block of 16 or 32 consecutive values
of a row (along the input dimension); only the way the scale and bias are stored differs. The
layouts below are those of llama.cpp's ``ggml-common.h`` block structs (bytes in struct order;
``d``, ``dmin`` and ``m`` are float16; ``QK_K = 256`` values per K-quant super-block):

    type  bytes  layout                                   value of code u        sub-block
    Q4_0   18    d, qs[16]                                d * (u - 8)            32, 4 bit
    Q4_1   20    d, m, qs[16]                             d * u + m              32, 4 bit
    Q5_0   22    d, qh[4], qs[16]                         d * (u - 16)           32, 5 bit
    Q5_1   24    d, m, qh[4], qs[16]                      d * u + m              32, 5 bit
    Q8_0   34    d, qs[32] (int8 q, u = q + 128)          d * (u - 128)          32, 8 bit
    Q2_K   84    scales[16], qs[64], d, dmin              d*sc_j*u - dmin*m_j    16, 2 bit
    Q3_K  110    hmask[32], qs[64], scales[12], d         d*(sc_j-32)*(u - 4)    16, 3 bit
    Q4_K  144    d, dmin, scales[12], qs[128]             d*sc_j*u - dmin*m_j    32, 4 bit
    Q5_K  176    d, dmin, scales[12], qh[32], qs[128]     d*sc_j*u - dmin*m_j    32, 5 bit
    Q6_K  210    ql[128], qh[64], scales[16] (int8), d    d*sc_j*(u - 32)        16, 6 bit

(``sc_j`` / ``m_j``: the sub-block's integer scale and minimum: 4 bits each in Q2_K, 6 bits
packed into 12 bytes in Q3_K, Q4_K and Q5_K, int8 in Q6_K.) The bit positions of each code are
given with each reader below.

Exactness: the products ``d * sc_j`` (at most 11 + 8 significant bits), ``scale * u`` (at most
24 bits) and ``bias`` are exact in float32, so ``scale * u + bias`` evaluated in float32 rounds
once, as ``gguf.quants.dequantize`` does: the two give bit-identical float32 values (tested on
random blocks of every type). In float16 the scales of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are the
stored ``d`` and the biases ``-8 d``, ``m``, ``-16 d``, ``-128 d`` (power-of-two multiples), so
they are exact too unless they overflow; the K-quant products ``d * sc_j`` generally need more
than float16's 11 significant bits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

QK_K = 256


@dataclass(frozen=True)
class SubBlocks:
    """A tensor read as affine sub-blocks.

    Attributes:
        codes: ``(rows, cols)`` uint8, each in ``0 .. 2**bits - 1``.
        scales: ``(rows, cols // size)`` float64.
        biases: ``(rows, cols // size)`` float64; value ``scales * codes + biases`` per sub-block.
        bits: bits per code.
        size: values per sub-block (16 or 32).
    """

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    size: int

    def values(self) -> np.ndarray:
        """``(rows, cols)`` float32: ``scale * code + bias`` evaluated in float32 (one rounding,
        as ggml and ``gguf.quants.dequantize`` do)."""
        s = np.repeat(self.scales.astype(np.float32), self.size, axis=1)
        b = np.repeat(self.biases.astype(np.float32), self.size, axis=1)
        return self.codes.astype(np.float32) * s + b


def _f16(b: np.ndarray, offset: int) -> np.ndarray:
    """The float16 at byte ``offset`` of every block, as float64: ``(rows, n_blocks)``."""
    return np.ascontiguousarray(b[..., offset:offset + 2]).view(np.float16)[..., 0].astype(
        np.float64)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """32 4-bit codes from 16 bytes (legacy types): value j < 16 is the low nibble of byte j,
    value j >= 16 the high nibble of byte j - 16. ``qs``: (..., 16) -> (..., 32)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Bit j of a little-endian uint32 (4 bytes) for j = 0..31: (..., 4) -> (..., 32)."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _legacy(b: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    if qtype == Q.Q4_0:
        return _nibbles32(b[..., 2:18]), d, -8.0 * d
    if qtype == Q.Q4_1:
        return _nibbles32(b[..., 4:20]), d, _f16(b, 2)
    if qtype == Q.Q5_0:
        return _nibbles32(b[..., 6:22]) | (_high_bits32(b[..., 2:6]) << 4), d, -16.0 * d
    if qtype == Q.Q5_1:
        return _nibbles32(b[..., 8:24]) | (_high_bits32(b[..., 4:8]) << 4), d, _f16(b, 2)
    # Q8_0: int8 q -> unsigned q + 128 (the bit pattern with its top bit flipped)
    return b[..., 2:34] ^ np.uint8(0x80), d, -128.0 * d


def _k_scales_6bit(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 8 six-bit scales and 8 six-bit minimums from 12 bytes. Bytes 0-3 hold
    scales 0-3 in their low 6 bits, bytes 4-7 minimums 0-3; scales / minimums 4-7 take their low
    4 bits from the low / high nibble of bytes 8-11 and their top 2 bits from the top 2 bits of
    bytes 0-3 / 4-7. ``s``: (..., 12) -> two (..., 8) arrays."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K: 16 six-bit scales (stored + 32) from 12 bytes. Scale j takes its low 4 bits from
    byte j % 8 (low nibble for j < 8, high nibble otherwise) and its top 2 bits from byte
    8 + j % 4, bits 2 * (j // 4) and up. ``s``: (..., 12) -> (..., 16) signed."""
    low = np.concatenate([s[..., 0:8] & 0x0F, s[..., 0:8] >> 4], axis=-1)
    j = np.arange(16)
    top = (s[..., 8 + j % 4] >> (2 * (j // 4)).astype(np.uint8)) & 0x03
    return (low | (top << 4)).astype(np.int16) - 32


def _two_bit_codes(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K low bits: 256 2-bit codes from 64 bytes. Value 128 h + 32 k + l sits in bits
    2k, 2k+1 of byte 32 h + l (h in 0..1, k in 0..3, l in 0..31). (..., 64) -> (..., 256)."""
    q = qs.reshape(*qs.shape[:-1], 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    return (q & 0x03).reshape(*qs.shape[:-1], QK_K)


def _k_quant(b: np.ndarray, qtype: Q) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    shape = b.shape[:-1]  # (rows, n_super_blocks)
    if qtype == Q.Q2_K:
        sc, qs, d, dmin = b[..., 0:16], b[..., 16:80], _f16(b, 80), _f16(b, 82)
        scale = d[..., None] * (sc & 0x0F)
        bias = -dmin[..., None] * (sc >> 4)
        return _two_bit_codes(qs), scale, bias
    if qtype == Q.Q3_K:
        hmask, qs, d = b[..., 0:32], b[..., 32:96], _f16(b, 108)
        # the high bit of value 32 k + l is bit k of hmask byte l; set means "no -4 offset"
        high = np.unpackbits(hmask[..., None, :], axis=-2, bitorder="little", count=8)
        codes = _two_bit_codes(qs) | (high.reshape(*shape, QK_K) << 2)
        scale = d[..., None] * _q3_k_scales(b[..., 96:108])
        return codes, scale, -4.0 * scale
    if qtype in (Q.Q4_K, Q.Q5_K):
        d, dmin = _f16(b, 0), _f16(b, 2)
        sc, mn = _k_scales_6bit(b[..., 4:16])
        qs = b[..., 16:144] if qtype == Q.Q4_K else b[..., 48:176]
        # sub-block 2i: low nibbles of bytes 32i..32i+31, sub-block 2i+1: their high nibbles
        q = qs.reshape(*shape, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        codes = (q & 0x0F).reshape(*shape, QK_K)
        if qtype == Q.Q5_K:  # the fifth bit of value 32 j + l is bit j of qh byte l
            high = np.unpackbits(b[..., None, 16:48], axis=-2, bitorder="little", count=8)
            codes = codes | (high.reshape(*shape, QK_K) << 4)
        return codes, d[..., None] * sc, -dmin[..., None] * mn
    # Q6_K: value 128 h + 64 s + l has its low 4 bits in nibble s of ql byte 64 h + l, and value
    # 128 h + 32 k + l its high 2 bits in bits 2k, 2k+1 of qh byte 32 h + l
    ql, qh, sc, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b, 208)
    low = ql.reshape(*shape, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    high = qh.reshape(*shape, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]
    codes = (low & 0x0F).reshape(*shape, QK_K) | ((high & 0x03).reshape(*shape, QK_K) << 4)
    scale = d[..., None] * sc.view(np.int8)
    return codes, scale, -32.0 * scale


# ggml type -> (bytes per block, values per block, code bits, values per sub-block)
LAYOUTS = {
    Q.Q4_0: (18, 32, 4, 32), Q.Q4_1: (20, 32, 4, 32), Q.Q5_0: (22, 32, 5, 32),
    Q.Q5_1: (24, 32, 5, 32), Q.Q8_0: (34, 32, 8, 32),
    Q.Q2_K: (84, QK_K, 2, 16), Q.Q3_K: (110, QK_K, 3, 16), Q.Q4_K: (144, QK_K, 4, 32),
    Q.Q5_K: (176, QK_K, 5, 32), Q.Q6_K: (210, QK_K, 6, 16),
}


def read_sub_blocks(blocks: np.ndarray, qtype: Q) -> SubBlocks:
    """``blocks`` (the raw GGUF tensor data, ``(rows, n_blocks * block_bytes)`` uint8) as
    affine sub-blocks; ``cols = n_blocks * values_per_block``.

    Raises:
        ValueError: ``qtype`` is not in :data:`LAYOUTS`, or ``blocks`` is not a 2-D uint8 array
            of whole blocks.
    """
    if qtype not in LAYOUTS:
        raise ValueError(f"qtype: {qtype.name} has no affine sub-block layout; supported: "
                         f"{', '.join(t.name for t in LAYOUTS)}")
    block_bytes, per_block, bits, size = LAYOUTS[qtype]
    if blocks.ndim != 2 or blocks.dtype != np.uint8 or blocks.shape[1] % block_bytes:
        raise ValueError(f"blocks: expected (rows, k * {block_bytes}) uint8 for {qtype.name}, "
                         f"got {blocks.shape} {blocks.dtype}")
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, block_bytes)
    codes, scales, biases = (_legacy if per_block == 32 else _k_quant)(b, qtype)
    return SubBlocks(codes=np.ascontiguousarray(codes, dtype=np.uint8).reshape(rows, -1),
                     scales=np.asarray(scales, np.float64).reshape(rows, -1),
                     biases=np.asarray(biases, np.float64).reshape(rows, -1),
                     bits=bits, size=size)
