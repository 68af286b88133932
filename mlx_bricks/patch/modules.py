"""What the patch replaces by module class, whatever the model_type: MoE experts (every mlx-lm
``SwitchGLU``, ``bricks/moe/piece.py``), MLPs with a fused gate|up layer
(``bricks/swiglu/fused_piece.py``) and token mixers (the pieces of :data:`MIXERS`: Gated
DeltaNet and the mixers added after it). A model_type missing from the patch table still gets
these; its attention and dense MLPs stay stock (``patch.core``).

A mixer piece (protocol: ``nn/mixer.py``) says which modules it is about (``matches``: known to
it or not, so that an unknown one is reported stock with the reason), which forwards it was read
against (``vetted``: ``patch.vetted`` fingerprints; a module whose ``__call__`` is not one of
them stays stock) and why a known module cannot run it (``reason``). Adding a mixer kind is one
piece object in its brick package and one line in :data:`MIXERS`.
"""
from __future__ import annotations

import mlx.nn as nn

from mlx_bricks.bricks.gated_delta.mixers import KDA_PIECE, OLMO_GDN_PIECE
from mlx_bricks.bricks.gemm.mlp_piece import RELU2_MLP_PIECE
from mlx_bricks.bricks.gated_delta.piece import GDN_PIECE
from mlx_bricks.bricks.mla.piece import MLA_PIECE, MLA_SCALED_PIECE
from mlx_bricks.bricks.moe.piece import (
    MOE_PIECE,
    SWITCH_MLP_PIECE,
    activation_of,
    switch_classes,
)
from mlx_bricks.bricks.attention.mixer_piece import ATTENTION_MIXER_PIECE
from mlx_bricks.bricks.short_conv.piece import SHORT_CONV_PIECE
from mlx_bricks.bricks.swiglu.fused_piece import FUSED_MLP_PIECE
from mlx_bricks.bricks.selective_scan.piece import SELECTIVE_SCAN_PIECE
from mlx_bricks.bricks.ssd.piece import FALCON_SSD_PIECE, SSD_PIECE
from mlx_bricks.nn import BricksMixer, BricksPiece, BricksState, attach, is_patched
from mlx_bricks.patch.report import DISABLED, FALLBACK, PATCHED, STOCK, ModuleReport, PatchReport
from mlx_bricks.patch.vetted import forward_fingerprint, signature_reason
from mlx_bricks.runtime.dispatch import NO_KERNEL_BACKEND, Dispatch

#: The token-mixer pieces patched by module, in the order a module is matched against them
#: (the Gated DeltaNet piece after the other gated-delta pieces: it claims every module that
#: calls ``gated_delta_update``).
MIXERS = (KDA_PIECE, OLMO_GDN_PIECE, GDN_PIECE, FALCON_SSD_PIECE, SSD_PIECE, SHORT_CONV_PIECE,
          SELECTIVE_SCAN_PIECE, MLA_PIECE, MLA_SCALED_PIECE, RELU2_MLP_PIECE,
          ATTENTION_MIXER_PIECE)


def has_experts(layer) -> bool:
    """Whether ``layer`` holds a ``SwitchGLU`` or ``SwitchMLP`` (mlx-lm's MoE experts)."""
    classes = switch_classes()[:2]
    return any(isinstance(m, classes) for _, m in layer.named_modules())


