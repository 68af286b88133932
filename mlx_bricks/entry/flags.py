"""The mlx-bricks flags of every command line, defined once.

``add_bricks_flags(parser)`` adds the ``mlx-bricks`` group that mlx-lm's commands get under the
hook (``--use-bricks`` and the ``--bricks-*`` flags). The single ``add_*_flag`` functions define
one flag each, under any names, for the mlx-bricks tools that spell them their own way
(``python -m mlx_bricks.patch --backend ... --kv ... --tune ...``). The choices come from the
library's own tuples (``mlx_bricks.options``, ``mlx_bricks.backends.BACKENDS``, the SwiGLU
variants), none of which imports MLX, so ``--help`` stays cheap.
"""
from __future__ import annotations

import argparse

from mlx_bricks.backends import BACKENDS
from mlx_bricks.backends import ENV_VAR as BACKEND_ENV
from mlx_bricks.bricks.swiglu.variants import VARIANT_ENV_VAR as SWIGLU_VARIANT_ENV
from mlx_bricks.bricks.swiglu.variants import VARIANTS as SWIGLU_VARIANTS
from mlx_bricks.options import KV_ALIASES, KV_CACHES, TUNE_MODES, kv_cache_choice

#: Title of the flag group in ``--help``.
GROUP = "mlx-bricks"
#: ``--bricks-mlp-variant``: ``auto`` (None to ``patch_model``) or a SwiGLU variant.
MLP_VARIANTS = ("auto", *SWIGLU_VARIANTS)


def add_backend_flag(parser, *names: str, dest: str | None = None) -> None:
    """``NAMES {metal,cuda,emulator,reference}``, default None (``$MLX_BRICKS_BACKEND``, then
    auto)."""
    parser.add_argument(*names, dest=dest, choices=BACKENDS, default=None,
                        help=f"Backend of the bricks (default: ${BACKEND_ENV}, else auto: metal, "
                        "cuda, reference).")


def add_kv_flag(parser, *names: str, dest: str | None = None, help: str) -> None:
    """``NAMES {fp16,q8_0}``, default ``fp16``; ``none`` is accepted for ``fp16``."""
    aliases = ", ".join(f"{old} = {new}" for old, new in KV_ALIASES.items())
    parser.add_argument(*names, dest=dest, type=kv_cache_choice, choices=KV_CACHES,
                        default=KV_CACHES[0], help=f"{help} Default: {KV_CACHES[0]} ({aliases}).")


def add_tune_flag(parser, *names: str, dest: str | None = None, default: str = "auto",
                  when: str = "at the first prefill") -> None:
    """``NAMES {auto,cached,force,off}`` (``patch_model(tune=...)``), default ``default``;
    ``when``: when this command measures in ``auto`` mode."""
    parser.add_argument(*names, dest=dest, choices=TUNE_MODES, default=default,
                        help="Tuning: auto (cached decisions; the missing ones are measured "
                        f"{when}), cached (cached decisions, else the prior; never measures, "
                        "so nothing delays the first token; `python -m mlx_bricks.tune MODEL` "
                        "measures ahead), force (measure again), off (the bricks' own rules). "
                        f"Default: {default}.")


def add_mlp_variant_flag(parser, *names: str, dest: str | None = None) -> None:
    """``NAMES {auto,fused,split}``, default ``auto`` (:func:`mlp_variant` gives the
    ``patch_model`` value)."""
    parser.add_argument(*names, dest=dest, choices=MLP_VARIANTS, default="auto",
                        help=f"SwiGLU brick variant: fused, split, or auto (${SWIGLU_VARIANT_ENV}"
                        ", else the brick's rule). Default: auto.")


def mlp_variant(value: str) -> str | None:
    """``patch_model(mlp_variant=...)`` for a ``--bricks-mlp-variant`` value."""
    return None if value == "auto" else value


def add_bricks_flags(parser: argparse.ArgumentParser, *, use_bricks_default: bool = False,
                     tune_default: str = "auto", tune_when: str = "at the first prefill"
                     ) -> argparse._ArgumentGroup:
    """Add the ``mlx-bricks`` group to ``parser``.

    Flags (destinations in brackets): ``--use-bricks/--no-use-bricks`` [use_bricks],
    ``--bricks-backend`` [bricks_backend], ``--bricks-kv {fp16,q8_0}`` [bricks_kv],
    ``--bricks-mlp-variant {auto,fused,split}`` [bricks_mlp_variant],
    ``--bricks-tune {auto,cached,force,off}`` [bricks_tune], ``--bricks-report``
    [bricks_report].

    Args:
        parser: the command's parser (mlx-lm's own, or any ``ArgumentParser``).
        use_bricks_default: default of ``--use-bricks`` (True for ``mlx_bricks.generate``).
        tune_default: default of ``--bricks-tune`` (the command's, ``entry.commands``).
        tune_when: when the command measures in ``auto`` mode (for the help).

    Returns:
        The argument group.
    """
    group = parser.add_argument_group(GROUP)
    group.add_argument(
        "--use-bricks", action=argparse.BooleanOptionalAction, default=use_bricks_default,
        help="Patch every model the command loads with the mlx-bricks kernels (a draft model "
        f"stays stock). Default: {'on' if use_bricks_default else 'off'}.")
    add_backend_flag(group, "--bricks-backend")
    add_kv_flag(group, "--bricks-kv",
                help="KV cache: fp16 (mlx-lm's own cache, whatever its float dtype) or q8_0 (K "
                "and V stored as Q8_0 blocks, 34/64 of the float16 bytes, read directly by the "
                "attention and decode bricks; sliding-window layers keep mlx-lm's rotating "
                "cache). Not with --kv-bits.")
    add_mlp_variant_flag(group, "--bricks-mlp-variant")
    add_tune_flag(group, "--bricks-tune", default=tune_default, when=tune_when)
    group.add_argument(
        "--bricks-report", action="store_true",
        help="Print the per-layer patch report, with the calls each brick served, to stderr "
        "when the command ends (the server: to its log).")
    return group
