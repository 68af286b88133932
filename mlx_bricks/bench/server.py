"""The server as users run it for agents (issue 44): ``mlx_lm.server`` stock and
``mlx_lm.server --use-bricks``, fresh processes, the ``openai`` client, same machine, same call.

For one model directory (random weights in real shapes: ``bench.user_path.write_model``) both
servers are started (``python -m mlx_lm server --model DIR``, the same flags but
``--use-bricks``; the bricks server with its defaults: ``--bricks-tune auto``, decisions taken
at load before the first request, in an empty ``MLX_BRICKS_HOME``), one after the other so the
bricks server measures on a quiet device, and each is warmed up with short requests
(:attr:`Settings.warmup_tokens`: the first calls of each process, MLX's kernel builds). Then,
alternating which server goes first at each step so both see the same machine:

- **chat**: one conversation: a system prompt, then user turns whose text grows the context to
  :attr:`Settings.turns` tokens (exactly: counted with the model's chat template, as the server
  counts it), each request streamed (``stream_options.include_usage``), ``max_tokens`` small,
  the conversation carried over so mlx-lm's LRU prompt cache serves the shared prefix. The
  assistant reply is forced to one repeated token by ``logit_bias`` (a token whose text
  re-tokenizes to itself in the chat template): both servers then carry the same conversation
  and the cache finds its own tokens back (random weights' free replies do not round-trip
  through text, and hybrid caches such as Gated DeltaNet's cannot be trimmed to a prefix).
  Per turn: ``prompt_tokens`` and ``cached_tokens`` (the server's usage), ``ttft_s`` (request
  sent to the first streamed content), ``generation_tps`` (completion tokens after the first
  over their time), ``wall_s``.
- **concurrent**: :attr:`Settings.concurrent` requests of about
  :attr:`Settings.concurrent_tokens` tokens each, sent at once from threads: per request
  TTFT and total seconds, and the batch's wall time.
- **memory**: the server processes' peak: GPU memory per process from ``nvidia-smi
  --query-compute-apps=pid,used_memory`` polled every :data:`POLL_S` s where nvidia-smi lists
  them, else the process's ``VmHWM`` (host memory, /proc); ``memory.source`` says which.

JSON: date, device, versions, per model: the servers (argv, seconds to ready, warm-ups, the
``[mlx-bricks]`` log line, exit status), per side and turn the figures, p50 / p95 of TTFT over
the turns, ratios stock / bricks (TTFT: above 1 the bricks are faster) and bricks / stock
(generation tok/s), the peak memory difference, and the issue's targets. Groups:
``server_cpu`` (the tiny llama, contexts of a few hundred tokens) and ``server_gpu`` (Llama-3-8B
4-bit, Qwen3.5-35B-A3B 4-bit, gpt-oss-20b MXFP4 shapes, ``GPU_LAYERS`` layers each, contexts
8k -> 32k); the script is this module's CLI (``--help``).
"""
from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mlx_bricks.bench import user_path as up
from mlx_bricks.bench.case import CPU, KERNEL, Benchmark
from mlx_bricks.bench.record import now
from mlx_bricks.bench.server_plan import (  # noqa: F401  (the plan's names, re-exported)
    CPU_SERVER_MODELS,
    CPU_SETTINGS,
    GPU_SERVER_MODELS,
    GPU_SETTINGS,
    MEMORY_TARGET_MIB,
    MODEL_START_S,
    POLL_S,
    SIDES,
    TTFT_TARGETS,
    Plan,
    Settings,
    chat_tokens,
    make_plan,
    reply_token,
)
from mlx_bricks.bench.server_proc import REQUEST_TIMEOUT, ServerProcess
from mlx_bricks.bench.user_report import document, write_report

