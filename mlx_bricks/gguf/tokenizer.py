"""Tokenizer files for an mlx-lm directory, built from a GGUF file's metadata without torch.

A GGUF carries its tokenizer as llama.cpp metadata (``tokenizer.ggml.*``: vocabulary, merges,
token types, special token ids) plus ``tokenizer.chat_template``. transformers' GGUF tokenizer
builder (``transformers.integrations.gguf.convert_gguf_tokenizer``) turns that into a
``tokenizers.Tokenizer``; its own metadata reader needs torch, so we read the fields with the
``gguf`` package and hand them over. We then write ``tokenizer.json``, ``tokenizer_config.json``
(chat template, special tokens, add_bos/add_eos) and ``special_tokens_map.json``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# GGUF key (after "tokenizer.ggml.") -> key transformers' builder expects
_BUILDER_KEYS = {
    "model": "tokenizer_type",
    "pre": "pre_tokenizer_type",
    "tokens": "tokens",
    "scores": "scores",
    "token_type": "token_type",
    "merges": "merges",
    "add_space_prefix": "add_prefix_space",
}

_SPECIAL_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}

# llama.cpp pre-tokenizer names that transformers' builder leaves on the plain GPT-2 split but
# whose reference tokenizer.json first splits every digit apart (SmolLM, StarCoder).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder"}


def build_tokenizer(meta: dict[str, Any], architecture: str):
    """``(tokenizers.Tokenizer, tokenizer_config dict)`` from GGUF ``tokenizer.*`` metadata.

    Raises ``ValueError`` when the file has no tokenizer or one transformers cannot build.
    """
    from tokenizers import Regex, decoders, pre_tokenizers, processors

    try:  # transformers >= 5.2x: picks the builder from tokenizer.ggml.model
        from transformers.integrations.gguf import convert_gguf_tokenizer
    except ImportError:  # earlier 5.x: picks the converter from the architecture
        from transformers.integrations.ggml import convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in meta or "tokenizer.ggml.model" not in meta:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model / .tokens missing)")
    spec = {name: meta[f"tokenizer.ggml.{key}"] for key, name in _BUILDER_KEYS.items()
            if f"tokenizer.ggml.{key}" in meta}
    tokens = spec["tokens"]
    tokenizer, _ = convert_gguf_tokenizer(architecture, spec)

    kind = spec["tokenizer_type"]
    if kind == "gpt2" and spec.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
    if kind == "gpt2" and tokenizer.decoder is None:
        tokenizer.decoder = decoders.ByteLevel()

    special_ids = {}
    for name, key in _SPECIAL_IDS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            special_ids[name] = int(token_id)
    special = {name: tokens[i] for name, i in special_ids.items()}
    # llama.cpp adds BOS by default to sentencepiece vocabularies that do not say otherwise.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_bos = add_bos and "bos_token" in special
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and "eos_token" in special
    single, pair = ["$A:0"], ["$A:0", "$B:1"]
    if add_bos:
        single, pair = [special["bos_token"]] + single, [special["bos_token"]] + pair
    if add_eos:
        single, pair = single + [special["eos_token"]], pair + [special["eos_token"]]
    used = {special[n]: special_ids[n] for n, on in (("bos_token", add_bos),
                                                     ("eos_token", add_eos)) if on}
    tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                             special_tokens=list(used.items()))

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return tokenizer, config


def write_tokenizer(meta: dict[str, Any], architecture: str, out_dir: Path,
                    model_max_length: int | None = None) -> dict[str, Any]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into
    ``out_dir``; returns the tokenizer config that was written."""
    tokenizer, config = build_tokenizer(meta, architecture)
    if model_max_length:
        config["model_max_length"] = int(model_max_length)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    special_map = {k: config[k] for k in _SPECIAL_IDS if k in config}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2,
                                                                ensure_ascii=False))
    return config
