"""GGUF file -> mlx-lm model directory (``config.json``, safetensors, tokenizer files).

Steps: check the file and read its metadata; build ``config.json`` from the ``<arch>.*`` keys;
build the tokenizer from ``tokenizer.*``; map each tensor to its mlx-lm name, undo llama.cpp's
Q/K row order for llama and its ``1 + w`` norm storage for gemma3, dequantize (or, with
``keep_quantized``, turn quantized matrices into MLX affine quantized tensors, see
:mod:`mlx_bricks.gguf.quant`); check every tensor against the shapes of the mlx-lm model class;
write everything into a temporary directory next to the output and rename it into place at the
end.
"""
from __future__ import annotations

import importlib
import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from . import quant
from .check import check_gguf_file
from .tokenizer import write_tokenizer

logger = logging.getLogger("mlx_bricks.gguf")

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
SHARD_BYTES = 4 << 30  # safetensors shard size limit
FORMAT_VERSION = 2  # bump when the output of the same GGUF changes


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture maps onto an mlx-lm model module."""

    model_type: str  # mlx_lm.models.<model_type>
    hf_class: str  # "architectures" entry of config.json
    permuted_qk: bool  # llama.cpp stored Q/K rows in its interleaved RoPE order
    default_rope_theta: float
    layer_names: dict = dataclass_field(default_factory=dict)  # overrides of _LAYER_NAMES
    norm_shift: float = 0.0  # llama.cpp stored every "*norm.weight" as w + norm_shift


# gemma3 (convert_hf_to_gguf.py's Gemma3Model): four norms per layer, and ffn_norm is the
# pre-feed-forward norm, not llama's post-attention one
_GEMMA3_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

ARCHITECTURES = {
    "llama": Architecture("llama", "LlamaForCausalLM", True, 10000.0),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", False, 1000000.0),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", False, 1000000.0),
    "gemma3": Architecture("gemma3_text", "Gemma3ForCausalLM", False, 1000000.0,
                           layer_names=_GEMMA3_LAYER_NAMES, norm_shift=1.0),
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

# GGUF tensor name -> mlx-lm parameter path (blk.N.* map to model.layers.N.*)
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3: RMSNorm per head before RoPE
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_UNQUANTIZED = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def convert_gguf(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float16",
    keep_quantized: bool = False,
    force: bool = False,
    progress: bool = True,
) -> Path:
    """Convert a GGUF model file into a directory that ``mlx_lm.load`` opens as is.

    Args:
        path: the ``.gguf`` file (one file; split ``-00001-of-0000N`` GGUFs are not supported).
        out_dir: the directory to create. It may exist only if empty, unless ``force``.
        dtype: ``"float16"``, ``"bfloat16"`` or ``"float32"``: the dtype of every dense tensor
            (dequantized weights, norms, biases) and of the scales/biases of quantized ones.
        keep_quantized: keep quantized matrices quantized, as MLX affine tensors (uint32 packed
            codes, per-group scales and biases in ``dtype``, group size 32; the
            ``quantization`` section of config.json says so, with per-module entries where the
            bits differ, and mlx-lm builds ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``).
            Bits per ggml type (:data:`mlx_bricks.gguf.quant.MAPPINGS`): Q4_0, Q4_1, Q4_K ->
            4; Q5_0, Q5_1, Q5_K -> 5; Q8_0 -> 8 (codes carried over: the GGUF's values exactly
            with float32 scales; also with float16 ones except the K-quants' scale products,
            rounded to float16); Q2_K, Q3_K, Q6_K -> 3, 4, 8 (their 16-value sub-blocks
            re-quantized to groups of 32, one bit above nominal); IQ4_NL/IQ4_XS -> 5,
            IQ3_XXS/IQ3_S -> 4, IQ2_XXS/IQ2_XS/IQ2_S -> 3 (re-quantized from their values, one
            bit above nominal).
            A note on logger ``mlx_bricks.gguf`` gives every lossy mapping's relative RMS error
            against the GGUF's values; types without a mapping (TQ1_0, TQ2_0, MXFP4, IQ1_S,
            IQ1_M...) are dequantized, with a note. Without it every tensor is dequantized to
            ``dtype``.
        force: replace ``out_dir`` if it exists and is not empty.
        progress: show a tqdm progress bar on stderr.

    Returns:
        The output directory, holding ``config.json``, ``model.safetensors`` (or shards
        ``model-0000i-of-0000n.safetensors`` with an index past 4 GiB), ``tokenizer.json``,
        ``tokenizer_config.json`` (with the chat template) and ``special_tokens_map.json``.

    Supported: architectures ``llama`` (Llama 1-3, Mistral-style, SmolLM; Q/K rows are put back in
    Hugging Face order so mlx-lm's default RoPE applies; Llama 3.x ``rope_freqs`` becomes mlx-lm's
    ``llama3`` rope scaling), ``qwen2`` (q/k/v biases, tied or untied output), ``qwen3``
    (per-head q/k norms) and ``gemma3`` (mlx-lm's ``gemma3_text``: norms stored by llama.cpp as
    ``1 + w`` are stored back as ``w``; sliding-window layer pattern, local and global RoPE bases
    and the attention scale as llama.cpp derives them, see :func:`build_config`); every ggml
    type ``gguf.quants.dequantize`` reads (F32, F16, BF16, Q4_0...Q8_1, K-quants,
    IQ-quants...); tokenizers transformers can build from GGUF metadata
    (``gpt2`` byte-level BPE, ``llama`` sentencepiece, ...), built without torch.

    The output is written into a temporary directory beside ``out_dir`` and renamed at the end:
    a failed or interrupted run leaves nothing behind.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a GGUF file, a truncated or corrupt one, an unsupported architecture,
            tokenizer or tensor, or a bad ``dtype``.
        FileExistsError: ``out_dir`` exists and is not an empty directory, and not ``force``.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {dtype!r}")
    path, out_dir = Path(path).expanduser(), Path(out_dir).expanduser()
    _check_out_dir(path, out_dir, force)
    reader = open_gguf(path)
    meta = read_metadata(reader)
    arch_name = meta.get("general.architecture")
    if arch_name not in ARCHITECTURES:
        raise ValueError(f"{path.name}: unsupported architecture {arch_name!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    arch = ARCHITECTURES[arch_name]
    tensors = {t.name: t for t in reader.tensors}
    config = build_config(meta, arch_name, tensors)
    config["mlx_bricks"] = {"converted_from": path.name, "format_version": FORMAT_VERSION,
                            "dtype": dtype, "keep_quantized": bool(keep_quantized)}
    expected = _expected_parameters(config)
    _check_names(tensors, expected, arch_name, config["model_type"])  # before writing anything

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary model directory
        write_tokenizer(meta, arch_name, tmp, config.get("max_position_embeddings"))
        notes, quantized = _write_weights(tensors, arch, config, expected, tmp, dtype,
                                          keep_quantized, progress)
        if quantized:
            bits = [q["bits"] for q in quantized.values()]
            default_bits = max(set(bits), key=bits.count)
            config["quantization"] = {"group_size": quant.GROUP_SIZE, "bits": default_bits,
                                      "mode": "affine"}
            config["quantization"].update({p: q for p, q in quantized.items()
                                           if q["bits"] != default_bits})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _move_into_place(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    for note in notes:
        logger.warning("note: %s", note)
    return out_dir


def open_gguf(path: Path) -> GGUFReader:
    """A ``GGUFReader`` for ``path``, with one clear error for a missing or damaged file
    (:func:`mlx_bricks.gguf.check.check_gguf_file` says what is wrong before the reader runs)."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise ValueError(f"{path}: not a file")
    check_gguf_file(path)
    try:
        reader = GGUFReader(path)
        for t in reader.tensors:  # the reader is lazy about nothing but data: touch the shapes
            if t.data.nbytes != t.n_bytes:
                raise ValueError(f"tensor {t.name} has {t.data.nbytes} of {t.n_bytes} bytes")
    except (ValueError, IndexError, KeyError, OverflowError) as e:
        # the structure check passed, so this is something it does not look at
        raise ValueError(f"{path}: corrupt GGUF file ({' '.join(str(e).split())})") from None
    return reader


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """``{key: value}`` of a GGUF's metadata (strings, numbers, lists), without ``GGUF.*``."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            value = field.contents()
        except (ValueError, IndexError) as e:
            raise ValueError(f"corrupt metadata field {key} ({e})") from None
        if field.types and field.types[0] != GGUFValueType.ARRAY and hasattr(value, "item"):
            value = value.item()
        meta[key] = value
    return meta


def build_config(meta: dict[str, Any], arch_name: str, tensors: dict) -> dict[str, Any]:
    """The mlx-lm / Hugging Face ``config.json`` for this file's metadata and tensors."""
    arch = ARCHITECTURES[arch_name]

    def key(name, default=None, required=True):
        value = meta.get(f"{arch_name}.{name}", default)
        if value is None and required:
            raise ValueError(f"metadata key {arch_name}.{name} is missing")
        if isinstance(value, list):
            raise ValueError(f"metadata key {arch_name}.{name} varies per layer; "
                             "only uniform layers are supported")
        return value

    n_heads = int(key("attention.head_count"))
    n_kv_heads = int(key("attention.head_count_kv", n_heads))
    hidden = int(key("embedding_length"))
    if "token_embd.weight" not in tensors or "blk.0.attn_q.weight" not in tensors:
        raise ValueError("the file lacks token_embd.weight or blk.0.attn_q.weight")
    q_rows = int(tensors["blk.0.attn_q.weight"].shape[1])  # GGUF shapes are (cols, rows)
    head_dim = int(key("attention.key_length", q_rows // n_heads))
    rope_dim = key("rope.dimension_count", None, required=False)
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"partial rotary embedding ({rope_dim} of {head_dim} dims) "
                         "is not supported")
    config = {
        "model_type": arch.model_type,
        "architectures": [arch.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", arch.default_rope_theta)),
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "max_position_embeddings": int(key("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch_name == "llama":
        config["attention_bias"] = any(f"blk.0.attn_{p}.bias" in tensors
                                       for p in ("q", "k", "v", "output"))
        config["mlp_bias"] = any(f"blk.0.ffn_{p}.bias" in tensors for p in ("gate", "up", "down"))
    rope_scaling = _rope_scaling(meta, arch_name, config, tensors)
    if rope_scaling:
        config["rope_scaling"] = rope_scaling
    if arch_name == "gemma3":
        config.update(_gemma3_config(meta, config, key))
    for name, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[name] = int(meta[f"tokenizer.ggml.{gguf_key}"])
    eot = meta.get("tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in config and int(eot) != config["eos_token_id"]:
        config["eos_token_id"] = [config["eos_token_id"], int(eot)]
    return config


def _gemma3_config(meta: dict[str, Any], config: dict[str, Any], key) -> dict[str, Any]:
    """The gemma3_text keys llama.cpp derives rather than stores (``llama-model.cpp``,
    ``LLM_ARCH_GEMMA3``):

    - sliding window: ``gemma3.attention.sliding_window`` tokens (a query attends to keys less
      than that many positions back, as in mlx-lm); absent or 0 means every layer is global.
    - layer pattern: every 6th layer global (llama.cpp hard-codes 6); a
      ``gemma3.attention.sliding_window_pattern`` key, when a file has one, is honoured (an int
      period, or one bool per layer, true = sliding, that must follow a period).
    - RoPE: global layers ``rope.freq_base`` (and ``rope.scaling``), sliding layers
      ``rope.freq_base_swa`` when present, else 10000 as llama.cpp hard-codes.
    - attention scale 1 / sqrt(query_pre_attn_scalar): head_dim, except for the 62-layer (27B)
      model, hidden_size / num_attention_heads.
    - logit soft-capping is refused: mlx-lm's gemma3_text has none.
    """
    layers = config["num_hidden_layers"]
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if float(meta.get(f"gemma3.{cap}", 0.0) or 0.0) != 0.0:
            raise ValueError(f"metadata key gemma3.{cap} is set; mlx-lm's gemma3_text has no "
                             "logit soft-capping")
    value_length = key("attention.value_length", config["head_dim"], required=False)
    if int(value_length) != config["head_dim"]:
        raise ValueError(f"gemma3: value_length {value_length} differs from key_length "
                         f"{config['head_dim']}; mlx-lm's gemma3_text uses one head_dim")
    window = int(meta.get("gemma3.attention.sliding_window", 0) or 0)
    pattern = meta.get("gemma3.attention.sliding_window_pattern", 6)
    if window <= 0:
        pattern, window = 1, config["max_position_embeddings"]
    elif isinstance(pattern, list):
        pattern = _sliding_period([bool(x) for x in pattern], layers)
    pattern = int(pattern)
    if pattern < 1 or pattern > layers:
        raise ValueError(f"gemma3: sliding-window pattern {pattern} with {layers} layers: "
                         "mlx-lm's gemma3_text needs at least one global layer every "
                         "`pattern` layers and no more than num_hidden_layers")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return {
        "sliding_window": window,
        "sliding_window_pattern": pattern,
        "rope_local_base_freq": float(meta.get("gemma3.rope.freq_base_swa", 10000.0)),
        "query_pre_attn_scalar": hidden // heads if layers == 62 else config["head_dim"],
    }


def _sliding_period(flags: list[bool], layers: int) -> int:
    """The period p with flags[i] == ((i + 1) % p != 0) for every layer (mlx-lm's only layout)."""
    if len(flags) != layers:
        raise ValueError(f"gemma3.attention.sliding_window_pattern has {len(flags)} entries "
                         f"for {layers} layers")
    for p in range(1, layers + 1):
        if all(f == ((i + 1) % p != 0) for i, f in enumerate(flags)):
            return p
    raise ValueError("gemma3.attention.sliding_window_pattern is not periodic with the last "
                     "layer of each period global; mlx-lm's gemma3_text cannot express it")


def _rope_scaling(meta, arch_name, config, tensors) -> dict | None:
    kind = meta.get(f"{arch_name}.rope.scaling.type", "none")
    if kind == "linear":
        return {"type": "linear", "factor": float(meta[f"{arch_name}.rope.scaling.factor"])}
    if kind not in ("none", None):
        raise ValueError(f"rope scaling {kind!r} is not supported (only linear and llama3)")
    if "rope_freqs.weight" not in tensors:
        return None
    factors = dequantize(tensors["rope_freqs.weight"].data,
                         tensors["rope_freqs.weight"].tensor_type).astype(np.float64).ravel()
    return llama3_rope_scaling(factors, config["head_dim"], config["rope_theta"])


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, base: float) -> dict | None:
    """mlx-lm's ``llama3`` rope_scaling that reproduces llama.cpp's ``rope_freqs`` factors.

    llama.cpp stores, per frequency pair i, the factor r_i dividing the rotation frequency: 1 for
    short wavelengths, ``factor`` for long ones, ``1 / ((1 - s) / factor + s)`` between, with
    ``s = (L / wavelength - low) / (high - low)``. ``s`` is linear in 1 / wavelength, so the
    transition points give its slope and offset, which fix L, low and high up to a common choice
    (we take low = 1); the resulting frequencies are the same.
    """
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs: expected {head_dim // 2} factors, got {factors.shape}")
    factor = float(factors.max())
    if math.isclose(factor, 1.0) and math.isclose(float(factors.min()), 1.0):
        return None
    inv_wavelen = base ** (-np.arange(0, head_dim, 2) / head_dim) / (2 * np.pi)
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    medium = (smooth > 1e-6) & (smooth < 1 - 1e-6)
    if medium.sum() < 2:
        raise ValueError("rope_freqs: cannot recover llama3 rope scaling (fewer than two "
                         "transition frequencies)")
    slope, offset = np.polyfit(inv_wavelen[medium], smooth[medium], 1)
    if offset >= 0 or slope <= 0:
        raise ValueError("rope_freqs: factors do not follow llama3 rope scaling")
    high = 1 - 1 / offset
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": float(high),
            "original_max_position_embeddings": float(-slope / offset)}


def _expected_parameters(config: dict) -> dict[str, tuple[int, ...]]:
    """``{parameter path: shape}`` of the mlx-lm model this config builds (nothing allocated:
    MLX arrays are lazy)."""
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    params = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    if config.get("tie_word_embeddings"):
        # gemma3_text always builds lm_head and drops it in sanitize() when the file has none
        params = {k: v for k, v in params.items() if not k.startswith("lm_head.")}
    return params


def mlx_name(gguf_name: str, arch_name: str = "llama") -> str:
    """mlx-lm parameter path of a GGUF tensor of architecture ``arch_name``
    (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``); ``ValueError`` for
    an unknown name."""
    layer_names = {**_LAYER_NAMES, **ARCHITECTURES[arch_name].layer_names}
    base, _, param = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 1 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{param}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{param}"
    raise ValueError(f"tensor {gguf_name!r} has no counterpart in the mlx-lm model")


def _write_weights(tensors, arch, config, expected, tmp, dtype, keep_quantized, progress):
    """Convert and save every tensor; returns (notes, {quantized module path: params})."""
    from tqdm import tqdm

    target = DTYPES[dtype]
    notes, quantized = [], {}
    dequantized: dict[str, list[str]] = {}  # ggml type -> tensors without an affine mapping
    kept: dict[str, _KeptStats] = {}  # ggml type -> error totals of its affine tensors
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    shards, current, current_bytes = [], {}, 0

    def flush():
        nonlocal current, current_bytes
        if current:
            shard = tmp / f"part-{len(shards):05d}.safetensors"
            mx.save_safetensors(str(shard), current, metadata={"format": "mlx"})
            shards.append((shard, list(current)))
            current, current_bytes = {}, 0

    def add(name, array):
        nonlocal current_bytes
        mx.eval(array)  # now, so the float32 source can go: memory stays about one shard
        if current_bytes + array.nbytes > SHARD_BYTES:
            flush()
        current[name] = array
        current_bytes += array.nbytes

    arch_name = next(k for k, v in ARCHITECTURES.items() if v is arch)
    names = [n for n in tensors if n != "rope_freqs.weight"]
    for gguf_name in tqdm(names, desc="converting", unit="tensor", disable=not progress):
        t = tensors[gguf_name]
        name = mlx_name(gguf_name, arch_name)
        module, _, param = name.rpartition(".")
        proj = module.rpartition(".")[2]
        unpermute = arch.permuted_qk and proj in heads
        qtype = t.tensor_type
        affine = None
        if keep_quantized and qtype not in _UNQUANTIZED and param == "weight" and t.data.ndim == 2:
            affine = _affine_or_note(gguf_name, t, qtype, dtype, notes, dequantized)
        if affine is not None:
            arrays = (affine.weight, affine.scales, affine.biases)
            if unpermute:
                arrays = [quant.unpermute_rows(a, heads[proj]) for a in arrays]
            weight, scales, biases = arrays
            shape = (weight.shape[0], weight.shape[1] * 32 // affine.bits)
            _check_shape(gguf_name, name, shape, expected)
            add(name, mx.array(weight))
            add(f"{module}.scales", mx.array(scales).astype(target))
            add(f"{module}.biases", mx.array(biases).astype(target))
            quantized[module] = {"group_size": quant.GROUP_SIZE, "bits": affine.bits}
            kept.setdefault(qtype.name, _KeptStats(affine.bits)).add(affine)
            continue
        try:
            values = dequantize(t.data, qtype)
        except NotImplementedError as e:
            raise ValueError(f"tensor {gguf_name!r}: ggml type {qtype.name} cannot be "
                             f"dequantized by the gguf package ({e})") from None
        if unpermute:
            values = quant.unpermute_rows(values, heads[proj])
        if arch.norm_shift and gguf_name.endswith("norm.weight"):
            # exact: llama.cpp added the shift to float32 copies of bfloat16 / float32 weights
            values = values.astype(np.float64) - arch.norm_shift
        _check_shape(gguf_name, name, values.shape, expected)
        add(name, mx.array(np.ascontiguousarray(values, dtype=np.float32)).astype(target))
    written = {n for _, names_ in shards for n in names_} | set(current)
    for name in sorted(set(expected) - written):  # only biases (checked before): zeros are exact
        add(name, mx.zeros(expected[name], dtype=target))
    flush()
    _name_shards(shards, tmp)
    notes.extend(stats.note(qname, dtype) for qname, stats in kept.items())
    for qname, names_ in dequantized.items():
        notes.append(f"{len(names_)} {qname} tensor(s) dequantized to {dtype} (no MLX affine "
                     f"mapping for {qname}), e.g. {names_[0]}")
    if keep_quantized and quantized and dtype == "bfloat16":
        notes.append("bfloat16 rounds the quantization scales and biases; use --dtype "
                     "float16 or float32 to keep the exact mappings exact")
    return [n for n in notes if n], quantized


def _affine_or_note(gguf_name, t, qtype, dtype, notes, dequantized):
    """``quant.to_affine`` of one GGUF matrix, or None (dequantize it) with the reason noted."""
    if qtype not in quant.MAPPINGS:
        dequantized.setdefault(qtype.name, []).append(gguf_name)
        return None
    cols = int(t.shape[0])  # GGUF shapes are (cols, rows)
    if cols % quant.GROUP_SIZE:  # cannot happen for whole ggml blocks; checked all the same
        notes.append(f"{gguf_name}: {cols} input columns is not a multiple of the group size "
                     f"{quant.GROUP_SIZE}; dequantized")
        return None
    affine = quant.to_affine(np.asarray(t.data), qtype, dtype)
    if affine is None:
        notes.append(f"{gguf_name}: {qtype.name} scale or bias too large for {dtype}; "
                     "dequantized")
    return affine


@dataclass
class _KeptStats:
    """Error totals of the tensors of one ggml type kept as MLX affine."""

    bits: int
    count: int = 0
    inexact: int = 0
    sq_error: float = 0.0
    sq_values: float = 0.0
    max_error: float = 0.0

    def add(self, affine: quant.AffineTensor) -> None:
        self.count += 1
        self.inexact += not affine.exact
        self.sq_error += affine.sq_error
        self.sq_values += affine.sq_values
        self.max_error = max(self.max_error, affine.max_error)

    def note(self, qname: str, dtype: str) -> str:
        """'' when every tensor is exact, else one line with the error."""
        if not self.inexact:
            return ""
        rel = math.sqrt(self.sq_error / self.sq_values) if self.sq_values else 0.0
        method = quant.MAPPINGS[GGMLQuantizationType[qname]].method
        how = "kept as" if method == "exact" else "re-quantized to"
        rounded = (f", scales and biases rounded to {dtype} (float32 keeps them exact)"
                   if method == "exact" else "")
        return (f"{self.count} {qname} tensor(s) {how} MLX {self.bits}-bit affine, group size "
                f"{quant.GROUP_SIZE}{rounded}: relative RMS error {rel:.2e} against the GGUF's "
                f"values, max abs error {self.max_error:.2e}")


def _check_names(tensors, expected, arch_name, model_type) -> None:
    """Every GGUF tensor has a place in the model, and every model weight a tensor (a missing
    bias is fine: the file omits those the model does not use, and zeros stand in exactly)."""
    mapped = set()
    for gguf_name in tensors:
        if gguf_name == "rope_freqs.weight":
            continue
        name = mlx_name(gguf_name, arch_name)
        if name not in expected:
            raise ValueError(f"tensor {gguf_name!r} ({name}) is not a parameter of mlx-lm's "
                             f"{model_type} model with this config")
        mapped.add(name)
    missing = sorted(n for n in set(expected) - mapped if not n.endswith(".bias"))
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise ValueError(f"the file has no tensor for {missing[0]}{more}")


def _check_shape(gguf_name, name, shape, expected):
    if tuple(shape) != expected[name]:
        raise ValueError(f"tensor {gguf_name!r} has shape {tuple(shape)}, the model expects "
                         f"{expected[name]} for {name}")


def _name_shards(shards, tmp: Path) -> None:
    """``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` plus the index file."""
    if len(shards) == 1:
        shards[0][0].rename(tmp / "model.safetensors")
        return
    weight_map = {}
    for i, (part, names) in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part.rename(tmp / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _check_out_dir(path: Path, out_dir: Path, force: bool) -> None:
    if out_dir.exists():
        if path.resolve().is_relative_to(out_dir.resolve()):
            raise ValueError(f"{out_dir}: contains the input file; choose another directory")
        empty = out_dir.is_dir() and not any(out_dir.iterdir())
        if not empty and not force:
            raise FileExistsError(f"{out_dir}: exists and is not empty (use --force / force=True "
                                  "to replace it)")


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``, replacing whatever is there (already checked)."""
    old = None
    if out_dir.is_dir() and not out_dir.is_symlink():
        if any(out_dir.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            out_dir.rename(old / "replaced")
        else:
            out_dir.rmdir()
    elif out_dir.exists() or out_dir.is_symlink():
        out_dir.unlink()
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
