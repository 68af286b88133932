"""Measure the error of ``--keep-quantized``'s GGUF -> MLX affine mappings (docs/models.md).

    .venv/bin/python scripts/gguf_requant_error.py tensors   # per-type tensor errors
    .venv/bin/python scripts/gguf_requant_error.py model     # default model, K-quant files

``tensors``: for every mapped ggml type, the relative RMS error and max abs error of
``mlx_bricks.gguf.quant.to_affine`` (scales in float16 and float32) against ``gguf``'s own
dequantized values, on (a) random blocks (every byte random: independent sub-block scales, the
worst case for the 16 -> 32 merges) of real shapes and (b) the embedded default model's matrices
(every matrix of 5 of its 30 layers) re-encoded in that type (tests/gguf_kquants.py for the
K-quants, gguf-py for the rest), with, for scale, the type's own error against those weights;
plus one more bit for the lossy types.

``model``: the default model's weights written as Q4_K_M-like, Q3_K_M-like, Q2_K-like and Q6_K
GGUFs (K-quants where a row holds whole 256-value super-blocks, which in this model is only
ffn_down; llama.cpp's fallback types elsewhere), each converted dense (float32) and with
``--keep-quantized`` (float32 scales), then the logits on a few prompts compared (max abs
difference, top-1 agreement) and 16 greedy tokens.

The default model's matrices have 576 or 1536 columns; for the K-quant tensor errors the
576-column ones are cut to their first 512 columns (whole super-blocks of real weights).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader
from gguf.quants import dequantize, quantize

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_bricks.gguf import quant  # noqa: E402
from mlx_bricks.models import default_gguf_path  # noqa: E402
from tests.gguf_kquants import (K_QUANTS, encode, q2_k, q3_k_m, q4_k_m,  # noqa: E402
                                q6_k, write_variant)
from tests.test_gguf import random_blocks  # noqa: E402

RANDOM_ONLY = (Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain what a GPU does in one sentence."]


LAYERS = (0, 7, 15, 22, 29)  # a sample: every matrix of 5 of the 30 layers (35 matrices)


def default_matrices() -> dict[str, np.ndarray]:
    reader = GGUFReader(default_gguf_path())
    return {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors
            if len(t.shape) == 2 and t.name.startswith(tuple(f"blk.{i}." for i in LAYERS))}


def tensors() -> None:
    mats = default_matrices()
    shapes = [(1536, 576), (576, 1536), (2048, 2048)]
    print("| type | bits | random blocks f32: rel RMS / max | f16 | default model f32: rel RMS /"
          " max | f16 | type's own error on the model | one more bit (model, f16) |")
    print("|---|---|---|---|---|---|---|---|")
    for qtype, mapping in quant.MAPPINGS.items():
        row = [qtype.name, str(mapping.bits)]
        for dtype in ("float32", "float16"):
            t = Totals()
            for i, (r, c) in enumerate(shapes):
                t.add(quant.to_affine(random_blocks(qtype, r, c, std=0.02, seed=i), qtype, dtype))
            row.append(t.text())
        if qtype in RANDOM_ONLY:
            row += ["-", "-", "-", "-"]
        else:
            t32, t16, own, more = Totals(), Totals(), Totals(), Totals()
            for w in mats.values():
                if qtype in K_QUANTS:  # K-quants need rows of whole 256-value super-blocks
                    w = np.ascontiguousarray(w[:, :w.shape[1] // 256 * 256])
                b = encode(w, qtype) if qtype in K_QUANTS else quantize(w, qtype)
                v = dequantize(b, qtype)
                t32.add(quant.to_affine(b, qtype, "float32"))
                t16.add(quant.to_affine(b, qtype, "float16"))
                own.add_raw(float(np.square(v.astype(np.float64) - w).sum()),
                            float(np.square(w.astype(np.float64)).sum()), 0.0)
                if mapping.method != "exact" and mapping.bits < 8:
                    more.add_raw(*more_bits(v, qtype, b, mapping.bits + 1))
            row += [t32.text(), t16.text(), f"{own.rel():.2e}",
                    f"{more.rel():.2e}" if more.sv else "-"]
        print("| " + " | ".join(row) + " |", flush=True)


class Totals:
    def __init__(self):
        self.sq = self.sv = self.mx = 0.0

    def add(self, a):
        self.add_raw(a.sq_error, a.sq_values, a.max_error)

    def add_raw(self, sq, sv, mx_):
        self.sq, self.sv, self.mx = self.sq + sq, self.sv + sv, max(self.mx, mx_)

    def rel(self):
        return float(np.sqrt(self.sq / self.sv))

    def text(self):
        return f"{self.rel():.2e} / {self.mx:.1e}"


def more_bits(values, qtype, blocks, bits, dtype="float16"):
    """(sum sq error, sum sq values, max error) of the mapping with ``bits`` instead."""
    grids = None
    if quant.MAPPINGS[qtype].method == "merge":
        grids = quant.read_sub_blocks(blocks, qtype)
    codes, s, z = quant.requantize(values, bits, dtype, grids=grids)
    sq, mx_ = quant.affine_error(codes, s, z, values)
    return sq, float(np.square(values.astype(np.float64)).sum()), mx_


def model() -> None:
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    from mlx_bricks.gguf import convert_gguf

    def run(model, tokenizer):
        out = []
        for p in PROMPTS:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                add_generation_prompt=True)
            logits = np.array(model(mx.array([ids]))[0].astype(mx.float32))
            toks = [t for t, _ in zip((tok for tok, _ in generate_step(
                mx.array(ids), model, sampler=lambda x: mx.argmax(x, axis=-1))), range(16))]
            out.append((logits, [int(t) for t in toks]))
        return out

    def f32(model):
        model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.float16 else a,
                              model.parameters()))
        return model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print("| file | quantized modules (bits) | max abs logit diff / max abs logit | top-1"
              " agreement | greedy 16 tokens identical |")
        print("|---|---|---|---|---|")
        variants = {"default Q4_1/Q8_0": None, "Q4_K_M-like": q4_k_m, "Q3_K_M-like": q3_k_m,
                    "Q2_K-like": q2_k, "Q6_K": q6_k}
        for label, pick in variants.items():
            src = default_gguf_path()
            if pick is not None:
                src = tmp / f"{label}.gguf"
                write_variant(default_gguf_path(), src, pick)
            dense = convert_gguf(src, tmp / f"{label}-dense", dtype="float32", progress=False)
            kept = convert_gguf(src, tmp / f"{label}-kept", dtype="float32", keep_quantized=True,
                                progress=False)
            a = run(*load(str(dense)))
            m, tok = load(str(kept))
            import mlx.nn as nn
            bits = {}
            for _, mod in m.named_modules():
                if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                    bits[mod.bits] = bits.get(mod.bits, 0) + 1
            b = run(f32(m), tok)
            diff = max(float(np.abs(x[0] - y[0]).max()) for x, y in zip(a, b))
            scale = max(float(np.abs(x[0]).max()) for x in a)
            top1 = np.mean(np.concatenate([x[0].argmax(-1) == y[0].argmax(-1)
                                           for x, y in zip(a, b)]))
            same = sum(x[1] == y[1] for x, y in zip(a, b))
            print(f"| {label} | {bits} | {diff:.3g} / {scale:.3g} | {top1:.3f} | "
                  f"{same} of {len(PROMPTS)} prompts |", flush=True)


if __name__ == "__main__":
    {"tensors": tensors, "model": model}[sys.argv[1]]()
