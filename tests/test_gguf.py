"""GGUF import (mlx_bricks.gguf): tiny synthetic llama / qwen2 / qwen3 / gemma3 files written here
with ``gguf.GGUFWriter`` convert to directories whose logits equal those of the same weights built
directly in mlx-lm, for F32, F16, BF16, Q4_0...Q8_0, the K-quants (Q2_K...Q6_K) and some
IQ-quants; with --keep-quantized the carried-over types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K)
are exact against ``gguf``'s own dequantizer and the re-quantized ones (Q2_K, Q3_K, Q6_K, IQ)
stay within their documented error; the default model converted that way generates its float16
text; damaged files and Ctrl-C give one clear line.

The references are independent of the converter: the tests write the GGUF the way llama.cpp does
(its name table, its Q/K row permutation, its rope_freqs formula, gemma3's ``1 + w`` norms) and
build the expected model from the original Hugging Face-layout weights.
"""
from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

from mlx_bricks.gguf import SUPPORTED_ARCHITECTURES, convert_gguf
from mlx_bricks.gguf import blocks, quant
from mlx_bricks.gguf.__main__ import main as cli_main

REPO = Path(__file__).resolve().parents[1]

TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
            max_position_embeddings=256)
HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]
# K-quant blocks hold 256 values of a row: every matrix's input dimension a multiple of 256
# (hidden != intermediate, so a transposed matrix cannot pass the shape checks)
TINY_K = dict(TINY, hidden_size=256, intermediate_size=512)

# llama.cpp's tensor names (gguf-py's TensorNameMap), written out here as the reference
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                "lm_head": "output"}


# --- a tiny byte-level BPE vocabulary ----------------------------------------------------------

def _byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "a t", "c at"]
TOKENS = SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe", "at", "cat"]
TOKEN_TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS))
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB = len(TOKENS)


# --- weights, the llama.cpp way ----------------------------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rows of each head as interleaved pairs."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def random_weights(arch: str, tied: bool, seed: int = 0, *, cfg: dict = TINY
                   ) -> dict[str, np.ndarray]:
    """Hugging Face / mlx-lm layout weights (name -> float32 array) for the tiny config."""
    rng = np.random.default_rng(seed)
    h, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd

    def mat(rows, cols):
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, h)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)}
    if not tied:
        w["lm_head.weight"] = mat(VOCAB, h)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(
            np.float32)
        w[p + "self_attn.q_proj.weight"] = mat(nq, h)
        w[p + "self_attn.k_proj.weight"] = mat(nkv, h)
        w[p + "self_attn.v_proj.weight"] = mat(nkv, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, nq)
        w[p + "mlp.gate_proj.weight"] = mat(f, h)
        w[p + "mlp.up_proj.weight"] = mat(f, h)
        w[p + "mlp.down_proj.weight"] = mat(h, f)
        if arch == "qwen3":
            for proj in ("q", "k"):
                w[p + f"self_attn.{proj}_norm.weight"] = (
                    1 + 0.1 * rng.standard_normal(hd)).astype(np.float32)
        if arch == "qwen2":
            for proj, n in (("q", nq), ("k", nkv), ("v", nkv)):
                w[p + f"self_attn.{proj}_proj.bias"] = rng.standard_normal(n).astype(np.float32)
    return w


def gguf_name(hf_name: str) -> str:
    module, _, param = hf_name.rpartition(".")
    if module in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[module]}.{param}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}.{param}"


def write_gguf(path: Path, arch: str, weights: dict[str, np.ndarray],
               types: dict[str, Q] | None = None, *, add_bos: bool = False,
               rope_freqs: np.ndarray | None = None, extra_tensors: dict | None = None,
               raw: dict[str, tuple[np.ndarray, Q]] | None = None, cfg: dict = TINY) -> Path:
    """A GGUF of ``weights`` as llama.cpp's converter writes it. ``types`` picks a ggml type per
    Hugging Face name (default F32); Q/K rows are permuted for llama before quantizing. ``raw``
    gives ready ggml data ``(uint8 blocks, one row per matrix row, Hugging Face row order; type)``
    written instead of ``weights[name]`` (the blocks' rows are permuted the same way)."""
    types, raw = types or {}, raw or {}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    for name, value in weights.items():
        qtype = types.get(name, Q.F32)
        if name in raw:
            value, qtype = raw[name]
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            n_head = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            value = llama_cpp_permute(value, n_head)
        if name in raw:
            w.add_tensor(gguf_name(name), value, raw_dtype=qtype)
        elif qtype == Q.F32:
            w.add_tensor(gguf_name(name), value.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(gguf_name(name), value.astype(np.float16))
        else:
            w.add_tensor(gguf_name(name), quantize(value, qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def as_stored(weights: dict[str, np.ndarray], types: dict[str, Q]) -> dict[str, np.ndarray]:
    """The values the GGUF holds, in Hugging Face row order (quantization is per row, so it
    commutes with llama.cpp's row permutation)."""
    out = {}
    for name, value in weights.items():
        qtype = types.get(name, Q.F32)
        if qtype == Q.F16:
            value = value.astype(np.float16).astype(np.float32)
        elif qtype != Q.F32:
            value = dequantize(quantize(value, qtype), qtype)
        out[name] = value
    return out


# byte offsets of the float16 fields of one ggml block (the scale d; Q4_1 / Q5_1's minimum m; the
# K-quants' super-block d and dmin), from the block structs of ggml-common.h: Q2_K is scales[16],
# qs[64], d, dmin; Q3_K hmask[32], qs[64], scales[12], d; Q4_K d, dmin, scales[12], qs[128]; Q5_K
# d, dmin, scales[12], qh[32], qs[128]; Q6_K ql[128], qh[64], scales[16], d; the IQ types below
# start with d.
FP16_FIELDS = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,), Q.IQ3_S: (0,),
    Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
}


def random_blocks(qtype: Q, rows: int, cols: int, *, std: float, seed: int = 0) -> np.ndarray:
    """Raw ggml blocks of ``qtype`` for a ``(rows, cols)`` matrix: ``(rows, cols / block_size *
    type_size)`` uint8 with random quants and packed sub-block scales (every byte value is legal
    there, so every code occurs) and finite float16 fields (one normal draw each, any sign),
    scaled so that the dequantized matrix has standard deviation ``std``. For the types gguf-py
    cannot quantize; the values to expect are ``gguf.quants.dequantize`` of the result."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise ValueError(f"cols: {cols} is not a multiple of {qtype.name}'s {block_size}")
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    draws = rng.standard_normal((rows, cols // block_size, len(FP16_FIELDS[qtype])))

    def with_gain(gain: float) -> np.ndarray:
        halves = (draws * gain).astype(np.float16)
        for i, offset in enumerate(FP16_FIELDS[qtype]):
            blocks[..., offset:offset + 2] = halves[..., i:i + 1].view(np.uint8)
        return blocks.reshape(rows, -1)

    # every value is linear in the block's float16 fields: one trial run fixes the gain
    gain = std / float(dequantize(with_gain(1.0), qtype).std())
    return with_gain(gain).copy()


def reference_model(arch: str, weights: dict[str, np.ndarray], dtype=mx.float32, *,
                    cfg: dict = TINY, **extra):
    """The tiny model built directly from mlx-lm's model classes (weights in their layout)."""
    from mlx_lm.models import llama, qwen2, qwen3

    module = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3}[arch]
    config = dict(cfg, model_type=arch, vocab_size=VOCAB,
                  head_dim=cfg["hidden_size"] // cfg["num_attention_heads"],
                  tie_word_embeddings="lm_head.weight" not in weights, **extra)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.load_weights([(k, mx.array(v).astype(dtype)) for k, v in weights.items()])
    mx.eval(model.parameters())
    return model


