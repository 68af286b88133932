"""The CLIs as users meet them: ``mlx_lm.generate`` / ``server`` / ``chat`` / ``benchmark
--use-bricks`` (through the installed import hook), ``mlx_bricks.generate`` and ``python -m
mlx_bricks.patch``. The server's requests: tests/test_server.py; the entry layer in process:
tests/test_entry.py.

The subprocess tests run an installed wheel, not the source tree: a session fixture builds the
wheel from a copy of the sources and installs it into a throwaway venv whose ``.pth`` file puts
the parent environment's site-packages (mlx, mlx-lm, ...) on the path. The parent's own ``.pth``
files are not processed there, so an editable install of mlx-bricks in the parent cannot shadow
the wheel. Model runs use the embedded default model (SmolLM2-135M-Instruct, about 135M params);
they are few and short, and independent runs go in parallel.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from mlx_bricks.entry import hook as _hook

ROOT = Path(__file__).resolve().parents[1]
PARENT_BIN = Path(sysconfig.get_path("scripts"))
SEP = "=" * 10  # mlx-lm's verbose output frames the generated text with this line
PROMPT = "What is the capital of France?"
TIMEOUT = 600


# ---------------------------------------------------------------------------------------------
# fixtures


def _copy_sources(dst: Path) -> None:
    """What the wheel is built from (not the tests, not build outputs of the working tree)."""
    dst.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("mlx_bricks", "metal_src", "cuda_src"):
        shutil.copytree(ROOT / name, dst / name, symlinks=True, ignore=ignore)


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> SimpleNamespace:
    """The wheel installed into a throwaway venv.

    Attributes: ``python`` (the venv's interpreter), ``bin`` (its scripts), ``site`` (its
    site-packages), ``env`` (environment without PYTHONPATH / MLX_BRICKS_BACKEND), ``run``
    (``run(args, **kw) -> CompletedProcess`` with that interpreter's environment).
    """
    base = tmp_path_factory.mktemp("cli")
    src, dist, venv = base / "src", base / "dist", base / "venv"
    _copy_sources(src)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(dist), str(src)], check=True, capture_output=True)
    (wheel,) = dist.glob("mlx_bricks-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True).stdout.strip())
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "MLX_BRICKS_BACKEND", "PYTHONSTARTUP")}
    # Before the parent's paths are visible: pip must not see a source tree or an editable
    # install of mlx-bricks there and call it "already installed".
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "--no-index", "-q", str(wheel)], check=True, capture_output=True,
                   env=env)
    parent_paths = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "zz_parent_env.pth").write_text("".join(f"{p}\n" for p in parent_paths))

    def run(args, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("timeout", TIMEOUT)
        return subprocess.run([str(a) for a in args], env=env, capture_output=True, text=True,
                              cwd=base, **kwargs)

    return SimpleNamespace(python=python, bin=venv / "bin", site=site, env=env, run=run,
                           base=base)


def _mlx_lm(installed, command: str = "generate") -> list:
    """mlx-lm's console script ``mlx_lm.COMMAND``, run by the venv's interpreter (so its
    site-packages and .pth files apply); argv[0] stays the script, as when a user types it."""
    script = PARENT_BIN / f"mlx_lm.{command}"
    if not script.exists():
        found = shutil.which(f"mlx_lm.{command}")
        if found is None:
            pytest.skip(f"mlx-lm's mlx_lm.{command} script is not installed")
        script = Path(found)
    return [installed.python, script]


def _parallel(run, commands: dict) -> dict:
    """``{key: CompletedProcess}`` of ``{key: argv}``, four at a time."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {key: pool.submit(run, argv) for key, argv in commands.items()}
        return {key: f.result() for key, f in futures.items()}


def _framed_text(stdout: str) -> str:
    """The generated text between mlx-lm's two ``==========`` lines."""
    parts = stdout.split(SEP + "\n")
    assert len(parts) >= 3, stdout
    return parts[1]


# ---------------------------------------------------------------------------------------------
# the hook: installed, removable, free for other processes


def test_wheel_installs_the_hook_line_and_records_it(installed):
    pth = installed.site / _hook.PTH_NAME
    assert pth.read_text() == _hook.PTH_LINE
    (record,) = installed.site.glob("mlx_bricks-*.dist-info/RECORD")
    # pip uninstall removes exactly the files listed in RECORD.
    assert any(line.split(",")[0] == _hook.PTH_NAME for line in record.read_text().splitlines())


def _imported_modules(importtime_stderr: str) -> set[str]:
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "imported package":
                names.add(name)
    return names


def test_hook_imports_nothing_unless_asked(installed):
    py = installed.python
    plain = installed.run([py, "-X", "importtime", "-c", "pass"])
    flagged = installed.run([py, "-X", "importtime", "-c", "pass", "--use-bricks"])
    assert plain.returncode == 0 and flagged.returncode == 0, plain.stderr + flagged.stderr
    plain_mods, flagged_mods = _imported_modules(plain.stderr), _imported_modules(flagged.stderr)
    assert "site" in plain_mods  # the parsing works
    assert not any(m.split(".")[0] in ("mlx", "mlx_bricks", "mlx_lm", "numpy")
                   for m in plain_mods)
    # --use-bricks on another program loads the hook module (to look at argv) and nothing heavy.
    assert "mlx_bricks.entry.hook" in flagged_mods
    assert not any(m.split(".")[0] in ("mlx", "mlx_lm", "numpy") for m in flagged_mods)


def test_every_entry_point_parses_the_bricks_flags(installed):
    """Every form of every command of the hook table lists the flags; without --use-bricks
    the hook leaves the program alone."""
    py, gen = installed.python, _mlx_lm(installed)
    results = _parallel(installed.run, {
        "mlx_lm.server --use-bricks": [*_mlx_lm(installed, "server"), "--use-bricks", "--help"],
        "python -m mlx_lm server --use-bricks": [py, "-m", "mlx_lm", "server", "--use-bricks",
                                                 "--help"],
        "python -m mlx_lm.server --use-bricks": [py, "-m", "mlx_lm.server", "--use-bricks",
                                                 "--help"],
        "mlx_lm.chat --use-bricks": [*_mlx_lm(installed, "chat"), "--use-bricks", "--help"],
        "python -m mlx_lm benchmark --use-bricks": [py, "-m", "mlx_lm", "benchmark",
                                                    "--use-bricks", "--help"],
        "mlx_lm.server (no flag)": [*_mlx_lm(installed, "server"), "--help"],
        "mlx_lm.generate --use-bricks": [*gen, "--use-bricks", "--help"],
        "python -m mlx_lm generate --use-bricks": [py, "-m", "mlx_lm", "generate",
                                                   "--use-bricks", "--help"],
        "python -m mlx_lm.generate --use-bricks": [py, "-m", "mlx_lm.generate", "--use-bricks",
                                                   "--help"],
        "mlx_bricks.generate": [installed.bin / "mlx_bricks.generate", "--help"],
        "python -m mlx_bricks.generate": [py, "-m", "mlx_bricks.generate", "--help"],
        "mlx_lm.generate (no flag)": [*gen, "--help"],
    })
    for name, r in results.items():
        assert r.returncode == 0, (name, r.stderr)
        assert "--prefill-step-size" in r.stdout, name  # mlx-lm's flags
        has_bricks = ("--bricks-backend" in r.stdout and "--bricks-kv {fp16,q8_0}" in r.stdout
                      and "--bricks-tune {auto,cached,force,off}" in r.stdout
                      and "--bricks-mlp-variant {auto,fused,split}" in r.stdout
                      and "--bricks-report" in r.stdout)
        assert has_bricks, name  # --help lists the mlx-bricks flags, with or without the flag
        if has_bricks:  # the program name is the command's, in every form
            command = re.search(r"generate|server|chat|benchmark", name).group(0)
            prog = "mlx_bricks.generate" if "mlx_bricks" in name else f"mlx_lm.{command}"
            assert r.stdout.startswith(f"usage: {prog} "), (name, r.stdout[:80])


@pytest.mark.slow
def test_editable_install_has_the_hook_and_uninstall_removes_it(tmp_path):
    src, venv = tmp_path / "src", tmp_path / "venv"
    _copy_sources(src)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True).stdout.strip())
    # --no-build-isolation builds with the parent's setuptools, so the parent must be visible
    (site / "zz_parent_env.pth").write_text(f"{sysconfig.get_path('purelib')}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLX_BRICKS_BACKEND")}
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "--ignore-installed",
                    "-q", "-e", str(src)], check=True, capture_output=True, env=env)
    assert (site / _hook.PTH_NAME).read_text() == _hook.PTH_LINE
    where = subprocess.run(
        [str(python), "-c", "import mlx_bricks; print(mlx_bricks.__file__)"], env=env,
        capture_output=True, text=True, check=True, cwd=tmp_path)
    assert where.stdout.startswith(str(src))  # the editable source, not a copy
    gen = [str(python), str(PARENT_BIN / "mlx_lm.generate"), "--use-bricks", "--help"]
    out = subprocess.run(gen, env=env, capture_output=True, text=True, check=True,
                         cwd=tmp_path).stdout
    assert "--bricks-kv" in out
    subprocess.run([*pip, "uninstall", "-y", "-q", "mlx-bricks"], check=True,
                   capture_output=True, env=env)
    assert not (site / _hook.PTH_NAME).exists()


