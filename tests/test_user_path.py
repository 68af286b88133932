"""The user's-path bench (``mlx_bricks.bench.user_path``): model directories, exact prompts, the
CLI output parsers, and one real run of the CPU group's machinery on the tiniest model. Speeds
are recorded, never asserted."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlx_bricks.bench import user_models as um
from mlx_bricks.bench import user_path as up
from mlx_bricks.bench import user_report as ur


@pytest.fixture(scope="module")
def tokenizer_dir():
    return um.default_tokenizer_dir()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return um._load_tokenizer(tokenizer_dir)


def test_bench_modules_import_without_a_circle():
    # bench.core imports the modules that define benchmarks; none of them imports bench.core
    code = ("import sys; import mlx_bricks.bench.moe, mlx_bricks.bench.user_path, "
            "mlx_bricks.bench.formats, mlx_bricks.bench.gated_delta; "
            "print('mlx_bricks.bench.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_groups_are_registered_and_run_only_when_named(monkeypatch):
    from mlx_bricks.bench.core import BENCHMARKS, CPU, GROUPS, KERNEL, ON_REQUEST, run_benchmarks

    assert GROUPS["user_path_cpu"] == [f"user_path_cpu_{n}" for n in um.CPU_MODELS]
    assert GROUPS["user_path_gpu"] == [f"user_path_gpu_{n}" for n in um.GPU_MODELS]
    assert {BENCHMARKS[n].backend for n in GROUPS["user_path_cpu"]} == {CPU}
    assert {BENCHMARKS[n].backend for n in GROUPS["user_path_gpu"]} == {KERNEL}
    assert ON_REQUEST == {*GROUPS["user_path_cpu"], *GROUPS["user_path_gpu"],
                          *GROUPS["server_cpu"], *GROUPS["server_gpu"]}
    assert set(um.GPU_PLAN) == set(um.GPU_MODELS)
    # the default run leaves them out: every benchmark is skipped here, none is a user path
    monkeypatch.setattr("mlx_bricks.bench.core._status", lambda backend: (False, "off"))
    names = [r["name"] for r in run_benchmarks(None, 1)["results"]]
    assert names and not ON_REQUEST & set(names)


def test_gpu_models_have_the_real_models_shapes():
    llama, qwen, gemma = (um.GPU_MODELS[n].config for n in
                          ("llama3_8b_q4", "qwen3_30b_a3b_q4", "gemma3_12b_q4"))
    assert (llama["hidden_size"], llama["intermediate_size"], llama["num_hidden_layers"],
            llama["num_key_value_heads"], llama["vocab_size"]) == (4096, 14336, 32, 8, 128256)
    assert (qwen["hidden_size"], qwen["num_experts"], qwen["num_experts_per_tok"],
            qwen["moe_intermediate_size"], qwen["num_hidden_layers"]) == (2048, 128, 8, 768, 48)
    assert (gemma["hidden_size"], gemma["intermediate_size"], gemma["head_dim"],
            gemma["num_hidden_layers"], gemma["sliding_window"]) == (3840, 15360, 256, 48, 1024)
    assert [um.GPU_MODELS[n].bits for n in ("llama3_8b_q8", "llama3_8b_bf16")] == [8, None]
    spec = um.GPU_MODELS["llama3_8b_q4"].with_layers(8)
    assert spec.config["num_hidden_layers"] == 8 and llama["num_hidden_layers"] == 32
    with pytest.raises(ValueError, match="layers must be a positive int"):
        spec.with_layers(0)
    with pytest.raises(ValueError, match="layers must be at least 6 for gemma3_12b_q4"):
        um.GPU_MODELS["gemma3_12b_q4"].with_layers(4)
    # nemotron_h takes its layer count from the pattern: cut with it, and mlx-lm agrees
    from mlx_lm.models.nemotron_h import ModelArgs

    nemo = um.GPU_MODELS["nemotron3_nano_q4"]
    assert len(nemo.config["hybrid_override_pattern"]) == nemo.config["num_hidden_layers"] == 52
    cut = nemo.with_layers(8).config
    assert "".join(cut["hybrid_override_pattern"]) == "MEMEM*EM"
    assert ModelArgs.from_dict(cut).num_hidden_layers == 8


@pytest.mark.parametrize("tokens", [31, 48, 128, 777, 2240])
def test_prompt_has_the_exact_token_count(tokenizer, tokens):
    text = um.make_prompt(tokenizer, tokens)
    # mlx_lm.generate's own steps: the chat template, then encode without special tokens
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              tokenize=False, add_generation_prompt=True)
    assert len(tokenizer.encode(templated, add_special_tokens=False)) == tokens


def test_prompt_shorter_than_the_template_is_refused(tokenizer):
    with pytest.raises(ValueError, match=r"tokens must be at least \d+ \(the chat template"):
        um.make_prompt(tokenizer, 5)


def test_prefill_chunks_follow_mlx_lm(monkeypatch):
    """The chunks of mlx-lm's prompt phase, seen by a model that records its input lengths."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import KVCache

    seen = []

    class Recorder(nn.Module):
        layers = [None]

        def __call__(self, tokens, cache=None, **kw):
            seen.append(tokens.shape[1])
            cache[0].update_and_fetch(mx.zeros((1, 1, tokens.shape[1], 4)),
                                      mx.zeros((1, 1, tokens.shape[1], 4)))
            return mx.zeros((1, tokens.shape[1], 8))

    for tokens in (2, 512, 2049, 4500):
        seen.clear()
        gen = generate_step(mx.zeros((tokens,), dtype=mx.int32), Recorder(), max_tokens=1,
                            prompt_cache=[KVCache()])
        next(gen)
        assert um.prefill_chunks(tokens) == seen[:len(um.prefill_chunks(tokens))]
        assert sum(um.prefill_chunks(tokens)) == tokens


