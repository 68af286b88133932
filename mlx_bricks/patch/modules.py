"""What the patch replaces by module class, whatever the model_type: MoE experts (every mlx-lm
``SwitchGLU``, ``bricks/moe/piece.py``) and token mixers (the pieces of :data:`MIXERS`: Gated
DeltaNet and the mixers added after it). A model_type missing from the patch table still gets
these; its attention and dense MLPs stay stock (``patch.core``).

A mixer piece (protocol: ``nn/mixer.py``) says which modules it is about (``matches``: known to
it or not, so that an unknown one is reported stock with the reason), which forwards it was read
against (``vetted``: ``patch.vetted`` fingerprints; a module whose ``__call__`` is not one of
them stays stock) and why a known module cannot run it (``reason``). Adding a mixer kind is one
piece object in its brick package and one line in :data:`MIXERS`.
"""
from __future__ import annotations

from mlx_bricks.bricks.gated_delta.piece import GDN_PIECE
from mlx_bricks.bricks.moe.piece import MOE_PIECE, activation_of, switch_classes
from mlx_bricks.nn import BricksMixer, BricksPiece, BricksState, attach, is_patched
from mlx_bricks.patch.report import DISABLED, FALLBACK, PATCHED, STOCK, ModuleReport
from mlx_bricks.patch.vetted import forward_fingerprint, signature_reason
from mlx_bricks.runtime.dispatch import NO_KERNEL_BACKEND, Dispatch

#: The token-mixer pieces patched by module, in the order a module is matched against them.
MIXERS = (GDN_PIECE,)


def has_experts(layer) -> bool:
    """Whether ``layer`` holds a ``SwitchGLU`` or ``SwitchMLP`` (mlx-lm's MoE experts)."""
    classes = switch_classes()[:2]
    return any(isinstance(m, classes) for _, m in layer.named_modules())


def patch_experts(report, i: int, layer, opts: dict, backend: str,
                   dispatch: Dispatch | None, layout) -> None:
    """Patch every ``SwitchGLU`` inside layer ``i`` by module, whatever the architecture (its
    call ``(x, indices)`` runs the MoE piece, ``bricks.moe.piece.MOE_PIECE``; the model's
    router, combine and shared experts stay its own), and report every ``SwitchMLP`` stock
    with the reason. With
    ``dispatch`` None, or composites only (no kernel backend) and float experts (the MoE
    kind's ``dequant`` composite applies to quantized ones), they are reported stock with
    :data:`NO_KERNEL_BACKEND`."""
    glu, switch_mlp = switch_classes()[:2]
    for path, module in layer.named_modules():
        if not isinstance(module, (glu, switch_mlp)):
            continue
        where = path or "layer"
        formats = MOE_PIECE.weight_formats(module) if isinstance(module, glu) else {}
        add = report.modules.append
        if not opts["mlp"]:
            add(ModuleReport(i, MOE_PIECE.role, DISABLED, reason=f"{where}: mlp=False",
                             weights=formats))
            continue
        reason = "module is already patched" if is_patched(module) else \
            MOE_PIECE.reason(module) or signature_reason(module, ("indices",))
        if reason is not None:
            add(ModuleReport(i, MOE_PIECE.role, FALLBACK, reason=f"{where}: {reason}",
                             weights=formats))
            continue
        quantized = any(isinstance(getattr(module, n, None), switch_classes()[3])
                        for n in MOE_PIECE.linears())
        if dispatch is None or (dispatch.composites_only and not quantized):
            add(ModuleReport(i, MOE_PIECE.role, STOCK, reason=NO_KERNEL_BACKEND,
                             weights=formats))
            continue
        if dispatch.tuning:
            tile = "tuned"
        else:
            tile = "reference" if backend == "reference" else "rule"
        variant = f"{where}: activation={activation_of(module)[0]}, tile={tile}"
        st = BricksState(backend=backend, layer=i, role=MOE_PIECE.role, layout=layout,
                         piece=MOE_PIECE, dispatch=dispatch)
        attach(module, BricksPiece, st)
        add(ModuleReport(i, MOE_PIECE.role, PATCHED, MOE_PIECE.bricks, variant, backend,
                         weights=formats, state=st))


def mixer_piece(module):
    """The piece of :data:`MIXERS` whose kind ``module`` is (known or not), or None."""
    return next((p for p in MIXERS if p.matches(module)), None)


def has_mixer(layer) -> bool:
    """Whether ``layer`` holds a module of a :data:`MIXERS` kind."""
    return any(mixer_piece(m) is not None for _, m in layer.named_modules())


def vetted_reason(module, piece) -> str | None:
    """Why ``module``'s forward is not one ``piece`` was read against (None: it is)."""
    fp = forward_fingerprint(module)
    if fp is not None and fp in piece.vetted:
        return None
    cls = type(module)
    return (f"{cls.__module__}.{cls.__name__}: a {piece.name} forward the patch does not know "
            f"(not vetted: {fp or 'source not readable'}): an op it does not follow would be "
            "skipped, so it stays stock")


def patch_mixers(report, i: int, layer, opts: dict, backend: str,
                 dispatch: Dispatch | None) -> None:
    """Patch every token mixer of a :data:`MIXERS` kind inside layer ``i`` by module (a module
    of that kind whose forward was not vetted, or whose parts the piece does not follow, is
    reported stock with the reason). Its prefill is tuned like any piece. Under
    ``attention=False`` it is reported disabled."""
    add = report.modules.append
    for path, module in layer.named_modules():
        piece = mixer_piece(module)
        if piece is None:
            continue
        where = path or "layer"
        if not opts["attention"]:
            add(ModuleReport(i, piece.role, DISABLED, reason=f"{where}: attention=False"))
            continue
        reason = ("module is already patched" if is_patched(module) else
                  vetted_reason(module, piece) or piece.reason(module)
                  or signature_reason(module, piece.call_names))
        if reason is not None:
            add(ModuleReport(i, piece.role, FALLBACK, reason=f"{where}: {reason}"))
            continue
        if dispatch is None:
            add(ModuleReport(i, piece.role, STOCK, reason=NO_KERNEL_BACKEND))
            continue
        how = "tuned" if dispatch.tuning else "rule"
        variant = f"{where}: {piece.name}, {piece.kind.name}={how}"
        st = BricksState(backend=backend, layer=i, role=piece.role, layout=None,
                         piece=piece, dispatch=dispatch)
        attach(module, BricksMixer, st)
        add(ModuleReport(i, piece.role, PATCHED, piece.bricks, variant, backend, state=st))
