"""The user's path as the benchmark of record (issue 33): mlx-lm's own CLIs in fresh processes.

Users run ``mlx_lm.generate`` with one prompt per process, or a long-lived server; the other
benchmarks time warm forwards in one process. This one writes model directories with random
weights (mlx-lm's model classes, ``mlx_lm.utils.quantize_model`` as ``mlx_lm.convert`` does it,
``config.json`` with ``"quantization"``, the default model's tokenizer files beside) and runs, per
model and prompt length P, each in a fresh process:

- ``stock``: ``python -m mlx_lm generate --model DIR --prompt - --max-tokens G`` with a prompt
  of exactly P tokens after mlx-lm's chat template (built from the tokenizer, read from stdin);
- ``cold``: the same with ``--use-bricks`` and ``MLX_BRICKS_HOME`` an empty directory of this
  model's (no decisions cached, nothing built): the model's first ``--use-bricks`` run. The
  home is kept across the model's prompt lengths, as a user's is: the first ``--use-bricks``
  run of a later, longer prompt is ``first`` (it finds the decisions of the shorter prompts'
  chunks; ``home_files_before`` says how many files the home held);
- ``cached``: the same again, same home;
- ``long_stock`` / ``long``: ``python -m mlx_lm benchmark -p P -g G -n TRIALS`` without and
  with ``--use-bricks`` (same home): one warm-up generation, then TRIALS timed ones in the same
  process, as a long-lived server sees them.

Every run uses mlx-lm's default ``prefill_step_size`` (2048; a prompt of P tokens is prefilled in
chunks of 2048 and a tail, ``prefill_chunks``). From what the CLIs print (``Prompt: N tokens, X
tokens-per-sec``, ``Generation: ...``, ``Peak memory: ...``; the benchmark's ``Trial i: ...``
lines) each run records: ``prompt_tokens``, ``prompt_tps``, ``generation_tokens``,
``generation_tps``, ``peak_memory_gb``, ``ttft_s`` (the prompt phase as mlx-lm times it: prompt
tokens / prompt tok/s, from the call to the first token), ``load_s`` (process start to the CLI's
first line after loading the model, and patching it: ``==========`` of generate, ``Running
warmup..`` of benchmark; stdout unbuffered), ``start_to_first_token_s`` (``load_s + ttft_s``:
what a user waits from the command to the first token), ``wall_s`` (the whole process), and the
``[mlx-bricks]`` line of stderr (``bricks_line``). ``ratios`` hold patched / stock of the same
prompt, measured in the same run: ``prompt_tps``, ``generation_tps``, ``peak_memory`` (above 1:
more), and stock / patched of ``ttft_s``, ``start_to_first_token_s`` and ``wall_s`` (above 1:
the patched run is faster).

Groups of ``python -m mlx_bricks.bench``: ``user_path_cpu`` (small models, backend ``cpu``: runs
where no kernel backend exists) and ``user_path_gpu`` (Llama-3-8B bf16 / 4-bit / 8-bit,
Qwen3-30B-A3B 4-bit, Gemma-3-12B 4-bit layer shapes on a kernel backend); neither runs unless
named. The GPU machine's script is this module's CLI (``python -m mlx_bricks.bench.user_path
--help``; docs/bench.md, "The user's path"), which writes the JSON, one log per process and a
plot into ``--out-dir``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from mlx_bricks.bench.case import CPU, KERNEL, Benchmark

#: mlx-lm's ``prefill_step_size`` default (``mlx_lm.generate.DEFAULT_PREFILL_STEP_SIZE`` and
#: ``mlx_lm.benchmark``'s ``--prefill-step-size``); the runs leave it at the default, this only
#: describes the chunks in the JSON.
PREFILL_STEP = 2048
#: Prompt lengths of the GPU group (tokens) and of the CPU group.
GPU_PROMPTS = (512, 2240, 8192, 32768)
CPU_PROMPTS = (128, 512)
#: Decoder layers of the GPU group's models in the device script (``--full-size``: the models'
#: own 32 / 48): one call of at most 10 minutes writes and runs them all.
GPU_LAYERS = 8
#: Generated tokens per run (``--max-tokens`` of generate, ``-g`` of benchmark).
GPU_MAX_TOKENS = 32
CPU_MAX_TOKENS = 8
#: Seconds a single CLI process may take before it is stopped (its run records the timeout).
RUN_TIMEOUT_S = 1800
#: Run kinds, in the order they run for one prompt (``first`` is ``cold`` while the model's
#: home is still empty).
KINDS = ("stock", "first", "cached", "long_stock", "long")
_ALL_KINDS = (*KINDS, "cold")

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
)}

#: The prompt lengths of each GPU model (all of :data:`GPU_PROMPTS` for the 4-bit llama, the
#: middle ones for the others): what fits one device call.
GPU_PLAN = {"llama3_8b_q4": GPU_PROMPTS, "qwen3_30b_a3b_q4": (2240, 8192),
            "gemma3_12b_q4": (2240, 8192), "llama3_8b_q8": (2240,), "llama3_8b_bf16": (2240,),
            "qwen35_35b_a3b_q4": (2240, 8192, 32768), "gpt_oss_20b_mxfp4": (2240, 8192, 32768)}

# The small models' vocabulary is the default model's tokenizer's (49152): the prompts' ids and
# the sampled ones decode.
_SMALL_LLAMA = dict(model_type="llama", hidden_size=512, num_hidden_layers=4,
                    intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                    rms_norm_eps=1e-5, vocab_size=49152, rope_theta=10000.0,
                    tie_word_embeddings=False)
_SMALL_QWEN3_MOE = dict(model_type="qwen3_moe", hidden_size=512, num_hidden_layers=2,
                        intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                        head_dim=64, num_experts=16, num_experts_per_tok=4,
                        moe_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[],
                        norm_topk_prob=True, rms_norm_eps=1e-6, vocab_size=49152,
                        rope_theta=1000000.0, max_position_embeddings=4096,
                        tie_word_embeddings=False)
# One sliding-window layer (window 64, shorter than the prompts) and one global layer.
_SMALL_GEMMA3 = dict(model_type="gemma3_text", hidden_size=512, num_hidden_layers=2,
                     intermediate_size=1536, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=128, rms_norm_eps=1e-6, vocab_size=49152, rope_theta=1000000.0,
                     rope_local_base_freq=10000.0, query_pre_attn_scalar=128, sliding_window=64,
                     sliding_window_pattern=2, max_position_embeddings=4096)

#: The CPU group's models: float16 activations, 4-bit gs64 weights (the user-path script's).
CPU_MODELS = {s.name: s for s in (
    ModelSpec("small_llama_q4", _SMALL_LLAMA, dtype="float16", bits=4,
              what="small llama (the user-path script's)"),
    ModelSpec("small_qwen3_moe_q4", _SMALL_QWEN3_MOE, dtype="float16", bits=4,
              what="small qwen3_moe (16 experts, top-4)"),
    ModelSpec("small_gemma3_q4", _SMALL_GEMMA3, dtype="float16", bits=4,
              what="small gemma3 (one window-64 layer, one global)"),
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


# --- one process --------------------------------------------------------------------------------

_GEN_RE = {
    "prompt": re.compile(r"^Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", re.M),
    "generation": re.compile(r"^Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", re.M),
    "peak": re.compile(r"^Peak memory: ([\d.]+) GB", re.M),
}
_TRIAL_RE = re.compile(r"^Trial (\d+):\s+prompt_tps=([\d.]+), generation_tps=([\d.]+), "
                       r"peak_memory=([\d.]+), total_time=([\d.]+)", re.M)
#: The line each CLI prints once the model is loaded (and patched), before the prompt phase.
LOADED_MARK = {"generate": "==========", "benchmark": "Running warmup.."}


def parse_generate(stdout: str) -> dict:
    """The figures ``mlx_lm.generate`` prints (``Prompt: N tokens, X tokens-per-sec``,
    ``Generation: ...``, ``Peak memory: Y GB``).

    Raises:
        ValueError: one of the three lines is missing.
    """
    found = {k: r.search(stdout) for k, r in _GEN_RE.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise ValueError(f"stdout: no {', '.join(missing)} line in mlx_lm.generate's output")
    p, g, m = found["prompt"], found["generation"], found["peak"]
    return {"prompt_tokens": int(p[1]), "prompt_tps": float(p[2]),
            "generation_tokens": int(g[1]), "generation_tps": float(g[2]),
            "peak_memory_gb": float(m[1])}


def parse_benchmark(stdout: str, prompt_tokens: int, generation_tokens: int) -> dict:
    """The trials ``mlx_lm.benchmark`` prints (``Trial i: prompt_tps=..., generation_tps=...,
    peak_memory=..., total_time=...``), with their medians as the run's figures.

    Raises:
        ValueError: no trial line.
    """
    trials = [{"prompt_tps": float(t[2]), "generation_tps": float(t[3]),
               "peak_memory_gb": float(t[4]), "total_time_s": float(t[5])}
              for t in _TRIAL_RE.finditer(stdout)]
    if not trials:
        raise ValueError("stdout: no Trial line in mlx_lm.benchmark's output")

    def med(k):
        return statistics.median(t[k] for t in trials)

    return {"prompt_tokens": prompt_tokens, "prompt_tps": med("prompt_tps"),
            "generation_tokens": generation_tokens, "generation_tps": med("generation_tps"),
            "peak_memory_gb": max(t["peak_memory_gb"] for t in trials), "trials": trials}


def _child_env(home: Path) -> dict:
    env = dict(os.environ)
    env["MLX_BRICKS_HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"  # the loaded-mark line arrives when it is printed
    # the child imports this mlx_bricks, wherever the parent found it
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([*parts, root])
    return env


def run_cli(argv: list[str], *, env: dict, stdin: str | None = None, mark: str | None = None,
            timeout: float = RUN_TIMEOUT_S) -> dict:
    """Run ``argv`` in a fresh process; its stdout and stderr, return code, wall seconds, and
    the seconds from the start to the first stdout line equal to ``mark`` (None if absent).
    A process past ``timeout`` seconds is killed (``timed_out``)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    out, err, seen = [], [], {}

    def read_out():
        for line in proc.stdout:
            if mark is not None and "mark" not in seen and line.rstrip("\n") == mark:
                seen["mark"] = time.perf_counter() - t0
            out.append(line)

    def read_err():
        err.extend(proc.stderr)

    threads = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for t in threads:
        t.start()
    try:
        if stdin is not None:
            proc.stdin.write(stdin)
        proc.stdin.close()
    except BrokenPipeError:  # the process ended before reading its prompt: its stderr says why
        pass
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        proc.wait()
    for t in threads:
        t.join()
    return {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
            "mark_s": seen.get("mark"), "stdout": "".join(out), "stderr": "".join(err),
            "timed_out": timed_out}