def logits(model, ids=(3, 70, 5, 200, 263, 100, 2, 41, 41, 7)) -> np.ndarray:
    out = model(mx.array([list(ids)]))
    return np.array(out.astype(mx.float32))


def load_converted(out: Path):
    from mlx_lm import load

    return load(str(out))


# --- round trips -------------------------------------------------------------------------------

@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False), ("qwen3", True)])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_dense_round_trip_logits_equal(tmp_path, arch, tied, dtype):
    weights = random_weights(arch, tied)
    types = {n: Q.F16 for n in weights if n.endswith("up_proj.weight")}  # mixed F32/F16 file
    src = write_gguf(tmp_path / "tiny.gguf", arch, weights, types)
    out = convert_gguf(src, tmp_path / "out", dtype=dtype, progress=False)

    model, _ = load_converted(out)
    stored = as_stored(weights, types)
    expected = logits(reference_model(arch, stored, getattr(mx, dtype)))
    got = logits(model)
    assert np.array_equal(got, expected), np.abs(got - expected).max()

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] == tied
    assert config["vocab_size"] == VOCAB and config["head_dim"] == HEAD_DIM
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2
    if arch == "llama":
        # the test is sensitive to the Q/K order: the GGUF's own order gives other logits
        permuted = dict(stored)
        for i in range(TINY["num_hidden_layers"]):
            for proj, heads in (("q", "num_attention_heads"), ("k", "num_key_value_heads")):
                key = f"model.layers.{i}.self_attn.{proj}_proj.weight"
                permuted[key] = llama_cpp_permute(stored[key], TINY[heads])
        wrong = logits(reference_model(arch, permuted, getattr(mx, dtype)))
        assert np.abs(wrong - expected).max() > 1e-2


@pytest.mark.parametrize("arch,tied", [("llama", True), ("qwen2", False)])
def test_keep_quantized_round_trip(tmp_path, arch, tied):
    weights = random_weights(arch, tied, seed=1)
    kinds = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
    types = {n: kinds[i % 5] for i, n in enumerate(sorted(weights)) if n.endswith("proj.weight")}
    types["model.embed_tokens.weight"] = Q.Q8_0
    if not tied:
        types["lm_head.weight"] = Q.Q4_1
    src = write_gguf(tmp_path / "tiny.gguf", arch, weights, types)
    out = convert_gguf(src, tmp_path / "out", dtype="float32", keep_quantized=True,
                       progress=False)

    model, _ = load_converted(out)
    modules = dict(model.named_modules())
    for name, qtype in types.items():
        module = modules[name.rpartition(".")[0]]
        assert isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)), name
        assert (module.bits, module.group_size) == (quant.MAPPINGS[qtype].bits, 32), name
        # exact: the stored affine tensors dequantize to the GGUF's values bit for bit
        deq = mx.dequantize(module.weight, module.scales, module.biases, group_size=32,
                            bits=module.bits)
        assert np.array_equal(np.array(deq), as_stored(weights, types)[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32
    assert {q["bits"] for p, q in config["quantization"].items() if isinstance(q, dict)} | {
        config["quantization"]["bits"]} == {4, 5, 8}
    expected = logits(reference_model(arch, as_stored(weights, types)))
    np.testing.assert_allclose(logits(model), expected, rtol=1e-4, atol=1e-4)


def test_keep_quantized_dequantizes_unmapped_types_with_a_note(tmp_path, caplog):
    """TQ2_0 (ternary) has no MLX affine mapping: dequantized, named in a note; the Q5_0 matrix
    next to it stays quantized (5-bit)."""
    weights = random_weights("llama", True, seed=2, cfg=TINY_K)
    types = {n: Q.TQ2_0 for n in weights if n.endswith("mlp.up_proj.weight")}
    types.update({n: Q.Q5_0 for n in weights if n.endswith("mlp.down_proj.weight")})
    src = write_gguf(tmp_path / "tiny.gguf", "llama", weights, types, cfg=TINY_K)
    with caplog.at_level(logging.WARNING, logger="mlx_bricks.gguf"):
        out = convert_gguf(src, tmp_path / "out", dtype="float32", keep_quantized=True,
                           progress=False)
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and re.search(r"\b2 TQ2_0 tensor.*dequantized.*no MLX affine", notes[0])
    model, _ = load_converted(out)
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    assert model.model.layers[0].mlp.down_proj.bits == 5
    expected = logits(reference_model("llama", as_stored(weights, types), cfg=TINY_K))
    np.testing.assert_allclose(logits(model), expected, rtol=1e-4, atol=1e-4)


def _llama_cpp_rope_factors(factor, low, high, old_len, base, dim):
    """convert_hf_to_gguf.py's LlamaModel rope_freqs for llama3 rope scaling."""
    out = []
    for freq in 1.0 / base ** (np.arange(0, dim, 2) / dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_llama3_rope_scaling(tmp_path):
    weights = random_weights("llama", True, seed=3)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 8.0, "original_max_position_embeddings": 2048}
    factors = _llama_cpp_rope_factors(8.0, 1.0, 8.0, 2048, TINY["rope_theta"], HEAD_DIM)
    assert 1.0 < factors[4] < 8.0 and 1.0 < factors[5] < 8.0  # two transition frequencies
    src = write_gguf(tmp_path / "tiny.gguf", "llama", weights, rope_freqs=factors)
    model, _ = load_converted(convert_gguf(src, tmp_path / "out", dtype="float32",
                                           progress=False))
    reference = reference_model("llama", weights, rope_scaling=scaling)
    got = np.array(model.model.layers[0].self_attn.rope._freqs)
    want = np.array(reference.model.layers[0].self_attn.rope._freqs)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(logits(model), logits(reference), rtol=1e-5, atol=1e-5)


# --- BF16, Q5_1, the K-quants and IQ-quants --------------------------------------------------

# gguf-py dequantizes these but cannot quantize them: the tests write random blocks
DEQUANTIZE_ONLY = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ2_XXS, Q.IQ3_S, Q.IQ4_NL,
                   Q.IQ4_XS)


def encoded_weights(arch: str, tied: bool, qtype: Q, seed: int):
    """``(weights, raw)`` for a TINY_K model whose matrices are stored as ``qtype``: ``raw`` maps
    each matrix to its ggml data (gguf-py's quantizer where it has one, else random blocks with
    the matrix's spread) and ``weights`` holds the values that data dequantizes to."""
    weights = random_weights(arch, tied, seed, cfg=TINY_K)
    raw = {}
    for i, (name, value) in enumerate(weights.items()):
        if value.ndim != 2:
            continue  # norms and biases stay F32, as in llama.cpp's files
        if qtype in DEQUANTIZE_ONLY:
            data = random_blocks(qtype, *value.shape, std=float(value.std()), seed=seed + i)
        else:
            data = quantize(value, qtype)
        raw[name] = (data, qtype)
        deq = dequantize(data, qtype)
        assert deq.shape == value.shape and np.isfinite(deq).all(), name
        assert 0.5 < deq.std() / value.std() < 2, name  # a model with sensible activations
        weights[name] = deq
    return weights, raw


# relative RMS error bounds of the lossy mappings against the GGUF's values on random blocks
# (every byte random: independent sub-block scales, the worst case), float32 scales; measured
# values in docs/models.md, bounds about 25% above them
LOSSY_BOUND = {Q.Q2_K: 0.06, Q.Q3_K: 0.057, Q.Q6_K: 0.004, Q.IQ4_NL: 0.034, Q.IQ4_XS: 0.034,
               Q.IQ3_S: 0.055, Q.IQ2_XXS: 0.15}


def _quantized_modules(model) -> dict:
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}


