"""Generate with a tensor-parallel (sharded) mlx-lm model whose prefill runs the bricks.

Start one process per rank with MLX's launcher (docs/sharding.md), e.g. two GPUs of one host:

    mlx.launch --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 -- \\
        python examples/sharded_generate.py path/to/mlx-model

or two Macs over TCP: ``mlx.launch --backend ring --hosts IP1,IP2 -- python examples/...``.
"""
from __future__ import annotations

import argparse

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.utils import sharded_load

from mlx_bricks.backends import BACKENDS
from mlx_bricks.patch import patch_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="mlx-lm model directory or Hugging Face repo")
    parser.add_argument("--backend", choices=BACKENDS, default=None)
    parser.add_argument("--prompt", default="Name three primary colours.")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    group = mx.distributed.init()
    # mlx-lm loads lazily and calls model.shard(group): q/k/v, gate/up column-sharded,
    # o/down row-sharded, n_heads / n_kv_heads divided by the group size.
    model, tokenizer = sharded_load(args.model, tensor_group=group)
    report = patch_model(model, backend=args.backend)  # after sharding: per-rank shapes
    rank0 = group.rank() == 0
    if rank0:
        print(f"rank 0 of {group.size()}: backend {report.backend}, patched "
              f"{report.n_patched} modules, {report.n_fallback} left stock")

    prompt = args.prompt
    if tokenizer.has_chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                               add_generation_prompt=True)
    for out in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens):
        if rank0:
            print(out.text, end="", flush=True)
    if rank0:
        print()
        print(report)


if __name__ == "__main__":
    main()
