"""State-space and short-conv families patched (issue 42): tiny random mamba2, nemotron_h,
granitemoehybrid, falcon_h1, plamo2, lfm2, lfm2_moe, jamba and mamba (Mamba-1: Falcon-Mamba's
form) models from mlx-lm's own classes, patched
vs stock (logits within the dtype rule against a float32 truth, greedy tokens equal, the caches
written as stock writes them, a second prefill continuing a filled cache, decode stock and
counted, unpatch exact) on the reference backend and on the emulator (the MSL kernels), and the
report (unknown mixers stock with the reason)."""
import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.patch import patch_model, patch_report, unpatch_model
from tests.ssm_models import DENSE, build, tokens
from tests.test_gated_delta_patch import assert_same_greedy
from tests.tolerance import assert_dtype_close

#: model_type -> (the mixer's report entry, its brick op, mixers in the tiny model)
FAMILIES = {"mamba2": ("mamba", "ssd", 2), "nemotron_h": ("mamba", "ssd", 3),
            "granitemoehybrid": ("mamba", "ssd", 3), "falcon_h1": ("mamba", "ssd", 2),
            "plamo2": ("mamba", "ssd", 1), "lfm2": ("conv", "short_conv", 2),
            "lfm2_moe": ("conv", "short_conv", 2), "jamba": ("mamba", "selective_scan", 3),
            "mamba": ("mamba", "selective_scan", 2)}
#: The projections each brick's mixers run as linear stages.
STAGES = {"ssd": 2, "selective_scan": 4, "short_conv": 2}
DECODE = "decode (L == 1): stock path by design"


def run(model, toks, cache=None):
    out = model(toks, cache=cache)
    mx.eval(out)
    return out


def mixers(report, model_type):
    role = FAMILIES[model_type][0]
    return [m for m in report.modules if m.module == role]


def cache_arrays(cache):
    """The mixers' cache arrays of a model's cache list (falcon_h1: the CacheList's first)."""
    from mlx_lm.models.cache import ArraysCache

    out = []
    for c in cache:
        c = getattr(c, "caches", [c])[0]
        if isinstance(c, ArraysCache):
            out.append(c.cache)
    return out


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_patched_matches_stock(model_type, dtype):
    role, op, n = FAMILIES[model_type]
    dense = DENSE.get(model_type, {}) if dtype != mx.float32 else {}
    model = build(model_type, dtype, **dense)
    toks = tokens(70)
    truth_cache = build(model_type, mx.float32, **dense).make_cache()
    truth = run(build(model_type, mx.float32, **dense), toks, truth_cache)  # the half model's
    stock_cache = model.make_cache()
    stock = run(model, toks, stock_cache)
    report = patch_model(model, backend="reference")
    entries = mixers(report, model_type)
    assert len(entries) == n and all(m.status == "patched" for m in entries), report
    cache = model.make_cache()
    out = run(model, toks, cache)
    assert sum(m.calls.get(op, 0) for m in entries) == n
    # the projections as linear stages (Mamba-2 and LFM2: in_proj, out_proj; Mamba-1: x_proj,
    # dt_proj too)
    assert sum(m.calls.get("linear", 0) for m in entries) == STAGES[op] * n, report
    if dtype == mx.float32:
        np.testing.assert_allclose(np.array(out), np.array(stock), atol=2e-4, rtol=2e-4)
    else:
        assert_dtype_close(out, truth, stock, dtype=dtype, what=f"{model_type} logits")
    assert_same_greedy(out, stock, truth)
    # the caches as stock writes them: the first mixer's conv state is its input's (bit-equal),
    # the recurrent states in stock's dtype (Mamba-2: float32; Mamba-1: the model's) and close
    got, want = cache_arrays(cache), cache_arrays(stock_cache)
    assert len(got) == n
    assert mx.array_equal(got[0][0], want[0][0])
    for g, w, t in zip(got, want, cache_arrays(truth_cache)):
        assert g[0].dtype == w[0].dtype and g[0].shape == w[0].shape
        if len(g) > 1:
            assert g[1].dtype == w[1].dtype
            assert op == "selective_scan" or g[1].dtype == mx.float32
            if w[1].dtype == mx.float32:
                np.testing.assert_allclose(np.array(g[1]), np.array(w[1]), atol=0.05, rtol=0.05)
            else:  # stock's half-precision state drifts over the prompt: the dtype rule
                assert_dtype_close(g[1], t[1], w[1], dtype=dtype, what=f"{model_type} state")
    # decode: the module's own step on the cache the bricks wrote, counted
    step = run(model, toks[:, -1:], cache)
    stock_step = run(build(model_type, dtype, **dense), toks[:, -1:], stock_cache)
    assert mx.array_equal(mx.argmax(step, -1), mx.argmax(stock_step, -1))
    assert sum(m.stock_calls.get(DECODE, 0) for m in entries) == n
    assert unpatch_model(model) == report.n_patched
    assert mx.array_equal(run(model, toks, model.make_cache()), stock)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_second_turn_continues_the_cache(model_type):
    """A prompt prefilled in two turns (the second continuing the filled cache: conv and
    recurrent states, attention K/V) == one prefill == stock."""
    model = build(model_type, mx.float32, seed=1)
    toks = tokens(90, seed=1)
    stock = run(model, toks, model.make_cache())
    patch_model(model, backend="reference")
    cache = model.make_cache()
    first = run(model, toks[:, :41], cache)
    second = run(model, toks[:, 41:], cache)
    np.testing.assert_allclose(np.array(mx.concatenate([first, second], 1)), np.array(stock),
                               atol=2e-4, rtol=2e-4)
    entries = mixers(patch_report(model), model_type)
    assert sum(m.calls.get(FAMILIES[model_type][1], 0) for m in entries) == 2 * len(entries)