def patch_experts(report, i: int, layer, opts: dict, backend: str,
                   dispatch: Dispatch | None, layout) -> None:
    """Patch every ``SwitchGLU`` and ``SwitchMLP`` inside layer ``i`` by module, whatever the
    architecture (its call ``(x, indices)`` runs the MoE piece, ``bricks.moe.piece.MOE_PIECE``,
    or for a gate-less ``SwitchMLP`` ``SWITCH_MLP_PIECE``; the model's router, combine and
    shared experts stay its own). With ``dispatch`` None, or composites only (no kernel
    backend) and float experts (the MoE kind's ``dequant`` composite applies to quantized
    ones), they are reported stock with :data:`NO_KERNEL_BACKEND`. The layer's fused gate|up
    MLPs (granitemoehybrid's shared MLP, plamo2's MLP) are patched by module here too
    (:func:`patch_fused_mlps`)."""
    patch_fused_mlps(report, i, layer, opts, backend, dispatch)
    glu, switch_mlp = switch_classes()[:2]
    for path, module in layer.named_modules():
        if not isinstance(module, (glu, switch_mlp)):
            continue
        piece = MOE_PIECE if isinstance(module, glu) else SWITCH_MLP_PIECE
        where = path or "layer"
        formats = piece.weight_formats(module)
        add = report.modules.append
        if not opts["mlp"]:
            add(ModuleReport(i, piece.role, DISABLED, reason=f"{where}: mlp=False",
                             weights=formats))
            continue
        reason = "module is already patched" if is_patched(module) else \
            piece.reason(module) or signature_reason(module, ("indices",))
        if reason is not None:
            add(ModuleReport(i, piece.role, FALLBACK, reason=f"{where}: {reason}",
                             weights=formats))
            continue
        quantized = any(isinstance(getattr(module, n, None), switch_classes()[3])
                        for n in piece.linears())
        if dispatch is None or (dispatch.composites_only and not quantized):
            add(ModuleReport(i, piece.role, STOCK, reason=NO_KERNEL_BACKEND,
                             weights=formats))
            continue
        if dispatch.tuning:
            tile = "tuned"
        else:
            tile = "reference" if backend == "reference" else "rule"
        variant = f"{where}: activation={activation_of(module)[0]}, tile={tile}"
        st = BricksState(backend=backend, layer=i, role=piece.role, layout=layout,
                         piece=piece, dispatch=dispatch)
        attach(module, BricksPiece, st)
        add(ModuleReport(i, piece.role, PATCHED, piece.bricks, variant, backend,
                         weights=formats, state=st))


def patch_fused_mlps(report, i: int, layer, opts: dict, backend: str,
                     dispatch: Dispatch | None) -> None:
    """Patch every MLP inside layer ``i`` whose gate and up projections are one fused layer
    (granitemoehybrid's shared MLP, plamo2's MLP: ``bricks/swiglu/fused_piece.py``) by module,
    whatever the architecture, as one ``swiglu_mlp`` piece; one whose forward was not vetted
    or whose parts the piece does not read is reported stock with the reason. With ``dispatch``
    None, or weights it does not admit (``Dispatch.admits``), reported stock
    (:data:`NO_KERNEL_BACKEND`);
    under ``mlp=False`` disabled."""
    from mlx_bricks.formats.layers import weight_of

    piece = FUSED_MLP_PIECE
    add = report.modules.append
    for path, module in layer.named_modules():
        if not piece.matches(module):
            continue
        where = path or "layer"
        if not opts["mlp"]:
            add(ModuleReport(i, where, DISABLED, reason="mlp=False"))
            continue
        reason = ("module is already patched" if is_patched(module) else
                  vetted_reason(module, piece) or piece.reason(module)
                  or signature_reason(module, ()))
        if reason is not None:
            add(ModuleReport(i, where, FALLBACK, reason=reason))
            continue
        layers = [module.get(n) for n in piece.linears() if module.get(n) is not None]
        if dispatch is None or not dispatch.admits([weight_of(m) for m in layers]):
            add(ModuleReport(i, where, STOCK, reason=NO_KERNEL_BACKEND))
            continue
        st = BricksState(backend=backend, layer=i, role=piece.role, layout=None, piece=piece,
                         dispatch=dispatch)
        attach(module, BricksPiece, st)
        add(ModuleReport(i, where, PATCHED, piece.bricks, "fused gate|up, swiglu", backend,
                         state=st))


def mixer_piece(module):
    """The piece of :data:`MIXERS` whose kind ``module`` is (known or not), or None."""
    return next((p for p in MIXERS if p.matches(module)), None)


def has_mixer(layer) -> bool:
    """Whether ``layer`` holds a module of a :data:`MIXERS` kind."""
    return any(mixer_piece(m) is not None for _, m in layer.named_modules())


