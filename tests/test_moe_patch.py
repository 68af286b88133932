"""Patching the MoE experts: every ``SwitchGLU`` of a model (by module, whatever the model_type)
runs its prefill through the MoE piece (``bricks/moe/piece.py``, ``bricks/moe/kind.py``).

Tiny random models of mlx-lm's own classes (qwen3_moe, qwen2_moe, mixtral, olmoe, gpt_oss,
deepseek_v3; hidden 64, 4-8 experts, 2 layers) patched on ``reference`` (SwitchGLU itself in MLX
ops: bit-equal to stock) and ``emulator`` (the real MSL kernels on the CPU) against stock
mlx-lm: the logits pass the dtype-scaled rule against a float64 clone, greedy tokens equal
stock's, decode stays stock, the report names the piece. Ragged calls (experts without rows, one
expert taking every token, top-k 1 and 8, 1 / 63 / 64 / 300 tokens), quantized experts, the
fallbacks (an unknown activation, mxfp4 experts, no kernel backend) and the kind's tuner path.

On the CPU, MLX 0.32's ``gather_mm`` takes float32 only, so stock float experts run in float32;
the float64 clone computes ``SwitchLinear`` with gathered weights (:func:`_gathered_switch`).
"""
from __future__ import annotations

import contextlib
import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import switch_layers
from mlx_lm.models.cache import make_prompt_cache

from mlx_bricks.bricks.moe import cuda as moe_cuda
from mlx_bricks.bricks.moe import msl as moe_msl
from mlx_bricks.bricks.moe.kind import MOE_MLP, rows_bucket
from mlx_bricks.bricks.moe.piece import MOE_PIECE, moe_args
from mlx_bricks.nn.calls import DECODE
from mlx_bricks.nn.classes import is_patched
from mlx_bricks.patch import patch_model, unpatch_model
from mlx_bricks.patch.core import NO_KERNEL_BACKEND
from tests.support import require_backend
from tests.tolerance import assert_dtype_close

VOCAB = 256
_COMMON = dict(hidden_size=64, num_hidden_layers=2, rms_norm_eps=1e-6, vocab_size=VOCAB)

# model_type -> ModelArgs fields (besides _COMMON and model_type).
CONFIGS = {
    "qwen3_moe": dict(intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], moe_intermediate_size=32, rope_theta=1e6,
                      tie_word_embeddings=False, max_position_embeddings=1024,
                      norm_topk_prob=True),
    # a shared expert (the model's dense MLP, stays stock) beside the routed ones
    "qwen2_moe": dict(intermediate_size=96, num_attention_heads=2, num_key_value_heads=1,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                    num_local_experts=4, num_experts_per_tok=2),
    "olmoe": dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                  num_experts=4, num_experts_per_tok=2),
    # SwigluOAI experts with biases; the attention has sinks (stays stock)
    "gpt_oss": dict(intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
    # MLA attention, a dense first layer, shared experts, grouped sigmoid routing
    "deepseek_v3": dict(intermediate_size=96, moe_intermediate_size=32, num_attention_heads=2,
                        num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4,
                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=16, v_head_dim=32,
                        qk_nope_head_dim=32, n_group=1, topk_group=1, num_experts_per_tok=2,
                        first_k_dense_replace=1, max_position_embeddings=1024),
}
ARCHS = tuple(CONFIGS)


def build(model_type: str, dtype=mx.float32, *, seed: int = 0, **overrides) -> nn.Module:
    """A random tiny mlx-lm ``model_type`` model in ``dtype``; the final norm scaled by 4 so the
    next-token logits have clear gaps (greedy tokens test the bricks, not ties)."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    fields = dict(_COMMON, **CONFIGS[model_type], model_type=model_type)
    fields.update(overrides)
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(fields))
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed + 1), len(params))
    new = []
    for k, (name, p) in zip(keys, params):
        if name.endswith("norm.weight"):
            p = (4.0 if name == "model.norm.weight" else 1.0) * (
                1.0 + 0.2 * mx.random.normal(p.shape, key=k))
        elif name.endswith(".bias") and "experts" in name:  # gpt-oss's expert biases
            p = 0.1 * mx.random.normal(p.shape, key=k)
        new.append((name, p))
    model.update(tree_unflatten(new))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def _gathered_call(self, x, indices, sorted_indices=False):
    """``SwitchLinear.__call__`` with the experts' weights gathered (any dtype, float64 too)."""
    y = x @ self["weight"][indices].swapaxes(-1, -2)
    if "bias" in self:
        y = y + mx.expand_dims(self["bias"][indices], -2)
    return y


