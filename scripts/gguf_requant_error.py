"""Measure the error of ``--keep-quantized``'s GGUF -> MLX affine mappings (docs/models.md).

    .venv/bin/python scripts/gguf_requant_error.py tensors   # per-type tensor errors
    .venv/bin/python scripts/gguf_requant_error.py model     # default model, K-quant files

``tensors``: for every mapped ggml type, the relative RMS error and max abs error of
``mlx_bricks.gguf.quant.to_affine`` (scales in float16 and float32) against ``gguf``'s own
dequantized values, on (a) random blocks (every byte random: independent sub-block scales, the
worst case for the 16 -> 32 merges) of real shapes and (b) the embedded default model's matrices
(two of its ffn_down matrices, 576 x 1536) re-encoded in that type (tests/gguf_kquants.py for the
K-quants, gguf-py for the rest), with, for scale, the type's own error against those weights;
plus the type's nominal width for the lossy types.

``model``: the default model's weights written as a Q4_K_M-like, a Q3_K, a Q2_K and a Q6_K GGUF
(K-quants where a row holds whole 256-value super-blocks, which in this model is only ffn_down;
llama.cpp's fallback types elsewhere), each converted dense (float32) and with
``--keep-quantized`` (float32 scales), then the logits on a few prompts compared (max abs
difference, top-1 agreement over every prompt position) and 16 greedy tokens
(``model Q3_K,Q6_K`` runs a subset).

The default model's matrices have 576 or 1536 columns; the K-quants need whole 256-value
super-blocks, which only its 1536-column ffn_down matrices hold.
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
from tests.gguf_kquants import (K_QUANTS, encode, q2_k, q3_k, q4_k_m,  # noqa: E402
                                q6_k, write_variant)
from tests.test_gguf import random_blocks  # noqa: E402

NOMINAL = {Q.Q2_K: 2, Q.Q3_K: 3, Q.Q6_K: 6, Q.IQ4_NL: 4, Q.IQ4_XS: 4, Q.IQ3_XXS: 3, Q.IQ3_S: 3,
           Q.IQ2_XXS: 2, Q.IQ2_XS: 2, Q.IQ2_S: 2}
RANDOM_ONLY = (Q.IQ4_NL, Q.IQ4_XS, Q.IQ3_XXS, Q.IQ3_S, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S)
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers.", "Explain what a GPU does in one sentence."]


MATRICES = ("blk.3.ffn_down.weight", "blk.22.ffn_down.weight")  # 576 x 1536: whole super-blocks


def default_matrices() -> dict[str, np.ndarray]:
    reader = GGUFReader(default_gguf_path())
    return {t.name: dequantize(t.data, t.tensor_type) for t in reader.tensors
            if t.name in MATRICES}


def tensors() -> None:
    mats = default_matrices()
    shapes = [(576, 1536), (256, 2048)]
    print("| type | bits | random blocks f32: rel RMS / max | f16 | default model f32: rel RMS /"
          " max | f16 | type's own error on the model | nominal bits (model, f16) |")
    print("|---|---|---|---|---|---|---|---|")
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else None  # e.g. "Q6_K,IQ4_NL"
    for qtype, mapping in quant.MAPPINGS.items():
        if only and qtype.name not in only:
            continue
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
                if mapping.method != "exact":  # one bit less: the nominal width
                    more.add_raw(*more_bits(v, qtype, b, NOMINAL[qtype]))
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

    import mlx.nn as nn

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
        print("| file | MLX bits of the re-quantized type | quantized modules (bits: count) | "
              "max abs logit diff / max abs logit | top-1 agreement | greedy 16 tokens "
              "identical |")
        print("|---|---|---|---|---|---|")
        variants = {"default Q4_1/Q8_0": (None, [None]), "Q4_K_M-like": (q4_k_m, [6, 8]),
                    "Q3_K": (q3_k, [3, 4]), "Q2_K": (q2_k, [2, 3]), "Q6_K": (q6_k, [6, 8])}
        if len(sys.argv) > 2:  # a subset, e.g. "Q3_K,Q6_K"
            variants = {k: v for k, v in variants.items() if k in sys.argv[2].split(",")}
        lossy = {"Q4_K_M-like": Q.Q6_K, "Q3_K": Q.Q3_K, "Q2_K": Q.Q2_K, "Q6_K": Q.Q6_K}
        for label, (pick, choices) in variants.items():
            src = default_gguf_path()
            if pick is not None:
                src = tmp / f"{label}.gguf"
                write_variant(default_gguf_path(), src, pick)
            dense = convert_gguf(src, tmp / f"{label}-dense", dtype="float32", progress=False)
            a = run(*load(str(dense)))
            scale = max(float(np.abs(x[0]).max()) for x in a)
            for bits in choices:
                saved = quant.MAPPINGS.get(lossy.get(label))
                if bits is not None:
                    quant.MAPPINGS[lossy[label]] = quant.Mapping(bits, saved.method)
                try:
                    kept = convert_gguf(src, tmp / f"{label}-kept-{bits}", dtype="float32",
                                        keep_quantized=True, progress=False)
                finally:
                    if bits is not None:
                        quant.MAPPINGS[lossy[label]] = saved
                m, tok = load(str(kept))
                counts = {}
                for _, mod in m.named_modules():
                    if isinstance(mod, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                        counts[mod.bits] = counts.get(mod.bits, 0) + 1
                b = run(f32(m), tok)
                diff = max(float(np.abs(x[0] - y[0]).max()) for x, y in zip(a, b))
                top1 = np.mean(np.concatenate([x[0].argmax(-1) == y[0].argmax(-1)
                                               for x, y in zip(a, b)]))
                same = [x[1] == y[1] for x, y in zip(a, b)]
                where = [next(i for i, (p, q) in enumerate(zip(x[1], y[1])) if p != q)
                         for x, y, ok in zip(a, b, same) if not ok]
                text = f"{sum(same)} of {len(PROMPTS)} prompts"
                if where:
                    text += f" (others leave it at token {', '.join(str(i + 1) for i in where)})"
                bits_text = "-" if bits is None else f"{lossy[label].name} -> {bits}"
                print(f"| {label} | {bits_text} | {dict(sorted(counts.items()))} | {diff:.3g} / "
                      f"{scale:.3g} | {top1:.3f} | {text} |", flush=True)


if __name__ == "__main__":
    {"tensors": tensors, "model": model}[sys.argv[1]]()