def _load() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (a shared CPU slows one process and not the next:
    fresh-process runs are not interleaved), where the OS has them."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _home_files(home: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(home)) if home.exists() else 0


def run_one(kind: str, model_dir: Path, home: Path, prompt_tokens: int, prompt_text: str,
            max_tokens: int, trials: int, log_dir: Path | None = None,
            timeout: float = RUN_TIMEOUT_S) -> dict:
    """One run (``kind`` of :data:`KINDS`, or ``cold``) in a fresh process, as its JSON entry
    (module docstring); a failed run has ``error`` (the return code and stderr's last lines)
    instead of the figures. A process killed by a signal (not the timeout) is run once more; the
    first one's end is kept in ``retried``.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in _ALL_KINDS:
        raise ValueError(f"kind must be one of {_ALL_KINDS}, got {kind!r}")
    bricks = kind not in ("stock", "long_stock")
    long_lived = kind.startswith("long")
    cli = "benchmark" if long_lived else "generate"
    argv = [sys.executable, "-m", "mlx_lm", cli, "--model", str(model_dir)]
    if long_lived:
        argv += ["-p", str(prompt_tokens), "-g", str(max_tokens), "-n", str(trials)]
    else:
        argv += ["--prompt", "-", "--max-tokens", str(max_tokens)]
    if bricks:
        argv.append("--use-bricks")
    entry = {"kind": kind, "cli": f"mlx_lm.{cli}", "bricks": bricks,
             "argv": [Path(argv[0]).name, *argv[1:]], "home_files_before": _home_files(home),
             "load_average": {"before": _load()}}
    home.mkdir(parents=True, exist_ok=True)

    def launch():
        return run_cli(argv, env=_child_env(home), stdin=None if long_lived else prompt_text,
                       mark=LOADED_MARK[cli], timeout=timeout)

    r = launch()
    if r["returncode"] < 0 and not r["timed_out"]:
        # Killed by a signal (once in ~1,400 CPU runs here: glibc's heap check aborting, after the
        # CLI had printed its figures): run it once more and keep the first run's end in
        # ``retried`` (a retried cold run finds what the first one wrote: ``home_files_before``).
        entry["retried"] = {"returncode": r["returncode"],
                            "stderr_tail": r["stderr"].strip().splitlines()[-5:],
                            "wall_s": r["wall_s"]}
        entry["home_files_before"] = _home_files(home)
        r = launch()
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{model_dir.name}_p{prompt_tokens}_{kind}.log").write_text(
            f"$ {' '.join(entry['argv'])}\n--- stdout\n{r['stdout']}\n--- stderr\n{r['stderr']}")
    lines = [ln for ln in r["stderr"].splitlines() if ln.startswith("[mlx-bricks]")]
    entry["load_average"]["after"] = _load()
    entry.update(wall_s=r["wall_s"], load_s=r["mark_s"], bricks_line=lines[0] if lines else None)
    try:
        if r["returncode"] != 0:
            raise ValueError(f"exit {r['returncode']}" + (" (timed out)" if r["timed_out"] else ""))
        figures = (parse_benchmark(r["stdout"], prompt_tokens, max_tokens) if long_lived
                   else parse_generate(r["stdout"]))
    except ValueError as e:
        tail = r["stderr"].strip().splitlines()[-5:]
        entry["error"] = f"{e}; stderr: {' | '.join(tail)}"[:2000]
        return entry
    entry.update(figures)
    entry["ttft_s"] = entry["prompt_tokens"] / entry["prompt_tps"]
    # a long-lived run's timed prompts come after its warm-up: no first token of the process
    entry["start_to_first_token_s"] = (None if entry["load_s"] is None or long_lived
                                       else entry["load_s"] + entry["ttft_s"])
    return entry


def ratios(stock: dict, patched: dict) -> dict | None:
    """Patched vs stock of one prompt (module docstring); None where either run failed."""
    if "error" in stock or "error" in patched:
        return None

    def div(a, b):
        return None if a is None or b is None or b == 0 else a / b

    return {"prompt_tps": div(patched["prompt_tps"], stock["prompt_tps"]),
            "generation_tps": div(patched["generation_tps"], stock["generation_tps"]),
            "peak_memory": div(patched["peak_memory_gb"], stock["peak_memory_gb"]),
            "ttft_s": div(stock["ttft_s"], patched["ttft_s"]),
            "start_to_first_token_s": div(stock["start_to_first_token_s"],
                                          patched["start_to_first_token_s"]),
            "wall_s": div(stock["wall_s"], patched["wall_s"])}


# --- one model ----------------------------------------------------------------------------------

def run_model(spec: ModelSpec, prompts, *, max_tokens: int, trials: int, work: Path,
              tokenizer: Path | None = None, log_dir: Path | None = None,
              deadline: float | None = None, keep: bool = False, on_run=None) -> dict:
    """Write ``spec``'s directory under ``work`` and run every kind of :data:`KINDS` for each
    prompt length of ``prompts`` (ascending), all with one ``MLX_BRICKS_HOME``
    (``work/<name>-home``, empty at the start: the first ``--use-bricks`` run is ``cold``).

    Args:
        spec: the model.
        prompts: prompt lengths in tokens.
        max_tokens: generated tokens per run.
        trials: the long-lived runs' timed trials.
        work: a directory for the model and its home (created).
        tokenizer: a model directory with the tokenizer (default: the default model's).
        log_dir: where each process's stdout and stderr are written (None: nowhere).
        deadline: ``time.monotonic()`` value after which no further run starts (the runs left
            are listed with ``skipped``); a run still going a minute after it is stopped.
        keep: keep the model directory (default: removed at the end; full-size ones are GBs).
        on_run: ``(entry)`` called after each run with the model's entry so far.

    Returns:
        ``{"model": ..., "prefill_step_size", "prompts": [{"tokens", "prefill_chunks", "runs":
        [...], "ratios": {kind: ...}}], "written": ...}``.

    Raises:
        ValueError: an empty or non-positive prompt length, ``max_tokens`` or ``trials`` < 1.
    """
    prompts = sorted(prompts)
    if not prompts or any(isinstance(p, bool) or not isinstance(p, int) or p < 2
                          for p in prompts):
        raise ValueError(f"prompts must be ints >= 2, got {prompts!r}")
    for name, v in (("max_tokens", max_tokens), ("trials", trials)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    work = Path(work)
    model_dir, home = work / spec.name, work / f"{spec.name}-home"
    if home.exists():
        shutil.rmtree(home)
    tokenizer = Path(tokenizer) if tokenizer is not None else default_tokenizer_dir()
    entry = {"model": {"name": spec.name, "what": spec.describe(), "config": spec.config,
                       "dtype": spec.dtype, "bits": spec.bits, "group_size": spec.group_size,
                       "mode": spec.mode},
             "prefill_step_size": PREFILL_STEP, "max_tokens": max_tokens, "trials": trials,
             "prompts": []}
    try:
        entry["written"] = write_model(spec, model_dir, tokenizer)
        tok = _load_tokenizer(model_dir)
        first = True
        for p in prompts:
            text = make_prompt(tok, p)
            item = {"tokens": p, "prefill_chunks": prefill_chunks(p), "runs": []}
            entry["prompts"].append(item)
            for kind in KINDS:
                if deadline is not None and time.monotonic() > deadline:
                    item["runs"].append({"kind": kind, "skipped": "time budget spent"})
                    continue
                timeout = (RUN_TIMEOUT_S if deadline is None
                           else min(RUN_TIMEOUT_S, max(60.0, deadline - time.monotonic() + 60)))
                label = "cold" if kind == "first" and first else kind
                run = run_one(label, model_dir, home, p, text, max_tokens, trials, log_dir,
                              timeout)
                if kind == "first":  # a failed cold run leaves the next prompt's cold
                    first = first and "error" in run
                item["runs"].append(run)
                if on_run is not None:
                    on_run(entry)
            by = {r["kind"]: r for r in item["runs"] if "skipped" not in r}
            item["ratios"] = {}
            for k, base in (("cold", "stock"), ("first", "stock"), ("cached", "stock"),
                            ("long", "long_stock")):
                if k in by and base in by:
                    item["ratios"][k] = ratios(by[base], by[k])
    finally:
        if not keep:
            shutil.rmtree(model_dir, ignore_errors=True)
    return entry


# --- the bench groups ---------------------------------------------------------------------------

def _work_dir() -> Path:
    """Where ``python -m mlx_bricks.bench`` writes the model directories:
    ``$MLX_BRICKS_BENCH_WORK`` if set, else a new temporary directory."""
    base = os.environ.get("MLX_BRICKS_BENCH_WORK")
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="user-path-", dir=base))
    return Path(tempfile.mkdtemp(prefix="mlx-bricks-user-path-"))


def _bench_run(spec: ModelSpec, prompts, max_tokens: int):
    def run(repeats: int) -> dict:
        work = _work_dir()
        try:
            return run_model(spec, prompts, max_tokens=max_tokens, trials=repeats, work=work)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return run


def benchmarks() -> dict[str, Benchmark]:
    """The user's-path benchmarks by name (``user_path_{cpu,gpu}_<model>``), for
    ``bench.core``: each runs one model over its group's prompt lengths; ``--repeats`` is the
    long-lived runs' trial count."""
    table = {}
    for group, backend, models, prompts, max_tokens in (
            ("cpu", CPU, CPU_MODELS, CPU_PROMPTS, CPU_MAX_TOKENS),
            ("gpu", KERNEL, GPU_MODELS, GPU_PROMPTS, GPU_MAX_TOKENS)):
        for spec in models.values():
            if group == "gpu":
                prompts = GPU_PLAN[spec.name]
            name = f"user_path_{group}_{spec.name}"
            table[name] = Benchmark(
                name, backend,
                f"the user's path: mlx-lm's generate (stock, --use-bricks cold, cached) and "
                f"benchmark (long-lived) in fresh processes, prompts of "
                f"{', '.join(map(str, prompts))} tokens, {max_tokens} generated; "
                f"{spec.describe()}, random weights",
                None, run=_bench_run(spec, prompts, max_tokens))
    return table


# --- tables and plot ----------------------------------------------------------------------------

def table_rows(doc: dict) -> list[dict]:
    """One row per run of a user-path document (the CLI's JSON or a bench result entry's
    ``models``): model, prompt tokens, kind, and the figures."""
    rows = []
    for m in doc["models"]:
        for item in m.get("prompts", []):
            for r in item["runs"]:
                rows.append({"model": m["model"]["name"], "tokens": item["tokens"], **r})
    return rows


def format_table(doc: dict) -> str:
    """A Markdown table of a user-path document: per run, TTFT, start to first token, prompt
    and generation tok/s, peak memory, wall, and the prompt tok/s ratio vs stock."""
    head = ("| model | prompt | run | TTFT s | start->1st token s | prompt tok/s | gen tok/s | "
            "peak GB | wall s | prompt x stock |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    ratio_of = {}
    for m in doc["models"]:
        for item in m.get("prompts", []):
            for k, r in item.get("ratios", {}).items():
                ratio_of[(m["model"]["name"], item["tokens"], k)] = r

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in table_rows(doc):
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or r.get("error", "")[:80]
            lines.append(f"| {r['model']} | {r['tokens']} | {r['kind']} | {why} |||||||")
            continue
        rat = ratio_of.get((r["model"], r["tokens"], r["kind"]))
        kind = r["kind"] + (f" (2nd try: the 1st exited {r['retried']['returncode']})"
                            if "retried" in r else "")
        lines.append(
            f"| {r['model']} | {r['tokens']} | {kind} | {f(r['ttft_s'], '.3f')} | "
            f"{f(r['start_to_first_token_s'], '.2f')} | {f(r['prompt_tps'], '.1f')} | "
            f"{f(r['generation_tps'], '.1f')} | {f(r['peak_memory_gb'], '.3f')} | "
            f"{f(r['wall_s'], '.1f')} | {f(rat and rat['prompt_tps'], '.2f')} |")
    return "\n".join(lines)


def plot(doc: dict, path: str | os.PathLike) -> None:
    """Bar plots of a user-path document, one row per model, bars per run kind over the prompt
    lengths (log scale): prompt tok/s; start to first token of the one-process runs; the
    prompt phase (TTFT as mlx-lm times it) of every run.

    Raises:
        ValueError: no model with measured prompts.
        ModuleNotFoundError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in doc["models"] if m.get("prompts")]
    if not models:
        raise ValueError("doc: no model with measured prompts to plot")
    order = ("stock", "cold", "first", "cached", "long_stock", "long")
    panels = (("prompt_tps", "prompt tok/s"),
              ("start_to_first_token_s", "command start to first token, s"),
              ("ttft_s", "prompt phase (TTFT), s"))
    fig, axes = plt.subplots(len(models), len(panels), figsize=(15, 3.3 * len(models)),
                             squeeze=False)
    for row, m in zip(axes, models):
        items = m["prompts"]
        kinds = [k for k in order if any(r["kind"] == k for it in items for r in it["runs"])]
        width = 0.8 / len(kinds)
        for ax, (key, label) in zip(row, panels):
            for i, k in enumerate(kinds):
                xs, ys = [], []
                for j, item in enumerate(items):
                    for r in item["runs"]:
                        if r["kind"] == k and r.get(key) is not None:
                            xs.append(j + (i - len(kinds) / 2 + 0.5) * width)
                            ys.append(r[key])
                ax.bar(xs, ys, width, label=k, color=f"C{order.index(k)}")
            ax.set_xticks(range(len(items)), [str(it["tokens"]) for it in items])
            ax.set_xlabel("prompt tokens")
            ax.set_yscale("log")
            ax.set_title(f"{m['model']['name']}: {label}", fontsize=9)
        row[0].legend(fontsize=7)
    save_figure(fig, doc, "the user's path: mlx-lm's CLIs in fresh processes, stock vs "
                "--use-bricks", path)


def save_figure(fig, doc: dict, what: str, path) -> None:
    """Title ``fig`` with ``what`` and the document's device, versions and date; save it to
    ``path`` (PNG, 110 dpi) and close it."""
    import matplotlib.pyplot as plt

    fig.suptitle(f"{what}; {doc.get('device', '')}, MLX {doc.get('mlx')}, mlx-lm "
                 f"{doc.get('mlx_lm')}, {doc.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the device script --------------------------------------------------------------------------

def _now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _document(group: str, started: str, models: list) -> dict:
    import platform

    import mlx.core as mx

    info = {k: str(v) for k, v in mx.device_info().items()}
    return {"group": f"user_path_{group}", "date": started, "finished": _now(),
            "device": info.get("device_name") or str(mx.default_device()),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "mlx_device": str(mx.default_device()), "device_info": info},
            "mlx": mx.__version__, "mlx_lm": _version("mlx-lm"),
            "mlx_bricks": _version("mlx-bricks"), "python": platform.python_version(),
            "models": models}


def write_report(doc: dict, stem: Path, format_table, plot) -> str:
    """Write ``stem``.md (``format_table(doc)``) and ``stem``.png (``plot(doc, path)``; a line
    on stderr where it cannot be drawn); return the table."""
    table = format_table(doc)
    stem.with_suffix(".md").write_text(table + "\n")
    try:
        plot(doc, stem.with_suffix(".png"))
    except (ValueError, ModuleNotFoundError) as e:
        print(f"[{stem.name}] no plot: {e}", file=sys.stderr)
    return table


def build_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m mlx_bricks.bench.user_path",
        description="The user's path: mlx-lm's generate and benchmark CLIs in fresh processes, "
        "stock and --use-bricks (cold, cached, long-lived), on random-weight model directories; "
        "JSON, logs and a plot into --out-dir.")
    p.add_argument("--group", choices=("cpu", "gpu"), default="cpu",
                   help="the model set and defaults (default: cpu)")
    p.add_argument("--models", nargs="+", metavar="NAME",
                   help="models of the group, in this order (default: all; cpu: "
                   f"{', '.join(CPU_MODELS)}, {TINY_LLAMA.name}; gpu: {', '.join(GPU_MODELS)})")
    p.add_argument("--prompts", nargs="+", type=int, metavar="TOKENS",
                   help=f"prompt lengths of every model (default: cpu {CPU_PROMPTS}; gpu: per "
                   f"model, {GPU_PLAN})")
    p.add_argument("--layers", type=int, default=None,
                   help=f"decoder layers of every model (default: cpu the model's own, gpu "
                   f"{GPU_LAYERS})")
    p.add_argument("--full-size", action="store_true",
                   help="the models' own layer counts (gpu: 32 / 48 layers; GBs to write)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"generated tokens (default: cpu {CPU_MAX_TOKENS}, gpu {GPU_MAX_TOKENS})")
    p.add_argument("--trials", type=int, default=3, help="long-lived timed trials (default: 3)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no run after this many seconds (the rest are listed as skipped)")
    p.add_argument("--tokenizer", default=None,
                   help="a model directory with the tokenizer files (default: the default "
                   "model's, mlx_bricks.default_model())")
    p.add_argument("--work", default=None,
                   help="where the model directories go (default: a temporary directory; each "
                   "model's is removed after its runs)")
    p.add_argument("--out-dir", required=True,
                   help="writes user_path_<group>.json (after every run), .md, .png and logs/")
    return p


def main(argv=None) -> int:
    """The device script: run a group, write JSON (after every run), a Markdown table, a plot
    and one log per process into ``--out-dir``; print the table."""
    args = build_parser().parse_args(argv)
    known = {**CPU_MODELS, TINY_LLAMA.name: TINY_LLAMA} if args.group == "cpu" else GPU_MODELS
    names = args.models or list(CPU_MODELS if args.group == "cpu" else GPU_MODELS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; known: {', '.join(known)}")
    layers = args.layers
    if layers is None and args.group == "gpu" and not args.full_size:
        layers = GPU_LAYERS
    max_tokens = args.max_tokens or (CPU_MAX_TOKENS if args.group == "cpu" else GPU_MAX_TOKENS)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="user-path-"))
    started = _now()
    models: list = []
    json_path = out / f"user_path_{args.group}.json"

    def write(current=None):
        doc = _document(args.group, started, models + ([current] if current else []))
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
        return doc

    for n in names:
        spec = known[n].with_layers(None if args.full_size else layers)
        prompts = args.prompts or (GPU_PLAN[n] if args.group == "gpu" else CPU_PROMPTS)
        if deadline is not None and time.monotonic() > deadline:
            models.append({"model": {"name": spec.name, "what": spec.describe()},
                           "skipped": "time budget spent"})
            continue
        print(f"[user_path] {spec.describe()}", file=sys.stderr, flush=True)
        models.append(run_model(spec, prompts, max_tokens=max_tokens, trials=args.trials,
                                work=work, tokenizer=args.tokenizer, log_dir=out / "logs",
                                deadline=deadline, on_run=write))
        write()
    table = write_report(write(), out / f"user_path_{args.group}", format_table, plot)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
