"""The Gated DeltaNet brick's piece in a patched mlx-lm model: a Gated DeltaNet mixer module
(qwen3_5 / qwen3_5_moe ``GatedDeltaNet``, qwen3_next ``Qwen3NextGatedDeltaNet``; mlx-lm 0.32.2)
whose prefill runs its own projections, causal conv1d + SiLU, q/k normalisation and gates
(mlx-lm's code, as the module's ``__call__`` runs it), then the brick's recurrence
(:data:`~mlx_bricks.bricks.gated_delta.kind.GATED_DELTA`) instead of ``gated_delta_update``,
then its own gated RMSNorm and out-projection; the cache's conv state and recurrent state are
written as the module writes them.

Only the classes in :func:`known_classes` are patched by this piece (their forward is the one
this file follows); kimi_linear, kimi_k3, bailing_moe_v3 and olmo_hybrid have their pieces in
``mixers.py``; any other module whose ``__call__`` calls ``gated_delta_update`` (a subclass
included) stays stock with the reason.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.gated_delta.kind import GATED_DELTA
from mlx_bricks.bricks.gated_delta.op import gated_delta_gates
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.runtime.classes import base_class

#: The mixer's name in reports.
MIXER = "Gated DeltaNet"
#: The l2-norm eps mlx-lm's modules pass to ``normalize_qk``.
QK_EPS = 1e-6


def known_classes() -> dict[type, tuple[str, ...]]:
    """mlx-lm's Gated DeltaNet classes this piece follows -> their input projections."""
    from mlx_lm.models import qwen3_5, qwen3_next

    return {qwen3_5.GatedDeltaNet: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
            qwen3_next.Qwen3NextGatedDeltaNet: ("in_proj_qkvz", "in_proj_ba")}


def calls_gated_delta(module) -> bool:
    """Whether ``module``'s class's ``__call__`` refers to mlx-lm's ``gated_delta_update`` (the
    name among its code's globals or closure variables): a Gated DeltaNet mixer, known to this
    piece or not."""
    call = getattr(base_class(module), "__call__", None)  # a patched module: its mlx-lm class
    code = getattr(call, "__code__", None)
    return code is not None and "gated_delta_update" in (*code.co_names, *code.co_freevars)


def gdn_reason(module, dtype=None) -> str | None:
    """Why ``module`` cannot run the Gated DeltaNet piece (None: it can): a class whose forward
    this piece does not follow (a subclass included), a sharded module, missing or
    unexpected parts."""
    cls = base_class(module)
    projections = known_classes().get(cls)
    if projections is None:
        return (f"{cls.__module__}.{cls.__name__}: a {MIXER} forward the "
                "patch does not know (patched: qwen3_5 GatedDeltaNet, qwen3_next "
                "Qwen3NextGatedDeltaNet, and those of bricks/gated_delta/mixers.py)")
    if getattr(module, "sharding_group", None) is not None:
        return "tensor-parallel (sharding_group set): stock keeps the all-sums"
    for name in (*projections, "out_proj"):
        if not isinstance(module.get(name), nn.Module):
            return f"{name} is missing"
    conv = module.get("conv1d")
    if not isinstance(conv, nn.Conv1d) or "bias" in conv:
        return "conv1d is not a bias-free nn.Conv1d"
    for name in ("A_log", "dt_bias"):
        if not isinstance(module.get(name), mx.array):
            return f"{name} is missing"
    if not callable(module.get("norm")):
        return "norm is missing"
    for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim",
                 "conv_dim", "conv_kernel_size"):
        if not isinstance(getattr(module, name, None), int):
            return f"{name} is not an int"
    if module.num_v_heads % module.num_k_heads:
        return f"num_v_heads {module.num_v_heads} is not a multiple of {module.num_k_heads}"
    if dtype is not None and dtype not in FLOAT_DTYPES:
        return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
    return None


def cache_reason(cache, entries: tuple[str, ...] = ("conv", "recurrent")) -> str | None:
    """Why the call's cache is not one the piece writes as the module does (None: it is): an
    ``ArraysCache`` of ``entries`` (what the module keeps in each slot)."""
    if cache is None:
        return None
    from mlx_lm.models.cache import ArraysCache

    if not isinstance(cache, ArraysCache):
        return f"cache {type(cache).__name__} is not an ArraysCache"
    if len(cache.cache) != len(entries):
        return (f"ArraysCache of {len(cache.cache)} entries, expected {len(entries)} "
                f"({', '.join(entries)})")
    return None