def test_parsers_read_the_clis_lines():
    out = ("==========\nsome text\n==========\nPrompt: 2240 tokens, 3095.125 tokens-per-sec\n"
           "Generation: 32 tokens, 181.500 tokens-per-sec\nPeak memory: 11.800 GB\n")
    assert up.parse_generate(out) == {"prompt_tokens": 2240, "prompt_tps": 3095.125,
                                      "generation_tokens": 32, "generation_tps": 181.5,
                                      "peak_memory_gb": 11.8}
    with pytest.raises(ValueError, match="no generation, peak line"):
        up.parse_generate("Prompt: 3 tokens, 1.0 tokens-per-sec\n")
    bench = ("Running warmup..\nTiming with prompt_tokens=512, generation_tokens=8, "
             "batch_size=1.\n"
             "Trial 1:  prompt_tps=100.000, generation_tps=10.000, peak_memory=1.000, "
             "total_time=2.000\n"
             "Trial 2:  prompt_tps=300.000, generation_tps=30.000, peak_memory=1.500, "
             "total_time=1.000\n"
             "Trial 3:  prompt_tps=200.000, generation_tps=20.000, peak_memory=1.200, "
             "total_time=1.500\nAverages: prompt_tps=200.000, generation_tps=20.000, "
             "peak_memory=1.233\n")
    r = up.parse_benchmark(bench, 512, 8)
    assert (r["prompt_tps"], r["generation_tps"], r["peak_memory_gb"]) == (200.0, 20.0, 1.5)
    assert len(r["trials"]) == 3 and r["trials"][1]["total_time_s"] == 1.0
    with pytest.raises(ValueError, match="no Trial line"):
        up.parse_benchmark("Averages: prompt_tps=1.0\n", 512, 8)


def test_run_cli_times_the_mark_and_stops_at_the_timeout():
    code = "import time; print('loading'); time.sleep(0.3); print('=========='); time.sleep(0.3)"
    r = up.run_cli([sys.executable, "-c", code], env=None, mark="==========")
    assert r["returncode"] == 0 and not r["timed_out"]
    assert 0.3 <= r["mark_s"] < r["wall_s"] and r["stdout"] == "loading\n==========\n"
    r = up.run_cli([sys.executable, "-c", "import time; time.sleep(30)"], env=None, timeout=1)
    assert r["timed_out"] and r["returncode"] != 0 and r["wall_s"] < 20 and r["mark_s"] is None


def test_ratios_are_patched_over_stock():
    stock = {"prompt_tps": 100.0, "generation_tps": 10.0, "peak_memory_gb": 2.0, "ttft_s": 5.0,
             "start_to_first_token_s": 8.0, "wall_s": 10.0}
    patched = {"prompt_tps": 400.0, "generation_tps": 5.0, "peak_memory_gb": 3.0,
               "ttft_s": 1.25, "start_to_first_token_s": None, "wall_s": 4.0}
    assert up.ratios(stock, patched) == {"prompt_tps": 4.0, "generation_tps": 0.5,
                                         "peak_memory": 1.5, "ttft_s": 4.0,
                                         "start_to_first_token_s": None, "wall_s": 2.5}
    assert up.ratios(stock, {"error": "exit 1"}) is None