def vetted_reason(module, piece) -> str | None:
    """Why ``module``'s forward, or a helper of it the piece follows (``piece.helpers``: method
    names), is not one ``piece`` was read against (None: they all are)."""
    fp = forward_fingerprint(module)
    if fp is not None and fp in piece.vetted:
        for name in getattr(piece, "helpers", ()):
            helper = forward_fingerprint(module, name)
            if helper not in piece.vetted:
                return (f"{type(module).__name__}.{name} is not one the patch was read against "
                        f"({helper or 'source not readable'}): stays stock")
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
    ``attention=False`` (a gate-less MLP piece: ``mlp=False``, its ``option``) it is reported
    disabled."""
    add = report.modules.append
    for path, module in layer.named_modules():
        piece = mixer_piece(module)
        if piece is None:
            continue
        where = path or "layer"
        option = getattr(piece, "option", "attention")
        if not opts[option]:
            add(ModuleReport(i, piece.role, DISABLED, reason=f"{where}: {option}=False"))
            continue
        reason = ("module is already patched" if is_patched(module) else
                  vetted_reason(module, piece) or piece.reason(module)
                  or signature_reason(module, piece.call_names))
        if reason is not None:
            add(ModuleReport(i, piece.role, FALLBACK, reason=f"{where}: {reason}"))
            continue
        if dispatch is None or (option == "mlp" and not _admits_any(dispatch, module, piece)):
            add(ModuleReport(i, piece.role, STOCK, reason=NO_KERNEL_BACKEND))
            continue
        how = "tuned" if dispatch.tuning else "rule"
        variant = f"{where}: {piece.name}, {piece.kind.name}={how}"
        st = BricksState(backend=backend, layer=i, role=piece.role, layout=None,
                         piece=piece, dispatch=dispatch)
        attach(module, BricksMixer, st)
        add(ModuleReport(i, piece.role, PATCHED, piece.bricks, variant, backend, state=st))


def _admits_any(dispatch, module, piece) -> bool:
    """Whether ``dispatch`` admits any of the linear layers of a piece made of linear pieces
    only (an MLP: ``option`` "mlp"); none admitted, it would run its own layers, stock."""
    from mlx_bricks.formats.layers import weight_of

    layers = [module.get(n) for n in piece.linears(None, module) if module.get(n) is not None]
    return any(dispatch.admits([weight_of(m)]) for m in layers)


def sinks_reason(attn, layout=None) -> str | None:
    """Why an attention module with learned attention sinks (gpt-oss's ``sinks``, one logit per
    head in the softmax's denominator) stays stock: its layout does not name them
    (``BlockLayout.sinks``), so the patched module would drop them."""
    if layout is not None and layout.sinks is not None:
        return None
    if isinstance(attn, dict) and "sinks" in attn:  # nn.Module is a dict of its arrays
        return ("attention sinks (sinks: a learned logit per head in the softmax) that the "
                "architecture's table entry does not name (BlockLayout.sinks)")
    return None


#: Class-name marks of a decoder layer's token mixer, most specific first, and the words the
#: report uses for them.
_MIXER_KINDS = (("GatedDeltaNet", "Gated DeltaNet"), ("Mamba", "Mamba"),
                ("ShortConv", "short-conv"), ("LinearAttention", "linear attention"),
                ("Attention", "attention"), ("Attn", "attention"))


def layer_mixers(layer) -> list[tuple[str, str, str]]:
    """``(attribute, kind, class name)`` of each token mixer among ``layer``'s direct children
    (attention, Gated DeltaNet, Mamba, short-conv, ...), by class name (:data:`_MIXER_KINDS`)."""
    out = []
    for name, child in layer.children().items():
        if not isinstance(child, nn.Module):
            continue
        cls = type(child).__name__
        kind = next((k for mark, k in _MIXER_KINDS if mark.lower() in cls.lower()), None)
        if kind is not None:
            out.append((name, kind, cls))
    return out


def mixer_entries(report: PatchReport, i: int, layer, reason: str) -> None:
    """One stock entry per token mixer of layer ``i``, named by its attribute and kind (a layer
    without attention is not reported as a ``self_attn`` fallback); Gated DeltaNet mixers
    have their own entries (``patch.modules.patch_mixers``)."""
    mixers = layer_mixers(layer)
    if not mixers and not has_mixer(layer):
        report.modules.append(ModuleReport(i, "mixer", FALLBACK,
                                           reason=f"no known token mixer: {reason}"))
    for name, kind, cls in mixers:
        if mixer_piece(getattr(layer, name)) is not None:
            continue  # patched by module, with its own entry (patch.modules)
        why = (sinks_reason(getattr(layer, name)) if kind == "attention" else None) or reason
        report.modules.append(ModuleReport(i, name, FALLBACK, reason=f"{kind} ({cls}): {why}"))


def unlisted_layer(report: PatchReport, i: int, layer, model_type) -> None:
    """The mixer entries of layer ``i`` of a model whose ``model_type`` is not in the patch
    table (its SwitchGLU experts are patched by module): stock, with the reason."""
    mixer_entries(report, i, layer,
                   f"model_type {model_type!r} is not in the patch table: its token mixers "
                   "and dense MLPs stay stock")
