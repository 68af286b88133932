"""The server bench's command line, Markdown tables and plot (``bench.server``'s JSON)."""
from __future__ import annotations

import argparse
import dataclasses
import os

from mlx_bricks import _cli
from mlx_bricks.bench import user_path as up
from mlx_bricks.bench.user_models import tokenizer_files
from mlx_bricks.bench.user_report import save_figure
from mlx_bricks.bench.server_plan import (CPU_SERVER_MODELS, CPU_SETTINGS, GPU_SERVER_MODELS,
                                          GPU_SETTINGS, SIDES, make_plan)


def build_parser() -> argparse.ArgumentParser:
    n = _cli.positive_int
    p = argparse.ArgumentParser(
        prog="python -m mlx_bricks.bench.server",
        description="mlx_lm.server stock vs --use-bricks as agents use it: a multi-turn chat "
        "whose context grows with the prompt cache reused, and concurrent requests (the openai "
        "client, streamed); TTFT per turn, generation tok/s, peak memory; JSON, Markdown, plot "
        "and the servers' logs into --out-dir.")
    p.add_argument("--group", choices=("cpu", "gpu"), default="cpu",
                   help="the model set and defaults (default: cpu)")
    p.add_argument("--models", nargs="+", metavar="NAME",
                   help=f"models, in this order (default: cpu {', '.join(CPU_SERVER_MODELS)}; "
                   f"gpu {', '.join(GPU_SERVER_MODELS)}; any of bench.user_path's)")
    p.add_argument("--turns", nargs="+", type=n, metavar="TOKENS",
                   help=f"context tokens after each turn (default: cpu {CPU_SETTINGS.turns}, "
                   f"gpu {GPU_SETTINGS.turns})")
    for flag, field, what in (
            ("--system-tokens", "system_tokens", "the system prompt's tokens"),
            ("--max-tokens", "max_tokens", "tokens generated per request"),
            ("--concurrent", "concurrent", "requests sent at once"),
            ("--concurrent-tokens", "concurrent_tokens", "tokens of each concurrent request")):
        p.add_argument(flag, type=n, help=f"{what} (default: cpu "
                       f"{getattr(CPU_SETTINGS, field)}, gpu {getattr(GPU_SETTINGS, field)})")
    p.add_argument("--warmup-tokens", nargs="+", type=n, metavar="TOKENS",
                   help=f"prompt tokens of each server's warm-up requests (default: cpu "
                   f"{CPU_SETTINGS.warmup_tokens}, gpu {GPU_SETTINGS.warmup_tokens})")
    p.add_argument("--layers", type=n, help=f"decoder layers of every model (default: cpu the "
                   f"model's own, gpu {up.GPU_LAYERS})")
    p.add_argument("--full-size", action="store_true", help="the models' own layer counts")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no phase after this many seconds (the rest listed as skipped)")
    p.add_argument("--tokenizer", default=None, help="a model directory with the tokenizer "
                   "files (default: the default model's, mlx_bricks.default_model())")
    p.add_argument("--work", default=None, help="where the model directories go (default: a "
                   "temporary directory; each model's is removed after its run)")
    p.add_argument("--out-dir", required=True,
                   help="writes server_<group>.json (after every phase), .md, .png and logs/")
    return _cli.one_line_errors(p)


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed arguments with ``settings`` (checked, and the requests built once with the
    tokenizer) and ``specs`` (name -> ``ModelSpec`` at the size it runs); a bad argument is one
    line on stderr and exit status 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    gpu = args.group == "gpu"
    base = GPU_SETTINGS if gpu else CPU_SETTINGS
    given = {f: getattr(args, f) for f in ("turns", "system_tokens", "max_tokens", "concurrent",
                                           "concurrent_tokens", "warmup_tokens")}
    args.settings = dataclasses.replace(
        base, **{f: tuple(v) if isinstance(v, list) else v for f, v in given.items()
                 if v is not None})
    known = {**up.GPU_MODELS} if gpu else {**CPU_SERVER_MODELS, **up.CPU_MODELS}
    names = args.models or list(GPU_SERVER_MODELS if gpu else CPU_SERVER_MODELS)
    unknown = [m for m in names if m not in known]
    if unknown:
        parser.error(f"--models: unknown {unknown}; known: {', '.join(known)}")
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s: must be positive, got {args.budget_s}")
    layers = None if args.full_size else (args.layers or (up.GPU_LAYERS if gpu else None))
    try:
        args.specs = {m: known[m].with_layers(layers) for m in names}
        tokenizer = args.tokenizer or up.default_tokenizer_dir()
        tokenizer_files(tokenizer)
        make_plan(up._load_tokenizer(tokenizer), args.settings)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    return args


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_table(doc: dict) -> str:
    """Markdown tables of a server-bench document: the chat per model and turn (context and
    cached tokens, TTFT per side and stock / bricks, generation tok/s per side), then per
    model the concurrent batch, peak memory and the targets."""
    lines = ["| model | turn | context tokens | cached | stock TTFT s | bricks TTFT s | "
             "TTFT stock/bricks | stock gen tok/s | bricks gen tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    tail = ["", "| model | concurrent TTFT p50 s stock / bricks | batch wall s stock / bricks | "
            "peak memory MiB stock / bricks (delta) | TTFT p50 / p95 stock/bricks | targets |",
            "|---|---|---|---|---|---|"]
    for m in doc["models"]:
        name = m["model"]["name"]
        if "skipped" in m or "error" in m:
            why = m.get("skipped") or m["error"][:120]
            lines.append(f"| {name} | {why} ||||||||")
        chat = m.get("chat", {})
        ratio = {r["turn"]: r["ttft"] for r in m.get("summary", {}).get("ratios", {})
                 .get("ttft_per_turn", [])}
        for s, b in zip(chat.get("stock", []), chat.get("bricks", [])):
            if "skipped" in s or "skipped" in b:
                lines.append(f"| {name} | {s['turn']} | time budget spent ||||||")
                continue
            lines.append(
                f"| {name} | {s['turn']} | {s['prompt_tokens']} | {s['cached_tokens']} | "
                f"{_f(s['ttft_s'], '.3f')} | {_f(b['ttft_s'], '.3f')} | "
                f"{_f(ratio.get(s['turn']), '.2f')} | {_f(s['generation_tps'], '.1f')} | "
                f"{_f(b['generation_tps'], '.1f')} |")
        if "summary" not in m:
            continue
        su, conc, mem = m["summary"], m.get("concurrent", {}), m.get("memory", {})
        r, t = su["ratios"], su["targets"]
        c = [conc.get(side, {}) for side in SIDES]
        peak = [mem.get(side, {}).get(mem.get("key")) for side in SIDES]
        tail.append(
            f"| {name} | {_f(c[0].get('ttft_p50_s'), '.3f')} / {_f(c[1].get('ttft_p50_s'), '.3f')}"
            f" | {_f(c[0].get('wall_s'), '.2f')} / {_f(c[1].get('wall_s'), '.2f')} | "
            f"{_f(peak[0], '.0f')} / {_f(peak[1], '.0f')} ({_f(r['peak_memory_delta_mib'], '+.0f')}"
            f"; {mem.get('key', '-')}) | {_f(r['ttft_p50'], '.2f')} / {_f(r['ttft_p95'], '.2f')}"
            f" | TTFT >= {_f(t['ttft_each_turn_at_least'], '.1f')}x: {t['ttft_met']}; memory: "
            f"{t['memory_met']} |")
    return "\n".join(lines + tail)


