"""The MLA piece: an mlx-lm multi-head latent attention module (``family.FAMILIES``) patched by
module (``patch.modules.MIXERS``), its prefill split into pieces (``forward.mla_forward``): the
projections (``q_proj`` or ``q_a_proj`` / ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``
(``kv`` caches), the value decompression ``unembed_out`` as one GEMM over all heads, the output
gates' ``g_proj``, ``o_proj`` / ``dense``) on the ``linear`` kind and the attention core on the
``attention`` kind (query head ``dn + dr``, value head ``dv``); the key decompression
``embed_q(latent)`` (a batched product whose weight is laid out for the absorbed decode, not for
the GEMM brick), the norms, RoPE and the cache writes are the module's own code.

Why a mixer and not a patch-table layout: the table's attention is q/k/v/o projections into
heads of one width; MLA has none of those (a latent, a shared rope key, two head widths, a cache
of latents). Why no MLA kind of its own: the core is the attention kind (with ``Dv < D``) and the
projections are linears, each tuned and guarded as everywhere else; what is MLA-specific is
their composition and the form rule (``op.choose_form``), which live here.

Decode (L == 1) stays mlx-lm's absorbed step. A prefill chunk over a cache chooses its form by
FLOPs: decompressed (the bricks) or absorbed (mlx-lm's decode computation for every query, MLX
ops; counted as a stock call with the reason).
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.attention.msl import SUPPORTED_HEAD_DIMS
from mlx_bricks.bricks.attention.op import check_value_dim
from mlx_bricks.bricks.attention.piece import KIND as ATTENTION
from mlx_bricks.bricks.gemm import piece as linear_piece
from mlx_bricks.bricks.mla.family import FAMILIES, facts_of
from mlx_bricks.bricks.mla.forward import LINEAR, dims, form_of, kv_cache_of, mla_forward, \
    value_weight
from mlx_bricks.bricks.mla.op import ABSORBED
from mlx_bricks.bricks.sparse_attention.kind import SPARSE_ATTENTION
from mlx_bricks.bricks.sparse_attention.piece import is_sparse, sparse_args
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.formats.layers import linear_reason, role_reason
from mlx_bricks.runtime.kind import Act
from mlx_bricks.runtime.classes import base_class

#: The mixer's name in reports.
MIXER = "MLA"
#: Every linear child the piece may read (the structure fingerprint).
LINEARS = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj",
           "o_proj", "dense", "embed_q", "unembed_out")


def is_mla(module) -> bool:
    """Whether ``module`` is an MLA module (known or not): it has ``kv_a_proj_with_mqa``."""
    return isinstance(module, nn.Module) and "kv_a_proj_with_mqa" in module


def projections(m, facts) -> tuple[str, ...]:
    """The module's linear projections, in forward order."""
    q = ("q_proj",) if "q_proj" in m else ("q_a_proj", "q_b_proj")
    kv = ("kv_a_proj_with_mqa", "kv_b_proj") if facts.cache == "kv" else ("kv_a_proj_with_mqa",)
    gate = ("g_proj",) if facts.gate == "per_head" or (
        facts.gate == "elementwise" and getattr(m, "use_gate", False)) else ()
    return (*q, *kv, *gate, facts.out)


def _multilinear_reason(m, name, shape, dtype) -> str | None:
    from mlx_lm.models.mla import MultiLinear, QuantizedMultiLinear

    layer = m.get(name)
    if type(layer) not in (MultiLinear, QuantizedMultiLinear):
        return f"{name} is {type(layer).__name__}, not mlx-lm's MultiLinear"
    got = tuple(layer.weight.shape)
    if isinstance(layer, MultiLinear):
        if got != shape:
            return f"{name}.weight has shape {got}, expected {shape}"
        if dtype is not None and layer.weight.dtype != dtype:
            return f"{name}.weight is {dtype_name(layer.weight.dtype)} but the input is " \
                   f"{dtype_name(dtype)}"
    elif got[:2] != shape[:2]:
        return f"{name}.weight has shape {got}, expected {shape[:2]} leading"
    return None


