"""One rank of the tensor-parallel prefill check: a llama sharded with mlx-lm's ``shard()``,
stock vs ``patch_model`` on the same sharded weights, in one process per rank (issue 18).

Every rank builds the same random model (seeded), shards it over the group, and keeps three
instances on the same sharded arrays: stock, patched, and a float32 copy as the reference of
the correctness check. One forward is a full prefill of ``M`` tokens with a fresh ``KVCache``.
Correctness: the patched logits (every position) against the float32 reference with the
dtype-scaled rule (``mlx_bricks.tune.check.dtype_close``: at most 2x stock's error + 4 ulps),
the largest ``|patched - stock|`` logit, and the greedy (argmax) token of the last position.
Timing: ``tune.timing.time_interleaved`` with one call per evaluation (every rank then issues
the same collectives in the same order; a rank's time includes waiting for the others, i.e. the
step time of the group); the group's time of each side is the slowest rank's median.

``tests/test_shard_gpu.py`` launches the ranks on 2 GPUs (``tests.shard_gpu_worker``);
docs/sharding.md.
"""
from __future__ import annotations

import os
import time

from mlx_bricks.bench.e2e import LLAMA_8B_4LAYER, LlamaShape, mx_dtype

#: A tiny shape for the CPU run of the same code (ring backend, reference bricks).
TINY = LlamaShape(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, head_dim=64,
                  vocab=512)
SHAPES = {"llama8b_4layer": LLAMA_8B_4LAYER, "tiny": TINY}
DTYPES = ("bf16", "fp16", "fp32")


