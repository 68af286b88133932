"""patch_model on models quantized with mlx-lm's own ``nn.quantize``: every attention and MLP
``nn.QuantizedLinear`` in MLX's affine format reaches its brick as a ``QuantizedWeight``.

Tiny random llama, qwen2 and qwen3 models (2 layers, tests/models.py) quantized 4-bit gs64,
8-bit gs32, with mlx-lm's ``mixed_3_6`` recipe (v_proj / down_proj of the last layer at 6 bits,
the rest at 3) and with a recipe giving every projection its own format (bits 2-8, group sizes
32 and 64, gate and up in different formats), patched vs stock mlx-lm on the same instance:

* logits: the dtype-scaled rule of tests/tolerance.py against a float64 run of the dequantized
  weights (decoded from the packed bits, tests/quant_support.py), stock in the same dtype being
  the naive side;
* greedy continuations (mlx-lm's ``generate_step``) identical, a difference accepted only at a
  float64 tie within stock's own rounding error (as in tests/test_patch.py);
* every patched module ran each of its bricks, and every quantized projection of the decoder
  layers was handed to a brick as a ``QuantizedWeight`` of its bits and group size.

The microscaling modes (mxfp4, nvfp4, mxfp8) are patched (their composites: tests/
test_microscaling.py); LoRA/DoRA over quantized layers stays stock with the reason. The default model converted with ``--keep-quantized`` runs ``python -m
mlx_bricks.patch`` with every attention/MLP linear on the quantized bricks: a 2-layer subset in
the default suite, the whole model (``python -m mlx_bricks.gguf`` then the patch command,
about 3 minutes on 2 CPU cores) marked slow.
"""
from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_bricks import kernels
from mlx_bricks.formats.affine import QuantizedWeight
from mlx_bricks.patch import patch_model, unpatch_model
from mlx_bricks.patch.core import stock_path
from mlx_bricks.runtime.guard import GUARD
from mlx_bricks.bricks import kinds
from mlx_bricks.runtime.kind import OpKind
from tests.models import build_model, tokens
from tests.quant_support import dequant64
from tests.support import require_backend
from tests.test_patch import greedy, run, run64, run_chunks
from tests.tolerance import EPS, assert_dtype_close, to_f64

KINDS = kinds()

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

#: Every projection in its own format: all affine widths, both group sizes the tiny models'
#: K allow, q/k/v and gate/up differing (gate != up: the fused SwiGLU cannot stage both).
PER_PROJECTION = {"q_proj": (4, 64), "k_proj": (2, 32), "v_proj": (8, 32), "o_proj": (5, 64),
                  "gate_proj": (6, 64), "up_proj": (4, 64), "down_proj": (3, 32)}


@pytest.fixture(autouse=True)
def _clean():
    """The process-wide guard starts and ends empty."""
    GUARD.reset()
    yield
    GUARD.reset()


@pytest.fixture(params=("metal", "cuda", "emulator", "reference"))
def patch_backend(request) -> str:
    """The backend a model is patched on (skipped where it cannot run)."""
    require_backend(request.param)
    return request.param


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

def quantize(model, recipe: str):
    """Quantize ``model`` in place with mlx-lm's ``nn.quantize`` (``recipe``: ``"q4g64"``,
    ``"q8g32"``, ``"mixed_3_6"`` (mlx-lm's recipe, group size 64) or ``"per_projection"``)."""
    if recipe in ("q4g64", "q8g32"):
        bits, gs = (4, 64) if recipe == "q4g64" else (8, 32)
        nn.quantize(model, group_size=gs, bits=bits)
    elif recipe == "mixed_3_6":
        from mlx_lm.convert import mixed_quant_predicate_builder

        recipe_predicate = mixed_quant_predicate_builder(recipe, model, 64)
        # as mlx_lm.utils.quantize_model wraps it: quantizable layers only
        nn.quantize(model, class_predicate=lambda p, m: hasattr(m, "to_quantized") and
                    recipe_predicate(p, m))
    elif recipe == "per_projection":
        def predicate(path, module):
            if not hasattr(module, "to_quantized"):
                return False
            bits, gs = PER_PROJECTION.get(path.rsplit(".", 1)[-1], (8, 64))
            return {"bits": bits, "group_size": gs}

        nn.quantize(model, class_predicate=predicate)
    else:
        raise ValueError(recipe)
    mx.eval(model.parameters())
    return model


