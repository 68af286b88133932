"""Where a Nemotron-3-Nano-shaped prefill spends its time, part by part (GPU machine): the
4-layer model (bench.ssm.NEMOTRON3_4LAYER) stock and patched, each part timed in place with
its inputs evaluated before and its output after (blocks, mixers, the conv, the scan: stock's
``ssm_update`` / the ssd kind's run), then the brick alone on the arguments the model gave it
(as given and made contiguous). Usage: python3 scripts/gpu/ssd_inmodel.py [T]; prints one JSON
line (seconds: sums over a forward, medians of 3 forwards)."""
import json
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten

import mlx_lm.models.nemotron_h as nh
from mlx_bricks.bricks.short_conv.kind import SHORT_CONV
from mlx_bricks.bricks.ssd.kind import SSD_KIND
from mlx_bricks.nn.mixer import BricksMixer
from mlx_bricks.tune.timing import time_interleaved
from nemotron_models import forward, models  # this folder (sys.path[0] as a script)

RECORDS: dict = {}
CAPTURED: dict = {}


def arrays(tree):
    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def synced(label, fn):
    def wrapper(*a, **k):
        mx.eval(arrays((list(a), k)))
        mx.synchronize()
        t = time.perf_counter()
        out = fn(*a, **k)
        mx.eval(arrays(out))
        mx.synchronize()
        RECORDS.setdefault(label, []).append(time.perf_counter() - t)
        return out
    return wrapper


def timed(fn, reps=7):
    """Median seconds of one evaluated call (the tuner's timing, one call per evaluation)."""
    return time_interleaved({"fn": fn}, repeats=reps, max_calls=1).median("fn")


def main(T):
    stock, patched, tokens = models(T)
    fwd = {"stock": forward(stock, tokens), "patched": forward(patched, tokens)}
    out = {"T": T, **{f"{n}_s": timed(f) for n, f in fwd.items()}}

    real = {"block": nh.NemotronHBlock.__call__, "mixer": nh.NemotronHMamba2Mixer.__call__,
            "bmixer": BricksMixer.__call__, "conv": nh.NemotronHMamba2Mixer._conv,
            "ssm_update": nh.ssm_update}
    ssd_run, conv_stock, conv_run = SSD_KIND.run, SHORT_CONV.stock, SHORT_CONV.run

    def capture(variant, args, backend):
        CAPTURED.update(variant=variant, args=args, backend=backend)
        return ssd_run(variant, args, backend)

    for name in ("stock", "patched"):
        def lab(x, name=name):
            return f"{name}.{x}"
        nh.NemotronHBlock.__call__ = synced(lab("block"), real["block"])
        nh.NemotronHMamba2Mixer.__call__ = synced(lab("mixer"), real["mixer"])
        BricksMixer.__call__ = synced(lab("mixer"), real["bmixer"])
        nh.NemotronHMamba2Mixer._conv = synced(lab("conv"), real["conv"])
        nh.ssm_update = synced(lab("scan"), real["ssm_update"])
        SSD_KIND.run = synced(lab("scan"), capture)
        SHORT_CONV.stock = synced(lab("conv"), conv_stock)
        SHORT_CONV.run = synced(lab("conv_brick"), conv_run)
        try:
            fwd[name]()  # warm with the wrappers
            per = []
            for _ in range(3):
                RECORDS.clear()
                t = time.perf_counter()
                mx.eval(fwd[name]())
                mx.synchronize()
                per.append(({k: (sum(v), len(v)) for k, v in RECORDS.items()},
                            time.perf_counter() - t))
        finally:
            nh.NemotronHBlock.__call__ = real["block"]
            nh.NemotronHMamba2Mixer.__call__ = real["mixer"]
            BricksMixer.__call__ = real["bmixer"]
            nh.NemotronHMamba2Mixer._conv = real["conv"]
            nh.ssm_update = real["ssm_update"]
            del SSD_KIND.run, SHORT_CONV.stock, SHORT_CONV.run
        out[f"{name}_synced_forward_s"] = sorted(p[1] for p in per)[1]
        for k in per[0][0]:
            out[k + "_s"] = sorted(p[0][k][0] for p in per)[1]
            out[k + "_calls"] = per[0][0][k][1]

    # the brick alone on the model's own arguments, then on contiguous copies
    v, args, backend = CAPTURED["variant"], CAPTURED["args"], CAPTURED["backend"]
    out["variant"] = getattr(v, "name", str(v))
    out["alone_model_args_s"] = timed(lambda: SSD_KIND.run(v, args, backend))
    copies = {k: (mx.contiguous(a) if isinstance(a, mx.array) else a) for k, a in args.items()}
    mx.eval(arrays(copies))
    out["alone_contiguous_s"] = timed(lambda: SSD_KIND.run(v, copies, backend))
    out["arg_info"] = {k: [list(a.shape), str(a.dtype)]
                       for k, a in args.items() if isinstance(a, mx.array)}
    out["stock_alone_model_args_s"] = timed(lambda: SSD_KIND.stock(args))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    for t in (sys.argv[1:] or ["2048"]):
        main(int(t))