@pytest.mark.parametrize("model_type", ["granitemoehybrid", "lfm2"])
def test_padded_batch(model_type):
    """mlx-lm's left-padded batch (ArraysCache left_padding: make_mask's mask): the padded
    row's logits match its prompt run alone."""
    from mlx_lm.models.cache import ArraysCache, BatchKVCache

    model = build(model_type, mx.float32, seed=4)
    patch_model(model, backend="reference")
    a, b = tokens(20, seed=5), tokens(13, seed=6)
    alone = run(model, b, model.make_cache())
    batch = mx.concatenate([a, mx.concatenate([mx.zeros((1, 7), mx.int32), b], 1)], 0)
    cache = [ArraysCache(size=len(c.cache), left_padding=[0, 7]) if isinstance(c, ArraysCache)
             else BatchKVCache(left_padding=[0, 7]) for c in model.make_cache()]
    out = run(model, batch, cache)
    entries = mixers(patch_report(model), model_type)
    assert sum(m.calls.get(FAMILIES[model_type][1], 0) for m in entries) == 2 * len(entries)
    np.testing.assert_allclose(np.array(out[1, 7:]), np.array(alone[0]), atol=1e-3)


@pytest.mark.parametrize("backend", ["emulator", "cuda"])
@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_kernels_in_the_model(model_type, backend):
    """backend='emulator' (the MSL kernels) or 'cuda' (their twins, on a GPU): the mixers run
    the kernel (launches counted) and the logits match stock (float32: the kernel's rounding
    only; on a GPU, where stock's float32 products may round as TF32, the dtype rule against
    the CPU's float32 forward)."""
    from mlx_bricks import kernels
    from tests.support import require_backend

    require_backend(backend)
    role, op, n = FAMILIES[model_type]
    model = build(model_type, mx.float32, seed=7)
    toks = tokens(21, seed=8)
    stock = run(model, toks, model.make_cache())
    truth = None
    if backend == "cuda":
        with mx.stream(mx.cpu):
            truth = run(model, toks, model.make_cache())
    launched = {"ssd": "ssd_chunk_out"}.get(op, op)  # the SSD's last of three steps
    before = {k: kernels.LAUNCH_COUNTS[(k, backend)]
              for k in ("ssd_chunk_out", "short_conv", "selective_scan")}
    report = patch_model(model, backend=backend, mlp=False, tune="off")
    out = run(model, toks, model.make_cache())
    # every mixer runs its conv on the short_conv kernel (the Mamba-2 mixers' conv stage too)
    assert kernels.LAUNCH_COUNTS[("short_conv", backend)] - before["short_conv"] == n
    assert kernels.LAUNCH_COUNTS[(launched, backend)] - before[launched] == n
    assert sum(m.calls.get(op, 0) for m in mixers(report, model_type)) == n
    if truth is None:
        np.testing.assert_allclose(np.array(out), np.array(stock), atol=2e-4, rtol=2e-4)
    else:
        assert_dtype_close(out, truth, stock, dtype=mx.float32, what=f"{model_type} logits")


