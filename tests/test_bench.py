"""python -m mlx_bricks.bench: the JSON it writes, its errors. Speeds are reported, never
asserted (the timings are whatever this machine gives)."""
from __future__ import annotations

import json

import pytest

from mlx_bricks import bench
from mlx_bricks.bench import __main__ as cli
from mlx_bricks.bench.core import BENCHMARKS, Benchmark, run_benchmarks, time_call
from tests.support import require_backend


def test_emulator_gemm_benchmark_json(tmp_path):
    require_backend("emulator")
    out = tmp_path / "bench.json"
    assert cli.main(["--only", "emulator_gemm_256", "--repeats", "2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["repeats"] == 2 and data["mlx"]
    (r,) = data["results"]
    assert r["name"] == "emulator_gemm_256" and r["backend"] == "emulator"
    assert len(r["brick_runs_s"]) == len(r["stock_runs_s"]) == 2
    assert r["brick_s"] > 0 and r["stock_s"] > 0
    assert r["ratio"] == pytest.approx(r["stock_s"] / r["brick_s"])
    # float16 outputs of K=256 float-accumulated dot products (|y| up to ~60): a few ulps
    assert r["max_abs_diff"] < 0.25


def test_unavailable_backend_is_listed_with_the_reason(monkeypatch):
    def never():
        raise AssertionError("setup of a skipped benchmark must not run")

    monkeypatch.setitem(BENCHMARKS, "metal_only", Benchmark("metal_only", "metal", "x", never))
    monkeypatch.setattr("mlx_bricks.backends.backend_status",
                        lambda name: (False, "no Metal device"))
    (r,) = run_benchmarks(["metal_only"], 1)["results"]
    assert r["skipped"] == "backend metal unavailable: no Metal device"
    assert "brick_s" not in r


def test_bad_arguments(capsys):
    with pytest.raises(ValueError, match=r"unknown benchmark\(s\) \['nope'\]; known: "):
        run_benchmarks(["nope"])
    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        time_call(lambda: None, 0)
    with pytest.raises(ValueError, match="repeats must be a positive int, got 0"):
        run_benchmarks(["emulator_gemm_256"], 0)  # before the benchmark's setup runs
    with pytest.raises(SystemExit) as e:
        cli.main(["--repeats", "0"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m mlx_bricks.bench: error: argument --repeats: expected a positive "
                   "integer, got 0 (see --help)"]
    assert set(bench.__all__) <= set(dir(bench))


def test_bad_out_path_fails_before_running(tmp_path, monkeypatch, capsys):
    def boom(*args):
        raise AssertionError("the benchmarks must not run")

    monkeypatch.setattr("mlx_bricks.bench.core.run_benchmarks", boom)
    with pytest.raises(SystemExit) as e:
        cli.main(["--out", str(tmp_path / "missing" / "b.json")])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m mlx_bricks.bench: ") and "not a writable directory" in line


def test_unknown_backend_in_the_environment_is_rejected(monkeypatch, capsys):
    monkeypatch.setenv("MLX_BRICKS_BACKEND", "tpu")
    with pytest.raises(SystemExit) as e:
        cli.main(["--only", "emulator_gemm_256"])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("python -m mlx_bricks.bench: error: MLX_BRICKS_BACKEND='tpu': expected one "
                    "of metal, cuda, emulator, reference")


def test_e2e_group_expands_and_needs_a_kernel_backend(monkeypatch):
    from mlx_bricks.bench.core import GROUPS, expand

    names = GROUPS["e2e_llama8b_4layer"]
    float_names = [f"e2e_llama8b_4layer_{d}_m{m}" for d in ("bf16", "fp16")
                   for m in (512, 2048, 8192)]
    quant_names = [f"e2e_llama8b_4layer_bf16_{q}_m{m}" for q in ("q4g64", "q8g64")
                   for m in (512, 2048, 8192)]
    assert names == float_names + quant_names
    assert GROUPS["e2e_llama8b_4layer_float"] == float_names
    assert GROUPS["e2e_llama8b_4layer_quantized"] == quant_names
    assert expand(["emulator_gemm_256", "e2e_llama8b_4layer", names[0]]) == [
        "emulator_gemm_256", *names]
    monkeypatch.setattr("mlx_bricks.backends.backend_status",
                        lambda name: (False, f"no {name} here"))
    results = run_benchmarks(["e2e_llama8b_4layer"], 1)["results"]
    assert [r["name"] for r in results] == names
    assert {r["skipped"] for r in results} == {
        "backend metal|cuda unavailable: metal: no metal here; cuda: no cuda here"}


def test_e2e_benchmark_on_a_tiny_llama():
    """The e2e machinery (shared weights, same-process interleaved timing, the patch's facts)
    on a tiny llama; on a machine without a kernel backend the patch leaves it stock."""
    from mlx_bricks.backends import active_backend
    from mlx_bricks.bench.core import KERNEL, run_one
    from mlx_bricks.bench.e2e import LlamaShape, setup

    tiny = LlamaShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=64,
                      vocab=64)
    b = Benchmark("tiny", KERNEL, "tiny llama", lambda: setup(tiny, "fp16", 24), min_calls=2)
    r = run_one(b, 2)
    assert len(r["brick_runs_s"]) == len(r["stock_runs_s"]) == 2
    assert r["calls_per_eval"]["brick"] >= 2 and r["ratio"] > 0
    assert r["model"] == {"shape": tiny.__dict__, "dtype": "fp16", "M": 24, "weights": "float"}
    assert json.loads(json.dumps(r)) == r
    if active_backend().name == "reference":
        assert r["patch"]["all_stock"] is True and r["patch"]["calls"] == {}
        assert r["max_abs_diff"] == 0.0 and r["tuning"]["applies"] is False
    with pytest.raises(ValueError, match="dtype must be one of"):
        setup(tiny, "fp32", 8)


def test_cpu_group_runs_only_without_a_kernel_backend(monkeypatch):
    from mlx_bricks.bench.core import CPU, GROUPS

    names = GROUPS["e2e_small_llama_cpu"]
    assert names == [f"e2e_small_llama_cpu_{d}_{q}_m{m}" for q in ("q4g64", "q8g64")
                     for d in ("fp16", "bf16") for m in (128, 512)]
    assert {BENCHMARKS[n].backend for n in names} == {CPU}
    monkeypatch.setattr("mlx_bricks.backends.backend_status",
                        lambda name: (name == "cuda", f"{name} status"))
    results = run_benchmarks(names[:1], 1)["results"]
    assert results[0]["skipped"] == ("backend cpu unavailable: a kernel backend is available "
                                     "(cuda status): the patch would not run on the CPU")


def test_formats_cpu_group():
    """The microscaled formats' CPU cases: one per mode and dtype, plus the MoE one; a case's
    composite and stock compute the same product (the brick side is the composite)."""
    import mlx.core as mx

    from mlx_bricks.bench import formats
    from mlx_bricks.bench.core import CPU, GROUPS

    names = GROUPS["formats_cpu"]
    assert names == [f"formats_cpu_linear_{m}_{d}" for m in ("mxfp4", "nvfp4", "mxfp8")
                     for d in ("fp16", "bf16")] + ["formats_cpu_moe_mxfp4_bf16"]
    assert {BENCHMARKS[n].backend for n in names} == {CPU}
    brick, stock, info = formats._linear_setup("mxfp8", "fp32")
    b, s = brick(), stock()
    # float32 sums of the same exact products (K = 1024 terms)
    assert mx.abs(b - s).max().item() <= 1e-5 * mx.abs(s).max().item()
    assert info()["shape"] == {"M": 128, "N": 1024, "K": 1024}


def test_cpu_e2e_case_reports_peak_memory_and_load():
    """A CPU e2e case on a tiny quantized llama (where no kernel backend exists): the
    composites run, the peaks and the load are in the result."""
    from mlx_bricks.backends import active_backend
    from mlx_bricks.bench.core import CPU, run_one
    from mlx_bricks.bench.e2e import LlamaShape, setup

    if active_backend().name != "reference":
        pytest.skip("this machine has a kernel backend")
    tiny = LlamaShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=64,
                      vocab=64)
    r = run_one(Benchmark("tiny", CPU, "tiny", lambda: setup(tiny, "bf16", 32, fmt=(4, 64))), 1)
    assert r["patch"]["n_patched"] == 2 and r["patch"]["calls"]["swiglu_mlp"] > 0
    # a tiny model: the default cap is 1/32 of its weight bytes, at least 1 MiB
    assert r["patch"]["dequant_cap"] == "1 MiB (default, 1/32 of the weights)"
    mem = r["peak_memory"]
    assert mem["case"] >= max(mem["brick"]["peak"], mem["stock"]["peak"]) > 0
    assert mem["brick"]["peak"] >= mem["brick"]["before"] > 0
    assert json.loads(json.dumps(r)) == r


def test_e2e_quantized_model_shares_the_quantized_weights():
    # Both sides hold the same nn.quantize'd arrays: the decoder linears are QuantizedLinear
    # (embedding and LM head float), and the forwards agree exactly when nothing is patched.
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_bricks.bench import e2e

    tiny = e2e.LlamaShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2,
                          head_dim=64, vocab=64)
    patched_fwd, stock_fwd, info = e2e.setup(tiny, "bf16", 16, fmt=(4, 64))
    stock, patched = e2e._models(tiny, "bf16", (4, 64))
    layer = stock.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, nn.QuantizedLinear)
    assert (layer.mlp.down_proj.bits, layer.mlp.down_proj.group_size) == (4, 64)
    assert type(stock.model.embed_tokens) is nn.Embedding
    assert patched.model.layers[0].self_attn.q_proj.weight is layer.self_attn.q_proj.weight
    assert info()["model"]["weights"] == "affine 4-bit, group_size 64"
    if info()["patch"]["all_stock"]:
        assert mx.array_equal(patched_fwd(), stock_fwd())


