"""How much of a model's prefill arithmetic the patch puts in bricks: a FLOP count per decoder
layer, split by whether the module computing it is patched.

Counted per prompt token at prompt length ``tokens`` (one sequence, no cache):

- every ``nn.Linear`` / ``nn.QuantizedLinear`` of a layer: ``2 * in * out``;
- MoE experts (``SwitchGLU``: gate, up, down; ``SwitchMLP``: fc1, fc2): ``2 * in * out`` per
  projection times the tokens' experts (``top_k``);
- the attention core of each module with q/k/v projections: ``4 * n_heads * head_dim * keys``
  (scores and the weighted sum), ``keys`` the average number of keys a query sees: ``(tokens +
  1) / 2`` causal, ``w - w (w - 1) / (2 tokens)`` for a sliding window ``w < tokens``;
- a multi-head latent attention module (``bricks.mla.piece.prefill_flops``): its projections
  (on the linear pieces: not counted as a mixer's own projections), the key and value
  decompressions, DeepSeek-V3.2's indexer and the core ``2 * n_heads * (q_head + v_head) *
  keys``, each part where it runs (the key decompression and the indexer's key projection
  stock; a call whose keys exceed the indexer's top-k runs stock whole).

- the recurrence of a gated-delta mixer (a module of a ``patch.modules.MIXERS`` piece of the
  ``gated_delta`` kind): ``6 * Hv * Dk * Dv`` (the state's products with k and q and its
  rank-1 update, per value head), in bricks when the mixer is patched. A patched mixer's own
  projections run mlx-lm's linears inside it (stock GEMMs): they count as in bricks like the
  rest of a patched module and are also reported apart (``mixer_linears``), except those its
  piece runs as ``linear`` stages (the GEMM brick: the piece's ``stage_names``).

Norms, RoPE, routers' softmax/top-k, activations and other recurrent mixers' state updates
(Mamba: only their projections are counted) are left out: a few percent at most of a
transformer layer. The embedding lookup costs nothing; the LM head (``2 * D * vocab`` per token)
is reported apart (mlx-lm computes it for every prompt token). A module is "in bricks" when it
or an enclosing module of its layer is patched (``nn.is_patched``); the count does not know
which calls fall back at run time (decode, masks, caches: the report's ``stock_calls``).
"""
from __future__ import annotations

import mlx.nn as nn

from mlx_bricks.bricks.mla.piece import is_mla
from mlx_bricks.bricks.mla.piece import prefill_flops as mla_prefill_flops
from mlx_bricks.nn import is_patched
from mlx_bricks.runtime.classes import base_class

_HEADS = ("n_heads", "num_attention_heads", "num_heads")
_TOP_K = ("num_experts_per_tok", "top_k", "num_experts_per_token", "k")


def _linear_flops(m) -> int:
    """``2 * in * out`` of one ``nn.Linear`` / ``nn.QuantizedLinear`` (per token)."""
    w = m.weight
    if isinstance(m, nn.QuantizedLinear):
        return 2 * w.shape[0] * w.shape[1] * 32 // m.bits
    return 2 * w.shape[0] * w.shape[1]


def _switch_flops(m, top_k: int) -> int:
    """Per token: each expert projection ``(E, out, in)`` times ``top_k`` experts."""
    total = 0
    for _, child in m.named_modules():
        w = child.get("weight") if isinstance(child, dict) else None
        if w is not None and w.ndim == 3 and child is not m:
            cols = w.shape[2] * 32 // child.bits if hasattr(child, "bits") else w.shape[2]
            total += 2 * w.shape[1] * cols * top_k
    return total


def _keys(tokens: int, window) -> float:
    if window is None or window >= tokens:
        return (tokens + 1) / 2
    return window - window * (window - 1) / (2 * tokens)


def _attention_core(m, tokens: int, window) -> int:
    """Scores and weighted sum of an attention module with ``q_proj`` (per token)."""
    heads = next((getattr(m, a) for a in _HEADS if isinstance(getattr(m, a, None), int)), None)
    q = m.get("q_proj")
    if heads is None or not hasattr(q, "weight"):
        return 0
    head_dim = q.weight.shape[0] // heads  # rows: the output width, packed or not
    return int(4 * heads * head_dim * _keys(tokens, window))


def _class_name(m) -> str:
    """``m``'s mlx-lm class name (a patched module's class is the bricks class over it)."""
    return base_class(m).__name__


def _top_k(parent, default) -> int:
    for a in _TOP_K:
        v = getattr(parent, a, None)
        if isinstance(v, int) and v > 0:
            return v
    return default


