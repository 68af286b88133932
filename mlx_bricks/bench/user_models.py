"""The user's-path benchmark's models and prompts (``bench.user_path``): model directories with
random weights, written as ``mlx_lm.convert`` writes them, and prompts of an exact token count.

Each model is a :class:`ModelSpec`: mlx-lm ``config.json`` fields at the real model's size, its
dtype and weight format. :func:`write_model` writes the directory (mlx-lm's own model class and
initialisation, ``mlx_lm.utils.quantize_model``, the default model's tokenizer files beside);
:func:`make_prompt` builds a prompt that ``mlx_lm.generate`` turns into exactly P tokens (chat
template included); :func:`prefill_chunks` says how mlx-lm prefills it.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path


#: mlx-lm's ``prefill_step_size`` default (``mlx_lm.generate.DEFAULT_PREFILL_STEP_SIZE`` and
#: ``mlx_lm.benchmark``'s ``--prefill-step-size``); the runs leave it at the default, this only
#: describes the chunks in the JSON.
PREFILL_STEP = 2048
#: Prompt lengths of the GPU group (tokens) and of the CPU group.
GPU_PROMPTS = (512, 2240, 8192, 32768)
CPU_PROMPTS = (128, 512)

# Words that are one token each after a space in the default model's tokenizer (checked when a
# prompt is built: the count is measured, not assumed).
_WORDS = ("the of and to in is was for on that with as by at from his it an were are which this "
          "be or has had not but first one their its new after who they two her she been other "
          "when there all during into school time may years more most only over city some world "
          "would where later up such used many can state about national out known university "
          "united then made").split()


@dataclass(frozen=True)
class ModelSpec:
    """A model directory to write: mlx-lm ``config.json`` fields (without ``quantization``),
    the float dtype, and the weight format.

    Attributes:
        name: short name (benchmark names, directory names).
        config: mlx-lm config fields at the model's real size (``num_hidden_layers`` included).
        dtype: ``"bfloat16"`` / ``"float16"`` / ``"float32"``: the float weights and activations.
        bits: None (float weights) or the quantized bits (``mlx_lm.utils.quantize_model``).
        group_size: the quantization group size.
        what: one line: the real model this has the shapes of.
        mode: ``quantize_model``'s mode: ``"affine"``, or ``"mxfp4"`` (group 32) as gpt-oss.
    """

    name: str
    config: dict
    dtype: str = "bfloat16"
    bits: int | None = 4
    group_size: int = 64
    what: str = ""
    mode: str = "affine"

    @property
    def text(self) -> dict:
        """The text model's fields: ``config``, or its ``text_config`` (qwen3_5 nests them)."""
        return self.config.get("text_config", self.config)

    def with_layers(self, layers: int | None) -> "ModelSpec":
        """The same model with ``layers`` decoder layers (None: unchanged)."""
        if layers is None or layers == self.text["num_hidden_layers"]:
            return self
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers must be a positive int or None, got {layers!r}")
        pattern = self.text.get("sliding_window_pattern", 1)
        if layers < pattern:  # gemma3 masks with its first global layer's cache
            raise ValueError(f"layers must be at least {pattern} for {self.name} (one global "
                             f"layer every {pattern}), got {layers}")
        text = {**self.text, "num_hidden_layers": layers}
        if "hybrid_override_pattern" in text:  # nemotron_h: the layer stack is the pattern's
            text["hybrid_override_pattern"] = text["hybrid_override_pattern"][:layers]
        nested = "text_config" in self.config
        return dataclasses.replace(self, config={**self.config, "text_config": text} if nested
                                   else text)

    def describe(self) -> str:
        c = self.text
        w = "float" if self.bits is None else f"{self.mode} {self.bits}-bit gs{self.group_size}"
        return (f"{self.what or self.name}: {c['model_type']}, {c['num_hidden_layers']} layers, "
                f"hidden {c['hidden_size']}, vocab {c['vocab_size']}, {self.dtype}, {w} weights")


_LLAMA3_8B = dict(model_type="llama", hidden_size=4096, num_hidden_layers=32,
                  intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, rms_norm_eps=1e-5, vocab_size=128256, rope_theta=500000.0,
                  max_position_embeddings=8192, tie_word_embeddings=False)
_QWEN3_30B_A3B = dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
                      intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True, rms_norm_eps=1e-6, vocab_size=151936,
                      rope_theta=1000000.0, max_position_embeddings=40960,
                      tie_word_embeddings=False)
