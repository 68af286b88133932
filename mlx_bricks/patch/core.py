"""The patch routine: one pass over the decoder layers, driven by the table in ``table.py``.

Every decision that depends only on the model's structure is made here, once, and written to the
report; decisions that depend on the call (mask, cache type, L == 1) are made by the modules in
``mlx_bricks.nn`` and counted there.
"""
from __future__ import annotations

import contextlib
import os
import weakref

import mlx.nn as nn

from mlx_bricks.backends import active_backend
from mlx_bricks.options import KV_CACHES
from mlx_bricks.bricks.attention.msl import SUPPORTED_HEAD_DIMS
from mlx_bricks.bricks.attention.piece import KIND as ATTENTION
from mlx_bricks.bricks.dequantize.composite import (
    CAP_SETTING,
    CAP_STRICT_SETTING,
    MIB,
    QUEUED_BACKENDS,
    resolve_cap,
    warm_first_use,
)
from mlx_bricks.bricks.gemm.piece import KIND as LINEAR
from mlx_bricks.bricks.gemm.piece import STAGES_MEMO
from mlx_bricks.bricks.moe.piece import switch_classes
from mlx_bricks.bricks.norm_qkv.piece import KIND as RMS_NORM_QKV
from mlx_bricks.bricks.norm_qkv.piece import rms_norm_reason
from mlx_bricks.bricks.swiglu.piece import MLP_PIECE
from mlx_bricks.bricks.swiglu.variants import VARIANT_ENV_VAR, resolve_variant
from mlx_bricks.formats.layers import linear_reason, weight_of
from mlx_bricks.formats.q8_0 import KV_QUANTS, QK8_0
from mlx_bricks.nn import (
    BricksAttention,
    BricksBlock,
    BricksPiece,
    BricksState,
    attach,
    detach,
    is_patched,
)
from mlx_bricks.nn.calls import track_batch_masks
from mlx_bricks.nn.gate import gate_model, model_gate, ungate_model
from mlx_bricks.nn.shared_kv import BricksSharedKVAttention
from mlx_bricks.nn.structure import attention_sharding_reason, linears
from mlx_bricks.runtime.dispatch import NO_KERNEL_BACKEND, TUNE_MODES, Dispatch, no_kernel_backend
from mlx_bricks.patch.report import (
    DISABLED,
    FALLBACK,
    PATCHED,
    STOCK,
    ModuleReport,
    PatchReport,
    record_weight_formats,
)
from mlx_bricks.patch.table import layer_types, lookup, supported_model_types
from mlx_bricks.patch.modules import (
    has_experts,
    has_mixer,
    mixer_entries,
    mixer_piece,
    patch_experts,
    patch_mixers,
    sinks_reason,
    unlisted_layer,
)
from mlx_bricks.patch.vetted import forward_reason, signature_reason


_BLOCK_BRICKS = (RMS_NORM_QKV.op_name, ATTENTION.op_name, LINEAR.op_name,
                 *MLP_PIECE.bricks)
_ATTN_BRICKS = (LINEAR.op_name, ATTENTION.op_name)


def _model_type(model):
    mt = getattr(model, "model_type", None)
    if mt is None:
        mt = getattr(getattr(model, "args", None), "model_type", None)
    return mt


def describe_rope(rope) -> str:
    """How the bricks apply this rope object (always the module's own object); None: a layer
    without RoPE (NoPE)."""
    if rope is None:
        return "NoPE: no rope on this layer"
    if type(rope) is nn.RoPE:
        return (f"nn.RoPE(dims={rope.dims}, traditional={rope.traditional}, base={rope.base}, "
                f"scale={rope.scale}) via mx.fast.rope")
    return f"{type(rope).__name__}: the module's own rope object (no RoPE brick; same as stock)"