def _small(spec_config, **over):
    return {**spec_config, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "vocab_size": 256, **over}


@pytest.mark.parametrize("name,config,bits", [
    ("llama_q8", _small(um._SMALL_LLAMA, num_attention_heads=2, num_key_value_heads=1), 8),
    ("qwen3_moe_q4", _small(um._SMALL_QWEN3_MOE, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=32, moe_intermediate_size=64, num_experts=4,
                            num_experts_per_tok=2), 4),
    ("gemma3_q4", _small(um._SMALL_GEMMA3, head_dim=64), 4),
    ("llama_float", _small(um._SMALL_LLAMA, num_attention_heads=2, num_key_value_heads=1),
     None),
])
def test_written_model_loads_in_mlx_lm(tmp_path, tokenizer_dir, name, config, bits):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import load

    spec = um.ModelSpec(name, config, dtype="float16", bits=bits)
    info = um.write_model(spec, tmp_path / name, tokenizer_dir)
    assert info["bytes"] > 0 and info["write_s"] > 0
    saved = json.loads((tmp_path / name / "config.json").read_text())
    if bits is None:
        assert "quantization" not in saved
    else:
        assert saved["quantization"]["bits"] == bits
        assert saved["quantization"]["group_size"] == 64
    assert (tmp_path / name / "tokenizer.json").is_file()
    model, tok = load(str(tmp_path / name))
    proj = model.layers[0].self_attn.q_proj
    assert isinstance(proj, nn.QuantizedLinear) == (bits is not None)
    if bits is not None:
        assert proj.bits == bits
    if name.startswith("qwen3_moe"):
        assert model.layers[0].mlp.gate.bits == 8  # qwen3_moe's own predicate: 8-bit router
    if name.startswith("gemma3"):
        assert model.tie_word_embeddings and "lm_head" not in model
    logits = model(mx.array([[1, 2, 3]]))
    assert logits.shape == (1, 3, 256) and logits.dtype == mx.float16
    assert mx.isfinite(logits).all().item()
    with pytest.raises(FileExistsError, match="already holds a model"):
        um.write_model(spec, tmp_path / name, tokenizer_dir)


def test_lm_head_rows_past_the_tokenizer_are_zero(tmp_path, tokenizer_dir):
    # the GPU models' vocabularies are larger than the default tokenizer's 49152 ids: greedy
    # decoding must land on ids it can print
    import mlx.core as mx
    from mlx_lm.utils import load

    config = _small(um._SMALL_LLAMA, num_attention_heads=2, num_key_value_heads=1,
                    vocab_size=49152 + 128)
    um.write_model(um.ModelSpec("wide", config, dtype="float16", bits=4), tmp_path / "w",
                   tokenizer_dir)
    model, _ = load(str(tmp_path / "w"))
    head = model.lm_head
    w = mx.dequantize(head.weight, head.scales, head.biases, head.group_size, head.bits)
    assert mx.all(w[49152:] == 0).item() and mx.any(w[:49152] != 0).item()
    logits = model(mx.array([[1, 2, 3, 4]]))
    assert (mx.argmax(logits[0], axis=-1) < 49152).all().item()