def quantized_model(arch, dtype, recipe, **overrides):
    return quantize(build_model(arch, dtype, num_hidden_layers=2, **overrides), recipe)


def dense64(qmodel):
    """A float64 stock model with ``qmodel``'s weights dequantized exactly (scale * q + bias
    decoded from the packed bits): the exact-arithmetic reference of the quantized network."""
    module = importlib.import_module(type(qmodel).__module__)
    dense = module.Model(qmodel.args)
    quantized = {p: m for p, m in qmodel.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))}
    params = []
    for name, a in tree_flatten(qmodel.parameters()):
        owner, leaf = name.rsplit(".", 1)
        if owner in quantized:
            if leaf in ("scales", "biases"):
                continue
            if leaf == "weight":
                w = dequant64(QuantizedWeight.from_module(quantized[owner]))
                params.append((name, mx.array(w, dtype=mx.float64)))
                continue
        params.append((name, a.astype(mx.float64)))
    dense.update(tree_unflatten(params))
    mx.eval(dense.parameters())
    return dense


def decoder_quantized(model) -> dict[int, str]:
    """``id(packed weight) -> "layer i proj (q4 gs64)"`` of every affine quantized projection
    in the decoder layers."""
    out = {}
    for i, layer in enumerate(model.layers):
        for parent, names in ((layer.self_attn, ATTN), (layer.mlp, MLP)):
            for n in names:
                lin = parent[n]
                if isinstance(lin, nn.QuantizedLinear) and lin.mode == "affine":
                    out[id(lin.weight)] = f"layer {i} {n} (q{lin.bits} gs{lin.group_size})"
    return out


@pytest.fixture
def brick_weights(monkeypatch) -> dict:
    """Records every weight handed to a brick: ``id(packed w) -> (bits, group_size)`` for a
    ``QuantizedWeight``, ``id(array) -> None`` for a float weight."""
    seen = {}
    real = OpKind.run

    def spy(self, variant, args, backend):
        for v in args.values():
            if isinstance(v, QuantizedWeight):
                seen[id(v.w)] = (v.bits, v.group_size)
            elif isinstance(v, mx.array) and v.ndim == 2:
                seen[id(v)] = None
        return real(self, variant, args, backend)

    monkeypatch.setattr(OpKind, "run", spy)
    return seen


def assert_all_quantized_on_bricks(model, report, seen):
    """Every decoder-layer quantized projection reached a brick as a QuantizedWeight of its
    format; every patched module ran its bricks; nothing fell back at call time."""
    want = decoder_quantized(model)
    assert want, "the model has no quantized projections"
    for wid, what in want.items():
        assert wid in seen, f"{what} never reached a brick"
        assert seen[wid] is not None and what.endswith(f"(q{seen[wid][0]} gs{seen[wid][1]})"), (
            f"{what} reached a brick as {seen[wid]}")
    assert report.n_fallback == 0 and report.runtime_fallbacks() == {}
    for m in report.modules:
        assert m.status == "patched"
        for brick in m.bricks:
            assert m.calls.get(brick, 0) > 0, f"layer {m.layer} {m.module}: {brick} unused"


def expected_formats(model, i: int, role: str) -> dict:
    layer = model.layers[i]
    parents = {"block": ((layer.self_attn, ATTN), (layer.mlp, MLP)),
               "self_attn": ((layer.self_attn, ATTN),), "mlp": ((layer.mlp, MLP),)}[role]
    return {n: f"q{p[n].bits} gs{p[n].group_size}" for p, names in parents for n in names}