@contextlib.contextmanager
def _gathered_switch():
    """Within the block, ``SwitchLinear`` multiplies gathered weights (float64 on the CPU)."""
    old = switch_layers.SwitchLinear.__call__
    switch_layers.SwitchLinear.__call__ = _gathered_call
    try:
        yield
    finally:
        switch_layers.SwitchLinear.__call__ = old


def float64_logits(model, toks):
    """The logits of a float64 copy of ``model`` (quantized layers dequantized), on the CPU."""
    module = importlib.import_module(type(model).__module__)
    copy = module.Model(model.args)
    flat = dict(tree_flatten(model.parameters()))
    out = []
    with mx.stream(mx.cpu):  # float64 is CPU-only (a GPU default device rejects it)
        for name, p in tree_flatten(copy.parameters()):
            prefix = name.rsplit(".", 1)[0]
            q = flat.get(f"{prefix}.scales")
            if name.endswith(".weight") and q is not None and flat[name].dtype == mx.uint32:
                owner = dict(model.named_modules())[prefix]
                p = mx.dequantize(flat[name], q, flat.get(f"{prefix}.biases"),
                                  group_size=owner.group_size, bits=owner.bits)
            else:
                p = flat[name]
            out.append((name, p.astype(mx.float64)))
    copy.update(tree_unflatten(out))
    with mx.stream(mx.cpu), _gathered_switch():
        y = copy(toks)
        mx.eval(y)
    return y


def tokens(n: int, seed: int = 0) -> mx.array:
    return mx.random.randint(0, VOCAB, (1, n), key=mx.random.key(1000 + seed)).astype(mx.int32)


def run(model, toks, cache=None):
    y = model(toks, cache=cache)
    mx.eval(y)
    return y


def greedy(model, toks, n: int = 4) -> list[int]:
    """``n`` greedy tokens after the prompt (prefill, then decode with mlx-lm's cache)."""
    cache = make_prompt_cache(model)
    y = run(model, toks, cache)
    out = []
    for _ in range(n):
        t = mx.argmax(y[:, -1, :], axis=-1)
        out.append(t.item())
        y = run(model, t[None], cache)
    return out


def moe_entries(report):
    return [m for m in report.modules if m.module == MOE_PIECE.role]


def expected_moe_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.layers)
            if any(isinstance(m, switch_layers.SwitchGLU) for _, m in layer.named_modules())]


pytestmark = pytest.mark.usefixtures("fresh_home")


def check_patched(model_type, backend, n_tokens=20, dtype=mx.float32, quantize=None,
                  tune="off", **kw):
    """Patch a tiny ``model_type`` model on ``backend``: every SwitchGLU patched and run, the
    logits within the rule of the float64 clone (bit-equal to stock on reference), greedy
    tokens as stock's, decode stock."""
    if backend != "reference":
        require_backend(backend)
    model = build(model_type, **kw)
    if quantize is not None:  # the router stays float: MLX 0.32.4 CUDA's 4-expert (N=4)
        # quantized matmul fails its TMA descriptor and returns garbage (the bench does the same)
        nn.quantize(model, group_size=quantize[1], bits=quantize[0],
                    class_predicate=lambda path, m: hasattr(m, "to_quantized")
                    and not path.endswith((".gate", ".router")))
    model.set_dtype(dtype)
    toks = tokens(n_tokens)
    stock = run(model, toks)
    assert mx.isfinite(stock).all(), f"{model_type}: stock mlx-lm's own logits are not finite"
    stock_tokens = greedy(model, toks)
    report = patch_model(model, backend=backend, tune=tune)
    layers = expected_moe_layers(model)
    entries = moe_entries(report)
    assert [m.layer for m in entries] == layers and layers
    assert all(m.status == "patched" and m.bricks == (MOE_MLP.op_name,) for m in entries)
    out = run(model, toks)

    def moe_count(what):  # the MoE modules' counts only: attention may be patched too
        return sum(sum(getattr(m, what).values()) for m in entries)

    if tune != "off" and report.dispatch.tuning:  # the tuner may keep stock: count both
        ran = moe_count("calls") + moe_count("tuned_stock_calls")
        assert ran == len(layers) and len(report.tuning()["decisions"]) >= 1
    else:
        assert report.calls()[MOE_MLP.op_name] == (len(layers) if n_tokens > 1 else 0)
    if backend == "reference" and quantize is None:
        assert mx.array_equal(out, stock), f"{model_type}: reference is SwitchGLU itself"
    assert_dtype_close(out, float64_logits(model, toks), stock, dtype=dtype,
                       what=f"{model_type} {backend} patched logits")
    assert greedy(model, toks) == stock_tokens
    decode = sum(m.stock_calls.get(DECODE, 0) for m in entries)
    assert decode == (4 + 2 * (n_tokens == 1)) * len(layers)  # a 1-token prompt is decode too
    return model, report