def mla_reason(m, dtype=None) -> str | None:
    """Why module ``m`` cannot run the MLA piece for ``dtype`` (None: it can)."""
    cls = base_class(m)
    facts = facts_of(cls)
    if facts is None:
        known = ", ".join(sorted(FAMILIES))
        return (f"{cls.__module__}.{cls.__name__}: an {MIXER} forward the patch does not know "
                f"(patched: {known})")
    for name in ("heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        attr = facts.heads if name == "heads" else name
        if not isinstance(getattr(m, attr, None), int):
            return f"{attr} is not an int"
    H, r, dn, dr, dv = dims(m, facts)
    names = projections(m, facts)
    for n in names:
        why = linear_reason(n, m.get(n), dtype)
        if why is not None:
            return why
    why = role_reason(names[:-1], names[-1:], m)
    if why is not None:
        return why
    if facts.cache == "latent":
        why = (_multilinear_reason(m, "embed_q", (H, r, dn), dtype)
               or _multilinear_reason(m, "unembed_out", (H, dv, r), dtype))
        if why is not None:
            return why
    if dn + dr not in SUPPORTED_HEAD_DIMS:
        return (f"query head_dim {dn} + {dr} is not one of the attention brick's "
                f"({', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
    try:
        check_value_dim(dv, dn + dr, False)
    except ValueError as e:
        return str(e)
    if facts.rope and not callable(m.get("rope", getattr(m, "rope", None))):
        return "rope is missing"
    if not isinstance(getattr(m, facts.scale, None), (int, float)):
        return f"{facts.scale} is not a number"
    if facts.indexer:
        from mlx_bricks.bricks.sparse_attention.piece import indexer_reason

        why = indexer_reason(m)
        if why is not None:
            return why
    if dtype is not None and dtype not in FLOAT_DTYPES:
        return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
    return None


def cache_reason(facts, cache) -> str | None:
    """Why the call's cache is not one the piece writes as the module does (None: it is)."""
    from mlx_lm.models.cache import CacheList, KVCache

    if cache is None:
        return None
    if facts.indexer:
        if type(cache) is not CacheList or len(cache.caches) != 2 or \
                any(type(c) is not KVCache for c in cache.caches):
            return f"cache is {type(cache).__name__}, not a CacheList of two KVCaches"
        return None
    if type(cache) is not KVCache:
        return f"cache is {type(cache).__name__}, not KVCache"
    return None


class MLAPiece:
    """MLA modules as a mixer of several pieces (``nn.mixer``'s protocol; module docstring).

    Args:
        call_names: the ``__call__`` arguments after the input this piece's classes take
            (``("mask", "cache")``; mistral4: ``("attn_scale", "mask", "cache")``).
    """

    name = MIXER
    role = "mla"
    kind = ATTENTION
    bricks = (LINEAR.op_name, ATTENTION.op_name)
    watched = ("kv_a_layernorm", "q_a_layernorm", "rope", "indexer")

    def __init__(self, call_names: tuple[str, ...]):
        self.call_names = call_names
        self.vetted = tuple(f.fingerprint for f in FAMILIES.values()
                            if f.call_names == call_names)

    def matches(self, module) -> bool:
        """An MLA module whose known call takes this piece's arguments (an unknown MLA
        module: the ``("mask", "cache")`` piece, which reports it stock)."""
        if not is_mla(module):
            return False
        facts = facts_of(base_class(module))
        names = facts.call_names if facts is not None else ("mask", "cache")
        return names == self.call_names

    def reason(self, module, layout=None, dtype=None) -> str | None:
        return mla_reason(module, dtype)

    def linears(self, layout=None, module=None) -> tuple[str, ...]:
        return LINEARS

    def call_reason(self, module, inputs, call) -> str | None:
        """Why this call's mask, cache or ``attn_scale`` is not one the piece follows."""
        facts = facts_of(base_class(module))
        L = inputs.shape[1]
        why = cache_reason(facts, call["cache"])
        if why is not None:
            return why
        kv = kv_cache_of(call["cache"], facts)
        S = L + (kv.offset if kv is not None else 0)
        mask = call["mask"]
        if not (isinstance(mask, str) and mask == "causal") and not (
                isinstance(mask, mx.array) and mask.dtype == mx.bool_
                and tuple(mask.shape) == (L, S)):
            what = f"an array {tuple(mask.shape)}" if isinstance(mask, mx.array) else repr(mask)
            return f"mask is {what}: not mlx-lm's causal mask (\"causal\" or ({L}, {S}) bool)"
        if facts.attn_scale:
            scale = call["attn_scale"]
            if not isinstance(scale, mx.array) or tuple(scale.shape) != (L, 1):
                return f"attn_scale is not the model's ({L}, 1) query scaling: stock"
        return None

    def shape_key(self, module, inputs, call) -> tuple:
        kv = kv_cache_of(call["cache"], facts_of(base_class(module)))
        mask = call["mask"]
        return (inputs.shape, inputs.dtype, 0 if kv is None else kv.offset,
                mask if isinstance(mask, str) else "array")

    def pieces(self, module, inputs, call) -> dict:
        """Every piece of this call shape with its arguments as shapes."""
        m, facts = module, facts_of(base_class(module))
        B, L, _ = inputs.shape
        dt = inputs.dtype
        H, r, dn, dr, dv = dims(m, facts)
        kv = kv_cache_of(call["cache"], facts)
        S = L + (kv.offset if kv is not None else 0)
        ins = {"kv_b_proj": Act((B, L, r), dt), facts.out: Act((B, L, H * dv), dt)}
        if "q_a_proj" in m:  # rows: the output width, packed or not
            ins["q_b_proj"] = Act((B, L, m.q_a_proj.weight.shape[0]), dt)
        out = {n: (LINEAR, linear_piece.linear_args(m[n], ins.get(n, inputs)))
               for n in projections(m, facts)}
        if facts.indexer and is_sparse(m, S):  # DSA: the top-k keys of each query
            out["sparse_attention"] = (SPARSE_ATTENTION, sparse_args(
                m, Act((B, H, L, dn), dt), Act((B, H, L, dr), dt), Act((B, 1, S, r), dt),
                Act((B, 1, S, dr), dt), Act((B, 1, L, m.indexer.index_topk), mx.uint32),
                getattr(m, facts.scale)))
            return out
        if form_of(m, facts, L, S - L) == ABSORBED:
            return out
        w = value_weight(m, H) if facts.cache == "latent" else None
        if w is not None:
            out["unembed_out"] = (LINEAR, {"x": Act((B, S, r), dt), "weight": w, "bias": None,
                                           "residual": None})
        out["attention"] = (ATTENTION, {
            "q": Act((B, H, L, dn + dr), dt), "k": Act((B, H, S, dn + dr), dt),
            "v": Act((B, H, S, dv), dt), "scale": getattr(m, facts.scale), "mask": "causal",
            "kv_quant": None})
        return out

    def forward(self, module, inputs, call, run):
        facts = facts_of(base_class(module))
        kv = kv_cache_of(call["cache"], facts)
        L = inputs.shape[1]
        S = L + (kv.offset if kv is not None else 0)
        if not (facts.indexer and is_sparse(module, S)) and \
                form_of(module, facts, L, S - L) == ABSORBED:
            module._bricks_state.stock[
                "attention: absorbed form (fewer FLOPs than decompressing the cache)"] += 1
        return mla_forward(module, facts, inputs, call["mask"], call["cache"], run,
                           call.get("attn_scale"))


MLA_PIECE = MLAPiece(("mask", "cache"))
"""DeepSeek-V2/V3/V3.2, GLM-4.7-Flash, Kimi, LongCat, Bailing, MiniCPM3, Youtu-LLM MLA."""
MLA_SCALED_PIECE = MLAPiece(("attn_scale", "mask", "cache"))
"""mistral4's MLA (called with the Llama-4 query scaling)."""


def prefill_flops(m, tokens: int, patched: bool, linear_flops) -> tuple[float, float]:
    """``(in bricks, stock)`` FLOPs per prompt token of MLA module ``m`` in a prefill of
    ``tokens`` tokens from an empty cache (``patch.coverage``; ``linear_flops(layer)``: its
    ``2 * in * out``). Bricks, where ``patched`` and the module runs the piece: the
    projections, the value decompression over all heads (where ``unembed_out`` is float or
    affine) and the attention core ``2 H (dn + dr + dv)`` per visible key (``(tokens + 1) / 2``
    on average). Stock: the key decompression ``2 H r dn`` (``embed_q``, a batched product),
    DeepSeek-V3.2's indexer key projection (its query and weight projections are not computed
    while the keys fit ``index_topk``); everything when unpatched or for an unknown module.
    When the indexer selects (more than ``index_topk`` keys): in bricks the projections and
    the sparse attention over ``min(position + 1, index_topk)`` keys a query (absorbed:
    ``2 H (2 r + dr)`` per key); stock the indexer (its projections and scores) and the
    queries' absorption and the outputs' ``unembed_out`` (``2 H r (dn + dv)``)."""
    facts = facts_of(base_class(m))
    if facts is None:
        return 0.0, sum(linear_flops(c) for _, c in m.named_modules()
                        if isinstance(c, (nn.Linear, nn.QuantizedLinear)))
    H, r, dn, dr, dv = dims(m, facts)
    proj = sum(linear_flops(m[n]) for n in projections(m, facts))
    keys = (tokens + 1) / 2
    bricks, stock = float(proj), 0.0
    if facts.cache == "latent":
        stock += 2 * H * r * dn
        if value_weight(m, H) is not None:
            bricks += 2 * H * r * dv
        else:
            stock += 2 * H * r * dv
    if facts.indexer:
        idx = m.indexer
        top = idx.index_topk
        if tokens > top:  # DSA: the sparse-attention brick over each query's top k
            keys = (top * (top + 1) / 2 + (tokens - top) * top) / tokens
            scored = (tokens + 1) / 2
            stock = sum(linear_flops(idx[n]) for n in ("wq_b", "wk", "weights_proj"))
            stock += 2 * idx.n_heads * idx.head_dim * scored + 2 * H * r * (dn + dv)
            core = 2 * H * (2 * r + dr) * keys
            if not patched:
                return 0.0, stock + proj + core
            return proj + core, stock
        stock += linear_flops(idx.wk)
    bricks += 2 * H * (dn + dr + dv) * keys
    if not patched:
        return 0.0, bricks + stock
    return bricks, stock
