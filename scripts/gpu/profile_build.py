"""Where the host time of building one patched prefill graph goes on the GPU machine: the
4-layer model of nemotron_models (MODEL=lfm2_q4|nemotron|nemotron_q4), tuned first, then
cProfile over 20 graph builds (nothing evaluated). Usage: python3 scripts/gpu/profile_build.py
[T] [sort] [lines]. Prints the listing on stdout."""
import cProfile
import pstats
import sys
import time

import mlx.core as mx
from mlx.utils import tree_flatten

from nemotron_models import forward, models  # this folder (sys.path[0] as a script)


def main(T=2048, sort="cumulative", lines=45):
    stock, patched, tokens = models(T)
    fwd = forward(patched, tokens)
    for _ in range(3):  # tuned and warm
        mx.eval([a for _, a in tree_flatten(fwd())])
    t0 = time.perf_counter()
    for _ in range(20):
        fwd()
    print(f"patched build {1e3 * (time.perf_counter() - t0) / 20:.3f} ms (unprofiled)")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(20):
        fwd()
    pr.disable()
    pstats.Stats(pr, stream=sys.stdout).sort_stats(sort).print_stats(lines)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]) if a else 2048, a[1] if len(a) > 1 else "cumulative",
         int(a[2]) if len(a) > 2 else 45)