def _attention_structure(attn, layout, kv_quant) -> tuple[str | None, int]:
    """(reason or None, head_dim) for an attention module."""
    if attn is None:
        return f"block has no {layout.attention!r}", 0
    if is_patched(attn):
        return "module is already patched", 0
    r = sinks_reason(attn, layout)
    if r is not None:
        return r, 0
    for name in layout.attention_linears_of(attn):
        r = linear_reason(name, getattr(attn, name, None))
        if r is not None:
            return r, 0
    r = attention_sharding_reason(attn, layout)  # tensor-parallel: mlx-lm's shard() layout
    if r is not None:
        return r, 0
    for name in layout.qk_norms_of(attn):
        r = rms_norm_reason(name, getattr(attn, name, None), layout)
        if r is not None:
            return r, 0
    n_heads, n_kv = layout.head_counts(attn)
    if not (isinstance(n_heads, int) and isinstance(n_kv, int) and n_heads > 0 and n_kv > 0):
        return f"attention has no integer {' / '.join(layout.heads)}", 0
    if n_heads % n_kv:
        return f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv}", 0
    q_rows = getattr(attn, layout.q_proj).weight.shape[0]
    per_head = 2 * n_heads if layout.output_gate else n_heads  # a gate beside each query
    head_dim = q_rows // per_head
    if head_dim * per_head != q_rows:
        return f"{layout.q_proj} has {q_rows} rows, not a multiple of {per_head} " \
               f"({'2 x ' if layout.output_gate else ''}n_heads {n_heads})", 0
    for name in (layout.k_proj, layout.v_proj):
        if name not in layout.attention_linears_of(attn):
            continue  # shared_kv: K/V of another layer, or values = keys
        rows = getattr(attn, name).weight.shape[0]
        if rows != n_kv * head_dim:
            return f"{name} has {rows} rows, expected n_kv_heads * head_dim = {n_kv * head_dim}", 0
    if not isinstance(layout.scale_of(attn), (int, float)):
        return f"attention has no numeric {layout.scale}", 0
    if layout.sinks is not None:
        sinks = layout.sinks_of(attn)
        if sinks is None or tuple(getattr(sinks, "shape", ())) != (n_heads,):
            return (f"attention's {layout.sinks} is not a ({n_heads},) array (one sink logit "
                    "per query head)"), 0
    if layout.chunked is not None and getattr(attn, layout.chunked, False) and \
            layout.chunk_size is None:
        return (f"chunked attention without a chunk length ({layout.chunk_arg} in the model's "
                "args): which calls stay within one chunk is unknown"), 0
    if layout.has_rope(attn) and not callable(getattr(attn, "rope", None)):
        return "attention has no rope module (NoPE or another position scheme)", 0
    if layout.shared_kv and layout.owns_kv(attn) and not callable(getattr(attn, layout.v_norm,
                                                                          None)):
        return f"attention has no {layout.v_norm} module (gemma4's value norm)", 0
    eps = layout.inline_qk_norm_eps
    if layout.inline_qk_norm is not None and getattr(attn, layout.inline_qk_norm, False) and \
            not isinstance(getattr(attn, eps, None) if isinstance(eps, str) else eps, float):
        return f"attention's weightless QK-norm has no float eps ({eps})", 0
    if head_dim not in SUPPORTED_HEAD_DIMS:
        dims = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
        return f"head_dim {head_dim} is not supported by the attention brick ({dims})", 0
    if kv_quant == "q8_0" and head_dim % QK8_0:
        return f"kv_quant='q8_0' needs head_dim % {QK8_0} == 0, head_dim is {head_dim}", 0
    return (forward_reason(attn, layout, layout.attention)
            or signature_reason(attn, layout.call_args)), head_dim


def _mlp_structure(mlp, layout) -> str | None:
    if mlp is None:
        return f"block has no {layout.mlp!r}"
    if is_patched(mlp):
        return "module is already patched"
    if isinstance(mlp, nn.Module) and has_experts(mlp):
        return moe_block_reason(mlp, layout)
    return (MLP_PIECE.reason(mlp, layout) or forward_reason(mlp, layout, layout.mlp)
            or signature_reason(mlp, ()))


def moe_block_reason(mlp, layout=None) -> str:
    """The report's words for a MoE block in a layer's MLP slot: which of its parts run the
    bricks (``SwitchGLU`` experts and ``SwitchMLP`` ones the MoE brick reads, by module; a
    layout's dense shared expert) and which stay stock (other ``SwitchMLP`` experts, the
    router, the combine)."""
    from mlx_bricks.bricks.moe.piece import SWITCH_MLP_PIECE

    glu, switch_mlp = switch_classes()[:2]
    experts = [m for _, m in mlp.named_modules() if isinstance(m, (glu, switch_mlp))]
    parts = []
    if any(isinstance(m, glu) for m in experts):
        parts.append("its SwitchGLU experts are patched by module (the moe entries)")
    for m in (m for m in experts if isinstance(m, switch_mlp)):
        reason = SWITCH_MLP_PIECE.reason(m)
        parts.append("its SwitchMLP experts are patched by module (the moe entries)"
                     if reason is None else f"its SwitchMLP experts stay stock ({reason})")
    shared = getattr(layout, "shared_expert", None)
    if shared is not None and getattr(mlp, shared, None) is not None:
        parts.append(f"its shared expert ({shared}) is patched as an MLP (its own entry)")
        rest = "router and combine stay stock"
    else:
        rest = "router, combine and any shared expert stay stock"
    return f"MoE block (router and experts, not a dense MLP): {'; '.join(parts)}; {rest}"


