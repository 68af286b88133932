"""A model's prompt cache with Q8_0 K/V (:func:`make_prompt_cache`, :func:`plan_prompt_cache`), and
the attention that reads it (:func:`q8_0_cache_attention`, :func:`route_attention`)."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

from mlx_bricks.cache.q8 import Q8_CACHES, Q8KVCache, _brick_backend
from mlx_bricks.bricks.q8_0.op import QK8_0, dequantize_q8_0
from mlx_bricks.options import KV_CACHES


# --- building a model's cache ------------------------------------------------------------------

@dataclass(frozen=True)
class LayerCache:
    """One entry of :func:`plan_prompt_cache`: the cache object of a layer and why it is that
    kind (``kind`` is the class name)."""

    layer: int
    cache: object
    reason: str

    @property
    def kind(self) -> str:
        return type(self.cache).__name__


def _head_dim(model, i: int) -> int | None:
    """head_dim of layer ``i``'s attention if it can be read from the model, else None."""
    layers = getattr(model, "layers", None)
    attn = None
    if layers is not None and i < len(layers):
        attn = getattr(layers[i], "self_attn", None)
    if attn is not None:
        hd = getattr(attn, "head_dim", None)
        if isinstance(hd, int):
            return hd
        kp, n_kv = getattr(attn, "k_proj", None), getattr(attn, "n_kv_heads", None)
        if kp is not None and isinstance(n_kv, int) and n_kv > 0 and "weight" in kp:
            return int(kp.weight.shape[0]) // n_kv
    args = getattr(model, "args", None)
    hd = getattr(args, "head_dim", None)
    if isinstance(hd, int):
        return hd
    hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def _latent(model, i: int, n: int) -> bool:
    """Whether layer ``i`` (of ``n`` cache entries) attends with multi-head latent attention."""
    from mlx_bricks.bricks.mla.piece import is_mla

    layers = getattr(model, "layers", ())
    return n == len(layers) and any(is_mla(m) for _, m in layers[i].named_modules())


def _stock_reason(c) -> str:
    if isinstance(c, _mlx_cache.RotatingKVCache):
        return (f"RotatingKVCache(max_size={c.max_size}) kept: a sliding-window (or max_kv_size) "
                "layer holds at most max_size tokens, so its memory is bounded already, and it "
                "needs window masks that the attention bricks do not take; no rotating Q8_0 "
                "variant")
    if isinstance(c, _mlx_cache.ArraysCache):
        return "ArraysCache kept: recurrent state, not a KV cache"
    return f"{type(c).__name__} kept: only plain KVCache layers become Q8KVCache"


def plan_prompt_cache(model, kv: str = "q8_0", *, max_kv_size: int | None = None,
                      backend: str | None = None) -> list[LayerCache]:
    """Per layer: the cache :func:`make_prompt_cache` builds and the reason.

    Starts from mlx-lm's own ``make_prompt_cache(model, max_kv_size)`` (so models with
    ``make_cache``, sliding windows included, get what stock gives them) and, for ``kv="q8_0"``,
    replaces every plain ``KVCache`` of a layer whose head_dim is a multiple of 32 by a
    :class:`Q8KVCache`. Everything else is kept, with the reason.

    Raises:
        ValueError: ``kv`` is not ``"q8_0"`` or ``"fp16"``.
    """
    if kv not in KV_CACHES:
        raise ValueError(f"kv must be one of {', '.join(KV_CACHES)}, got {kv!r}")
    stock = _mlx_cache.make_prompt_cache(model, max_kv_size=max_kv_size)
    plan = []
    for i, c in enumerate(stock):
        if kv == "fp16":
            plan.append(LayerCache(i, c, "kv='fp16': mlx-lm's cache"))
        elif type(c) is not _mlx_cache.KVCache:
            plan.append(LayerCache(i, c, _stock_reason(c)))
        elif _latent(model, i, len(stock)):
            plan.append(LayerCache(i, c, "KVCache kept: multi-head latent attention caches "
                                         "latents and rope keys, not K/V"))
        else:
            hd = _head_dim(model, i) if len(stock) == len(getattr(model, "layers", ())) else None
            if hd is not None and hd % QK8_0:
                plan.append(LayerCache(i, c, f"KVCache kept: head_dim {hd} is not a multiple "
                                             f"of {QK8_0} (Q8_0 blocks)"))
            else:
                plan.append(LayerCache(i, Q8KVCache(backend=backend),
                                       "Q8_0 K/V: 34/64 of the float16 bytes"))
    return plan


def make_prompt_cache(model, kv: str = "q8_0", *, max_kv_size: int | None = None,
                      backend: str | None = None) -> list:
    """The model's prompt cache with Q8_0 K/V where possible (:func:`plan_prompt_cache`).

    Args:
        model: a loaded mlx-lm model.
        kv: ``"q8_0"`` (Q8KVCache for full-attention layers) or ``"fp16"`` (mlx-lm's own cache,
            whatever its dtype: the name says "not quantized").
        max_kv_size: as mlx-lm's ``make_prompt_cache`` (rotating caches, kept stock).
        backend: backend of the Q8_0 quantizer (see :class:`Q8KVCache`); None: the backend the
            model was patched on (``patch_model(kv_cache="q8_0")``), else ``MLX_BRICKS_BACKEND``
            or auto.

    Returns a list with one cache per layer, usable wherever mlx-lm takes ``prompt_cache``,
    *provided* the model's attention reads Q8_0 (patched with ``kv_cache="q8_0"``).
    """
    if backend is None:  # a model patched with kv_cache="q8_0" gives its backend
        report = getattr(model, "__dict__", {}).get("_bricks_report")
        if report is not None and report.options.get("kv_cache") == "q8_0":
            backend = report.backend.name
    return [p.cache for p in plan_prompt_cache(model, kv, max_kv_size=max_kv_size,
                                               backend=backend)]


