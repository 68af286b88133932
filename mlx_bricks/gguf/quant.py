"""GGUF quantized tensors -> MLX affine quantized tensors (``--keep-quantized``).

MLX's affine format (``mx.quantize(w, group_size, bits)``) stores, per group of ``group_size``
consecutive values of a row, a scale ``s`` and a bias ``z`` (in the model's float dtype) and
unsigned ``bits``-bit codes ``u`` (value ``s * u + z``), packed low bits first into a
little-endian uint32 bitstream: value ``j`` of a row occupies bits ``[j*bits, (j+1)*bits)``.
MLX supports group sizes 32, 64 and 128 and bits 2, 3, 4, 5, 6 and 8. Every GGUF tensor here
becomes group size 32; the bits follow the ggml type (:data:`MAPPINGS`):

- **Carried over** (``exact``): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K are affine in
  sub-blocks of 32 values (:mod:`mlx_bricks.gguf.blocks`), so their codes are kept and each
  sub-block's scale and bias become the group's. With float32 scales ``s * u + z`` is exactly
  the GGUF's value. With float16 scales the legacy types stay exact (their scales and biases are
  float16 numbers or power-of-two multiples of them); the K-quants' ``d * sc_j`` and
  ``dmin * m_j`` are rounded to float16 (relative error at most 2**-11 each).
- **Re-quantized** (``merge``): Q2_K, Q3_K and Q6_K have sub-blocks of 16 with their own scales;
  MLX has no group size 16, so each pair of sub-blocks becomes one group of 32, one bit wider
  than the type (Q2_K -> 3, Q3_K -> 4, Q6_K -> 8: MLX has no 7 bits), fitted to the GGUF's values
  (:func:`requantize`, seeded with each half's own grid on the finer grid, which keeps that half
  exact).
- **Re-quantized from values** (``values``): the IQ types store codebook indices (non-uniform
  levels); their values (``gguf.quants.dequantize``) are fitted with a uniform grid one bit
  wider than the type's nominal width (IQ4 -> 5, IQ3 -> 4, IQ2 -> 3 bits).

Every other type (TQ1_0, TQ2_0, MXFP4, ...) is dequantized by the caller. The error of each
mapping against ``gguf``'s own dequantized values is in docs/models.md.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from .blocks import LAYOUTS, read_sub_blocks

GROUP_SIZE = 32
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
REFINE_STEPS = 2  # least-squares refinements per starting grid (6 gain < 0.5% error)


@dataclass(frozen=True)
class Mapping:
    """How one ggml type becomes MLX affine: ``bits`` per code at group size 32, and the method:
    ``"exact"`` (codes carried over), ``"merge"`` (pairs of 16-value sub-blocks re-quantized) or
    ``"values"`` (re-quantized from the dequantized values)."""

    bits: int
    method: str


MAPPINGS = {
    Q.Q4_0: Mapping(4, "exact"), Q.Q4_1: Mapping(4, "exact"),
    Q.Q5_0: Mapping(5, "exact"), Q.Q5_1: Mapping(5, "exact"),
    Q.Q8_0: Mapping(8, "exact"),
    Q.Q4_K: Mapping(4, "exact"), Q.Q5_K: Mapping(5, "exact"),
    # one bit above nominal (no 7-bit: Q6_K -> 8): at the nominal width the merge adds 0.65-0.7x
    # the type's own error on real weights, and the Q2_K / Q6_K default-model files change their
    # greedy text (docs/models.md)
    Q.Q2_K: Mapping(3, "merge"), Q.Q3_K: Mapping(4, "merge"), Q.Q6_K: Mapping(8, "merge"),
    # one bit above nominal: the codebook levels are not uniform, and a uniform grid of the
    # nominal width adds 27-32% (IQ2), 12-13% (IQ3), 6% (IQ4) relative RMS error (docs/models.md)
    Q.IQ4_NL: Mapping(5, "values"), Q.IQ4_XS: Mapping(5, "values"),
    Q.IQ3_XXS: Mapping(4, "values"), Q.IQ3_S: Mapping(4, "values"),
    Q.IQ2_XXS: Mapping(3, "values"), Q.IQ2_XS: Mapping(3, "values"),
    Q.IQ2_S: Mapping(3, "values"),
}


@dataclass(frozen=True)
class AffineTensor:
    """One matrix in MLX's affine format, with its error against the GGUF's values.

    Attributes:
        weight: ``(rows, cols * bits / 32)`` uint32, the packed codes.
        scales: ``(rows, cols / 32)`` float32 holding values of the target dtype (casting to it
            is exact).
        biases: like ``scales``.
        bits: bits per code; the group size is :data:`GROUP_SIZE`.
        exact: ``scales * codes + biases`` (float32) equals every GGUF value.
        sq_error: sum over the matrix of (affine value - GGUF value)**2 (float64).
        sq_values: sum of GGUF value**2 (for a relative RMS error).
        max_error: largest abs(affine value - GGUF value).
    """

    weight: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    exact: bool
    sq_error: float
    sq_values: float
    max_error: float


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (round to nearest even), returned as float64; values beyond
    the dtype's range become +-inf."""
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(over="ignore"):
        if dtype == "float16":
            return x.astype(np.float16).astype(np.float64)
        f32 = x.astype(np.float32)
        if dtype == "float32":
            return f32.astype(np.float64)
    if dtype != "bfloat16":
        raise ValueError(f"dtype: expected one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    # bfloat16 is the top half of a float32: add half an ulp (ties to even), drop the low half
    u = f32.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX affine packing of ``codes`` ``(rows, cols)`` (each < 2**bits; cols a multiple of 32)
    into ``(rows, cols * bits / 32)`` uint32: value j at bits [j*bits, (j+1)*bits) of the row's
    little-endian bitstream."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits: expected one of {SUPPORTED_BITS}, got {bits}")
    rows, cols = codes.shape
    if cols % 32:
        raise ValueError(f"codes: {cols} columns is not a multiple of 32")
    assert sys.byteorder == "little"  # the byte views below; MLX runs on little-endian only
    # 8 codes fill exactly `bits` bytes: build them in a uint64 and keep its low bytes
    c = codes.reshape(rows, cols // 8, 8).astype(np.uint64)
    word = (c << (np.arange(8, dtype=np.uint64) * np.uint64(bits))).sum(axis=-1, dtype=np.uint64)
    out = word[..., None].view(np.uint8)[..., :bits]
    return np.ascontiguousarray(out).reshape(rows, -1).view(np.uint32)


def to_affine(blocks: np.ndarray, qtype: Q, dtype: str = "float16") -> AffineTensor | None:
    """The GGUF matrix ``blocks`` (raw data, ``(rows, n_blocks * block_bytes)`` uint8) in MLX's
    affine format with scales and biases in ``dtype``, as :data:`MAPPINGS` says for ``qtype``.

    Returns None when a scale or bias does not fit ``dtype`` (float16 beyond 65504); the caller
    then keeps the tensor dense.

    Raises:
        ValueError: ``qtype`` not in :data:`MAPPINGS`, a bad ``dtype``, or ``blocks`` not a
            whole number of blocks.
    """
    if qtype not in MAPPINGS:
        raise ValueError(f"qtype: {qtype.name} has no MLX affine mapping; mapped: "
                         f"{', '.join(t.name for t in MAPPINGS)}")
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    mapping = MAPPINGS[qtype]
    if mapping.method == "values":
        values = dequantize(blocks, qtype)
        if values.ndim != 2 or values.shape[1] % GROUP_SIZE:
            raise ValueError(f"blocks: expected a matrix of whole {qtype.name} blocks, got "
                             f"{blocks.shape}")
        codes, scales, biases = requantize(values, mapping.bits, dtype)
    else:
        sub = read_sub_blocks(blocks, qtype)
        values = sub.values()
        if mapping.method == "exact":
            codes, scales, biases = sub.codes, round_to(sub.scales, dtype), round_to(
                sub.biases, dtype)
        else:
            codes, scales, biases = requantize(values, mapping.bits, dtype, grids=sub)
    if not (np.isfinite(scales).all() and np.isfinite(biases).all()):
        return None
    sq_error, max_error = affine_error(codes, scales, biases, values)
    return AffineTensor(weight=pack(codes, mapping.bits), scales=scales.astype(np.float32),
                        biases=biases.astype(np.float32), bits=mapping.bits,
                        exact=sq_error == 0.0,
                        sq_error=sq_error,
                        sq_values=float(np.square(values, dtype=np.float64).sum()),
                        max_error=max_error)


def affine_error(codes, scales, biases, values, group_size: int = GROUP_SIZE
                 ) -> tuple[float, float]:
    """``(sum of squared errors, max abs error)`` of ``scales * codes + biases`` evaluated in
    float32 (as ``mx.dequantize`` with float32 scales does) against ``values``."""
    rows = codes.shape[0]
    s = np.repeat(np.asarray(scales, np.float32), group_size, axis=1)
    b = np.repeat(np.asarray(biases, np.float32), group_size, axis=1)
    err = (codes.astype(np.float32) * s + b).astype(np.float64) - values.reshape(rows, -1)
    return float(np.square(err).sum()), float(np.abs(err).max(initial=0.0))


def requantize(values: np.ndarray, bits: int, dtype: str, *, grids=None,
               chunk_values: int = 1 << 21) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fit MLX affine groups of 32 to ``values`` ``(rows, cols)``: ``(codes uint8 (rows, cols),
    scales, biases (rows, cols / 32) float64 holding ``dtype`` values)``, each group minimising
    the squared error against ``values`` over a few candidate grids.

    Candidates per group: the min/max grid (``mx.quantize``'s choice), and with ``grids`` (a
    :class:`~mlx_bricks.gguf.blocks.SubBlocks` of 16-value sub-blocks) each half's own grid,
    which reproduces that half exactly (finer by powers of two when ``bits`` exceeds the
    sub-blocks' bits); each candidate is refined by alternating nearest codes and a
    least-squares scale and bias (:data:`REFINE_STEPS` times, as llama.cpp's ``make_qkx``
    quantizers do). Scales and biases are rounded to ``dtype`` before the codes are chosen, so
    the error reported is the error stored. Rows are processed in chunks of about
    ``chunk_values`` values to bound memory.
    """
    rows, cols = values.shape
    if cols % GROUP_SIZE:
        raise ValueError(f"values: {cols} columns is not a multiple of {GROUP_SIZE}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits: expected one of {SUPPORTED_BITS}, got {bits}")
    if grids is not None and (grids.size != 16 or grids.codes.shape != values.shape):
        raise ValueError("grids: expected 16-value sub-blocks of the same matrix")
    codes = np.empty((rows, cols), np.uint8)
    n_groups = cols // GROUP_SIZE
    scales, biases = np.empty((rows, n_groups)), np.empty((rows, n_groups))
    step = max(1, chunk_values // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        v = values[r0:r1].astype(np.float32).reshape(-1, GROUP_SIZE)
        halves = None
        if grids is not None:
            halves = (grids.scales[r0:r1].reshape(-1, 2), grids.biases[r0:r1].reshape(-1, 2),
                      grids.bits)
        c, s, z = _fit_groups(v, bits, dtype, halves)
        codes[r0:r1] = c.reshape(r1 - r0, cols)
        scales[r0:r1], biases[r0:r1] = s.reshape(r1 - r0, -1), z.reshape(r1 - r0, -1)
    return codes, scales, biases


def _fit_groups(v, bits, dtype, halves):
    """Best (codes, scale, bias) per row of ``v`` ``(groups, 32)`` float32; see
    :func:`requantize`. Arithmetic on the values is float32 (the GGUF values are float32), per
    group sums float64."""
    n = (1 << bits) - 1
    lo, hi = v.min(axis=1).astype(np.float64), v.max(axis=1).astype(np.float64)
    starts = [((hi - lo) / n, lo)]
    if halves is not None:
        h_scales, h_biases, h_bits = halves
        for h in range(2):
            s_h, z_h = h_scales[:, h], h_biases[:, h]
            for m in range(bits - h_bits + 1):  # a grid 2**m times finer keeps half h exact
                s = s_h / (1 << m)
                spare = n - ((1 << h_bits) - 1) * (1 << m)  # codes left to cover the other half
                edge = np.where(s > 0, lo, hi)
                with np.errstate(divide="ignore", invalid="ignore"):
                    k = np.where(s != 0, np.ceil((z_h - edge) / s), 0)
                starts.append((s, z_h - np.clip(k, 0, spare) * s))

    sum_v = v.sum(axis=1, dtype=np.float64)
    sum_vv = np.einsum("ij,ij->i", v, v, dtype=np.float64)
    best_err = np.full(len(v), np.inf)
    best_s, best_z = np.zeros(len(v)), np.zeros(len(v))
    for s, z in starts:
        for step in range(REFINE_STEPS + 1):
            s, z = round_to(s, dtype), round_to(z, dtype)
            ok = np.isfinite(s) & np.isfinite(z)
            s, z = np.where(ok, s, 0.0), np.where(ok, z, 0.0)
            c = _codes(v, s, z, n)
            # sum((s c + z - v)**2) from per-group sums: one pass per sum, no residual array
            sc, scc, scv = (c.sum(axis=1, dtype=np.float64),
                            np.einsum("ij,ij->i", c, c, dtype=np.float64),
                            np.einsum("ij,ij->i", c, v, dtype=np.float64))
            g = v.shape[1]
            err = (s * s * scc + 2 * s * z * sc - 2 * s * scv + g * z * z - 2 * z * sum_v
                   + sum_vv)
            err = np.where(ok, err, np.inf)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_s, best_z = np.where(better, s, best_s), np.where(better, z, best_z)
            if step < REFINE_STEPS:  # least-squares scale and bias for these codes
                mc, mv = sc / g, sum_v / g
                var, cov = scc / g - mc * mc, scv / g - mc * mv
                with np.errstate(divide="ignore", invalid="ignore"):
                    s = np.where(var > 0, cov / np.where(var > 0, var, 1.0), s)
                z = mv - s * mc
    return _codes(v, best_s, best_z, n).astype(np.uint8), best_s, best_z


def _codes(v, s, z, n):
    """Nearest codes ``clip(rint((v - z) / s), 0, n)`` (0 where s is 0), float32."""
    with np.errstate(divide="ignore"):
        inv = np.where(s != 0, 1.0 / np.where(s != 0, s, 1.0), 0.0).astype(np.float32)
    c = (v - z.astype(np.float32)[:, None]) * inv[:, None]
    np.rint(c, out=c)
    return np.clip(c, 0, n, out=c)


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


__all__ = ["GROUP_SIZE", "MAPPINGS", "LAYOUTS", "AffineTensor", "Mapping", "to_affine",
           "requantize", "pack", "round_to", "affine_error", "unpermute_rows"]
