"""The user's path as the benchmark of record (issue 33): mlx-lm's own CLIs in fresh processes.

Users run ``mlx_lm.generate`` with one prompt per process, or a long-lived server; the other
benchmarks time warm forwards in one process. This one writes model directories with random
weights (mlx-lm's model classes, ``mlx_lm.utils.quantize_model`` as ``mlx_lm.convert`` does it,
``config.json`` with ``"quantization"``, the default model's tokenizer files beside) and runs, per
model and prompt length P, each in a fresh process:

- ``stock``: ``python -m mlx_lm generate --model DIR --prompt - --max-tokens G`` with a prompt
  of exactly P tokens after mlx-lm's chat template (built from the tokenizer, read from stdin);
- ``cold``: the same with ``--use-bricks`` and ``MLX_BRICKS_HOME`` an empty directory of this
  model's (no decisions cached, nothing built): the model's first ``--use-bricks`` run. The
  home is kept across the model's prompt lengths, as a user's is: the first ``--use-bricks``
  run of a later, longer prompt is ``first`` (it finds the decisions of the shorter prompts'
  chunks; ``home_files_before`` says how many files the home held);
- ``cached``: the same again, same home;
- ``long_stock`` / ``long``: ``python -m mlx_lm benchmark -p P -g G -n TRIALS`` without and
  with ``--use-bricks`` (same home): one warm-up generation, then TRIALS timed ones in the same
  process, as a long-lived server sees them.

Every run uses mlx-lm's default ``prefill_step_size`` (2048; a prompt of P tokens is prefilled in
chunks of 2048 and a tail, ``prefill_chunks``). From what the CLIs print (``Prompt: N tokens, X
tokens-per-sec``, ``Generation: ...``, ``Peak memory: ...``; the benchmark's ``Trial i: ...``
lines) each run records: ``prompt_tokens``, ``prompt_tps``, ``generation_tokens``,
``generation_tps``, ``peak_memory_gb``, ``ttft_s`` (the prompt phase as mlx-lm times it: prompt
tokens / prompt tok/s, from the call to the first token), ``load_s`` (process start to the CLI's
first line after loading the model, and patching it: ``==========`` of generate, ``Running
warmup..`` of benchmark; stdout unbuffered), ``start_to_first_token_s`` (``load_s + ttft_s``:
what a user waits from the command to the first token), ``wall_s`` (the whole process), and the
``[mlx-bricks]`` line of stderr (``bricks_line``). ``ratios`` hold patched / stock of the same
prompt, measured in the same run: ``prompt_tps``, ``generation_tps``, ``peak_memory`` (above 1:
more), and stock / patched of ``ttft_s``, ``start_to_first_token_s`` and ``wall_s`` (above 1:
the patched run is faster).

Groups of ``python -m mlx_bricks.bench``: ``user_path_cpu`` (small models, backend ``cpu``: runs
where no kernel backend exists) and ``user_path_gpu`` (Llama-3-8B bf16 / 4-bit / 8-bit,
Qwen3-30B-A3B 4-bit, Gemma-3-12B 4-bit layer shapes on a kernel backend); neither runs unless
named. The GPU machine's script is this module's CLI (``python -m mlx_bricks.bench.user_path
--help``; docs/bench.md, "The user's path"), which writes the JSON, one log per process and a
plot into ``--out-dir``.

The models and prompts are ``bench.user_models``; the table and plot, ``bench.user_report``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from mlx_bricks import _cli
from mlx_bricks import env as bricks_env
from mlx_bricks.bench.case import CPU, KERNEL, Benchmark
from mlx_bricks.bench.record import load_average, now
from mlx_bricks.bench.user_models import (
    CPU_MODELS,
    CPU_PROMPTS,
    GPU_MODELS,
    GPU_PLAN,
    GPU_PROMPTS,
    PREFILL_STEP,
    TINY_LLAMA,
    ModelSpec,
    _load_tokenizer,
    default_tokenizer_dir,
    make_prompt,
    prefill_chunks,
    write_model,
)
from mlx_bricks.bench.user_report import document, format_table, plot, write_report

PROG = "python -m mlx_bricks.bench.user_path"
#: Decoder layers of the GPU group's models in the device script (``--full-size``: the models'
#: own 32 / 48): one call of at most 10 minutes writes and runs them all.
GPU_LAYERS = 8
#: Generated tokens per run (``--max-tokens`` of generate, ``-g`` of benchmark).
GPU_MAX_TOKENS = 32
CPU_MAX_TOKENS = 8
#: Seconds a single CLI process may take before it is stopped (its run records the timeout).
RUN_TIMEOUT_S = 1800
#: Run kinds, in the order they run for one prompt (``first`` is ``cold`` while the model's
#: home is still empty).
KINDS = ("stock", "first", "cached", "long_stock", "long")
_ALL_KINDS = (*KINDS, "cold")


# --- one process --------------------------------------------------------------------------------

_GEN_RE = {
    "prompt": re.compile(r"^Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", re.M),
    "generation": re.compile(r"^Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", re.M),
    "peak": re.compile(r"^Peak memory: ([\d.]+) GB", re.M),
}
_TRIAL_RE = re.compile(r"^Trial (\d+):\s+prompt_tps=([\d.]+), generation_tps=([\d.]+), "
                       r"peak_memory=([\d.]+), total_time=([\d.]+)", re.M)
#: The line each CLI prints once the model is loaded (and patched), before the prompt phase.
LOADED_MARK = {"generate": "==========", "benchmark": "Running warmup.."}


def parse_generate(stdout: str) -> dict:
    """The figures ``mlx_lm.generate`` prints (``Prompt: N tokens, X tokens-per-sec``,
    ``Generation: ...``, ``Peak memory: Y GB``).

    Raises:
        ValueError: one of the three lines is missing.
    """
    found = {k: r.search(stdout) for k, r in _GEN_RE.items()}
    missing = [k for k, m in found.items() if m is None]
    if missing:
        raise ValueError(f"stdout: no {', '.join(missing)} line in mlx_lm.generate's output")
    p, g, m = found["prompt"], found["generation"], found["peak"]
    return {"prompt_tokens": int(p[1]), "prompt_tps": float(p[2]),
            "generation_tokens": int(g[1]), "generation_tps": float(g[2]),
            "peak_memory_gb": float(m[1])}


def parse_benchmark(stdout: str, prompt_tokens: int, generation_tokens: int) -> dict:
    """The trials ``mlx_lm.benchmark`` prints (``Trial i: prompt_tps=..., generation_tps=...,
    peak_memory=..., total_time=...``), with their medians as the run's figures.

    Raises:
        ValueError: no trial line.
    """
    trials = [{"prompt_tps": float(t[2]), "generation_tps": float(t[3]),
               "peak_memory_gb": float(t[4]), "total_time_s": float(t[5])}
              for t in _TRIAL_RE.finditer(stdout)]
    if not trials:
        raise ValueError("stdout: no Trial line in mlx_lm.benchmark's output")

    def med(k):
        return statistics.median(t[k] for t in trials)

    return {"prompt_tokens": prompt_tokens, "prompt_tps": med("prompt_tps"),
            "generation_tokens": generation_tokens, "generation_tps": med("generation_tps"),
            "peak_memory_gb": max(t["peak_memory_gb"] for t in trials), "trials": trials}


def _child_env(home: Path) -> dict:
    env = dict(os.environ)
    env["MLX_BRICKS_HOME"] = str(home)
    env["PYTHONUNBUFFERED"] = "1"  # the loaded-mark line arrives when it is printed
    # the child imports this mlx_bricks, wherever the parent found it
    root = str(Path(__file__).resolve().parents[2])
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in parts:
        env["PYTHONPATH"] = os.pathsep.join([*parts, root])
    return env


def run_cli(argv: list[str], *, env: dict, stdin: str | None = None, mark: str | None = None,
            timeout: float = RUN_TIMEOUT_S) -> dict:
    """Run ``argv`` in a fresh process; its stdout and stderr, return code, wall seconds, and
    the seconds from the start to the first stdout line equal to ``mark`` (None if absent).
    A process past ``timeout`` seconds is killed (``timed_out``)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    out, err, seen = [], [], {}

    def read_out():
        for line in proc.stdout:
            if mark is not None and "mark" not in seen and line.rstrip("\n") == mark:
                seen["mark"] = time.perf_counter() - t0
            out.append(line)

    def read_err():
        err.extend(proc.stderr)

    threads = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for t in threads:
        t.start()
    try:
        if stdin is not None:
            proc.stdin.write(stdin)
        proc.stdin.close()
    except BrokenPipeError:  # the process ended before reading its prompt: its stderr says why
        pass
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        proc.wait()
    for t in threads:
        t.join()
    return {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
            "mark_s": seen.get("mark"), "stdout": "".join(out), "stderr": "".join(err),
            "timed_out": timed_out}


