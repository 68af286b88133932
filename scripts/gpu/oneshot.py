"""The one-shot user path in the order a fresh GPU machine needs (issue 44): per model and prompt,
``mlx_lm.generate`` in fresh processes: stock (pays MLX's own JIT: the warm-up, recorded but
not compared), stock again (the baseline, JIT cache warm), ``--use-bricks`` with an empty
mlx-bricks home (cold: nothing measured or built), ``--use-bricks`` again (cached), stock once
more (drift). Default flags otherwise. Built on ``mlx_bricks.bench.user_path`` (its model specs,
``write_model``, ``make_prompt``, ``run_one``).

Usage (GPU machine, MLX installed): ``python3 scripts/gpu/oneshot.py OUT.json MODEL:TOKENS[,TOKENS]
...`` e.g. ``qwen35_35b_a3b_q4:2240,8192 gpt_oss_20b_mxfp4:2240``; env LAYERS (default 8),
BUDGET_S (no run starts after it, default 480), TOKENIZER (default .bench-tok).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from mlx_bricks.bench.user_models import GPU_MODELS, _load_tokenizer, make_prompt, write_model
from mlx_bricks.bench.user_path import run_one

SEQUENCE = ("stock", "stock", "cold", "cached", "stock")
LABELS = ("stock_jit", "stock", "cold", "cached", "stock_after")


def main(argv) -> int:
    import mlx.core as mx
    import mlx_lm

    out = Path(argv[0])
    plan = [(a.split(":")[0], [int(t) for t in a.split(":")[1].split(",")]) for a in argv[1:]]
    layers = int(os.environ.get("LAYERS", 8))
    deadline = time.monotonic() + float(os.environ.get("BUDGET_S", 480))
    tokenizer = Path(os.environ.get("TOKENIZER", ".bench-tok"))
    doc = {"date": time.strftime("%Y-%m-%d"), "device": mx.device_info().get("device_name"),
           "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "layers": layers,
           "sequence": list(LABELS), "models": []}
    work = Path(tempfile.mkdtemp(prefix="oneshot_"))
    for name, prompts in plan:
        spec = GPU_MODELS[name].with_layers(layers)
        entry = {"model": name, "what": spec.describe(), "prompts": []}
        doc["models"].append(entry)
        model_dir, home = work / name, work / f"{name}-home"
        entry["written"] = write_model(spec, model_dir, tokenizer)
        tok = _load_tokenizer(model_dir)
        for p in prompts:
            text = make_prompt(tok, p)
            item = {"tokens": p, "runs": {}}
            entry["prompts"].append(item)
            for kind, label in zip(SEQUENCE, LABELS):
                if time.monotonic() > deadline:
                    item["runs"][label] = {"skipped": "time budget spent"}
                    continue
                r = run_one(kind, model_dir, home, p, text, 32, 1, out.parent / "logs",
                            timeout=max(60.0, deadline - time.monotonic() + 60))
                item["runs"][label] = r
                print(name, p, label, {k: r.get(k) for k in (
                    "prompt_tps", "generation_tps", "peak_memory_gb", "ttft_s", "wall_s",
                    "error", "bricks_line")}, flush=True)
                out.write_text(json.dumps(doc, indent=1, default=str))
            runs = item["runs"]
            if all("prompt_tps" in runs.get(k, {}) for k in ("stock", "cold", "cached")):
                base = runs["stock"]["prompt_tps"]
                item["prompt_ratio"] = {k: runs[k]["prompt_tps"] / base
                                        for k in ("cold", "cached")}
                item["generation_ratio"] = {
                    k: runs[k]["generation_tps"] / runs["stock"]["generation_tps"]
                    for k in ("cold", "cached")}
                print(name, p, "ratios", item["prompt_ratio"], item["generation_ratio"],
                      flush=True)
            out.write_text(json.dumps(doc, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