# ---------------------------------------------------------------------------------------------
# generation and the patch check on the default model


def _verbose_line(stderr: str):
    """(backend, patched, kept stock, rest of the line) of ``[mlx-bricks] backend: ...``."""
    line = re.search(r"^\[mlx-bricks\] backend: (\w+) .*; patched (\d+) modules, (\d+) kept "
                     r"stock(.*)$", stderr, re.M)
    assert line, stderr
    return line.group(1), int(line.group(2)), int(line.group(3)), line.group(4)


def test_generate_use_bricks_gives_the_stock_text(installed, default_model_dir):
    from mlx_bricks.backends import active_backend

    gen = _mlx_lm(installed)
    results = _parallel(installed.run, {
        "stock": [*gen, "--model", default_model_dir, "--prompt", PROMPT, "--max-tokens", "16"],
        # no --model: the embedded default model
        "bricks": [*gen, "--use-bricks", "--prompt", PROMPT, "--max-tokens", "16"],
        # a named backend patches even without a kernel backend (tests, debugging)
        "named": [*gen, "--use-bricks", "--bricks-backend", "reference", "--prompt", PROMPT,
                  "--max-tokens", "16"],
        # the Q8_0 KV cache (prefill and decode read it; report: the cache kind per layer)
        "q8": [*gen, "--use-bricks", "--bricks-kv", "q8_0", "--bricks-report", "--prompt",
               PROMPT, "--max-tokens", "16"],
    })
    stock, bricks, named = results["stock"], results["bricks"], results["named"]
    for r in results.values():
        assert r.returncode == 0, r.stderr
    text = _framed_text(stock.stdout)
    assert text.strip()
    assert _framed_text(bricks.stdout) == text
    assert _framed_text(named.stdout) == text
    assert _framed_text(results["q8"].stdout) == text
    assert "KV cache per layer (kv_cache=q8_0): Q8KVCache x 30" in results["q8"].stderr
    assert "; KV cache: Q8_0 in 30/30 layers" in _verbose_line(results["q8"].stderr)[3]
    # --verbose (mlx-lm's default): which backend, how many modules, mlx-lm's prompt tokens/s
    backend, patched, kept, rest = _verbose_line(bricks.stderr)
    choice = active_backend()
    assert backend == choice.name
    if choice.name == "reference":  # no kernel backend: the model stays stock, and says so
        assert (patched, kept) == (0, 30)
        assert rest == " (no kernel backend on this machine (reference is the same math as " \
                       "stock))"
    else:
        assert patched > 0 and kept == 0 and rest == "; tuning: auto"
    assert _verbose_line(named.stderr)[:3] == ("reference", 30, 0)
    assert re.search(r"^Prompt: \d+ tokens, [\d.]+ tokens-per-sec$", bricks.stdout, re.M)


