"""``mlx_lm.server --use-bricks`` as clients meet it: real servers, real HTTP, on 127.0.0.1.

Three servers run for the module, side by side, on the embedded default model: stock mlx-lm,
``--use-bricks`` (``reference`` backend: this machine has no GPU, and a named backend patches
every module), and ``--use-bricks --bricks-kv q8_0``. Requests go through the ``openai`` client
(http.client where it is not installed), concurrently, streamed and not, to both endpoints; the
patched servers must give stock's greedy answers, stock's HTTP errors, reuse and trim their
prompt caches like stock, survive a client that disconnects, and lose no request under load.
A fourth server runs a tiny random model on the MSL emulator with one kernel source broken: the
first-call guard falls back to stock for the process and the request completes.

Every server is a subprocess stopped by a finalizer (SIGINT, SIGKILL after a grace period);
all server tests share one xdist worker (``xdist_group``), so each starts once.
"""
from __future__ import annotations

import json
import re
import socket
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mlx_bricks.entry.hook import PTH_NAME
from tests.serving import Server, ask, run_load, start_all

pytestmark = pytest.mark.xdist_group("server")

ROOT = Path(__file__).resolve().parent
#: Short prompts with confident greedy answers (8 tokens each).
PROMPTS = (
    ("chat", "What is the capital of France?", False),
    ("chat", "Name the largest planet of the solar system.", True),
    ("text", "The capital of France is", False),
    ("text", "Monday, Tuesday, Wednesday,", True),
)
#: The tiny model's context (``max_position_embeddings``): a longer prompt is cheap here.
TINY_CONTEXT = 64


def _require_hook():
    site = Path(sysconfig.get_path("purelib"))
    if not (site / PTH_NAME).exists():
        pytest.skip(f"mlx-bricks is not installed here ({site / PTH_NAME} is missing): "
                    "`pip install -e .` installs the hook")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """A random 2-layer llama (hidden 128, head_dim 64, GQA 2:1, float16) with the default
    model's tokenizer, context ``TINY_CONTEXT``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    d = tmp_path_factory.mktemp("tiny")
    config = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
              "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1,
              "rms_norm_eps": 1e-5, "vocab_size": 49152, "tie_word_embeddings": True,
              "max_position_embeddings": TINY_CONTEXT, "torch_dtype": "float16"}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.float16)
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (d / "config.json").write_text(json.dumps(config))
    for f in default_model_dir.iterdir():
        if f.name != "config.json" and not f.name.endswith(".safetensors"):
            (d / f.name).write_bytes(f.read_bytes())
    return d


@pytest.fixture(scope="module")
def servers(tmp_path_factory, default_model_dir, request):
    """``{"stock", "bricks", "q8"}`` -> running :class:`Server` (started in parallel)."""
    _require_hook()
    logs = tmp_path_factory.mktemp("logs")
    bricks = ["--use-bricks", "--bricks-backend", "reference", "--bricks-report"]
    started = {
        "stock": Server(["--model", default_model_dir], logs / "stock.log"),
        # no --model: the embedded default model
        "bricks": Server(bricks, logs / "bricks.log"),
        "q8": Server([*bricks, "--bricks-kv", "q8_0"], logs / "q8.log"),
    }
    request.addfinalizer(lambda: [s.stop() for s in started.values()])
    return start_all(started)


def _ask_all(jobs: dict) -> dict:
    """``{key: Answer}`` of ``{key: (port, kind, prompt, stream, extra)}``, all at once."""
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {k: pool.submit(ask, port, kind, prompt, stream=stream, **extra)
                   for k, (port, kind, prompt, stream, extra) in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def _loads(server: Server) -> list[str]:
    """The model paths of the server's ``[mlx-bricks] PATH: backend: ...`` lines, in order."""
    return re.findall(r"^.*\[mlx-bricks\] (\S+): backend: ", server.log(), re.M)


# ---------------------------------------------------------------------------------------------


def test_concurrent_greedy_answers_equal_stock(servers):
    """Both endpoints, streamed and not, sent at once to all three servers: the patched
    servers answer as stock does (Q8_0 K/V rounds K and V, but not enough to change these
    answers)."""
    jobs = {(name, i): (s.port, kind, prompt, stream, {})
            for name, s in servers.items() for i, (kind, prompt, stream) in enumerate(PROMPTS)}
    answers = _ask_all(jobs)
    for i, (kind, prompt, _) in enumerate(PROMPTS):
        stock = answers["stock", i]
        assert stock.text.strip(), (prompt, stock)
        for name in ("bricks", "q8"):
            got = answers[name, i]
            assert (got.text, got.finish_reason, got.prompt_tokens) == \
                (stock.text, stock.finish_reason, stock.prompt_tokens), (name, prompt)


