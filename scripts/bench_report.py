"""Tables (markdown) and a plot of the H200 results committed under bench/results.

    python scripts/bench_report.py [--plot docs/img/h200_ratios.png]

Reads the JSON the GPU scripts wrote (scripts/gpu/*.py, ``python -m mlx_bricks.bench``) and
prints, per op and weight format, the best measured ratio over the CUDA tiles (stock time /
brick time, same process) with the TFLOP/s of both sides; the plot needs matplotlib
(``pip install matplotlib``).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def gemm_family() -> dict:
    """``{case without tile: (ratio, tile, brick TF/s, stock TF/s, file)}``, best tile each."""
    best: dict = collections.defaultdict(list)
    for f in sorted(RESULTS.glob("*-h200-gemm*.json")):
        for r in json.loads(f.read_text())["results"]:
            if "ratio" not in r:
                continue
            m = re.match(r"(linear_\w+?_(?:qo|kv|gate_up|down)_M\d+)_(\w+)$", r["name"])
            name, tile = (m.group(1), m.group(2)) if m else (r["name"], "-")
            best[name].append((r["ratio"], tile, r["brick_tflops"], r["stock_tflops"], f.name))
    return {k: max(v) for k, v in best.items()}


def table(rows: dict) -> str:
    out = ["| case | best tile | brick TFLOP/s | stock TFLOP/s | ratio |", "|---|---|---|---|---|"]
    for k in sorted(rows, key=lambda n: (n.split("_M")[0], int(re.search(r"_M(\d+)", n)[1]))):
        ratio, tile, b, s, _ = rows[k]
        out.append(f"| {k} | {tile} | {b:.0f} | {s:.0f} | {ratio:.2f} |")
    return "\n".join(out)


def plot(rows: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = collections.defaultdict(dict)
    for k, (ratio, *_rest) in rows.items():
        m = re.match(r"(.+)_M(\d+)$", k)
        groups[m.group(1)][int(m.group(2))] = ratio
    names = sorted(groups)
    fig, ax = plt.subplots(figsize=(12, 5))
    width = 0.27
    for i, M in enumerate((512, 2048, 8192)):
        ax.bar([x + (i - 1) * width for x in range(len(names))],
               [groups[n].get(M, 0) for n in names], width, label=f"M = {M}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("stock time / brick time")
    ax.set_title("CUDA twins vs stock MLX 0.32.4 on the H200 (bf16 activations; best tile)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plot", default=None, help="write the ratio plot (PNG) here")
    args = p.parse_args()
    rows = gemm_family()
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
