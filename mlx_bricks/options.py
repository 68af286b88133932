"""The values of ``patch_model``'s options, without importing MLX.

The library checks its arguments against these tuples and every command line takes its choices
from them (``mlx_bricks.entry.flags``), as do the environment variables (``mlx_bricks.env``),
so ``--help`` lists what the library accepts and the three cannot drift.
"""
from __future__ import annotations

import math
import numbers

#: ``patch_model(backend=...)``, ``--backend``, ``MLX_BRICKS_BACKEND``: the backends
#: (``mlx_bricks.backends``).
BACKENDS = ("metal", "cuda", "emulator", "reference")
#: ``patch_model(mlp_variant=...)``, ``MLX_BRICKS_SWIGLU_VARIANT``: the SwiGLU brick's variants,
#: in the order the docs describe them (``bricks/swiglu/variants.py``).
SWIGLU_VARIANTS = ("fused", "split")

#: ``patch_model(tune=...)``: cached decisions and measure the missing ones at first use;
#: cached decisions and the prior for the missing ones, never measuring (what one-shot commands
#: use: no tuning before the first token); measure again; or the bricks' own rules unmeasured
#: (docs/tuning.md).
TUNE_MODES = ("auto", "cached", "force", "off")
#: ``patch_model(kv_cache=...)`` and ``make_prompt_cache(model, kv)``: mlx-lm's own cache
#: (whatever its float dtype: the name says "not quantized"), or the Q8_0 cache.
KV_CACHES = ("fp16", "q8_0")
#: Older spellings a command line still accepts, and what they mean.
KV_ALIASES = {"none": "fp16"}


def kv_cache_choice(text: str) -> str:
    """argparse ``type=`` of a KV flag: ``text`` with :data:`KV_ALIASES` applied (argparse then
    checks the result against :data:`KV_CACHES`, the ``choices``)."""
    return KV_ALIASES.get(text, text)


MIB = 1 << 20
#: The dispatch setting (``Dispatch(common=...)``) that carries the dequantize cap, in bytes.
CAP_SETTING = "dequant_cap"
#: ``patch_model(dequant_cap=...)``, ``MLX_BRICKS_DEQUANT_CAP``: the largest cap when neither
#: sets one, MiB (``bricks/dequantize/composite.py``: a model gets the smaller of this and
#: 1/:data:`DEFAULT_CAP_FRACTION` of its weights).
DEFAULT_CAP_MIB = 256
#: Without an explicit cap, the transient float weights are also kept to this fraction of the
#: model's own weight bytes (at least 1 MiB): a user feels memory relative to the model. A
#: 4-layer hidden-512 4-bit model on the CPU peaked 1.12x stock with whole weights dequantized
#: at once (0.126 vs 0.113 GB, 2026-12-05) and 0.99x with 2 MiB tiles, at the same speed.
DEFAULT_CAP_FRACTION = 32
#: The dispatch setting that marks the cap as the user's (``patch_model(dequant_cap=...)`` or
#: ``MLX_BRICKS_DEQUANT_CAP``): True keeps it strict; False (a default cap) lets
#: :func:`call_cap` raise it per call on :data:`QUEUED_BACKENDS`. Absent: strict.
CAP_STRICT_SETTING = "dequant_cap_strict"
#: Backends whose device runs behind the host: every buffer a queued command uses stays alive
#: until the command has run (unbounded, a whole forward's dequantized tiles were alive at once:
#: H200, 2026-12-04, 1.5-2.9 GB above stock with a 256 MiB cap; docs/bench.md), so the tiles
#: are bounded while queued (``InFlight`` in ``bricks/dequantize/composite.py``), and each
#: bound is a wait of the host on the device.
QUEUED_BACKENDS = ("cuda", "metal")


def call_cap(cap: int, strict: bool, backend: str, out_bytes: int) -> int:
    """The cap of one call in bytes: ``cap``, or, where the cap is a default (``strict``
    False) and ``backend`` queues (:data:`QUEUED_BACKENDS`), at least ``out_bytes``, the
    bytes the call's products write: a transient weight tile no larger than the products the
    call allocates anyway (the tiles' outputs and their concatenation come on top), while
    tiles under a model-sized cap cost a host wait each: on an H100 a 2,048-row LFM2 MLP (12.4 MiB default cap, 4-bit)
    ran its dequantize-then-GEMM composite in 0.80-0.87 ms tiled against 0.34 ms with whole
    weights and stock's 1.11 ms (bench/results/2026-12-07-h100-session9.md). The CPU keeps the
    cap: its tiles run in order with no wait, and whole weights there cost memory, no time.
    """
    if strict or backend not in QUEUED_BACKENDS:
        return cap
    return max(cap, int(out_bytes))


def parse_cap(value, name: str) -> int:
    """A dequantize cap of ``value`` MiB (a number, or its text) in bytes (at least 1).

    Raises:
        TypeError: ``value`` is neither a number nor a str (``name`` in the message).
        ValueError: not a number, not finite, or zero or below.
    """
    what = f"{name} must be a number of MiB above 0"
    if isinstance(value, str):
        try:
            mib = float(value.strip())
        except ValueError:
            raise ValueError(f"{what}, got {value!r}") from None
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        mib = float(value)
    else:
        raise TypeError(f"{what}, got {type(value).__name__}")
    if not math.isfinite(mib) or mib <= 0:
        raise ValueError(f"{what}, got {value!r}")
    return max(1, int(mib * MIB))
