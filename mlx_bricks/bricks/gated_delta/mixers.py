"""The other gated-delta mixers of mlx-lm 0.32.2 as pieces of the Gated DeltaNet brick: Kimi
Delta Attention (a decay per key dim: kimi_linear ``KimiDeltaAttention``, kimi_k3
``KimiK3DeltaAttention``, bailing_moe_v3 ``BailingKDA``) and olmo_hybrid's ``GatedDeltaNet``
(a decay per head, q/k/v convolved apart).

Each family's prefill runs the module's own code (its projections, the big ones as ``linear``
stages on the GEMM brick where the dispatch chooses it; its own short-convolution helpers,
which read and write the cache's conv states; ``normalize_qk``; the gates as
``gated_delta_update`` forms them) up to the recurrence, then the brick's recurrence
(:data:`~mlx_bricks.bricks.gated_delta.kind.GATED_DELTA`) instead of ``gated_delta_update``,
then the module's own cache write, output gate, norm and out-projection (a stage too). What each forward
computes around the recurrence (read from mlx-lm 0.32.2, vetted by fingerprint):

* kimi_linear: q/k/v projections, one ``ShortConv1d`` each (SiLU; masked tokens zeroed;
  cache slots 0-2, ``lengths``); l2-normalised q/k (q scaled by head_dim**-0.5); the gate
  ``a = f_b_proj(f_a_proj(x))`` per key dim, ``g = exp(-exp(A_log) softplus(a + dt_bias))``;
  ``beta = sigmoid(b_proj(x))``; slot 3 the state; ``o_norm(y) * sigmoid(g_b_proj(g_a_proj(x)))``
  then ``o_proj``.
* kimi_k3: one ``ShortConv1d`` over the fused ``qkv_proj`` (slot 0; slot 1 the state), the
  gate as kimi_linear's with ``gate_lower_bound`` (``g = exp(lb sigmoid(exp(A_log) (a +
  dt_bias)))``) when set, the output gate from ``g_proj`` (full rank) or ``g_b_proj(g_a_proj)``.
* bailing_moe_v3: q/k/v convolutions by its ``_causal_conv`` (slots 0-2), the gate from
  ``f_proj`` with ``kda_lower_bound``, ``beta = sigmoid(b_proj(x))`` in float32, output
  ``o_norm(y) * sigmoid(g_proj(x))`` (the gate in float32) then ``o_proj``.
* olmo_hybrid: q/k/v convolutions by its ``_apply_conv1d`` (no masking, no ``lengths``), a
  gate per head from ``a_proj`` / ``b_proj`` (``beta`` in [0, 2] with
  ``linear_allow_neg_eigval``), output ``o_norm(y, g_proj(x))`` (its gated RMSNorm) then
  ``o_proj``.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.gated_delta.op import gated_delta_gates
from mlx_bricks.bricks.gated_delta.piece import QK_EPS, GatedDeltaPiece
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.runtime.classes import base_class


def _normalize(q, k, head_dim: int, scale: float | None = None):
    """mlx-lm's ``normalize_qk`` as the modules call it (eps 1e-6; q scaled by
    ``head_dim**-0.5`` unless the module's own ``scale``)."""
    from mlx_lm.models.gated_delta import normalize_qk

    return normalize_qk(q, k, inv_scale=head_dim ** -0.5 if scale is None else scale,
                        eps=QK_EPS)


def _split_heads(m, x, *arrays):
    """Each (B, T, H * D) array as (B, T, H, D) (the KDA modules' heads)."""
    B, T, _ = x.shape
    return [a.reshape(B, T, m.num_heads, m.head_dim) for a in arrays]


def _kda_gates(m, a, b, lower_bound=None):
    """``(g, beta)`` with a gate per key dim, as ``gated_delta_update`` forms them from the
    module's ``A_log`` (H,) and ``dt_bias`` (H * D,)."""
    H, D = m.num_heads, m.head_dim
    return gated_delta_gates(a, b, m.A_log.reshape(H, 1), m.dt_bias.reshape(H, D),
                             lower_bound=lower_bound)


