"""The server bench (``mlx_bricks.bench.server``): exact conversations, the GPU group's models,
argument errors, the summary's arithmetic, the memory poll, and one real run of the CPU group
(stock and ``--use-bricks`` ``mlx_lm.server`` processes, the openai client) on the tiny model.
Speeds are recorded, never asserted."""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from mlx_bricks.bench import server as sv
from mlx_bricks.bench import user_path as up


@pytest.fixture(scope="module")
def tokenizer():
    return up._load_tokenizer(up.default_tokenizer_dir())


def test_plan_has_the_exact_token_counts_and_a_reply_that_round_trips(tokenizer):
    s = sv.CPU_SETTINGS
    plan = sv.make_plan(tokenizer, s)
    assert [len(sv.chat_tokens(tokenizer, plan.messages(i))) for i in range(len(s.turns))] == \
        list(s.turns)
    assert len(sv.chat_tokens(tokenizer, plan.history(0), generation_prompt=False)) == \
        s.system_tokens
    assert [len(sv.chat_tokens(tokenizer, [{"role": "user", "content": c}]))
            for c in plan.concurrent] == [s.concurrent_tokens] * s.concurrent
    assert len(set(plan.concurrent)) == s.concurrent  # no shared prefix past the template
    # the forced reply: max_tokens copies of one token, found back by the next turn's template
    assert tokenizer.encode(plan.reply, add_special_tokens=False) == [plan.reply_id] * s.max_tokens
    first = sv.chat_tokens(tokenizer, plan.messages(0))
    second = sv.chat_tokens(tokenizer, plan.messages(1))
    assert second[:len(first) + s.max_tokens] == first + [plan.reply_id] * s.max_tokens
    with pytest.raises(ValueError, match="turns must be ascending"):
        sv.make_plan(tokenizer, dataclasses.replace(s, turns=(384, 192)))
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        sv.make_plan(tokenizer, dataclasses.replace(s, max_tokens=0))


