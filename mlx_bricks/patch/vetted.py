"""Which mlx-lm forwards a patch-table entry was vetted against.

A patched module replaces its mlx-lm ``__call__`` with the bricks' pieces, which compute what
the table entry (``nn.layout.BlockLayout``) says that forward does. An op the entry does not
describe (llama4's inline weightless QK-norm under a llama entry, a subclass or a monkeypatched
``__call__`` with an extra step, a changed mlx-lm release) would silently be skipped, so each
entry records the source fingerprint of every ``__call__`` it was checked against, and a
module whose ``__call__`` is not one of them stays stock with the reason.

The fingerprint is the function's home (``<module>.<qualname>``) and the first 12 hex digits
of the SHA-256 of its dedented source (``inspect.getsource``). Print a model's with
``python -m mlx_bricks.patch.vetted <model_type>`` (a tiny random model built from mlx-lm's
own classes) when vetting a new entry or a new mlx-lm release.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import sys
import textwrap


@functools.lru_cache(maxsize=None)
def _fingerprint_of(fn) -> str | None:
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return None
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    return f"{fn.__module__}.{fn.__qualname__}={digest}"


def forward_fingerprint(module) -> str | None:
    """``"<module>.<qualname>=<sha256[:12]>"`` of ``type(module).__call__`` (None: its source
    cannot be read, e.g. a builtin or a function made at run time without a file)."""
    fn = getattr(type(module), "__call__", None)
    fn = getattr(fn, "__func__", fn)
    if fn is None:
        return None
    try:
        return _fingerprint_of(fn)
    except TypeError:  # unhashable callable
        return None


def forward_reason(module, layout, what: str) -> str | None:
    """Why ``module``'s forward is not one ``layout`` was vetted against (None: it is);
    ``what`` names the module in the reason (``"self_attn"``)."""
    fp = forward_fingerprint(module)
    if fp is not None and fp in layout.vetted:
        return None
    cls = type(module).__name__
    got = "its source cannot be read" if fp is None else fp
    return (f"{what} forward {cls}.__call__ is not one this table entry was vetted against "
            f"({got}): an op the patch does not know would be skipped, so it stays stock")


def signature_reason(module, names: tuple[str, ...]) -> str | None:
    """None if ``type(module).__call__`` takes ``(self, <x>, *names)`` and nothing else required.

    The bricks pass the call through positionally, so the positions (and, for mask/cache, the
    names) must be mlx-lm's; further parameters are fine if they have defaults.
    """
    cls = type(module)
    try:
        params = list(inspect.signature(cls.__call__).parameters.values())[1:]
    except (TypeError, ValueError):
        return f"{cls.__name__}.__call__ has no inspectable signature"
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    want = 1 + len(names)
    if len(positional) < want or [p.name for p in positional[1:want]] != list(names):
        got = ", ".join(p.name for p in params)
        expect = ", ".join(("x", *names))
        return f"unknown call signature {cls.__name__}({got}); expected ({expect})"
    for p in params:
        if p in positional[:want] or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            return f"unknown call signature: {cls.__name__}.__call__ requires {p.name!r}"
    return None


def vetted_forwards(model) -> list[str]:
    """The fingerprints of every distinct ``__call__`` in ``model``'s decoder layers (blocks,
    attention modules, MLPs, MoE blocks), sorted: the candidates for a table entry's
    ``vetted``, each to be read against the layout before it is listed."""
    out = set()
    for layer in getattr(model, "layers", []):
        for _, m in layer.named_modules():
            fp = forward_fingerprint(m)
            if fp is not None and fp.startswith("mlx_lm.models."):
                out.add(fp)
    return sorted(out)


def _main(argv) -> int:
    """``python -m mlx_bricks.patch.vetted MODEL_TYPE``: build the tiny model of
    ``tests.models`` (run from the repository root) and print its forwards."""
    if len(argv) != 1:
        print(__doc__)
        return 2
    from tests.models import build_model

    for fp in vetted_forwards(build_model(argv[0])):
        print(fp)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