def build_sharded(shape: LlamaShape, dtype: str, group, *, seed: int = 0):
    """``(stock, patched-to-be, reference float32)`` llama instances sharded over ``group``,
    the first two on the same arrays (mlx-lm's ``Model.shard``). Weights are drawn on every
    rank from the same seed, so the ranks shard one model."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.models.llama import Model

    mx.random.seed(seed)
    stock = Model(shape.model_args())
    stock.set_dtype(mx_dtype(dtype))
    stock.shard(group)
    mx.eval(stock.parameters())

    def twin(cast):
        m = Model(shape.model_args())
        m.shard(group)  # its own (never evaluated) init is replaced below
        m.update(tree_map(cast, stock.parameters()))
        return m

    patched = twin(lambda a: a)
    ref = twin(lambda a: a.astype(mx.float32))
    mx.eval(ref.parameters())
    return stock, patched, ref


def run_rank(*, shape_name: str = "llama8b_4layer", dtype: str = "bf16", M: int = 2048,
             backend: str | None = "cuda", tune: str = "auto", repeats: int = 10,
             dist_backend: str = "any", group=None, expect_size: int | None = None) -> dict:
    """Run the check on this rank and return its results (module docstring).

    Args:
        shape_name: ``"llama8b_4layer"`` or ``"tiny"`` (:data:`SHAPES`).
        dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"``: the model's dtype.
        M: prompt tokens (one prefill chunk with a fresh cache).
        backend, tune: ``patch_model``'s arguments.
        repeats: timing rounds (each one call of each side, interleaved).
        dist_backend: ``mx.distributed.init(strict=True, backend=...)`` when ``group`` is None.
        group: the ``mx.distributed.Group`` to shard over (None: initialise one).
        expect_size: the number of ranks the group must have (None: any).

    Raises:
        ValueError: unknown shape or dtype; ``M`` < 2.
        RuntimeError: no distributed group could be formed (MLX's error), or it has another
            size than ``expect_size``.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_bricks.patch import patch_model
    from mlx_bricks.tune.check import EPS, dtype_close
    from mlx_bricks.tune.timing import time_interleaved

    if shape_name not in SHAPES:
        raise ValueError(f"shape_name must be one of {sorted(SHAPES)}, got {shape_name!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if isinstance(M, bool) or not isinstance(M, int) or M < 2:
        raise ValueError(f"M must be an int >= 2 (a prefill), got {M!r}")
    shape = SHAPES[shape_name]
    if group is None:
        group = mx.distributed.init(strict=True, backend=dist_backend)
    if expect_size is not None and group.size() != expect_size:
        raise RuntimeError(f"the {dist_backend!r} group has {group.size()} ranks, expected "
                           f"{expect_size} (was the process started by a launcher?)")
    t0 = time.perf_counter()
    stock, patched, ref = build_sharded(shape, dtype, group)
    build_s = time.perf_counter() - t0
    report = patch_model(patched, backend=backend, tune=tune)
    toks = mx.random.randint(0, shape.vocab, (1, M), key=mx.random.key(M))

    def forward(model, last_only=True):
        out = model(toks, cache=make_prompt_cache(model))
        return out[:, -1, :] if last_only else out

    # Correctness (the patched side's first call also takes its tuning decisions).
    t0 = time.perf_counter()
    got = forward(patched, last_only=False)
    mx.eval(got)
    first_call_s = time.perf_counter() - t0
    naive = forward(stock, last_only=False)
    mx.eval(naive)
    ref_logits = forward(ref, last_only=False)
    mx.eval(ref_logits)
    close = dtype_close(got, ref_logits, naive, dtype=mx_dtype(dtype))
    diff = mx.abs(got.astype(mx.float32) - naive.astype(mx.float32))
    greedy_p = int(mx.argmax(got[0, -1]).item())
    greedy_s = int(mx.argmax(naive[0, -1]).item())
    argmax_agree = float(mx.mean(mx.argmax(got[0], -1) == mx.argmax(naive[0], -1)).item())
    logit_scale = float(mx.abs(naive.astype(mx.float32)).max().item())
    # A different greedy token is accepted only as a rounding tie: the float32 reference
    # prefers neither by more than stock's own error there (x2 + 4 ulps), as the tests do.
    last_ref = ref_logits[0, -1].astype(mx.float32)
    margin = abs(last_ref[greedy_s].item() - last_ref[greedy_p].item())
    tie_budget = (2 * mx.abs(naive[0, -1].astype(mx.float32) - last_ref).max().item()
                  + 4 * EPS[mx_dtype(dtype)] * max(1.0, mx.abs(last_ref).max().item()))
    greedy_ok = greedy_p == greedy_s or margin <= tie_budget
    del got, naive, ref_logits, ref

    timing = time_interleaved({"stock": lambda: forward(stock),
                               "patched": lambda: forward(patched)},
                              repeats=repeats, min_calls=1, max_calls=1)
    med = mx.array([timing.median("stock"), timing.median("patched")], dtype=mx.float32)
    per_rank = mx.distributed.all_gather(med[None], group=group)  # (size, 2), rank order
    mx.eval(per_rank)
    per_rank = per_rank.tolist()
    group_stock = max(r[0] for r in per_rank)
    group_patched = max(r[1] for r in per_rank)
    attn = patched.layers[0].self_attn
    mlp = patched.layers[0].mlp
    return {
        "rank": group.rank(), "size": group.size(),
        "model": {"shape": shape.__dict__, "shape_name": shape_name, "dtype": dtype, "M": M,
                  "local": {"n_heads": attn.n_heads, "n_kv_heads": attn.n_kv_heads,
                            "q_proj": list(attn.q_proj.weight.shape),
                            "o_proj": list(attn.o_proj.weight.shape),
                            "gate_proj": list(mlp.gate_proj.weight.shape),
                            "down_proj": list(mlp.down_proj.weight.shape)}},
        "patch": {"backend": report.backend.name, "tune": tune, "n_patched": report.n_patched,
                  "n_fallback": report.n_fallback,
                  "fallbacks": [f"layer {m.layer} {m.module}: {m.reason}"
                                for m in report.fallbacks],
                  "calls": dict(report.calls()), "stock_calls": dict(report.stock_calls()),
                  "tuned_stock_calls": dict(report.tuned_stock_calls())},
        "tuning": report.tuning(),
        "correct": {"ok": bool(close.ok and greedy_ok), "rule_ok": bool(close.ok),
                    "greedy_ok": bool(greedy_ok), "greedy_ref_margin": margin,
                    "greedy_tie_budget": tie_budget,
                    "error_vs_fp32": float(close.error), "budget": float(close.budget),
                    "stock_error_vs_fp32": float(close.naive_error),
                    "max_abs_patched_vs_stock": float(diff.max().item()),
                    "max_abs_stock_logit": logit_scale,
                    "greedy_patched": greedy_p, "greedy_stock": greedy_s,
                    "argmax_agreement_all_positions": argmax_agree},
        "timing": {"repeats": repeats, "stock_s_rank": timing.median("stock"),
                   "patched_s_rank": timing.median("patched"), "per_rank_s": per_rank,
                   "group_stock_s": group_stock, "group_patched_s": group_patched,
                   "speedup": group_stock / group_patched,
                   "runs": timing.runs},
        "build_s": build_s, "first_patched_call_s": first_call_s,
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "CUDA_VISIBLE_DEVICES",
                                               "MLX_RANK", "MLX_WORLD_SIZE")},
        "mlx": mx.__version__,
    }