@pytest.mark.parametrize("model_type", ARCHS)
def test_reference_matches_stock(model_type):
    check_patched(model_type, "reference")


# one representative model on the emulator in the default suite; the others are slow
@pytest.mark.parametrize("model_type", [
    m if m == "qwen3_moe" else pytest.param(m, marks=pytest.mark.slow) for m in ARCHS])
def test_emulator_matches_stock(model_type):
    check_patched(model_type, "emulator")


# (model_type, overrides, the dense layers): head_dim 64 (the attention brick's smallest)
TABLE_MOE = {"qwen3_moe": (dict(head_dim=64, mlp_only_layers=[1]), [1]),
             "qwen2_moe": (dict(hidden_size=128), [])}


@pytest.mark.parametrize("backend", ["reference", pytest.param("emulator",
                                                                 marks=pytest.mark.slow)])
@pytest.mark.parametrize("model_type", TABLE_MOE)
def test_table_moe_architectures(model_type, backend):
    """qwen3_moe and qwen2_moe are in the patch table (qwen3's / qwen2's attention): their
    attention runs the bricks too; a MoE layer's mlp is reported stock with the reason (its
    experts are the moe entry; qwen2_moe's shared expert stays in the stock sparse block), a
    dense layer (qwen3_moe's mlp_only_layers) runs the unified block."""
    if backend == "emulator":
        require_backend("emulator")
    overrides, dense = TABLE_MOE[model_type]
    model = build(model_type, **overrides)
    toks = tokens(40)
    stock = run(model, toks)
    stock_tokens = greedy(model, toks)
    report = patch_model(model, backend=backend, tune="off")
    assert report.architecture == model_type
    got = {(m.layer, m.module): m.status for m in report.modules}
    want = {}
    for i in range(2):
        want.update({(i, "block"): "patched"} if i in dense else {
            (i, "self_attn"): "patched", (i, "mlp"): "fallback", (i, "moe"): "patched"})
    assert got == want
    for mlp in (m for m in report.modules if m.module == "mlp"):
        assert mlp.reason.startswith("MoE block") and "patched by module" in mlp.reason
        assert mlp.weights == {}
    out = run(model, toks)
    assert_dtype_close(out, float64_logits(model, toks), stock, dtype=mx.float32,
                       what=f"{model_type} attention + experts {backend}")
    calls = report.calls()
    assert calls[MOE_MLP.op_name] == 2 - len(dense) and calls["flash_attention"] == 2
    assert greedy(model, toks) == stock_tokens


def test_gpt_oss_report():
    """gpt-oss: the SwigluOAI experts (with biases) are patched, the report lists per layer
    what ran. This tiny model's head_dim 32 is not one of the attention brick's, so its
    attention (sinks and all: tests/test_patch_new_attention.py) stays stock with that reason."""
    model, report = check_patched("gpt_oss", "reference", n_tokens=12)
    attn = [m for m in report.modules if m.module == "self_attn"]
    assert len(attn) == 2 and all(m.status == "fallback" and "head_dim 32" in m.reason
                                  for m in attn)
    for m in moe_entries(report):
        assert "mlp.experts" in m.variant and "activation=swiglu_oai" in m.variant
        assert m.weights == {"gate_proj": "float32", "up_proj": "float32",
                             "down_proj": "float32"}
    text = str(report)
    assert f"{MOE_MLP.op_name}:2" in text
    assert report.to_dict()["modules"][2]["module"] == MOE_PIECE.role
    assert unpatch_model(model) == 2
    assert not any(is_patched(m) for m in model.modules())