# --- attention over the cache ------------------------------------------------------------------

def q8_0_cache_attention(queries, keys, values, *, scale, mask=None, backend=None):
    """Attention of ``queries`` over the Q8_0 K/V a :class:`Q8KVCache` returned: the drop-in
    for mlx-lm's ``scaled_dot_product_attention`` on layers with this cache.

    Args:
        queries: (B, Hq, L, D) float16/bfloat16/float32.
        keys, values: ``(qs, d)`` tuples from ``Q8KVCache.update_and_fetch``.
        scale: Python float.
        mask: None, ``"causal"`` or an mx.array mask.
        backend: bricks backend (None: auto).

    Dispatch: ``L <= DECODE_MAX_LQ`` (decode, speculative drafts) -> ``ops.decode_attention``
    (flash-decoding, GQA-grouped, reads the quants); longer L -> ``ops.flash_attention`` with
    ``kv_quant="q8_0"`` (prefill brick, reads the quants) when it supports head_dim; an array
    mask or a head_dim the prefill brick lacks -> K/V dequantized to the queries' dtype and
    ``mx.fast.scaled_dot_product_attention`` (correct, costs a full-precision copy of the
    layer's K/V for the call).

    Returns (B, Hq, L, D) of the queries' dtype.
    """
    from mlx_bricks import ops
    from mlx_bricks.bricks.attention import msl as prefill
    from mlx_bricks.bricks.decode.op import DECODE_MAX_LQ

    L, D = queries.shape[2], queries.shape[3]
    if not isinstance(mask, mx.array):
        if L <= DECODE_MAX_LQ:
            return ops.decode_attention(queries, keys, values, scale=scale, mask=mask,
                                        kv_quant="q8_0",
                                        backend=_brick_backend("decode_attention", backend))
        if D in prefill.SUPPORTED_HEAD_DIMS:
            return ops.flash_attention(queries, keys, values, scale=scale, mask=mask,
                                       kv_quant="q8_0",
                                       backend=_brick_backend("flash_attention", backend))
    be = _brick_backend("q8_0_dequantize", backend)
    k = dequantize_q8_0(*keys, dtype=queries.dtype, backend=be)
    v = dequantize_q8_0(*values, dtype=queries.dtype, backend=be)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)


# --- routing mlx-lm's attention -------------------------------------------------------------------

#: module name -> (original scaled_dot_product_attention, number of active routes)
_ROUTES: dict[str, list] = {}


def _route_module(name: str):
    """Route ``name``'s ``scaled_dot_product_attention`` (counted); returns its undo."""
    module = sys.modules[name]
    if name not in _ROUTES:
        original = module.scaled_dot_product_attention

        def routed(queries, keys, values, cache, scale, mask, sinks=None):
            if isinstance(cache, Q8_CACHES):
                if sinks is not None:
                    raise ValueError("attention sinks are not supported with a Q8_0 KV cache")
                return q8_0_cache_attention(queries, keys, values, scale=scale, mask=mask,
                                            backend=cache.backend)
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                            sinks=sinks)

        module.scaled_dot_product_attention = routed
        _ROUTES[name] = [original, 0]
    _ROUTES[name][1] += 1
    done = []

    def undo():
        if done:
            return
        done.append(True)
        entry = _ROUTES[name]
        entry[1] -= 1
        if entry[1] == 0:
            module.scaled_dot_product_attention = entry[0]
            del _ROUTES[name]

    return undo


def route_attention(model):
    """Make ``model``'s stock attention read :class:`Q8KVCache` layers through the bricks.

    mlx-lm's attention modules call the module-level name ``scaled_dot_product_attention`` of
    their model file (``mlx_lm/models/llama.py`` etc., imported from ``models/base.py``). This
    replaces that name in every model file the model's modules come from (smollm3's and the
    mistral3 wrapper's attention is llama.py's) by a function that sends a call whose
    ``cache`` is a ``Q8KVCache`` to :func:`q8_0_cache_attention` (on the cache's ``backend``)
    and every other call, unchanged, to the original; so it is harmless to other models of the
    same architecture. Routes are counted per module: the original comes back when the last
    one is undone.

    Returns:
        A function of no arguments that undoes this route (idempotent).

    Raises:
        ValueError: none of the model's modules has ``scaled_dot_product_attention``
            (architectures whose attention does not go through ``models/base.py``).
    """
    modules = [model, *(model.modules() if callable(getattr(model, "modules", None)) else ())]
    names = sorted({type(m).__module__ for m in modules
                    if getattr(sys.modules.get(type(m).__module__), "scaled_dot_product_attention",
                               None) is not None})
    if not names:
        raise ValueError(f"{type(model).__module__} has no scaled_dot_product_attention to "
                         "route")
    undos = [_route_module(name) for name in names]

    def undo():
        for u in undos:
            u()

    return undo
