"""The values of ``patch_model``'s string options, without importing MLX.

The library checks its arguments against these tuples and every command line takes its choices
from them (``mlx_bricks.entry.flags``), so ``--help`` lists what the library accepts and the
two cannot drift.
"""
from __future__ import annotations

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
