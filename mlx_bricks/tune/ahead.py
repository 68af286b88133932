"""Measuring a patched model's decisions before it serves: the prefills that take them.

``python -m mlx_bricks.tune MODEL`` and the server (right after loading, before its first
request) run one prefill of random tokens per chunk size: every piece's decision for those shape
buckets is then taken (from the cache, or measured, with the tuner's progress bar) and written
to the decision cache, so the requests and later processes only read it.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.tune.buckets import DEFAULT_M


def measure_ahead(model, report, ms=DEFAULT_M, vocab_size: int = 2) -> list[dict]:
    """Run one prefill of ``M`` random token ids per ``M`` in ``ms`` through the patched
    ``model`` (a fresh mlx-lm prompt cache each; the attention pieces see q_len = kv_len = M).

    Args:
        model: a model patched by ``patch_model`` with ``report``.
        report: its ``PatchReport`` (nothing is run when tuning does not apply to it).
        ms: chunk sizes (tokens), each > 0.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.

    Returns:
        The decisions taken so far (``report.tuning()["decisions"]``).
    """
    from mlx_lm.models.cache import make_prompt_cache

    if not report.tuning()["applies"]:
        return []
    for M in ms:
        tokens = mx.random.randint(0, max(2, int(vocab_size)), (1, int(M)),
                                   key=mx.random.key(int(M)))
        mx.eval(model(tokens, cache=make_prompt_cache(model)))
    return report.tuning()["decisions"]