def assert_same_greedy_q(model, dense, dtype, prompt, stock, patched):
    """``patched`` greedy tokens equal ``stock``'s, up to a float64 tie (tests/test_patch.py's
    rule, with ``dense`` the float64 model of the dequantized weights and the stock path of
    the same instance as the same-dtype run)."""
    t = next((i for i, (a, b) in enumerate(zip(stock, patched)) if a != b), None)
    assert len(stock) == len(patched)
    if t is None:
        return
    ctx = mx.array(list(prompt) + list(stock[:t]))[None]
    ref = to_f64(run64(dense, ctx)[0, -1])
    with stock_path(model):
        naive = to_f64(run(model, ctx)[0, -1])
    margin = abs(ref[stock[t]] - ref[patched[t]])
    budget = 2 * np.abs(naive - ref).max() + 4 * EPS[dtype] * max(1.0, np.abs(ref).max())
    assert margin <= budget, (
        f"greedy token {t} differs ({patched[t]} vs stock {stock[t]}) where float64 prefers one "
        f"by {margin:.3g} > rounding budget {budget:.3g}")


def check_patched_vs_stock(model, backend, dtype, seen, **patch_kwargs):
    """Chunked prefill logits and 8 greedy tokens, patched vs stock; returns the report."""
    dt = DTYPES[dtype]
    toks = tokens(12)
    chunks = [(0, 7), (7, 12)]  # the second chunk attends to cached K/V (Lk > Lq)
    refs = run_chunks(dense64(model), run64, toks, chunks)
    stock = run_chunks(model, run, toks, chunks)
    stock_greedy = greedy(model, toks[0], n=8, prefill_step_size=7)
    report = patch_model(model, backend=backend, **patch_kwargs)
    launches = sum(n for (_, be), n in kernels.LAUNCH_COUNTS.items() if be == backend)
    patched = run_chunks(model, run, toks, chunks)
    for (a, b), p, s, r in zip(chunks, patched, stock, refs):
        assert p.dtype == dt
        assert_dtype_close(p, r, s, dtype=dt, what=f"{backend} chunk {a}:{b}")
    assert_same_greedy_q(model, dense64(model), dt, toks[0].tolist(), stock_greedy,
                         greedy(model, toks[0], n=8, prefill_step_size=7))
    if backend != "reference":  # the kernels really ran
        assert sum(n for (_, be), n in kernels.LAUNCH_COUNTS.items() if be == backend) > launches
    assert_all_quantized_on_bricks(model, report, seen)
    return report


# ---------------------------------------------------------------------------------------------
# numerics: patched vs stock, every quantized projection on the bricks
# ---------------------------------------------------------------------------------------------

CASES = (  # (arch, recipe, dtype): each arch, recipe and dtype more than once
    ("llama", "q4g64", "float16"), ("qwen2", "q4g64", "bfloat16"), ("qwen3", "q4g64", "float32"),
    ("llama", "q8g32", "bfloat16"), ("qwen2", "q8g32", "float32"), ("qwen3", "q8g32", "float16"),
    ("llama", "mixed_3_6", "float32"), ("qwen3", "mixed_3_6", "bfloat16"),
    ("qwen2", "per_projection", "float16"),
)


@pytest.mark.parametrize("arch,recipe,dtype", CASES)
def test_quantized_block_matches_stock(patch_backend, brick_weights, arch, recipe, dtype):
    model = quantized_model(arch, DTYPES[dtype], recipe)
    report = check_patched_vs_stock(model, patch_backend, dtype, brick_weights)
    assert [m.module for m in report.modules] == ["block", "block"]
    for m in report.modules:
        assert m.weights == expected_formats(model, m.layer, "block")
    text = str(report)
    if recipe in ("q4g64", "q8g32"):
        fmt = "q4 gs64" if recipe == "q4g64" else "q8 gs32"
        assert all(m.weight_summary == fmt for m in report.modules)
        assert fmt in text
    if recipe == "mixed_3_6":  # the last layer's v_proj and down_proj at 6 bits
        assert report.modules[0].weight_summary == "q3 gs64"
        assert report.modules[1].weight_summary == "q3 gs64 (v_proj, down_proj: q6 gs64)"
        assert "q3 gs64 (v_proj, down_proj: q6 gs64)" in text