def _kimi_linear_prologue(m, x, mask, cache, proj):
    B, T, _ = x.shape
    lengths = None if cache is None else cache.lengths
    states = [None] * 3 if cache is None else [cache[i] for i in range(3)]
    if states[0] is None:
        states = [mx.zeros((B, m.conv_kernel - 1, m.projection_dim), dtype=x.dtype)] * 3
    outs = []
    for i, (name, conv) in enumerate((("q_proj", m.q_conv), ("k_proj", m.k_conv),
                                      ("v_proj", m.v_conv))):
        out, states[i] = conv(proj(m, name, x), states[i], mask, lengths)
        outs.append(out)
    if cache is not None:
        for i in range(3):
            cache[i] = states[i]
    q, k, v = _split_heads(m, x, *outs)
    q, k = _normalize(q, k, m.head_dim, m.scale)
    a, = _split_heads(m, x, m.f_b_proj(m.f_a_proj(x)))
    return (q, k, v, *_kda_gates(m, a, m.b_proj(x).reshape(B, T, m.num_heads)))


def _kimi_gate_out(m, x, y, gate, proj):
    gate, = _split_heads(m, x, gate)
    out = m.o_norm(y.reshape(gate.shape)) * mx.sigmoid(gate)
    return proj(m, "o_proj", out.reshape(x.shape[0], x.shape[1], -1))


def _kimi_linear_epilogue(m, x, y, proj):
    return _kimi_gate_out(m, x, y, m.g_b_proj(m.g_a_proj(x)), proj)


def _kimi_k3_prologue(m, x, mask, cache, proj):
    B, T, _ = x.shape
    P = m.projection_dim
    conv_state = None if cache is None else cache[0]
    if conv_state is None:
        conv_state = mx.zeros((B, m.conv_kernel - 1, 3 * P), dtype=x.dtype)
    qkv, conv_state = m.qkv_conv(proj(m, "qkv_proj", x), conv_state, mask,
                                 None if cache is None else cache.lengths)
    if cache is not None:
        cache[0] = conv_state
    q, k, v = _split_heads(m, x, qkv[..., :P], qkv[..., P:2 * P], qkv[..., 2 * P:])
    q, k = _normalize(q, k, m.head_dim, m.scale)
    a, = _split_heads(m, x, m.f_b_proj(m.f_a_proj(x)))
    return (q, k, v, *_kda_gates(m, a, m.b_proj(x).reshape(B, T, m.num_heads),
                                 m.lower_bound))


def _kimi_k3_epilogue(m, x, y, proj):
    gate = proj(m, "g_proj", x) if m.use_full_rank_gate else m.g_b_proj(m.g_a_proj(x))
    return _kimi_gate_out(m, x, y, gate, proj)


def _bailing_prologue(m, x, mask, cache, proj):
    q, k, v = (m._causal_conv(proj(m, name, x), conv, cache, i, mask)
               for i, (name, conv) in enumerate((("q_proj", m.q_conv1d), ("k_proj", m.k_conv1d),
                                                 ("v_proj", m.v_conv1d))))
    q, k, v = _split_heads(m, x, q, k, v)
    q, k = _normalize(q, k, m.head_dim)
    a, = _split_heads(m, x, m.f_proj(x))
    return (q, k, v, *_kda_gates(m, a, m.b_proj(x).astype(mx.float32), m.lower_bound))


def _bailing_epilogue(m, x, y, proj):
    gate, = _split_heads(m, x, proj(m, "g_proj", x))
    out = m.o_norm(y)
    out = out * mx.sigmoid(gate.astype(mx.float32)).astype(out.dtype)
    return proj(m, "o_proj", out.reshape(x.shape[0], x.shape[1], -1))


def _olmo_prologue(m, x, mask, cache, proj):
    q, k, v = (proj(m, n, x) for n in ("q_proj", "k_proj", "v_proj"))
    states = [None] * 3 if cache is None else [cache[i] for i in range(3)]
    q, k, v = (m._apply_conv1d(a, conv, states[i], cache, i) for i, (a, conv) in enumerate(
        ((q, m.q_conv1d), (k, m.k_conv1d), (v, m.v_conv1d))))
    B, S, _ = x.shape
    Hk, Hv, Dk, Dv = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    q, k = _normalize(q.reshape(B, S, Hk, Dk), k.reshape(B, S, Hk, Dk), Dk)
    return (q, k, v.reshape(B, S, Hv, Dv),
            *gated_delta_gates(m.a_proj(x), m.b_proj(x), m.A_log, m.dt_bias,
                               allow_neg_eigval=m.allow_neg_eigval))


def _olmo_epilogue(m, x, y, proj):
    gate = proj(m, "g_proj", x).reshape(-1, m.head_v_dim)
    out = m.o_norm(y.reshape(-1, m.head_v_dim), gate)
    return proj(m, "o_proj", out.reshape(x.shape[0], x.shape[1], -1))