def test_chat_and_benchmark_with_the_bricks(installed, default_model_dir):
    """``mlx_lm.chat --use-bricks`` (default model, questions on stdin) prints what stock chat
    prints; ``mlx_lm.benchmark --use-bricks`` prints stock's table for the patched model."""
    chat, bench = _mlx_lm(installed, "chat"), _mlx_lm(installed, "benchmark")
    questions = f"{PROMPT}\nq\n"
    results = _parallel(lambda argv: installed.run(argv, input=questions), {
        "stock chat": [*chat, "--model", default_model_dir, "--max-tokens", "8"],
        "bricks chat": [*chat, "--use-bricks", "--bricks-backend", "reference", "--max-tokens",
                        "8"],
        "bricks benchmark": [*bench, "--use-bricks", "--bricks-backend", "reference", "-p", "16",
                             "-g", "4", "-n", "1"],
    })
    for name, r in results.items():
        assert r.returncode == 0, (name, r.stderr)
    stock, bricks = results["stock chat"], results["bricks chat"]
    # the same screen, up to the speed figures (``prompt 1.6 tok/s``)
    def screen(out):
        return re.sub(r"[\d.]+ tok/s", "N tok/s", out)

    assert "Paris" in stock.stdout and screen(bricks.stdout) == screen(stock.stdout)
    assert _verbose_line(bricks.stderr)[:3] == ("reference", 30, 0)
    b = results["bricks benchmark"]
    assert _verbose_line(b.stderr)[:3] == ("reference", 30, 0)
    assert "Timing with prompt_tokens=16, generation_tokens=4, batch_size=1." in b.stdout
    assert re.search(r"^Trial 1: +prompt_tps=[\d.]+, generation_tps=[\d.]+, "
                     r"peak_memory=[\d.]+, total_time=[\d.]+$", b.stdout, re.M), b.stdout
    assert re.search(r"^Averages: prompt_tps=[\d.]+, generation_tps=[\d.]+", b.stdout, re.M)
    assert "[mlx-bricks]" not in b.stdout  # stdout is stock's