def _home_files(home: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(home)) if home.exists() else 0


def run_one(kind: str, model_dir: Path, home: Path, prompt_tokens: int, prompt_text: str,
            max_tokens: int, trials: int, log_dir: Path | None = None,
            timeout: float = RUN_TIMEOUT_S) -> dict:
    """One run (``kind`` of :data:`KINDS`, or ``cold``) in a fresh process, as its JSON entry
    (module docstring); a failed run has ``error`` (the return code and stderr's last lines)
    instead of the figures. A process killed by a signal (not the timeout) is run once more; the
    first one's end is kept in ``retried``.

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in _ALL_KINDS:
        raise ValueError(f"kind must be one of {_ALL_KINDS}, got {kind!r}")
    bricks = kind not in ("stock", "long_stock")
    long_lived = kind.startswith("long")
    cli = "benchmark" if long_lived else "generate"
    argv = [sys.executable, "-m", "mlx_lm", cli, "--model", str(model_dir)]
    if long_lived:
        argv += ["-p", str(prompt_tokens), "-g", str(max_tokens), "-n", str(trials)]
    else:
        argv += ["--prompt", "-", "--max-tokens", str(max_tokens)]
    if bricks:
        argv.append("--use-bricks")
    entry = {"kind": kind, "cli": f"mlx_lm.{cli}", "bricks": bricks,
             "argv": [Path(argv[0]).name, *argv[1:]], "home_files_before": _home_files(home),
             "load_average": {"before": load_average()}}
    home.mkdir(parents=True, exist_ok=True)

    def launch():
        return run_cli(argv, env=_child_env(home), stdin=None if long_lived else prompt_text,
                       mark=LOADED_MARK[cli], timeout=timeout)

    r = launch()
    if r["returncode"] < 0 and not r["timed_out"]:
        # Killed by a signal (once in ~1,400 CPU runs here: glibc's heap check aborting, after the
        # CLI had printed its figures): run it once more and keep the first run's end in
        # ``retried`` (a retried cold run finds what the first one wrote: ``home_files_before``).
        entry["retried"] = {"returncode": r["returncode"],
                            "stderr_tail": r["stderr"].strip().splitlines()[-5:],
                            "wall_s": r["wall_s"]}
        entry["home_files_before"] = _home_files(home)
        r = launch()
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"{model_dir.name}_p{prompt_tokens}_{kind}.log").write_text(
            f"$ {' '.join(entry['argv'])}\n--- stdout\n{r['stdout']}\n--- stderr\n{r['stderr']}")
    lines = [ln for ln in r["stderr"].splitlines() if ln.startswith("[mlx-bricks]")]
    entry["load_average"]["after"] = load_average()
    entry.update(wall_s=r["wall_s"], load_s=r["mark_s"], bricks_line=lines[0] if lines else None)
    try:
        if r["returncode"] != 0:
            raise ValueError(f"exit {r['returncode']}" + (" (timed out)" if r["timed_out"] else ""))
        figures = (parse_benchmark(r["stdout"], prompt_tokens, max_tokens) if long_lived
                   else parse_generate(r["stdout"]))
    except ValueError as e:
        tail = r["stderr"].strip().splitlines()[-5:]
        entry["error"] = f"{e}; stderr: {' | '.join(tail)}"[:2000]
        return entry
    entry.update(figures)
    entry["ttft_s"] = entry["prompt_tokens"] / entry["prompt_tps"]
    # a long-lived run's timed prompts come after its warm-up: no first token of the process
    entry["start_to_first_token_s"] = (None if entry["load_s"] is None or long_lived
                                       else entry["load_s"] + entry["ttft_s"])
    return entry


def ratios(stock: dict, patched: dict) -> dict | None:
    """Patched vs stock of one prompt (module docstring); None where either run failed."""
    if "error" in stock or "error" in patched:
        return None

    def div(a, b):
        return None if a is None or b is None or b == 0 else a / b

    return {"prompt_tps": div(patched["prompt_tps"], stock["prompt_tps"]),
            "generation_tps": div(patched["generation_tps"], stock["generation_tps"]),
            "peak_memory": div(patched["peak_memory_gb"], stock["peak_memory_gb"]),
            "ttft_s": div(stock["ttft_s"], patched["ttft_s"]),
            "start_to_first_token_s": div(stock["start_to_first_token_s"],
                                          patched["start_to_first_token_s"]),
            "wall_s": div(stock["wall_s"], patched["wall_s"])}


# --- one model ----------------------------------------------------------------------------------

def run_model(spec: ModelSpec, prompts, *, max_tokens: int, trials: int, work: Path,
              tokenizer: Path | None = None, log_dir: Path | None = None,
              deadline: float | None = None, keep: bool = False, on_run=None) -> dict:
    """Write ``spec``'s directory under ``work`` and run every kind of :data:`KINDS` for each
    prompt length of ``prompts`` (ascending), all with one ``MLX_BRICKS_HOME``
    (``work/<name>-home``, empty at the start: the first ``--use-bricks`` run is ``cold``).

    Args:
        spec: the model.
        prompts: prompt lengths in tokens.
        max_tokens: generated tokens per run.
        trials: the long-lived runs' timed trials.
        work: a directory for the model and its home (created).
        tokenizer: a model directory with the tokenizer (default: the default model's).
        log_dir: where each process's stdout and stderr are written (None: nowhere).
        deadline: ``time.monotonic()`` value after which no further run starts (the runs left
            are listed with ``skipped``); a run still going a minute after it is stopped.
        keep: keep the model directory (default: removed at the end; full-size ones are GBs).
        on_run: ``(entry)`` called after each run with the model's entry so far.

    Returns:
        ``{"model": ..., "prefill_step_size", "prompts": [{"tokens", "prefill_chunks", "runs":
        [...], "ratios": {kind: ...}}], "written": ...}``.

    Raises:
        ValueError: an empty or non-positive prompt length, ``max_tokens`` or ``trials`` < 1.
    """
    prompts = sorted(prompts)
    if not prompts or any(isinstance(p, bool) or not isinstance(p, int) or p < 2
                          for p in prompts):
        raise ValueError(f"prompts must be ints >= 2, got {prompts!r}")
    for name, v in (("max_tokens", max_tokens), ("trials", trials)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    work = Path(work)
    model_dir, home = work / spec.name, work / f"{spec.name}-home"
    if home.exists():
        shutil.rmtree(home)
    tokenizer = Path(tokenizer) if tokenizer is not None else default_tokenizer_dir()
    entry = {"model": {"name": spec.name, "what": spec.describe(), "config": spec.config,
                       "dtype": spec.dtype, "bits": spec.bits, "group_size": spec.group_size,
                       "mode": spec.mode},
             "prefill_step_size": PREFILL_STEP, "max_tokens": max_tokens, "trials": trials,
             "prompts": []}
    try:
        entry["written"] = write_model(spec, model_dir, tokenizer)
        tok = _load_tokenizer(model_dir)
        first = True
        for p in prompts:
            text = make_prompt(tok, p)
            item = {"tokens": p, "prefill_chunks": prefill_chunks(p), "runs": []}
            entry["prompts"].append(item)
            for kind in KINDS:
                if deadline is not None and time.monotonic() > deadline:
                    item["runs"].append({"kind": kind, "skipped": "time budget spent"})
                    continue
                timeout = (RUN_TIMEOUT_S if deadline is None
                           else min(RUN_TIMEOUT_S, max(60.0, deadline - time.monotonic() + 60)))
                label = "cold" if kind == "first" and first else kind
                run = run_one(label, model_dir, home, p, text, max_tokens, trials, log_dir,
                              timeout)
                if kind == "first":  # a failed cold run leaves the next prompt's cold
                    first = first and "error" in run
                item["runs"].append(run)
                if on_run is not None:
                    on_run(entry)
            by = {r["kind"]: r for r in item["runs"] if "skipped" not in r}
            item["ratios"] = {}
            for k, base in (("cold", "stock"), ("first", "stock"), ("cached", "stock"),
                            ("long", "long_stock")):
                if k in by and base in by:
                    item["ratios"][k] = ratios(by[base], by[k])
    finally:
        if not keep:
            shutil.rmtree(model_dir, ignore_errors=True)
    return entry


# --- the bench groups ---------------------------------------------------------------------------

def _work_dir() -> Path:
    """Where ``python -m mlx_bricks.bench`` writes the model directories:
    ``$MLX_BRICKS_BENCH_WORK`` if set, else a new temporary directory."""
    base = bricks_env.get("MLX_BRICKS_BENCH_WORK")
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix="user-path-", dir=base))
    return Path(tempfile.mkdtemp(prefix="mlx-bricks-user-path-"))


def _bench_run(spec: ModelSpec, prompts, max_tokens: int):
    def run(repeats: int) -> dict:
        work = _work_dir()
        try:
            return run_model(spec, prompts, max_tokens=max_tokens, trials=repeats, work=work)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    return run


def benchmarks() -> dict[str, Benchmark]:
    """The user's-path benchmarks by name (``user_path_{cpu,gpu}_<model>``), for
    ``bench.core``: each runs one model over its group's prompt lengths; ``--repeats`` is the
    long-lived runs' trial count."""
    table = {}
    for group, backend, models, prompts, max_tokens in (
            ("cpu", CPU, CPU_MODELS, CPU_PROMPTS, CPU_MAX_TOKENS),
            ("gpu", KERNEL, GPU_MODELS, GPU_PROMPTS, GPU_MAX_TOKENS)):
        for spec in models.values():
            if group == "gpu":
                prompts = GPU_PLAN[spec.name]
            name = f"user_path_{group}_{spec.name}"
            table[name] = Benchmark(
                name, backend,
                f"the user's path: mlx-lm's generate (stock, --use-bricks cold, cached) and "
                f"benchmark (long-lived) in fresh processes, prompts of "
                f"{', '.join(map(str, prompts))} tokens, {max_tokens} generated; "
                f"{spec.describe()}, random weights",
                None, run=_bench_run(spec, prompts, max_tokens))
    return table


# --- the device script --------------------------------------------------------------------------

def build_parser():
    """The parser of ``python -m mlx_bricks.bench.user_path``; a bad flag exits 2 with one
    line."""
    import argparse

    p = argparse.ArgumentParser(
        prog=PROG,
        description="The user's path: mlx-lm's generate and benchmark CLIs in fresh processes, "
        "stock and --use-bricks (cold, cached, long-lived), on random-weight model directories; "
        "JSON, logs and a plot into --out-dir.")
    p.add_argument("--group", choices=("cpu", "gpu"), default="cpu",
                   help="the model set and defaults (default: cpu)")
    p.add_argument("--models", nargs="+", metavar="NAME",
                   help="models of the group, in this order (default: all; cpu: "
                   f"{', '.join(CPU_MODELS)}, {TINY_LLAMA.name}; gpu: {', '.join(GPU_MODELS)})")
    p.add_argument("--prompts", nargs="+", type=int, metavar="TOKENS",
                   help=f"prompt lengths of every model (default: cpu {CPU_PROMPTS}; gpu: per "
                   f"model, {GPU_PLAN})")
    p.add_argument("--layers", type=int, default=None,
                   help=f"decoder layers of every model (default: cpu the model's own, gpu "
                   f"{GPU_LAYERS})")
    p.add_argument("--full-size", action="store_true",
                   help="the models' own layer counts (gpu: 32 / 48 layers; GBs to write)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"generated tokens (default: cpu {CPU_MAX_TOKENS}, gpu {GPU_MAX_TOKENS})")
    p.add_argument("--trials", type=int, default=3, help="long-lived timed trials (default: 3)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no run after this many seconds (the rest are listed as skipped)")
    p.add_argument("--tokenizer", default=None,
                   help="a model directory with the tokenizer files (default: the default "
                   "model's, mlx_bricks.default_model())")
    p.add_argument("--work", default=None,
                   help="where the model directories go (default: a temporary directory; each "
                   "model's is removed after its runs)")
    p.add_argument("--out-dir", required=True,
                   help="writes user_path_<group>.json (after every run), .md, .png and logs/")
    return _cli.one_line_errors(p)


def main(argv=None) -> int:
    """The device script: run a group, write JSON (after every run), a Markdown table, a plot
    and one log per process into ``--out-dir``; print the table.

    Raises:
        SystemExit: 2 on bad input (one line on stderr), 130 on Ctrl-C.
    """
    args = build_parser().parse_args(argv)
    return _cli.run_cli(PROG, lambda: _run(args))


def _run(args) -> int:
    known = {**CPU_MODELS, TINY_LLAMA.name: TINY_LLAMA} if args.group == "cpu" else GPU_MODELS
    names = args.models or list(CPU_MODELS if args.group == "cpu" else GPU_MODELS)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise _cli.CliError(f"--models: unknown {unknown}; known: {', '.join(known)}")
    layers = args.layers
    if layers is None and args.group == "gpu" and not args.full_size:
        layers = GPU_LAYERS
    try:  # checked before any model is written
        specs = {n: known[n].with_layers(None if args.full_size else layers) for n in names}
    except ValueError as e:
        raise _cli.CliError(f"--layers: {e}") from None
    max_tokens = args.max_tokens or (CPU_MAX_TOKENS if args.group == "cpu" else GPU_MAX_TOKENS)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.budget_s is None else time.monotonic() + args.budget_s
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="user-path-"))
    started = now()
    models: list = []
    json_path = out / f"user_path_{args.group}.json"

    def write(current=None):
        doc = document(args.group, started, models + ([current] if current else []))
        json_path.write_text(json.dumps(doc, indent=2) + "\n")
        return doc

    for n in names:
        spec = specs[n]
        prompts = args.prompts or (GPU_PLAN[n] if args.group == "gpu" else CPU_PROMPTS)
        if deadline is not None and time.monotonic() > deadline:
            models.append({"model": {"name": spec.name, "what": spec.describe()},
                           "skipped": "time budget spent"})
            continue
        print(f"[user_path] {spec.describe()}", file=sys.stderr, flush=True)
        models.append(run_model(spec, prompts, max_tokens=max_tokens, trials=args.trials,
                                work=work, tokenizer=args.tokenizer, log_dir=out / "logs",
                                deadline=deadline, on_run=write))
        write()
    table = write_report(write(), out / f"user_path_{args.group}", format_table, plot)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