@functools.lru_cache(maxsize=None)
def _mlx_lm_class(module: str, cls: str) -> type:
    return getattr(importlib.import_module(f"mlx_lm.models.{module}"), cls)


@dataclass(frozen=True)
class Family:
    """One mlx-lm gated-delta mixer class this piece follows (module docstring).

    Attributes:
        module, cls: the mlx-lm model file and class (``mlx_lm.models.<module>.<cls>``).
        vetted: the ``patch.vetted`` fingerprint of its ``__call__`` it was read against.
        entries: what the module keeps in each slot of its ``ArraysCache``.
        linears, convs, norm: the children its forward uses (projections, convolutions,
            the output norm), checked present.
        ints: its integer attributes the forward reads.
        gate_linears: ``module -> names``: projections its configuration adds (kimi_k3's
            output gate: full rank or low rank).
        vec: a gate per key dim (Kimi Delta Attention) rather than per head.
        prologue: ``(module, x, mask, cache, proj) -> (q, k, v, g, beta)``: the forward up to
            the recurrence (the conv states read from and written to the cache).
        epilogue: ``(module, x, y, proj) -> output``: the forward after the recurrence and its
            cache write (the state into the cache's last slot, the offset advanced).
            Both call ``proj(module, name, x)`` for each projection of :attr:`staged` (a
            ``linear`` stage or the module's own layer, as the dispatch chose).
        staged: ``module -> names``: the big projections (those that are not a gate's
            low-rank pair or few columns), which may run as stages; ``o_proj`` reads the
            heads after the recurrence, every other one the mixer's input.
    """

    module: str
    cls: str
    vetted: str
    entries: tuple[str, ...]
    linears: tuple[str, ...]
    convs: tuple[str, ...]
    norm: str
    ints: tuple[str, ...]
    vec: bool
    prologue: Callable
    epilogue: Callable
    staged: Callable
    gate_linears: Callable = lambda m: ()

    def resolve(self) -> type:
        """The mlx-lm class (imported once)."""
        return _mlx_lm_class(self.module, self.cls)


_KDA_INTS = ("num_heads", "head_dim")
_KIMI = ("q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj")