# the cuda twins on a GPU (skipped elsewhere): bfloat16 float and 4-bit experts, the tile rule
# and the tuner (stock gather_mm / gather_qmm timed against every tile the GPU runs)
@pytest.mark.parametrize("tune", ["off", "force"])
@pytest.mark.parametrize("model_type,quantize,overrides", [
    ("qwen3_moe", None, {}), ("gpt_oss", None, {}), ("deepseek_v3", None, {}),
    # every quantized K at least 512: MLX 0.32.4 CUDA's stock quantized matmul fails its TMA
    # descriptor for fewer groups per row and returns garbage (stock's own logits not finite)
    ("qwen3_moe", (4, 64), {"hidden_size": 512, "moe_intermediate_size": 512,
                            "num_attention_heads": 4, "head_dim": 128}),
    ("mixtral", (4, 64), {"hidden_size": 512, "intermediate_size": 512,
                          "num_attention_heads": 4})], ids=str)
def test_cuda_matches_stock(model_type, quantize, overrides, tune):
    check_patched(model_type, "cuda", n_tokens=80, dtype=mx.bfloat16, quantize=quantize,
                  tune=tune, **overrides)


@pytest.mark.parametrize("n", [1, 63, 64, 300])
def test_prompt_lengths_reference(n):
    check_patched("qwen3_moe", "reference", n_tokens=n)


@pytest.mark.parametrize("n", [1, 63, pytest.param(64, marks=pytest.mark.slow)])
def test_prompt_lengths_emulator(n):
    check_patched("mixtral", "emulator", n_tokens=n)


@pytest.mark.parametrize("backend", ["reference", "emulator"])
@pytest.mark.parametrize("k", [1, 8])
def test_top_k(backend, k):
    check_patched("qwen3_moe", backend, n_tokens=24, num_experts=8, num_experts_per_tok=k)


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_quantized_experts(backend):
    """4-bit gs64 experts (QuantizedSwitchLinear) in bfloat16: stock's gather_qmm runs on the
    CPU."""
    model, report = check_patched("qwen3_moe", backend, dtype=mx.bfloat16, quantize=(4, 64),
                                  moe_intermediate_size=64)
    assert all(m.weights["down_proj"] == "q4 gs64" for m in moe_entries(report))


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_quantized_experts_with_biases(backend):
    """gpt-oss with 4-bit gs32 experts in float16: QuantizedSwitchLinear keeps the expert
    biases (``bias``), which the brick adds."""
    model, report = check_patched("gpt_oss", backend, dtype=mx.float16, quantize=(4, 32))
    glu = model.layers[0].mlp.experts
    assert type(glu.up_proj) is switch_layers.QuantizedSwitchLinear and "bias" in glu.up_proj
    assert all(m.weights["gate_proj"] == "q4 gs32" for m in moe_entries(report))


@pytest.mark.parametrize("backend", ["reference", "emulator"])
@pytest.mark.parametrize("routing", ["one_expert", "two_of_eight"])
def test_experts_without_rows(backend, routing):
    """The patched SwitchGLU itself, called with chosen indices: every token on expert 3 (the
    others get no rows), or on experts 1 and 6 only; against the stock class."""
    if backend == "emulator":
        require_backend("emulator")
    model = build("qwen3_moe", num_experts=8, num_experts_per_tok=2)
    glu = model.layers[0].mlp.switch_mlp
    x = mx.random.normal((1, 70, 64), key=mx.random.key(3))
    k = 1 if routing == "one_expert" else 2
    idx = mx.full((1, 70, k), 3, mx.int32) if k == 1 else mx.broadcast_to(
        mx.array([1, 6], mx.int32), (1, 70, 2))
    stock = glu(x, idx)
    report = patch_model(model, backend=backend, tune="off")
    out = glu(x, idx)
    assert out.shape == stock.shape == (1, 70, k, 64)
    if backend == "reference":
        assert mx.array_equal(out, stock)
    ref = MOE_MLP.reference_tail(moe_args(glu, x, idx), 70 * k)
    assert_dtype_close(out.reshape(-1, 64), ref, stock.reshape(-1, 64), dtype=mx.float32,
                       what=f"{routing} {backend}")
    assert report.calls()[MOE_MLP.op_name] == 1


