"""A simple K-quant encoder (Q2_K ... Q6_K) for tests and measurements: ``gguf`` (gguf-py) can
dequantize the K-quants but not quantize them, and llama.cpp is not installed here.

The quantizer is simpler than llama.cpp's (no error search, no importance matrix): per
16/32-value sub-block the min/max or max-abs grid, then the sub-block scales (and minimums)
quantized to the type's 4/6/8-bit integers against the super-block's float16 ``d`` (``dmin``),
then the nearest codes. The structure (super-blocks of 256, sub-block scales of 4-8 bits, how
much adjacent sub-blocks' scales differ on real weights) is what matters for the MLX affine
mapping's error, and it is the same. The packing follows ``ggml-common.h``'s block structs (see
``mlx_bricks/gguf/blocks.py``); ``encode`` checks that ``gguf.quants.dequantize`` reads back the
intended values.

``write_variant`` rewrites a GGUF (the default model's) with other types per tensor, using
llama.cpp's fallback types where a row does not hold whole super-blocks; ``q4_k_m``, ``q3_k``,
``q2_k`` and ``q6_k`` are the recipes ``scripts/gguf_requant_error.py`` and the slow test use.
"""
from __future__ import annotations

import numpy as np
from pathlib import Path

from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

QK_K = 256
K_QUANTS = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)[..., None].view(np.uint8)


def _int_scales(values: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """``(d (n,) float16 values as float64, integer scales (n, k))``: ``values`` (n, k) >= 0
    approximated by d * integer, integers in 0..levels."""
    d = (values.max(axis=1) / levels).astype(np.float16).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d[:, None] > 0, np.rint(values / d[:, None]), 0)
    return d, np.clip(q, 0, levels).astype(np.int64)


def _asymmetric(x, sub, bits, scale_bits):
    """Q2_K / Q4_K / Q5_K: value = d*sc*u - dmin*m with u in 0..2**bits-1."""
    n = (1 << bits) - 1
    xs = x.reshape(len(x), -1, sub)  # (super-blocks, sub-blocks, sub)
    lo = np.minimum(xs.min(axis=2), 0.0)  # llama.cpp keeps the minimum <= 0
    scale = (xs.max(axis=2) - lo) / n
    d, sc = _int_scales(scale, (1 << scale_bits) - 1)
    dmin, mn = _int_scales(-lo, (1 << scale_bits) - 1)
    s = d[:, None] * sc
    z = -dmin[:, None] * mn
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(s[..., None] > 0, np.rint((xs - z[..., None]) / s[..., None]), 0)
    return np.clip(u, 0, n).astype(np.uint8).reshape(len(x), QK_K), d, dmin, sc, mn


def _symmetric(x, sub, bits, scale_levels):
    """Q3_K / Q6_K: value = d*sc*(u - 2**(bits-1)), sc signed; the extreme value of each
    sub-block maps to code 0 (as llama.cpp's make_qx_quants does)."""
    half = 1 << (bits - 1)
    xs = x.reshape(len(x), -1, sub)
    idx = np.abs(xs).argmax(axis=2)
    extreme = np.take_along_axis(xs, idx[..., None], axis=2)[..., 0]
    scale = -extreme / half
    big = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)[:, 0]
    d = (-big / scale_levels).astype(np.float16).astype(np.float64)  # sc = -levels at the largest
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] != 0, np.rint(scale / d[:, None]), 0)
    sc = np.clip(sc, -scale_levels, scale_levels - 1).astype(np.int64)
    s = d[:, None] * sc
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(s[..., None] != 0, np.rint(xs / s[..., None]) + half, half)
    return np.clip(u, 0, 2 * half - 1).astype(np.uint8).reshape(len(x), QK_K), d, sc


def _two_bit_bytes(u: np.ndarray) -> np.ndarray:
    """Codes (n, 256) < 4 -> 64 bytes: value 128 h + 32 k + l in bits 2k of byte 32 h + l."""
    u = u.reshape(len(u), 2, 4, 32).astype(np.uint8)
    return (u << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=2, dtype=np.uint8).reshape(
        len(u), 64)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """(n, 256) of 0/1 -> 32 bytes: bit j of byte l is value 32 j + l."""
    return np.packbits(bits.reshape(len(bits), 8, 32), axis=1, bitorder="little")[:, 0, :]


def _nibble_pairs(u: np.ndarray) -> np.ndarray:
    """4-bit codes (n, 256) -> 128 bytes: sub-block 2i in the low nibbles of bytes 32i.., 2i+1
    in their high nibbles."""
    u = u.reshape(len(u), 4, 2, 32).astype(np.uint8)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(len(u), 128)