def prologue(m, inputs, mask, cache, proj):
    """The module's own computation up to ``gated_delta_update`` (mlx-lm 0.32.2's
    ``GatedDeltaNet.__call__`` / ``Qwen3NextGatedDeltaNet.__call__``): the projections (each
    through ``proj(module, name, x)``: the module's linear, or its GEMM piece), the conv state
    read and written, conv1d + SiLU, q/k normalisation and the gates.

    Returns ``(args, z)``: the brick's arguments (q, k, v, g, beta, state, mask) and the
    output gate z (B, S, Hv, Dv).
    """
    from mlx_lm.models import qwen3_5
    from mlx_lm.models.gated_delta import normalize_qk

    B, S, _ = inputs.shape
    if base_class(m) is qwen3_5.GatedDeltaNet:
        mixed = proj(m, "in_proj_qkv", inputs)
        z = proj(m, "in_proj_z", inputs).reshape(B, S, m.num_v_heads, m.head_v_dim)
        b = m.in_proj_b(inputs)
        a = m.in_proj_a(inputs)
    else:
        q, k, v, z, b, a = m.fix_query_key_value_ordering(proj(m, "in_proj_qkvz", inputs),
                                                           m.in_proj_ba(inputs))
        mixed = mx.concatenate([q.reshape(B, S, -1), k.reshape(B, S, -1),
                                v.reshape(B, S, -1)], axis=-1)
    if cache is not None and cache[0] is not None:
        conv_state = cache[0]
    else:
        conv_state = mx.zeros((B, m.conv_kernel_size - 1, m.conv_dim), dtype=inputs.dtype)
    if mask is not None:
        mixed = mx.where(mask[..., None], mixed, 0)
    conv_input = mx.concatenate([conv_state, mixed], axis=1)
    if cache is not None:
        n_keep = m.conv_kernel_size - 1
        if cache.lengths is not None:
            ends = mx.clip(cache.lengths, 0, S)
            positions = (ends[:, None] + mx.arange(n_keep))[..., None]
            cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
        else:
            cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
    conv_out = nn.silu(m.conv1d(conv_input))
    q, k, v = [t.reshape(B, S, h, d) for t, h, d in zip(
        mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
        [m.num_k_heads, m.num_k_heads, m.num_v_heads],
        [m.head_k_dim, m.head_k_dim, m.head_v_dim])]
    state = cache[1] if cache else None
    q, k = normalize_qk(q, k, inv_scale=m.head_k_dim ** -0.5, eps=QK_EPS)
    g, beta = gated_delta_gates(a, b, m.A_log, m.dt_bias)
    if state is None:  # mlx-lm starts from float32 zeros
        state = mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state, "mask": mask}, z


def epilogue(m, y, state, z, cache, S, proj):
    """The module's own computation after ``gated_delta_update``: the recurrent state and the
    offset written to the cache, the gated RMSNorm, the out-projection (through ``proj``)."""
    if cache is not None:
        cache[1] = state
        cache.advance(S)
    out = m.norm(y, z)
    return proj(m, "out_proj", out.reshape(y.shape[0], S, -1))


def projections(m) -> tuple[str, ...]:
    """The module's big projections (the input ones that are not the gates' few columns, and
    out_proj): those the piece runs as ``linear`` stages."""
    from mlx_lm.models import qwen3_5

    if base_class(m) is qwen3_5.GatedDeltaNet:
        return ("in_proj_qkv", "in_proj_z", "out_proj")
    return ("in_proj_qkvz", "out_proj")


