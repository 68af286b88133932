"""The entry layer in process (no subprocess, no model run): which program the hook serves, one
flag vocabulary, one-way imports, the ``.pth`` line of setup.py, model resolution, and the
session's swaps (``load`` patches main models, not the draft; ``make_prompt_cache``). The
commands as users run them: tests/test_cli.py and tests/test_server.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_bricks import options
from mlx_bricks.entry import hook as _hook
from tests.test_cli import _bad_model_dirs

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, orig_argv, expected", [
    (["/venv/bin/mlx_lm.generate", "--use-bricks"], [], "generate"),
    (["C:\\venv\\Scripts\\mlx_lm.generate.exe", "--use-bricks"], [], "generate"),
    (["/venv/bin/mlx_lm.server", "--use-bricks"], [], "server"),
    (["/venv/bin/mlx_lm.chat", "--use-bricks"], [], "chat"),
    (["/venv/bin/mlx_lm.benchmark-script.py", "--use-bricks"], [], "benchmark"),
    (["/venv/bin/mlx_lm.convert", "--use-bricks"], [], None),
    (["-c", "--use-bricks"], ["py", "-c", "pass", "--use-bricks"], None),
    (["-m", "generate"], ["py", "-m", "mlx_lm", "generate", "--use-bricks"], "generate"),
    (["-m", "--use-bricks"], ["py", "-m", "mlx_lm.generate", "--use-bricks"], "generate"),
    (["-m", "--use-bricks"], ["py", "-X", "importtime", "-B", "-m", "mlx_lm.generate"],
     "generate"),
    (["-m", "--use-bricks"], ["py", "-Ximporttime", "-Bmmlx_lm.generate"], "generate"),
    (["-m", "server"], ["py", "-m", "mlx_lm", "server", "--use-bricks"], "server"),
    (["-m", "--use-bricks"], ["py", "-m", "mlx_lm.server", "--use-bricks"], "server"),
    (["-m", "chat"], ["py", "-m", "mlx_lm", "chat", "--use-bricks"], "chat"),
    (["-m", "benchmark"], ["py", "-m", "mlx_lm", "benchmark", "--use-bricks"], "benchmark"),
    (["-m", "lora"], ["py", "-m", "mlx_lm", "lora", "--use-bricks"], None),
    (["-m", "--use-bricks"], ["py", "-m", "mlx_lm"], None),
    (["script.py", "--use-bricks"], ["py", "script.py", "--use-bricks"], None),
])
def test_target_command(argv, orig_argv, expected):
    command = _hook.target_command(argv, orig_argv)
    assert (command.name if command is not None else None) == expected


def test_one_vocabulary_for_the_flags():
    """patch_model's own tuples are the CLIs' choices; the old spelling none still parses."""
    from mlx_bricks.patch import core
    from mlx_bricks.runtime import dispatch
    from mlx_bricks.patch.__main__ import setup_arg_parser as patch_parser

    assert core.KV_CACHES is options.KV_CACHES and dispatch.TUNE_MODES is options.TUNE_MODES
    assert core.TUNE_MODES is options.TUNE_MODES
    parser = patch_parser()
    # the check's K/V rounding is named as patch_model names it, apart from --bricks-kv's cache
    assert parser.parse_args([]).kv_quant == "none"
    assert parser.parse_args(["--kv-quant", "q8_0"]).kv_quant == "q8_0"
    assert "--kv" not in parser._option_string_actions  # only argparse's prefix matching
    assert parser.parse_args(["--bricks-tune", "off", "--bricks-backend", "reference"]).tune \
        == "off"
    actions = {a.dest: a for a in parser._actions}
    assert tuple(actions["kv_quant"].choices) == ("none", *core.KV_QUANTS[1:])
    assert tuple(actions["tune"].choices) == options.TUNE_MODES


def test_entry_imports_one_way_and_no_mlx_for_help():
    """The hook imports no session (it reaches it only when the target module loads); the
    flags, the session module and the patch/tune CLIs' parsers import no MLX."""
    code = (
        "import sys\n"
        "import mlx_bricks.entry.hook\n"
        "assert 'mlx_bricks.entry.session' not in sys.modules, 'hook imported the session'\n"
        "from mlx_bricks.entry import session, flags, resolve\n"
        "from mlx_bricks.patch.__main__ import setup_arg_parser as p\n"
        "from mlx_bricks.tune.__main__ import setup_arg_parser as t\n"
        "p(); t()\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm', 'numpy'))\n"
        "print(heavy)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


def test_setup_py_writes_the_hook_line():
    """setup.py cannot import the package, so it keeps its own copy of the line."""
    text = (ROOT / "setup.py").read_text()
    start = text.index("PTH_NAME = ")
    namespace: dict = {}
    exec(text[start:text.index(")\n", start) + 2], namespace)  # the two constants
    assert namespace["PTH_NAME"] == _hook.PTH_NAME
    assert namespace["PTH_LINE"] == _hook.PTH_LINE


def test_resolve_model_rejects(tmp_path, capsys):
    from mlx_bricks._cli import CliError
    from mlx_bricks.entry.resolve import resolve_model
    from mlx_bricks.patch import supported_model_types

    d = _bad_model_dirs(tmp_path)
    llama = json.dumps({"model_type": "llama"})
    for name, config in (("bad_json", "{not json"), ("no_type", "{}"), ("no_weights", llama)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
    (tmp_path / "notes.txt").write_text("not a model")
    supported = ", ".join(sorted(supported_model_types()))
    cases = {
        d["missing"]: f"MODEL_DIR '{d['missing']}' does not exist",
        tmp_path / "notes.txt": "is a file; expected an mlx-lm model directory or a .gguf file",
        d["no_config"]: "has no config.json (not an mlx-lm model directory)",
        tmp_path / "bad_json": "cannot read '",
        tmp_path / "no_type": "config.json' has no model_type",
        tmp_path / "no_weights": "no model*.safetensors weights in",
        d["bad_weights"]: "cannot read weights '",
    }
    for path, expected in cases.items():
        with pytest.raises(CliError) as err:
            resolve_model(str(path), what="MODEL_DIR", allow_hub=False, need_patchable=True)
        assert expected in str(err.value), (path, str(err.value))
    # a model_type outside the patch table is no error: one line says what stays stock
    from mlx_bricks.entry.resolve import check_model_type

    assert check_model_type({"model_type": "gemma"}, d["gemma"]) == "gemma"
    err = capsys.readouterr().err
    assert f"model_type 'gemma' of '{d['gemma']}' is not in the patch table (supported: " \
        f"{supported}): its attention and dense MLPs stay stock" in err
    with pytest.raises(CliError, match="MODEL_DIR is empty"):
        resolve_model(" ", what="MODEL_DIR", allow_hub=False, need_patchable=True)
    # the unsupported model_type is only an error where the bricks are asked for
    with pytest.raises(CliError, match="cannot read weights"):
        resolve_model(str(d["bad_weights"]).replace("bad_weights", "gemma"), what="--model",
                      allow_hub=True, need_patchable=False)


def test_resolve_model_passes_hub_repo_ids_through_only_when_allowed(tmp_path):
    from mlx_bricks._cli import CliError
    from mlx_bricks.entry.resolve import resolve_model

    repo = "mlx-community/SmolLM2-135M-Instruct"  # not a local path here
    assert resolve_model(repo, what="--model", allow_hub=True, need_patchable=True) == repo
    with pytest.raises(CliError, match="does not exist"):
        resolve_model(repo, what="MODEL_DIR", allow_hub=False, need_patchable=True)
    with pytest.raises(CliError, match="does not exist"):  # a relative path is not a repo id
        resolve_model("./models/x", what="--model", allow_hub=True, need_patchable=True)


def test_gguf_model_is_converted_once_into_the_cache(tmp_path, monkeypatch):
    import mlx_bricks.gguf
    from mlx_bricks import _cli
    from mlx_bricks.entry import resolve

    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF placeholder")
    calls = []

    def fake_convert(path, out_dir, **options):  # writes what convert_gguf would, minimally
        calls.append((Path(path), Path(out_dir), options))
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text(json.dumps({"model_type": "llama"}))
        return Path(out_dir)

    monkeypatch.setattr(mlx_bricks.gguf, "convert_gguf", fake_convert)
    first = resolve.convert_gguf_cached(gguf)
    assert first.parent == tmp_path / "home" / "gguf" and first.name.startswith("tiny-")
    assert resolve.convert_gguf_cached(gguf) == first and len(calls) == 1  # reused
    gguf.write_bytes(b"GGUF placeholder, edited")  # another size: converted again
    second = resolve.convert_gguf_cached(gguf)
    assert second != first and len(calls) == 2

    def failing_convert(path, out_dir, **options):
        raise ValueError("tiny.gguf: unsupported architecture 'mamba'")

    monkeypatch.setattr(mlx_bricks.gguf, "convert_gguf", failing_convert)
    gguf.write_bytes(b"GGUF placeholder, edited again")
    with pytest.raises(_cli.CliError, match="cannot convert '.*tiny.gguf': tiny.gguf: "
                                            "unsupported architecture 'mamba'"):
        resolve.convert_gguf_cached(gguf)


def test_load_patchable_reports_a_failing_load_as_one_line(default_model_dir):
    from mlx_bricks import _cli
    from mlx_bricks.entry import resolve

    def broken(path):
        raise ValueError("Missing 3 parameters:\nmodel.layers.0.mlp.gate_proj.weight, ...")

    with pytest.raises(_cli.CliError, match=r"^cannot load '.*': Missing 3 parameters") as e:
        resolve.load_patchable(str(default_model_dir), "reference", broken)
    assert "\n" not in str(e.value)
    path, loaded = resolve.load_patchable(str(default_model_dir), "reference", lambda p: p.name)
    assert path == Path(default_model_dir) and loaded == Path(default_model_dir).name


def test_session_patches_main_models_not_the_draft_and_gives_them_their_cache(default_model_dir):
    """A load with keyword arguments (a main model) is patched, a load with the path alone
    (mlx-lm's --draft-model load) is not; make_prompt_cache gives the Q8_0 cache to the model
    patched with it and mlx-lm's own to the other."""
    import argparse

    from mlx_lm.models import cache as mlx_cache

    from mlx_bricks._cli import CliError
    from mlx_bricks.entry.session import Session, _BricksPromptCache, _PatchingLoad
    from mlx_bricks.patch import patch_report, unpatch_model
    from tests.models import build_model

    session = Session("server")
    session.args = argparse.Namespace(use_bricks=True, bricks_kv="q8_0", bricks_backend="reference",
                                      bricks_mlp_variant="auto", bricks_tune="auto")
    seen = []

    def fake_load(path, *args, **kwargs):  # what mlx-lm's load returns, for a tiny model
        seen.append(path)
        return build_model("llama", num_hidden_layers=1), None

    load = _PatchingLoad(session, fake_load)
    main, _ = load(str(default_model_dir), tokenizer_config={})  # checked like --model
    try:
        draft, _ = load("draft-model")
        assert seen == [str(default_model_dir), "draft-model"]
        assert patch_report(main).options["kv_cache"] == "q8_0" and patch_report(draft) is None
        assert [path for path, _ in session.loaded] == [str(default_model_dir)]
        make = _BricksPromptCache(mlx_cache.make_prompt_cache)
        assert type(make(main)[0]).__name__ == "Q8KVCache"
        assert type(make(draft)[0]) is mlx_cache.KVCache
        with pytest.raises(CliError, match="does not exist"):  # a request's unknown model
            load("/no/such/model", tokenizer_config={})
    finally:
        unpatch_model(main)  # its Q8_0 route of llama's attention must not outlive the test