def test_unknown_mixers_stay_stock():
    """A Mamba-2 or Mamba-1 mixer subclass with its own forward or helper stays stock with the
    reason (jamba's attention and MLPs are still patched); attention=False disables the known
    ones."""
    from mlx_lm.models import jamba, nemotron_h

    class OwnStep(jamba.JambaMambaMixer):  # the vetted forward, another ssm_step
        def ssm_step(self, *args):
            return super().ssm_step(*args)

    model = build("jamba")
    model.layers[0].mamba.__class__ = OwnStep
    report = patch_model(model, backend="reference")
    mamba = [m for m in report.modules if m.module == "mamba"]
    assert [m.status for m in mamba] == ["fallback", "patched", "patched"]
    assert "OwnStep.ssm_step is not one the patch was read against" in mamba[0].reason
    assert any(m.module == "self_attn" and m.status == "patched" for m in report.modules)

    class Custom(nemotron_h.NemotronHMamba2Mixer):
        def __call__(self, hidden_states, mask, cache=None):
            return super().__call__(hidden_states, mask, cache)

    class OwnSSM(nemotron_h.NemotronHMamba2Mixer):  # the vetted forward, another helper
        def _ssm(self, *args):
            return super()._ssm(*args)

    model = build("nemotron_h")
    model.layers[0].mixer.__class__ = Custom
    model.layers[2].mixer.__class__ = OwnSSM
    entries = mixers(patch_model(model, backend="reference"), "nemotron_h")
    assert [m.status for m in entries] == ["fallback", "fallback", "patched"]
    assert "forward the patch does not know" in entries[0].reason
    assert "OwnSSM._ssm is not one the patch was read against" in entries[1].reason
    disabled = patch_model(model, backend="reference", attention=False)
    assert all(m.status == "disabled" for m in mixers(disabled, "nemotron_h"))


def test_cpu_tuning_and_prior(tmp_path, monkeypatch):
    """Auto backend on this CPU (no kernel backend): the mixers are patched and tuned (the
    composites against stock); with tune='cached' and nothing measured the prior takes the
    composites."""
    from mlx_bricks.backends import active_backend

    if active_backend(None).name != "reference":
        pytest.skip("a kernel backend is available here")
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path))
    for model_type in ("nemotron_h", "lfm2"):
        model = build(model_type, mx.bfloat16, **DENSE.get(model_type, {}))
        stock = run(model, tokens(64))
        report = patch_model(model, tune="cached")
        out = run(model, tokens(64))
        op = FAMILIES[model_type][1]
        entries = mixers(report, model_type)
        assert sum(m.calls.get(op, 0) for m in entries) == len(entries)
        assert (mx.argmax(out, -1) == mx.argmax(stock, -1)).mean().item() > 0.95
        report = patch_model(model)
        run(model, tokens(64))
        assert any(op in d["key"] for d in report.dispatch.summary()["decisions"])