def test_report_is_logged_once_per_loaded_model(servers, tiny_model_dir, default_model_dir):
    """The startup model, then a model named by a request, then the first again: one report
    in the log per load, none for requests that reuse the loaded model."""
    s = servers["bricks"]
    ask(s.port, "text", "Hello", max_tokens=2)  # the default model is loaded (and stays)
    before = _loads(s)
    assert before and before[0] == str(default_model_dir)
    assert "patched 30 modules, 0 kept stock" in s.log()
    tiny = str(tiny_model_dir)
    for model in (tiny, tiny, "default_model"):
        ask(s.port, "text", "Hello", max_tokens=2, model=model)
    assert _loads(s) == [*before, tiny, str(default_model_dir)]


def test_prompt_cache_reuse_and_trimming(servers):
    """A growing conversation reuses the cached prefix, a diverging one trims a cached longer
    sequence (``LRUPromptCache.fetch_nearest_cache``): the same cached-token counts and
    answers as stock, with both caches."""
    first = [{"role": "user", "content": "What is the capital of Germany?"}]
    turns = {}
    for name, s in servers.items():
        a1 = ask(s.port, "chat", first, max_tokens=4)
        grown = [*first, {"role": "assistant", "content": a1.text},
                 {"role": "user", "content": "And of Italy?"}]
        a2 = ask(s.port, "chat", grown, max_tokens=4)
        # shares the first question's start, then diverges: a longer cached one is trimmed
        a3 = ask(s.port, "chat", [{"role": "user", "content": "What is the capital of Spain?"}],
                 max_tokens=4)
        turns[name] = (a1, a2, a3)
    for name in ("bricks", "q8"):
        for got, stock in zip(turns[name], turns["stock"]):
            assert (got.text, got.cached_tokens) == (stock.text, stock.cached_tokens), name
    a1, a2, a3 = turns["stock"]
    assert a2.cached_tokens > 0 and a3.cached_tokens > 0  # both paths of the cache were taken
    assert a3.cached_tokens < a3.prompt_tokens


def _bad_requests(tiny_model_dir) -> dict:
    """name -> (path, JSON body or raw bytes, status mlx-lm's server answers)."""
    long_prompt = " ".join(["word"] * (2 * TINY_CONTEXT))
    return {
        "malformed JSON": ("/v1/chat/completions", b'{"messages": [', 400),
        "not an object": ("/v1/completions", b"[1, 2]", 400),
        "unknown model": ("/v1/completions", {"prompt": "Hi", "model": "no-such/model",
                                              "max_tokens": 2}, 404),
        "max_tokens 0": ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400),
        "max_tokens negative": ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "Hi"}],
                                 "max_tokens": -5}, 400),
        # accepted: generation ends at the stop sequence (mlx-lm has no upper bound)
        "max_tokens huge": ("/v1/completions", {"prompt": "The capital of France is",
                                                "max_tokens": 10**9, "stop": ["."]}, 200),
        "no messages": ("/v1/chat/completions", {"max_tokens": 2}, 400),
        # mlx-lm 0.32 does not check the context length: it answers (positions past
        # max_position_embeddings)
        "prompt longer than the context": ("/v1/completions", {
            "prompt": long_prompt, "model": str(tiny_model_dir), "max_tokens": 2}, 200),
        "unknown path": ("/v2/nothing", {}, 404),
    }