def _affine_values(module) -> np.ndarray:
    """What a quantized module computes with, in float32."""
    return np.array(mx.dequantize(module.weight, module.scales.astype(mx.float32),
                                  module.biases.astype(mx.float32),
                                  group_size=module.group_size, bits=module.bits))


@pytest.mark.parametrize("qtype,arch,tied", [
    (Q.BF16, "qwen2", False), (Q.Q5_1, "llama", True), (Q.Q2_K, "llama", True),
    (Q.Q3_K, "qwen2", False), (Q.Q4_K, "llama", True), (Q.Q5_K, "qwen3", True),
    (Q.Q6_K, "llama", False), (Q.IQ2_XXS, "llama", True), (Q.IQ3_S, "qwen2", False),
    (Q.IQ4_NL, "qwen3", True), (Q.IQ4_XS, "llama", True)], ids=lambda v: getattr(v, "name", v))
def test_bf16_k_and_iq_quants(tmp_path, caplog, qtype, arch, tied):
    """Dense: every type dequantizes to exactly the GGUF's values. --keep-quantized: each type
    becomes MLX affine with its mapping's bits, exact for the carried-over types, within the
    documented error otherwise, and the model computes with those values."""
    weights, raw = encoded_weights(arch, tied, qtype, seed=7)
    src = write_gguf(tmp_path / "tiny.gguf", arch, weights, raw=raw, cfg=TINY_K)
    stored = {t.name: t.tensor_type for t in gguf.GGUFReader(src).tensors}
    assert {stored[gguf_name(n)] for n in raw} == {qtype}
    expected = logits(reference_model(arch, weights, cfg=TINY_K))

    out = convert_gguf(src, tmp_path / "dense", dtype="float32", progress=False)
    got = logits(load_converted(out)[0])
    assert np.array_equal(got, expected), np.abs(got - expected).max()

    with caplog.at_level(logging.WARNING, logger="mlx_bricks.gguf"):
        out = convert_gguf(src, tmp_path / "keep", dtype="float32", keep_quantized=True,
                           progress=False)
    notes = [r.getMessage() for r in caplog.records if r.name == "mlx_bricks.gguf"]
    model, _ = load_converted(out)
    modules = _quantized_modules(model)
    if qtype == Q.BF16:  # a float type: nothing to keep, nothing lost
        assert notes == [] and modules == {}
        assert "quantization" not in json.loads((out / "config.json").read_text())
        assert np.array_equal(logits(model), expected)
        return
    mapping = quant.MAPPINGS[qtype]
    assert set(modules) == {n.rpartition(".")[0] for n in raw}
    affine = {}
    for name in raw:
        module = modules[name.rpartition(".")[0]]
        assert (module.bits, module.group_size) == (mapping.bits, 32), name
        affine[name] = _affine_values(module)
        if mapping.method == "exact":
            assert np.array_equal(affine[name], weights[name]), name
    if mapping.method == "exact":
        assert notes == []
    else:
        sq = sum(np.square(affine[n].astype(np.float64) - weights[n]).sum() for n in raw)
        rel = np.sqrt(sq / sum(np.square(weights[n].astype(np.float64)).sum() for n in raw))
        assert 0 < rel < LOSSY_BOUND[qtype], rel
        (note,) = notes
        assert re.search(rf"\b{len(raw)} {qtype.name} tensor\(s\) re-quantized to MLX "
                         rf"{mapping.bits}-bit.*relative RMS error (\S+)", note), note
        assert float(re.search(r"relative RMS error (\S+)", note)[1]) == pytest.approx(rel,
                                                                                       rel=0.01)
    reference = logits(reference_model(arch, dict(weights, **affine), cfg=TINY_K))
    np.testing.assert_allclose(logits(model), reference, rtol=1e-4, atol=1e-4)


