"""The patch consults the tuner (``mlx_bricks.runtime.dispatch``): per-piece brick or stock,
cached and forced decisions, ``tune="off"``, honest CPU behaviour, and the build and first-call
guard with injected faults (an invalid kernel source, a kernel returning wrong values).

Tuning applies to ``metal`` and ``cuda`` only; tests that exercise it on this machine let it
apply to ``reference`` too (fixture ``tuned_reference``) and inject variants whose speed is
really different (a "slow" variant computes stock four times). No clock is mocked.
"""
from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.models import llama

from mlx_bricks import kernels, ops
from mlx_bricks.backends import backend_status
from mlx_bricks.runtime import dispatch as dispatch_mod
from mlx_bricks.patch import patch_model
from mlx_bricks.runtime.dispatch import NO_KERNEL_BACKEND
from mlx_bricks.tune.cache import DecisionCache
from mlx_bricks.bricks import kinds
from mlx_bricks.runtime.kind import Act, Variant
from mlx_bricks.tune.tuner import Decision
from tests.models import build_model, clone, tokens
from tests.support import require_backend
from tests.tolerance import assert_dtype_close

KINDS = kinds()

PIECES = ("qkv", "attention", "o_proj", "mlp")


pytestmark = pytest.mark.usefixtures("fresh_home")


@pytest.fixture
def tuned_reference(monkeypatch):
    """Tuning applies to the reference backend here (it stands in for metal / cuda)."""
    monkeypatch.setattr(dispatch_mod, "TUNED_BACKENDS", ("metal", "cuda", "reference"))


def run(model, toks, cache=None):
    out = model(toks, cache=cache)
    mx.eval(out)
    return out


def _maximum(outs):
    if isinstance(outs[0], tuple):
        return tuple(_maximum([o[i] for o in outs]) for i in range(len(outs[0])))
    m = outs[0]
    for o in outs[1:]:
        m = mx.maximum(m, o)
    return m


def slow_variants(monkeypatch, names=("slow",)):
    """Every kind offers variants that compute stock four times (really slower, same values)."""
    for k in KINDS.values():
        vs = [Variant(n, fn=lambda a, backend=None, k=k: _maximum([k.stock(a) for _ in range(4)]))
              for n in names]
        monkeypatch.setattr(k, "variants",
                            lambda backend, dtype=None, args=None, names=None, settings=None,
                            vs=vs: list(vs))


def count_tune_calls(monkeypatch) -> list:
    """Count (and run) the dispatcher's measurements; ``calls.restore()`` re-installs the
    counter after another patch of ``tune_op``."""
    calls = _Calls()
    real = dispatch_mod.tune_op

    def counting(kind, args, backend, **kw):
        calls.append(str(kind.key(args)))
        return real(kind, args, backend, **kw)

    monkeypatch.setattr(dispatch_mod, "tune_op", counting)
    calls.restore = lambda: monkeypatch.setattr(dispatch_mod, "tune_op", counting)
    return calls


class _Calls(list):
    """A list with a ``restore`` hook."""


