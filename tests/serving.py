"""A real ``mlx_lm.server`` as a subprocess, and its clients: for tests/test_server.py and
scripts/server_latency.py.

:class:`Server` starts ``mlx_lm.server`` (the installed console script, so ``--use-bricks`` goes
through the installed import hook) on 127.0.0.1 at a free port, waits until it answers, and stops
it (SIGINT, then SIGKILL after a grace period), checking that it leaves no process behind
(``mlx_bricks.bench.server_proc``, shared with the server bench).
:func:`ask` sends one OpenAI-style request with the ``openai`` client when it is installed, else
with ``http.client``; :func:`run_load` keeps N clients busy for T seconds and counts every
request.
"""
from __future__ import annotations

import http.client
import json
import os
import statistics
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from mlx_bricks.bench.server_proc import REQUEST_TIMEOUT, ServerProcess, start_all  # noqa: F401

try:
    import openai
except ImportError:  # the test extra installs it; http.client does the same requests
    openai = None

BIN = Path(sysconfig.get_path("scripts"))


def server_env() -> dict:
    """The environment of a test server: offline (an unknown model fails at once instead of
    trying the Hugging Face Hub), no backend override."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_BRICKS_BACKEND", "PYTHONPATH")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


class Server(ServerProcess):
    """``mlx_lm.server ARGS`` on 127.0.0.1 at a free port, its output in ``log_path``
    (``mlx_bricks.bench.server_proc.ServerProcess``), in :func:`server_env`.

    Args:
        args: the server's flags (no ``--host`` / ``--port``).
        log_path: file for its stdout and stderr.
        script: the console script (default ``mlx_lm.server`` beside this interpreter); a
            ``.py`` file runs with this interpreter too.
    """

    def __init__(self, args: list[str], log_path: Path, script: Path | None = None):
        script = Path(script) if script is not None else BIN / "mlx_lm.server"
        super().__init__([sys.executable, script, *args], log_path, env=server_env())


@dataclass
class Answer:
    """One completed request: the generated text, why it ended, the usage counts."""

    text: str
    finish_reason: str | None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    seconds: float = 0.0


def _payload(kind: str, prompt, max_tokens: int, stream: bool, extra: dict) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0.0, "stream": stream, **extra}
    if kind == "chat":
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def ask(port: int, kind: str, prompt, *, max_tokens: int = 8, stream: bool = False,
        **extra) -> Answer:
    """One greedy request: ``kind`` ``"chat"`` (``/v1/chat/completions``; ``prompt`` a string
    or a message list) or ``"text"`` (``/v1/completions``), streamed or not.

    Raises:
        RuntimeError: a status other than 200 (http.client) / the openai client's errors.
    """
    start = time.perf_counter()
    body = _payload(kind, prompt, max_tokens, stream, extra)
    answer = (_ask_openai if openai is not None else _ask_http)(port, kind, body)
    answer.seconds = time.perf_counter() - start
    return answer


def _ask_openai(port: int, kind: str, body: dict) -> Answer:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                           max_retries=0, timeout=REQUEST_TIMEOUT)
    known = {"model", "messages", "prompt", "max_tokens", "temperature", "stream",
             "stream_options", "seed", "stop"}
    kwargs = {"model": "default_model", **{k: v for k, v in body.items() if k in known}}
    kwargs["extra_body"] = {k: v for k, v in body.items() if k not in known}
    create = client.chat.completions.create if kind == "chat" else client.completions.create
    result = create(**kwargs)
    if not body["stream"]:
        choice = result.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        details = result.usage.prompt_tokens_details
        return Answer(text or "", choice.finish_reason, result.usage.prompt_tokens,
                      getattr(details, "cached_tokens", None))
    parts, finish, usage = [], None, None
    for chunk in result:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if kind == "chat" else choice.text
            parts.append(piece or "")
            finish = choice.finish_reason or finish
    details = getattr(usage, "prompt_tokens_details", None)
    return Answer("".join(parts), finish, getattr(usage, "prompt_tokens", None),
                  getattr(details, "cached_tokens", None))


def _ask_http(port: int, kind: str, body: dict) -> Answer:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT)
    try:
        conn.request("POST", path, body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{path}: HTTP {response.status}: {response.read()!r}")
        if not body["stream"]:
            data = json.loads(response.read())
            choice, usage = data["choices"][0], data["usage"]
            text = choice["message"]["content"] if kind == "chat" else choice["text"]
            return Answer(text or "", choice["finish_reason"], usage["prompt_tokens"],
                          usage.get("prompt_tokens_details", {}).get("cached_tokens"))
        parts, finish, usage = [], None, {}
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            for choice in data["choices"]:
                piece = choice.get("delta", {}).get("content") if kind == "chat" \
                    else choice.get("text")
                parts.append(piece or "")
                finish = choice.get("finish_reason") or finish
        return Answer("".join(parts), finish, usage.get("prompt_tokens"),
                      usage.get("prompt_tokens_details", {}).get("cached_tokens"))
    finally:
        conn.close()


#: The load's requests, in turn: both endpoints, streamed and not (short greedy answers).
LOAD_REQUESTS = (
    ("chat", "What is the capital of France?", False),
    ("text", "The three primary colours are", True),
    ("chat", "Name a planet of the solar system.", True),
    ("text", "One, two, three,", False),
)


@dataclass
class Load:
    """What :func:`run_load` saw: requests sent, answered (200 with text), failed (with the
    errors), and the latency of each answered one (seconds)."""

    sent: int = 0
    answered: int = 0
    failed: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        """The ``q``-quantile of the latencies (``statistics.quantiles``, inclusive)."""
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[round(q * 100) - 1]


def run_load(port: int, clients: int, seconds: float, *, max_tokens: int = 8) -> Load:
    """``clients`` threads, each sending :data:`LOAD_REQUESTS` in turn (one at a time) until
    ``seconds`` have passed; every request is counted, answered or failed."""
    load, lock = Load(), threading.Lock()
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        n = i
        while time.monotonic() < deadline:
            kind, prompt, stream = LOAD_REQUESTS[n % len(LOAD_REQUESTS)]
            n += 1
            with lock:
                load.sent += 1
            try:
                answer = ask(port, kind, prompt, stream=stream, max_tokens=max_tokens)
            except Exception as e:  # noqa: BLE001 (counted: a load test must see every failure)
                with lock:
                    load.failed.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                if answer.text:
                    load.answered += 1
                    load.latencies.append(answer.seconds)
                else:
                    load.failed.append(f"empty answer to {prompt!r}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return load