# Gemma 3 ties the LM head to the embedding (no lm_head in the checkpoint).
_GEMMA3_12B = dict(model_type="gemma3_text", hidden_size=3840, num_hidden_layers=48,
                   intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8,
                   head_dim=256, rms_norm_eps=1e-6, vocab_size=262208, rope_theta=1000000.0,
                   rope_local_base_freq=10000.0, query_pre_attn_scalar=256, sliding_window=1024,
                   sliding_window_pattern=6, max_position_embeddings=131072,
                   rope_scaling={"rope_type": "linear", "factor": 8.0})

# Qwen3.5-35B-A3B: Gated DeltaNet layers, full attention every fourth; mlx-lm's qwen3_5 Model
# reads the text model's fields from ``text_config``.
_QWEN35_35B_A3B = dict(model_type="qwen3_5_moe", text_config=dict(
    model_type="qwen3_5_moe", hidden_size=2048, num_hidden_layers=40, intermediate_size=512,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    full_attention_interval=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, rms_norm_eps=1e-6, vocab_size=248320,
    max_position_embeddings=262144, tie_word_embeddings=False))
# gpt-oss-20b: every layer MoE (biased SwiGLU-OAI experts), window-128 layers between full ones.
_GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24,
                    intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
                    num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                    vocab_size=201088, sliding_window=128, rope_theta=150000,
                    rms_norm_eps=1e-5)

# Nemotron-3-Nano-30B-A3B: Mamba-2 (M), MoE (E, 128 relu2 experts of 1856, top-6, a shared
# expert) and attention (*) layers; mlx-lm's nemotron_h counts the layers from the pattern.
_NEMOTRON3_NANO = dict(
    model_type="nemotron_h", vocab_size=131072, hidden_size=2688, intermediate_size=1856,
    num_hidden_layers=52, hybrid_override_pattern=list(
        "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"),
    max_position_embeddings=262144, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
    attention_bias=False, mamba_num_heads=64, mamba_head_dim=64, mamba_proj_bias=False,
    ssm_state_size=128, conv_kernel=4, n_groups=8, mlp_bias=False, layer_norm_epsilon=1e-5,
    use_bias=False, use_conv_bias=True, moe_intermediate_size=1856,
    moe_shared_expert_intermediate_size=3712, n_group=1, n_routed_experts=128,
    n_shared_experts=1, topk_group=1, num_experts_per_tok=6, norm_topk_prob=True,
    routed_scaling_factor=2.5)

#: The GPU group's models, at their real sizes (the device script cuts the layers:
#: :data:`GPU_LAYERS`).
GPU_MODELS = {s.name: s for s in (
    ModelSpec("llama3_8b_q4", _LLAMA3_8B, bits=4, what="Llama-3-8B 4-bit"),
    ModelSpec("qwen3_30b_a3b_q4", _QWEN3_30B_A3B, bits=4, what="Qwen3-30B-A3B 4-bit"),
    ModelSpec("gemma3_12b_q4", _GEMMA3_12B, bits=4, what="Gemma-3-12B 4-bit"),
    ModelSpec("llama3_8b_q8", _LLAMA3_8B, bits=8, what="Llama-3-8B 8-bit"),
    ModelSpec("llama3_8b_bf16", _LLAMA3_8B, bits=None, what="Llama-3-8B bf16"),
    ModelSpec("qwen35_35b_a3b_q4", _QWEN35_35B_A3B, bits=4, what="Qwen3.5-35B-A3B 4-bit"),
    ModelSpec("gpt_oss_20b_mxfp4", _GPT_OSS_20B, bits=4, group_size=32, mode="mxfp4",
              what="gpt-oss-20b MXFP4"),
    ModelSpec("nemotron3_nano_q4", _NEMOTRON3_NANO, bits=4, what="Nemotron-3-Nano-30B-A3B 4-bit"),
)}

#: The prompt lengths of each GPU model (all of :data:`GPU_PROMPTS` for the 4-bit llama, the
#: middle ones for the others): what fits one device call.
GPU_PLAN = {"llama3_8b_q4": GPU_PROMPTS, "qwen3_30b_a3b_q4": (2240, 8192),
            "gemma3_12b_q4": (2240, 8192), "llama3_8b_q8": (2240,), "llama3_8b_bf16": (2240,),
            "qwen35_35b_a3b_q4": (2240, 8192, 32768), "gpt_oss_20b_mxfp4": (2240, 8192, 32768),
            "nemotron3_nano_q4": (2240, 8192)}