def forbid_tuning(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("nothing may be measured here")

    monkeypatch.setattr(dispatch_mod, "tune_op", boom)


# ---------------------------------------------------------------------------------------------
# honest CPU


def test_no_kernel_backend_leaves_every_module_stock():
    if backend_status("metal")[0] or backend_status("cuda")[0]:
        pytest.skip("this machine has a kernel backend")
    model = build_model("llama", mx.float16)
    toks = tokens(20)
    stock = run(model, toks)
    report = patch_model(model)
    assert (report.backend.name, report.backend.source) == ("reference", "auto")
    assert report.n_patched == 0 and report.n_fallback == 0 and report.all_stock
    assert report.n_stock == len(model.layers)
    assert {(m.status, m.reason) for m in report.modules} == {("stock", NO_KERNEL_BACKEND)}
    assert all(type(layer) is llama.TransformerBlock for layer in model.layers)
    assert mx.array_equal(run(model, toks), stock)
    assert report.calls() == {} and report.dispatch is None
    text = str(report)
    assert "left stock on purpose (3 modules): no kernel backend on this machine" in text
    data = report.to_dict()
    assert data["all_stock"] is True and data["tuning"]["applies"] is False
    assert json.loads(json.dumps(data)) == data
    # naming a backend, reference included, still patches (tests and debugging)
    assert patch_model(model, backend="reference").n_patched == len(model.layers)


# ---------------------------------------------------------------------------------------------
# tuning through the patch


def test_tuned_stock_pieces_run_the_original_block(tuned_reference, monkeypatch):
    slow_variants(monkeypatch)
    tuned = count_tune_calls(monkeypatch)
    model = build_model("llama", mx.float32, num_hidden_layers=2)
    toks = tokens(20)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert report.tuning()["applies"] and report.options["tune"] == "auto"
    assert mx.array_equal(run(model, toks), stock)  # every piece stock: the block's __call__
    assert len(tuned) == 4  # one decision per piece, shared by the two identical layers
    assert report.calls() == {}
    reasons = report.tuned_stock_calls()
    assert sum(reasons.values()) == 4 * len(model.layers)
    assert {r.split(":")[0] for r in reasons} == set(PIECES)
    assert all(": tuned: stock faster (x0." in r for r in reasons)
    assert report.runtime_fallbacks() == {}
    decisions = report.tuning()["decisions"]
    assert len(decisions) == 4 and {d["winner"] for d in decisions} == {"stock"}
    assert {d["source"] for d in decisions} == {"measured"}
    text = str(report)
    assert "tuning decisions (ratio = stock time / brick time):" in text
    assert "tuned stock paths (stock measured faster):" in text
    # the decisions are cached: a new patch measures nothing and decides the same
    assert len(DecisionCache().decisions()) == 4
    monkeypatch.setattr(dispatch_mod, "tune_op", lambda *a, **k: pytest.fail("measured"))
    report = patch_model(model, backend="reference")
    assert mx.array_equal(run(model, toks), stock)
    assert {d["source"] for d in report.tuning()["decisions"]} == {"cache"}
    # force measures again
    tuned.clear()
    tuned.restore()
    report = patch_model(model, backend="reference", tune="force")
    run(model, toks)
    assert len(tuned) == 4
    assert {d["source"] for d in report.tuning()["decisions"]} == {"measured"}


def test_cached_decisions_mix_brick_and_stock_pieces(tuned_reference, monkeypatch):
    """A cached brick winner for the out-projection runs the GEMM brick there; the other pieces
    (measured slower) run mlx-lm's own code."""
    slow_variants(monkeypatch)
    monkeypatch.setattr(KINDS["linear"], "variants",
                        lambda backend, dtype=None, args=None, names=None, settings=None: [
                            Variant("64x64", {"tile": "64x64"})])
    model = build_model("llama", mx.float32, num_hidden_layers=2)
    attn = model.layers[0].self_attn
    o_args = {"x": Act((1, 20, attn.n_heads * 64), mx.float32), "weight": attn.o_proj.weight,
              "bias": None, "residual": Act((1, 20, 128), mx.float32)}
    key = f"reference|{KINDS['linear'].key(o_args)}"
    DecisionCache().put({key: Decision(key, "64x64", {"tile": "64x64"}, 1.3, 1e-3).to_dict()})
    toks = tokens(20)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    out = run(model, toks)
    assert mx.allclose(out, stock, rtol=1e-5, atol=1e-5)
    assert report.calls() == {"linear": 2}
    pieces = {r.split(":")[0] for r in report.tuned_stock_calls()}
    assert pieces == {"qkv", "attention", "mlp"}
    (o,) = [d for d in report.tuning()["decisions"] if d["key"] == key]
    assert (o["winner"], o["source"], o["reason"]) == ("64x64", "cache",
                                                       "tuned: 64x64 faster (x1.30)")


def test_cached_winner_the_op_no_longer_offers_is_measured_again(tuned_reference, monkeypatch):
    slow_variants(monkeypatch)
    tuned = count_tune_calls(monkeypatch)
    model = build_model("llama", mx.float32, num_hidden_layers=1)
    patch_model(model, backend="reference")
    run(model, tokens(9))
    assert len(tuned) == 4
    cache = DecisionCache()
    cache.put({k: dict(v, winner="gone") for k, v in cache.decisions().items()})
    tuned.clear()
    patch_model(model, backend="reference")
    run(model, tokens(9))
    assert len(tuned) == 4


def test_a_kind_without_variants_on_the_backend_runs_stock(tuned_reference, monkeypatch):
    """A brick without a kernel on the backend (a CUDA twin not written yet) is not measured:
    its pieces run stock, counted as a fallback with the reason."""
    slow_variants(monkeypatch)
    monkeypatch.setattr(KINDS["swiglu_mlp"], "variants",
                        lambda backend, dtype=None, args=None, names=None, settings=None: [])
    tuned = count_tune_calls(monkeypatch)
    model = build_model("llama", mx.float32, num_hidden_layers=1)
    report = patch_model(model, backend="reference")
    run(model, tokens(9))
    assert len(tuned) == 3
    assert report.runtime_fallbacks() == {
        "mlp: no reference kernel for swiglu_mlp (float32, w=float)": 1}


def test_fixed_mlp_variant_is_the_only_candidate(tuned_reference, monkeypatch):
    slow_variants(monkeypatch, names=("fused", "split"))
    tuned = count_tune_calls(monkeypatch)
    model = build_model("llama", mx.float32, num_hidden_layers=1)
    report = patch_model(model, backend="reference", mlp_variant="split")
    run(model, tokens(9))
    assert "swiglu=tuned (split only)" in report.modules[0].variant
    (mlp,) = [d for d in report.tuning()["decisions"] if "swiglu_mlp" in d["key"]]
    assert mlp["key"].endswith("|only=split")
    assert len(tuned) == 4
    decision = DecisionCache().get(mlp["key"])
    assert set(decision["variants"]) == {"split"}


def test_tune_off_reproduces_the_rules(tuned_reference, monkeypatch):
    """tune="off": no measurement; every piece runs its brick with the ops' default tile and
    variant arguments, exactly the composition the patch ran before the tuner existed."""
    forbid_tuning(monkeypatch)
    model = build_model("llama", mx.float32, num_hidden_layers=1)
    layer = model.layers[0]
    attn, mlp = layer.self_attn, layer.mlp
    x = mx.random.normal((1, 9, 128), key=mx.random.key(5))
    be = "reference"
    q, k, v = ops.rms_norm_qkv(x, layer.input_layernorm.weight, layer.input_layernorm.eps,
                               attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                               n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=64,
                               backend=be)
    o = ops.flash_attention(attn.rope(q), attn.rope(k), v, scale=attn.scale, mask="causal",
                            backend=be)
    h = ops.linear(o.transpose(0, 2, 1, 3).reshape(1, 9, -1), attn.o_proj.weight, residual=x,
                   backend=be)
    post = layer.post_attention_layernorm
    want = ops.swiglu_mlp(mx.fast.rms_norm(h, post.weight, post.eps), mlp.gate_proj.weight,
                          mlp.up_proj.weight, mlp.down_proj.weight, h, backend=be)
    report = patch_model(model, backend=be, tune="off")
    assert report.tuning()["why"].startswith("off:")
    assert report.modules[0].variant == "kv_quant=none, swiglu=reference"
    got = layer(x, "causal", None)
    assert mx.array_equal(got, want)
    assert report.calls() == {"rms_norm_qkv": 1, "flash_attention": 1, "linear": 1,
                              "swiglu_mlp": 1}
    assert report.tuning()["decisions"] == []


def test_named_emulator_is_not_tuned(monkeypatch):
    require_backend("emulator")
    forbid_tuning(monkeypatch)
    model = build_model("llama", mx.float32, num_hidden_layers=1)
    report = patch_model(model, backend="emulator", tune="force")
    assert report.tuning()["applies"] is False
    assert report.tuning()["why"] == ("not applied: backend emulator was named (argument); "
                                      "the bricks run as asked")


def test_bad_tune_value():
    model = build_model("llama", num_hidden_layers=1)
    with pytest.raises(ValueError, match="tune must be one of 'auto', 'cached', 'force', 'off', got 'on'"):
        patch_model(model, backend="reference", tune="on")


# ---------------------------------------------------------------------------------------------
# the build and first-call guard: injected faults on the emulator


@pytest.fixture
def fresh_kernels(request):
    """Kernel objects built during the test are forgotten afterwards (a broken source must
    not be served to later tests)."""
    kernels.get_kernel.cache_clear()
    request.addfinalizer(kernels.get_kernel.cache_clear)


def test_kernel_that_fails_to_build_is_disabled_and_stock_runs(fresh_kernels, monkeypatch):
    require_backend("emulator")
    real = kernels.read_source

    def broken(filename, package=kernels.SOURCE_PACKAGE):
        text = real(filename, package)
        if filename == "gemm.metal":
            text += "\n this is not Metal ;\n"
        return text

    monkeypatch.setattr(kernels, "read_source", broken)
    model = build_model("llama", mx.float32, num_hidden_layers=2)
    toks = tokens(7)
    stock = run(model, toks)
    report = patch_model(model, backend="emulator")
    out = run(model, toks)
    assert mx.allclose(out, stock, rtol=1e-4, atol=1e-4)
    # the GEMM kernel is the out-projection and the MLP's down projection: both pieces are
    # disabled and run stock in both layers; the other bricks (their own kernels) still ran
    linear, mlp = report.tuning()["disabled"]
    assert linear.startswith("linear variant rule on emulator failed to build or run: "
                             "EmulatorCompileError")
    assert mlp.startswith("swiglu_mlp variant fused on emulator failed to build or run: "
                          "EmulatorCompileError")
    fallbacks = report.runtime_fallbacks()
    for piece in ("o_proj", "mlp"):
        assert sum(n for r, n in fallbacks.items() if r.startswith(f"{piece}: disabled: ")) == 2
    assert dict(report.calls()) == {"rms_norm_qkv": 2, "flash_attention": 2}
    assert "disabled for this process (pieces run stock):" in str(report)


def attention_kernel_off_by_half(monkeypatch):
    """Every flash_attention kernel launch returns 1.5x its output (the guard's first-call
    check must catch it)."""
    real = kernels.launch

    def wrong(name, backend, **kw):
        outs = real(name, backend, **kw)
        return [o * 1.5 for o in outs] if name == "flash_attention" else outs

    monkeypatch.setattr(kernels, "launch", wrong)


def test_kernel_with_wrong_output_is_disabled_and_stock_runs(fresh_kernels, monkeypatch):
    require_backend("emulator")
    attention_kernel_off_by_half(monkeypatch)
    dt = mx.float16
    model = build_model("qwen2", dt)
    toks = tokens(12)
    with mx.stream(mx.cpu):  # float64 runs on the CPU only
        ref = run(clone(model, mx.float64), toks)
    stock = run(model, toks)
    report = patch_model(model, backend="emulator")
    out = run(model, toks)
    (reason,) = report.tuning()["disabled"]
    assert reason.startswith("attention variant rule on emulator: first output disagrees "
                             "with stock beyond tolerance (error ")
    fallbacks = report.runtime_fallbacks()
    assert sum(fallbacks.values()) == len(model.layers)
    assert all(r.startswith("attention: disabled: ") for r in fallbacks)
    assert "flash_attention" not in report.calls()
    assert report.calls()["rms_norm_qkv"] == len(model.layers)
    # the next prefill re-chooses (the disable invalidated every remembered choice)
    run(model, toks)
    assert sum(report.runtime_fallbacks().values()) == 2 * len(model.layers)
    assert report.calls()["rms_norm_qkv"] == 2 * len(model.layers)
    assert_dtype_close(out, ref, stock, dtype=dt, what="model with the attention brick disabled")


def test_structure_changed_after_a_call_is_seen():
    """The per-call structure check is remembered behind the identity of the layers and
    weights: adapters attached after a first prefill still switch the block to stock."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = build_model("llama", num_hidden_layers=2)
    report = patch_model(model, backend="reference")
    toks = tokens(10)
    run(model, toks)
    assert report.runtime_fallbacks() == {}
    linear_to_lora_layers(model, 1, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    patched = run(model, toks)
    (reason, n), = report.runtime_fallbacks().items()
    assert "LoRA/DoRA" in reason and n == 1
    from mlx_bricks.patch import unpatch_model

    unpatch_model(model)
    assert mx.array_equal(patched, run(model, toks))


def test_stock_path_runs_the_original_classes_for_a_while():
    from mlx_bricks.patch.core import stock_path

    model = build_model("llama", mx.float16, num_hidden_layers=2)
    toks = tokens(9)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    patched_classes = [type(layer) for layer in model.layers]
    with stock_path(model):
        assert all(type(layer) is llama.TransformerBlock for layer in model.layers)
        assert mx.array_equal(run(model, toks), stock)
    assert report.calls() == {}
    assert [type(layer) for layer in model.layers] == patched_classes
    run(model, toks)
    assert report.calls()["swiglu_mlp"] == 2
    with pytest.raises(TypeError, match="model"):
        with stock_path(None):
            pass


def test_neural_accelerators_are_read_from_the_architecture():
    """M5 and newer (applegpu_g17 on macOS 26.2+): MLX's own GEMM and attention use the neural
    accelerators; earlier generations and macOS releases keep the ALU kernels."""
    from mlx_bricks.backends import neural_accelerators

    assert neural_accelerators("applegpu_g16s", "26.2") is None
    assert neural_accelerators("applegpu_g17s", "26.1") is None
    assert neural_accelerators("", "26.2") is None
    assert "neural accelerators" in neural_accelerators("applegpu_g17s", "26.2")
    assert "applegpu_g18p" in neural_accelerators("applegpu_g18p", "")


def test_with_neural_accelerators_stock_is_kept_without_measuring(monkeypatch):
    """On an M5 the tuner reaches stock at once: the kernel variants are no candidates, nothing
    is timed, and the reason names the accelerators."""
    from mlx_bricks.backends import BackendChoice

    from mlx_bricks.bricks.dequantize import composite as composite_mod

    reason = "applegpu_g17s: MLX runs matmul ... on the GPU's neural accelerators"
    monkeypatch.setattr(dispatch_mod, "neural_accelerators", lambda: reason)
    # a Mac computes on its GPU: the CPU's NumPy-BLAS composite does not apply there
    monkeypatch.setattr(composite_mod, "on_cpu", lambda *a: False)
    monkeypatch.setattr(dispatch_mod, "tune_op", lambda *a, **k: pytest.fail("measured"))
    d = dispatch_mod.Dispatch(BackendChoice("metal", "argument", "test"), "auto")
    w = mx.random.normal((64, 32))
    choice = d.choose(KINDS["linear"], {"x": Act((1, 40, 32), mx.float32), "weight": w})
    assert not choice.brick and choice.tuned and choice.reason == f"stock kept: {reason}"
    # without the accelerators the same call has kernel candidates (and would be measured)
    monkeypatch.setattr(dispatch_mod, "neural_accelerators", lambda: None)
    d = dispatch_mod.Dispatch(BackendChoice("metal", "argument", "test"), "off")
    assert d.choose(KINDS["linear"], {"x": Act((1, 40, 32), mx.float32), "weight": w}).brick


# ---------------------------------------------------------------------------------------------
# the whole-block check


@pytest.fixture
def block_checked(tuned_reference, monkeypatch):
    """The whole-block check applies to ``reference`` too, and every piece's tuning answers that
    its "slow" variant (stock computed four times: really slower) is twice as fast as stock: a
    per-piece timing that misjudges the block, as on the H200 (docs/bench.md, 2026-12-04)."""
    monkeypatch.setattr(dispatch_mod, "BLOCK_CHECK_BACKENDS", ("metal", "cuda", "reference"))
    slow_variants(monkeypatch)
    monkeypatch.setattr(dispatch_mod, "tune_op", lambda kind, args, backend, **kw: Decision(
        f"{backend}|{kind.key(args)}", "slow", {}, 2.0, 1e-3))


def _block_decisions(report):
    return [d for d in report.tuning()["decisions"] if d["key"].startswith("reference|block[")]


def test_a_block_slower_than_stock_runs_stock(block_checked, monkeypatch):
    """Pieces that chose a brick stand only when the whole block is faster than stock: here it
    is four times slower, so every piece runs mlx-lm's code (bit for bit stock), counted as the
    block's tuned stock path; the check's own timed calls are not counted; the block decision
    is cached, and a cached "bricks" decision lets the bricks run."""
    model = build_model("llama", mx.float32, num_hidden_layers=2)
    toks = tokens(20)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert mx.array_equal(run(model, toks), stock)
    assert report.calls() == {}  # the check ran the slow bricks, uncounted
    reasons = report.tuned_stock_calls()
    assert sum(reasons.values()) == 4 * len(model.layers)
    assert {r.split(":")[0] for r in reasons} == set(PIECES)
    assert all(": tuned: block stock faster (x0." in r for r in reasons), reasons
    (block,) = _block_decisions(report)  # the two identical layers share one decision
    assert (block["winner"], block["source"]) == ("stock", "measured")
    assert block["ratio"] < 1 and block["measured"] == {"L": 20}
    assert all(f"{p}: " in block["key"] and " slow" in block["key"] for p in PIECES)
    piece_winners = {d["winner"] for d in report.tuning()["decisions"]
                     if d["key"] != block["key"]}
    assert piece_winners == {"slow"}
    assert mx.array_equal(run(model, toks), stock)  # the all-stock fast path now
    assert sum(report.tuned_stock_calls().values()) == 2 * 4 * len(model.layers)
    assert len(_block_decisions(report)) == 1  # measured once
    # a cached "bricks" decision for the same block: the pieces' bricks run
    cache = DecisionCache()
    data = dict(cache.get(block["key"]), winner="bricks", ratio=1.2)
    cache.put({block["key"]: data})
    monkeypatch.setattr(dispatch_mod, "tune_op", lambda *a, **k: pytest.fail("measured"))
    report = patch_model(model, backend="reference")
    assert mx.array_equal(run(model, toks), stock)  # the slow variant's values are stock's
    assert report.calls() == {"rms_norm_qkv": 2, "flash_attention": 2, "linear": 2,
                              "swiglu_mlp": 2}
    (block,) = _block_decisions(report)
    assert (block["winner"], block["source"]) == ("bricks", "cache")


def test_block_check_waits_for_a_call_it_can_repeat(block_checked):
    """A prefill into a cache already holding tokens cannot be repeated on a scratch cache: the
    pieces' choices run unweighed (counted as bricks) and no block decision is taken; the
    next prompt from an empty cache takes it, and it then holds for the same pieces' keys at
    any offset."""
    from mlx_lm.models.cache import make_prompt_cache

    model = build_model("llama", mx.float32, num_hidden_layers=2)
    toks = tokens(7)
    report = patch_model(model, backend="reference")
    cache = make_prompt_cache(model)
    run(model, tokens(1), cache)  # decode: stock by design; the cache now holds a token
    run(model, toks, cache)
    assert report.calls()["swiglu_mlp"] == len(model.layers)
    assert _block_decisions(report) == [] and report.tuned_stock_calls() == {}
    stock = run(build_model("llama", mx.float32, num_hidden_layers=2), toks)  # same weights
    # an empty cache: weighed (the block on scratch caches), stock faster
    assert mx.array_equal(run(model, toks, make_prompt_cache(model)), stock)
    assert len(_block_decisions(report)) == 1
    assert report.calls()["swiglu_mlp"] == len(model.layers)  # unchanged
    cache = make_prompt_cache(model)
    run(model, tokens(1), cache)
    run(model, toks, cache)  # offset 1 again: the block decision of these keys applies
    assert report.calls()["swiglu_mlp"] == len(model.layers)
    assert sum(report.tuned_stock_calls().values()) == 2 * 4 * len(model.layers)


def test_padded_batch_prefill_runs_unweighed(block_checked):
    """A padded batch (``BatchKVCache``: one offset per sequence, an array) cannot be repeated
    on a scratch cache: the pieces' choices run, nothing is weighed, nothing raises."""
    from mlx_lm.models.cache import BatchKVCache

    model = build_model("llama", mx.float32, num_hidden_layers=2)
    report = patch_model(model, backend="reference")
    toks = mx.concatenate([tokens(9), tokens(9)[:, ::-1]], axis=0)
    run(model, toks, [BatchKVCache([2, 0]) for _ in model.layers])
    assert report.calls()["swiglu_mlp"] == len(model.layers)
    assert _block_decisions(report) == [] and report.runtime_fallbacks() == {}


def test_guard_disabling_a_variant_while_the_block_is_timed(fresh_kernels, monkeypatch):
    """The block's first brick run can be inside its timing: there the guard disables the
    attention kernel (wrong first output). That timing is thrown away (not cached, nothing
    decided), the call runs the attention stock with the reason, and the next prefill weighs
    the block with the attention stock."""
    require_backend("emulator")
    monkeypatch.setattr(dispatch_mod, "TUNED_BACKENDS", ("metal", "cuda", "emulator"))
    monkeypatch.setattr(dispatch_mod, "BLOCK_CHECK_BACKENDS", ("metal", "cuda", "emulator"))
    monkeypatch.setattr(dispatch_mod, "tune_op", lambda kind, args, backend, variants, **kw:
                        Decision(f"{backend}|{kind.key(args)}", variants[0].name,
                                 dict(variants[0].kwargs), 2.0, 1e-3))
    attention_kernel_off_by_half(monkeypatch)
    model = build_model("llama", mx.float32, num_hidden_layers=1)
    toks = tokens(7)
    stock = run(model, toks)
    report = patch_model(model, backend="emulator")
    out = run(model, toks)
    (reason,) = report.tuning()["disabled"]
    assert reason.startswith("attention variant ") and "first output disagrees" in reason
    assert _emulator_block_decisions(report) == []
    assert not [k for k in DecisionCache().decisions() if "|block[" in k]
    assert list(report.runtime_fallbacks()) == [f"attention: disabled: {reason}"]
    assert mx.allclose(out, stock, rtol=1e-4, atol=1e-4)
    run(model, toks)  # chosen again: the attention stock, the block weighed (emulator: slow)
    (block,) = _emulator_block_decisions(report)
    assert block["source"] == "measured" and "attention: attention[" in block["key"]
    assert block["key"].split("attention: ")[1].split(";")[0].endswith(" stock")


def _emulator_block_decisions(report):
    return [d for d in report.tuning()["decisions"] if d["key"].startswith("emulator|block[")]


def test_an_attention_module_slower_than_stock_runs_stock(block_checked):
    """Where only the attention module is patched (qwen3_moe: its MLP is a SwitchGLU, patched
    apart), the attention module is weighed whole the same way: slower, so it runs mlx-lm's
    own attention (bit for bit stock)."""
    from tests.test_moe_patch import build as build_moe

    model = build_moe("qwen3_moe", head_dim=64)  # a head size the attention brick has
    toks = tokens(12)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    assert mx.array_equal(run(model, toks), stock)  # the MoE's "slow" variant gives stock's values
    attention = [m for m in report.modules if m.module == "self_attn"]
    assert attention and all(m.status == "patched" and m.calls == {} for m in attention)
    reasons = {r for m in attention for r in m.tuned_stock_calls}
    assert {r.split(":")[0] for r in reasons} == {"q_proj", "k_proj", "v_proj", "attention",
                                                  "o_proj"}
    assert all(": tuned: block stock faster (x0." in r for r in reasons), reasons
    (check,) = _block_decisions(report)
    assert "q_proj: linear[" in check["key"] and check["winner"] == "stock"