def _k_scale_bytes(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 8 six-bit scales and minimums -> 12 bytes."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    b0 = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    b1 = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    b2 = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([b0, b1, b2], axis=1)


def encode(x: np.ndarray, qtype: Q) -> np.ndarray:
    """``x`` (rows, cols) float, cols a multiple of 256 -> raw ggml blocks (rows, cols / 256 *
    type_size) uint8 of ``qtype`` (Q2_K, Q3_K, Q4_K, Q5_K or Q6_K)."""
    rows, cols = x.shape
    if cols % QK_K:
        raise ValueError(f"x: {cols} columns is not a multiple of {QK_K}")
    flat = x.reshape(-1, QK_K).astype(np.float64)
    if qtype == Q.Q2_K:
        u, d, dmin, sc, mn = _asymmetric(flat, 16, 2, 4)
        out = [(sc | (mn << 4)).astype(np.uint8), _two_bit_bytes(u), _f16_bytes(d),
               _f16_bytes(dmin)]
        expect = (d[:, None] * sc)[..., None] * u.reshape(-1, 16, 16) - (dmin[:, None] * mn)[
            ..., None]
    elif qtype in (Q.Q4_K, Q.Q5_K):
        bits = 4 if qtype == Q.Q4_K else 5
        u, d, dmin, sc, mn = _asymmetric(flat, 32, bits, 6)
        out = [_f16_bytes(d), _f16_bytes(dmin), _k_scale_bytes(sc, mn)]
        if qtype == Q.Q5_K:
            out.append(_bit_planes(u >> 4))
        out.append(_nibble_pairs(u & 0x0F))
        expect = (d[:, None] * sc)[..., None] * u.reshape(-1, 8, 32) - (dmin[:, None] * mn)[
            ..., None]
    elif qtype == Q.Q3_K:
        u, d, sc = _symmetric(flat, 16, 3, 32)
        s6 = (sc + 32).astype(np.uint8)
        low = (s6[:, :8] & 0x0F) | ((s6[:, 8:] & 0x0F) << 4)
        # top 2 bits of scale 4 k + i go to bits 2k, 2k+1 of byte 8 + i
        top = ((s6 >> 4).reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(
            axis=1, dtype=np.uint8)
        out = [_bit_planes(u >> 2), _two_bit_bytes(u & 0x03), low, top, _f16_bytes(d)]
        expect = (d[:, None] * sc)[..., None] * (u.reshape(-1, 16, 16).astype(np.float64) - 4)
    elif qtype == Q.Q6_K:
        u, d, sc = _symmetric(flat, 16, 6, 128)
        lo, hi = u & 0x0F, u >> 4
        ql = lo.reshape(-1, 2, 2, 64)
        ql = (ql[:, :, 0] | (ql[:, :, 1] << 4)).reshape(-1, 128)
        qh = hi.reshape(-1, 2, 4, 32)
        qh = (qh << (2 * np.arange(4, dtype=np.uint8))[:, None]).sum(axis=2, dtype=np.uint8)
        out = [ql, qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8), _f16_bytes(d)]
        expect = (d[:, None] * sc)[..., None] * (u.reshape(-1, 16, 16).astype(np.float64) - 32)
    else:
        raise ValueError(f"qtype: {qtype.name} is not a K-quant this encoder writes")
    out = [np.ascontiguousarray(a, dtype=np.uint8).reshape(len(flat), -1) for a in out]
    blocks = np.concatenate(out, axis=1).reshape(rows, -1)
    got = dequantize(blocks, qtype)
    want = expect.reshape(rows, cols)
    if not np.allclose(got, want, rtol=1e-6, atol=1e-6 * float(np.abs(want).max() + 1e-30)):
        raise AssertionError(f"{qtype.name} packing does not read back")
    return blocks


def write_variant(src: Path, dst: Path, pick) -> None:
    """A copy of GGUF ``src`` whose matrices are re-encoded as ``pick(name, layer, n_layers)``."""
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    n_layers = int(reader.fields[f"{arch}.block_count"].contents())
    w = GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        if len(t.shape) != 2:
            w.add_tensor(t.name, values.astype(np.float32))
            continue
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else -1
        qtype = pick(t.name, layer, n_layers)
        if qtype in K_QUANTS and values.shape[1] % 256:
            qtype = FALLBACK[qtype]  # llama.cpp's choice for rows K-quants cannot hold
        data = encode(values, qtype) if qtype in K_QUANTS else quantize(values, qtype)
        w.add_tensor(t.name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# llama.cpp (llama-quant.cpp) for a tensor whose rows are not whole 256-value super-blocks
# (576 columns in the default model: all but ffn_down); it picks IQ4_NL for Q2_K / Q3_K, which
# gguf-py cannot write: Q4_0 stands in
FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def q4_k_m(name, layer, n):
    """llama.cpp's Q4_K_M recipe, simplified: Q6_K for the embedding and for attn_v / ffn_down
    of the first and last eighth of the layers and every third layer between, Q4_K else."""
    more = layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2
    if name == "token_embd.weight" or (more and ("attn_v" in name or "ffn_down" in name)):
        return Q.Q6_K
    return Q.Q4_K


def q3_k(name, layer, n):
    return Q.Q6_K if name == "token_embd.weight" else Q.Q3_K


def q2_k(name, layer, n):
    return Q.Q6_K if name == "token_embd.weight" else Q.Q2_K


def q6_k(name, layer, n):
    return Q.Q6_K
