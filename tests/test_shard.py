"""Tensor-parallel (sharded) mlx-lm models under the patch (issue 18; docs/sharding.md).

The main test starts two ranks of MLX's ``ring`` backend over loopback on this machine
(``tests.launch``; the rank side is ``tests/shard_worker.py``): tiny random llama and
qwen3 models sharded with mlx-lm's own ``Model.shard()``, stock vs patched on the reference
backend (named), fused block and unfused modules, with and without biases, float32 and
bfloat16. The in-process tests use the singleton group (size 1: ``all_sum`` is the identity),
which exercises the same code paths without a second process.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.nn.layers.distributed import shard_linear

from tests.launch import launch_local, rank_envs
from mlx_bricks.nn import DECODE
from mlx_bricks.patch import patch_model
from tests.models import build_model, tokens
from tests.support import require_backend
from tests.tolerance import assert_dtype_close

ROOT = Path(__file__).resolve().parents[1]
RANKS = 2
BRICK_CALLS = {"block": ("rms_norm_qkv", "flash_attention", "linear", "swiglu_mlp"),
               "self_attn": ("linear", "flash_attention"), "mlp": ("swiglu_mlp",)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The per-rank JSON of ``tests.shard_worker`` run as 2 ring ranks (skip with the reason
    when the ring backend is unavailable or the ranks cannot connect)."""
    if not mx.distributed.is_available("ring"):
        pytest.skip("MLX's ring distributed backend is not available in this build")
    out = tmp_path_factory.mktemp("shard")
    results = launch_local([sys.executable, "-m", "tests.shard_worker", str(out)], RANKS,
                           "ring", timeout=180, cwd=ROOT)
    init_errors = sorted(out.glob("rank*-init.json"))
    if init_errors:
        pytest.skip("ring backend over loopback unavailable here: "
                    + json.loads(init_errors[0].read_text())["init_error"])
    for r in results:
        assert r.returncode == 0, (f"rank {r.rank} exited with {r.returncode}:\n"
                                   f"{r.stderr[-4000:]}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def _cases(two_ranks):
    return [(rank, case) for rank in two_ranks for case in rank["cases"]]


def test_two_ranks_form_a_group(two_ranks):
    assert [r["rank"] for r in two_ranks] == list(range(RANKS))
    assert all(r["size"] == RANKS and r["all_sum_check"] == RANKS for r in two_ranks)


def test_sharded_patched_logits_and_tokens_match_stock(two_ranks):
    for rank, c in _cases(two_ranks):
        what = f"rank {rank['rank']} {c['name']}"
        assert c["logits_ok"], (f"{what}: patched error {c['error']:.3g} vs float64 exceeds "
                                f"budget {c['budget']:.3g} (stock's {c['naive_error']:.3g})")
        if c["dtype"] == "float32":  # the reference backend: same math as stock in float32
            assert c["max_abs_patched_vs_stock"] <= 1e-4, what
        tie = c["tie"]
        assert c["patched_tokens"] == c["stock_tokens"] or tie["tie"], (
            f"{what}: greedy token {tie['first_diff']} differs from stock where float64 prefers "
            f"one by {tie.get('margin')} > {tie.get('budget')}")


def test_ranks_agree_after_the_reductions(two_ranks):
    """Every rank ends with the same logits (the row-sharded layers all-sum the partials)."""
    by_name = [{c["name"]: c["patched_sha"] for c in r["cases"]} for r in two_ranks]
    assert by_name[0] == by_name[1]


def test_sharded_modules_run_the_bricks(two_ranks):
    for rank, c in _cases(two_ranks):
        s = c["shapes"]
        prefix = "Quantized" if "-q4" in c["name"] else ""
        assert s["classes"] == [f"{prefix}AllToShardedLinear", f"{prefix}ShardedToAllLinear"], \
            c["name"]
        for m in c["modules"]:
            what = f"rank {rank['rank']} {c['name']} layer {m['layer']} {m['module']}"
            assert m["status"] == "patched", f"{what}: {m['reason']}"
            assert m["module"] == ("block" if c["fuse_block"] else m["module"])
            for brick in BRICK_CALLS[m["module"]]:
                assert m["calls"].get(brick, 0) > 0, f"{what}: {brick} never ran"
            assert set(m["stock_calls"]) <= {DECODE}, f"{what}: {m['stock_calls']}"


def test_tuner_keys_use_the_per_rank_shapes(two_ranks):
    """Decision keys carry each rank's local weight shapes and head counts (half the model's
    q/gate rows, half the o/down columns), not the unsharded ones."""
    for rank, c in _cases(two_ranks):
        s = c["shapes"]
        if "-q4" in c["name"]:  # packed weights: the shapes below are the float ones'
            assert all(k.endswith("w=q4g32") for k in c["keys"] if "attention[" not in k)
            continue
        n_q, hidden = s["q_proj_full"]
        inter = s["gate_proj_full"][0]
        assert s["q_proj"] == [n_q // RANKS, hidden] and s["gate_proj"] == [inter // RANKS, hidden]
        assert s["o_proj"] == [hidden, n_q // RANKS]
        keys = "\n".join(c["keys"])
        head_dim = n_q // (s["n_heads"] * RANKS)
        assert f"swiglu_mlp[K={hidden},N={inter // RANKS}," in keys, keys
        assert f"N={inter}," not in keys, keys
        # the out-projection: the local partial product (no bias, no residual in the brick)
        assert f"linear[N={hidden},K={n_q // RANKS},bias=0,res=0]" in keys, keys
        assert f"linear[N={hidden},K={n_q}," not in keys, keys
        if c["fuse_block"]:
            heads = f"heads={s['n_heads']}/{s['n_kv_heads']}x{head_dim}"
            assert f"rms_norm_qkv[K={hidden},{heads}," in keys, keys


# ---------------------------------------------------------------------------------------------
# in process: the singleton group (size 1)
# ---------------------------------------------------------------------------------------------

def _sharded(arch, **overrides):
    model = build_model(arch, mx.float32, **overrides)
    model.shard(mx.distributed.init())
    return model


@pytest.mark.parametrize("fuse_block", (True, False))
def test_singleton_group_sharded_model_matches_stock(fuse_block):
    model = _sharded("llama", attention_bias=True, mlp_bias=True)
    toks = tokens(9)
    stock = model(toks)
    report = patch_model(model, backend="reference", fuse_block=fuse_block)
    patched = model(toks)
    assert mx.abs(patched - stock).max().item() <= 1e-4
    assert report.n_fallback == 0 and report.n_patched > 0
    assert all(sum(m.calls.values()) > 0 for m in report.modules)


@pytest.mark.parametrize("fuse_block", (True, False))
def test_singleton_group_sharded_model_on_msl(fuse_block):
    """The MSL kernels (emulator) on a sharded model: the first-call guard compares each
    row-sharded piece's partial product with stock's (no bias, no residual) and keeps the
    bricks; logits within the dtype-scaled rule of float64."""
    require_backend("emulator")
    model = _sharded("llama", num_hidden_layers=1, attention_bias=True, mlp_bias=True)
    ref = build_model("llama", mx.float64, num_hidden_layers=1, attention_bias=True,
                      mlp_bias=True)
    toks = tokens(7)
    with mx.stream(mx.cpu):
        want = ref(toks)
        mx.eval(want)
    stock = model(toks)
    report = patch_model(model, backend="emulator", fuse_block=fuse_block)
    got = model(toks)
    assert_dtype_close(got, want, stock, dtype=mx.float32, what=f"fuse_block={fuse_block}")
    assert report.stock_calls() == {} and report.tuning()["disabled"] == []
    for m in report.modules:
        assert m.status == "patched" and all(m.calls.get(b, 0) > 0 for b in m.bricks), m


@pytest.mark.parametrize("fuse_block", (True, False))
def test_quantized_sharded_linears_run_the_quantized_bricks(fuse_block):
    """``nn.quantize`` then ``shard()``: the quantized tensor-parallel linears feed the bricks
    as ``QuantizedWeight`` (reference backend: the same products as stock)."""
    model = build_model("llama", mx.float32, attention_bias=True, mlp_bias=True)
    nn.quantize(model, group_size=64, bits=4)
    model.shard(mx.distributed.init())
    attn = model.layers[0].self_attn
    assert type(attn.q_proj).__name__ == "QuantizedAllToShardedLinear"
    assert type(attn.o_proj).__name__ == "QuantizedShardedToAllLinear"
    toks = tokens(9)
    stock = model(toks)
    report = patch_model(model, backend="reference", fuse_block=fuse_block)
    patched = model(toks)
    assert mx.abs(patched - stock).max().item() <= 1e-4 * max(1.0, mx.abs(stock).max().item())
    assert report.n_fallback == 0 and report.n_patched > 0
    assert all(sum(m.calls.values()) > 0 for m in report.modules)
    assert report.stock_calls() == {}


def test_sharding_other_than_mlx_lms_is_left_stock():
    """A row-sharded input projection (or a column-sharded output one) is not mlx-lm's layout:
    attention and MLP stay stock with the reason."""
    model = build_model("llama", mx.float32)
    group = mx.distributed.init()
    layer = model.layers[0]
    layer.self_attn.q_proj = shard_linear(layer.self_attn.q_proj, "sharded-to-all", group=group)
    layer.mlp.down_proj = shard_linear(layer.mlp.down_proj, "all-to-sharded", group=group)
    report = patch_model(model, backend="reference")
    layer0 = {m.module: m for m in report.modules if m.layer == 0}
    assert "q_proj is ShardedToAllLinear (row-sharded)" in layer0["self_attn"].reason
    assert "down_proj is AllToShardedLinear (column-sharded)" in layer0["mlp"].reason
    assert all(m.status == "patched" for m in report.modules if m.layer != 0)


def test_call_time_structure_check_sees_a_resharded_layer():
    model = _sharded("llama")
    patch_model(model, backend="reference", fuse_block=False)
    attn = model.layers[1].self_attn
    attn.o_proj = shard_linear(nn.Linear(*reversed(attn.o_proj.weight.shape), bias=False),
                               "all-to-sharded", group=mx.distributed.init())
    model(tokens(4))
    assert any("o_proj is AllToShardedLinear (column-sharded)" in r
               for r in attn._bricks_state.stock), attn._bricks_state.stock


def test_gpu_check_rank_side_runs_tiny_on_the_ring(two_ranks):
    """``tests/test_shard_gpu.py``'s rank side (``mlx_bricks.bench.shard.run_rank``), tiny,
    reference bricks: correct, every layer patched and used, per-rank shapes, both ranks'
    timings gathered."""
    for rank in two_ranks:
        b = rank["bench"]
        assert b["correct"]["ok"], b["correct"]
        assert b["patch"]["n_patched"] == b["model"]["shape"]["layers"]
        assert b["patch"]["n_fallback"] == 0 and b["patch"]["stock_calls"] == {}
        assert set(b["patch"]["calls"]) == set(BRICK_CALLS["block"])
        shape, local = b["model"]["shape"], b["model"]["local"]
        assert local["n_heads"] == shape["heads"] // RANKS
        assert local["gate_proj"] == [shape["intermediate"] // RANKS, shape["hidden"]]
        assert local["down_proj"] == [shape["hidden"], shape["intermediate"] // RANKS]
        assert len(b["timing"]["per_rank_s"]) == RANKS
    assert two_ranks[0]["bench"]["timing"]["per_rank_s"] == \
        two_ranks[1]["bench"]["timing"]["per_rank_s"]


# ---------------------------------------------------------------------------------------------
# the local launcher
# ---------------------------------------------------------------------------------------------

def test_launcher_environments(tmp_path):
    ring = rank_envs(2, "ring", tmp_path)
    assert [e["MLX_RANK"] for e in ring] == ["0", "1"]
    hosts = json.loads(Path(ring[0]["MLX_HOSTFILE"]).read_text())
    assert len(hosts) == 2 and all(h[0].startswith("127.0.0.1:") for h in hosts)
    nccl = rank_envs(2, "nccl", tmp_path)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in nccl] == ["0", "1"]
    assert all(e["NCCL_NVLS_ENABLE"] == "0" and e["MLX_WORLD_SIZE"] == "2" for e in nccl)
    assert nccl[0]["NCCL_PORT"] == nccl[1]["NCCL_PORT"]
    with pytest.raises(ValueError, match="backend"):
        rank_envs(2, "mpi", tmp_path)


def test_launcher_stops_the_others_when_a_rank_fails():
    """A failed rank's peers would wait for it in a collective: they are killed after the
    grace period, not at the timeout."""
    code = ("import os, sys, time\n"
            "sys.exit(3) if os.environ['MLX_RANK'] == '0' else time.sleep(60)")
    results = launch_local([sys.executable, "-c", code], 2, "ring", timeout=50, grace=0.5)
    assert [(r.rank, r.returncode) for r in results] == [(0, 3), (1, None)]
