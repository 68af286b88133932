"""docs/ against the code: every flag, choice and default the command-line documents state is
the code's (the argparse parsers of the commands, ``mlx_bricks.options`` / ``env`` / ``home``),
so a default changed in one place and not the other fails here."""
from __future__ import annotations

import argparse
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: Flags of other programs the documents quote (nvidia-smi's, in serving.md's peak memory).
OTHER_TOOLS = {"--query-compute-apps"}
#: The documents that state flags and defaults of the commands.
DOCS = ("cli.md", "patch.md", "tuning.md", "serving.md", "setup.md")
FLAG = re.compile(r"(?<![\w-])(--[a-z](?:[a-z0-9-]*[a-z0-9])?)(?![\w-]*\*)")


def _code(name: str) -> tuple[list[str], list[str]]:
    """``(fenced blocks, inline code spans)`` of ``docs/<name>``."""
    text = (ROOT / "docs" / name).read_text()
    fence = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
    blocks = fence.findall(text)
    inline = re.findall(r"`([^`\n]+)`", fence.sub("", text))
    return blocks, inline


def _ours() -> dict[str, argparse.ArgumentParser]:
    """mlx-bricks' own commands, by program name, and the ``mlx-bricks`` group as mlx-lm's
    commands get it (every command's tune default)."""
    from mlx_bricks.bench.__main__ import build_parser as bench
    from mlx_bricks.bench.server_report import build_parser as server
    from mlx_bricks.bench.user_path import build_parser as user_path
    from mlx_bricks.entry.commands import COMMANDS
    from mlx_bricks.entry.flags import add_bricks_flags
    from mlx_bricks.gguf.__main__ import setup_arg_parser as gguf
    from mlx_bricks.patch.__main__ import setup_arg_parser as patch
    from mlx_bricks.tune.__main__ import setup_arg_parser as tune

    out = {p.prog: p for p in (patch(), tune(), bench(), gguf(), user_path(), server())}
    for c in COMMANDS.values():
        p = argparse.ArgumentParser(prog=c.module, add_help=False)
        add_bricks_flags(p, tune_default=c.tune)
        out[c.module] = p
    return out


def _mlx_lm_flags() -> set[str]:
    """The flags of mlx-lm's own commands (its ``server`` builds its parser inside ``main``:
    read from its source)."""
    flags = set()
    for name in ("generate", "chat", "benchmark"):
        parser = importlib.import_module(f"mlx_lm.{name}").setup_arg_parser()
        flags |= {s for a in parser._actions for s in a.option_strings}
    flags |= set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"",
                            inspect.getsource(importlib.import_module("mlx_lm.server"))))
    return flags


@pytest.fixture(scope="module")
def ours():
    return _ours()


@pytest.fixture(scope="module")
def actions(ours):
    """flag -> the argparse actions that define it, over mlx-bricks' commands."""
    out: dict[str, list] = {}
    for p in ours.values():
        for a in p._actions:
            for s in a.option_strings:
                out.setdefault(s, []).append(a)
    return out


def _doc_flags(name: str) -> set[str]:
    blocks, inline = _code(name)
    return {f for code in blocks + inline for f in FLAG.findall(code)}


@pytest.mark.parametrize("name", DOCS)
def test_every_flag_the_docs_name_exists(name, actions):
    known = set(actions) | _mlx_lm_flags() | {"--help"} | OTHER_TOOLS
    unknown = sorted(_doc_flags(name) - known)
    assert not unknown, f"docs/{name} names flags no command has: {unknown}"


def _default_words(action) -> set[str]:
    """How a document may write ``action``'s default."""
    d = action.default
    if isinstance(d, bool):
        return {"on", "true"} if d else {"off", "false"}
    if isinstance(d, (list, tuple)):
        return {" ".join(map(str, d))}
    return {str(d)}


def _stated_defaults(text: str) -> list[tuple[str, str]]:
    """``(flag, value)`` for each "default X" (``default: X``, ``Default: X``, ``default is
    X``; X a backticked span, or one word that ends the clause) that a flag owns: in a table
    row whose first cell is a flag, that flag; in prose, the nearest flag at most a clause
    before it (not "the default model" of a sentence that names a flag somewhere)."""
    stated = re.compile(r"\b[Dd]efault(?: is|:)? (`[^`]+`|[\w.~/-]+(?=[,;.)]|$))")
    out = []
    for line in text.splitlines():
        cells = line.split("|")
        if line.startswith("| `--"):
            row_flag = FLAG.findall(cells[1])[0]
            out += [(row_flag, m.group(1).strip("`")) for c in cells[2:]
                    for m in stated.finditer(c)]
            continue
        for seg in re.split(r"(?<=\.) ", line):
            for m in stated.finditer(seg):
                spans = [(sp, FLAG.findall(sp.group(1)))
                         for sp in re.finditer(r"`([^`]+)`", seg[:m.start()])]
                spans = [(sp, f) for sp, f in spans if f]
                if spans and m.start() - spans[-1][0].end() <= 80:
                    out.append((spans[-1][1][-1], m.group(1).strip("`").rstrip(".")))
    return out