def test_cpu_group_machinery_on_the_tiny_model(tmp_path, tokenizer_dir):
    """Every run kind of two prompt lengths on the tiniest model, for real: fresh processes of
    mlx-lm's generate and benchmark, stock and --use-bricks; the JSON's figures are the CLIs'
    own (the token counts they print are the ones asked for). About 45 s on 2 loaded cores
    (20 processes), so not marked slow."""
    prompts, max_tokens, trials = (40, 72), 3, 1
    entry = up.run_model(um.TINY_LLAMA, prompts, max_tokens=max_tokens, trials=trials,
                         work=tmp_path / "work", tokenizer=tokenizer_dir,
                         log_dir=tmp_path / "logs", keep=True)
    assert json.loads(json.dumps(entry)) == entry
    saved = json.loads((tmp_path / "work" / "tiny_llama_q4" / "config.json").read_text())
    assert saved["quantization"]["bits"] == 4 and saved["num_hidden_layers"] == 2
    assert [it["tokens"] for it in entry["prompts"]] == list(prompts)
    kinds = [[r["kind"] for r in it["runs"]] for it in entry["prompts"]]
    assert kinds == [["stock", "cold", "cached", "long_stock", "long"],
                     ["stock", "first", "cached", "long_stock", "long"]]
    for item in entry["prompts"]:
        assert item["prefill_chunks"] == um.prefill_chunks(item["tokens"])
        by = {r["kind"]: r for r in item["runs"]}
        for kind, r in by.items():
            assert "error" not in r, f"{kind}: {r['error']}"
            assert r["prompt_tokens"] == item["tokens"]
            assert r["prompt_tps"] > 0 and r["generation_tps"] > 0 and r["peak_memory_gb"] > 0
            assert r["ttft_s"] == pytest.approx(item["tokens"] / r["prompt_tps"])
            assert 0 < r["load_s"] < r["wall_s"]
            assert (r["bricks_line"] is not None) == r["bricks"] == (
                kind not in ("stock", "long_stock"))
            if r["bricks"]:
                assert r["bricks_line"].startswith("[mlx-bricks] backend: ")
            if kind.startswith("long"):
                assert r["cli"] == "mlx_lm.benchmark" and len(r["trials"]) == trials
                assert r["start_to_first_token_s"] is None
            else:
                assert r["cli"] == "mlx_lm.generate" and r["generation_tokens"] <= max_tokens
                assert r["start_to_first_token_s"] == pytest.approx(r["load_s"] + r["ttft_s"])
                assert r["start_to_first_token_s"] < r["wall_s"]
            log = tmp_path / "logs" / f"tiny_llama_q4_p{item['tokens']}_{kind}.log"
            assert f"Prompt: {item['tokens']} tokens" in log.read_text() or kind.startswith(
                "long")
        for kind, base in (("cached", "stock"), ("long", "long_stock")):
            assert item["ratios"][kind] == up.ratios(by[base], by[kind])
            assert item["ratios"][kind]["prompt_tps"] == pytest.approx(
                by[kind]["prompt_tps"] / by[base]["prompt_tps"])
    first, second = entry["prompts"]
    # cold: an empty home (unless the run was retried: its first try wrote there)
    assert first["runs"][1]["home_files_before"] == 0 or "retried" in first["runs"][1]
    assert second["runs"][1]["home_files_before"] > 0  # the first prompt's decisions are there
    doc = {"models": [entry], "device": "cpu", "date": "today"}
    table = ur.format_table(doc)
    assert table.count("| tiny_llama_q4 |") == 10


@pytest.mark.parametrize("first_end, retried", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGABRT)", True),  # as glibc's heap check
    ("import sys; sys.exit(3)", False),  # an error of the CLI's own is the run's result
])
def test_a_run_killed_by_a_signal_runs_once_more(tmp_path, tokenizer_dir, tokenizer, monkeypatch,
                                                 first_end, retried):
    import signal

    model_dir = tmp_path / "tiny"
    um.write_model(um.TINY_LLAMA, model_dir, tokenizer_dir)
    real, argvs = up.run_cli, []

    def first_one_ends(argv, **kw):
        argvs.append(argv)
        return real([sys.executable, "-c", first_end] if len(argvs) == 1 else argv, **kw)

    monkeypatch.setattr(up, "run_cli", first_one_ends)
    r = up.run_one("stock", model_dir, tmp_path / "home", 40, um.make_prompt(tokenizer, 40),
                   max_tokens=2, trials=1)
    if retried:
        assert len(argvs) == 2 and argvs[0] == argvs[1]
        assert r["retried"]["returncode"] == -signal.SIGABRT and "error" not in r
        assert r["prompt_tokens"] == 40 and r["generation_tps"] > 0
        table = ur.format_table({"models": [{"model": {"name": "tiny"}, "prompts": [
            {"tokens": 40, "runs": [r], "ratios": {}}]}]})
        assert f"stock (2nd try: the 1st exited {-signal.SIGABRT})" in table
    else:
        assert len(argvs) == 1 and "retried" not in r and r["error"].startswith("exit 3")


def test_a_benchmark_that_measures_itself_is_run_by_the_runner(monkeypatch):
    from mlx_bricks.bench.core import BENCHMARKS, CPU, Benchmark, run_benchmarks

    monkeypatch.setitem(BENCHMARKS, "self_measured", Benchmark(
        "self_measured", CPU, "x", None, run=lambda repeats: {"trials": repeats}))
    monkeypatch.setattr("mlx_bricks.bench.core._status", lambda backend: (True, "here"))
    (r,) = run_benchmarks(["self_measured"], 4)["results"]
    assert r["trials"] == 4 and r["name"] == "self_measured" and "load_average" in r