def test_patch_cli_json_passes_on_the_default_model(installed, default_model_dir):
    from mlx_bricks.backends import active_backend

    # A raw prompt (6 tokens; 37 with SmolLM's chat template): CPU prefill is slow.
    base = [installed.python, "-m", "mlx_bricks.patch", default_model_dir, "--json", "--prompt",
            "The capital of France is", "--ignore-chat-template", "--max-tokens", "8"]
    results = _parallel(installed.run, {
        "auto": [*base, "--repeats", "3"],
        "named": [*base, "--backend", "reference", "--mlp-variant", "split", "--repeats", "1"],
    })
    auto = results["auto"]
    assert auto.returncode == 0, auto.stderr + auto.stdout
    (line,) = auto.stdout.splitlines()
    f = json.loads(line)
    assert f["passed"] is True and f["greedy_match"] is True
    if active_backend().name == "reference":
        # No kernel backend: the patch leaves every module stock (the same computation as
        # stock, so prompt_tps_ratio is 1 up to timing noise: measured, not asserted).
        print(f"\nno kernel backend: prompt_tps_ratio {f['prompt_tps_ratio']:.3f} "
              f"(median of {f['repeats']})")
        assert f["all_stock"] is True and f["report"]["n_patched"] == 0
        assert f["stock_reason"] == ("no kernel backend on this machine (reference is the same "
                                     "math as stock)")
        assert f["report"]["calls"] == {} and f["report"]["n_stock"] == 30
        assert f["max_abs_delta_logits_all"] == 0.0
    r = results["named"]
    assert r.returncode == 0, r.stderr + r.stdout
    (line,) = r.stdout.splitlines()  # one JSON object
    f = json.loads(line)
    assert f["passed"] is True and f["fail_reasons"] == []
    assert f["greedy_match"] is True and f["stock_tokens"] == f["patched_tokens"]
    assert len(f["stock_tokens"]) > 0 and f["stock_text"].strip()
    assert f["top1_agreement"] == 1.0
    # float16 model: the bricks' logits stay within a few float16 ulps of the logits' scale
    assert 0.0 <= f["max_abs_delta_logits_last"] <= f["max_abs_delta_logits_all"]
    assert f["max_abs_delta_logits_all"] < 0.02 * f["max_abs_logits_stock"]
    assert f["prompt_tps_stock"] > 0 and f["prompt_tps_patched"] > 0
    assert f["prompt_tps_ratio"] == pytest.approx(f["prompt_tps_patched"]
                                                  / f["prompt_tps_stock"])
    report = f["report"]
    assert report["model_type"] == f["model_type"] == "llama"
    assert report["n_patched"] == report["n_layers"] == 30 and report["n_fallback"] == 0
    assert report["backend"]["name"] == f["backend"]["name"]
    assert report["options"]["mlp_variant"] == "split"
    assert sum(report["calls"].values()) > 0  # the bricks really ran


