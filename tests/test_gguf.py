"""GGUF import (mlx_bricks.gguf): tiny synthetic llama / qwen2 / qwen3 files written here with
``gguf.GGUFWriter`` convert to directories whose logits equal those of the same weights built
directly in mlx-lm, for F32, F16, BF16, Q4_0...Q8_0, the K-quants (Q2_K...Q6_K) and some
IQ-quants; Q4_0/Q4_1/Q8_0 re-encoding is exact against ``gguf``'s own dequantizer; bad inputs give
one clear error.

The references are independent of the converter: the tests write the GGUF the way llama.cpp does
(its name table, its Q/K row permutation, its rope_freqs formula) and build the expected model
from the original Hugging Face-layout weights.
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
from mlx_bricks.gguf import quant
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
    Q.IQ2_XXS: (0,), Q.IQ3_S: (0,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
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
    kinds = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
    types = {n: kinds[i % 3] for i, n in enumerate(sorted(weights)) if n.endswith("proj.weight")}
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
        assert (module.bits, module.group_size) == (8 if qtype == Q.Q8_0 else 4, 32), name
        # exact: the stored affine tensors dequantize to the GGUF's values bit for bit
        deq = mx.dequantize(module.weight, module.scales, module.biases, group_size=32,
                            bits=module.bits)
        assert np.array_equal(np.array(deq), as_stored(weights, types)[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32
    expected = logits(reference_model(arch, as_stored(weights, types)))
    np.testing.assert_allclose(logits(model), expected, rtol=1e-4, atol=1e-4)


def test_keep_quantized_dequantizes_other_types_with_a_note(tmp_path, caplog):
    weights = random_weights("llama", True, seed=2)
    types = {n: Q.Q5_0 for n in weights if n.endswith("mlp.up_proj.weight")}
    types.update({n: Q.Q8_0 for n in weights if n.endswith("mlp.down_proj.weight")})
    src = write_gguf(tmp_path / "tiny.gguf", "llama", weights, types)
    with caplog.at_level(logging.WARNING, logger="mlx_bricks.gguf"):
        out = convert_gguf(src, tmp_path / "out", dtype="float32", keep_quantized=True,
                           progress=False)
    assert any("Q5_0" in r.getMessage() and "dequantized" in r.getMessage()
               for r in caplog.records)
    model, _ = load_converted(out)
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, nn.QuantizedLinear)
    expected = logits(reference_model("llama", as_stored(weights, types)))
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


@pytest.mark.parametrize("qtype,arch,tied", [
    (Q.BF16, "qwen2", False), (Q.Q5_1, "llama", True), (Q.Q2_K, "llama", True),
    (Q.Q3_K, "qwen2", False), (Q.Q4_K, "llama", True), (Q.Q5_K, "qwen3", True),
    (Q.Q6_K, "llama", False), (Q.IQ2_XXS, "llama", True), (Q.IQ3_S, "qwen2", False),
    (Q.IQ4_NL, "qwen3", True), (Q.IQ4_XS, "llama", True)], ids=lambda v: getattr(v, "name", v))
def test_bf16_k_and_iq_quants_dequantize_exactly(tmp_path, caplog, qtype, arch, tied):
    weights, raw = encoded_weights(arch, tied, qtype, seed=7)
    src = write_gguf(tmp_path / "tiny.gguf", arch, weights, raw=raw, cfg=TINY_K)
    stored = {t.name: t.tensor_type for t in gguf.GGUFReader(src).tensors}
    assert {stored[gguf_name(n)] for n in raw} == {qtype}
    expected = logits(reference_model(arch, weights, cfg=TINY_K))

    out = convert_gguf(src, tmp_path / "dense", dtype="float32", progress=False)
    got = logits(load_converted(out)[0])
    assert np.array_equal(got, expected), np.abs(got - expected).max()

    # nothing to keep: dequantized all the same, with a note for a quantized type
    with caplog.at_level(logging.WARNING, logger="mlx_bricks.gguf"):
        out = convert_gguf(src, tmp_path / "keep", dtype="float32", keep_quantized=True,
                           progress=False)
    notes = [r.getMessage() for r in caplog.records if r.name == "mlx_bricks.gguf"]
    if qtype == Q.BF16:
        assert notes == []  # a float type, like F16: nothing was lost
    else:
        assert len(notes) == 1 and re.search(rf"\b{len(raw)} {qtype.name}\b.*dequantized",
                                             notes[0]), notes
    model, _ = load_converted(out)
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                   for _, m in model.named_modules())
    assert "quantization" not in json.loads((out / "config.json").read_text())
    got = logits(model)
    assert np.array_equal(got, expected), np.abs(got - expected).max()


def test_keep_quantized_k_quant_mix(tmp_path, caplog, capsys):
    """A Q4_K_M-like file (Q4_K, Q6_K for attn_v / ffn_down / embeddings) with one Q8_0 matrix,
    through the command line: the K-quants are dequantized and named in the note, the Q8_0 one
    stays quantized."""
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
    notes = " | ".join(r.getMessage() for r in caplog.records)
    assert re.search(r"\b5 Q6_K\b.*dequantized", notes), notes  # 2 v, 2 down, 1 embedding
    assert re.search(r"\b9 Q4_K\b.*dequantized", notes), notes
    assert "Q8_0 tensor" not in notes, notes
    model, _ = load_converted(out)
    layers = model.model.layers
    assert isinstance(layers[1].self_attn.o_proj, nn.QuantizedLinear)
    assert layers[1].self_attn.o_proj.bits == 8
    assert type(layers[0].self_attn.o_proj) is nn.Linear
    assert type(layers[1].mlp.down_proj) is nn.Linear
    assert type(model.model.embed_tokens) is nn.Embedding
    expected = logits(reference_model("llama", weights, cfg=TINY_K))
    np.testing.assert_allclose(logits(model), expected, rtol=1e-4, atol=1e-4)


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


# --- exact re-encoding of Q4_0 / Q4_1 / Q8_0 ---------------------------------------------------

def _unpack_mlx(weight: np.ndarray, bits: int) -> np.ndarray:
    """MLX affine packing, read independently: value i of a row sits at bit bits*i of the row's
    little-endian uint32 stream."""
    per_word = 32 // bits
    shifts = (np.arange(per_word) * bits).astype(np.uint32)
    codes = (weight[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(weight.shape[0], -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_affine_re_encoding_is_exact(qtype):
    blocks = random_blocks(qtype, rows=6, cols=5 * 32, std=1.0)
    reference = dequantize(blocks, qtype)  # gguf's own dequantizer, float32
    weight, scales, biases = quant.to_affine(blocks, qtype)
    bits = quant.KEEPABLE[qtype][0]
    assert weight.dtype == np.uint32 and scales.dtype == biases.dtype == np.float16
    codes = _unpack_mlx(weight, bits).astype(np.float64)
    s = np.repeat(scales.astype(np.float64), 32, axis=1)
    b = np.repeat(biases.astype(np.float64), 32, axis=1)
    assert np.array_equal(codes * s + b, reference.astype(np.float64))
    # MLX itself agrees, in float32 (exact) ...
    deq = mx.dequantize(mx.array(weight), mx.array(scales).astype(mx.float32),
                        mx.array(biases).astype(mx.float32), group_size=32, bits=bits)
    assert np.array_equal(np.array(deq), reference)
    # ... and in float16 up to its two roundings (s * u, then + z): half an ulp of each
    deq16 = np.array(mx.dequantize(mx.array(weight), mx.array(scales), mx.array(biases),
                                   group_size=32, bits=bits).astype(mx.float32))
    bound = (np.abs(codes * s) + np.abs(reference)) * 2.0 ** -11 + 2.0 ** -24
    assert np.all(np.abs(deq16 - reference) <= bound)


def test_affine_re_encoding_reports_float16_overflow():
    blocks = random_blocks(Q.Q8_0, rows=2, cols=2 * 32, std=1.0)
    blocks[0, 0:2] = np.array([1000.0], dtype=np.float16).view(np.uint8)  # -128 d overflows
    assert quant.to_affine(blocks, Q.Q8_0) is None
    with pytest.raises(ValueError, match="Q5_0"):
        quant.to_affine(blocks, Q.Q5_0)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(48 * 3).reshape(48, 3)
    assert np.array_equal(quant.unpermute_rows(llama_cpp_permute(w, 3), 3), w)
    assert not np.array_equal(llama_cpp_permute(w, 3), w)


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


@pytest.mark.parametrize("keep", [10, 200, 0.5, 0.999])
def test_truncated_file(tmp_path, tiny_gguf, capsys, keep):
    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep if isinstance(keep, int) else int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        convert_gguf(cut, tmp_path / "out")
    rc, err = _cli(capsys, cut, tmp_path / "out")
    assert rc == 2 and "truncated or corrupt" in _one_error_line(err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


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