@pytest.mark.parametrize("model_type", [t for t, f in FAMILIES.items() if f[1] == "ssd"])
def test_projections_run_as_gemm_stages_on_the_cpu(model_type, tmp_path, monkeypatch):
    """No kernel backend, tune='cached' (mlx_lm.generate's default): a Mamba-2 mixer's in_proj
    and out_proj, 4-bit, run the linear kind's composites as stages (the CPU prior's NumPy-BLAS
    ones); the logits within the dtype rule of a float32 truth on the same 4-bit weights."""
    import mlx.nn as nn

    from mlx_bricks.backends import active_backend

    if active_backend(None).name != "reference":
        pytest.skip("a kernel backend is available here")
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path))
    role, op, n = FAMILIES[model_type]

    def quantized(dtype):
        m = build(model_type, mx.bfloat16, **DENSE.get(model_type, {}))
        nn.quantize(m, group_size=32, bits=4, class_predicate=lambda p, x: isinstance(
            x, nn.Linear) and p.endswith(("in_proj", "out_proj")) and x.weight.shape[1] % 32 == 0)
        m.set_dtype(dtype)  # the scales and biases; the packed weights stay
        mx.eval(m.parameters())
        return m

    model = quantized(mx.bfloat16)
    toks = tokens(48, seed=3)
    truth = run(quantized(mx.float32), toks)
    stock = run(model, toks)
    report = patch_model(model, tune="cached", mlp=False)
    out = run(model, toks)
    entries = mixers(report, model_type)
    assert len(entries) == n and all(m.status == "patched" for m in entries), report
    assert sum(m.calls.get(op, 0) for m in entries) == n
    assert sum(m.calls.get("linear", 0) for m in entries) == 2 * n, report
    assert_dtype_close(out, truth, stock, dtype=mx.bfloat16, what=f"4-bit {model_type} logits")


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_nemotron_h_relu2_mlps(backend):
    """nemotron_h's gate-less MLPs (a dense layer's, a MoE block's shared experts: up, ReLU^2,
    down) run their projections as two linear pieces; float32 logits match stock, decode is
    the module's own step, ``mlp=False`` disables them, unpatch is exact."""
    from tests.support import require_backend

    if backend == "emulator":
        require_backend("emulator")
    model = build("nemotron_h", mx.float32)
    toks = tokens(40)
    stock = run(model, toks)
    report = patch_model(model, backend=backend, tune="off")
    mlps = [m for m in report.modules if m.module == "mlp"]
    assert len(mlps) == 2 and all(m.status == "patched" for m in mlps), report
    cache = model.make_cache()
    out = run(model, toks, cache)
    np.testing.assert_allclose(np.array(out), np.array(stock), atol=2e-4, rtol=2e-4)
    assert sum(m.calls.get("linear", 0) for m in mlps) == 2 * len(mlps)
    run(model, toks[:, -1:], cache)
    assert sum(m.stock_calls.get(DECODE, 0) for m in mlps) == len(mlps)
    assert {m.status for m in patch_model(model, backend=backend, mlp=False).modules
            if m.module == "mlp"} == {"disabled"}
    unpatch_model(model)
    assert mx.array_equal(run(model, toks), stock)


@pytest.mark.parametrize("backend", ["reference", "emulator"])
@pytest.mark.parametrize("model_type,layer,extra", [
    ("nemotron_h", 3, {}), ("plamo2", 1, {"hidden_size_per_head": 64})])
def test_attention_mixers(model_type, layer, extra, backend):
    """nemotron_h's and plamo2's attention layers (a layer's one mixer: NoPE GQA; plamo2's
    fused qkv, per-head q/k norms and RoPE) run their projections as linear pieces and the
    core on the attention brick; float32 logits match stock over two turns (the KV cache
    continued), decode is the module's own step, a subclass stays stock, unpatch is exact."""
    from tests.support import require_backend

    if backend == "emulator":
        require_backend("emulator")
    model = build(model_type, mx.float32, seed=2, **extra)
    toks = tokens(40, seed=2)
    stock_cache = model.make_cache()
    stock = [run(model, toks[:, a:b], stock_cache) for a, b in ((0, 25), (25, 40))]
    report = patch_model(model, backend=backend, tune="off")
    attn = [m for m in report.modules if m.module == "attention"]
    assert len(attn) == 1 and attn[0].status == "patched", report
    cache = model.make_cache()
    out = [run(model, toks[:, a:b], cache) for a, b in ((0, 25), (25, 40))]
    for o, s in zip(out, stock):
        np.testing.assert_allclose(np.array(o), np.array(s), atol=2e-4, rtol=2e-4)
    projections = 2 if model_type == "plamo2" else 4
    assert attn[0].calls == {"linear": 2 * projections, "flash_attention": 2}, attn[0].calls
    run(model, toks[:, -1:], cache)
    assert attn[0].stock_calls.get(DECODE, 0) == 1
    unpatch_model(model)
    assert mx.array_equal(run(model, toks[:, :25], model.make_cache()), stock[0])

    mixer = model.layers[layer].mixer
    Own = type("Own", (type(mixer),), {"__call__": lambda self, *a, **k: super(
        Own, self).__call__(*a, **k)})
    mixer.__class__ = Own
    entry = [m for m in patch_model(model, backend=backend).modules if m.module == "attention"]
    assert entry[0].status == "fallback" and "forward the patch does not know" in \
        entry[0].reason


