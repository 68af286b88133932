"""Structure checks of patched modules (shared by patch time and call time): whether a block,
an attention module or a single piece's module can run its bricks for an input dtype, cached
per module by the identity of the layers and arrays it looked at; and the weight formats a
module's bricks read (for the report)."""
from __future__ import annotations

from mlx_bricks.bricks.norm_qkv.piece import rms_norm_reason
from mlx_bricks.bricks.swiglu.piece import MLP_PIECE
from mlx_bricks.formats.layers import format_name, linear_reason, role_reason


def attention_sharding_reason(attn, layout) -> str | None:
    """Why the attention's tensor-parallel sharding is not mlx-lm's (None: plain, or q/k/v
    column-sharded and o row-sharded; ``formats.layers.role_reason``)."""
    return role_reason((layout.q_proj, layout.k_proj, layout.v_proj), (layout.o_proj,), attn)


def attention_reason(attn, layout, dtype=None) -> str | None:
    """Why the attention module's layers cannot feed the bricks for ``dtype`` (None: they
    can): q/k/v/o linears, their sharding, the per-head norms of the layout."""
    for n in layout.attention_linears_of(attn):
        r = linear_reason(n, getattr(attn, n, None), dtype)
        if r is not None:
            return r
    r = attention_sharding_reason(attn, layout)
    if r is None and layout.has_qk_norm(attn):
        for n in layout.qk_norms_of(attn):
            r = rms_norm_reason(n, getattr(attn, n, None), layout, dtype)
            if r is not None:
                return r
    return r


def block_reason(block, layout, dtype=None) -> str | None:
    """Why the block cannot run the unified prefill for ``dtype`` (None: it can)."""
    for n in (layout.input_norm, layout.post_attention_norm):
        r = rms_norm_reason(n, getattr(block, n), layout, dtype)
        if r is not None:
            return r
    return (attention_reason(getattr(block, layout.attention), layout, dtype)
            or MLP_PIECE.reason(getattr(block, layout.mlp), layout, dtype))


def _fingerprint(module, names, out: list) -> None:
    """Append the identity of each child ``names`` of ``module`` and of its weight array (and
    scales: ``set_dtype`` casts a quantized layer's scales but not its packed uint32 weight)
    to ``out`` (plain dict lookups: ``nn.Module`` is a dict of its children and arrays). A
    layer swapped (LoRA, ``nn.quantize``) or its arrays replaced (``set_dtype``,
    ``load_weights``) changes it."""
    get = module.get
    for n in names:
        child = get(n)
        out.append(id(child))
        if child is not None:
            out.append(id(child.get("weight")))
            out.append(id(child.get("scales")))


def structure_reason(module, state, dtype) -> str | None:
    """Why the module's current structure cannot run the bricks for ``dtype`` (None: it can).

    The full check (module types, weight dtypes) runs again only when the layers or arrays it
    looked at are other objects than last time (LoRA adapters attached, ``nn.quantize``,
    ``set_dtype``, ``load_weights``): comparing their identities costs a few microseconds per
    call, the checks themselves far more.
    """
    lay = state.layout
    token: list = [dtype]
    if state.role == "block":
        _fingerprint(module, (lay.input_norm, lay.post_attention_norm, lay.attention, lay.mlp),
                     token)
        attn, mlp = module.get(lay.attention), module.get(lay.mlp)
    else:
        attn = mlp = module
    if state.role in ("block", "self_attn") and isinstance(attn, dict):
        _fingerprint(attn, lay.attention_linears_of(attn) + lay.qk_norms_of(attn), token)
    if state.role == "block" and isinstance(mlp, dict):
        _fingerprint(mlp, lay.mlp_linears, token)
    if state.piece is not None:
        _fingerprint(module, state.piece.linears(lay), token)
        # other children the piece's check reads (a SwitchGLU's activation module)
        token.extend(id(module.get(n)) for n in getattr(state.piece, "watched", ()))
    token = tuple(token)
    if state.structure is not None and state.structure[0] == token:
        return state.structure[1]
    if state.role == "block":
        reason = block_reason(module, lay, dtype)
    elif state.role == "self_attn":
        reason = attention_reason(module, lay, dtype)
    else:
        reason = state.piece.reason(module, lay, dtype)
    state.structure = (token, reason)
    return reason


def linears(module, role: str, layout, piece=None) -> dict:
    """``{projection name: layer}`` of the linear layers a module of ``role`` (``"block"``,
    ``"self_attn"``, or a single ``piece``'s role) feeds its bricks from, attention ones first
    (None for a missing one)."""
    def child(parent, n):  # nn.Module is a dict of its children
        return parent.get(n) if isinstance(parent, dict) else None

    out = {}
    if role in ("block", "self_attn"):
        attn = child(module, layout.attention) if role == "block" else module
        names = layout.attention_linears_of(attn) if attn is not None else \
            layout.attention_linears
        out.update({n: child(attn, n) for n in names})
    if role == "block":
        mlp = child(module, layout.mlp)
        out.update({n: child(mlp, n) for n in layout.mlp_linears})
    elif piece is not None:
        out.update({n: child(module, n) for n in piece.linears(layout)})
    return out


def weight_formats(module, role: str, layout, piece=None) -> dict[str, str]:
    """``{projection name: format_name(...)}`` of :func:`linears`."""
    return {n: format_name(m) for n, m in linears(module, role, layout, piece).items()}
