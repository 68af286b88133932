"""A real ``mlx_lm.server`` as a subprocess on 127.0.0.1: for the server bench
(``bench.server``) and the server tests (tests/serving.py builds its ``Server`` on it).

:class:`ServerProcess` starts a server command line at a free port, waits until ``/health``
answers, and stops it (SIGINT, then SIGKILL after a grace period), checking that it leaves no
process behind. Linux ``/proc`` is read for the children.
"""
from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

#: Seconds a server may take to answer ``/health`` (loading, patching, tuning at load).
START_TIMEOUT = 600
#: Seconds one HTTP request may take.
REQUEST_TIMEOUT = 600
#: Seconds between SIGINT and SIGKILL when stopping.
STOP_GRACE = 60


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (the server binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


class ServerProcess:
    """``argv`` (an ``mlx_lm.server`` command line without ``--host`` / ``--port``) on
    127.0.0.1 at a free port, in a session of its own, its stdout and stderr in ``log_path``.

    Args:
        argv: the command line (interpreter, script or ``-m mlx_lm server``, flags).
        log_path: file for its output.
        env: its environment (None: this process's).
        cwd: its working directory (None: ``log_path``'s directory).

    Attributes:
        port: the port it listens on.
        started: ``time.perf_counter()`` when it was started.
    """

    def __init__(self, argv: list, log_path: str | os.PathLike, *, env: dict | None = None,
                 cwd: str | os.PathLike | None = None):
        self.port = free_port()
        self.log_path = Path(log_path)
        self.argv = [*map(str, argv), "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env, cwd=cwd if cwd is not None else self.log_path.parent,
                                     start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Until ``/health`` answers 200 (the HTTP server and its generation thread run).

        Returns:
            Seconds from the start of the process to that answer.

        Raises:
            RuntimeError: the server exited or did not answer within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.request("GET", "/health", timeout=5)[0] == 200:
                    return time.perf_counter() - self.started
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server did not answer within {timeout} s:\n{self.log()}")

    def request(self, method: str, path: str, body=None, *, raw: bytes | None = None,
                timeout: float = REQUEST_TIMEOUT) -> tuple[int, bytes]:
        """``(status, body)`` of one HTTP request; ``body`` is sent as JSON, ``raw`` as is."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def stop(self) -> tuple[int, list[int]]:
        """SIGINT (the server's own shutdown), SIGKILL after ``STOP_GRACE`` seconds.

        Returns:
            ``(exit status, child processes still alive afterwards)``.
        """
        kids = children(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=STOP_GRACE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        alive = [k for k in kids if Path(f"/proc/{k}").exists()]
        for k in alive:
            os.kill(k, signal.SIGKILL)
        return self.proc.returncode, alive


def start_all(servers: dict) -> dict:
    """Wait until every server of ``{name: ServerProcess}`` answers (they start in parallel);
    on a failure stop them all and re-raise."""
    try:
        for s in servers.values():
            s.wait_ready()
    except BaseException:
        for s in servers.values():
            s.stop()
        raise
    return servers