def prefill_flops(model, tokens: int = 2048) -> dict:
    """FLOPs per prompt token of ``model``'s decoder layers, split by patched or not.

    Args:
        model: an mlx-lm model (patched or not) with ``layers``; its weights are only looked
            at for their shapes (a model built lazily at full size is not evaluated).
        tokens: the prompt length the attention core is averaged over (> 0).

    Returns:
        ``{"bricks": F, "stock": F, "share": bricks / (bricks + stock), "lm_head": F,
        "layers": [(bricks, stock) per layer], "mixer_linears": F, "by_class": {class name
        of a layer's child: [bricks, stock]}}`` with F in FLOPs per token.

    Raises:
        ValueError: ``tokens`` is not a positive int, or the model has no ``layers``.
    """
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens <= 0:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (list, tuple)):
        raise ValueError("model has no list of decoder layers (model.layers)")
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    from mlx_bricks.patch.modules import mixer_piece
    from mlx_bricks.patch.table import model_args

    args = model_args(model)
    default_k = _top_k(args, 1)
    per_layer = []
    mixer_linears = 0
    by_class: dict[str, list[int]] = {}
    for layer in layers:
        counts = [0, 0]  # bricks, stock

        def add(flops, patched, top):
            counts[0 if patched else 1] += flops
            by_class.setdefault(top, [0, 0])[0 if patched else 1] += flops

        skip: set[int] = set()  # a mixer's linears that run as its GEMM stages

        def walk(m, patched, parent, top, in_mixer=False):
            nonlocal mixer_linears
            patched = patched or is_patched(m)
            if is_mla(m):  # multi-head latent attention (bricks/mla): part by part
                bricks, stock = mla_prefill_flops(m, tokens, patched, _linear_flops)
                add(bricks, True, top)
                add(stock, False, top)
                return
            piece = mixer_piece(m)
            if piece is not None:  # a token mixer: its own linears are counted apart too
                in_mixer = patched
                staged = getattr(piece, "stage_names", None)
                if patched and staged is not None:  # projections run as GEMM stages
                    for name in staged(m, None):
                        add(_linear_flops(m[name]), True, top)
                        skip.add(id(m[name]))
                if getattr(getattr(piece, "kind", None), "name", None) == "gated_delta":
                    try:
                        _, hv, dk, dv, _ = piece.heads(m)
                        add(6 * hv * dk * dv, patched, top)
                    except AttributeError:  # a gated-delta module the pieces do not know
                        pass
            if isinstance(m, (SwitchGLU, SwitchMLP)):
                add(_switch_flops(m, _top_k(parent, default_k)), patched, top)
                return
            if isinstance(m, (nn.Linear, nn.QuantizedLinear)):
                if id(m) in skip:  # counted above, on the GEMM brick
                    return
                add(_linear_flops(m), patched, top)
                mixer_linears += _linear_flops(m) if in_mixer else 0
                return
            if getattr(piece, "attention_core", False):  # a mixer piece's attention core
                heads, head_dim = piece.core_dims(m)
                add(int(4 * heads * head_dim * _keys(tokens, None)), patched, top)
            elif piece is None and isinstance(m, dict) and "q_proj" in m and "k_proj" in m:
                state = m.__dict__.get("_bricks_state")
                window = None
                if state is not None and state.layout is not None:  # a mixer's: no window
                    from mlx_bricks.nn.calls import layer_window

                    window = layer_window(m, state.layout, state.sliding)[0]
                add(_attention_core(m, tokens, window), patched, top)
            for child in m.children().values():
                for c in child if isinstance(child, (list, tuple)) else [child]:
                    if isinstance(c, nn.Module):
                        walk(c, patched, m, _class_name(c) if m is layer else top, in_mixer)

        walk(layer, False, None, _class_name(layer))
        per_layer.append(tuple(counts))
    bricks = sum(b for b, _ in per_layer)
    stock = sum(s for _, s in per_layer)
    head = getattr(model, "lm_head", None) or getattr(getattr(model, "language_model", None),
                                                      "lm_head", None)
    lm_head = _linear_flops(head) if isinstance(head, (nn.Linear, nn.QuantizedLinear)) else 0
    if not lm_head and args is not None:
        lm_head = 2 * getattr(args, "hidden_size", 0) * getattr(args, "vocab_size", 0)
    total = bricks + stock
    return {"bricks": bricks, "stock": stock, "share": bricks / total if total else 0.0,
            "lm_head": lm_head, "layers": per_layer, "mixer_linears": mixer_linears,
            "by_class": by_class}


def _main(argv=None) -> int:
    """``python -m mlx_bricks.patch.coverage [--tokens N] [NAME ...]``: the share of each
    real-size model's prefill FLOPs in bricks (``patch.real_configs``: built lazily, patched
    on the reference backend as asked), per family; "own proj": the patched mixers' own
    projections (in bricks with their module, but mlx-lm's linears inside it); then the
    classes whose FLOPs stay stock."""
    import argparse

    from mlx_bricks.patch.core import patch_model
    from mlx_bricks.patch.real_configs import CONFIGS, build

    parser = argparse.ArgumentParser(prog="python -m mlx_bricks.patch.coverage",
                                     description=_main.__doc__)
    parser.add_argument("names", nargs="*", help=f"configs (default all: {', '.join(CONFIGS)})")
    parser.add_argument("--tokens", type=int, default=2048, help="prompt length (default 2048)")
    args = parser.parse_args(argv)
    print(f"{'model':28} {'model_type':18} {'in bricks':>10} {'own proj':>9} {'GFLOP/token':>12}")
    for name in args.names or list(CONFIGS):
        model = build(name)
        patch_model(model, backend="reference")
        f = prefill_flops(model, args.tokens)
        total = f["bricks"] + f["stock"]
        print(f"{name:28} {CONFIGS[name][0]:18} {100 * f['share']:9.1f}% "
              f"{100 * f['mixer_linears'] / total:8.1f}% {total / 1e9:12.2f}")
        stock = sorted(((s, c) for c, (_, s) in f["by_class"].items() if s), reverse=True)
        if stock:
            print(f"{'':28} stock: " + ", ".join(f"{c} {100 * s / total:.1f}%"
                                                   for s, c in stock))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
