"""The first-call guard's check costs a few rows, not a second call (``runtime/guard.py``).

* ``OpKind.check_stock``: stock on the rows :meth:`OpKind.tail` reads equals those rows of the
  whole stock call (the GEMM family's last rows, the MoE's last tokens, attention's last
  queries under a causal mask with more keys than queries);
* ``GatedDelta.check_call``: the recurrence on the call's first tokens is the whole call's
  output there (causality), so the guard checks that prefix;
* the guard still disables a variant whose output is wrong where it checks, runs stock on the
  checked rows or prefix only, and returns the whole call's output of a passing variant.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks.bricks import kinds
from mlx_bricks.bricks.gated_delta.kind import CHECK_TOKENS, GATED_DELTA
from mlx_bricks.runtime.guard import Guard
from mlx_bricks.runtime.kind import Act, Variant, check_rows
from tests.quant_support import randn, weight

KINDS = kinds()


def _close(a, b, tol=1e-5):
    np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("fmt", [None, (4, 64)])
def test_linear_and_swiglu_check_stock_is_the_tail_of_stock(fmt):
    x = randn((2, 37, 128), mx.float32, 1)
    res = randn((2, 37, 96), mx.float32, 2)
    lin = {"x": x, "weight": weight(96, 128, fmt, mx.float32, 3), "residual": res}
    k = KINDS["linear"]
    rows = check_rows(k.n_rows(lin))
    _close(k.tail(k.check_stock(lin), rows), k.tail(k.stock(lin), rows))
    mlp = {"x": x, "w_gate": weight(64, 128, fmt, mx.float32, 4),
           "w_up": weight(64, 128, fmt, mx.float32, 5), "w_down": weight(128, 64, fmt,
                                                                           mx.float32, 6)}
    k = KINDS["swiglu_mlp"]
    mlp = {n: mlp[n] for n in mlp}
    _close(k.tail(k.check_stock(mlp), rows), k.tail(k.stock(mlp), rows))
    assert k.check_stock(mlp).reshape(-1, 128).shape[0] == rows  # rows only, not 74


def test_moe_check_stock_is_the_tail_of_stock():
    k = KINDS["moe_mlp"]
    E, D, N, top = 4, 64, 32, 2
    x = randn((1, 13, D), mx.float32, 1)
    idx = mx.random.randint(0, E, (1, 13, top), key=mx.random.key(2)).astype(mx.uint32)
    args = {"x": x, "indices": idx, "w_gate": randn((E, N, D), mx.float32, 3),
            "w_up": randn((E, N, D), mx.float32, 4), "w_down": randn((E, D, N), mx.float32, 5)}
    rows = check_rows(k.n_rows(args))
    _close(k.tail(k.check_stock(args), rows), k.tail(k.stock(args), rows))


@pytest.mark.parametrize("mask", [None, "causal"])
def test_attention_check_stock_is_the_tail_of_stock(mask):
    k = KINDS["attention"]
    q = randn((1, 4, 20, 64), mx.float32, 1)
    kv = [randn((1, 2, 50, 64), mx.float32, s) for s in (2, 3)]
    args = {"q": q, "k": kv[0], "v": kv[1], "scale": 0.125, "mask": mask}
    rows = check_rows(k.n_rows(args))
    _close(k.tail(k.check_stock(args), rows), k.tail(k.stock(args), rows))


def _gdn_args(T, seed=0):
    shapes = {"q": Act((1, T, 2, 32), mx.float32), "k": Act((1, T, 2, 32), mx.float32),
              "v": Act((1, T, 4, 32), mx.float32), "g": Act((1, T, 4), mx.float32),
              "beta": Act((1, T, 4), mx.float32), "state": Act((1, 4, 32, 32), mx.float32)}
    return GATED_DELTA.synthetic(shapes, seed)


def test_gated_delta_check_call_is_a_prefix_of_the_call():
    args = _gdn_args(CHECK_TOKENS + 70)
    small = GATED_DELTA.check_call(args)
    assert small["q"].shape[1] == CHECK_TOKENS and small["state"] is args["state"]
    y, _ = GATED_DELTA.stock(args)
    ys, _ = GATED_DELTA.stock(small)
    _close(ys, y[:, :CHECK_TOKENS], 1e-4)
    short = _gdn_args(CHECK_TOKENS)
    assert GATED_DELTA.check_call(short) is short


def test_guard_checks_a_prefix_and_stock_only_runs_there(monkeypatch):
    """A correct variant passes and its whole output is returned; stock ran on the prefix only;
    a variant wrong in the last token of the prefix is disabled (stock's output comes back)."""
    args = _gdn_args(CHECK_TOKENS + 70, seed=1)
    seen = []
    stock = GATED_DELTA.stock

    def spy(a):
        seen.append(a["q"].shape[1])
        return stock(a)

    monkeypatch.setattr(GATED_DELTA, "stock", spy)
    key = GATED_DELTA.key(args)
    guard = Guard()
    good = Variant("good", {}, lambda a, backend: stock(a), builds=False)
    out, reason = guard.run(GATED_DELTA, good, args, "reference", key, lambda: stock(args))
    assert reason is None
    assert seen == [CHECK_TOKENS]  # stock ran on the prefix, not on the whole call
    _close(out[0], stock(args)[0], 1e-5)
    assert out[0].shape[1] == CHECK_TOKENS + 70

    def wrong(a, backend):
        y, s = stock(a)
        return y.at[:, -1].add(1.0), s  # where the check reads: the last rows checked

    bad = Variant("bad", {}, wrong, builds=False)
    out, reason = guard.run(GATED_DELTA, bad, args, "reference", key, lambda: stock(args))
    assert reason is not None and "first output disagrees" in reason
    assert guard.disabled_reason("reference", GATED_DELTA.name, "bad", key.scope) == reason
    _close(out[0], stock(args)[0], 1e-6)


def test_guard_on_a_gemm_catches_wrong_last_rows():
    k = KINDS["linear"]
    args = {"x": randn((1, 300, 64), mx.float32, 1), "weight": weight(48, 64, None,
                                                                          mx.float32, 2)}
    key = k.key(args)
    bad = Variant("bad", {}, lambda a, backend: k.stock(a) * 1.01, builds=False)
    out, reason = Guard().run(k, bad, args, "reference", key, lambda: k.stock(args))
    assert reason is not None and "first output disagrees" in reason
    _close(out, k.stock(args))