@pytest.mark.parametrize("backend", ["reference", "emulator"])
@pytest.mark.parametrize("act", ["geglu", "swiglu_oai", "situ"])
def test_activation_modules(backend, act):
    """gemma4's ``GeGLU`` runs as ``gelu_tanh``; a ``SwigluOAI`` with its own alpha and limit
    passes them, kimi_k3's ``SiTU`` its beta and linear_beta (the patched SwitchGLU against the
    stock class and the float64 rows)."""
    if backend == "emulator":
        require_backend("emulator")
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.gemma4_text import GeGLU
    from mlx_lm.models.kimi_k3 import SiTU

    model = build("qwen3_moe", num_experts=8, num_experts_per_tok=2)
    glu = model.layers[0].mlp.switch_mlp
    glu.activation = {"geglu": GeGLU(), "swiglu_oai": SwigluOAI(alpha=1.5, limit=0.05),
                      "situ": SiTU(beta=0.7, linear_beta=1.5)}[act]
    x = mx.random.normal((1, 40, 64), key=mx.random.key(4))
    idx = mx.random.randint(0, 8, (1, 40, 2), key=mx.random.key(5)).astype(mx.int32)
    stock = glu(x, idx)
    report = patch_model(model, backend=backend, tune="off")
    entry = moe_entries(report)[0]
    name = "gelu_tanh" if act == "geglu" else act
    assert entry.status == "patched" and f"activation={name}" in entry.variant
    args = moe_args(glu, x, idx)
    assert args["activation"] == name
    if act == "swiglu_oai":  # a limit this low clamps many gate and up values
        assert (args["alpha"], args["limit"]) == (1.5, 0.05)
    if act == "situ":
        assert (args["beta"], args["linear_beta"]) == (0.7, 1.5)
    out = glu(x, idx)
    if backend == "reference":
        assert mx.array_equal(out, stock)
    ref = MOE_MLP.reference_tail(args, 80)
    assert_dtype_close(out.reshape(-1, 64), ref, stock.reshape(-1, 64), dtype=mx.float32,
                       what=f"{act} {backend}")


def test_situ_with_a_parameter_out_of_range_stays_stock():
    """A SiTU whose beta is not > 0: the experts stay stock at patch time, with the reason."""
    from mlx_lm.models.kimi_k3 import SiTU

    model = build("qwen3_moe", num_experts=8, num_experts_per_tok=2)
    model.layers[0].mlp.switch_mlp.activation = SiTU(beta=0.0)
    entry = moe_entries(patch_model(model, backend="reference", tune="off"))[0]
    assert entry.status == "fallback" and "SiTU with beta=0.0" in entry.reason


def _kimi_k3():
    from tests.models import build_model

    return build_model("kimi_k3", mx.float32)


def _nemotron_h():
    from tests.ssm_models import build as build_ssm

    return build_ssm("nemotron_h", mx.float32)


#: model -> (builder, the experts' activation, their switch layers, the kernels that must run
#: on the emulator): kimi_k3's SwitchGLU with SiTU (behind latent projections), nemotron_h's
#: gate-less SwitchMLP (fc1, ReLU^2, fc2: w_gate None, the moe_up kernel).
EXPERT_MODELS = {
    "kimi_k3": (_kimi_k3, "situ", {"gate_proj", "up_proj", "down_proj"},
                ("moe_gate_up", "moe_down")),
    "nemotron_h": (_nemotron_h, "relu2", {"fc1", "fc2"}, ("moe_up", "moe_down")),
}


