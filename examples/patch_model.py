"""Patch an mlx-lm model in Python, generate with it, and print the per-layer report.

    python examples/patch_model.py                       # the embedded default model
    python examples/patch_model.py path/to/mlx-model --backend reference --kv q8_0
"""
from __future__ import annotations

import argparse

from mlx_lm import generate, load

from mlx_bricks.backends import BACKENDS
from mlx_bricks.models import default_model
from mlx_bricks.patch import patch_model, unpatch_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", help="mlx-lm model directory (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--backend", choices=BACKENDS, default=None)
    parser.add_argument("--kv", choices=("none", "q8_0"), default="none")
    parser.add_argument("--prompt", default="Name three primary colours.")
    args = parser.parse_args()

    model, tokenizer = load(args.model or str(default_model()))
    report = patch_model(model, kv_quant=None if args.kv == "none" else args.kv,
                         backend=args.backend)
    print(f"backend: {report.backend}")
    print(f"patched {report.n_patched} modules, {report.n_fallback} left stock")

    prompt = args.prompt
    if tokenizer.has_chat_template:
        messages = [{"role": "user", "content": prompt}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    print(generate(model, tokenizer, prompt, max_tokens=32))

    # The counters are live: the table now says how many prefill calls each brick served.
    print(report)
    unpatch_model(model)  # the same model object, stock again


if __name__ == "__main__":
    main()
