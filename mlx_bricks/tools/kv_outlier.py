"""When not to use Q8_0 K: a synthetic outlier channel (a large constant k-bias, as qwen2's
k_proj bias puts on a few channels of K).

    python -m mlx_bricks.tools.kv_outlier [--out FILE]

Setup (float64 numpy, deterministic): head_dim 128, 1024 keys, 64 queries, q, k, v ~ N(0, 1),
scale 1/sqrt(128); channel 5 of every key gets ``+bias`` for bias in 0 .. 200. A constant
channel shifts every score of a query by the same ``q_5 * bias``, which softmax ignores, so in
exact arithmetic the bias changes nothing. Q8_0 quantizes K in blocks of 32 channels with one
scale ``amax / 127``: the outlier sets the scale of its block (channels 0-31), and the other 31
channels of that block lose precision in proportion to the bias. Reported per bias, Q8_0 K
(V full precision) against exact K:

* ``block_rel_err``: RMS error of the dequantized non-outlier channels of the outlier's block,
  relative to their RMS;
* ``score_err``: largest error of a score ``scale * q . k`` (natural-log units);
* ``weights_kld``: mean KL divergence of the softmax weights (exact || Q8_0), nats;
* ``out_rel_rms``: RMS error of the attention output relative to its RMS;
* the same three after *K smoothing* (subtract each channel's mean over the keys before
  quantizing, as SageAttention does; exact for softmax, since it shifts a query's scores by a
  constant), to show the remedy. Not implemented in the cache (future work).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BIASES = (0.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0)


def _q8_round_trip(x):
    import mlx.core as mx
    import numpy as np

    from mlx_bricks.bricks.q8_0.op import quantize_q8_0_reference

    qs, d = quantize_q8_0_reference(mx.array(x.astype(np.float32)))
    qs = np.array(qs).astype(np.float64)
    d = np.array(d.astype(mx.float32)).astype(np.float64)
    return (qs.reshape(*qs.shape[:-1], -1, 32) * d[..., None]).reshape(qs.shape)


def _attend(q, k, v, scale):
    import numpy as np

    s = q @ k.T * scale
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(axis=-1, keepdims=True)
    return p, p @ v


def measure(D: int = 128, n_keys: int = 1024, n_queries: int = 64, channel: int = 5,
            seed: int = 0) -> dict:
    """The table of the module docstring, as a dict."""
    import numpy as np

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_queries, D))
    k0 = rng.standard_normal((n_keys, D))
    v = rng.standard_normal((n_keys, D))
    scale = D ** -0.5
    block = slice(channel // 32 * 32, channel // 32 * 32 + 32)
    others = [c for c in range(block.start, block.stop) if c != channel]
    rows = []
    for bias in BIASES:
        k = k0.copy()
        k[:, channel] += bias
        p_ref, o_ref = _attend(q, k, v, scale)
        row = {"bias": bias}
        for name, kk in (("", k), ("smoothed_", k - k.mean(axis=0, keepdims=True))):
            kq = _q8_round_trip(kk)
            p, o = _attend(q, kq, v, scale)
            s_err = np.abs((q @ (kq - kk).T) * scale).max()
            kld = np.sum(p_ref * (np.log(p_ref) - np.log(p)), axis=-1).mean()
            rel = np.sqrt(np.mean((o - o_ref) ** 2) / np.mean(o_ref ** 2))
            if not name:
                row["block_rel_err"] = float(np.sqrt(np.mean((kq - kk)[:, others] ** 2) /
                                                     np.mean(kk[:, others] ** 2)))
            row[f"{name}score_err"] = float(s_err)
            row[f"{name}weights_kld"] = float(kld)
            row[f"{name}out_rel_rms"] = float(rel)
        rows.append(row)
    return {"what": "Q8_0 K with a constant outlier channel (synthetic k-bias)",
            "head_dim": D, "keys": n_keys, "queries": n_queries, "outlier_channel": channel,
            "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlx_bricks.tools.kv_outlier",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the JSON here too")
    args = p.parse_args(argv)
    result = measure()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