@pytest.mark.parametrize("name", DOCS)
def test_choices_and_defaults_the_docs_state_are_the_parsers(name, actions):
    """``--flag {a,b}`` lists the parser's choices; a table row or sentence that gives a flag's
    ``default X`` (or ``default: X``, ``Default: X``) gives the parser's default."""
    text = (ROOT / "docs" / name).read_text()
    checked = 0
    for flag, choices in re.findall(r"(--[a-z][\w-]*) \{([^}]+)\}", text):
        if flag not in actions:
            continue
        want = {tuple(a.choices) for a in actions[flag] if a.choices}
        assert tuple(choices.split(",")) in want, f"docs/{name}: {flag} {{{choices}}}"
        checked += 1
    for flag, value in _stated_defaults(text):
        if flag not in actions or all(a.default is None for a in actions[flag]):
            continue  # None defaults are described in words ($MLX_BRICKS_BACKEND, else auto)
        words = set().union(*(_default_words(a) for a in actions[flag]))
        assert value in words, f"docs/{name}: {flag} default {value!r}, code {words}"
        checked += 1
    if name in ("cli.md", "serving.md"):
        assert checked >= 5, f"docs/{name}: the test read only {checked} statements"


def test_the_bricks_flag_tables_list_every_flag():
    """cli.md and serving.md's tables of the ``mlx-bricks`` group hold each of its flags."""
    from mlx_bricks.entry.flags import add_bricks_flags

    group = add_bricks_flags(argparse.ArgumentParser(add_help=False))
    flags = {a.option_strings[0] for a in group._group_actions}
    for name in ("cli.md", "serving.md"):
        rows = {FLAG.findall(line)[0] for line in (ROOT / "docs" / name).read_text().splitlines()
                if line.startswith("| `--") and FLAG.findall(line)}
        assert flags <= rows, f"docs/{name} lacks {sorted(flags - rows)}"


def test_dequant_cap_default_is_stated_as_the_code_computes_it():
    from mlx_bricks.options import DEFAULT_CAP_FRACTION, DEFAULT_CAP_MIB

    for name in ("cli.md", "patch.md", "tuning.md"):
        text = " ".join((ROOT / "docs" / name).read_text().split())
        said = re.findall(r"DEQUANT_CAP`?[^.]*?default[^.]*?\.", text)
        assert said, f"docs/{name} gives no default of the dequantize cap"
        for s in said:
            assert f"1/{DEFAULT_CAP_FRACTION}" in s and f"{DEFAULT_CAP_MIB} MiB" in s, (name, s)
            assert not re.search(r"default \(?\d+\)?[;)]", s), (name, s)


def test_the_environment_table_is_env_variables():
    from mlx_bricks.env import VARIABLES

    text = (ROOT / "docs" / "cli.md").read_text()
    rows = re.findall(r"^\| `(MLX_BRICKS_\w+)` \| (.+?) \| (.+?) \|$", text, re.M)
    assert [(n, w, t) for n, w, t in rows] == [(v.name, v.what, v.takes)
                                               for v in VARIABLES.values()]


def test_every_variable_the_code_reads_is_in_the_table():
    """Each ``MLX_BRICKS_*`` name in the package's code is an ``env`` variable (or the
    ``.pth`` hook's and the user path's own words), so none is read unchecked."""
    from mlx_bricks.env import VARIABLES

    seen = set()
    for path in (ROOT / "mlx_bricks").rglob("*.py"):
        seen |= set(re.findall(r"\b(MLX_BRICKS_[A-Z_]*[A-Z])\b", path.read_text()))
    assert seen - set(VARIABLES) == set()


def test_the_hook_line_the_docs_show_is_the_installed_one():
    from mlx_bricks.entry.hook import PTH_LINE

    blocks, _ = _code("cli.md")
    assert PTH_LINE in blocks, "docs/cli.md shows another .pth line than entry.hook.PTH_LINE"


def test_home_and_tune_defaults():
    from mlx_bricks.home import DEFAULT_HOME
    from mlx_bricks.tune.buckets import DEFAULT_M

    cli = (ROOT / "docs" / "cli.md").read_text()
    assert f"default `{DEFAULT_HOME}/models/`" in cli
    assert f"(default `{' '.join(map(str, DEFAULT_M))}`" in cli


def test_readme_gives_the_two_commands_first_and_links_only_the_repository():
    lines = (ROOT / "README.md").read_text().splitlines()
    for command in ("bash scripts/run.sh", "bash scripts/test.sh"):
        first = next(i for i, line in enumerate(lines, 1) if line.startswith(command))
        assert first <= 25, f"README: {command!r} first at line {first}"
    for target in re.findall(r"\]\(([^)#]+)", "\n".join(lines)):
        assert target.startswith("http") or (ROOT / target).exists(), target