def _disconnect_mid_stream(port: int) -> bytes:
    """Start a long streamed answer, read up to its first event, close the socket."""
    body = json.dumps({"prompt": "Count from one to one hundred:", "max_tokens": 200,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.sendall(head + body)
        seen = b""
        while b"\ndata: " not in seen:
            chunk = sock.recv(4096)
            assert chunk, seen
            seen += chunk
        sock.shutdown(socket.SHUT_RDWR)
    return seen[seen.index(b"\ndata: ") + 1:]


def test_bad_requests_get_stock_errors_and_the_server_keeps_serving(servers, tiny_model_dir):
    cases = _bad_requests(tiny_model_dir)
    for name in ("stock", "bricks"):
        s = servers[name]
        for case, (path, body, status) in cases.items():
            raw = body if isinstance(body, bytes) else None
            got, data = s.request("POST", path, None if raw else body, raw=raw)
            assert got == status, (name, case, data[:300])
            if status == 400:
                assert "error" in json.loads(data), (name, case)
        assert _disconnect_mid_stream(s.port).startswith(b"data: {")
        # still serving, and answering right
        assert s.request("GET", "/health")[0] == 200
    answers = _ask_all({name: (servers[name].port, "chat", PROMPTS[0][1], False, {})
                        for name in ("stock", "bricks")})
    assert answers["stock"].text == answers["bricks"].text != ""


def test_short_load_loses_no_request(servers):
    """4 clients for 6 s (both endpoints, streamed and not): every request answered.
    The long version (8 clients, 30 s, both servers, process check): test_load_slow."""
    load = run_load(servers["bricks"].port, clients=4, seconds=6)
    assert load.failed == [] and load.sent == load.answered > 0
    assert servers["bricks"].request("GET", "/health")[0] == 200


@pytest.mark.slow
def test_load_slow(tmp_path, default_model_dir):
    """8 clients for 30 s against a patched and a stock server (one after the other): no
    request lost or failed, and each server, stopped, leaves no process behind."""
    _require_hook()
    for name, args in (("bricks", ["--use-bricks", "--bricks-backend", "reference"]),
                       ("stock", ["--model", default_model_dir])):
        s = Server(args, tmp_path / f"{name}.log")
        try:
            start_all({name: s})
            load = run_load(s.port, clients=8, seconds=30)
        finally:
            code, alive = s.stop()
        print(f"\n{name}: {load.sent} requests, {load.answered} answered, p95 "
              f"{load.percentile(0.95):.2f} s")
        assert load.failed == [] and load.sent == load.answered > 0, (name, load.failed[:3])
        assert alive == [] and code is not None, (name, code, alive)
        with pytest.raises(OSError):  # nobody listens on the port any more
            socket.create_connection(("127.0.0.1", s.port), timeout=2).close()


def test_kernel_fault_in_a_request_falls_back_to_stock(tmp_path, tiny_model_dir):
    """A kernel that fails to build (gemm.metal broken, MSL emulator): the guard disables the
    pieces that use it for the process at the first request, which completes on stock; so does
    the next; the final report (``--bricks-report``, logged at shutdown) lists them."""
    _require_hook()
    from tests.support import require_backend

    require_backend("emulator")
    s = Server(["gemm.metal", "--use-bricks", "--bricks-backend", "emulator", "--bricks-report",
                "--model", tiny_model_dir], tmp_path / "fault.log",
               script=ROOT / "server_with_fault.py")
    try:
        start_all({"fault": s})
        # "seed" makes mlx-lm serve the request alone (not batched): the prefill runs the
        # bricks on mlx-lm's KVCache
        for _ in range(2):
            answer = ask(s.port, "text", "The capital of France is", max_tokens=4, seed=0)
            assert answer.finish_reason in ("length", "stop"), answer
    finally:
        code, alive = s.stop()
    log = s.log()
    assert alive == [], alive
    assert "final patch report of" in log, log[-3000:]
    final = log[log.index("final patch report of"):]
    disabled = final[final.index("disabled for this process (pieces run stock):"):]
    # gemm.metal is the out-projection's kernel and the SwiGLU's down projection's
    assert re.search(r"^ +linear variant \S+ on emulator failed to build or run", disabled,
                     re.M), disabled
    assert re.search(r"^ +swiglu_mlp variant \S+ on emulator failed to build or run", disabled,
                     re.M), disabled


def test_stopping_leaves_nothing_and_the_report_names_the_batch_fallback(servers):
    """Last test of the module (the servers stop here): each patched server exits on SIGINT,
    leaves no process and no listening port behind, and its final report (``--bricks-report``)
    counts the padded-batch calls that ran stock, with the reason: only the Q8_0-cache server
    has them (the fp16 server's ``BatchKVCache`` batches run the attention brick with
    ``kv_start``)."""
    # a burst of prompts of different lengths: mlx-lm batches those that queue while a
    # prefill runs, left-padded, whatever batching the earlier tests' timing gave
    burst = [" ".join(["word"] * n) for n in (3, 9, 17, 26, 5, 14, 21, 30)]
    _ask_all({(name, i): (servers[name].port, "text", prompt, False, {"max_tokens": 2})
              for name in ("bricks", "q8") for i, prompt in enumerate(burst)})
    for name in ("bricks", "q8"):
        s = servers[name]
        code, alive = s.stop()
        assert alive == [] and code is not None, (name, code, alive)
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", s.port), timeout=2).close()
        log = s.log()
        assert "final patch report of" in log, (name, log[-2000:])
        final = log[log.rindex("final patch report of"):]
        padded = ("mask is an array (sliding window or padding): the attention brick takes "
                  "causal only" in final)
        assert padded == (name == "q8"), (name, final[-2000:])