@pytest.mark.parametrize("backend", ["reference", "emulator"])
@pytest.mark.parametrize("name", EXPERT_MODELS)
def test_model_experts(name, backend):
    """A tiny float32 model's routed experts run the MoE brick: every MoE layer's experts
    patched (their activation named), called once per prefill (on the emulator through the
    kernels listed), logits close to stock's and to float64's."""
    if backend == "emulator":
        require_backend("emulator")
    from mlx_bricks import kernels

    build, act, layers, launched = EXPERT_MODELS[name]
    model = build()
    toks = tokens(30)
    stock = run(model, toks)
    report = patch_model(model, backend=backend, tune="off")
    entries = moe_entries(report)
    assert entries and all(m.status == "patched" and f"activation={act}" in m.variant
                           for m in entries), report
    assert all(set(m.weights) == layers for m in entries)
    before = {k: kernels.LAUNCH_COUNTS[(k, backend)] for k in launched}
    out = run(model, toks)
    assert report.calls()[MOE_MLP.op_name] == len(entries)
    if backend == "emulator":
        assert all(kernels.LAUNCH_COUNTS[(k, backend)] - before[k] == len(entries)
                   for k in launched)
    assert_dtype_close(out, float64_logits(model, toks), stock, dtype=mx.float32,
                       what=f"{name} {backend}")


@pytest.mark.parametrize("backend", ["reference", "emulator"])
def test_batch_and_flat_inputs(backend):
    """x of (batch, L, D) and of (tokens, D) (a model that flattens before its experts); one
    flat token is decode (stock, counted)."""
    if backend == "emulator":
        require_backend("emulator")
    model = build("qwen3_moe", num_hidden_layers=1)
    glu = model.layers[0].mlp.switch_mlp
    report = patch_model(model, backend=backend, tune="off")
    for i, shape in enumerate(((2, 33, 64), (33, 64))):
        x = mx.random.normal(shape, key=mx.random.key(7 + i))
        idx = mx.random.randint(0, 4, (*shape[:-1], 2), key=mx.random.key(9 + i))
        out = glu(x, idx)
        stock = type(glu)._bricks_base.__call__(glu, x, idx)
        assert out.shape == stock.shape == (*shape[:-1], 2, 64)
        if backend == "reference":
            assert mx.array_equal(out, stock)
        ref = MOE_MLP.reference_tail(moe_args(glu, x, idx), 8)
        assert_dtype_close(out.reshape(-1, 64)[-8:], ref, stock.reshape(-1, 64)[-8:],
                           dtype=mx.float32, what=f"{shape} {backend}")
    assert report.calls()[MOE_MLP.op_name] == 2
    x1 = mx.random.normal((1, 64), key=mx.random.key(11))
    idx1 = mx.array([[1, 2]], mx.int32)
    assert mx.array_equal(glu(x1, idx1), type(glu)._bricks_base.__call__(glu, x1, idx1))
    assert report.stock_calls()[DECODE] == 1


@pytest.mark.parametrize("tune", ["off", "force", "auto"])
def test_tune_modes_on_the_emulator(tune):
    """Tuning does not apply to a named emulator: every mode runs the brick by its rule."""
    require_backend("emulator")
    model = build("olmoe", num_hidden_layers=1)
    toks = tokens(16)
    stock = run(model, toks)
    report = patch_model(model, backend="emulator", tune=tune)
    assert all(m.status == "patched" and "tile=rule" in m.variant for m in moe_entries(report))
    out = run(model, toks)
    assert_dtype_close(out, float64_logits(model, toks), stock, dtype=mx.float32,
                       what=f"tune={tune}")
    assert report.calls()[MOE_MLP.op_name] == 1


def test_tuner_measures_the_tiles(monkeypatch):
    """With tuning applied to the emulator (standing in for metal), the dispatch measures the
    brick's tiles against stock SwitchGLU for the piece's key and runs the winner or stock."""
    require_backend("emulator")
    from mlx_bricks.runtime import dispatch as dispatch_mod

    monkeypatch.setattr(dispatch_mod, "TUNED_BACKENDS", ("metal", "cuda", "emulator"))
    monkeypatch.setattr(MOE_MLP, "listing", lambda backend, dtype, args: ("bm32",))
    model = build("qwen3_moe", num_hidden_layers=1)
    toks = tokens(16)
    stock = run(model, toks)
    report = patch_model(model, backend="emulator", tune="force")
    assert "tile=tuned" in moe_entries(report)[0].variant
    out = run(model, toks)
    decisions = report.tuning()["decisions"]
    assert len(decisions) == 1 and decisions[0]["key"].startswith(f"emulator|{MOE_MLP.name}[")
    d = report.dispatch.decisions[next(iter(report.dispatch.decisions))]
    assert d.variants["bm32"]["ok"], d.variants
    assert_dtype_close(out, float64_logits(model, toks), stock, dtype=mx.float32,
                       what="tuned")
    ran = report.calls().get(MOE_MLP.op_name, 0) + sum(report.tuned_stock_calls().values())
    assert ran == 1


