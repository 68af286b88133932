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


#: Whole-model targets (stock time / patched time) of the quantized-prefill and MoE issues, by
#: (model, weights, M); a case without one has none.
E2E_TARGETS = {("llama8b", "q4g64", 512): 1.5, ("llama8b", "q4g64", 2048): 3.3,
               ("llama8b", "q4g64", 8192): 3.5, ("llama8b", "q8g64", 2048): 2.8,
               **{("qwen3_moe", "q4g64", M): 2.0 for M in (512, 2048, 8192)}}


def e2e_rows() -> dict:
    """``{(model, weights, M): (ratio, stock ms, patched ms, file)}`` of the whole-model H200
    benchmarks (``*-h200-e2e*.json``), the newest file's figure for each case; ratio and stock
    ms are None where stock could not run (``stock_error``)."""
    rows = {}
    for f in sorted(RESULTS.glob("*-h200-e2e*.json")):
        for r in json.loads(f.read_text())["results"]:
            m = re.match(r"e2e_(llama8b|qwen3_moe)_4layer_bf16(?:_(q\dg\d+))?_m(\d+)$", r["name"])
            if not m or "brick_s" not in r or (r.get("ratio") is None
                                               and "stock_error" not in r):
                continue
            stock_ms = None if r.get("stock_s") is None else r["stock_s"] * 1e3
            rows[(m.group(1), m.group(2) or "bf16", int(m.group(3)))] = (
                r.get("ratio"), stock_ms, r["brick_s"] * 1e3, f.name)
    return rows


def e2e_table(rows: dict) -> str:
    out = ["| model | weights | M | stock ms | patched ms | ratio | target | file |",
           "|---|---|---|---|---|---|---|---|"]
    for k in sorted(rows):
        ratio, s, b, f = rows[k]
        t = E2E_TARGETS.get(k)
        if ratio is None:  # stock raised: the patched model runs where stock does not
            out.append(f"| {k[0]} | {k[1]} | {k[2]} | stock fails | {b:.2f} | - | "
                       f"{'-' if t is None else f'>= {t}: no stock figure'} | {f} |")
            continue
        verdict = "-" if t is None else f">= {t}: {'met' if ratio >= t else 'not met'}"
        shown = f"{ratio:.2f}" if t is None or (round(ratio, 2) >= t) == (ratio >= t) \
            else f"{ratio:.3f}"  # 1.997 is not 2.00
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {s:.2f} | {b:.2f} | {shown} | {verdict} "
                   f"| {f} |")
    return "\n".join(out)


def e2e_plot(rows: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({k[:2] for k in rows})
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.27
    for i, M in enumerate((512, 2048, 8192)):
        xs = [x + (i - 1) * width for x in range(len(cases))]
        ax.bar(xs, [rows.get((*c, M), (0,))[0] or 0 for c in cases], width, label=f"M = {M}")
        for x, c in zip(xs, cases):
            if (*c, M) in rows and rows[(*c, M)][0] is None:
                ax.text(x, 0.1, "stock fails", rotation=90, ha="center", va="bottom", fontsize=8)
            t = E2E_TARGETS.get((*c, M))
            if t is not None:
                ax.plot([x - width / 2, x + width / 2], [t, t], color="k", lw=1.5)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(cases)), [f"{m} {w}" for m, w in cases])
    ax.set_ylabel("stock time / patched time (black: target)")
    ax.set_title("Whole-model 4-layer prefill, patched vs stock mlx-lm, H200, MLX 0.32.4 CUDA")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plot", default=None, help="write the GEMM-family ratio plot (PNG) here")
    p.add_argument("--e2e-plot", default=None, help="write the whole-model ratio plot here")
    args = p.parse_args()
    rows = gemm_family()
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
    e2e = e2e_rows()
    print()
    print(e2e_table(e2e))
    if args.e2e_plot:
        e2e_plot(e2e, args.e2e_plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