def test_a_case_whose_stock_cannot_run_reports_no_stock_figure():
    """Where stock raises (the MoE bench: ``gather_qmm`` at 65,536 rows on MLX 0.32.4 CUDA), the
    stock side is the brick's own call: the entry must not report a ratio against stock."""
    import mlx.core as mx

    from mlx_bricks.bench.core import CPU, run_one

    a = mx.arange(16, dtype=mx.float32)

    def brick():
        return a * 2

    b = Benchmark("stockless", CPU, "x * 2", lambda: (brick, brick, lambda: {
        "flop": 16.0, "stock_error": "no implementation"}))
    r = run_one(b, 1)
    assert r["ratio"] is None and r["stock_s"] is None and r["stock_tflops"] is None
    assert r["max_abs_diff"] is None and "stock" not in r["peak_memory"]
    assert r["brick_s"] > 0 and r["brick_tflops"] > 0 and r["stock_error"] == "no implementation"
    assert json.loads(json.dumps(r)) == r


def test_e2e_case_whose_stock_cannot_run_times_the_patched_model_alone():
    """The 4-bit Qwen3-MoE M = 8192 case: stock mlx-lm's forward raises on MLX 0.32.4 CUDA
    (``gather_qmm``), the patched one runs. The entry says why and holds no stock figure; the
    patched side is still the patched model (its patch facts and calls are there)."""
    import mlx.nn as nn

    from mlx_bricks.bench import e2e
    from mlx_bricks.bench.core import CPU, run_one

    class Fails(nn.Module):
        def __call__(self, x):
            raise RuntimeError("cuGraphAddKernelNode failed: invalid argument")

    tiny = e2e.LlamaShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2,
                          head_dim=64, vocab=64)
    try:
        stock, patched = e2e._models(tiny, "bf16", (4, 64))
        stock.model.layers[1].mlp = Fails()
        r = run_one(Benchmark("stockless e2e", CPU, "tiny",
                              lambda: e2e.setup(tiny, "bf16", 32, fmt=(4, 64))), 1)
    finally:
        e2e._MODELS.clear()
    assert r["stock_error"] == "cuGraphAddKernelNode failed: invalid argument"
    assert r["ratio"] is None and r["stock_s"] is None and r["max_abs_diff"] is None
    assert r["brick_s"] > 0 and "stock" not in r["peak_memory"]
    assert r["patch"]["n_patched"] == 2 and r["patch"]["calls"]
    assert json.loads(json.dumps(r)) == r