def test_keep_quantized_k_quant_mix(tmp_path, caplog, capsys):
    """A Q4_K_M-like file (Q4_K, Q6_K for attn_v / ffn_down / embeddings) with one Q8_0 matrix,
    through the command line: all kept quantized (4- and 8-bit, per-module bits in
    config.json); the Q6_K ones re-quantized to 8-bit with a note, the Q4_K ones exact in
    float32."""
    weights = random_weights("llama", True, seed=8, cfg=TINY_K)
    raw = {}
    for i, name in enumerate(n for n in weights if weights[n].ndim == 2):
        if name == "model.layers.1.self_attn.o_proj.weight":
            raw[name] = (quantize(weights[name], Q.Q8_0), Q.Q8_0)
        else:
            qtype = Q.Q6_K if any(k in name for k in ("v_proj", "down_proj", "embed")) else Q.Q4_K
            raw[name] = (random_blocks(qtype, *weights[name].shape,
                                       std=float(weights[name].std()), seed=i), qtype)
        weights[name] = dequantize(*raw[name])
    src = write_gguf(tmp_path / "tiny.gguf", "llama", weights, raw=raw, cfg=TINY_K)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="mlx_bricks.gguf"):
        rc, err = _cli(capsys, src, out, "--dtype", "float32", "--keep-quantized")
    assert rc == 0, err
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 1 and re.search(r"\b5 Q6_K\b.*re-quantized to MLX 8-bit", notes[0])
    model, _ = load_converted(out)
    layers = model.model.layers
    assert layers[1].self_attn.o_proj.bits == 8 and layers[0].self_attn.o_proj.bits == 4
    assert layers[1].mlp.down_proj.bits == 8 and layers[1].mlp.up_proj.bits == 4
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8
    config = json.loads((out / "config.json").read_text())["quantization"]
    assert (config["bits"], config["group_size"], config["mode"]) == (4, 32, "affine")
    assert config["model.layers.1.self_attn.o_proj"] == {"group_size": 32, "bits": 8}
    assert config["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    assert "model.layers.0.mlp.up_proj" not in config  # the default, 4
    assert np.array_equal(_affine_values(layers[0].mlp.up_proj),
                          weights["model.layers.0.mlp.up_proj.weight"])  # Q4_K: exact
    affine = {n: _affine_values(dict(model.named_modules())[n.rpartition(".")[0]])
              for n in raw}
    reference = logits(reference_model("llama", dict(weights, **affine), cfg=TINY_K))
    np.testing.assert_allclose(logits(model), reference, rtol=1e-4, atol=1e-4)


def test_type_gguf_cannot_dequantize_is_one_clear_error(tmp_path, capsys):
    weights = random_weights("llama", True, seed=9, cfg=TINY_K)
    name = "model.layers.1.mlp.up_proj.weight"
    rows, cols = weights[name].shape
    block_size, type_size = GGML_QUANT_SIZES[Q.Q8_K]  # ggml's dot-product helper type
    raw = {name: (np.zeros((rows, cols // block_size * type_size), np.uint8), Q.Q8_K)}
    src = write_gguf(tmp_path / "odd.gguf", "llama", weights, raw=raw, cfg=TINY_K)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*Q8_K.*cannot be dequantized"):
        convert_gguf(src, tmp_path / "out", progress=False)
    rc, err = _cli(capsys, src, tmp_path / "out")
    assert rc == 2 and "Q8_K" in _one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]


# --- GGUF blocks -> MLX affine: exactness and the re-quantizer ---------------------------------

def _unpack_mlx(weight: np.ndarray, bits: int) -> np.ndarray:
    """MLX affine packing, read independently: value i of a row sits at bits [bits*i,
    bits*(i+1)) of the row's little-endian bitstream."""
    stream = np.unpackbits(weight.view(np.uint8), axis=1, bitorder="little")
    fields = stream.reshape(weight.shape[0], -1, bits).astype(np.int64)
    return (fields << np.arange(bits)).sum(axis=-1)


@pytest.mark.parametrize("qtype", list(blocks.LAYOUTS), ids=lambda t: t.name)
def test_sub_block_reader_is_bit_exact(qtype):
    """Every legacy and K-quant type read as affine sub-blocks gives gguf's own dequantized
    values bit for bit (random bytes: every code, scale and sign pattern occurs)."""
    b = random_blocks(qtype, rows=5, cols=2 * 256, std=1.0, seed=11)
    sub = blocks.read_sub_blocks(b, qtype)
    assert sub.codes.max() == (1 << sub.bits) - 1 and sub.codes.min() == 0
    assert np.array_equal(sub.values(), dequantize(b, qtype))


EXACT_TYPES = [t for t, m in quant.MAPPINGS.items() if m.method == "exact"]


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda t: t.name)
def test_carried_over_types_are_exact(qtype):
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K: with float32 scales, MLX's own dequantize of the
    result equals gguf's dequantizer bit for bit; with float16 scales the legacy types still do,
    the K-quants within the float16 rounding of their scale products."""
    blocks_ = random_blocks(qtype, rows=6, cols=2 * 256, std=1.0)
    reference = dequantize(blocks_, qtype)  # gguf's own dequantizer, float32
    bits = quant.MAPPINGS[qtype].bits
    for dtype in ("float32", "float16"):
        a = quant.to_affine(blocks_, qtype, dtype)
        assert a.bits == bits and a.weight.dtype == np.uint32
        codes = _unpack_mlx(a.weight, bits)
        assert codes.max() == (1 << bits) - 1  # every code width is used
        deq = np.array(mx.dequantize(mx.array(a.weight), mx.array(a.scales),
                                     mx.array(a.biases), group_size=32, bits=bits))
        legacy = qtype not in (Q.Q4_K, Q.Q5_K)
        if dtype == "float32" or legacy:
            assert a.exact and np.array_equal(deq, reference), dtype
            # the independent unpacking agrees too (float32, one rounding, as ggml evaluates)
            s, z = (np.repeat(x.astype(np.float32), 32, axis=1) for x in (a.scales, a.biases))
            assert np.array_equal(codes.astype(np.float32) * s + z, reference)
        else:  # each scale and bias rounded to float16: half an ulp each
            s32 = quant.to_affine(blocks_, qtype, "float32")
            ds = np.repeat(np.abs(s32.scales.astype(np.float64)), 32, axis=1) * 2.0 ** -11
            dz = np.repeat(np.abs(s32.biases.astype(np.float64)), 32, axis=1) * 2.0 ** -11
            bound = codes * ds + dz + np.abs(reference) * 2.0 ** -23
            assert not a.exact and np.all(np.abs(deq - reference) <= bound)
            assert np.sqrt(a.sq_error / a.sq_values) < 2.0 ** -11


def test_affine_re_encoding_reports_float16_overflow():
    blocks_ = random_blocks(Q.Q8_0, rows=2, cols=2 * 32, std=1.0)
    blocks_[0, 0:2] = np.array([1000.0], dtype=np.float16).view(np.uint8)  # -128 d overflows
    assert quant.to_affine(blocks_, Q.Q8_0, "float16") is None
    assert quant.to_affine(blocks_, Q.Q8_0, "float32").exact
    with pytest.raises(ValueError, match="TQ2_0"):
        quant.to_affine(blocks_, Q.TQ2_0)


@pytest.mark.parametrize("bits", quant.SUPPORTED_BITS)
def test_pack_is_mlx_packing(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(3, 96), dtype=np.uint8)
    packed = quant.pack(codes, bits)
    assert packed.shape == (3, 96 * bits // 32) and np.array_equal(_unpack_mlx(packed, bits),
                                                                   codes)
    ones = mx.ones((3, 3))
    deq = mx.dequantize(mx.array(packed), ones, 0 * ones, group_size=32, bits=bits)
    assert np.array_equal(np.array(deq), codes.astype(np.float32))


def test_round_to_matches_mlx_casts():
    x = np.random.default_rng(0).standard_normal(4096) * np.logspace(-30, 30, 4096)
    for dtype in ("float16", "bfloat16", "float32"):
        want = np.array(mx.array(x.astype(np.float32)).astype(getattr(mx, dtype)).astype(
            mx.float32)).astype(np.float64)
        got = quant.round_to(x.astype(np.float32), dtype)
        assert np.array_equal(got, want), dtype


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q6_K, Q.IQ4_NL, Q.IQ2_XXS],
                         ids=lambda t: t.name)
def test_requantizer_beats_mlx_quantize(qtype):
    """The lossy mappings fit the GGUF's values better than mx.quantize does (same bits, group
    32, float16 scales), and a merged pair of sub-blocks with equal scales stays exact."""
    b = random_blocks(qtype, rows=64, cols=512, std=0.02, seed=5)
    if qtype == Q.Q6_K:  # make every pair of 16-value sub-blocks of row 0 share its scale
        sc = b[0].reshape(-1, 210)[:, 192:208]
        sc[:, 1::2] = sc[:, 0::2]
    values = dequantize(b, qtype)
    a = quant.to_affine(b, qtype, "float16")
    a32 = quant.to_affine(b, qtype, "float32")  # float16 would round the equal scales
    bits = quant.MAPPINGS[qtype].bits
    w, s, z = mx.quantize(mx.array(values).astype(mx.float16), group_size=32, bits=bits)
    theirs = np.array(mx.dequantize(w, s, z, group_size=32, bits=bits).astype(mx.float32))
    their_sq = np.square(theirs.astype(np.float64) - values).sum()
    assert a.sq_error < 0.8 * their_sq, (a.sq_error, their_sq)
    if qtype == Q.Q6_K:
        mine = np.array(mx.dequantize(mx.array(a32.weight), mx.array(a32.scales),
                                      mx.array(a32.biases), group_size=32, bits=bits))
        assert np.array_equal(mine[0], values[0])
        assert not np.array_equal(mine[1], values[1])


def test_default_model_tensors_map_within_documented_error():
    """Real weights (the embedded default model's ffn_down, 1536 columns: whole K-quant
    super-blocks) encoded as Q2_K / Q3_K / Q6_K: the merged mappings' error against the GGUF
    values, with float16 scales, stays within the documented figures (docs/models.md: 0.101,
    0.050, 0.0033 on this matrix at 3, 4, 8 bits; bounds 25% above)."""
    from mlx_bricks.models import default_gguf_path
    from tests.gguf_kquants import encode

    try:
        path = default_gguf_path()
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.3.ffn_down.weight")
    w = dequantize(t.data, t.tensor_type)[:256]
    for qtype, bound in ((Q.Q2_K, 0.13), (Q.Q3_K, 0.063), (Q.Q6_K, 0.0042)):
        a = quant.to_affine(encode(w, qtype), qtype, "float16")
        rel = np.sqrt(a.sq_error / a.sq_values)
        assert 0 < rel < bound, (qtype.name, rel)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(48 * 3).reshape(48, 3)
    assert np.array_equal(quant.unpermute_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


# --- gemma3 ------------------------------------------------------------------------------------

# a sentencepiece-style vocabulary as llama.cpp writes Gemma's: pad, eos, bos, unk first, control
# tokens, byte fallback tokens, then pieces (merges are rebuilt from the order of the pieces)
GEMMA_PIECES = ["▁", "t", "h", "e", "c", "a", "s", "th", "he", "the", "▁the", "at", "▁c", "▁cat"]
GEMMA_TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
                + [f"<0x{i:02X}>" for i in range(256)] + GEMMA_PIECES)
GEMMA_TOKEN_TYPES = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(GEMMA_PIECES)
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
                  "{{ m['content'] }}<end_of_turn>\n{% endfor %}")
# hidden 256: every matrix's input dimension holds whole K-quant super-blocks; head_dim 256 as
# in every Gemma 3; 1 KV head; a window of 4 so that a 10-token prompt slides
GEMMA_TINY = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=4,
                  max_position_embeddings=512)


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to bfloat16 (the dtype of Gemma checkpoints), kept as float32."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)


def gemma3_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Hugging Face layout weights of the tiny gemma3 (tied embeddings), bfloat16 values."""
    c = GEMMA_TINY
    rng = np.random.default_rng(seed)
    h, f, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nq, nkv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd

    def mat(rows, cols):
        return _bf16(rng.standard_normal((rows, cols)) / np.sqrt(cols))

    def norm(n):  # Gemma norms multiply by 1 + w; w is often far from 0. |w| >= 2**-15, as
        # w + 1 then holds a bfloat16 w exactly in float32 (llama.cpp's file keeps w + 1)
        w = _bf16(0.5 * rng.standard_normal(n))
        return np.where(np.abs(w) < 2.0 ** -15, np.float32(0), w)

    w = {"model.embed_tokens.weight": _bf16(0.05 * rng.standard_normal((len(GEMMA_TOKENS), h))),
         "model.norm.weight": norm(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            w[p + n + ".weight"] = norm(h)
        w[p + "self_attn.q_norm.weight"], w[p + "self_attn.k_norm.weight"] = norm(hd), norm(hd)
        w[p + "self_attn.q_proj.weight"] = mat(nq, h)
        w[p + "self_attn.k_proj.weight"] = mat(nkv, h)
        w[p + "self_attn.v_proj.weight"] = mat(nkv, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, nq)
        w[p + "mlp.gate_proj.weight"] = mat(f, h)
        w[p + "mlp.up_proj.weight"] = mat(f, h)
        w[p + "mlp.down_proj.weight"] = mat(h, f)
    return w


def write_gemma3_gguf(path: Path, weights: dict[str, np.ndarray], *, pattern: int | None = 2,
                      raw: dict | None = None) -> Path:
    """A gemma3 GGUF as llama.cpp's Gemma3Model converter writes it: gguf-py's own tensor name
    map, every ``*norm.weight`` stored as ``1 + w`` (float32), key/value length 256, the
    sliding window; ``pattern`` adds a sliding_window_pattern key (llama.cpp hard-codes 6, which
    a 4-layer model cannot use). ``raw``: ready ggml data per Hugging Face name."""
    c, raw = GEMMA_TINY, raw or {}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, c["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_sliding_window(c["sliding_window"])
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(GEMMA_TOKENS)
    w.add_token_scores([0.0] * len(GEMMA_TOKENS))
    w.add_token_types(GEMMA_TOKEN_TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.add_eot_token_id(5)
    w.add_chat_template(GEMMA_TEMPLATE)
    for name, value in weights.items():
        target = names.get_name(name, try_suffixes=(".weight",))
        if name in raw:
            w.add_tensor(target, raw[name][0], raw_dtype=raw[name][1])
        elif name.endswith("norm.weight"):
            w.add_tensor(target, value.astype(np.float32) + np.float32(1))
        else:
            w.add_tensor(target, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gemma3_reference(weights: dict[str, np.ndarray], **overrides):
    """mlx-lm's gemma3_text Model built directly from ``weights`` and the config written out
    here (what the file's metadata means), float32."""
    from mlx_lm.models import gemma3_text

    config = dict(GEMMA_TINY, model_type="gemma3_text", vocab_size=len(GEMMA_TOKENS),
                  sliding_window_pattern=2, query_pre_attn_scalar=256, **overrides)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    arrays = model.sanitize({k: mx.array(v) for k, v in weights.items()})  # tied: no lm_head
    model.load_weights(list(arrays.items()))
    mx.eval(model.parameters())
    return model


GEMMA_PROMPT = (2, 270, 271, 268, 6, 273, 275, 70, 263, 275)  # longer than the window (4)


def _greedy(model, ids, n=8) -> list[int]:
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(list(ids)), model, max_tokens=n,
                          sampler=lambda x: mx.argmax(x, axis=-1))
    return [int(t) for t, _ in steps]


def test_gemma3_round_trip_logits_and_greedy_tokens(tmp_path):
    weights = gemma3_weights()
    src = write_gemma3_gguf(tmp_path / "gemma3.gguf", weights)
    out = convert_gguf(src, tmp_path / "out", dtype="float32", progress=False)
    model, tokenizer = load_converted(out)

    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("gemma3_text",
                                                               ["Gemma3ForCausalLM"])
    assert (config["head_dim"], config["num_key_value_heads"]) == (256, 1)
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (4, 2)
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1e6, 1e4)
    assert config["query_pre_attn_scalar"] == 256 and config["eos_token_id"] == [1, 5]
    assert [layer.self_attn.is_sliding for layer in model.layers] == [True, False, True, False]

    reference = gemma3_reference(weights)
    expected = logits(reference, GEMMA_PROMPT)
    got = logits(model, GEMMA_PROMPT)
    assert np.array_equal(got, expected), np.abs(got - expected).max()
    assert _greedy(model, GEMMA_PROMPT) == _greedy(reference, GEMMA_PROMPT)
    # the test sees the norm shift, the window and the layer pattern
    shifted = {k: v + 1 if k.endswith("norm.weight") else v for k, v in weights.items()}
    for wrong in (logits(gemma3_reference(shifted), GEMMA_PROMPT),
                  logits(gemma3_reference(weights, sliding_window=512), GEMMA_PROMPT),
                  logits(gemma3_reference(weights, rope_local_base_freq=1e6), GEMMA_PROMPT)):
        assert np.abs(wrong - expected).max() > 1e-3

    # the tokenizer: Gemma's sentencepiece pieces, BOS added, no prefix space, byte fallback
    ix = {t: i for i, t in enumerate(GEMMA_TOKENS)}
    assert tokenizer.encode("the cat") == [2, ix["the"], ix["▁cat"]]
    assert tokenizer.encode("é")[1:] == [ix["<0xC3>"], ix["<0xA9>"]]
    text = "<start_of_turn>user\nthe cat<end_of_turn>"
    ids = tokenizer.encode(text)
    assert ids[1] == ix["<start_of_turn>"] and ids[-1] == ix["<end_of_turn>"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<bos>" + text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert prompt == "<bos><start_of_turn>user\nhi<end_of_turn>\n"


def test_gemma3_k_quants_keep_quantized(tmp_path, caplog):
    """Q4_K matrices and a Q6_K tied embedding: dense, exactly the GGUF values; kept, MLX 4-bit
    (exact in float32) and an 8-bit QuantizedEmbedding that is also the output layer."""
    weights = gemma3_weights(seed=1)
    raw = {}
    for i, name in enumerate(n for n in weights if weights[n].ndim == 2):
        qtype = Q.Q6_K if "embed" in name else Q.Q4_K
        raw[name] = (random_blocks(qtype, *weights[name].shape, std=float(weights[name].std()),
                                   seed=i), qtype)
        weights[name] = dequantize(*raw[name])
    src = write_gemma3_gguf(tmp_path / "gemma3.gguf", weights, raw=raw)
    expected = logits(gemma3_reference(weights), GEMMA_PROMPT)
    dense, _ = load_converted(convert_gguf(src, tmp_path / "dense", dtype="float32",
                                           progress=False))
    assert np.array_equal(logits(dense, GEMMA_PROMPT), expected)

    with caplog.at_level(logging.WARNING, logger="mlx_bricks.gguf"):
        out = convert_gguf(src, tmp_path / "keep", dtype="float32", keep_quantized=True,
                           progress=False)
    assert [re.search(r"1 Q6_K tensor\(s\) re-quantized to MLX 8-bit", r.getMessage())
            is not None for r in caplog.records] == [True]
    model, _ = load_converted(out)
    modules = _quantized_modules(model)
    assert len(modules) == 1 + 7 * GEMMA_TINY["num_hidden_layers"]
    emb = model.model.embed_tokens
    assert isinstance(emb, nn.QuantizedEmbedding) and emb.bits == 8
    assert model.layers[0].mlp.gate_proj.bits == 4
    assert np.array_equal(_affine_values(model.layers[0].mlp.gate_proj),
                          weights["model.layers.0.mlp.gate_proj.weight"])
    affine = {n: _affine_values(dict(model.named_modules())[n.rpartition(".")[0]]) for n in raw}
    reference = gemma3_reference(dict(weights, **affine))
    np.testing.assert_allclose(logits(model, GEMMA_PROMPT), logits(reference, GEMMA_PROMPT),
                               rtol=1e-4, atol=1e-4)
    assert _greedy(model, GEMMA_PROMPT) == _greedy(reference, GEMMA_PROMPT)


class _Shape:
    def __init__(self, *shape):
        self.shape = shape


def _gemma3_meta(layers=26, **extra) -> dict:
    meta = {"gemma3.block_count": layers, "gemma3.embedding_length": 1152,
            "gemma3.feed_forward_length": 6912, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
            "gemma3.attention.value_length": 256, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "gemma3.rope.freq_base": 1e6, "gemma3.context_length": 32768,
            "gemma3.attention.sliding_window": 512}
    meta.update(extra)
    return {k: v for k, v in meta.items() if v is not None}


_GEMMA3_TENSORS = {"token_embd.weight": _Shape(1152, 262144), "blk.0.attn_q.weight":
                   _Shape(1152, 1024)}


def test_gemma3_config_follows_llama_cpp():
    """gemma-3-1b's metadata gives mlx-lm's config for it; llama.cpp's rules for what the file
    does not store (pattern 6, local base 10000, the 27B attention scale); soft-capping and a
    pattern mlx-lm cannot build are refused."""
    from mlx_bricks.gguf.convert import build_config

    c = build_config(_gemma3_meta(), "gemma3", _GEMMA3_TENSORS)
    assert (c["sliding_window"], c["sliding_window_pattern"], c["head_dim"]) == (512, 6, 256)
    assert (c["rope_local_base_freq"], c["query_pre_attn_scalar"]) == (10000.0, 256)
    c = build_config(_gemma3_meta(layers=62, **{"gemma3.embedding_length": 5376,
                                                "gemma3.attention.head_count": 32,
                                                "gemma3.attention.key_length": 128,
                                                "gemma3.attention.value_length": 128,
                                                "gemma3.rope.freq_base_swa": 5e4}),
                     "gemma3", {"token_embd.weight": _Shape(5376, 262144),
                                "blk.0.attn_q.weight": _Shape(5376, 4096)})
    assert (c["query_pre_attn_scalar"], c["rope_local_base_freq"]) == (168, 5e4)
    c = build_config(_gemma3_meta(**{"gemma3.attention.sliding_window": None}), "gemma3",
                     _GEMMA3_TENSORS)
    assert c["sliding_window_pattern"] == 1  # no window: every layer global
    flags = [(i + 1) % 3 != 0 for i in range(26)]
    c = build_config(_gemma3_meta(**{"gemma3.attention.sliding_window_pattern": flags}),
                     "gemma3", _GEMMA3_TENSORS)
    assert c["sliding_window_pattern"] == 3
    c = build_config(_gemma3_meta(**{"gemma3.rope.scaling.type": "linear",
                                     "gemma3.rope.scaling.factor": 8.0}), "gemma3",
                     _GEMMA3_TENSORS)
    assert c["rope_scaling"] == {"type": "linear", "factor": 8.0}
    for bad, match in (({"gemma3.final_logit_softcapping": 30.0}, "soft-capping"),
                       ({"gemma3.attention.sliding_window_pattern": [False, True] * 13},
                        "not periodic"),
                       ({"gemma3.attention.value_length": 128}, "value_length")):
        with pytest.raises(ValueError, match=match):
            build_config(_gemma3_meta(**bad), "gemma3", _GEMMA3_TENSORS)
    with pytest.raises(ValueError, match="at least one global layer"):
        build_config(_gemma3_meta(layers=4), "gemma3", _GEMMA3_TENSORS)


# --- tokenizer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_from_metadata(tmp_path, add_bos):
    weights = random_weights("qwen2", False)
    src = write_gguf(tmp_path / "tiny.gguf", "qwen2", weights, add_bos=add_bos)
    out = convert_gguf(src, tmp_path / "out", progress=False)
    _, tokenizer = load_converted(out)

    vocab = {t: i for i, t in enumerate(TOKENS)}
    bos = [1] if add_bos else []
    # byte-level BPE with the merges' ranks: "the" -> t|he, " the" -> Ġthe, " cat" -> Ġ|cat
    expected = ["t", "he", "Ġ", "cat", "Ġ", "s", "at", "Ġthe"]
    assert tokenizer.encode("the cat sat the") == bos + [vocab[t] for t in expected]
    # control tokens stay whole; any UTF-8 text survives the round trip
    text = "<|im_start|>user\n12 éà 🙂<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids[len(bos)] == vocab["<|im_start|>"] and ids[-1] == vocab["<|im_end|>"]
    assert tokenizer.decode(ids[len(bos):]) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                           add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer.eos_token_ids == {2}


# --- bad inputs --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return write_gguf(path, "llama", random_weights("llama", True))


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = cli_main([str(a) for a in argv] + ["--no-progress"])
    err = capsys.readouterr().err
    return rc, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("python -m mlx_bricks.gguf: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_missing_file(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match="no such file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")
    rc, err = _cli(capsys, tmp_path / "absent.gguf", tmp_path / "out")
    assert rc == 2 and "absent.gguf" in _one_error_line(err)


def test_not_a_gguf_file(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ValueError, match="not a GGUF file"):
        convert_gguf(bad, tmp_path / "out")
    rc, err = _cli(capsys, bad, tmp_path / "out")
    assert rc == 2 and "not a GGUF file" in _one_error_line(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("keep,what", [
    (10, r"truncated GGUF file \(10 bytes\): the header needs bytes 8\.\.16"),
    (200, r"truncated GGUF file \(200 bytes\): metadata entry 5 of 22 needs bytes "
          r"\d+\.\.\d+"),
    (0.5, r"truncated GGUF file \(\d+ bytes\): the data of tensor '[\w.]+' ends at byte \d+"),
    (0.999, r"truncated GGUF file \(\d+ bytes\): the data of tensor 'blk\.1\.[\w.]+' ends")])
def test_truncated_file(tmp_path, tiny_gguf, capsys, keep, what):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ValueError, match=rf"^{re.escape(str(cut))}: {what}"):
        convert_gguf(cut, tmp_path / "out")
    rc, err = _cli(capsys, cut, tmp_path / "out")
    assert rc == 2 and re.search(what, _one_error_line(err))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def _field_offsets(path: Path) -> tuple[int, int]:
    """Byte offsets of the value type of the first metadata entry and of the ggml type of the
    first tensor table entry, as gguf-py's reader lays them out (parts: key length, key, type,
    value...; name length, name, n_dims, dims, type, offset)."""
    reader = gguf.GGUFReader(path)
    kv = next(f for name, f in reader.fields.items() if not name.startswith("GGUF."))
    kv_type = kv.offset + sum(p.nbytes for p in kv.parts[:2])
    t = reader.tensors[0].field
    tensor_type = t.offset + sum(p.nbytes for p in t.parts[:4])
    return kv_type, tensor_type


@pytest.mark.parametrize("damage,what", [
    ("version", r"unsupported GGUF version 99 \(supported: 2, 3\)"),
    ("counts", r"corrupt GGUF header: it announces 1099511627776 metadata entries and 20 "
               r"tensors"),
    ("value type", r"corrupt GGUF metadata: metadata key '[\w.]+' has unknown value type 77"),
    ("ggml type", r"corrupt GGUF tensor table: tensor '[\w.]+' has unknown ggml type 77"),
    ("empty", r"empty file, not a GGUF file")])
def test_corrupt_file_is_one_clear_line(tmp_path, tiny_gguf, capsys, damage, what):
    """What is wrong, in words, with the file's name: never numpy's text from the reader."""
    data = bytearray(tiny_gguf.read_bytes())
    kv_type, tensor_type = _field_offsets(tiny_gguf)
    if damage == "version":
        data[4:8] = (99).to_bytes(4, "little")
    elif damage == "counts":
        data[16:24] = (1 << 40).to_bytes(8, "little")
    elif damage == "value type":
        data[kv_type:kv_type + 4] = (77).to_bytes(4, "little")
    elif damage == "ggml type":
        data[tensor_type:tensor_type + 4] = (77).to_bytes(4, "little")
    else:
        data = b""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"^{re.escape(str(bad))}: {what}$"):
        convert_gguf(bad, tmp_path / "out")
    rc, err = _cli(capsys, bad, tmp_path / "out")
    assert rc == 2 and re.search(what, _one_error_line(err))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_ctrl_c_exits_130_and_leaves_nothing(tmp_path):
    """SIGINT while python -m mlx_bricks.gguf writes the default model (about 10 s): exit 130,
    one line, no traceback, no temporary directory left."""
    import signal
    import time

    from mlx_bricks.models import default_gguf_path

    try:
        src = default_gguf_path()
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_bricks.gguf", str(src), str(out), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        # as in a terminal: a runner that ignores SIGINT for its children must not make this
        # test vacuous
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while not any(p.name.startswith(".out.tmp-") for p in tmp_path.iterdir()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)  # the conversion is writing into its temporary dir
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.rstrip().splitlines()[-1] == "python -m mlx_bricks.gguf: interrupted"
    assert list(tmp_path.iterdir()) == []


def test_unsupported_architecture(tmp_path, capsys):
    path = tmp_path / "phi.gguf"
    w = gguf.GGUFWriter(str(path), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'phi3'") as info:
        convert_gguf(path, tmp_path / "out")
    assert all(arch in str(info.value) for arch in SUPPORTED_ARCHITECTURES)
    rc, err = _cli(capsys, path, tmp_path / "out")
    assert rc == 2 and "phi3" in _one_error_line(err)


def test_out_dir_not_empty_needs_force(tmp_path, tiny_gguf, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        convert_gguf(tiny_gguf, out)
    rc, err = _cli(capsys, tiny_gguf, out)
    assert rc == 2 and "--force" in _one_error_line(err)
    assert (out / "old.txt").read_text() == "keep me"

    assert _cli(capsys, tiny_gguf, out, "--force")[0] == 0
    assert not (out / "old.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or backup left


def test_empty_out_dir_is_fine(tmp_path, tiny_gguf):
    (tmp_path / "out").mkdir()
    assert (convert_gguf(tiny_gguf, tmp_path / "out", progress=False) / "config.json").is_file()


def test_refuses_to_replace_the_folder_holding_the_input(tmp_path, tiny_gguf):
    local = tmp_path / "model.gguf"
    local.write_bytes(tiny_gguf.read_bytes())
    with pytest.raises(ValueError, match="contains the input"):
        convert_gguf(local, tmp_path, force=True)
    assert local.is_file()


def test_bad_dtype(tmp_path, tiny_gguf):
    with pytest.raises(ValueError, match="dtype"):
        convert_gguf(tiny_gguf, tmp_path / "out", dtype="int8")


def test_unknown_tensor_fails_and_leaves_nothing(tmp_path):
    weights = random_weights("llama", True)
    src = write_gguf(tmp_path / "odd.gguf", "llama", weights,
                     extra_tensors={"blk.0.attn_sinks.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="attn_sinks"):
        convert_gguf(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]


def test_missing_bias_is_zero(tmp_path):
    weights = random_weights("qwen2", False, seed=5)
    key = "model.layers.0.self_attn.v_proj.bias"
    written = {k: v for k, v in weights.items() if k != key}
    src = write_gguf(tmp_path / "tiny.gguf", "qwen2", written)
    model, _ = load_converted(convert_gguf(src, tmp_path / "out", dtype="float32",
                                           progress=False))
    expected = logits(reference_model("qwen2", dict(weights, **{key: 0 * weights[key]})))
    assert np.array_equal(logits(model), expected)
    assert not np.array_equal(logits(reference_model("qwen2", weights)), expected)


def test_missing_tensor(tmp_path):
    weights = random_weights("llama", True)
    del weights["model.layers.1.mlp.down_proj.weight"]
    src = write_gguf(tmp_path / "odd.gguf", "llama", weights)
    with pytest.raises(ValueError, match=r"no tensor for model\.layers\.1\.mlp\.down_proj"):
        convert_gguf(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]


def test_wrong_shape_fails_midway_and_leaves_nothing(tmp_path):
    weights = random_weights("llama", True)
    weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][
        :, :32]
    src = write_gguf(tmp_path / "odd.gguf", "llama", weights)
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight.*\(96, 32\).*\(96, 64\)"):
        convert_gguf(src, tmp_path / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["odd.gguf"]


def test_interrupted_run_leaves_nothing(tmp_path, tiny_gguf, monkeypatch):
    import mlx_bricks.gguf.convert as convert

    calls = []

    def interrupted(*args):
        calls.append(args)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return dequantize(*args)

    monkeypatch.setattr(convert, "dequantize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tiny_gguf, tmp_path / "out", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_cli_entry_point_runs_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mlx_bricks.gguf", str(tmp_path / "x.gguf"),
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 2
    _one_error_line(proc.stderr)


def test_sentencepiece_tokenizer_from_metadata(tmp_path):
    """A llama.cpp "llama" (sentencepiece BPE) vocabulary: prefix space, byte fallback, BOS by
    default."""
    from mlx_bricks.gguf.tokenizer import write_tokenizer
    from mlx_lm.utils import load_tokenizer

    tokens = (["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
              + ["▁", "t", "h", "e", "c", "a", "▁t", "he", "▁the", "at", "▁c", "▁cat"])
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * 12,
            "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(12)],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    write_tokenizer(meta, "llama", tmp_path)
    tokenizer = load_tokenizer(tmp_path)
    ids = tokenizer.encode("the cat é")
    ix = {t: i for i, t in enumerate(tokens)}
    assert ids == [1, ix["▁the"], ix["▁cat"], ix["▁"], ix["<0xC3>"], ix["<0xA9>"]]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the cat é"


def test_keep_quantized_bfloat16_notes_rounded_scales(tmp_path, caplog):
    weights = random_weights("llama", True, seed=4)
    types = {n: Q.Q4_0 for n in weights if n.endswith("proj.weight")}
    src = write_gguf(tmp_path / "tiny.gguf", "llama", weights, types)
    with caplog.at_level(logging.WARNING, logger="mlx_bricks.gguf"):
        out = convert_gguf(src, tmp_path / "out", dtype="bfloat16", keep_quantized=True,
                           progress=False)
    assert any("bfloat16 rounds" in r.getMessage() for r in caplog.records)
    model, _ = load_converted(out)
    assert model.layers[0].mlp.up_proj.scales.dtype == mx.bfloat16


def test_large_models_are_sharded(tmp_path, monkeypatch):
    import mlx_bricks.gguf.convert as convert

    monkeypatch.setattr(convert, "SHARD_BYTES", 40_000)
    weights = random_weights("qwen2", False, seed=6)
    src = write_gguf(tmp_path / "tiny.gguf", "qwen2", weights)
    out = convert_gguf(src, tmp_path / "out", dtype="float32", progress=False)
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(shards) > 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    model, _ = load_converted(out)
    assert np.array_equal(logits(model), logits(reference_model("qwen2", weights)))


# --- the embedded default model with --keep-quantized ------------------------------------------

DEFAULT_PROMPTS = ("What is the capital of France?", "Write a haiku about the sea.",
                   "List three prime numbers.")


def _default_gguf() -> Path:
    from mlx_bricks.models import default_gguf_path

    try:
        return default_gguf_path()
    except ModuleNotFoundError as e:  # scripts/setup.sh installs it
        pytest.skip(str(e))


def _greedy_texts(model_dir: Path, n: int = 16) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy tokens and the prompt's logits (every position) for DEFAULT_PROMPTS. Without Metal
    the model runs in float32: MLX's CPU quantized matmul is ~40x slower with float16
    activations, and casting float16 scales, biases and weights to float32 is exact."""
    from mlx.utils import tree_map
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    if not mx.metal.is_available():
        model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.float16 else a,
                              model.parameters()))
    tokens, last = [], []
    for prompt in DEFAULT_PROMPTS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True)
        last.append(np.array(model(mx.array([ids]))[0].astype(mx.float32)))
        tokens.append(_greedy(model, ids, n))
    return tokens, last


def test_default_model_keep_quantized_generates_the_float16_text():
    """The default model converted with --keep-quantized (Q4_1 projections -> 4-bit, Q8_0
    embedding and output -> 8-bit, carried over exactly) generates the same 16 greedy tokens as
    its float16 conversion on each prompt; the logits differ only by the float16 rounding of the
    dense model's weights."""
    from mlx_bricks.models import default_model

    _default_gguf()
    dense_dir, quantized_dir = default_model("float16"), default_model("4bit")
    config = json.loads((quantized_dir / "config.json").read_text())["quantization"]
    assert (config["bits"], config["group_size"]) == (4, 32)
    assert config["model.embed_tokens"] == {"group_size": 32, "bits": 8}
    dense_tokens, dense_logits = _greedy_texts(dense_dir)
    tokens, last = _greedy_texts(quantized_dir)
    assert tokens == dense_tokens
    for a, b in zip(last, dense_logits):
        assert np.abs(a - b).max() < 0.02 * np.abs(b).max()


@pytest.mark.slow
def test_default_model_as_q4_k_m_keep_quantized_generates_the_dense_text(tmp_path):
    """The default model's weights written as a Q4_K_M-like GGUF (Q4_K / Q6_K on the 1536-column
    ffn_down matrices, llama.cpp's fallbacks Q5_0 / Q8_0 on the 576-column ones), converted with
    --keep-quantized (Q6_K re-quantized to 8-bit) and dense: the same top-1 token at every prompt
    position, logits within 5% of their scale, the same greedy texts (float32 scales and
    activations; a few minutes)."""
    from tests.gguf_kquants import q4_k_m, write_variant

    src = tmp_path / "q4_k_m.gguf"
    write_variant(_default_gguf(), src, q4_k_m)
    types = {t.tensor_type for t in gguf.GGUFReader(src).tensors}
    assert {Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0} <= types
    dense = convert_gguf(src, tmp_path / "dense", dtype="float32", progress=False)
    kept = convert_gguf(src, tmp_path / "kept", dtype="float32", keep_quantized=True,
                        progress=False)
    bits = {json.dumps(v) for v in json.loads((kept / "config.json").read_text())[
        "quantization"].values() if isinstance(v, dict)}
    assert bits == {json.dumps({"group_size": 32, "bits": b}) for b in (4, 8)}
    (tokens, logits_kept), (dense_tokens, logits_dense) = _greedy_texts(kept), _greedy_texts(dense)
    for a, b in zip(logits_kept, logits_dense):  # every prompt position: same top-1 token
        assert np.array_equal(a.argmax(-1), b.argmax(-1))
        assert np.abs(a - b).max() < 0.05 * np.abs(b).max()
    assert tokens == dense_tokens