def plot(doc: dict, path: str | os.PathLike) -> None:
    """One row per model: TTFT per turn against the context tokens, stock and bricks (log
    scale); TTFT stock / bricks per turn with the target; the concurrent requests' TTFT.

    Raises:
        ValueError: no model with answered turns.
        ModuleNotFoundError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = [m for m in doc["models"]
              if any(t.get("ttft_s") is not None for t in m.get("chat", {}).get("stock", []))]
    if not models:
        raise ValueError("doc: no model with answered turns to plot")
    fig, axes = plt.subplots(len(models), 3, figsize=(15, 3.4 * len(models)), squeeze=False)
    for (a_ttft, a_ratio, a_conc), m in zip(axes, models):
        name = m["model"]["name"]
        for i, side in enumerate(SIDES):
            turns = [t for t in m["chat"][side] if t.get("ttft_s") is not None]
            a_ttft.plot([t["prompt_tokens"] for t in turns], [t["ttft_s"] for t in turns],
                        "o-", color=f"C{i}", label=side)
            reqs = m.get("concurrent", {}).get(side, {}).get("requests", [])
            a_conc.bar([j + (i - 0.5) * 0.4 for j in range(len(reqs))],
                       [r["ttft_s"] or 0 for r in reqs], 0.4, color=f"C{i}", label=side)
        a_ttft.set_yscale("log")
        a_ttft.set(xlabel="context tokens", ylabel="TTFT, s", title=f"{name}: chat, TTFT per turn")
        per = m["summary"]["ratios"]["ttft_per_turn"]
        a_ratio.plot([r["context_tokens"] for r in per], [r["ttft"] for r in per], "o-",
                     color="C2")
        want = m["summary"]["targets"]["ttft_each_turn_at_least"]
        if want:
            a_ratio.axhline(want, color="grey", ls="--", label=f"target {want}x")
            a_ratio.legend(fontsize=7)
        a_ratio.axhline(1, color="black", lw=0.5)
        a_ratio.set(xlabel="context tokens", ylabel="stock / bricks",
                    title=f"{name}: TTFT stock / bricks")
        n = m["settings"]["concurrent"]
        a_conc.set_xticks(range(n), [str(j + 1) for j in range(n)])
        a_conc.set(xlabel="request", ylabel="TTFT, s",
                   title=f"{name}: {m['settings']['concurrent']} concurrent requests")
        a_ttft.legend(fontsize=7)
        a_conc.legend(fontsize=7)
    for ax in axes.flat:
        ax.title.set_fontsize(9)
    save_figure(fig, doc, "mlx_lm.server stock vs --use-bricks (openai client, prompt cache "
                   "reused)", path)