# The small models' vocabulary is the default model's tokenizer's (49152): the prompts' ids and
# the sampled ones decode.
_SMALL_LLAMA = dict(model_type="llama", hidden_size=512, num_hidden_layers=4,
                    intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                    rms_norm_eps=1e-5, vocab_size=49152, rope_theta=10000.0,
                    tie_word_embeddings=False)
_SMALL_QWEN3_MOE = {**_QWEN3_30B_A3B, "hidden_size": 512, "num_hidden_layers": 2,
                    "intermediate_size": 1536, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16,
                    "num_experts_per_tok": 4, "moe_intermediate_size": 256,
                    "vocab_size": 49152, "max_position_embeddings": 4096}
# One sliding-window layer (window 64, shorter than the prompts) and one global layer.
_SMALL_GEMMA3 = dict(model_type="gemma3_text", hidden_size=512, num_hidden_layers=2,
                     intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=128, rms_norm_eps=1e-6, vocab_size=49152, rope_theta=1000000.0,
                     rope_local_base_freq=10000.0, query_pre_attn_scalar=128, sliding_window=64,
                     sliding_window_pattern=2, max_position_embeddings=4096)

#: The CPU group's models: float16 activations with 4-bit gs64 weights (the user-path script's), and
#: an unquantized bfloat16 llama.
CPU_MODELS = {s.name: s for s in (
    ModelSpec("small_llama_q4", _SMALL_LLAMA, dtype="float16", bits=4,
              what="small llama (the user-path script's)"),
    ModelSpec("small_qwen3_moe_q4", _SMALL_QWEN3_MOE, dtype="float16", bits=4,
              what="small qwen3_moe (16 experts, top-4)"),
    ModelSpec("small_gemma3_q4", _SMALL_GEMMA3, dtype="float16", bits=4,
              what="small gemma3 (one window-64 layer, one global)"),
    ModelSpec("small_llama_bf16", _SMALL_LLAMA, dtype="bfloat16", bits=None,
              what="small llama, unquantized bfloat16 (the CPU's BLAS products)"),
)}

#: The smallest model (the test's): 2 layers, hidden 64.
TINY_LLAMA = ModelSpec("tiny_llama_q4", {**_SMALL_LLAMA, "hidden_size": 64,
                                         "num_hidden_layers": 2, "intermediate_size": 128,
                                         "num_attention_heads": 2, "num_key_value_heads": 1},
                       dtype="float16", bits=4, what="tiny llama")


# --- model directories --------------------------------------------------------------------------

def tokenizer_files(src: str | os.PathLike) -> list[Path]:
    """The tokenizer files of a model directory (``tokenizer*``, ``special*``,
    ``chat_template*``).

    Raises:
        FileNotFoundError: ``src`` holds no ``tokenizer_config.json``.
    """
    src = Path(src)
    if not (src / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"tokenizer: {src} has no tokenizer_config.json")
    return sorted(p for p in src.iterdir()
                  if p.is_file() and p.name.startswith(("tokenizer", "special", "chat_template")))


def default_tokenizer_dir() -> Path:
    """The default model's directory (``mlx_bricks.default_model()``): its tokenizer files go
    beside the random weights."""
    from mlx_bricks import default_model

    return Path(default_model())