class GatedDeltaPiece:
    """A Gated DeltaNet mixer as one piece (what ``mlx_bricks.nn.mixer.BricksMixer`` runs; the
    protocol is that module's docstring).

    Attributes:
        role: the module's role in reports (``"linear_attn"``, its attribute in the layer).
        kind: the op kind (:data:`~mlx_bricks.bricks.gated_delta.kind.GATED_DELTA`).
        bricks: the brick ops the module runs in prefill (for the report).
    """

    name = MIXER
    role = "linear_attn"
    kind = GATED_DELTA
    bricks = (GATED_DELTA.op_name,)
    watched = ("conv1d", "norm")
    call_names = ("mask", "cache")
    #: The forwards this piece follows (``patch.vetted`` fingerprints, mlx-lm 0.32.2).
    vetted = ("mlx_lm.models.qwen3_5.GatedDeltaNet.__call__=190c5a99ab7d",
              "mlx_lm.models.qwen3_next.Qwen3NextGatedDeltaNet.__call__=65ff8ae4bfdf")

    def matches(self, module) -> bool:
        """Whether ``module`` is a Gated DeltaNet mixer (known to this piece or not)."""
        return calls_gated_delta(module)

    def prior_saving(self, module, backend: str) -> float:
        """Seconds per prompt token this mixer's prefill saves on ``backend`` once warm
        (``tune.prior.saved_s_per_token``; ``kind.SAVED_S_PER_TOKEN_STATE`` per state
        element), 0 where nothing was measured."""
        from mlx_bricks.bricks.gated_delta.kind import SAVED_S_PER_TOKEN_STATE

        _, hv, dk, dv, _ = self.heads(module)
        return SAVED_S_PER_TOKEN_STATE.get(backend, 0.0) * hv * dk * dv

    def call_reason(self, module, inputs, call) -> str | None:
        """Why this call's mask or cache is not one the piece follows (None: it is)."""
        mask = call["mask"]
        if mask is not None and (not isinstance(mask, mx.array) or mask.dtype != mx.bool_
                                 or tuple(mask.shape) != tuple(inputs.shape[:2])):
            return "mask is not a (B, L) bool array"
        return cache_reason(call["cache"], self.cache_entries(module))

    def cache_entries(self, module) -> tuple[str, ...]:
        """What ``module`` keeps in each slot of its ``ArraysCache``."""
        return ("conv", "recurrent")

    def shape_key(self, module, inputs, call) -> tuple:
        return (inputs.shape, inputs.dtype, call["mask"] is not None, call["cache"] is None)

    def stage_names(self, module, dtype) -> tuple[str, ...]:
        """The projections of :meth:`projections` that run as ``linear`` stages
        (``bricks.gemm.piece.stage_names``)."""
        from mlx_bricks.bricks.gemm.piece import stage_names

        return stage_names(module, self.projections(module), dtype)

    def stages(self, module, inputs, call) -> dict:
        """The projections on the GEMM brick (``linear`` kind), each tuned and guarded as
        every linear: ``{name: (LINEAR, its arguments as shapes)}``. Their inputs: the
        mixer's input, and for ``out_proj`` the normed heads (B, S, Hv * Dv)."""
        from mlx_bricks.bricks.gemm import piece as linear_piece
        from mlx_bricks.runtime.kind import Act

        B, S, _ = inputs.shape
        _, Hv, _, Dv, _ = self.heads(module)
        x = Act(tuple(inputs.shape), inputs.dtype)
        out = self.out_projection
        return {n: (linear_piece.KIND, linear_piece.linear_args(
                    module[n], Act((B, S, Hv * Dv), inputs.dtype) if n == out else x))
                for n in self.stage_names(module, inputs.dtype)}

    #: The output projection (its input: the heads after the recurrence, (B, S, Hv * Dv));
    #: every other stage reads the mixer's input.
    out_projection = "out_proj"

    def projections(self, module) -> tuple[str, ...]:
        """The module's projections that may run as stages (:func:`projections`)."""
        return projections(module)

    def prologue(self, module, inputs, call, run):
        proj = self._projector(module, inputs.dtype, run)
        args, z = prologue(module, inputs, call["mask"], call["cache"], proj)
        return args, (z, proj)

    def epilogue(self, module, out, ctx, inputs, call):
        y, state = out
        z, proj = ctx
        return epilogue(module, y, state, z, call["cache"], inputs.shape[1], proj)

    def _projector(self, module, dtype, run):
        """``proj(module, name, x)``: a stage through ``run`` (brick or stock, as chosen), any
        other projection the module's own layer (``bricks.gemm.piece.projector``)."""
        from mlx_bricks.bricks.gemm.piece import projector

        return projector(self.stage_names(module, dtype), run)

    def linears(self, layout=None, module=None) -> tuple[str, ...]:
        """The linear layers the piece reads (structure fingerprint)."""
        return ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz",
                "in_proj_ba", "out_proj")

    def reason(self, module, layout=None, dtype=None) -> str | None:
        return gdn_reason(module, dtype)

    def heads(self, module) -> tuple[int, int, int, int, bool]:
        """``(Hk, Hv, Dk, Dv, vec)``: the recurrence's heads and head dims, and whether its gate
        is per key dim."""
        return (module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim,
                False)

    def placeholders(self, module, inputs, call) -> dict:
        """The kind's arguments as shapes (``runtime.kind.Act``) for the dispatcher's key."""
        from mlx_bricks.runtime.kind import Act

        mask = call["mask"]
        B, S, _ = inputs.shape
        Hk, Hv, Dk, Dv, vec = self.heads(module)
        return {"q": Act((B, S, Hk, Dk), inputs.dtype), "k": Act((B, S, Hk, Dk), inputs.dtype),
                "v": Act((B, S, Hv, Dv), inputs.dtype),
                "g": Act((B, S, Hv, Dk) if vec else (B, S, Hv), mx.float32),
                "beta": Act((B, S, Hv), inputs.dtype),
                "state": Act((B, Hv, Dv, Dk), mx.float32),
                "mask": None if mask is None else Act((B, S), mx.bool_)}


GDN_PIECE = GatedDeltaPiece()