@pytest.mark.parametrize("model_type", ["mamba", "jamba", "mamba2"])
def test_mixed_dtype_checkpoint_falls_back(model_type):
    """A checkpoint of mixed dtypes (bfloat16 with float32 A_log and D, as unconverted weights
    come): the first mixer's output is float32, so the next mixer's input no longer matches its
    bfloat16 conv bias; that call runs stock with the reason instead of failing, and the logits
    are within the dtype rule of the float32 model's."""
    truth = run(build(model_type, mx.float32), tokens(30))
    model = build(model_type, mx.bfloat16)
    for _, m in model.named_modules():
        for name in ("A_log", "D"):
            if isinstance(m.get(name), mx.array):
                m[name] = m[name].astype(mx.float32)
    toks = tokens(30)
    stock = run(model, toks, model.make_cache())
    report = patch_model(model, backend="reference", tune="off")
    out = run(model, toks, model.make_cache())
    entries = mixers(report, model_type)
    reasons = [k for m in entries for k in m.stock_calls]
    assert any("bias is bfloat16 but the input is float32" in k for k in reasons), reasons
    assert_dtype_close(out, truth, stock, dtype=mx.bfloat16, what=f"{model_type} logits")


def test_relu2_mlps_without_kernel_backend_follow_their_weights():
    """No kernel backend: nemotron_h's gate-less MLPs (linear pieces only) are patched where
    their weights are admitted (bfloat16 on the CPU) and reported stock otherwise (float16:
    they would run their own layers)."""
    from mlx_bricks.backends import active_backend
    from mlx_bricks.runtime.dispatch import NO_KERNEL_BACKEND

    if active_backend(None).name != "reference":
        pytest.skip("a kernel backend is available here")
    for dtype, status in ((mx.float16, "stock"), (mx.bfloat16, "patched")):
        report = patch_model(build("nemotron_h", dtype, **DENSE["nemotron_h"]))
        mlps = [m for m in report.modules if m.module == "mlp"]
        assert mlps and {m.status for m in mlps} == {status}, (dtype, mlps)
        assert status == "patched" or all(m.reason == NO_KERNEL_BACKEND for m in mlps)


def test_coverage_of_real_sizes():
    """The CLI's real-size shares: every mixer, attention and MLP of LFM2-1.2B,
    Mamba-Codestral-7B, Falcon-Mamba-7B and Nemotron-3-Nano in bricks; Granite-4.0-H-Small and Jamba-v0.1 (its
    routers stock) >= 90%."""
    from mlx_bricks.patch.coverage import prefill_flops
    from mlx_bricks.patch.real_configs import build as build_real

    share = {}
    for name in ("LFM2-1.2B", "Mamba-Codestral-7B", "Granite-4.0-H-Small", "Jamba-v0.1",
                 "Falcon-Mamba-7B", "Nemotron-3-Nano-30B-A3B", "PLaMo-2-8B"):
        model = build_real(name)
        patch_model(model, backend="reference")
        share[name] = prefill_flops(model, 2048)["share"]
    assert share["LFM2-1.2B"] == share["Mamba-Codestral-7B"] == share["Falcon-Mamba-7B"] == 1.0
    # their attention layers a mixer piece too (plamo2: the small bcdt/dt projections stay
    # its Mamba mixers' own)
    assert share["Nemotron-3-Nano-30B-A3B"] == 1.0 and share["PLaMo-2-8B"] >= 0.99
    assert share["Granite-4.0-H-Small"] >= 0.9 and share["Jamba-v0.1"] >= 0.9


def test_bench_groups_build_on_tiny_shapes(tmp_path, monkeypatch):
    """``--only ssm``, ``mamba1`` (kernel backends) and ``ssm_cpu`` (the CPU) are registered;
    their cases build and agree with stock on tiny shapes of the same kinds."""
    from mlx_bricks.bench import ssm
    from mlx_bricks.bench.core import BENCHMARKS, CPU, GROUPS, KERNEL
    from mlx_bricks.bench.e2e import setup

    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path))
    # the 4-layer models at 2,048 / 8,192 tokens, bf16 and 4-bit (q4g64) weights
    assert len(GROUPS["ssm"]) == 14 and len(GROUPS["ssm_cpu"]) == 5
    assert len(GROUPS["mamba1"]) == 12
    assert {BENCHMARKS[n].backend for n in GROUPS["ssm"] + GROUPS["mamba1"]} == {KERNEL}
    assert {BENCHMARKS[n].backend for n in GROUPS["ssm_cpu"]} == {CPU}
    tiny = ssm.NemotronHShape(hidden=64, heads=4, head_dim=16, groups=2, state=16, vocab=256)
    lfm2 = ssm.Lfm2Shape(hidden=64, ff=128, heads=1, kv_heads=1, vocab=256)
    jamba = ssm.JambaShape(hidden=64, ff=128, vocab=256)
    falcon = ssm.MambaShape(hidden=64, layers=2, vocab=256)
    cases = [(ssm.scan(24, "fp32", tiny), 1e-3), (ssm.conv(24, "fp32", 32), 1e-3),
             (ssm.selective(24, "fp32", 32, 8), 1e-3),
             (setup(tiny, "bf16", 24), 0.1), (setup(lfm2, "bf16", 24), 0.1),
             (setup(jamba, "bf16", 24), 0.1), (setup(falcon, "bf16", 24), 0.1),
             (ssm.decode(tiny, "bf16", prompt=8, steps=2), 0.1)]
    for (brick, stock, info), tol in cases:
        a, b = (np.array(f().astype(mx.float32)) for f in (brick, stock))
        np.testing.assert_allclose(a, b, atol=tol, rtol=tol)
        assert isinstance(info(), dict)


