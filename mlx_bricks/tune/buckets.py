"""Shape buckets of the tuner's decisions: one decision serves every shape in its bucket.

A decision is keyed by op kind, the op's fixed shape parameters (N and K of a linear layer, the
head layout of attention), a bucket of the sizes that vary with the prompt (M = batch x tokens of
a prefill chunk; the q and kv lengths of attention), the dtype and the weight format
(``mlx_bricks.formats.formats_key``). The edges
follow how GEMM and attention kernels change regime: below 32 rows a 64-row tile is mostly
padding, up to about 512 rows there are too few tiles to fill a GPU, past 2048 every tile
variant is compute-bound.
"""
from __future__ import annotations

#: Upper edges of the M buckets (rows of a GEMM: batch x tokens of one prefill chunk).
M_EDGES = (32, 128, 512, 2048)
#: One prefill chunk size per M bucket (the last one above 2048): what tuning ahead runs.
DEFAULT_M = (32, 128, 512, 2048, 4096)
#: Upper edges of the kv-length buckets of attention (keys visible to a prefill chunk).
KV_EDGES = (32, 128, 512, 2048, 8192)


def _bucket(n: int, edges: tuple[int, ...], what: str) -> str:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{what} must be a positive int, got {n!r}")
    for edge in edges:
        if n <= edge:
            return f"{what}<={edge}"
    return f"{what}>{edges[-1]}"


def m_bucket(M: int) -> str:
    """``"M<=32"``, ``"M<=128"``, ``"M<=512"``, ``"M<=2048"`` or ``"M>2048"``.

    Raises:
        ValueError: ``M`` is not a positive int.
    """
    return _bucket(M, M_EDGES, "M")


def attention_bucket(q_len: int, kv_len: int) -> str:
    """``"q<=512,kv<=2048"``: the q-length bucket (M edges) and the kv-length bucket
    (:data:`KV_EDGES`) of a prefill chunk of ``q_len`` queries seeing ``kv_len`` keys.

    Raises:
        ValueError: a length that is not a positive int.
    """
    return f"{_bucket(q_len, M_EDGES, 'q')},{_bucket(kv_len, KV_EDGES, 'kv')}"