#: The Kimi Delta Attention classes (a decay per key dim).
KDA_FAMILIES = (
    Family("kimi_linear", "KimiDeltaAttention",
           "mlx_lm.models.kimi_linear.KimiDeltaAttention.__call__=dac0d1f51245",
           ("q conv", "k conv", "v conv", "recurrent"), (*_KIMI, "g_a_proj", "g_b_proj"),
           ("q_conv", "k_conv", "v_conv"), "o_norm", (*_KDA_INTS, "projection_dim", "conv_kernel"),
           True,
           _kimi_linear_prologue, _kimi_linear_epilogue,
           lambda m: ("q_proj", "k_proj", "v_proj", "o_proj")),
    Family("kimi_k3", "KimiK3DeltaAttention",
           "mlx_lm.models.kimi_k3.KimiK3DeltaAttention.__call__=ae67c47aad89",
           ("conv", "recurrent"), ("qkv_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj"),
           ("qkv_conv",), "o_norm", (*_KDA_INTS, "projection_dim", "conv_kernel"), True,
           _kimi_k3_prologue, _kimi_k3_epilogue,
           lambda m: ("qkv_proj", *(("g_proj",) if m.use_full_rank_gate else ()), "o_proj"),
           lambda m: ("g_proj",) if m.use_full_rank_gate else ("g_a_proj", "g_b_proj")),
    Family("bailing_moe_v3", "BailingKDA",
           "mlx_lm.models.bailing_moe_v3.BailingKDA.__call__=8c93a8da928b",
           ("q conv", "k conv", "v conv", "recurrent"),
           ("q_proj", "k_proj", "v_proj", "f_proj", "b_proj", "g_proj", "o_proj"),
           ("q_conv1d", "k_conv1d", "v_conv1d"), "o_norm",
           (*_KDA_INTS, "projection_size", "conv_kernel_size"), True, _bailing_prologue,
           _bailing_epilogue, lambda m: ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")),
)
#: olmo_hybrid's Gated DeltaNet (a decay per head).
OLMO_FAMILIES = (
    Family("olmo_hybrid", "GatedDeltaNet",
           "mlx_lm.models.olmo_hybrid.GatedDeltaNet.__call__=7615a29d02aa",
           ("q conv", "k conv", "v conv", "recurrent"),
           ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_proj"),
           ("q_conv1d", "k_conv1d", "v_conv1d"), "o_norm",
           ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel_size"),
           False, _olmo_prologue, _olmo_epilogue,
           lambda m: ("q_proj", "k_proj", "v_proj", "g_proj", "o_proj")),
)


class FamilyPiece(GatedDeltaPiece):
    """Gated-delta mixers of known families (:class:`Family`) as one piece each (the mixer
    protocol: ``mlx_bricks.nn.mixer``); call checks, shape key and placeholders as the Gated
    DeltaNet piece's."""

    def __init__(self, name: str, families: tuple[Family, ...]):
        self.name = name
        self.families = families
        self.vetted = tuple(f.vetted for f in families)
        self.watched = tuple(dict.fromkeys(n for f in families for n in (*f.convs, f.norm)))
        self._linears = tuple(dict.fromkeys(
            (*(n for f in families for n in f.linears), "g_proj", "g_a_proj", "g_b_proj")))

    def family(self, module) -> Family | None:
        """The family of ``module``'s mlx-lm class (exact class), or None."""
        cls = base_class(module)
        return next((f for f in self.families if f.resolve() is cls), None)

    def matches(self, module) -> bool:
        return self.family(module) is not None

    def cache_entries(self, module) -> tuple[str, ...]:
        return self.family(module).entries

    def heads(self, module):
        if self.family(module).vec:
            H, D = module.num_heads, module.head_dim
            return H, H, D, D, True
        return super().heads(module)

    out_projection = "o_proj"

    def projections(self, module) -> tuple[str, ...]:
        """The family's big projections (:attr:`Family.staged`)."""
        return self.family(module).staged(module)

    def prologue(self, module, inputs, call, run):
        """The family's prologue, its big projections through ``run`` as chosen (stages); the
        state from the cache's last slot (float32 zeros when empty, as
        ``gated_delta_update``). Returns ``(args, (inputs, proj))``."""
        cache, mask = call["cache"], call["mask"]
        proj = self._projector(module, inputs.dtype, run)
        q, k, v, g, beta = self.family(module).prologue(module, inputs, mask, cache, proj)
        state = None if cache is None else cache[len(cache.cache) - 1]
        if state is None:
            B, _, Hv, Dv = v.shape
            state = mx.zeros((B, Hv, Dv, q.shape[3]), dtype=mx.float32)
        return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state,
                "mask": mask}, (inputs, proj)

    def epilogue(self, module, out, ctx, inputs, call):
        y, state = out
        x, proj = ctx
        cache = call["cache"]
        if cache is not None:
            cache[len(cache.cache) - 1] = state
            cache.advance(inputs.shape[1])
        return self.family(module).epilogue(module, x, y, proj)

    def linears(self, layout=None, module=None) -> tuple[str, ...]:
        """The linear layers the piece reads (structure fingerprint)."""
        return self._linears

    def reason(self, module, layout=None, dtype=None) -> str | None:
        """Why ``module`` cannot run the piece (None: it can): missing or unexpected parts,
        an input dtype other than float16 / bfloat16 / float32."""
        fam = self.family(module)
        if fam is None:
            cls = base_class(module)
            return f"{cls.__module__}.{cls.__name__}: not a {self.name} class this piece follows"
        for name in (*fam.linears, *fam.gate_linears(module), *fam.convs):
            if not isinstance(module.get(name), nn.Module):
                return f"{name} is missing"
        for name in ("A_log", "dt_bias"):
            if not isinstance(module.get(name), mx.array):
                return f"{name} is missing"
        if not callable(module.get(fam.norm)):
            return f"{fam.norm} is missing"
        for name in fam.ints:
            if not isinstance(getattr(module, name, None), int):
                return f"{name} is not an int"
        if not fam.vec and module.num_v_heads % module.num_k_heads:
            return f"num_v_heads {module.num_v_heads} is not a multiple of {module.num_k_heads}"
        if dtype is not None and dtype not in FLOAT_DTYPES:
            return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
        return None


KDA_PIECE = FamilyPiece("Kimi Delta Attention", KDA_FAMILIES)
"""kimi_linear, kimi_k3, bailing_moe_v3: the gated delta rule with a decay per key dim."""
OLMO_GDN_PIECE = FamilyPiece("Gated DeltaNet (olmo_hybrid)", OLMO_FAMILIES)
"""olmo_hybrid: the gated delta rule with a decay per head."""
