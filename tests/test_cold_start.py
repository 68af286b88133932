"""What a fresh process pays: ``tune="cached"`` never measures (the prior and the cache decide),
a kernel winner runs only where its gain pays its build, and decode costs one check per
forward (the decode gate switches the patched modules to their stock classes).

Independent references: stock mlx-lm outputs of the same model and a float64 clone
(``tests.models.dense64``), never values the code under test produced.
"""
from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from mlx_bricks.backends import backend_status
from mlx_bricks.bricks import kinds
from mlx_bricks.nn import DECODE, BricksBlock
from mlx_bricks.patch import patch_model, unpatch_model
from mlx_bricks.patch.core import stock_path
from mlx_bricks.runtime import dispatch as dispatch_mod
from mlx_bricks.runtime.kind import Act, Variant
from mlx_bricks.tune import prior
from mlx_bricks.tune.cache import DecisionCache
from mlx_bricks.tune.tuner import STOCK, Decision
from tests.models import build_model, tokens
from tests.test_patch_cpu import dense64, run64
from tests.tolerance import assert_dtype_close

KINDS = kinds()


pytestmark = pytest.mark.usefixtures("fresh_home")


def _no_measuring(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("tune='cached' measured something")
    monkeypatch.setattr(dispatch_mod, "tune_op", boom)


def _quantized_llama(dtype=mx.float16, layers=2):
    model = build_model("llama", dtype, num_hidden_layers=layers)
    nn.quantize(model, group_size=64, bits=4, class_predicate=lambda path, m: isinstance(
        m, nn.Linear) and path.startswith("model.layers."))
    mx.eval(model.parameters())
    return model


def run(model, toks, cache=None):
    out = model(toks, cache=cache)
    mx.eval(out)
    return out


# ---------------------------------------------------------------------------------------------
# tune="cached": nothing measured, prior and cache decide


def test_cached_mode_runs_the_prior_without_measuring(monkeypatch):
    if backend_status("metal")[0] or backend_status("cuda")[0]:
        pytest.skip("the CPU prior applies where there is no kernel backend")
    _no_measuring(monkeypatch)
    model = _quantized_llama()
    toks = tokens(24)
    ref = run64(dense64(model), toks)
    stock = run(model, toks)
    report = patch_model(model, tune="cached")
    assert (report.backend.name, report.backend.source) == ("reference", "auto")
    out = run(model, toks)
    assert_dtype_close(out, ref, stock, dtype=mx.float16, what="logits")
    decisions = report.tuning()["decisions"]
    assert decisions and {d["source"] for d in decisions} == {"prior"}
    # every quantized piece ran its composite, the products through NumPy's BLAS on the CPU
    # (attention has no candidate here: stock)
    winners = {d["key"].split("[")[0].split("|")[1]: d["winner"] for d in decisions}
    assert winners == {"rms_norm_qkv": "blas", "linear": "blas", "swiglu_mlp": "blas_fused"}
    assert report.calls()["linear"] == len(model.layers)
    assert DecisionCache().decisions() == {}  # a prior is never written as a measurement


def test_cached_mode_prefers_a_cached_measurement_over_the_prior(monkeypatch):
    if backend_status("metal")[0] or backend_status("cuda")[0]:
        pytest.skip("the CPU prior applies where there is no kernel backend")
    model = _quantized_llama(layers=1)
    toks = tokens(24)
    stock = run(model, toks)
    # measure once (auto), then flip the cached MLP decision to stock
    patch_model(model, tune="auto")
    run(model, toks)
    cache = DecisionCache()
    (key,) = [k for k in cache.decisions() if "swiglu_mlp" in k]
    d = Decision.from_dict(key, cache.decisions()[key])
    cache.put({key: Decision(key, STOCK, {}, 0.5, d.stock_s, d.variants, d.measured).to_dict()})
    _no_measuring(monkeypatch)
    report = patch_model(model, tune="cached")
    out = run(model, toks)
    assert {d["source"] for d in report.tuning()["decisions"]} == {"cache"}
    assert "swiglu_mlp" not in report.calls() and report.calls()["linear"] == 1
    assert "mlp: tuned: stock faster (x0.50)" in report.tuned_stock_calls()
    assert_dtype_close(out, run64(dense64(model), toks), stock, dtype=mx.float16,
                       what="logits")


def test_prior_rules():
    from mlx_bricks.bricks.gemm.piece import linear_args

    k = KINDS["linear"]
    cands = [Variant("wg128x128", {"tile": "wg128x128"}), *[c.bind({}) for c in k.composites]]
    q4 = nn.QuantizedLinear(4096, 4096, bits=4, group_size=64)
    q8 = nn.QuantizedLinear(4096, 4096, bits=8, group_size=64)
    small = nn.QuantizedLinear(2048, 512, bits=4, group_size=64)
    flt = nn.Linear(4096, 4096, bias=False)

    def winner(layer, M, backend, dtype=mx.bfloat16, candidates=cands):
        args = linear_args(layer, Act((1, M, 2048 if layer is small else 4096), dtype))
        return prior.prior_decision(k, args, candidates, backend, "x").winner

    for layer, M, backend, want in [
            (q4, 300, "cuda", "dequant"), (q4, 100, "cuda", STOCK), (q8, 600, "cuda", STOCK),
            (q8, 2048, "cuda", "dequant"), (small, 2048, "cuda", STOCK),
            (flt, 4096, "cuda", STOCK), (q4, 4096, "metal", STOCK),
            (q4, 8, "reference", "blas")]:
        assert winner(layer, M, backend) == want, (M, backend, want)
    # float32 activations on the CPU: stock (its quantized matmul was not measured slower)
    assert winner(q4, 64, "reference", mx.float32) == STOCK
    # a kernel variant never wins by prior (it would cost a build)
    assert winner(q4, 4096, "cuda", candidates=cands[:1]) == STOCK


def test_a_kernel_runs_only_where_its_gain_pays_its_build():
    d = Decision("k", "wg128x128", {}, 2.0, 2e-3,
                 {"wg128x128": {"s": 1e-3, "ok": True}, "dequant": {"s": 1.5e-3, "ok": True}})
    # gain 1 ms per call: 32 calls save 32 ms, far below a build of 1.5 s
    assert not prior.pays(d, "cuda", 32, built=False)
    assert prior.pays(d, "cuda", 32, built=True)
    assert prior.pays(d, "reference", 32, built=False)
    assert prior.pays(d, "cuda", 32, built=False, build_s=0.01)
    assert prior.pays(d, "cuda", 2000, built=False)
    alt = prior.without_builds(d, {"dequant"}, "k")
    assert alt.winner == "dequant" and alt.ratio == pytest.approx(2e-3 / 1.5e-3)
    assert prior.without_builds(d, set(), "k").winner == STOCK
    slow = Decision("k", "wg128x128", {}, 2.0, 2e-3,
                    {"wg128x128": {"s": 1e-3, "ok": True}, "dequant": {"s": 2.5e-3, "ok": True}})
    assert prior.without_builds(slow, {"dequant"}, "k").winner == STOCK
    no_timing = Decision("k", "wg128x128")
    assert not prior.pays(no_timing, "metal", 10, built=False)


@pytest.mark.parametrize("on_disk", [False, True])
def test_cached_kernel_winner_that_does_not_pay_runs_stock(monkeypatch, on_disk):
    """Through the dispatch: a cached kernel winner with a small gain runs stock in
    ``cached`` mode (its build would cost more), unless its kernels are already compiled on
    this machine (the CUDA build cache: ``kernels.is_built``) or the gain pays the build."""
    monkeypatch.setattr(dispatch_mod, "TUNED_BACKENDS", ("metal", "cuda", "reference"))
    monkeypatch.setattr(prior, "BUILD_BACKENDS", ("cuda", "metal", "reference"))
    monkeypatch.setitem(prior.BUILD_S, "reference", 1.0)
    asked = []
    monkeypatch.setattr(dispatch_mod, "is_built", lambda k: asked.append(k) or on_disk)
    monkeypatch.setattr(KINDS["linear"], "variants",
                        lambda backend, dtype=None, args=None, names=None, settings=None: [
                            Variant("64x64", {"tile": "64x64"},
                                    cuda_kernels=KINDS["linear"].cuda_kernels)])
    model = build_model("llama", mx.float32, num_hidden_layers=2)
    attn = model.layers[0].self_attn
    o_args = {"x": Act((1, 20, attn.n_heads * 64), mx.float32), "weight": attn.o_proj.weight,
              "bias": None, "residual": Act((1, 20, 128), mx.float32)}
    key = f"reference|{KINDS['linear'].key(o_args)}"
    variants = {"64x64": {"s": 1e-3, "ok": True}}
    DecisionCache().put({key: Decision(key, "64x64", {"tile": "64x64"}, 1.3, 1.3e-3,
                                       variants).to_dict()})
    _no_measuring(monkeypatch)
    for k in ("rms_norm_qkv", "attention", "swiglu_mlp"):  # the others: cached stock
        monkeypatch.setattr(KINDS[k], "variants", lambda *a, **kw: [])
    toks = tokens(20)
    stock = run(model, toks)
    report = patch_model(model, backend="reference", tune="cached")
    out = run(model, toks)
    assert asked and set(asked) <= set(KINDS["linear"].cuda_kernels)  # the build cache asked
    if on_disk:  # nothing to build: the measured winner runs
        assert report.calls()["linear"] == 2
        return
    assert "linear" not in report.calls()
    (o,) = [d for d in report.tuning()["decisions"] if d["key"] == key]
    assert o["winner"] == STOCK and "would not pay its build" in o["reason"]
    assert mx.allclose(out, stock, rtol=1e-5, atol=1e-5)
    # 0.3 ms x 2 layers pays a build of 0.5 ms
    monkeypatch.setitem(prior.BUILD_S, "reference", 5e-4)
    report = patch_model(model, backend="reference", tune="cached")
    run(model, toks)
    assert report.calls()["linear"] == 2


def test_command_defaults_never_measure_before_the_first_token():
    from mlx_bricks.entry.commands import COMMANDS
    from mlx_bricks.entry.flags import add_bricks_flags

    assert {n: (c.tune, c.tune_at_load) for n, c in COMMANDS.items()} == {
        "generate": ("cached", False), "chat": ("cached", False),
        "server": ("auto", True), "benchmark": ("auto", False)}
    p = argparse.ArgumentParser()
    add_bricks_flags(p, tune_default="cached")
    assert p.parse_args([]).bricks_tune == "cached"
    assert p.parse_args(["--bricks-tune", "auto"]).bricks_tune == "auto"


# ---------------------------------------------------------------------------------------------
# the decode gate


def test_decode_runs_the_stock_classes_and_costs_one_check(monkeypatch):
    model = build_model("llama", mx.float32, num_hidden_layers=3)
    stock_model = build_model("llama", mx.float32, num_hidden_layers=3)
    toks = tokens(12)
    report = patch_model(model, backend="reference", tune="off")
    assert report.n_patched == 3
    bricks_classes = [type(layer) for layer in model.layers]
    entered = []
    real = BricksBlock.__call__

    def counting(self, *a, **k):
        entered.append(a[0].shape[1])
        return real(self, *a, **k)
    monkeypatch.setattr(BricksBlock, "__call__", counting)

    cache, stock_cache = make_prompt_cache(model), make_prompt_cache(stock_model)
    out = run(model, toks, cache)
    want = run(stock_model, toks, stock_cache)
    assert mx.allclose(out, want, rtol=1e-4, atol=1e-4)
    assert entered == [12, 12, 12]
    nxt = mx.argmax(out[:, -1:], axis=-1)
    for _ in range(3):  # decode: the blocks' own mlx-lm classes, no bricks Python
        out = run(model, nxt, cache)
        want = run(stock_model, nxt, stock_cache)
        assert all(type(layer) is llama.TransformerBlock for layer in model.layers)
        assert mx.allclose(out, want, rtol=1e-4, atol=1e-4)
        nxt = mx.argmax(out[:, -1:], axis=-1)
    assert entered == [12, 12, 12]
    assert report.stock_calls() == {DECODE: 3 * 3}  # counted as before, once a report reads
    # the next prefill switches the bricks classes back
    run(model, tokens(5, seed=1), make_prompt_cache(model))
    assert [type(layer) for layer in model.layers] == bricks_classes
    assert entered[3:] == [5, 5, 5]
    # stock_path in decode mode, then unpatch: the original classes everywhere
    run(model, nxt, cache)
    with stock_path(model):
        assert all(type(layer) is llama.TransformerBlock for layer in model.layers)
        run(model, tokens(5, seed=2))
        assert all(type(layer) is llama.TransformerBlock for layer in model.layers)
    assert [type(layer) for layer in model.layers] == bricks_classes
    assert unpatch_model(model) == 3
    assert type(model) is llama.Model
    assert all(type(layer) is llama.TransformerBlock for layer in model.layers)
    assert "_bricks_gate" not in model.__dict__


def test_gated_model_keeps_its_class_identity():
    model = build_model("llama", mx.float32, num_hidden_layers=1)
    patch_model(model, backend="reference", tune="off")
    assert isinstance(model, llama.Model)
    assert type(model).__name__ == "Model" and type(model).__module__ == llama.__name__
    unpatch_model(model)
    assert type(model) is llama.Model


# ---------------------------------------------------------------------------------------------
# memory: the composites' queued tiles are bounded; the tuner counts memory


def test_queued_tiles_are_bounded_on_gpu_backends(monkeypatch):
    """Every half cap of dequantized tiles the host submits the newest output and waits for
    the mark submitted half a cap earlier (never for the newest: the device keeps work
    queued); the composite's values are those of the unbounded computation; the CPU, which
    runs in order, is not bounded."""
    from types import SimpleNamespace

    from mlx_bricks.bricks.dequantize import composite
    from mlx_bricks.formats.layers import weight_of

    events = []
    fake = SimpleNamespace(**{n: getattr(mx, n) for n in dir(mx) if not n.startswith("__")})
    fake.async_eval = lambda a: (events.append(("submit", a)), mx.async_eval(a))
    fake.eval = lambda a: (events.append(("wait", a)), mx.eval(a))
    monkeypatch.setattr(composite, "mx", fake)
    bound = composite.InFlight()
    outs = [mx.full((2,), float(i)) for i in range(6)]
    for o in outs:  # 40 bytes each against a cap of 100: a mark every 2 tiles (>= 50 bytes)
        bound.queued(o, 40, 100)
    assert [(e, int(a[0].item())) for e, a in events] == [
        ("submit", 1), ("submit", 3), ("wait", 1), ("submit", 5), ("wait", 3)]
    assert bound.mark is outs[5]

    events.clear()
    layer = nn.QuantizedLinear(256, 512, bits=4, group_size=64)
    layer.set_dtype(mx.float16)
    x = mx.random.normal((1, 40, 256)).astype(mx.float16)
    want = layer(x)
    for backend, bounded in (("reference", False), ("cuda", True)):
        composite.IN_FLIGHT.reset()
        events.clear()
        tiles = composite.DenseTiles(cap=64 * 1024, how="mx", backend=backend)
        y = tiles.linear(x, (weight_of(layer),), (None,))
        assert mx.allclose(y, want, rtol=1e-2, atol=1e-2)
        assert (len([e for e in events if e[0] == "submit"]) > 0) == bounded
    composite.IN_FLIGHT.reset()


def test_tuner_refuses_a_variant_over_stock_peak_plus_the_cap():
    from mlx_bricks.tune.tuner import tune_op

    k = KINDS["linear"]
    layer = nn.Linear(512, 1024, bias=False)
    args = {"x": Act((1, 64, 512), mx.float32), "weight": layer.weight, "bias": None,
            "residual": None}

    def hungry(a, backend=None):  # the stock value, after holding a 16 MiB temporary
        big = mx.ones((4 * 2**20,), mx.float32)
        mx.eval(big)
        return k.stock(a) + 0 * big[:1].sum()

    lean = Variant("lean", fn=lambda a, backend=None: k.stock(a) * 1.0)
    d = tune_op(k, args, "reference", variants=[Variant("hungry", fn=hungry), lean],
                memory_cap=2**20, budget_s=0.2)
    assert not d.variants["hungry"]["ok"] and "peak memory" in d.variants["hungry"]["error"]
    assert d.variants["hungry"]["peak_bytes"] >= 16 * 2**20
    assert d.variants["lean"]["ok"]
    d = tune_op(k, args, "reference", variants=[Variant("hungry", fn=hungry)], budget_s=0.2)
    assert d.variants["hungry"]["ok"]  # no cap: no limit
    # a cap raised per call (options.call_cap): a function of stock's peak (its output here)
    seen = []
    d = tune_op(k, args, "reference", variants=[Variant("hungry", fn=hungry)], budget_s=0.2,
                memory_cap=lambda stock_peak: seen.append(stock_peak) or 32 * 2**20)
    assert len(seen) == 1 and 64 * 1024 * 4 <= seen[0] < 2 * 2**20, seen
    assert d.variants["hungry"]["ok"]


def test_server_on_the_cpu_serves_from_the_prior_at_once(monkeypatch):
    """The server measures at load only on a kernel backend; without one its requests are
    decided by the prior, and nothing is measured at load or at the first request."""
    if backend_status("metal")[0] or backend_status("cuda")[0]:
        pytest.skip("the CPU path")
    from mlx_bricks.entry.session import Session

    _no_measuring(monkeypatch)
    session = Session("server", argv=[])
    session.args = argparse.Namespace(bricks_kv="fp16", bricks_mlp_variant="auto",
                                      bricks_backend=None, bricks_tune="auto", verbose=False)
    model = _quantized_llama(layers=1)
    report = session.patch(model, "tiny")
    assert report.dispatch.mode == "cached"
    run(model, tokens(24))
    assert {d["source"] for d in report.tuning()["decisions"]} == {"prior"}


def test_prior_knows_the_microscaled_formats_only_where_measured():
    from mlx_bricks.bricks.gemm.piece import linear_args

    k = KINDS["linear"]
    cands = [c.bind({}) for c in k.composites]
    layer = nn.QuantizedLinear(1024, 1024, group_size=32, bits=4, mode="mxfp4")
    args = linear_args(layer, Act((1, 128, 1024), mx.float16))
    assert k.key(args).weights == "mxfp4"
    free = [c for c in cands if c.name == "dequant"]
    assert prior.prior_decision(k, args, free, "reference", "x").winner == "dequant"
    # CUDA: the composites of these formats were not measured there yet
    big = linear_args(nn.QuantizedLinear(4096, 4096, group_size=32, bits=4, mode="mxfp4"),
                      Act((1, 2048, 4096), mx.bfloat16))
    assert prior.prior_decision(k, big, free, "cuda", "x").winner == STOCK
    # the MoE composite: chosen by prior on the CPU only
    assert "moe_mlp" in prior.PRIOR_KINDS["reference"]
    assert "moe_mlp" not in prior.PRIOR_KINDS["cuda"]


# ---------------------------------------------------------------------------------------------
# the first-token guard: a one-shot process's prompt too short to pay the first-prefill cost


def _llama3_8b_q4_bytes(layers: int) -> int:
    """Bytes of Llama-3-8B's affine 4-bit gs64 dense linears (float16 scales and biases)."""
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336  # q o, k v, gate up down
    return layers * per_layer * (4 + 2 * 16 / 64) // 8


def test_first_token_guard_matches_the_h100_measurements():
    # bench/results/2026-12-05-h100-user-path.json, 2026-12-06-h100-first-call.jsonl: 8 layers
    # at 2,240 tokens were later than stock, 32 layers at 2,048 tokens too, and at 4,096 on one
    # of two H100s (0.82 + 0.31 s vs 0.56 + 0.47 s); 32 layers at 8,192 won on both (1.64 vs
    # 1.75 s, 0.82x in mlx_lm.generate).
    rate = prior.SAVED_S_PER_TOKEN_GIB["cuda"] / 2**30
    eight, full = (prior.min_prompt_tokens("cuda", rate * _llama3_8b_q4_bytes(n))
                   for n in (8, 32))
    assert eight > 2240 and 4096 < full <= 8192
    assert prior.min_prompt_tokens("cuda", 0) == float("inf")  # nothing the prior speeds up
    assert prior.min_prompt_tokens("reference", 1.0) == 0  # no one-off cost measured
    assert prior.min_prompt_tokens("metal", 1.0) == 0


def test_saved_per_token_counts_each_piece_kind():
    """The cost model is per model: a Gated DeltaNet mixer adds its own rate (per state
    element) and its projections that run as linear stages the dense rate, dense quantized
    linears theirs; on the real Qwen3.5-35B-A3B shape (30 Gated DeltaNet layers of 32 x 128 x
    128) the bricks pay from a few hundred tokens where the per-GiB rule alone (only the
    attention layers' linears, the MoE experts being stock on CUDA) said tens of thousands."""
    from mlx_bricks.bricks.gated_delta.kind import SAVED_S_PER_TOKEN_STATE
    from mlx_bricks.nn.gate import model_gate

    model = build_model("qwen3_5", mx.float16)
    nn.quantize(model, group_size=64, bits=4,
                class_predicate=lambda p, m: isinstance(m, nn.Linear) and "layers" in p)
    patch_model(model, backend="reference")
    modules = [m for m, _, _ in model_gate(model).modules]
    gdn = [m for m in modules if type(m).__name__.startswith("BricksMixer")]
    dense = [m for m in modules if m not in gdn]
    assert gdn and dense
    per_state = SAVED_S_PER_TOKEN_STATE["cuda"]
    # the mixers' big projections run as linear stages (the small in_proj_b / in_proj_a stay
    # the module's own layers, not counted)
    stage_bytes = sum(sum(getattr(m[p], n).nbytes for n in ("weight", "scales", "biases"))
                      for m in gdn for p in ("in_proj_qkv", "in_proj_z", "out_proj"))
    assert stage_bytes > 0
    want = (sum(per_state * m.num_v_heads * m.head_k_dim * m.head_v_dim for m in gdn)
            + prior.SAVED_S_PER_TOKEN_GIB["cuda"]
            * (prior.quantized_linear_bytes(dense) + stage_bytes) / 2**30)
    assert prior.saved_s_per_token("cuda", modules) == pytest.approx(want)
    assert prior.saved_s_per_token("metal", modules) == 0  # nothing measured there
    unpatch_model(model)
    real = 30 * per_state * 32 * 128 * 128
    assert 100 < prior.min_prompt_tokens("cuda", real) < 512


def test_mamba1_mixers_bring_their_saving():
    """Mamba-1 mixers (the selective-scan piece) add their own rate per state element, so a
    one-shot jamba / Falcon-Mamba prefill on CUDA leaves the first-token guard from a few
    dozen tokens (Falcon-Mamba-7B: 64 layers of 8192 x 16) instead of never (a float model has
    no quantized linears to count)."""
    from mlx_bricks.bricks.selective_scan.kind import SAVED_S_PER_TOKEN_STATE
    from mlx_bricks.nn.gate import model_gate
    from tests.ssm_models import build as build_ssm

    model = build_ssm("mamba", mx.bfloat16)
    patch_model(model, backend="reference")
    modules = [m for m, _, _ in model_gate(model).modules]
    mixers = [m for m in modules if type(m).__name__.startswith("BricksMixer")]
    assert len(mixers) == 2
    want = sum(SAVED_S_PER_TOKEN_STATE["cuda"] * m.intermediate_size * m.ssm_state_size
               for m in mixers)
    assert prior.saved_s_per_token("cuda", modules) == pytest.approx(want)
    unpatch_model(model)
    real = 64 * SAVED_S_PER_TOKEN_STATE["cuda"] * 8192 * 16
    assert prior.min_prompt_tokens("cuda", real) < 64


def test_mamba2_mixers_bring_their_saving():
    """Mamba-2 mixers (the ssd piece) add their measured rate per state element (H x P x N):
    on CUDA the scan is a small part of a Nemotron-3 layer once cuBLAS runs the GEMMs, so a
    one-shot prefill of the real model (23 Mamba-2 layers of 64 x 64 x 128) leaves the
    first-token guard only from ~16k tokens."""
    from mlx_bricks.bricks.ssd.kind import SAVED_S_PER_TOKEN_STATE
    from mlx_bricks.nn.gate import model_gate
    from tests.ssm_models import DENSE
    from tests.ssm_models import build as build_ssm

    model = build_ssm("nemotron_h", mx.bfloat16, **DENSE["nemotron_h"])
    patch_model(model, backend="reference")
    modules = [m for m, _, _ in model_gate(model).modules]
    mixers = [m for m in modules if type(m).__name__.startswith("BricksMixer")
              and hasattr(m, "ssm_state_size")]
    assert len(mixers) == 3
    got = sum(m._bricks_state.piece.prior_saving(m, "cuda") for m in mixers)
    assert got == pytest.approx(sum(SAVED_S_PER_TOKEN_STATE["cuda"] * m.num_heads * m.head_dim
                                    * m.ssm_state_size for m in mixers))
    unpatch_model(model)
    real = 23 * SAVED_S_PER_TOKEN_STATE["cuda"] * 64 * 64 * 128
    assert 10_000 < prior.min_prompt_tokens("cuda", real) < 30_000


def test_quantized_linear_bytes_counts_each_dense_linear_once():
    model = _quantized_llama(layers=2)
    args = model.args
    h, i = args.hidden_size, args.intermediate_size
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    elements = 2 * (2 * h * q + 2 * h * kv + 3 * h * i)  # two layers: q o, k v, gate up down
    # 4-bit weights, one float16 scale and bias per 64 weights
    assert prior.quantized_linear_bytes([model, *model.layers]) == elements // 2 + (
        elements // 64) * 2 * 2
    assert prior.quantized_linear_bytes([build_model("llama", mx.float16)]) == 0


def test_first_token_guard_runs_a_short_prompt_stock_once_per_cold_process(monkeypatch, capsys):
    import importlib

    from mlx_bricks.entry.session import Session, _FirstTokenGuard
    from mlx_bricks.nn import gate as gate_mod

    if backend_status("metal")[0] or backend_status("cuda")[0]:
        pytest.skip("the CPU path (the guard's cost is set for 'reference' here)")
    mlx_generate = importlib.import_module("mlx_lm.generate")  # the module, not the function
    # a one-off cost on the CPU backend such that this model pays from 16 tokens
    model = _quantized_llama(layers=2)
    qbytes = prior.quantized_linear_bytes(model.layers)
    monkeypatch.setitem(prior.FIRST_PREFILL_S, "reference", 1.0)  # see saved_s_per_token
    monkeypatch.setitem(prior.SAVED_S_PER_TOKEN_GIB, "reference", 2**30 / (16 * qbytes))
    monkeypatch.setattr(gate_mod, "WARM", set())
    stock_model = _quantized_llama(layers=2)
    session = Session("generate", argv=[])
    session.args = argparse.Namespace(bricks_kv="fp16", bricks_mlp_variant="auto",
                                      bricks_backend=None, bricks_tune="cached", verbose=True)
    report = session.patch(model, "tiny")
    capsys.readouterr()
    gate = gate_mod.model_gate(model)
    assert gate.min_prompt == pytest.approx(16)
    step = _FirstTokenGuard(session, mlx_generate.generate_step)

    def greedy(m, prompt, n=4, generate_step=mlx_generate.generate_step):
        gen = generate_step(prompt, m, max_tokens=n, prompt_cache=make_prompt_cache(m))
        return [int(t) for t, _ in gen]

    short, long = tokens(10, seed=3)[0], tokens(24, seed=4)[0]
    # a cold process: the 10-token prompt runs stock (its 9-token prefill forward included)
    assert greedy(model, short, generate_step=step) == greedy(stock_model, short)
    assert "linear" not in report.calls()
    assert report.stock_calls()[gate_mod.FIRST_TOKEN] == len(model.layers)
    assert capsys.readouterr().err.count("prompt of 10 tokens: stock prefill") == 1
    # a prompt that pays runs the bricks, and warms the backend for every later prompt
    out = greedy(model, long, generate_step=step)
    assert report.calls()["linear"] == len(model.layers) and "reference" in gate_mod.WARM
    assert out == greedy(stock_model, long)
    greedy(model, short, generate_step=step)
    assert report.calls()["linear"] == 2 * len(model.layers)
    assert capsys.readouterr().err == ""  # said once
    unpatch_model(model)
    # --bricks-tune auto / force ask for the bricks: no guard (off patches nothing here)
    for tune in ("auto", "force"):
        session.args.bricks_tune = tune
        session.patch(model, "tiny")
        assert gate_mod.model_gate(model).min_prompt == 0, tune
        unpatch_model(model)


def test_first_token_guard_is_on_for_one_shot_commands_only():
    from mlx_bricks.entry.commands import COMMANDS

    assert {n for n, c in COMMANDS.items() if c.first_token} == {"generate", "chat"}


def test_a_variant_is_built_only_when_all_its_cuda_kernels_are(monkeypatch):
    on_disk = {"gemm"}
    monkeypatch.setattr(dispatch_mod, "is_built", lambda k: k in on_disk)
    assert dispatch_mod.built(Variant("t", cuda_kernels=("gemm",)))
    assert not dispatch_mod.built(Variant("t", cuda_kernels=("gemm", "gemm_splitk")))
    assert not dispatch_mod.built(Variant("t"))  # kernels not known: not built
    linear = KINDS["linear"]
    assert linear.variant("64x64").cuda_kernels == linear.cuda_kernels
    brick = next(c for c in linear.composites if c.name.startswith("dequant_brick"))
    assert brick.bind({}).cuda_kernels == ("dequantize",)
    on_disk.add("dequantize")
    assert dispatch_mod.built(brick.bind({}))


def test_warm_first_use_dequantizes_each_format_once(monkeypatch):
    """The composites' first-use costs are paid at patch time on CUDA: one small dequantize and
    GEMM per weight format (dtype, bits, group_size, mode) the patched modules hold, evaluated;
    nothing elsewhere."""
    from mlx_bricks.bricks.dequantize import composite

    model = build_model("llama", mx.float16)
    nn.quantize(model.layers[0], group_size=64, bits=4)
    nn.quantize(model.layers[1], group_size=32, bits=8)
    nn.quantize(model.layers[2], group_size=64, bits=4)
    calls = []
    real = mx.dequantize

    def spy(w, scales, biases=None, **kw):
        calls.append((kw["bits"], kw["group_size"], w.shape[0]))
        return real(w, scales, biases, **kw)

    monkeypatch.setattr(composite.mx, "dequantize", spy)
    assert composite.warm_first_use(model.layers, "reference") == 0.0 and not calls
    assert composite.warm_first_use(model.layers, "cuda") > 0
    assert sorted(calls) == [(4, 64, composite.WARM_ROWS), (8, 32, composite.WARM_ROWS)]
    calls.clear()
    assert composite.warm_first_use([build_model("llama", mx.float16)], "cuda") == 0.0
    assert not calls


def test_every_kind_names_registered_cuda_kernels():
    """The kernels each kind says its variants launch on cuda are registered twins (a renamed
    or new kernel shows up here, not as a build the dispatch counted as done); a kind names
    some unless it lists no kernel variant on cuda (sparse_attention: composites only)."""
    import mlx.core as mx

    from mlx_bricks import kernels

    kinds()
    for kind in KINDS.values():
        assert kind.cuda_kernels or not kind.listing("cuda", mx.bfloat16, None), kind.name
        for name in kind.cuda_kernels:
            assert kernels.has_kernel(name, "cuda"), (kind.name, name)
