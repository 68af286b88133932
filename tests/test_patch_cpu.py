"""patch_model on a machine without a kernel backend (auto selection gives ``reference``):
quantized models and bfloat16 ones get the composites where they measure (or the prior says
they run) faster than stock; float16 and float32 models stay stock.

A tiny llama quantized with ``nn.quantize`` (4-bit gs64, float16 and bfloat16 activations) is
patched and tuned on ``reference``-auto: its pieces' composites win (MLX 0.32.4's CPU
``quantized_matmul`` is 17-57x slower than the dequantized float GEMM at these activation
dtypes, a margin no load on the machine closes); its logits meet the tolerance rule against
float64 of the dequantized weights and its greedy continuation is stock's (a difference
accepted only at a float64 tie, tests/test_patch.py's rule). Modules with float16 weights only
stay stock with the no-kernel-backend reason; bfloat16 ones run the NumPy-BLAS products (MLX's
CPU GEMM is tens of times slower: ``Dispatch.admits``); ``tune="off"`` patches nothing. The
default model quantized to 4 bits gives stock's 16 greedy tokens exactly (slow: the stock
side's float16 ``quantized_matmul`` takes minutes on 2 cores).
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from mlx_bricks.backends import backend_status
from mlx_bricks.patch import patch_model, unpatch_model
from mlx_bricks.runtime.dispatch import NO_KERNEL_BACKEND
from mlx_bricks.runtime.guard import GUARD
from tests.models import build_model, tokens
from tests.test_patch import greedy, run, run64
from tests.test_patch_quantized import assert_same_greedy_q, dense64
from tests.tolerance import assert_dtype_close


@pytest.fixture(autouse=True)
def _cpu_only(tmp_path, monkeypatch):
    if backend_status("metal")[0] or backend_status("cuda")[0]:
        pytest.skip("this machine has a kernel backend")
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path))  # a fresh decision cache
    monkeypatch.delenv("MLX_BRICKS_DEQUANT_CAP", raising=False)
    GUARD.reset()


def _quantize(model, only=None):
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, m: isinstance(
        m, nn.Linear) and path.startswith("model.layers.") and (only is None or only in path))
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_quantized_model_runs_the_composites(dtype):
    model = _quantize(build_model("llama", dtype))
    toks = tokens(24)
    ref = run64(dense64(model), toks)
    stock_logits = run(model, toks)
    stock = greedy(model, toks[0], 12)
    report = patch_model(model, dequant_cap=1)
    assert (report.backend.name, report.backend.source) == ("reference", "auto")
    assert report.n_patched == len(model.layers) and report.n_stock == 0
    assert_dtype_close(run(model, toks), ref, stock_logits, dtype=dtype, what="logits")
    assert_same_greedy_q(model, dense64(model), dtype, toks[0].tolist(), stock,
                         greedy(model, toks[0], 12))
    decisions = report.tuning()["decisions"]
    assert {d["key"].split("|")[1].split("[")[0] for d in decisions} == {
        "rms_norm_qkv", "linear", "swiglu_mlp"}
    assert all(d["winner"].startswith(("dequant", "blas")) for d in decisions), decisions
    calls = report.calls()  # two prefills (the logits, the greedy prompt)
    n = 2 * len(model.layers)
    assert calls["rms_norm_qkv"] == calls["linear"] == calls["swiglu_mlp"] == n
    from mlx_bricks.options import CAP_SETTING, CAP_STRICT_SETTING

    assert report.dispatch.common == {CAP_SETTING: 1 << 20, CAP_STRICT_SETTING: True}
    text = str(report)
    assert "dequant_cap=1 MiB (argument)" in text
    assert "composites of stock ops (no kernel backend)" in text
    # attention has no composite for float K/V: mlx-lm's own, with the reason
    assert all(r.startswith("attention: no kernel backend on this machine and no composite")
               for r in report.runtime_fallbacks())


def test_bfloat16_model_runs_the_blas_products():
    """bfloat16 weights on the CPU (``Dispatch.admits``), tune='cached': every dense piece runs
    the prior's NumPy-BLAS composite from 16 rows; logits within the dtype rule of float64 on
    the same weights, greedy tokens stock's up to a float64 tie; unpatched, stock's logits."""
    model = build_model("llama", mx.bfloat16)
    toks = tokens(24)
    ref = run64(dense64(model), toks)
    stock_logits = run(model, toks)
    stock = greedy(model, toks[0], 12)
    report = patch_model(model, tune="cached")
    assert report.n_patched == len(model.layers) and report.n_stock == 0, report
    assert_dtype_close(run(model, toks), ref, stock_logits, dtype=mx.bfloat16, what="logits")
    assert_same_greedy_q(model, dense64(model), mx.bfloat16, toks[0].tolist(), stock,
                         greedy(model, toks[0], 12))
    decisions = report.tuning()["decisions"]
    assert decisions and all(d["winner"].startswith("blas") and d["source"] == "prior"
                             for d in decisions), decisions
    n = 2 * len(model.layers)  # the logits' prefill and the greedy prompt's
    assert report.calls()["linear"] == report.calls()["swiglu_mlp"] == n
    unpatch_model(model)
    assert mx.array_equal(run(model, toks), stock_logits)


def test_float_modules_stay_stock_with_the_reason():
    model = _quantize(build_model("llama", mx.float16), only="mlp")
    prompt = tokens(16)[0]
    stock = greedy(model, prompt, 6)
    report = patch_model(model, fuse_block=False)
    assert [(m.module, m.status) for m in report.modules if m.layer == 0] == [
        ("self_attn", "stock"), ("mlp", "patched")]
    assert {m.reason for m in report.modules if m.status == "stock"} == {NO_KERNEL_BACKEND}
    assert type(model.layers[0].self_attn) is llama.Attention
    assert greedy(model, prompt, 6) == stock
    # the unified block reads the quantized MLP: patched
    assert patch_model(model).n_patched == len(model.layers)
    unpatch_model(model)


def test_float_model_and_tune_off_stay_stock():
    model = build_model("llama", mx.float16)
    report = patch_model(model)
    assert report.all_stock and report.dispatch is None
    assert {(m.status, m.reason) for m in report.modules} == {("stock", NO_KERNEL_BACKEND)}
    qmodel = _quantize(build_model("llama", mx.float16))
    report = patch_model(qmodel, tune="off")
    assert report.all_stock and report.dispatch is None


def test_bad_cap_is_one_line_naming_the_variable(monkeypatch):
    model = _quantize(build_model("llama", mx.float16))
    with pytest.raises(ValueError, match="^dequant_cap must be a number of MiB above 0, got 0$"):
        patch_model(model, dequant_cap=0)
    monkeypatch.setenv("MLX_BRICKS_DEQUANT_CAP", "lots")
    with pytest.raises(ValueError, match="^MLX_BRICKS_DEQUANT_CAP='lots': expected a number of "
                                         "MiB above 0$"):
        patch_model(model)


@pytest.mark.slow
def test_default_model_quantized_to_4_bits_answers_as_stock():
    """SmolLM2-135M (float16) with its decoder linears quantized 4-bit gs64 by nn.quantize: the
    patched prefill's logits (composites on the CPU: the products in float32 through NumPy's
    BLAS) no further from a float64 run of the same weights than stock's, and 8 greedy tokens
    stock's (further on, a 4-bit model's greedy text may turn where the two caches differ in
    their last float16 bits: the patched one is the closer to float64)."""
    from mlx_lm import load

    from mlx_bricks import default_model

    model, tokenizer = load(str(default_model()))
    _quantize(model)
    prompt = mx.array(tokenizer.encode("The capital of France is"))
    ref = run64(dense64(model), prompt[None])
    stock_logits = run(model, prompt[None])
    stock = greedy(model, prompt, 8)
    report = patch_model(model)
    assert report.n_patched == len(model.layers)
    assert_dtype_close(run(model, prompt[None]), ref, stock_logits, dtype=mx.float16,
                       what="logits")
    assert greedy(model, prompt, 8) == stock
    assert report.calls()["swiglu_mlp"] == 2 * len(model.layers)  # the logits, the greedy prompt
    print("\n" + tokenizer.decode(stock))