@pytest.mark.parametrize("bits", [None, 4])
def test_fused_gate_up_mlps(bits):
    """plamo2's MLP and Granite 4.0-H's shared MLP (gate and up fused in one layer) run the
    SwiGLU brick on the fused weight's row halves, float or 4-bit affine (the halves sliced
    field by field), matching stock; mlp=False disables them."""
    import mlx.nn as nn

    from mlx_bricks.bricks.swiglu.fused_piece import rows
    from mlx_bricks.formats.affine import QuantizedWeight

    for model_type, where in (("plamo2", "mlp"), ("granitemoehybrid", "shared_mlp")):
        model = build(model_type, mx.float32, seed=3)
        if bits:
            nn.quantize(model, group_size=32, bits=bits,
                        class_predicate=lambda p, m: isinstance(m, nn.Linear) and
                        m.weight.shape[0] % 32 == 0 and m.weight.shape[1] % 32 == 0)
        toks = tokens(30, seed=3)
        stock = run(model, toks, model.make_cache())
        report = patch_model(model, backend="reference")
        fused = [m for m in report.modules if m.module == where]
        assert fused and all(m.status == "patched" for m in fused), report
        out = run(model, toks, model.make_cache())
        assert sum(m.calls.get("swiglu_mlp", 0) for m in fused) == len(fused)
        np.testing.assert_allclose(np.array(out), np.array(stock), atol=2e-3, rtol=2e-3)
        assert all(m.status == "disabled" for m in patch_model(
            model, backend="reference", mlp=False).modules if m.module == where)
    q = QuantizedWeight(*mx.quantize(mx.ones((8, 32)), group_size=32, bits=4), 32, 4)
    half = rows(q, 4, 8)
    assert half.w.shape == (4, 4) and half.scales.shape == (4, 1) and half.bits == 4


@pytest.mark.parametrize("model_type", ["granitemoehybrid", "lfm2"])
def test_right_padded_batch(model_type):
    """mlx-lm's right-padded batch (ArraysCache.prepare(lengths): its mask ends each row at its
    length): logits of the valid tokens and the states as stock (the conv state taken before
    each row's length, the recurrent state after its last valid token)."""
    from mlx_lm.models.cache import ArraysCache, KVCache

    def caches(model):
        out = []
        for c in model.make_cache():
            if isinstance(c, ArraysCache):
                c.prepare(lengths=[20, 13])
            out.append(c if isinstance(c, ArraysCache) else KVCache())
        return out

    model = build(model_type, mx.float32, seed=4)
    a, b = tokens(20, seed=5), tokens(13, seed=6)
    batch = mx.concatenate([a, mx.concatenate([b, mx.zeros((1, 7), mx.int32)], 1)], 0)
    want_cache = caches(model)
    want = run(model, batch, want_cache)
    report = patch_model(model, backend="reference")
    got_cache = caches(model)
    got = run(model, batch, got_cache)
    entries = mixers(report, model_type)
    assert sum(m.calls.get(FAMILIES[model_type][1], 0) for m in entries) == len(entries)
    np.testing.assert_allclose(np.array(got[1, :13]), np.array(want[1, :13]), atol=1e-4)
    np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), atol=1e-4)
    got_arrays, want_arrays = cache_arrays(got_cache), cache_arrays(want_cache)
    assert mx.array_equal(got_arrays[0][0], want_arrays[0][0])  # the first mixer's input
    for g, w in zip(got_arrays, want_arrays):
        for x, y in zip(g, w):
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-4)
