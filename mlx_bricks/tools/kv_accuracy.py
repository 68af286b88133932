"""Cost of Q8_0 K/V in a real model: KL divergence and top-1 agreement of next-token
distributions, Q8_0 cache vs float cache, as llama.cpp's ``perplexity --kl-divergence`` reports.

    python -m mlx_bricks.tools.kv_accuracy [--model DIR] [--tokens 1536] [--text FILE]
                                           [--chunk 512] [--backend reference] [--out FILE]

The text is tokenized and cut to ``--tokens`` tokens, then run through the model in prefill
chunks of ``--chunk`` tokens (so attention meets Lk > Lq, as in generation) three times:

* ``fp32``: weights and cache in float32 (the reference for the float16 noise floor);
* ``fp16``: the model as loaded (float16), mlx-lm's ``KVCache``;
* ``q8_0``: the same model with :class:`mlx_bricks.cache.Q8KVCache` on every layer, attention
  through :mod:`mlx_bricks.tools.kv_driver` (K/V quantized once on append; each query attends
  over the Q8_0 K/V of every earlier token and its own, as in decode).

For every position it computes ``KL(P_fp16 || P_q8_0)`` (nats) and whether the argmax agrees,
and the same for ``fp32`` against each. Default text: the repository's README.md followed by
docs/bricks.md (English prose with some tables and code: the project's own text, so the
measurement needs nothing else); default model: ``mlx_bricks.default_model()``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TEXTS = (ROOT / "README.md", ROOT / "docs" / "bricks.md")


def _versions() -> dict:
    import mlx.core as mx
    from importlib.metadata import version

    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"mlx": mx.__version__, "mlx_lm": version("mlx-lm"),
            "mlx_bricks": version("mlx-bricks"), "commit": commit,
            "python": platform.python_version(), "machine": platform.platform()}


def run_logits(model, tokens, cache, chunk: int):
    """Logits (L, vocab) float32 of ``tokens`` fed through ``cache`` in chunks (Q8_0 layers
    attend on their cache's backend)."""
    import mlx.core as mx

    from mlx_bricks.tools.kv_driver import q8_0_attention

    outs = []
    with q8_0_attention(model):
        for lo in range(0, len(tokens), chunk):
            logits = model(mx.array([tokens[lo:lo + chunk]]), cache=cache)[0]
            logits = logits.astype(mx.float32)
            mx.eval(logits, [c.state for c in cache])
            outs.append(logits)
    return mx.concatenate(outs, axis=0)


def compare(ref, other) -> dict:
    """KL(softmax(ref) || softmax(other)) per position (nats, float32 log-softmax) and top-1
    agreement, summarised."""
    import mlx.core as mx
    import numpy as np

    lp = ref - mx.logsumexp(ref, axis=-1, keepdims=True)
    lq = other - mx.logsumexp(other, axis=-1, keepdims=True)
    kld = mx.sum(mx.exp(lp) * (lp - lq), axis=-1)
    top1 = mx.argmax(ref, axis=-1) == mx.argmax(other, axis=-1)
    kld, top1 = np.array(kld).astype(np.float64), np.array(top1)
    return {"mean_kld": float(kld.mean()), "median_kld": float(np.median(kld)),
            "p99_kld": float(np.quantile(kld, 0.99)), "max_kld": float(kld.max()),
            "top1_agreement": float(top1.mean()), "positions": int(kld.size)}


def measure(model_dir: str | None = None, n_tokens: int = 1536, text_path: str | None = None,
            chunk: int = 512, backend: str | None = "reference") -> dict:
    """Run the three passes and return the JSON-ready result (see the module docstring).

    Raises:
        ValueError: the text has fewer than ``n_tokens`` tokens, or n_tokens/chunk < 1.
    """
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache as stock_cache

    import mlx_bricks
    from mlx_bricks.cache import make_prompt_cache

    if n_tokens < 1 or chunk < 1:
        raise ValueError(f"--tokens and --chunk must be >= 1, got {n_tokens}, {chunk}")
    versions = _versions()  # before the run: the commit that runs
    model_dir = str(model_dir or mlx_bricks.default_model())
    paths = [Path(text_path)] if text_path else list(DEFAULT_TEXTS)
    model, tokenizer = load(model_dir)
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
    tokens = tokenizer.encode(text)
    if len(tokens) < n_tokens:
        raise ValueError(f"the text has {len(tokens)} tokens, fewer than --tokens {n_tokens}")
    tokens = tokens[:n_tokens]
    dtype = model.layers[0].self_attn.q_proj.weight.dtype

    fp16 = run_logits(model, tokens, stock_cache(model), chunk)
    q8 = run_logits(model, tokens, make_prompt_cache(model, "q8_0", backend=backend), chunk)
    model.set_dtype(mx.float32)
    fp32 = run_logits(model, tokens, stock_cache(model), chunk)

    return {
        "what": "next-token distributions: Q8_0 KV cache vs float KV cache (KL in nats)",
        "date": datetime.date.today().isoformat(),
        "versions": versions,
        "model": model_dir, "model_dtype": str(dtype).replace("mlx.core.", ""),
        "text": [str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p in paths],
        "tokens": n_tokens, "prefill_chunk": chunk, "backend": backend,
        "q8_0_vs_fp16": compare(fp16, q8),
        "fp16_vs_fp32": compare(fp32, fp16),
        "q8_0_vs_fp32": compare(fp32, q8),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlx_bricks.tools.kv_accuracy",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="mlx-lm model directory (default: the "
                   "embedded default model)")
    p.add_argument("--tokens", type=int, default=1536, help="tokens of text (default 1536)")
    p.add_argument("--text", default=None,
                   help="text file (default: README.md then docs/bricks.md of the repository)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--backend", default="reference",
                   help="bricks backend of the Q8_0 attention (default reference)")
    p.add_argument("--out", default=None, help="write the JSON here too")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    result = measure(args.model, args.tokens, args.text, args.chunk, args.backend)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