@pytest.mark.parametrize("arch,recipe,dtype,mlp_variant", (
    ("llama", "mixed_3_6", "float16", "split"),
    ("qwen3", "per_projection", "float32", "fused"),
))
def test_quantized_split_modules_match_stock(patch_backend, brick_weights, arch, recipe, dtype,
                                             mlp_variant):
    """fuse_block=False: q/k/v/o through the GEMM brick one by one, the MLP through SwiGLU
    (gate and up of different formats run split even when fused is asked for)."""
    model = quantized_model(arch, DTYPES[dtype], recipe)
    report = check_patched_vs_stock(model, patch_backend, dtype, brick_weights,
                                    fuse_block=False, mlp_variant=mlp_variant)
    assert [m.module for m in report.modules] == ["self_attn", "mlp"] * 2
    for m in report.modules:
        assert m.weights == expected_formats(model, m.layer, m.module)
    chunk_calls = 2  # prefill chunks of 7 and 5 tokens, then the greedy prompt (8 calls more)
    for m in report.modules:
        if m.module == "self_attn":  # four projections per call
            assert m.calls["linear"] == 4 * m.calls["flash_attention"] >= 4 * chunk_calls


# ---------------------------------------------------------------------------------------------
# what stays stock, and why
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode,group_size,bits", (("mxfp4", 32, 4), ("nvfp4", 16, 4),
                                                  ("mxfp8", 32, 8)))
def test_microscaled_modes_are_patched_with_their_format(mode, group_size, bits):
    """mxfp4 / nvfp4 / mxfp8 layers reach the bricks (their reference computations here; the
    composites where no kernel backend exists: tests/test_microscaling.py): patched, the
    format in the report, the logits within the rule of the float64 decoded model."""
    from tests.test_microscaling import _dense64_model

    model = build_model("llama", mx.bfloat16, num_hidden_layers=2)
    nn.quantize(model, group_size=group_size, bits=bits, mode=mode)
    toks = tokens(10)
    stock = run(model, toks)
    ref = run64(_dense64_model(model), toks)
    report = patch_model(model, backend="reference")
    assert report.n_patched == len(model.layers) and report.n_fallback == 0
    for m in report.modules:
        assert set(m.weights.values()) == {f"{mode} gs{group_size}"}
    assert_dtype_close(run(model, toks), ref, stock, dtype=mx.bfloat16, what=mode)
    assert f"{mode} gs{group_size}" in str(report)


@pytest.mark.parametrize("use_dora", (False, True), ids=("lora", "dora"))
def test_lora_over_quantized_layers_stays_stock(patch_backend, brick_weights, use_dora):
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = quantized_model("qwen2", mx.float32, "q4g64")
    linear_to_lora_layers(model, 1, {"rank": 4, "scale": 10.0, "dropout": 0.0},
                          use_dora=use_dora)  # adapters on the last layer
    toks = tokens(10)
    stock = run(model, toks)
    report = patch_model(model, backend=patch_backend)
    assert [(m.module, m.status) for m in report.layer(0)] == [("block", "patched")]
    assert report.layer(0)[0].weight_summary == "q4 gs64"
    for m in report.layer(1):
        assert m.status == "fallback"
        assert "over nn.QuantizedLinear (q4 gs64) (LoRA/DoRA adapter)" in m.reason
    # float32: the bricks differ from stock only in summation order.
    assert mx.allclose(run(model, toks), stock, rtol=1e-4, atol=1e-4)
    layer0 = decoder_quantized(model)
    assert any(wid in brick_weights for wid in layer0)