def test_qwen3_moe_group_is_registered_and_builds_on_a_tiny_shape():
    """``e2e_qwen3_moe_4layer``: bf16 float and 4-bit gs64 experts at M 512 / 2048 / 8192 on a
    kernel backend; its setup builds a tiny qwen3_moe (quantized: stock's CPU ``gather_mm``
    takes float32 only) whose experts are QuantizedSwitchLinear on both sides, router float."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from mlx_bricks.bench import e2e
    from mlx_bricks.bench.core import GROUPS, KERNEL

    names = GROUPS["e2e_qwen3_moe_4layer"]
    assert names == [f"e2e_qwen3_moe_4layer_bf16{q}_m{m}" for q in ("", "_q4g64")
                     for m in (512, 2048, 8192)]
    assert {BENCHMARKS[n].backend for n in names} == {KERNEL}
    assert "Qwen3-30B-A3B" in BENCHMARKS[names[0]].what
    assert (e2e.QWEN3_MOE_4LAYER.hidden, e2e.QWEN3_MOE_4LAYER.experts,
            e2e.QWEN3_MOE_4LAYER.top_k, e2e.QWEN3_MOE_4LAYER.moe_intermediate) == (
                2048, 128, 8, 768)
    tiny = e2e.Qwen3MoeShape(hidden=64, moe_intermediate=64, experts=4, top_k=2, layers=2,
                             heads=2, kv_heads=1, head_dim=32, vocab=64)
    patched_fwd, stock_fwd, info = e2e.setup(tiny, "bf16", 16, fmt=(4, 64))
    stock, patched = e2e._models(tiny, "bf16", (4, 64))
    mlp = stock.model.layers[0].mlp
    assert isinstance(mlp.switch_mlp.down_proj, QuantizedSwitchLinear)
    assert type(mlp.gate) is nn.Linear
    assert patched.model.layers[0].mlp.switch_mlp.up_proj.weight is mlp.switch_mlp.up_proj.weight
    out, ref = patched_fwd(), stock_fwd()
    assert out.shape == ref.shape == (1, 64)
    if info()["patch"]["all_stock"]:
        assert mx.array_equal(out, ref)
    e2e._MODELS.clear()


def test_gpt_oss_groups_are_registered_and_build_on_a_tiny_shape():
    """``e2e_gpt_oss20b_4layer`` (kernel backend) and ``e2e_small_gpt_oss_cpu``: gpt_oss with
    mxfp4 experts (QuantizedSwitchLinear on both sides, the rest float); the tiny model's
    patched forward is close to stock's (the numerics: tests/test_microscaling.py)."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from mlx_bricks.bench import e2e
    from mlx_bricks.bench.core import CPU, GROUPS, KERNEL

    names = GROUPS["e2e_gpt_oss20b_4layer"]
    assert names == [f"e2e_gpt_oss20b_4layer_bf16_mxfp4_m{m}" for m in (512, 2048, 8192)]
    assert {BENCHMARKS[n].backend for n in names} == {KERNEL}
    cpu = GROUPS["e2e_small_gpt_oss_cpu"]
    assert cpu == [f"e2e_small_gpt_oss_cpu_bf16_mxfp4_m{m}" for m in (128, 512)]
    assert {BENCHMARKS[n].backend for n in cpu} == {CPU}
    assert (e2e.GPT_OSS_20B_4LAYER.hidden, e2e.GPT_OSS_20B_4LAYER.experts,
            e2e.GPT_OSS_20B_4LAYER.top_k) == (2880, 32, 4)
    tiny = e2e.GptOssShape(hidden=64, intermediate=64, experts=4, top_k=2, layers=2, heads=2,
                           kv_heads=1, head_dim=32, vocab=64)
    patched_fwd, stock_fwd, info = e2e.setup(tiny, "bf16", 16, fmt="mxfp4")
    stock, patched = e2e._models(tiny, "bf16", "mxfp4")
    experts = stock.model.layers[0].mlp.experts
    assert isinstance(experts.down_proj, QuantizedSwitchLinear)
    assert experts.down_proj.mode == "mxfp4"
    assert type(stock.model.layers[0].self_attn.q_proj).__name__ == "Linear"
    out, ref = patched_fwd(), stock_fwd()
    assert out.shape == ref.shape == (1, 64)
    assert info()["model"]["weights"] == "mxfp4 experts"
    scale = mx.abs(ref).max().item()
    assert mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item() <= 0.05 * scale
    e2e._MODELS.clear()