def _block_structure(layer, layout) -> str | None:
    if layout.unfused is not None:
        return layout.unfused
    if layout.output_gate:
        return ("the attention's output is gated (sigmoid of q_proj's gate columns): the "
                "unified block's qkv piece has no gate")
    if is_patched(layer):
        return "module is already patched"
    attn = getattr(layer, layout.attention)
    has_bias = ["bias" in getattr(attn, n) for n in (layout.q_proj, layout.k_proj, layout.v_proj)]
    if len(set(has_bias)) > 1:
        return "q/k/v biases are not all present or all absent (rms_norm_qkv takes all or none)"
    for name in (layout.input_norm, layout.post_attention_norm):
        r = rms_norm_reason(name, getattr(layer, name, None), layout)
        if r is not None:
            return r
    return forward_reason(layer, layout, "block") or signature_reason(layer, layout.call_args)


def _weights_read(module, role, layout, piece=None) -> list:
    """The weights of the linear layers the module's bricks read (``Dispatch.admits``)."""
    return [weight_of(m) for m in linears(module, role, layout, piece).values()
            if m is not None]


def layer_sliding(layer, i: int, layout, types) -> bool | None:
    """Whether decoder layer ``i`` is a sliding-window layer by its own attribute
    (``layout.layer_sliding``) or the model's ``layout.layer_types`` list; None: the layout
    marks sliding layers on the attention module (``layout.sliding``) or not at all.
    ``types``: the model's per-layer types (``patch.table.layer_types``; None where unknown:
    then the attention stays stock, see :func:`_patch_layer`)."""
    if layout.layer_sliding is not None:
        return bool(getattr(layer, layout.layer_sliding, False))
    if layout.layer_types is not None:
        return isinstance(types, (list, tuple)) and i < len(types) and \
            types[i] == "sliding_attention"
    return None