def stream_chat(port: int, messages: list, *, max_tokens: int, reply_id: int | None = None,
                timeout: float = REQUEST_TIMEOUT) -> dict:
    """One streamed greedy chat request with the ``openai`` client.

    Returns:
        ``prompt_tokens``, ``cached_tokens``, ``completion_tokens`` (the server's usage),
        ``ttft_s`` (sent to the first content chunk), ``generation_tps`` (completion tokens
        after the first over the seconds from the first content chunk to the last; None for
        one token), ``wall_s``, ``finish_reason``, ``text``.
    """
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=timeout)
    bias = {str(reply_id): 100} if reply_id is not None else None
    t0 = time.perf_counter()
    first = last = usage = finish = None
    parts = []
    for chunk in client.chat.completions.create(
            model="default_model", messages=messages, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, logit_bias=bias):
        now = time.perf_counter()
        usage = chunk.usage or usage
        for c in chunk.choices:
            if c.delta.content:
                first = now if first is None else first
                last = now
                parts.append(c.delta.content)
            finish = c.finish_reason or finish
    wall = time.perf_counter() - t0
    details = getattr(usage, "prompt_tokens_details", None)
    n = getattr(usage, "completion_tokens", None)
    return {"prompt_tokens": getattr(usage, "prompt_tokens", None),
            "cached_tokens": getattr(details, "cached_tokens", None), "completion_tokens": n,
            "ttft_s": None if first is None else first - t0,
            "generation_tps": (n - 1) / (last - first) if n and n > 1 and last > first else None,
            "wall_s": wall, "finish_reason": finish, "text": "".join(parts)}


def concurrent_requests(port: int, prompts: list, *, max_tokens: int, reply_id: int,
                        timeout: float = REQUEST_TIMEOUT) -> dict:
    """``prompts`` as single-turn chat requests sent at once (one thread each, released
    together): per request :func:`stream_chat`'s figures, and the batch's ``wall_s``."""
    gate = threading.Barrier(len(prompts) + 1)

    def one(text):
        gate.wait()
        return stream_chat(port, [{"role": "user", "content": text}], max_tokens=max_tokens,
                           reply_id=reply_id, timeout=timeout)

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        gate.wait()
        t0 = time.perf_counter()
        requests = [f.result() for f in futures]
    wall = time.perf_counter() - t0
    return {"requests": [{k: v for k, v in r.items() if k != "text"} for r in requests],
            "wall_s": wall, **percentiles([r["ttft_s"] for r in requests], "ttft")}


def percentiles(values: list, name: str) -> dict:
    """``{name}_p50_s`` and ``{name}_p95_s`` of ``values`` (numpy, linear interpolation);
    None where a value is missing."""
    if not values or any(v is None for v in values):
        return {f"{name}_p50_s": None, f"{name}_p95_s": None}
    p50, p95 = np.percentile(values, [50, 95])
    return {f"{name}_p50_s": float(p50), f"{name}_p95_s": float(p95)}


# --- memory -------------------------------------------------------------------------------------

def vm_hwm_mib(pid: int) -> float | None:
    """The process's peak resident host memory (``VmHWM`` of /proc/PID/status), MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class MemoryPoll:
    """Polls ``nvidia-smi`` every ``interval`` s in a thread (where it exists): the peak GPU
    memory of each watched process (``--query-compute-apps=pid,used_memory``, MiB) and the
    GPU's total used memory (``--query-gpu=memory.used``, every process, MiB). Processes listed
    before the first watched one starts (this one, after writing a model) are left out."""

    def __init__(self, interval: float = POLL_S):
        self.interval = interval
        self.smi = shutil.which("nvidia-smi")
        self.pids, self.peak, self.order, self.before = {}, {}, [], set()
        self.total_peak, self.polls = None, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        if self.smi:
            self.before = {pid for pid, _ in self._apps()}
            self._thread.start()

    def add(self, name: str, pid: int) -> None:
        """Watch ``pid`` under ``name`` from now on (start them in the order to match)."""
        self.pids[name] = pid

    def _query(self, what: str) -> list[list[str]]:
        try:
            out = subprocess.run([self.smi, what, "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return []
        return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]

    def _apps(self) -> list[tuple[str, int]]:
        return [(r[0], int(r[1])) for r in self._query("--query-compute-apps=pid,used_memory")
                if len(r) == 2 and r[1].isdigit()]

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid, used in self._apps():
                if pid not in self.before:
                    self.peak[pid] = max(self.peak.get(pid, 0), used)
                    if pid not in self.order:
                        self.order.append(pid)
            used = [int(r[0]) for r in self._query("--query-gpu=memory.used") if r[0].isdigit()]
            if used:
                self.total_peak = max(self.total_peak or 0, sum(used))
            self.polls += 1
            self._stop.wait(self.interval)

    def stop(self) -> dict:
        """Stop polling. Per watched name ``gpu_peak_mib`` and ``vm_hwm_mib``; ``key``: the
        one the summary compares (``gpu_peak_mib`` where nvidia-smi listed the processes,
        ``vm_hwm_mib`` without nvidia-smi, None where it exists but listed none of them) and
        ``source`` in words."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        gpu = {name: self.peak.get(str(pid)) for name, pid in self.pids.items()}
        source = "nvidia-smi --query-compute-apps used_memory, per process"
        if not any(gpu.values()) and len(self.order) == len(self.pids) > 0:
            # another pid namespace (a container): the servers appear in the order they started
            gpu = {name: self.peak[pid] for name, pid in zip(self.pids, self.order)}
            source += " (matched in the order the servers started: nvidia-smi's pids differ)"
        if all(v is not None for v in gpu.values()) and gpu:
            key = "gpu_peak_mib"
        elif not self.smi:
            key, source = "vm_hwm_mib", "/proc VmHWM (host memory, per process; no nvidia-smi)"
        else:
            key, source = None, ("nvidia-smi listed no server process: no per-server GPU figure "
                                 "(gpu_total_used_peak_mib: the whole GPU, both servers)")
        per = {name: {"gpu_peak_mib": gpu.get(name), "vm_hwm_mib": vm_hwm_mib(pid)}
               for name, pid in self.pids.items()}
        return {"source": source, "key": key, "nvidia_smi": self.smi, "polls": self.polls,
                "gpu_total_used_peak_mib": self.total_peak, **per}


