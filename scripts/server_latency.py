"""Latency of ``mlx_lm.server --use-bricks`` against stock ``mlx_lm.server``, in the same run.

Starts both servers on the embedded default model (the patched one on ``--bricks-backend``,
default ``reference``: on a machine without a GPU that is the bricks' own math through the
patched modules), then alternates load phases, stock first: ``--clients`` clients for
``--seconds`` against one server, then the same against the other, ``--rounds`` times, so both
see the same machine state. Each client sends tests/serving.py's ``LOAD_REQUESTS`` in turn
(both endpoints, streamed and not, greedy, ``--max-tokens`` tokens). Writes one JSON object:
per side the requests sent / answered / failed and the latency p50 / p95 / mean (seconds),
and ``p95_ratio`` = patched p95 / stock p95.

    .venv/bin/python scripts/server_latency.py --out bench/results/server_latency_cpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.serving import Load, Server, run_load, start_all  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--out", help="JSON file (default: standard output)")
    args = parser.parse_args(argv)

    from mlx_bricks.models import default_model

    model = default_model()
    logs = Path(tempfile.mkdtemp(prefix="server_latency_"))
    servers = {
        "stock": Server(["--model", model], logs / "stock.log"),
        "patched": Server(["--use-bricks", "--bricks-backend", args.backend, "--model", model],
                          logs / "patched.log"),
    }
    loads = {name: Load() for name in servers}
    loadavg = [os.getloadavg()[0]]
    try:
        start_all(servers)
        for name, s in servers.items():  # warm-up: first calls, the loaded model in place
            run_load(s.port, clients=1, seconds=0.1, max_tokens=args.max_tokens)
        for _ in range(args.rounds):
            for name, s in servers.items():
                got = run_load(s.port, args.clients, args.seconds, max_tokens=args.max_tokens)
                total = loads[name]
                total.sent += got.sent
                total.answered += got.answered
                total.failed += got.failed
                total.latencies += got.latencies
    finally:
        stopped = {name: s.stop() for name, s in servers.items()}
        loadavg.append(os.getloadavg()[0])
    sides = {}
    for name, load in loads.items():
        sides[name] = {"sent": load.sent, "answered": load.answered, "failed": len(load.failed),
                       "p50_s": load.percentile(0.50), "p95_s": load.percentile(0.95),
                       "mean_s": statistics.fmean(load.latencies),
                       "exit_status": stopped[name][0], "processes_left": stopped[name][1]}
    result = {
        "what": "mlx_lm.server latency, patched vs stock, alternating load phases",
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.system()} {platform.machine()}, {platform.python_version()}, "
                   f"{os.cpu_count()} CPUs",
        # 1-minute load average at the start and the end: a shared machine's load moves the
        # latencies of both sides far more than the patch does
        "loadavg_1min_start_end": loadavg,
        "backend": args.backend, "model": str(model), "clients": args.clients,
        "seconds_per_phase": args.seconds, "rounds": args.rounds, "max_tokens": args.max_tokens,
        **sides,
        "p95_ratio": sides["patched"]["p95_s"] / sides["stock"]["p95_s"],
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