def _patch_layer(report: PatchReport, i: int, layer, layout, opts: dict, backend: str,
                 dispatch: Dispatch | None, types=None) -> None:
    """Patch layer ``i`` (or, with ``dispatch`` None, only report what would be patched: the
    modules are then left stock with :data:`NO_KERNEL_BACKEND`; so are the modules whose
    weights the dispatch does not admit, ``Dispatch.admits``). ``types``: the model's per-layer
    attention types where the layout has ``layer_types`` (``patch.table.layer_types``)."""
    attention, mlp, fuse_block, kv_quant = (
        opts["attention"], opts["mlp"], opts["fuse_block"], opts["kv_quant"])
    attn_mod = getattr(layer, layout.attention, None)
    mlp_mod = getattr(layer, layout.mlp, None)
    add = report.modules.append

    attn_reason, head_dim = _attention_structure(attn_mod, layout, kv_quant)
    sliding = layer_sliding(layer, i, layout, types)
    if attn_reason is None and layout.layer_types is not None and types is None:
        attn_reason = (f"the model has no per-layer attention types ({layout.layer_types}): "
                       "which layers slide is unknown")
    if attn_reason is None and layout.shared_kv and opts["kv_cache"] == "q8_0":
        attn_reason = ("gemma4's shared K/V with kv_cache='q8_0': the Q8_0 cache readers do not "
                       "take K/V handed between layers")
    if attn_reason is None and layout.sinks is not None and opts["kv_cache"] == "q8_0":
        attn_reason = ("attention sinks with kv_cache='q8_0': the Q8_0 cache readers (decode) "
                       "have no sinks")
    mlp_reason = _mlp_structure(mlp_mod, layout)
    rope = ""
    if attn_mod is not None and not layout.has_rope(attn_mod):
        rope = describe_rope(None)
    elif attn_mod is not None and callable(getattr(attn_mod, "rope", None)):
        rope = describe_rope(attn_mod.rope)
    attn_variant = f"kv_quant={kv_quant or 'none'}"
    if opts["kv_cache"] == "q8_0":
        attn_variant = "kv_cache=q8_0"
    # the reference backend runs MLX ops: no kernel variant to report; tuning picks per bucket
    if dispatch is not None and dispatch.tuning:
        fixed = dispatch.settings.get(MLP_PIECE.kind.name, {}).get("fixed")
        mlp_variant = "swiglu=tuned" + (f" ({opts['mlp_variant']} only)" if fixed else "")
    elif backend == "reference":
        mlp_variant = "swiglu=reference"
    else:
        mlp_variant = f"swiglu={opts['mlp_variant']}"

    def patch(module, mixin, role, bricks, variant, rope="", piece=None):
        if dispatch is None or not dispatch.admits(_weights_read(module, role, layout, piece)):
            add(ModuleReport(i, role, STOCK, reason=NO_KERNEL_BACKEND, rope=rope))
            return
        st = BricksState(backend=backend, layer=i, role=role, layout=layout,
                         head_dim=head_dim, kv_quant=kv_quant, piece=piece,
                         dispatch=dispatch, sliding=sliding)
        attach(module, mixin, st)
        if opts["kv_cache"] == "q8_0" and ATTENTION.op_name in bricks:
            bricks = (*bricks, "q8_0_cache_attention")
        add(ModuleReport(i, role, PATCHED, bricks, variant, backend, rope=rope, state=st))

    if attention and mlp and fuse_block and attn_reason is None and mlp_reason is None:
        block_reason = _block_structure(layer, layout)
        if block_reason is None:
            patch(layer, BricksBlock, "block", _BLOCK_BRICKS, f"{attn_variant}, {mlp_variant}",
                  rope)
            return
        add(ModuleReport(i, "block", FALLBACK, reason=f"not fused: {block_reason}"))

    if not attention:
        add(ModuleReport(i, "self_attn", DISABLED, reason="attention=False"))
    elif attn_mod is None or mixer_piece(attn_mod) is not None:  # mixers: patch.modules
        mixer_entries(report, i, layer, f"the {report.architecture} entry has no brick for "
                       f"it (no {layout.attention!r} on this layer)")
    elif attn_reason is not None:
        add(ModuleReport(i, "self_attn", FALLBACK, reason=attn_reason, rope=rope))
    else:
        mixin = BricksSharedKVAttention if layout.shared_kv else BricksAttention
        patch(attn_mod, mixin, "self_attn", _ATTN_BRICKS, attn_variant, rope)

    if not mlp:
        add(ModuleReport(i, "mlp", DISABLED, reason="mlp=False"))
    elif mlp_reason is not None:
        add(ModuleReport(i, "mlp", FALLBACK, reason=mlp_reason))
    else:
        patch(mlp_mod, BricksPiece, MLP_PIECE.role, MLP_PIECE.bricks, mlp_variant,
              piece=MLP_PIECE)
    def dense(where, module):  # a dense MLP beside the layer's mlp, as an MLP piece
        why = _mlp_structure(module, layout) if mlp else "mlp=False"
        if why is not None:
            add(ModuleReport(i, where, FALLBACK if mlp else DISABLED, reason=why))
        else:
            patch(module, BricksPiece, MLP_PIECE.role, MLP_PIECE.bricks, mlp_variant,
                  piece=MLP_PIECE)
            report.modules[-1].module = where

    shared = getattr(mlp_mod, layout.shared_expert, None) if layout.shared_expert else None
    if shared is not None and isinstance(mlp_mod, nn.Module) and has_experts(mlp_mod):
        dense(f"{layout.mlp}.{layout.shared_expert}", shared)
    for j, extra in enumerate(getattr(layer, layout.mlp_list or "", None) or ()):
        dense(f"{layout.mlp_list}.{j}", extra)