def test_scales_of_another_dtype_than_the_activations_run_stock():
    """The bricks compute in one dtype: a quantized layer whose scales are not the activations'
    dtype keeps the stock path, decided at the call with the reason. ``set_dtype`` on a
    patched model's layer casts its scales but not its packed weight: the call-time check
    still notices."""
    model = quantized_model("llama", mx.float32, "q4g64")
    toks = tokens(9)
    report = patch_model(model, backend="reference")
    run(model, toks)
    assert report.runtime_fallbacks() == {} and report.calls()["rms_norm_qkv"] == 2
    model.layers[0].self_attn.q_proj.set_dtype(mx.float16)
    assert model.layers[0].self_attn.q_proj.scales.dtype == mx.float16
    with stock_path(model):
        stock = run(model, toks)
    assert mx.allclose(run(model, toks), stock, rtol=1e-4, atol=1e-4)
    [(reason, n)] = report.runtime_fallbacks().items()
    assert reason == "q_proj.scales is float16 but the input is float32" and n == 1
    assert report.layer(1)[0].calls["rms_norm_qkv"] == 2


# ---------------------------------------------------------------------------------------------
# dispatch: decisions keyed by the weight format
# ---------------------------------------------------------------------------------------------

def test_decision_keys_carry_every_weight_format():
    from mlx_bricks.bricks.gemm.piece import linear_args
    from mlx_bricks.bricks.swiglu.piece import mlp_args
    from mlx_bricks.formats.layers import weight_of
    from mlx_bricks.patch.table import lookup
    from mlx_bricks.runtime.kind import Act

    model = quantized_model("llama", mx.float16, "per_projection")
    layer, layout = model.layers[0], lookup("llama")[1]
    attn, x = layer.self_attn, Act((1, 40, 128), mx.float16)
    qkv = {"x": x, "norm_weight": layer.input_layernorm.weight, "eps": 1e-5,
           "wq": weight_of(attn.q_proj), "wk": weight_of(attn.k_proj), "wv": weight_of(attn.v_proj),
           "n_heads": 4, "n_kv_heads": 2, "head_dim": 64}
    mlp = mlp_args(layer.mlp, layout, x)
    assert KINDS["rms_norm_qkv"].key(qkv).weights == "q4g64/q2g32/q8g32"
    assert KINDS["swiglu_mlp"].key(mlp).weights == "q6g64/q4g64/q3g32"
    assert KINDS["linear"].key(linear_args(attn.o_proj, x)).weights == "q5g64"
    # one format for all: its plain name (float keys stay as they were)
    assert KINDS["rms_norm_qkv"].key(dict(qkv, wk=qkv["wq"], wv=qkv["wq"])).weights == "q4g64"
    # gate and up in different formats: the fused variant is no candidate
    assert KINDS["swiglu_mlp"].listing("emulator", mx.float16, mlp) == ("split",)
    same = dict(mlp, w_up=mlp["w_gate"])
    assert KINDS["swiglu_mlp"].listing("emulator", mx.float16, same) == (
        "fused", "split")


def test_4bit_and_8bit_projections_get_their_own_decisions(tmp_path, monkeypatch):
    """With tuning on (reference standing in for a kernel backend), a model whose layers are
    4-bit and 8-bit takes one decision per piece and format: the same shapes in another
    format are measured, not reused."""
    from tests.test_dispatch import count_tune_calls, slow_variants
    import mlx_bricks.runtime.dispatch as dispatch_mod

    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path / "home"))  # own decision cache
    monkeypatch.setattr(dispatch_mod, "TUNED_BACKENDS", ("metal", "cuda", "reference"))
    slow_variants(monkeypatch)
    tuned = count_tune_calls(monkeypatch)
    model = build_model("llama", mx.float32, num_hidden_layers=2)
    nn.quantize(model, class_predicate=lambda p, m: hasattr(m, "to_quantized") and (
        {"bits": 4, "group_size": 64} if p.startswith("model.layers.0.")
        else {"bits": 8, "group_size": 64}))
    report = patch_model(model, backend="reference")
    run(model, tokens(9))
    keys = [d["key"] for d in report.tuning()["decisions"]]
    assert len(tuned) == len(keys)
    for kind in ("rms_norm_qkv", "linear", "swiglu_mlp"):
        fmts = sorted(k.rsplit("w=", 1)[1] for k in keys if f"|{kind}[" in k)
        assert fmts == ["q4g64", "q8g64"], (kind, keys)
    # measured stock faster everywhere (slow variants): the pieces ran stock, as tuned
    assert report.tuned_stock_calls() and report.runtime_fallbacks() == {}


