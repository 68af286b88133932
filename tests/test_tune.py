"""The tuner (``mlx_bricks.tune``): buckets, the tolerance rule, op kinds, measured decisions,
the decision cache (round trip, two processes, corrupt and foreign files) and the CLI.

Timing is real everywhere (no clock is mocked): an injected "slow" variant computes stock four
times, an injected "fast" one returns a result computed beforehand (it does no work at all), so
the expected winner is never within timing noise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama

from mlx_bricks import kernels
from mlx_bricks.backends import BackendError
from mlx_bricks.bricks.attention import op as attention
from mlx_bricks.bricks.gemm import msl as gemm_msl
from mlx_bricks.bricks.gemm import op as gemm
from mlx_bricks.bricks.norm_qkv import op as norm_qkv
from mlx_bricks.bricks.swiglu import msl as mlp_msl
from mlx_bricks.bricks.swiglu import op as mlp
from mlx_bricks.formats.affine import QuantizedWeight
from mlx_bricks.tune import __main__ as tune_cli
from mlx_bricks.formats import format_of
from mlx_bricks.tune.buckets import attention_bucket, m_bucket
from mlx_bricks.tune.cache import FORMAT, Context, DecisionCache
from mlx_bricks.tune.check import dtype_close
from mlx_bricks.runtime.guard import Guard
from mlx_bricks.bricks import kinds
from mlx_bricks.runtime.kind import Act, Variant
from mlx_bricks.tune.timing import time_interleaved
from mlx_bricks.tune.tuner import MIN_SPEEDUP, STOCK, Decision, tune_op
from tests import ssm_models
from tests.models import model_args

KINDS = kinds()

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """Every test gets its own cache directory."""
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path / "home"))


def ctx(**changes) -> Context:
    base = dict(device="Test GPU", architecture="test_arch", mlx="0.32.4", mlx_bricks="0.1.0",
                kernels="0123456789ab")
    base.update(changes)
    return Context(**base)


# ---------------------------------------------------------------------------------------------
# buckets, tolerance, listing functions


def test_buckets():
    assert [m_bucket(m) for m in (1, 32, 33, 128, 129, 512, 2048, 2049, 8192)] == [
        "M<=32", "M<=32", "M<=128", "M<=128", "M<=512", "M<=512", "M<=2048", "M>2048",
        "M>2048"]
    assert attention_bucket(512, 512) == "q<=512,kv<=512"
    assert attention_bucket(100, 3000) == "q<=128,kv<=8192"
    assert attention_bucket(9000, 9000) == "q>2048,kv>8192"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="M must be a positive int"):
            m_bucket(bad)
    w = mx.random.normal((64, 128))
    assert format_of(w).key == "float"
    assert format_of(QuantizedWeight(*mx.quantize(w, group_size=64, bits=4), 64, 4)).key == \
        "q4g64"


def test_dtype_close_rule():
    ref = np.linspace(-3, 3, 64)
    naive = ref + 1e-3
    assert dtype_close(ref + 1.5e-3, ref, naive, dtype=mx.float16).ok
    bad = dtype_close(ref + 3e-2, ref, naive, dtype=mx.float16)
    assert not bad.ok and "budget" in str(bad)
    # a naive result that happens to be exact still allows a few ulps
    assert dtype_close(ref + 2 * 2.0**-10, ref, ref, dtype=mx.float16).ok
    nonfinite = ref.copy()
    nonfinite[3] = np.inf
    r = dtype_close(nonfinite, ref, naive, dtype=mx.float16)
    assert not r.ok and not r.finite
    assert not dtype_close(ref[:5], ref, naive, dtype=mx.float16).shape_ok
    with pytest.raises(ValueError, match="dtype"):
        dtype_close(ref, ref, ref, dtype=mx.int32)


def test_variant_listing_functions():
    for b in ("metal", "emulator"):
        assert gemm.tile_names(b) == tuple(gemm_msl.TILES)
        assert norm_qkv.tile_names(b) == tuple(gemm_msl.TILES)
        assert mlp.variant_names(b) == ("fused", "split")
        assert mlp.tile_names(b, "fused") == tuple(mlp_msl.FUSED_TILES)
        assert mlp.tile_names(b, "split") == tuple(gemm_msl.TILES)
        assert attention.variant_names(b) == ("default",)
    for f in (gemm.tile_names, norm_qkv.tile_names, mlp.variant_names, attention.variant_names):
        assert f("reference") == () and f("reference", mx.float16) == ()
        with pytest.raises(BackendError, match="unknown backend"):
            f("tpu")
    # cuda: the twins' own tiles (those this GPU can run; no GPU here: no wgmma tile), none for
    # float32 (no twin) nor for a brick without a twin
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
    assert set(gemm.tile_names("cuda", mx.bfloat16)) <= set(gemm_cuda.TILES)
    assert gemm.tile_names("cuda", mx.float32) == ()
    assert norm_qkv.tile_names("cuda", mx.float16) == gemm.tile_names("cuda", mx.float16)
    assert set(mlp.tile_names("cuda", "fused", mx.float16)) <= set(swiglu_cuda.SWIGLU_TILES)
    assert mlp.variant_names("cuda", mx.float32) == ()
    if not kernels.has_kernel("flash_attention", "cuda"):
        assert attention.variant_names("cuda") == ()
    with pytest.raises(ValueError, match="variant must be one of"):
        mlp.tile_names("emulator", "fast")
    # every listed name is accepted by its op (the reference backend validates, then runs ops)
    x, w = mx.random.normal((4, 32)), mx.random.normal((16, 32))
    for t in gemm.tile_names("emulator"):
        mx.eval(gemm.linear(x, w, tile=t, backend="reference"))
    for v in mlp.variant_names("emulator"):
        for t in mlp.tile_names("emulator", v):
            mx.eval(mlp.swiglu(x, w, w, variant=v, tile=t, backend="reference"))


# ---------------------------------------------------------------------------------------------
# op kinds: stock is mlx-lm's computation, the check accepts it and rejects a wrong result


def _kind_args(dtype=mx.float32):
    _, args = model_args("llama", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64)
    mx.random.seed(3)
    block = llama.TransformerBlock(args)
    block.set_dtype(dtype)
    x = mx.random.normal((2, 9, 64)).astype(dtype)
    a = block.self_attn
    return block, x, {
        "linear": {"x": x, "weight": a.q_proj.weight, "bias": None,
                   "residual": mx.random.normal((2, 9, 256)).astype(dtype)},
        "swiglu_mlp": {"x": x, "w_gate": block.mlp.gate_proj.weight,
                       "w_up": block.mlp.up_proj.weight, "w_down": block.mlp.down_proj.weight,
                       "residual": None},
        "rms_norm_qkv": {"x": x, "norm_weight": block.input_layernorm.weight,
                         "eps": block.input_layernorm.eps, "wq": a.q_proj.weight,
                         "wk": a.k_proj.weight, "wv": a.v_proj.weight, "n_heads": 4,
                         "n_kv_heads": 2, "head_dim": 64},
        "attention": {"q": mx.random.normal((2, 4, 9, 64)).astype(dtype),
                      "k": mx.random.normal((2, 2, 13, 64)).astype(dtype),
                      "v": mx.random.normal((2, 2, 13, 64)).astype(dtype),
                      "scale": 64**-0.5, "mask": "causal", "kv_quant": None},
        "moe_mlp": {"x": x, "indices": mx.random.randint(0, 4, (2, 9, 2)),
                    "w_gate": (mx.random.normal((4, 96, 64)) * 0.125).astype(dtype),
                    "w_up": (mx.random.normal((4, 96, 64)) * 0.125).astype(dtype),
                    "w_down": (mx.random.normal((4, 64, 96)) * 0.1).astype(dtype)},
        # the kind's own model-like values (normalised q/k, mlx-lm's gates)
        "gated_delta": KINDS["gated_delta"].synthetic({
            "q": Act((2, 9, 2, 32), dtype), "k": Act((2, 9, 2, 32), dtype),
            "v": Act((2, 9, 4, 16), dtype), "g": Act((2, 9, 4), mx.float32),
            "beta": Act((2, 9, 4), dtype), "state": Act((2, 4, 16, 32), mx.float32)}, seed=3),
        **ssm_models.kind_args(dtype),  # ssd, short_conv, selective_scan
        # an indexer-like selection of 8 of 20 keys per query (the kind's own values)
        "sparse_attention": KINDS["sparse_attention"].synthetic({
            "q": Act((2, 4, 9, 16), dtype), "q_pe": Act((2, 4, 9, 8), dtype),
            "latent": Act((2, 1, 20, 32), dtype), "k_pe": Act((2, 1, 20, 8), dtype),
            "indices": Act((2, 1, 9, 8), mx.uint32),
            "w_k": (mx.random.normal((4, 32, 16)) * 0.2).astype(dtype),
            "w_v": (mx.random.normal((4, 12, 32)) * 0.2).astype(dtype), "scale": 0.2}, seed=3),
    }


def test_kind_stock_is_mlx_lm(monkeypatch):
    block, x, args = _kind_args()
    a = block.self_attn
    lin = args["linear"]
    assert mx.array_equal(KINDS["linear"].stock(lin), lin["residual"] + a.q_proj(x))
    assert mx.array_equal(KINDS["swiglu_mlp"].stock(args["swiglu_mlp"]), block.mlp(x))
    q, k, v = KINDS["rms_norm_qkv"].stock(args["rms_norm_qkv"])
    h = block.input_layernorm(x)
    assert mx.array_equal(q, a.q_proj(h).reshape(2, 9, 4, -1).transpose(0, 2, 1, 3))
    assert mx.array_equal(v, a.v_proj(h).reshape(2, 9, 2, -1).transpose(0, 2, 1, 3))
    at = args["attention"]
    assert mx.array_equal(KINDS["attention"].stock(at), mx.fast.scaled_dot_product_attention(
        at["q"], at["k"], at["v"], scale=at["scale"], mask="causal"))


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("name", tuple(KINDS))
def test_kind_check_accepts_bricks_and_rejects_wrong_values(name, dtype):
    _, _, all_args = _kind_args(getattr(mx, dtype))
    k, args = KINDS[name], all_args[name]
    naive = k.stock(args)
    brick = k.brick(args, "reference")
    assert k.check(brick, naive, args).ok
    assert k.check(naive, naive, args).ok
    # off by far more than 4 bfloat16 ulps at the output scale (the rule's floor)
    if isinstance(naive, tuple):
        wrong = (naive[0], naive[1] * 1.25 + 0.1, *naive[2:])
    else:
        wrong = naive * 1.25 + 0.1
    r = k.check(wrong, naive, args)
    assert not r.ok and r.error > r.budget


def test_kind_keys_and_synthetic_inputs():
    _, _, args = _kind_args()
    assert str(KINDS["linear"].key(args["linear"])) == \
        "linear[N=256,K=64,bias=0,res=1] M<=32 float32 w=float"
    assert str(KINDS["attention"].key(args["attention"])) == \
        "attention[head_dim=64,gqa=2,kv_quant=none,mask=causal] q<=32,kv<=32 float32 w=-"
    placeholder = dict(args["linear"], x=Act((3, 50, 64), mx.float32), residual=None)
    key = KINDS["linear"].key(placeholder)
    assert (key.params, key.bucket) == ("N=256,K=64,bias=0,res=0", "M<=512")
    synth = KINDS["linear"].synthetic(placeholder)
    assert synth["x"].shape == (3, 50, 64) and synth["weight"] is placeholder["weight"]
    assert mx.array_equal(synth["x"], KINDS["linear"].synthetic(placeholder)["x"])


# ---------------------------------------------------------------------------------------------
# the tuner: real timing, injected variants


def _linear_problem(dtype=mx.float32):
    w = (mx.random.normal((512, 512), key=mx.random.key(1)) * 512**-0.5).astype(dtype)
    mx.eval(w)
    return {"x": Act((1, 128, 512), dtype), "weight": w, "bias": None, "residual": None}


def _slow(args, backend=None):
    """Stock four times (all four evaluated: the maximum of equal values is the value)."""
    s = [KINDS["linear"].stock(args) for _ in range(4)]
    return mx.maximum(mx.maximum(s[0], s[1]), mx.maximum(s[2], s[3]))


def _memo(args, factor=1.0):
    """A variant that does no work: stock's result on the tuner's synthetic inputs, computed
    beforehand (scaled by ``factor`` to make it wrong)."""
    out = KINDS["linear"].stock(KINDS["linear"].synthetic(args)) * factor
    mx.eval(out)
    return lambda *_: out


def test_tuner_picks_stock_when_the_brick_is_slower():
    args = _linear_problem()
    d = tune_op(KINDS["linear"], args, "reference", variants=[Variant("slow", fn=_slow)],
                guard=Guard())
    assert d.winner == STOCK and not d.brick
    assert d.ratio < 1 / 1.5  # four times the work
    assert d.reason == f"tuned: stock faster (x{d.ratio:.2f})"
    assert d.variants["slow"]["ok"] and d.variants["slow"]["s"] > d.stock_s
    assert d.measured == {"M": 128} and d.key.startswith("reference|linear[N=512,K=512")


def test_tuner_picks_the_brick_when_it_is_faster():
    args = _linear_problem()
    d = tune_op(KINDS["linear"], args, "reference",
                variants=[Variant("slow", fn=_slow), Variant("fast", {"tile": "64x64"},
                                                              fn=_memo(args))], guard=Guard())
    assert d.winner == "fast" and d.brick and d.kwargs == {"tile": "64x64"}
    assert d.ratio >= MIN_SPEEDUP
    assert d.reason.startswith("tuned: fast faster (x")
    assert d.variants["fast"]["calls"] > d.variants["slow"]["calls"]


def test_tuner_never_picks_a_variant_that_fails_the_check():
    args = _linear_problem()
    guard = Guard()

    def broken(*_):
        raise RuntimeError("[metal_kernel] Unable to build metal library from source")

    d = tune_op(KINDS["linear"], args, "reference", guard=guard,
                variants=[Variant("wrong", fn=_memo(args, 1.01)), Variant("broken", fn=broken),
                          Variant("slow", fn=_slow)])
    assert d.winner == STOCK  # "wrong" would be far faster; only "slow" passed
    assert not d.variants["wrong"]["ok"] and "numeric check failed" in d.variants["wrong"]["error"]
    assert d.variants["wrong"]["s"] is None
    assert "failed to build or run: RuntimeError" in d.variants["broken"]["error"]
    scope = "linear[N=512,K=512,bias=0,res=0] float32 w=float"
    assert set(guard.disabled) == {("reference", "linear", "wrong", scope),
                                   ("reference", "linear", "broken", scope)}
    # all failing: stock, and the reason says why
    d = tune_op(KINDS["linear"], args, "reference", guard=guard,
                variants=[Variant("wrong", fn=_memo(args, 1.01))])
    assert d.winner == STOCK and d.ratio is None
    assert d.reason.startswith("tuned: no brick variant passed its checks (wrong: linear "
                               "variant wrong on reference: numeric check failed")


def test_tuner_when_stock_fails_to_run(monkeypatch):
    """Stock raising at these shapes (MLX 0.32.4 CUDA's gather_qmm at 8192 tokens, top-8) is
    no crash: variants are checked against the reference alone (a correct one passes, a 10%
    wrong one does not), the fastest passing one wins untimed against stock, and with none
    passing the decision is stock with the reason."""
    args = _linear_problem(mx.bfloat16)  # the dtypes of GPU prefill (float32: see dtype_close)
    kind = KINDS["linear"]
    right, wrong = _memo(args), _memo(args, 1.1)  # 10% off: beyond bfloat16's 4 ulps
    stock = kind.stock

    def slow(a, backend=None):  # stock's work four times, as _slow
        s = [stock(a) for _ in range(4)]
        return mx.maximum(mx.maximum(s[0], s[1]), mx.maximum(s[2], s[3]))

    def failing_stock(a):
        raise RuntimeError("cuGraphAddKernelNode(&node, graph_, NULL, 0, &params) failed")

    monkeypatch.setattr(kind, "stock", failing_stock)
    d = tune_op(kind, args, "reference", guard=Guard(), repeats=2,
                variants=[Variant("wrong", fn=wrong), Variant("slow", fn=slow),
                          Variant("fast", {"tile": "64x64"}, fn=right)])
    assert (d.winner, d.kwargs, d.ratio, d.stock_s) == ("fast", {"tile": "64x64"}, None, None)
    assert not d.variants["wrong"]["ok"] and d.variants["slow"]["ok"]
    assert d.note.startswith("stock failed: RuntimeError") and "cuGraphAddKernelNode" in d.reason
    assert d.variants["fast"]["s"] < d.variants["slow"]["s"]
    d = tune_op(kind, args, "reference", guard=Guard(), variants=[Variant("wrong", fn=wrong)])
    assert d.winner == STOCK and d.reason.startswith("tuned: stock failed: RuntimeError")


def test_guard_when_stock_fails_to_run(monkeypatch):
    """The guard's first-call check where stock raises (on the rows the check reads, and the
    module's own stock path too): a correct brick's output is returned (checked against the
    reference), a wrong one re-raises stock's error (nothing wrong is returned) and is
    disabled."""
    kind = KINDS["linear"]
    args = kind.synthetic(_linear_problem(mx.bfloat16))
    key = kind.key(args)
    good = kind.stock(args)
    mx.eval(good)

    def failing_stock(*_):
        raise RuntimeError("cuGraphAddKernelNode failed: invalid argument")

    monkeypatch.setattr(kind, "check_stock", failing_stock)
    guard = Guard()
    out, reason = guard.run(kind, Variant("fast", fn=lambda *_: good), args, "reference", key,
                            failing_stock)
    assert reason is None and mx.array_equal(out, good)
    with pytest.raises(RuntimeError, match="cuGraphAddKernelNode"):
        guard.run(kind, Variant("wrong", fn=lambda *_: good * 1.1), args, "reference", key,
                  failing_stock)
    assert "disagrees with the reference (stock failed)" in guard.disabled_reason(
        "reference", "linear", "wrong", key.scope)


def test_dtype_close_without_stock():
    """naive=None: the budget is the reference rounded to the dtype (plus 4 ulps)."""
    ref = np.linspace(-3, 3, 101)
    rounded = np.array(mx.array(ref.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))
    assert dtype_close(rounded, ref, None, dtype=mx.bfloat16).ok
    assert not dtype_close(ref * 1.05, ref, None, dtype=mx.bfloat16).ok


def test_tuner_with_no_variant_and_decision_round_trip():
    args = _linear_problem()
    d = tune_op(KINDS["linear"], args, "cuda", variants=[])
    assert d.winner == STOCK and d.reason == "tuned: no brick variant on cuda"
    d = tune_op(KINDS["linear"], args, "reference", variants=[Variant("slow", fn=_slow)],
                guard=Guard(), repeats=2)
    back = Decision.from_dict(d.key, json.loads(json.dumps(d.to_dict())))
    assert (back.winner, back.ratio, back.variants, back.source, back.stock_rounds) == (
        d.winner, d.ratio, d.variants, "cache", 2)
    with pytest.raises(ValueError, match="not a tuning decision"):
        Decision.from_dict("k", {"ratio": 1.0})


def test_time_interleaved_calls_per_eval_and_errors():
    import time

    a = mx.random.normal((64, 64))

    def slow():  # one call takes longer than the target: one call per evaluation
        time.sleep(0.02)
        return a @ a, a

    # A sleep, not a big GEMM: on a loaded machine a small op may time slower than a big one.
    t = time_interleaved({"small": lambda: a + 1, "slow": slow}, repeats=3, target_s=0.01,
                         max_calls=16)
    assert set(t.runs) == {"small", "slow"} and all(len(r) == 3 for r in t.runs.values())
    assert t.calls["slow"] == 1 <= t.calls["small"] <= 16
    assert min(t.runs["slow"]) >= 0.02
    t = time_interleaved({"one": lambda: a + 1}, repeats=1, max_bytes=1)
    assert t.calls["one"] == 1  # memory bound
    with pytest.raises(ValueError, match="repeats"):
        time_interleaved({"x": lambda: a}, repeats=0)
    with pytest.raises(TypeError, match="must return mx.array"):
        time_interleaved({"x": lambda: 3}, repeats=1)


def test_time_interleaved_bounds_a_slow_candidate():
    """A call that takes a whole round gets the rounds that fit the budget, its calibration
    call counted as the first; warm candidates skip the warm-up; fast ones keep every round."""
    import time

    a = mx.random.normal((8, 8))
    calls = {"slow": 0, "fast": 0}

    def slow():
        calls["slow"] += 1
        time.sleep(0.2)
        return a + 1

    def fast():
        calls["fast"] += 1
        return a + 2

    t = time_interleaved({"slow": slow, "fast": fast}, repeats=5, warm={"slow"}, budget_s=0.5)
    assert len(t.runs["slow"]) == 2 and all(r >= 0.2 for r in t.runs["slow"])
    assert calls["slow"] == 2  # no warm-up, the calibration call, one more round
    assert len(t.runs["fast"]) == 5
    # A call far shorter than the target gets several per round (a target no loaded CI machine
    # takes one (8, 8) add to reach).
    t = time_interleaved({"fast": fast}, repeats=2, target_s=0.5)
    assert t.calls["fast"] > 1 and len(t.runs["fast"]) == 2
    calls["slow"] = 0
    t = time_interleaved({"slow": slow}, repeats=3, budget_s=0.1)
    assert len(t.runs["slow"]) == 1 and calls["slow"] == 2  # warm-up and calibration
    t = time_interleaved({"slow": slow}, repeats=2)
    assert len(t.runs["slow"]) == 2  # no budget: every round


# ---------------------------------------------------------------------------------------------
# the decision cache


def test_cache_round_trip_and_context(tmp_path):
    path = tmp_path / "tune" / "decisions.json"
    c = DecisionCache(path, ctx())
    assert c.get("metal|k") is None
    assert c.put({"metal|k": {"winner": "64x64", "ratio": 1.2}})
    again = DecisionCache(path, ctx())
    assert again.get("metal|k") == {"winner": "64x64", "ratio": 1.2}
    assert DecisionCache(path, ctx(mlx="0.33.0")).get("metal|k") is None
    assert DecisionCache(path, ctx(kernels="ffffffffffff")).get("metal|k") is None
    DecisionCache(path, ctx(mlx="0.33.0")).put({"metal|k": {"winner": STOCK}})
    data = json.loads(path.read_text())
    assert data["format"] == FORMAT and len(data["contexts"]) == 2
    assert again.get("metal|k") == {"winner": "64x64", "ratio": 1.2}
    entry = data["contexts"][ctx().id]
    assert entry["context"]["device"] == "Test GPU"
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".tmp"] == []
    assert again.clear() and not path.exists() and not again.clear()


def test_default_cache_lives_under_mlx_bricks_home(tmp_path):
    c = DecisionCache()
    assert c.path == tmp_path / "home" / "tune" / "decisions.json"
    assert c.context.mlx == mx.__version__ and len(c.context.kernels) == 12


@pytest.mark.parametrize("content,problem", (
    ("{not json", "corrupt"),
    (json.dumps({"format": 99, "contexts": {}}), "foreign format 99"),
    (json.dumps([1, 2]), "foreign format None"),
    (json.dumps({"format": FORMAT, "contexts": {"x": 3}}), "unexpected structure"),
))
def test_corrupt_or_foreign_file_is_ignored_with_one_line(tmp_path, capsys, content, problem):
    path = tmp_path / "decisions.json"
    path.write_text(content)
    c = DecisionCache(path, ctx(device=f"dev {problem}"))
    assert c.get("metal|k") is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mlx-bricks: warning: tuning cache ")
    assert problem in err[0]
    assert c.put({"metal|k": {"winner": STOCK}})  # the next write replaces the file
    assert json.loads(path.read_text())["format"] == FORMAT
    assert DecisionCache(path, ctx(device=f"dev {problem}")).get("metal|k") == {"winner": STOCK}


def test_unwritable_cache_warns_and_keeps_the_decision(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    c = DecisionCache(blocker / "tune" / "decisions.json", ctx(device="unwritable"))
    assert c.put({"metal|k": {"winner": STOCK}}) is False
    assert c.get("metal|k") == {"winner": STOCK}
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "cannot be written" in line


_WRITER = textwrap.dedent("""
    import sys
    import mlx.core as mx
    from mlx_bricks.tune.cache import Context, DecisionCache
    from mlx_bricks.runtime.guard import Guard
    from mlx_bricks.bricks import kinds
    from mlx_bricks.runtime.kind import Act, Variant
    from mlx_bricks.tune.tuner import tune_op

    KINDS = kinds()
    who, n = sys.argv[1], int(sys.argv[2])
    cache = DecisionCache(sys.argv[3], Context("Test GPU", "arch", "0.32.4", "0.1.0", "k"))
    w = mx.random.normal((64, 64))
    args = {"x": Act((1, 16 if who == "a" else 200, 64), mx.float32), "weight": w}
    d = tune_op(KINDS["linear"], args, "reference", guard=Guard(), repeats=1,
                variants=[Variant("same", fn=lambda a, backend=None: KINDS["linear"].stock(a))])
    cache.put({d.key: d.to_dict()})
    for i in range(n):
        cache.put({f"reference|{who}{i}": {"winner": "stock", "ratio": None}})
""")


def test_two_processes_tuning_at_once_keep_both(tmp_path):
    path = tmp_path / "shared" / "decisions.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, who, "40", str(path)], env=env,
                              stderr=subprocess.PIPE, text=True) for who in ("a", "b")]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    data = json.loads(path.read_text())
    (entry,) = data["contexts"].values()
    keys = set(entry["decisions"])
    assert {f"reference|{w}{i}" for w in "ab" for i in range(40)} <= keys
    assert any("M<=32" in k for k in keys) and any("M<=512" in k for k in keys)
    assert len(keys) == 82
    assert [p.name for p in path.parent.iterdir()] == ["decisions.json", "decisions.json.lock"] \
        or sorted(p.name for p in path.parent.iterdir()) == ["decisions.json",
                                                            "decisions.json.lock"]


# ---------------------------------------------------------------------------------------------
# the CLI


def test_cli_show_and_clear(tmp_path, capsys):
    home = tmp_path / "home"
    c = DecisionCache()
    c.put({"metal|linear[N=1,K=1,bias=0,res=0] M<=32 float16 w=float":
           Decision("k", "64x64", {"tile": "64x64"}, 1.25).to_dict()})
    assert tune_cli.main(["--show", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cache"] == str(home / "tune" / "decisions.json")
    (d,) = out["decisions"]
    assert (d["winner"], d["ratio"]) == ("64x64", 1.25)
    assert tune_cli.main(["--show"]) == 0
    assert "64x64 (x1.25)" in capsys.readouterr().out
    assert tune_cli.main(["--clear"]) == 0
    assert "deleted" in capsys.readouterr().out and not c.path.exists()
    with pytest.raises(SystemExit) as e:
        tune_cli.main(["--show", "--clear"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == \
        "python -m mlx_bricks.tune: error: --show and --clear are exclusive"
    with pytest.raises(SystemExit) as e:
        tune_cli.main(["--m", "0"])
    assert e.value.code == 2


def test_cli_on_a_machine_without_a_kernel_backend(tmp_path, capsys):
    from mlx_bricks.backends import backend_status

    if backend_status("metal")[0] or backend_status("cuda")[0]:
        pytest.skip("this machine has a kernel backend")
    from tests.models import build_model

    model_dir = tmp_path / "tiny"
    model = build_model("llama", mx.float16, num_hidden_layers=1)
    model_dir.mkdir()
    from mlx.utils import tree_flatten

    mx.save_safetensors(str(model_dir / "model.safetensors"), dict(tree_flatten(
        model.parameters())))
    config = {"model_type": "llama", "vocab_size": 256, **{
        k: v for k, v in model.args.__dict__.items() if isinstance(v, (int, float, bool, str))}}
    (model_dir / "config.json").write_text(json.dumps(config))
    assert tune_cli.main([str(model_dir), "--json", "--m", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["decisions"] == [] and out["backend"] == "reference"
    assert out["note"] == ("nothing to tune: nothing patched: no kernel backend on this machine "
                           "(reference is the same math as stock)")
    assert not (tmp_path / "home" / "tune" / "decisions.json").exists()


def test_nn_quantize_model_is_not_in_the_way():
    """A quantized linear's stock is nn.QuantizedLinear's computation (for the quantized ops)."""
    layer = nn.Linear(128, 64)
    mx.eval(layer.parameters())
    q = nn.QuantizedLinear.from_linear(layer, group_size=64, bits=4)
    x = mx.random.normal((3, 128))
    w = QuantizedWeight.from_module(q)
    args = {"x": x, "weight": w, "bias": q.bias, "residual": None}
    assert mx.array_equal(KINDS["linear"].stock(args), q(x))
    assert KINDS["linear"].key(args).weights == "q4g64"
    assert KINDS["linear"].check(q(x), q(x), args).ok


@pytest.mark.parametrize("options", ({"window": 5}, {"softcap": 2.0}, {"window": 3, "softcap": 1.5}))
def test_attention_kind_window_and_softcap(options):
    """The attention kind carries window / softcap to the brick and to its stock (the brick's
    MLX-ops reference); the check's own reference applies them the same way."""
    _, _, all_args = _kind_args(mx.float16)
    args = dict(all_args["attention"], **options)
    k = KINDS["attention"]
    naive = k.stock(args)
    plain = k.stock(all_args["attention"])
    assert not mx.allclose(naive, plain, atol=1e-2)  # the options change the values
    assert k.check(naive, naive, args).ok
    assert k.check(k.brick(args, "reference"), naive, args).ok
    assert not k.check(plain, naive, args).ok
    key = str(k.key(args))
    assert all(f"{name}={value}" in key for name, value in options.items())


def test_kernel_source_hash_survives_a_spec_without_sources(monkeypatch):
    from mlx_bricks.tune import cache

    monkeypatch.setitem(kernels._SPECS, "no_files", kernels.KernelSpec(
        "no_files", body="missing.metal", input_names=("x",), output_names=("y",)))
    cache.kernel_source_hash.cache_clear()
    try:
        assert len(cache.kernel_source_hash()) == 12
    finally:
        cache.kernel_source_hash.cache_clear()