# --- one model ----------------------------------------------------------------------------------

_BRICKS_LINE = re.compile(r"\[mlx-bricks\] \S+: backend: .*")


def _server(model_dir: Path, bricks: bool, home: Path, log_dir: Path) -> ServerProcess:
    env = up._child_env(home)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir)]
    side = "bricks" if bricks else "stock"
    return ServerProcess(argv + (["--use-bricks"] if bricks else []),
                         log_dir / f"{model_dir.name}_{side}.log", env=env)


def _late(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _timeout(deadline: float | None) -> float:
    """Seconds a request or a start may take: :data:`REQUEST_TIMEOUT`, or up to two minutes
    past the deadline (at least one)."""
    if deadline is None:
        return REQUEST_TIMEOUT
    return min(REQUEST_TIMEOUT, max(60.0, deadline - time.monotonic() + 120))


def _one_line(e: Exception) -> str:
    """The exception in one line; a long one (a server's log) keeps its start and its end."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 2000 else f"{text[:400]} ... {text[-1500:]}"


def run_model(spec: up.ModelSpec, settings: Settings, *, work: Path, tokenizer=None,
              log_dir: Path | None = None, deadline: float | None = None,
              start_by: float | None = None, keep: bool = False, on_phase=None) -> dict:
    """Write ``spec``'s directory under ``work``, run both servers through the chat and the
    concurrent requests (module docstring), stop them.

    Args:
        spec: the model.
        settings: the requests.
        work: a directory for the model, its ``MLX_BRICKS_HOME`` (emptied) and the logs.
        tokenizer: a model directory with the tokenizer (default: the default model's).
        log_dir: where each server's log goes (default: ``work/logs``).
        deadline: ``time.monotonic()`` after which no phase starts (listed as skipped).
        start_by: ``time.monotonic()`` after which the model is not started (default:
            ``deadline``).
        keep: keep the model directory (default: removed at the end).
        on_phase: ``(entry)`` called after each phase with the entry so far.

    Returns:
        The model's JSON entry: ``model``, ``settings``, ``written``, ``servers``, ``chat``,
        ``concurrent``, ``memory``, ``summary`` (:func:`summarize`); ``error`` where a phase
        failed; only ``model`` and ``skipped`` past the deadline.

    Raises:
        ValueError: bad settings (before anything is written or started).
    """
    if _late(deadline if start_by is None else start_by):
        return {"model": {"name": spec.name, "what": spec.describe()},
                "skipped": "time budget spent"}
    work = Path(work)
    tokenizer = Path(tokenizer) if tokenizer is not None else up.default_tokenizer_dir()
    plan = make_plan(up._load_tokenizer(tokenizer), settings)
    model_dir, home = work / spec.name, work / f"{spec.name}-home"
    log_dir = Path(log_dir) if log_dir is not None else work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(home, ignore_errors=True)
    entry = {"model": {"name": spec.name, "what": spec.describe(), "config": spec.config,
                       "dtype": spec.dtype, "bits": spec.bits, "group_size": spec.group_size,
                       "mode": spec.mode},
             "settings": {**dataclasses.asdict(settings), "reply_token": plan.reply_id},
             "servers": {}, "chat": {side: [] for side in SIDES}}
    servers, poll = {}, MemoryPoll()

    def phase():
        if on_phase is not None:
            on_phase(entry)

    try:
        entry["written"] = up.write_model(spec, model_dir, tokenizer)
        for side in SIDES:  # one at a time: the bricks server tunes at load on a quiet device
            s = servers[side] = _server(model_dir, side == "bricks", home, log_dir)
            poll.add(side, s.pid)
            info = entry["servers"][side] = {"argv": [Path(s.argv[0]).name, *s.argv[1:]],
                                             "ready_s": s.wait_ready(_timeout(deadline))}
            info["warmups"] = [stream_chat(s.port, [{"role": "user", "content": w}],
                                           max_tokens=2, timeout=_timeout(deadline))
                               for w in plan.warmups]
            found = _BRICKS_LINE.search(s.log())
            info["bricks_line"] = found.group(0) if found else None
        phase()
        for i, target in enumerate(settings.turns):
            order = SIDES if i % 2 == 0 else SIDES[::-1]
            for side in order:
                if _late(deadline):
                    entry["chat"][side].append({"turn": i, "skipped": "time budget spent"})
                    continue
                r = stream_chat(servers[side].port, plan.messages(i),
                                max_tokens=settings.max_tokens, reply_id=plan.reply_id,
                                timeout=_timeout(deadline))
                r.update(turn=i, target_tokens=target, first=order[0],
                         reply_as_planned=r.pop("text") == plan.reply)
                entry["chat"][side].append(r)
            phase()
        entry["concurrent"] = {}
        order = SIDES if len(settings.turns) % 2 == 0 else SIDES[::-1]
        for side in order:
            entry["concurrent"][side] = ({"skipped": "time budget spent"} if _late(deadline) else
                                         concurrent_requests(servers[side].port, plan.concurrent,
                                                             max_tokens=settings.max_tokens,
                                                             reply_id=plan.reply_id,
                                                             timeout=_timeout(deadline)))
            entry["concurrent"][side]["first"] = order[0]
        phase()
    except Exception as e:  # noqa: BLE001 (recorded: the other models still run)
        entry["error"] = _one_line(e)
    finally:
        entry["memory"] = poll.stop()
        for side, s in servers.items():
            code, left = s.stop()
            entry["servers"].setdefault(side, {}).update(exit_status=code, processes_left=left)
        if not keep:
            shutil.rmtree(model_dir, ignore_errors=True)
    entry["summary"] = summarize(entry)
    return entry


def summarize(entry: dict) -> dict:
    """Per side p50 / p95 of the chat's TTFT over its turns and the median generation tok/s;
    ``ratios``: per turn and of those, stock / bricks for times (above 1: the bricks server is
    faster), bricks / stock for tok/s, and the peak memory difference (bricks - stock, MiB);
    ``targets``: the issue's, and whether they were met (None where not measured)."""
    def ok(side):
        return [t for t in entry.get("chat", {}).get(side, []) if t.get("ttft_s") is not None]

    def div(a, b):
        return None if a is None or b is None or b == 0 else a / b

    out = {}
    for side in SIDES:
        tps = [t["generation_tps"] for t in ok(side) if t["generation_tps"] is not None]
        out[side] = {**percentiles([t["ttft_s"] for t in ok(side)], "ttft"),
                     "generation_tps_median": float(np.median(tps)) if tps else None}
    by_turn = {side: {t["turn"]: t for t in ok(side)} for side in SIDES}
    per_turn = [{"turn": i, "context_tokens": by_turn["stock"][i]["prompt_tokens"],
                 "ttft": div(by_turn["stock"][i]["ttft_s"], by_turn["bricks"][i]["ttft_s"]),
                 "generation_tps": div(by_turn["bricks"][i]["generation_tps"],
                                       by_turn["stock"][i]["generation_tps"])}
                for i in sorted(set(by_turn["stock"]) & set(by_turn["bricks"]))]
    conc = entry.get("concurrent", {})
    s_c, b_c = conc.get("stock", {}), conc.get("bricks", {})
    mem = entry.get("memory", {})
    s_m, b_m = (mem.get(side, {}).get(mem.get("key") or "") for side in SIDES)
    ratios = {"ttft_per_turn": per_turn,
              "ttft_p50": div(out["stock"]["ttft_p50_s"], out["bricks"]["ttft_p50_s"]),
              "ttft_p95": div(out["stock"]["ttft_p95_s"], out["bricks"]["ttft_p95_s"]),
              "generation_tps_median": div(out["bricks"]["generation_tps_median"],
                                           out["stock"]["generation_tps_median"]),
              "concurrent_ttft_p50": div(s_c.get("ttft_p50_s"), b_c.get("ttft_p50_s")),
              "concurrent_wall": div(s_c.get("wall_s"), b_c.get("wall_s")),
              "peak_memory": div(b_m, s_m),
              "peak_memory_delta_mib": None if s_m is None or b_m is None else b_m - s_m}
    want = TTFT_TARGETS.get(entry["model"]["name"])
    ttfts = [t["ttft"] for t in per_turn]
    targets = {"ttft_each_turn_at_least": want,
               "ttft_met": None if want is None or not ttfts or None in ttfts
               else min(ttfts) >= want,
               "peak_memory_delta_mib_at_most": MEMORY_TARGET_MIB,
               "memory_met": None if ratios["peak_memory_delta_mib"] is None
               else ratios["peak_memory_delta_mib"] <= MEMORY_TARGET_MIB}
    return {**out, "ratios": ratios, "targets": targets}


# --- the bench groups ---------------------------------------------------------------------------

def group_models(group: str) -> dict:
    """The models of a group by name, at the sizes they run (gpu: ``GPU_LAYERS`` layers)."""
    if group == "cpu":
        return dict(CPU_SERVER_MODELS)
    return {n: up.GPU_MODELS[n].with_layers(up.GPU_LAYERS) for n in GPU_SERVER_MODELS}


def benchmarks() -> dict[str, Benchmark]:
    """``server_{cpu,gpu}_<model>`` for ``bench.core`` (run only when named; ``--repeats`` is
    not used: one conversation and one concurrent batch per server)."""
    table = {}
    for group, backend, settings in (("cpu", CPU, CPU_SETTINGS), ("gpu", KERNEL, GPU_SETTINGS)):
        for name, spec in group_models(group).items():
            def run(repeats, spec=spec, settings=settings):
                work = up._work_dir()
                try:
                    return run_model(spec, settings, work=work)
                finally:
                    shutil.rmtree(work, ignore_errors=True)

            table[f"server_{group}_{name}"] = Benchmark(
                f"server_{group}_{name}", backend,
                f"mlx_lm.server stock vs --use-bricks (openai client): a chat growing to "
                f"{', '.join(map(str, settings.turns))} tokens with the prompt cache, "
                f"{settings.concurrent} concurrent requests of {settings.concurrent_tokens} "
                f"tokens; {spec.describe()}, random weights", None, run=run)
    return table


def main(argv=None) -> int:
    """The device script (``--help``): run a group, write ``server_<group>.json`` (after every
    phase), ``.md`` and ``.png`` and the servers' logs into ``--out-dir``; print the table."""
    from mlx_bricks.bench.server_report import format_table, parse_args, plot

    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    deadline = start_by = None
    if args.budget_s is not None:
        deadline = time.monotonic() + args.budget_s
        start_by = deadline - MODEL_START_S[args.group]
    started, models = now(), []

    def write(current=None):
        doc = document(args.group, started, models + ([current] if current else []))
        doc["group"] = f"server_{args.group}"
        (out / f"server_{args.group}.json").write_text(json.dumps(doc, indent=2) + "\n")
        return doc

    with tempfile.TemporaryDirectory(prefix="server-bench-") as tmp:
        for spec in args.specs.values():
            print(f"[server] {spec.describe()}", file=sys.stderr, flush=True)
            models.append(run_model(spec, args.settings, work=Path(args.work or tmp),
                                    tokenizer=args.tokenizer, log_dir=out / "logs",
                                    deadline=deadline, start_by=start_by, on_phase=write))
            write()
    print(write_report(write(), out / f"server_{args.group}", format_table, plot))
    return 0


if __name__ == "__main__":
    sys.exit(main())