# ---------------------------------------------------------------------------------------------
# the default model converted with --keep-quantized, through python -m mlx_bricks.patch
# ---------------------------------------------------------------------------------------------

def _default_gguf() -> Path:
    from mlx_bricks.models import default_gguf_path

    try:
        return default_gguf_path()
    except ModuleNotFoundError as e:  # scripts/setup.sh installs it
        pytest.skip(str(e))


def _patch_cli(argv, capsys) -> dict:
    from mlx_bricks.patch.__main__ import main

    rc = main([*argv, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out["fail_reasons"]
    return out


def assert_cli_quantized(out: dict, n_layers: int, fmt: str):
    """The patch command's JSON: passed, same greedy text, every layer a patched block whose
    projections are all ``fmt`` and whose bricks ran."""
    assert out["passed"] and out["greedy_match"] and out["top1_agreement"] == 1.0
    assert out["stock_text"] == out["patched_text"] and out["patched_tokens"]
    report = out["report"]
    assert report["n_patched"] == n_layers and report["n_fallback"] == 0
    for m in report["modules"]:
        assert (m["module"], m["status"], m["weights"]) == ("block", "patched", fmt)
        assert set(m["weight_formats"]) == set(ATTN + MLP)
        assert all(m["calls"][b] > 0 for b in m["bricks"])


@pytest.fixture(scope="module")
def default_q4_subset(tmp_path_factory) -> Path:
    """The first two layers of the default model as converted with --keep-quantized
    (``default_model("4bit")``: Q4_1 -> MLX 4-bit gs32), written as an mlx-lm directory with
    float32 scales and norms (exact; MLX's CPU quantized matmul is ~40x slower with float16)."""
    from mlx_lm import load
    from mlx_lm.utils import save_model

    from mlx_bricks.models import default_model

    _default_gguf()
    src = default_model("4bit")
    model, _ = load(str(src))
    model.model.layers = model.model.layers[:2]
    model.update(tree_unflatten([(k, v.astype(mx.float32) if v.dtype == mx.float16 else v)
                                 for k, v in tree_flatten(model.parameters())]))
    out = tmp_path_factory.mktemp("default_q4_subset")
    save_model(out, model)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 2
    (out / "config.json").write_text(json.dumps(config))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, out / f.name)
    return out


def test_default_model_layer_subset_keep_quantized_runs_patched(patch_backend, default_q4_subset,
                                                                capsys):
    """``python -m mlx_bricks.patch`` on the 2-layer subset: both blocks on the quantized
    bricks, the same greedy text (about 30 s on the emulator, 10 s on reference)."""
    out = _patch_cli([str(default_q4_subset), "--backend", patch_backend, "--repeats", "1",
                      "--max-tokens", "8", "--prompt", "The capital of France is"], capsys)
    assert_cli_quantized(out, 2, "q4 gs32")


@pytest.mark.slow
def test_default_model_keep_quantized_runs_patched(tmp_path):
    """The whole default model: ``python -m mlx_bricks.gguf ... --keep-quantized`` (float32
    scales and activations: MLX's CPU quantized matmul is ~40x slower in float16), then
    ``python -m mlx_bricks.patch`` on the reference backend: 30 blocks on the quantized bricks
    (the report says q4 gs32 for each), the same greedy text (a few minutes)."""
    out_dir = tmp_path / "q4"
    subprocess.run([sys.executable, "-m", "mlx_bricks.gguf", str(_default_gguf()), str(out_dir),
                    "--keep-quantized", "--dtype", "float32", "--no-progress"], cwd=REPO,
                   check=True, capture_output=True, timeout=600)
    proc = subprocess.run([sys.executable, "-m", "mlx_bricks.patch", str(out_dir), "--backend",
                           "reference", "--repeats", "1", "--json"], cwd=REPO, text=True,
                          capture_output=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_cli_quantized(json.loads(proc.stdout), 30, "q4 gs32")
