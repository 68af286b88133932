"""Start one command as the N ranks of an ``mx.distributed`` group on this host.

What ``mlx.launch`` does for local ranks, reduced to the environment each MLX backend reads
(mlx 0.32, ``mlx/distributed/*/``): the **ring** backend reads ``MLX_RANK`` and
``MLX_HOSTFILE``, a JSON list with one list of ``"ip:port"`` addresses per rank (here one
loopback address each); **nccl** reads ``MLX_RANK``, ``MLX_WORLD_SIZE``, ``NCCL_HOST_IP`` and
``NCCL_PORT`` (rank 0's address), and each rank sees one GPU through ``CUDA_VISIBLE_DEVICES``.
NVLink multicast (NVLS) stays off for NCCL (``NCCL_NVLS_ENABLE=0`` is forced: on the shared GPU
hosts it can take the GPUs out of service). Used by the sharding tests (``tests/test_shard.py``,
``tests/test_shard_gpu.py``), which need each rank's exit status and output separately; users
start ranks with ``mlx.launch`` (docs/sharding.md).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: Backends this launcher can start.
BACKENDS = ("ring", "nccl")
#: NCCL settings every rank gets (NVLink multicast off; see the module docstring).
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class RankResult:
    """One rank's process: ``returncode`` (None when it was killed at the timeout), output."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on 127.0.0.1 now (bound and released; another process
    could take one before the ranks bind it, which then fails their connection loudly)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def rank_envs(n: int, backend: str, workdir: str | os.PathLike) -> list[dict[str, str]]:
    """The environment variables of each of ``n`` ranks for ``backend`` (module docstring);
    the ring hostfile is written to ``workdir``.

    Raises:
        ValueError: ``n`` < 1 or an unknown backend.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "ring":
        hostfile = Path(workdir) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        return [{"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)} for r in range(n)]
    port = free_ports(1)[0]
    return [dict(NCCL_SAFE_ENV, MLX_RANK=str(r), MLX_WORLD_SIZE=str(n),
                 NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(port), CUDA_VISIBLE_DEVICES=str(r))
            for r in range(n)]


def _wait(procs: list, timeout: float, grace: float) -> list[int | None]:
    """Exit codes of ``procs``; the ones still running at ``timeout``, or ``grace`` seconds
    after another rank failed (its peers would wait in a collective), are killed (None)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + grace)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    codes = []
    for p in procs:  # only the processes started here, by their own handle
        code = p.poll()
        if code is None:
            p.kill()
            p.wait()
        codes.append(code)
    return codes


def launch_local(cmd: list[str], n: int, backend: str, *, timeout: float,
                 env: dict[str, str] | None = None, cwd=None,
                 grace: float = 10.0) -> list[RankResult]:
    """Run ``cmd`` as ranks ``0 .. n-1`` of a ``backend`` group on this host and wait.

    Args:
        cmd: the command (argv list), the same for every rank.
        n: number of ranks.
        backend: ``"ring"`` (TCP over loopback; CPU or GPU) or ``"nccl"`` (one GPU per rank).
        timeout: seconds for all ranks together; ranks still running then are killed (their
            ``returncode`` is None).
        grace: once a rank exits with a nonzero status, seconds the others get before they
            are killed (they may be waiting for it in a collective).
        env: extra environment variables (on top of this process's).
        cwd: working directory of the ranks.

    Returns:
        One :class:`RankResult` per rank, in rank order.

    Raises:
        ValueError: see :func:`rank_envs`.
    """
    with tempfile.TemporaryDirectory(prefix="mlx-bricks-launch-") as tmp:
        envs = rank_envs(n, backend, tmp)
        procs, outs = [], []
        for r, renv in enumerate(envs):
            out = (open(Path(tmp) / f"rank{r}.out", "w+"), open(Path(tmp) / f"rank{r}.err", "w+"))
            outs.append(out)
            procs.append(subprocess.Popen(cmd, env={**os.environ, **(env or {}), **renv},
                                          cwd=cwd, stdout=out[0], stderr=out[1],
                                          stdin=subprocess.DEVNULL))
        codes = _wait(procs, timeout, grace)
        results = []
        for r, (o, e) in enumerate(outs):
            o.seek(0)
            e.seek(0)
            results.append(RankResult(r, codes[r], o.read(), e.read()))
            o.close()
            e.close()
        return results
