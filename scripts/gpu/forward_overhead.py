"""Host time against device time of a Nemotron-3-Nano-shaped prefill (GPU machine): for the
4-layer model (bench.ssm.NEMOTRON3_4LAYER) stock and patched, the seconds spent building the
graph (the forward called, nothing evaluated) and evaluating it; then one layer's conv stage
(short_conv kind, brick and stock) and scan (ssd kind) alone, 20 calls per evaluation (device
throughput) and one call per evaluation (latency). Usage: python3 scripts/gpu/forward_overhead.py
[T]; prints one JSON line (seconds, medians). MODEL=lfm2_q4: that model's split only."""
import json
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_bricks.bench.ssm import NemotronHShape
from mlx_bricks.bricks.short_conv.kind import SHORT_CONV
from mlx_bricks.bricks.ssd.kind import SSD_KIND
from mlx_bricks.runtime.kind import Act
from nemotron_models import SHAPE, forward, models  # this folder (sys.path[0] as a script)
from mlx_bricks.tune.timing import time_interleaved


BACKEND = "cuda" if mx.cuda.is_available() else "reference"


def arrays(tree):
    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def med(xs):
    return sorted(xs)[len(xs) // 2]


def split(fn, reps=7):
    """(build seconds, eval seconds, total) medians of ``fn`` (returns arrays, lazily)."""
    mx.eval(arrays(fn()))
    mx.synchronize()
    build, run, total = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        mx.eval(arrays(out))
        mx.synchronize()
        t2 = time.perf_counter()
        build.append(t1 - t0)
        run.append(t2 - t1)
        total.append(t2 - t0)
    return med(build), med(run), med(total)


def many(fn, n=20, reps=5):
    """Median seconds per call over ``reps`` evaluations of ``n`` calls (the tuner's timing)."""
    return time_interleaved({"fn": fn}, repeats=reps, min_calls=n, max_calls=n).median("fn")


def main(T):
    shape = SHAPE
    stock, patched, tokens = models(T)
    out = {"T": T}
    for name, m in (("stock", stock), ("patched", patched)):
        b, r, t = split(forward(m, tokens))
        out.update({f"{name}_build_s": b, f"{name}_eval_s": r, f"{name}_total_s": t})
    if not isinstance(shape, NemotronHShape):  # MODEL=lfm2_q4 (nemotron_models): the split only
        print(json.dumps(out), flush=True)
        return
    H, P, G, N = shape.heads, shape.head_dim, shape.groups, shape.state
    C = H * P + 2 * G * N
    mixer = next(layer.mixer for layer in patched.backbone.layers if layer.block_type == "M")
    conv = mixer.conv1d
    bf = mx.bfloat16
    conv_args = SHORT_CONV.synthetic({
        "x": Act((1, T, C), bf), "weight": conv.weight, "bias": conv.get("bias"),
        "state": None, "mask": None, "activation": "silu"})
    ssd_args = SSD_KIND.synthetic({
        "x": Act((1, T, H, P), bf), "dt": Act((1, T, H), bf), "A_log": mixer.A_log,
        "B": Act((1, T, G, N), bf), "C": Act((1, T, G, N), bf), "D": mixer.D.astype(bf),
        "dt_bias": mixer.dt_bias, "state": None, "mask": None,
        "time_step_limit": tuple(mixer.time_step_limit)})
    mx.eval(arrays(conv_args), arrays(ssd_args))
    for name, fn in (("conv_brick", lambda: SHORT_CONV.brick(conv_args, BACKEND)),
                     ("conv_stock", lambda: SHORT_CONV.stock(conv_args)),
                     ("scan_brick", lambda: SSD_KIND.brick(ssd_args, BACKEND)),
                     ("scan_stock", lambda: SSD_KIND.stock(ssd_args))):
        out[f"{name}_x20_s"] = many(fn)
        out[f"{name}_build_s"], out[f"{name}_eval_s"], out[f"{name}_s"] = split(fn)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    for t in (sys.argv[1:] or ["2048"]):
        main(int(t))