def test_ctrl_c_during_generation_exits_130(installed, default_model_dir):
    """SIGINT once mlx_bricks.generate has printed its first token: exit 130, no traceback."""
    proc = subprocess.Popen(
        [str(installed.bin / "mlx_bricks.generate"), "--prompt", "Count from 1 to 1000.",
         "--max-tokens", "2000"],
        env=installed.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=installed.base,
        # as in a terminal: a runner that starts jobs in the background (SIGINT ignored, which
        # children inherit and Python then leaves alone) must not make this test vacuous
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + TIMEOUT
        while proc.stdout.readline() != SEP + "\n":
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        assert proc.stdout.read(1)  # the first generated text: we are in generation
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.rstrip().splitlines()[-1] == "mlx_bricks.generate: interrupted"


# ---------------------------------------------------------------------------------------------
# bad input: one line, exit 2


def _bad_model_dirs(base: Path) -> dict[str, Path]:
    dirs = {}

    def model_dir(name: str, config: str | None, weights: bytes | None) -> Path:
        d = base / name
        d.mkdir(parents=True, exist_ok=True)
        if config is not None:
            (d / "config.json").write_text(config)
        if weights is not None:
            (d / "model.safetensors").write_bytes(weights)
        dirs[name] = d
        return d

    model_dir("no_config", None, None)
    model_dir("gemma", json.dumps({"model_type": "gemma"}), b"")
    model_dir("bad_weights", json.dumps({"model_type": "llama"}), b"\xff" * 64)
    dirs["missing"] = base / "does-not-exist"
    return dirs


def test_bad_input_is_one_line_and_exit_2(installed, default_model_dir):
    from mlx_bricks.backends import backend_status

    d = _bad_model_dirs(installed.base / "bad")
    patch = [installed.python, "-m", "mlx_bricks.patch"]
    gen = [*_mlx_lm(installed), "--use-bricks"]
    server = [*_mlx_lm(installed, "server"), "--use-bricks"]
    cases = {
        # name: (argv, expected fragment of the one line). More messages of the model checks:
        # test_resolve_model_rejects (in-process, cheaper than a subprocess each).
        "patch: missing dir": ([*patch, d["missing"]], f"MODEL_DIR '{d['missing']}' does not "
                               "exist"),
        "patch: no config.json": ([*patch, d["no_config"]], "has no config.json"),
        # a model_type outside the patch table is no error (test_entry: the notice); its
        # empty weights are
        "patch: unlisted model_type, empty weights": ([*patch, d["gemma"]],
                                                      "cannot read weights"),
        "patch: unreadable weights": ([*patch, d["bad_weights"]], "cannot read weights"),
        "patch: empty prompt": ([*patch, default_model_dir, "--prompt", " "],
                                "--prompt is empty"),
        "patch: bad --max-tokens": ([*patch, "--max-tokens", "0"],
                                    "argument --max-tokens/-m: expected a positive integer, "
                                    "got 0"),
        "generate: missing --model": ([*gen, "--model", d["missing"]],
                                      f"--model '{d['missing']}' does not exist"),
        "generate: empty prompt": ([*gen, "--prompt", ""], "--prompt is empty"),
        "generate: --max-tokens 0": ([*gen, "--prompt", "hi", "--max-tokens", "0"],
                                     "--max-tokens must be a positive integer or -1"),
        "generate: bad --bricks-kv": ([*gen, "--bricks-kv", "q4_0"],
                                      "argument --bricks-kv: invalid choice: 'q4_0'"),
        "generate: --kv-bits with --bricks-kv q8_0": (
            [*gen, "--prompt", "hi", "--bricks-kv", "q8_0", "--kv-bits", "8"],
            "--kv-bits and --bricks-kv q8_0 exclude each other"),
        "generate: bad --bricks-mlp-variant": (
            [*gen, "--bricks-mlp-variant", "fast"],
            "argument --bricks-mlp-variant: invalid choice: 'fast'"),
        "patch: bad --mlp-variant": ([*patch, "--mlp-variant", "fast"],
                                     "argument --mlp-variant/--bricks-mlp-variant: invalid "
                                     "choice: 'fast'"),
        "server: missing --model": ([*server, "--model", d["missing"]],
                                    f"--model '{d['missing']}' does not exist"),
        "server: --kv-bits with --bricks-kv q8_0": (
            [*server, "--bricks-kv", "q8_0", "--kv-bits", "8"],
            "--kv-bits and --bricks-kv q8_0 exclude each other"),
        "benchmark: unlisted model_type, empty weights": (
            [*_mlx_lm(installed, "benchmark"), "--use-bricks", "--model", d["gemma"]],
            "cannot read weights"),
    }
    if not backend_status("metal")[0]:
        cases["patch: unavailable backend"] = ([*patch, "--backend", "metal"],
                                               "backend 'metal' (argument) is unavailable")
    results = _parallel(installed.run, {name: argv for name, (argv, _) in cases.items()})
    for name, (_, expected) in cases.items():
        r = results[name]
        assert r.returncode == 2, (name, r.returncode, r.stderr)
        lines = r.stderr.splitlines()
        assert len(lines) == 1, (name, r.stderr)
        assert lines[0].split(": error: ")[0] in ("python -m mlx_bricks.patch",
                                                 "mlx_lm.generate", "mlx_lm.server",
                                                 "mlx_lm.benchmark"), (name, lines[0])
        assert expected in lines[0], (name, lines[0])
        assert r.stdout == "", (name, r.stdout)


# ---------------------------------------------------------------------------------------------
# in-process units (no subprocess, no model)


def test_compare_and_verdict_figures():
    import mlx.core as mx

    from mlx_bricks.patch.__main__ import compare, verdict

    rng = np.random.default_rng(0)
    stock_logits = rng.standard_normal((5, 11)).astype(np.float32)
    patched_logits = stock_logits + rng.uniform(-1e-3, 1e-3, (5, 11)).astype(np.float32)
    patched_logits[2, int(np.argmin(stock_logits[2]))] = 100.0  # flips one position's top-1
    stock = {"logits": mx.array(stock_logits), "tokens": [3, 4], "prefill_s": [2.0, 1.0, 4.0]}
    patched = {"logits": mx.array(patched_logits), "tokens": [3, 5], "prefill_s": [1.0]}
    f = compare(stock, patched, n_prompt=10)
    delta = np.abs(patched_logits.astype(np.float64) - stock_logits)
    assert f["max_abs_delta_logits_last"] == pytest.approx(delta[-1].max(), rel=1e-6)
    assert f["max_abs_delta_logits_all"] == pytest.approx(delta.max(), rel=1e-6)
    assert f["max_abs_logits_stock"] == pytest.approx(np.abs(stock_logits).max(), rel=1e-6)
    assert f["top1_agreement"] == pytest.approx(4 / 5)
    assert f["greedy_match"] is False
    assert f["prompt_tps_stock"] == pytest.approx(10 / 2.0)  # median of the timed runs
    assert f["prompt_tps_patched"] == pytest.approx(10 / 1.0)
    assert f["prompt_tps_ratio"] == pytest.approx(2.0)
    assert verdict(f, n_patched=3) == ["top-1 agreement 80.00% < 100%",
                                       "greedy continuations differ"]
    ok = dict(f, top1_agreement=1.0, greedy_match=True)
    assert verdict(ok, n_patched=3) == []
    assert verdict(ok, n_patched=0) == ["no module was patched (see the report for why)"]


# ---------------------------------------------------------------------------------------------
# python -m mlx_bricks

def test_package_main_lists_the_commands_and_the_bricks_flags():
    """``python -m mlx_bricks`` (a fresh process): the commands, every flag of the group
    ``--use-bricks`` adds (from the parser itself) and the environment variables; exit 0."""
    import argparse

    from mlx_bricks.__main__ import COMMANDS, FLAGS
    from mlx_bricks.entry.flags import add_bricks_flags
    from mlx_bricks.env import VARIABLES

    r = subprocess.run([sys.executable, "-m", "mlx_bricks"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stderr == ""
    for command in ("patch", "tune", "bench", "gguf"):
        assert f"python -m mlx_bricks.{command}" in r.stdout
    group = add_bricks_flags(argparse.ArgumentParser(add_help=False))
    assert {a.dest for a in group._group_actions} == set(FLAGS)
    for action in group._group_actions:
        assert any(line.lstrip().startswith(action.option_strings[0]) and FLAGS[action.dest]
                   in line for line in r.stdout.splitlines()), action.option_strings
    assert all(name in r.stdout for name in VARIABLES)
    assert len(r.stdout.splitlines()) <= 30 and len(COMMANDS) == 5


def test_package_main_rejects_arguments_in_one_line(capsys):
    from mlx_bricks.__main__ import main

    assert main(["--help"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["patch"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("python -m mlx_bricks: error: unknown argument 'patch'")
