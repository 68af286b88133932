"""The user's-path benchmark's document as a Markdown table and a plot (``bench.user_path``)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from mlx_bricks.bench.record import now, version


def table_rows(doc: dict) -> list[dict]:
    """One row per run of a user-path document (the CLI's JSON or a bench result entry's
    ``models``): model, prompt tokens, kind, and the figures."""
    rows = []
    for m in doc["models"]:
        for item in m.get("prompts", []):
            for r in item["runs"]:
                rows.append({"model": m["model"]["name"], "tokens": item["tokens"], **r})
    return rows


def format_table(doc: dict) -> str:
    """A Markdown table of a user-path document: per run, TTFT, start to first token, prompt
    and generation tok/s, peak memory, wall, and the prompt tok/s ratio vs stock."""
    head = ("| model | prompt | run | TTFT s | start->1st token s | prompt tok/s | gen tok/s | "
            "peak GB | wall s | prompt x stock |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    ratio_of = {}
    for m in doc["models"]:
        for item in m.get("prompts", []):
            for k, r in item.get("ratios", {}).items():
                ratio_of[(m["model"]["name"], item["tokens"], k)] = r

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in table_rows(doc):
        if "skipped" in r or "error" in r:
            why = r.get("skipped") or r.get("error", "")[:80]
            lines.append(f"| {r['model']} | {r['tokens']} | {r['kind']} | {why} |||||||")
            continue
        rat = ratio_of.get((r["model"], r["tokens"], r["kind"]))
        kind = r["kind"] + (f" (2nd try: the 1st exited {r['retried']['returncode']})"
                            if "retried" in r else "")
        lines.append(
            f"| {r['model']} | {r['tokens']} | {kind} | {f(r['ttft_s'], '.3f')} | "
            f"{f(r['start_to_first_token_s'], '.2f')} | {f(r['prompt_tps'], '.1f')} | "
            f"{f(r['generation_tps'], '.1f')} | {f(r['peak_memory_gb'], '.3f')} | "
            f"{f(r['wall_s'], '.1f')} | {f(rat and rat['prompt_tps'], '.2f')} |")
    return "\n".join(lines)


def plot(doc: dict, path: str | os.PathLike) -> None:
    """Bar plots of a user-path document, one row per model, bars per run kind over the prompt
    lengths (log scale): prompt tok/s; start to first token of the one-process runs; the
    prompt phase (TTFT as mlx-lm times it) of every run.

    Raises:
        ValueError: no model with measured prompts.
        ModuleNotFoundError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in doc["models"] if m.get("prompts")]
    if not models:
        raise ValueError("doc: no model with measured prompts to plot")
    order = ("stock", "cold", "first", "cached", "long_stock", "long")
    panels = (("prompt_tps", "prompt tok/s"),
              ("start_to_first_token_s", "command start to first token, s"),
              ("ttft_s", "prompt phase (TTFT), s"))
    fig, axes = plt.subplots(len(models), len(panels), figsize=(15, 3.3 * len(models)),
                             squeeze=False)
    for row, m in zip(axes, models):
        items = m["prompts"]
        kinds = [k for k in order if any(r["kind"] == k for it in items for r in it["runs"])]
        width = 0.8 / len(kinds)
        for ax, (key, label) in zip(row, panels):
            for i, k in enumerate(kinds):
                xs, ys = [], []
                for j, item in enumerate(items):
                    for r in item["runs"]:
                        if r["kind"] == k and r.get(key) is not None:
                            xs.append(j + (i - len(kinds) / 2 + 0.5) * width)
                            ys.append(r[key])
                ax.bar(xs, ys, width, label=k, color=f"C{order.index(k)}")
            ax.set_xticks(range(len(items)), [str(it["tokens"]) for it in items])
            ax.set_xlabel("prompt tokens")
            ax.set_yscale("log")
            ax.set_title(f"{m['model']['name']}: {label}", fontsize=9)
        row[0].legend(fontsize=7)
    save_figure(fig, doc, "the user's path: mlx-lm's CLIs in fresh processes, stock vs "
                "--use-bricks", path)


def save_figure(fig, doc: dict, what: str, path) -> None:
    """Title ``fig`` with ``what`` and the document's device, versions and date; save it to
    ``path`` (PNG, 110 dpi) and close it."""
    import matplotlib.pyplot as plt

    fig.suptitle(f"{what}; {doc.get('device', '')}, MLX {doc.get('mlx')}, mlx-lm "
                 f"{doc.get('mlx_lm')}, {doc.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def document(group: str, started: str, models: list) -> dict:
    """The JSON document of a user-path run of ``group`` begun at ``started``: the machine,
    the versions and the ``models`` entries (``user_path.run_model``)."""
    import platform

    import mlx.core as mx

    info = {k: str(v) for k, v in mx.device_info().items()}
    return {"group": f"user_path_{group}", "date": started, "finished": now(),
            "device": info.get("device_name") or str(mx.default_device()),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "mlx_device": str(mx.default_device()), "device_info": info},
            "mlx": mx.__version__, "mlx_lm": version("mlx-lm"),
            "mlx_bricks": version("mlx-bricks"), "python": platform.python_version(),
            "models": models}


def write_report(doc: dict, stem: Path, format_table, plot) -> str:
    """Write ``stem``.md (``format_table(doc)``) and ``stem``.png (``plot(doc, path)``; a line
    on stderr where it cannot be drawn); return the table."""
    table = format_table(doc)
    stem.with_suffix(".md").write_text(table + "\n")
    try:
        plot(doc, stem.with_suffix(".png"))
    except (ValueError, ModuleNotFoundError) as e:
        print(f"[{stem.name}] no plot: {e}", file=sys.stderr)
    return table
