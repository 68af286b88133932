"""Where a patched Nemotron-3-Nano-shaped prompt's time goes between one whole-prompt forward
and mlx-lm's prefill (bench.e2e.prefill: T - 1 tokens into the cache, then the last token's
logits): the 4-layer model (bench.ssm.NEMOTRON3_4LAYER), stock and patched, timed interleaved.
Usage on the GPU machine: python3 scripts/gpu/nemotron_last_step.py [T ...]; prints one JSON
line per T (seconds, medians)."""
import json
import sys

from mlx_bricks.bench.e2e import prefill
from mlx_bricks.tune.timing import time_interleaved
from nemotron_models import forward, models  # this folder (sys.path[0] as a script)


def main(T):
    stock, patched, tokens = models(T)
    fns = {}
    for name, model in (("stock", stock), ("patched", patched)):
        fns[f"{name}_T"] = forward(model, tokens)
        fns[f"{name}_T-1"] = forward(model, tokens[:, :-1])
        fns[f"{name}_prefill"] = lambda m=model: prefill(m, tokens)
    t = time_interleaved(fns, repeats=7, max_calls=1)
    print(json.dumps({"T": T, **{k: t.median(k) for k in fns}}), flush=True)


if __name__ == "__main__":
    for T in [int(a) for a in sys.argv[1:]] or [2048, 8192]:
        main(T)
