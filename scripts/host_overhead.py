"""Host time of building one prefill graph, stock vs patched, on a machine without a GPU: the
``cuda`` backend simulated (every kernel launch replaced by lazy zeros of its outputs, as
``mlx_bricks.cudacheck.recorded_launches`` does; the first-call guard passed), the patched
model's decisions taken from a GPU run's benchmark JSON (``--decisions``) or, without one, the
ops' own rules (``tune="off"``). What it measures is the Python and MLX graph-building time that
``mlx_lm.generate`` spends before each prefill chunk is evaluated (the GPU idles meanwhile).

Usage: python scripts/host_overhead.py [--model lfm2|llama] [--tokens 2047]
       [--decisions bench/results/2026-12-07-h100-session8/e2e_lfm2_..._run1.json] [--profile]
Prints one JSON line: median milliseconds of each side (interleaved runs), launches per forward.
"""
import argparse
import collections
import cProfile
import importlib
import json
import pkgutil
import pstats
import statistics
import sys
import time

import mlx.core as mx

from mlx_bricks import backends, cudacheck, kernels
from mlx_bricks.cuda import toolchain

def launching_modules() -> list:
    """``mlx_bricks.kernels`` and every brick module holding its ``launch`` (``from
    mlx_bricks.kernels import launch``): what ``cudacheck.recorded_launches`` must replace."""
    import mlx_bricks.bricks as bricks

    for info in pkgutil.walk_packages(bricks.__path__, "mlx_bricks.bricks."):
        importlib.import_module(info.name)
    return [kernels] + [m for n, m in sorted(sys.modules.items())
                        if n.startswith("mlx_bricks.bricks.")
                        and getattr(m, "launch", None) is kernels.launch]


def simulate_cuda() -> None:
    """Make this process believe it has an sm_90 GPU (launches: ``recorded_launches``), its
    first-call guard passing every brick."""
    backends.cuda_capability = toolchain.cuda_capability = lambda: (9, 0)
    backends._status_cache["cuda"] = backends.Availability(True, "simulated")
    backends._status_cache["metal"] = backends.Availability(False, "simulated")
    from mlx_bricks.runtime import guard
    guard.GUARD.run = lambda kind, variant, args, backend, key, stock: (
        kind.run(variant, args, backend), None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("lfm2", "llama"), default="lfm2")
    ap.add_argument("--tokens", type=int, default=2047)
    ap.add_argument("--decisions", help="a benchmark JSON with the patched run's decisions")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--profile", action="store_true", help="also print a cProfile listing")
    ap.add_argument("--sort", default="cumulative", help="the listing's order (pstats keys)")
    a = ap.parse_args()
    simulate_cuda()
    with cudacheck.recorded_launches(*launching_modules()) as records:
        measure(a, records)


def measure(a, records: list) -> None:
    """The builds of :func:`main`'s arguments ``a``; ``records``: the launches recorded."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_bricks.bench.e2e import LLAMA_8B_4LAYER, _models
    from mlx_bricks.bench.ssm import LFM2_1B_4LAYER
    from mlx_bricks.patch import patch_model
    from mlx_bricks.tune.tuner import Decision

    shape = {"lfm2": LFM2_1B_4LAYER, "llama": LLAMA_8B_4LAYER}[a.model]
    stock, patched = _models(shape, "bf16", (4, 64))
    report = patch_model(patched, backend="cuda", tune="auto" if a.decisions else "off")
    if a.decisions:
        for d in json.load(open(a.decisions))["results"][0]["tuning"]["decisions"]:
            report.dispatch.decisions[d["key"]] = Decision.from_dict(d["key"], d)
    tokens = mx.random.randint(0, 1000, (1, a.tokens), key=mx.random.key(0))

    def build(model):
        cache = make_prompt_cache(model)
        model(tokens, cache=cache)
        return [c.state for c in cache]

    sides = {"stock": lambda: build(stock), "patched": lambda: build(patched)}
    times = {k: [] for k in sides}
    for f in sides.values():
        f()
    records.clear()
    build(patched)
    per_forward = dict(collections.Counter(r.name for r in records))
    for _ in range(a.repeats):
        for k, f in sides.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    ms = {k: round(1e3 * statistics.median(v), 3) for k, v in times.items()}
    print(json.dumps({"model": a.model, "tokens": a.tokens, "build_ms": ms,
                      "patched_over_stock_ms": round(ms["patched"] - ms["stock"], 3),
                      "launches_per_forward": per_forward}))
    if a.profile:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(30):
            build(patched)
        pr.disable()
        pstats.Stats(pr).sort_stats(a.sort).print_stats(40)


if __name__ == "__main__":
    main()