def test_prefill_runs_the_prompt_as_mlx_lm_does():
    """``bench.e2e.prefill`` (the e2e forward and the patch check's timing): the last token's
    logits after the rest of the prompt went into the cache, in one chunk or several, equal one
    whole-prompt call's last position (stock mlx-lm, float32 weights)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_bricks.bench.e2e import LlamaShape, _models, prefill

    tiny = LlamaShape(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, head_dim=64,
                      vocab=64)
    model = _models(tiny, "fp16", None)[0]
    model.set_dtype(mx.float32)
    tokens = mx.random.randint(0, 64, (1, 37), key=mx.random.key(3))
    want = model(tokens, cache=make_prompt_cache(model))[:, -1, :]
    for step in (None, 8, 36, 100):
        got = prefill(model, tokens, step)
        assert got.shape == (1, 64)
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), step
    one = prefill(model, tokens[:, :1])
    assert mx.allclose(one, model(tokens[:, :1])[:, -1, :], atol=1e-5, rtol=1e-5).item()


@pytest.mark.parametrize("family", ["nemotron_h", "lfm2"])
def test_e2e_quantized_state_space_families(family):
    # The 4-bit benchmarks of the state-space families quantize their decoder layers' linears
    # (nemotron_h keeps them under backbone.layers), not the embedding or the LM head; the
    # patched prefill's last logits are as close to a float32 truth (the same 4-bit weights,
    # float32 activations) as stock's bf16 run.
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_map

    from mlx_bricks.bench import e2e
    from mlx_bricks.bench.ssm import Lfm2Shape, NemotronHShape

    assert "e2e_nemotron3_4layer_bf16_q4g64_t8192" in BENCHMARKS
    assert "e2e_lfm2_1b_4layer_bf16_q4g64_t2048" in BENCHMARKS
    if family == "nemotron_h":
        tiny = NemotronHShape(hidden=128, heads=4, head_dim=16, groups=2, state=16, vocab=64)
    else:
        tiny = Lfm2Shape(hidden=64, ff=128, heads=1, kv_heads=1, vocab=64)
    patched_fwd, stock_fwd, info = e2e.setup(tiny, "bf16", 32, fmt=(4, 64))
    stock, _ = e2e._models(tiny, "bf16", (4, 64))
    body = stock.backbone if family == "nemotron_h" else stock.model
    quantized = [p for p, m in stock.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert quantized and all(".layers." in p for p in quantized)
    assert type(body.embeddings if family == "nemotron_h" else body.embed_tokens) is nn.Embedding
    assert info()["model"]["weights"] == "affine 4-bit, group_size 64"
    truth = tiny.model_class()(tiny.model_args())
    nn.quantize(truth, group_size=64, bits=4, class_predicate=e2e._quantized_layer)
    truth.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                          stock.parameters()))
    tokens = mx.random.randint(0, tiny.vocab, (1, 32), key=mx.random.key(32))
    want = e2e.prefill(truth, tokens).astype(mx.float32)
    got, ref = (f().astype(mx.float32) for f in (patched_fwd, stock_fwd))
    assert got.shape == ref.shape == (1, 64)
    err, stock_err = (mx.abs(a - want).max().item() for a in (got, ref))
    assert err <= 1.5 * stock_err + 0.02, (err, stock_err)