def _check_flag(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def patch_model(model, *, attention=True, mlp=True, fuse_block=True, kv_quant=None,
                kv_cache="fp16", mlp_variant=None, backend=None, tune="auto",
                dequant_cap=None, progress=None) -> PatchReport:
    """Run prefill of a loaded mlx-lm model through the bricks, in place, where they are
    faster than stock on this device.

    Each supported decoder layer gets, on that instance only (other models are untouched):
    ``BricksBlock`` when ``fuse_block`` (and ``attention`` and ``mlp``) and the block is a
    standard pre-norm block, else ``BricksAttention`` and/or ``BricksPiece`` (the MLP). Parameters stay the
    same arrays under the same names. Prefill (L > 1) is split into pieces (RMSNorm + QKV,
    attention, the out-projection, the MLP), each running its brick or mlx-lm's own stock code
    as the dispatcher decides (``tune``); decode (L == 1: the model's forward switches every
    patched module to its original class, one check per forward: ``nn.gate``) and the cases
    the bricks do not cover (array masks, caches other than ``KVCache``, LoRA/DoRA linears,
    unknown call signatures, sliding-window layers) run the stock code, with the reason in the
    report. MLX affine ``nn.QuantizedLinear`` projections feed the quantized bricks (docs/
    patch.md, "Quantized models"); ``mxfp4`` / ``nvfp4`` / ``mxfp8`` layers and experts feed
    the kinds' composites only (no kernel reads them; docs/formats.md). A brick that fails to
    build, or whose first output disagrees with stock, is disabled for the process and its
    pieces run stock (the report
    says which and why).

    On a machine without a kernel backend (auto selection gave ``reference``), the modules
    that read a quantized weight (MLX affine or microscaled) are patched and each of their
    pieces is tuned: the kinds' composites ("dequantize the weight, then the stock float computation", in row
    tiles under ``dequant_cap``) are timed against stock, and whichever is faster runs (MLX
    0.32.4's CPU ``quantized_matmul`` with float16 activations is 17-57x slower than the
    dequantized float GEMM); modules with float weights only are reported ``stock`` with
    :data:`NO_KERNEL_BACKEND` (reference is the same math as stock), and so is every module
    with ``tune="off"``. Naming a backend (argument or ``MLX_BRICKS_BACKEND``), ``reference``
    included, patches as asked.
    Calling it again re-patches from scratch with the new options. The API follows
    Liger-Kernel's instance patching (``apply_liger_kernel_to_llama(..., model=...)``): one
    flag per brick, a live model, weights left where they are.

    Args:
        model: an mlx-lm model (``nn.Module`` with ``layers`` and ``model_type``).
        attention: patch the attention modules.
        mlp: patch the MLP modules: the dense MLPs, and every MoE expert module
            (``SwitchGLU``, by module whatever the model_type: its ``(x, indices)`` call runs
            the MoE piece; docs/moe.md, "Patching").
        fuse_block: use the unified block where both can be patched.
        kv_quant: None or ``"q8_0"``: K/V rounded to Q8_0 inside the attention brick (needs
            head_dim % 32 == 0). The mlx-lm cache keeps full precision: no memory is saved and
            decode stays stock; for a real Q8_0 cache use ``kv_cache``.
        kv_cache: ``"fp16"`` (default: mlx-lm's cache, whatever its float dtype) or ``"q8_0"``:
            the model's attention (bricks and stock code, prefill and decode) reads
            ``mlx_bricks.cache.Q8KVCache`` layers directly (34/64 of the float16 bytes; decode
            through the flash-decoding brick). Build the cache with
            ``mlx_bricks.make_prompt_cache(model)``; the report lists the cache kind per layer
            (sliding-window layers keep mlx-lm's ``RotatingKVCache``, with the reason). Applies
            on every backend, ``reference`` included (it saves memory there too). See
            docs/kv_cache.md.
        mlp_variant: SwiGLU brick variant, ``"fused"`` or ``"split"``; ``None`` takes
            ``MLX_BRICKS_SWIGLU_VARIANT``, then the brick's default (``ops.swiglu_variants``).
            Resolved once here and reported; the reference backend has no variants.
        backend: ``None`` (``MLX_BRICKS_BACKEND``, then auto) or a name from
            ``mlx_bricks.backends.BACKENDS``; resolved once here.
        tune: on a kernel backend (``metal``, ``cuda``): ``"auto"`` uses the decision cache
            and measures the missing decisions (each piece's shape bucket, at its first
            prefill); ``"cached"`` uses the decision cache and, for the missing decisions, the
            prior (``tune.prior``: composites where they won on such devices, else stock),
            never measuring, and runs a kernel variant only where its cached gain pays its
            per-process build (what one-shot commands use: nothing delays the first token);
            ``"force"`` measures again and overwrites the cache; ``"off"`` runs the
            bricks by the ops' rules, unmeasured. Tuning does not apply to ``emulator`` or
            ``reference`` (they run as asked). See docs/tuning.md.
        dequant_cap: the most memory, in MiB (a number > 0, fractions allowed), one row tile
            of a composite's dequantized weight may hold while it is made (the float tile and
            the dequantizer's temporaries); None: ``MLX_BRICKS_DEQUANT_CAP``, else 256 or
            1/32 of the model's weight bytes (at least 1), whichever is smaller; a default
            cap (not this argument's, not the variable's) grows per call on a GPU to the
            bytes the call's products write (``options.call_cap``). The report shows it
            (``options``). See ``bricks/dequantize/composite.py``.
        progress: show the tuner's progress bar on stderr (None: when stderr is a terminal).

    Returns:
        PatchReport (also kept as ``model._bricks_report``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``; a flag is not a bool.
        ValueError: ``kv_quant`` is not None or ``"q8_0"``; ``kv_cache`` is not ``"fp16"`` or
            ``"q8_0"``, or ``"q8_0"`` together with ``kv_quant``; an unknown ``mlp_variant`` or
            ``tune``; ``kv_cache="q8_0"`` on a model whose attention cannot be routed;
            ``dequant_cap`` (or ``MLX_BRICKS_DEQUANT_CAP``) zero or below, or not a number
            (a ``TypeError`` for an argument of another type).
        mlx_bricks.backends.BackendError: unknown or unavailable backend.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    for name, value in (("attention", attention), ("mlp", mlp), ("fuse_block", fuse_block)):
        _check_flag(name, value)
    if kv_quant not in KV_QUANTS:
        raise ValueError(f"kv_quant must be None or 'q8_0', got {kv_quant!r}")
    if kv_cache not in KV_CACHES:
        raise ValueError(f"kv_cache must be 'fp16' or 'q8_0', got {kv_cache!r}")
    track_batch_masks()  # a padded batch is admitted only with BatchKVCache.make_mask's mask
    if kv_cache == "q8_0" and kv_quant is not None:
        raise ValueError("kv_quant and kv_cache='q8_0' exclude each other: the Q8_0 cache "
                         "already gives the attention Q8_0 K/V (leave kv_quant=None)")
    if tune not in TUNE_MODES:
        raise ValueError(f"tune must be one of {', '.join(map(repr, TUNE_MODES))}, "
                         f"got {tune!r}")
    cap, cap_source = resolve_cap(dequant_cap, _weight_bytes(model))
    choice = active_backend(backend)
    strict = cap_source in ("argument", "env")
    grows = "" if strict or choice.name not in QUEUED_BACKENDS else \
        "; per call at least the call's output"
    fixed = mlp_variant is not None or bool(os.environ.get(VARIANT_ENV_VAR, "").strip())
    mlp_variant = resolve_variant(mlp_variant, "mlp_variant")

    unpatch_model(model)
    model_type = _model_type(model)
    arch, layout = lookup(model_type, model)
    opts = {"attention": attention, "mlp": mlp, "fuse_block": fuse_block, "kv_quant": kv_quant,
            "kv_cache": kv_cache, "mlp_variant": mlp_variant, "tune": tune,
            "dequant_cap": f"{cap / MIB:g} MiB ({cap_source}{grows})"}
    # No kernel backend: only the composites can beat stock (reference is the same math as
    # stock), and only by measurement or the prior; which modules they take: Dispatch.admits
    # (quantized weights, and bfloat16 ones where MLX runs on the CPU).
    no_kernels = no_kernel_backend(choice)
    if no_kernels and tune == "off":
        dispatch = None
    else:
        dispatch = Dispatch(choice, tune, progress=progress, settings={
            MLP_PIECE.kind.name: {"variant": mlp_variant, "fixed": fixed}},
            common={CAP_SETTING: cap, CAP_STRICT_SETTING: strict})
    report = PatchReport(model_type=model_type, architecture=arch, backend=choice,
                         options=opts, dispatch=dispatch)
    layers = getattr(model, "layers", None)
    if layout is None and isinstance(layers, (list, tuple)) and (
            any(map(has_experts, layers)) or any(map(has_mixer, layers))):
        report.n_layers = len(layers)
        for i, layer in enumerate(layers):
            if getattr(layer, "self_attn", None) is not None or not has_mixer(layer):
                unlisted_layer(report, i, layer, model_type)
            patch_mixers(report, i, layer, opts, choice.name, dispatch)
            patch_experts(report, i, layer, opts, choice.name, dispatch, None)
        if no_kernels and report.n_patched == 0:
            report.dispatch = None
    elif layout is None:
        report.modules.append(ModuleReport(
            None, "model", FALLBACK,
            reason=f"model_type {model_type!r} is not in the patch table "
                   f"(supported: {', '.join(supported_model_types())})"))
    elif not isinstance(layers, (list, tuple)):
        report.modules.append(ModuleReport(
            None, "model", FALLBACK, reason="model has no list of decoder layers (model.layers)"))
    else:
        report.n_layers = len(layers)
        types = layer_types(model, layout.layer_types) if layout.layer_types else None
        for i, layer in enumerate(layers):
            _patch_layer(report, i, layer, layout, opts, choice.name, dispatch, types)
            patch_mixers(report, i, layer, opts, choice.name, dispatch)
            patch_experts(report, i, layer, opts, choice.name, dispatch, layout)
        record_weight_formats(report, layers, layout)
        if no_kernels and report.n_patched == 0:
            report.dispatch = None  # nothing admitted (a float16 model): exactly stock
    if report.dispatch is not None:  # one call per layer and forward: what a build is weighed
        report.dispatch.calls_hint = max(1, report.n_layers)  # against (tune.prior.pays)
    if kv_cache == "q8_0" and layout is not None:
        _route_q8_0_cache(model, report, choice.name)
    patched = [m for m in model.modules() if is_patched(m)]
    if report.dispatch is not None:  # first-use costs paid while loading, not by the prompt
        report.warm_s = warm_first_use(patched, choice.name)
    # decode: one check per forward switches the patched modules to their stock classes
    gate_model(model, patched, choice.name)
    object.__setattr__(model, "_bricks_report", report)
    return report


def _weight_bytes(model) -> int:
    """Bytes of the model's parameters (what the default dequantize cap is relative to)."""
    from mlx.utils import tree_flatten

    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def _route_q8_0_cache(model, report: PatchReport, backend: str) -> None:
    """``kv_cache="q8_0"``: route the model file's stock attention to the Q8_0 cache readers
    (undone by ``unpatch_model``) and record the per-layer cache plan."""
    from mlx_bricks import cache as kv

    kv.register_with_mlx_lm()  # so mlx-lm's load_prompt_cache can rebuild Q8KVCache
    undo = kv.route_attention(model)
    object.__setattr__(model, "_bricks_kv_undo", undo)
    # a model dropped without unpatch_model (a server swapping models) gives its route back
    weakref.finalize(model, undo)
    report.kv_caches = [(p.layer, p.kind, p.reason)
                        for p in kv.plan_prompt_cache(model, "q8_0", backend=backend)]


#: What the patch keeps in modules' ``__dict__`` besides its state (dropped by
#: :func:`unpatch_model`).
MEMOS = (STAGES_MEMO,)


def unpatch_model(model) -> int:
    """Give every patched module of ``model`` its original class back (stock behaviour).

    Safe on a model that was never patched. Returns the number of modules restored.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    ungate_model(model)  # every patched module back to its bricks class first
    restored = sum(detach(m) for m in model.modules())
    for m in model.modules():  # the stage lists the patch kept
        for memo in MEMOS:
            m.__dict__.pop(memo, None)
    model.__dict__.pop("_bricks_report", None)
    undo = model.__dict__.pop("_bricks_kv_undo", None)
    if undo is not None:
        undo()
    return restored


@contextlib.contextmanager
def stock_path(model):
    """Within the block, every patched module of ``model`` runs its original class (stock
    code); afterwards the patch is back with the same report, states and counters. For A/B
    timing of one instance in one process (``python -m mlx_bricks.patch``).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an mlx.nn.Module, got {type(model).__name__}")
    gate = model_gate(model)
    if gate is not None:  # the gate must not switch the classes back during the block
        gate.switch(prefill=True)
        gate.suspended = True
    patched = [(m, type(m)) for m in model.modules() if is_patched(m)]
    for m, cls in patched:
        m.__class__ = cls._bricks_base
    try:
        yield model
    finally:
        for m, cls in patched:
            m.__class__ = cls
        if gate is not None:
            gate.suspended = False


def patch_report(model) -> PatchReport | None:
    """The report of the last ``patch_model(model)``, or None if it is not patched."""
    return getattr(model, "__dict__", {}).get("_bricks_report")