@pytest.mark.parametrize("argv, message", [
    (["--turns", "400", "200"], "turns must be ascending"),
    (["--turns", "40"], "turns must be ascending ints above system_tokens (48)"),
    (["--models", "nope"], "--models: unknown ['nope']"),
    (["--concurrent", "0"], "expected a positive integer, got 0"),
    (["--tokenizer", "/nonexistent"], "has no tokenizer_config.json"),
    (["--budget-s", "-1"], "--budget-s: must be positive"),
])
def test_bad_arguments_are_one_line_and_exit_2(capsys, tmp_path, argv, message):
    from mlx_bricks.bench.server_report import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args([*argv, "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and message in err
    assert err.startswith("python -m mlx_bricks.bench.server: error: ")


def test_gpu_group_models_have_the_real_shapes():
    from mlx_bricks.bench.core import BENCHMARKS, GROUPS, KERNEL, ON_REQUEST

    qwen, oss = (up.GPU_MODELS[n] for n in ("qwen35_35b_a3b_q4", "gpt_oss_20b_mxfp4"))
    t = qwen.text
    assert qwen.config["text_config"] is t and qwen.config["model_type"] == "qwen3_5_moe"
    assert (t["hidden_size"], t["num_hidden_layers"], t["full_attention_interval"],
            t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"],
            t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"], t["num_experts"],
            t["moe_intermediate_size"], t["num_experts_per_tok"],
            t["shared_expert_intermediate_size"], t["vocab_size"]) == (
        2048, 40, 4, 16, 32, 128, 16, 2, 256, 256, 512, 8, 512, 248320)
    c = oss.config
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_local_experts"],
            c["num_experts_per_tok"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["vocab_size"], c["sliding_window"]) == (
        2880, 24, 32, 4, 64, 8, 64, 201088, 128)
    assert (oss.mode, oss.bits, oss.group_size) == ("mxfp4", 4, 32)
    cut = sv.group_models("gpu")
    assert list(cut) == list(sv.GPU_SERVER_MODELS)
    assert cut["qwen35_35b_a3b_q4"].text["num_hidden_layers"] == up.GPU_LAYERS == \
        cut["qwen35_35b_a3b_q4"].config["text_config"]["num_hidden_layers"]
    assert "text_config" not in cut["gpt_oss_20b_mxfp4"].config
    assert "mxfp4 4-bit gs32" in cut["gpt_oss_20b_mxfp4"].describe()
    assert up.GPU_PLAN["qwen35_35b_a3b_q4"] == up.GPU_PLAN["gpt_oss_20b_mxfp4"] == (2240, 8192,
                                                                                     32768)
    assert GROUPS["server_gpu"] == [f"server_gpu_{n}" for n in sv.GPU_SERVER_MODELS]
    assert {BENCHMARKS[n].backend for n in GROUPS["server_gpu"]} == {KERNEL}
    assert set(GROUPS["server_cpu"]) | set(GROUPS["server_gpu"]) <= ON_REQUEST


@pytest.mark.parametrize("name, config, mode", [
    ("qwen35", {"model_type": "qwen3_5_moe", "text_config": {
        **up.GPU_MODELS["qwen35_35b_a3b_q4"].text, "hidden_size": 128, "head_dim": 64,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64, "vocab_size": 50000}}, "affine"),
    ("gpt_oss", {**up.GPU_MODELS["gpt_oss_20b_mxfp4"].config, "hidden_size": 64,
                 "intermediate_size": 64, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 50000},
     "mxfp4"),
])
def test_nested_and_mxfp4_models_are_written_and_load(tmp_path, name, config, mode):
    import mlx.core as mx
    from mlx_lm import load

    spec = up.ModelSpec(name, config, dtype="float16", bits=4,
                        group_size=32 if mode == "mxfp4" else 64, mode=mode).with_layers(4)
    up.write_model(spec, tmp_path / name, up.default_tokenizer_dir())
    saved = json.loads((tmp_path / name / "config.json").read_text())
    assert saved["quantization"]["mode"] == mode
    assert spec.text["num_hidden_layers"] == 4 and saved.get("text_config", saved)[
        "num_hidden_layers"] == 4
    model, _ = load(str(tmp_path / name))
    logits = model(mx.array([[1, 2, 3, 4]]))
    assert logits.shape == (1, 4, 50000) and (mx.argmax(logits[0], -1) < 49152).all().item()


def test_summary_ratios_percentiles_and_targets():
    def turn(i, ttft, tps, ctx):
        return {"turn": i, "ttft_s": ttft, "generation_tps": tps, "prompt_tokens": ctx}

    entry = {"model": {"name": "llama3_8b_q4"},
             "chat": {"stock": [turn(0, 4.0, 50.0, 100), turn(1, 9.0, 40.0, 200)],
                      "bricks": [turn(0, 1.0, 50.0, 100), turn(1, 3.0, 40.0, 200)]},
             "concurrent": {"stock": {"ttft_p50_s": 2.0, "wall_s": 6.0},
                            "bricks": {"ttft_p50_s": 1.0, "wall_s": 4.0}},
             "memory": {"key": "gpu_peak_mib", "stock": {"gpu_peak_mib": 1000},
                        "bricks": {"gpu_peak_mib": 1300}}}
    s = sv.summarize(entry)
    assert s["stock"]["ttft_p50_s"] == 6.5 and s["stock"]["ttft_p95_s"] == pytest.approx(8.75)
    r = s["ratios"]
    assert [(t["turn"], t["context_tokens"], t["ttft"], t["generation_tps"])
            for t in r["ttft_per_turn"]] == [(0, 100, 4.0, 1.0), (1, 200, 3.0, 1.0)]
    assert r["ttft_p50"] == pytest.approx(6.5 / 2.0) and r["concurrent_wall"] == 1.5
    assert r["peak_memory_delta_mib"] == 300 and r["peak_memory"] == 1.3
    assert s["targets"] == {"ttft_each_turn_at_least": 2.5, "ttft_met": True,
                            "peak_memory_delta_mib_at_most": 256, "memory_met": False}
    entry["memory"] = {"key": None, "stock": {}, "bricks": {}}
    entry["model"]["name"] = "other"
    s = sv.summarize(entry)
    assert s["ratios"]["peak_memory_delta_mib"] is None and s["targets"]["memory_met"] is None
    assert s["targets"]["ttft_met"] is None


def test_memory_poll_reads_nvidia_smi_per_process(tmp_path, monkeypatch):
    """A stand-in nvidia-smi lists: both servers' pids; one of them (no figure); pids of
    another namespace (matched in the order the servers started); none."""
    apps = tmp_path / "apps"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$1\" in --query-compute-apps*) cat {apps};; "
                   "*) echo 5000;; esac\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    me, other = os.getpid(), os.getppid()
    for listed, key, stock, bricks in (
            ({me: 700, other: 900}, "gpu_peak_mib", 700, 900),
            ({me: 700}, None, 700, None),
            ({1001: 650, 1002: 800}, "gpu_peak_mib", 650, 800),
            ({}, None, None, None)):
        apps.write_text("42, 300\n")  # listed before the servers start: left out
        poll = sv.MemoryPoll(interval=0.01)
        poll.add("stock", me)
        poll.add("bricks", other)
        apps.write_text("".join(f"{p}, {m}\n" for p, m in listed.items()))
        while poll.polls < 3:
            poll._stop.wait(0.01)
        got = poll.stop()
        assert (got["key"], got["stock"]["gpu_peak_mib"], got["bricks"]["gpu_peak_mib"]) == (
            key, stock, bricks), listed
        assert got["gpu_total_used_peak_mib"] == 5000 and got["stock"]["vm_hwm_mib"] > 0
        assert ("order the servers started" in got["source"]) == (1001 in listed)


# --- one real run ---------------------------------------------------------------------------

@pytest.mark.xdist_group("server")
def test_cpu_group_on_the_tiny_model(tmp_path):
    """Both servers for real (about 40-80 s on 2 loaded cores): every turn answered, the
    context grows by the planned tokens, the second turn reuses the whole first one from
    mlx-lm's prompt cache, the concurrent requests are answered, the JSON has its figures."""
    out = tmp_path
    assert sv.main(["--group", "cpu", "--out-dir", str(out), "--work", str(out / "work")]) == 0
    doc = json.loads((out / "server_cpu.json").read_text())
    assert doc["group"] == "server_cpu" and doc["mlx_lm"] and doc["device"]
    (m,) = doc["models"]
    s = sv.CPU_SETTINGS
    assert "error" not in m, m.get("error")
    assert m["settings"]["turns"] == list(s.turns)
    for side in sv.SIDES:
        info = m["servers"][side]
        assert info["ready_s"] > 0 and info["processes_left"] == []
        assert ("--use-bricks" in info["argv"]) == (side == "bricks")
        assert (info["bricks_line"] is not None) == (side == "bricks")
        assert all(w["completion_tokens"] and w["ttft_s"] > 0 for w in info["warmups"])
        turns = m["chat"][side]
        assert [t["prompt_tokens"] for t in turns] == list(s.turns)  # grows, exactly as planned
        for t in turns:
            assert t["reply_as_planned"] and t["finish_reason"] == "length"
            assert t["completion_tokens"] == s.max_tokens
            assert 0 < t["ttft_s"] < t["wall_s"] and t["generation_tps"] > 0
        # the second turn's prompt starts with the first turn and its reply: all from the cache
        assert turns[1]["cached_tokens"] == turns[0]["prompt_tokens"] + s.max_tokens
        assert turns[0]["cached_tokens"] < s.system_tokens
        assert [t["first"] for t in turns] == ["stock", "bricks"]
        conc = m["concurrent"][side]
        assert len(conc["requests"]) == s.concurrent
        for r in conc["requests"]:
            assert r["prompt_tokens"] == s.concurrent_tokens
            assert r["completion_tokens"] == s.max_tokens and 0 < r["ttft_s"] <= conc["wall_s"]
        assert conc["ttft_p50_s"] <= conc["ttft_p95_s"]
    assert m["memory"]["key"] == "vm_hwm_mib" and m["memory"]["nvidia_smi"] is None
    assert all(m["memory"][side]["vm_hwm_mib"] > 50 for side in sv.SIDES)
    assert m["summary"] == sv.summarize(m)
    r = m["summary"]["ratios"]
    assert [t["ttft"] for t in r["ttft_per_turn"]] == [
        a["ttft_s"] / b["ttft_s"] for a, b in zip(m["chat"]["stock"], m["chat"]["bricks"])]
    assert r["peak_memory_delta_mib"] == (m["memory"]["bricks"]["vm_hwm_mib"]
                                          - m["memory"]["stock"]["vm_hwm_mib"])
    table = (out / "server_cpu.md").read_text()
    assert table.count("| tiny_llama_q4 |") == len(s.turns) + 1
    assert not (out / "work" / "tiny_llama_q4").exists()
    assert {p.name for p in (out / "logs").iterdir()} == {
        "tiny_llama_q4_stock.log", "tiny_llama_q4_bricks.log"}
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        assert not (out / "server_cpu.png").exists()
    else:
        assert (out / "server_cpu.png").stat().st_size > 10_000


def test_module_runs_as_a_script():
    import subprocess

    out = subprocess.run([sys.executable, "-m", "mlx_bricks.bench.server", "--help"],
                         capture_output=True, text=True, check=True)
    assert "--turns" in out.stdout and "--concurrent-tokens" in out.stdout