def test_key_buckets_tokens_and_rows_per_expert():
    model = build("qwen3_moe", num_experts=8, num_experts_per_tok=2)
    glu = model.layers[0].mlp.switch_mlp
    x = mx.zeros((1, 100, 64))
    idx = mx.zeros((1, 100, 2), mx.int32)
    key = MOE_MLP.key(moe_args(glu, x, idx))
    assert key.kind == MOE_MLP.name
    assert key.params == "E=8,N=32,D=64,k=2,bias=0"
    assert key.bucket == "M<=128,rpe<=32" and key.dtype == "float32" and key.weights == "float"
    assert rows_bucket(8192, 8, 128) == "rpe<=512" and rows_bucket(1, 1, 128) == "rpe<=32"
    assert MOE_MLP.listing("reference", mx.float32, None) == ()
    assert MOE_MLP.listing("emulator", mx.float32, None) == tuple(moe_msl.TILES)
    assert MOE_MLP.listing("cuda", mx.float32, None) == ()  # no CUDA twin for float32
    assert set(MOE_MLP.listing("cuda", mx.bfloat16, None)) <= set(moe_cuda.TILES)


def test_unknown_activation_stays_stock_and_mxfp4_is_patched():
    """A SwitchGLU with another activation: stock, with the reason; one with mxfp4 experts is
    patched (SwitchGLU in MLX ops on reference: stock's values); the model's output is
    stock's."""
    model = build("qwen3_moe")

    class Relu2(nn.Module):
        def __call__(self, x, gate):
            return nn.relu(gate) ** 2 * x

    model.layers[0].mlp.switch_mlp.activation = Relu2()
    glu = model.layers[1].mlp.switch_mlp
    glu.gate_proj = glu.gate_proj.to_quantized(group_size=32, bits=4, mode="mxfp4")
    toks = tokens(12)
    stock = run(model, toks)
    report = patch_model(model, backend="reference")
    e0, e1 = moe_entries(report)
    assert e0.status == "fallback" and "activation Relu2" in e0.reason
    assert e1.status == "patched" and e1.weights["gate_proj"] == "mxfp4 gs32"
    assert report.n_patched == 1
    assert mx.array_equal(run(model, toks), stock)
    assert report.calls()[MOE_MLP.op_name] == 1


def test_structure_change_after_patching_runs_stock():
    """An activation module swapped after the patch: the call runs stock, with the reason."""
    model = build("qwen3_moe", num_hidden_layers=1)
    toks = tokens(12)
    report = patch_model(model, backend="reference")
    run(model, toks)
    assert report.calls()[MOE_MLP.op_name] == 1
    glu = model.layers[0].mlp.switch_mlp

    class Relu2(nn.Module):
        def __call__(self, x, gate):
            return nn.relu(gate) ** 2 * x

    glu.activation = Relu2()
    x = mx.random.normal((1, 12, 64), key=mx.random.key(6))
    idx = mx.zeros((1, 12, 2), mx.int32)
    out = glu(x, idx)
    assert mx.array_equal(out, type(glu)._bricks_base.__call__(glu, x, idx))
    assert report.calls()[MOE_MLP.op_name] == 1
    (reason,) = [r for r in report.stock_calls() if "Relu2" in r]
    assert report.stock_calls()[reason] == 1


def test_no_kernel_backend_leaves_the_experts_stock(monkeypatch):
    from mlx_bricks.backends import backend_status

    if backend_status("metal")[0] or backend_status("cuda")[0]:
        pytest.skip("this machine has a kernel backend")
    monkeypatch.delenv("MLX_BRICKS_BACKEND", raising=False)
    model = build("mixtral")
    report = patch_model(model)
    assert [(m.status, m.reason) for m in moe_entries(report)] == [
        ("stock", NO_KERNEL_BACKEND)] * 2
    assert report.n_patched == 0 and report.dispatch is None


def test_mlp_false_and_dense_models_unchanged():
    model = build("mixtral")
    report = patch_model(model, backend="reference", mlp=False)
    assert [m.status for m in moe_entries(report)] == ["disabled"] * 2
    assert report.n_patched == 0