def write_model(spec: ModelSpec, path: str | os.PathLike, tokenizer: str | os.PathLike,
                *, seed: int = 0) -> dict:
    """Write an mlx-lm model directory with random weights.

    mlx-lm's own model class of ``spec.config`` with its own initialisation (lazy), cast to
    ``spec.dtype``, quantized by ``mlx_lm.utils.quantize_model`` (what ``mlx_lm.convert -q``
    does: every layer with ``to_quantized`` whose input size the group size divides, the
    model's own ``quant_predicate``, e.g. qwen3_moe's 8-bit router) when ``spec.bits``, evaluated
    one layer at a time (a full-size model's float weights never all exist at once); the LM
    head's rows past the tokenizer's vocabulary are zero (greedy decoding then picks ids the
    tokenizer prints); saved with
    ``mlx_lm.utils.save_model`` / ``save_config`` (``config.json`` with ``"quantization"``);
    the tokenizer files of ``tokenizer`` are copied beside.

    Args:
        spec: the model.
        path: the directory (created; must not hold a model already).
        tokenizer: a model directory to take the tokenizer files from.
        seed: ``mx.random.seed`` before the weights are drawn.

    Returns:
        ``{"path", "bytes" (weight files), "write_s"}``.

    Raises:
        FileExistsError: ``path`` already holds a ``config.json``.
        FileNotFoundError: ``tokenizer`` holds no tokenizer.
    """
    import mlx.core as mx
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    t0 = time.perf_counter()
    path = Path(path)
    if (path / "config.json").exists():
        raise FileExistsError(f"path: {path} already holds a model")
    files = tokenizer_files(tokenizer)
    config = dict(spec.config)
    Model, Args = _get_classes(config)
    mx.random.seed(seed)
    model = Model(Args.from_dict(config))
    if config["model_type"] == "gemma3_text":  # tied: the checkpoint has no lm_head
        model.pop("lm_head")
    # mlx-lm decodes greedily: a random LM head's argmax can sit on an id the tokenizer has no
    # text for (the real vocabularies are larger than the default tokenizer's), and generate
    # then prints no figures. Rows past the tokenizer give logit 0 instead; the GEMM's cost is
    # the same.
    words = _load_tokenizer(tokenizer).vocab_size
    lm = model.language_model if "language_model" in model else model  # qwen3_5 nests it
    head = lm["lm_head"] if "lm_head" in lm else lm.model.embed_tokens
    if head.weight.shape[0] > words:
        w = head.weight
        head.weight = mx.concatenate([w[:words], mx.zeros((w.shape[0] - words, w.shape[1]),
                                                          dtype=w.dtype)])
    model.set_dtype(getattr(mx, spec.dtype))
    if spec.bits is not None:
        model, config = quantize_model(model, config, spec.group_size, spec.bits, spec.mode)
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    for f in files:
        shutil.copy(f, path / f.name)
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    del model
    mx.clear_cache()
    return {"path": str(path), "bytes": size, "write_s": time.perf_counter() - t0}


# --- prompts ------------------------------------------------------------------------------------

def _load_tokenizer(model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(Path(model_dir))


def generate_prompt_tokens(tokenizer, text: str) -> int:
    """Tokens ``mlx_lm.generate`` prefills for ``--prompt text`` (mlx-lm 0.32's ``main``: the
    chat template with the generation prompt where the tokenizer has one, then ``encode``
    without special tokens; else ``encode`` with them)."""
    if tokenizer.has_chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return len(tokenizer.encode(text, add_special_tokens=False))
    return len(tokenizer.encode(text, add_special_tokens=True))


def make_prompt(tokenizer, tokens: int, count=generate_prompt_tokens) -> str:
    """A prompt text that ``mlx_lm.generate`` turns into exactly ``tokens`` tokens (chat
    template included): space-separated common words, their number corrected until the
    measured count is exact. ``count(tokenizer, text)``: the tokens a text makes (default:
    ``mlx_lm.generate``'s prompt; the server bench counts a whole conversation).

    Raises:
        ValueError: ``tokens`` is below the chat template's own tokens + 1, or no word count
            gives it exactly.
    """
    words = [w for w in _WORDS if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
    if len(words) < 8:
        raise ValueError("tokenizer: fewer than 8 of the prompt words are one token each")

    def text(n):
        return " ".join(words[i % len(words)] for i in range(n))

    base = count(tokenizer, text(1)) - 1
    if tokens < base + 1:
        raise ValueError(f"tokens must be at least {base + 1} (the chat template takes {base}), "
                         f"got {tokens}")
    n = tokens - base
    tried = set()
    while n not in tried and n >= 1:
        tried.add(n)
        got = count(tokenizer, text(n))
        if got == tokens:
            return text(n)
        n += tokens - got
    raise ValueError(f"tokens: no prompt of these words gives exactly {tokens} tokens")


def prefill_chunks(tokens: int, step: int = PREFILL_STEP) -> list[int]:
    """The model calls of mlx-lm 0.32's prompt phase for a ``tokens``-token prompt: chunks of
    ``step`` while more than one token is left (the tail chunk included), then the last token
    with the first generation step."""
    chunks, left = [], tokens
    while left > 1:
        n = min(step, left - 1)
        chunks.append(n)
        left -= n
    return chunks + [left]
