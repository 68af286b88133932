"""Where a patched Nemotron-3-Nano-shaped prefill spends its time (GPU machine): the 4-layer
model (bench.ssm.NEMOTRON3_4LAYER) stock and patched, then each with its scan replaced by zeros
(stock: mlx-lm's ssm_update; patched: the ssd kind's brick), so scan and rest are apart. Usage:
python3 scripts/gpu/nemotron_split.py [T]; prints one JSON line (seconds, medians)."""
import json
import sys

import mlx.core as mx

import mlx_lm.models.nemotron_h as nh
from mlx_bricks.bricks.ssd import kind as ssd_kind
from mlx_bricks.tune.timing import time_interleaved
from nemotron_models import forward, models  # this folder (sys.path[0] as a script)


def timed(fn, reps=7):
    """Median seconds of one evaluated call (the tuner's timing, one call per evaluation)."""
    return time_interleaved({"fn": fn}, repeats=reps, max_calls=1).median("fn")


def main(T):
    stock, patched, tokens = models(T)

    def fwd(model):
        return forward(model, tokens)

    out = {"T": T, "stock_s": timed(fwd(stock)), "patched_s": timed(fwd(patched))}
    real_update, real_brick = nh.ssm_update, ssd_kind.SSD.brick

    def zero_update(x, A_log, B, C, D, dt, dt_bias, state=None, *a, **k):
        b, _, H, P = x.shape
        return mx.zeros_like(x), mx.zeros((b, H, P, B.shape[-1]), mx.float32)

    def zero_brick(self, args, backend, **kw):
        x, B = args["x"], args["B"]
        b, _, H, P = x.shape
        return mx.zeros_like(x), mx.zeros((b, H, P, B.shape[-1]), mx.float32)

    nh.ssm_update = zero_update
    ssd_kind.SSD.brick = zero_brick
    try:
        out["stock_without_scan_s"] = timed(fwd(stock))
        out["patched_without_scan_s"] = timed(fwd(patched))
    finally:
        nh.ssm_update, ssd_kind.SSD.brick = real_update, real_brick
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    for t in (sys.argv[1:] or ["2048"]):
        main(int(t))
