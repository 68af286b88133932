"""A Q8_0 KV cache that follows mlx-lm's cache protocol, and attention over it.

:class:`Q8KVCache` stores K and V as ggml's Q8_0 blocks along head_dim (int8 quants ``qs`` and a
float16 scale ``d`` per 32 values: 34 bytes per 32 values, exactly 34/64 of a float16 cache).
New K/V are quantized once, on append (``mlx_bricks.ops.quantize_q8_0``, ggml's rounding), into
buffers that grow in ``step``-sized chunks as mlx-lm's ``KVCache`` does; ``update_and_fetch``
returns the Q8_0 views ``(qs, d)`` of K and V up to ``offset``, which the attention bricks read
directly (:func:`q8_0_cache_attention`: decode brick for a few query tokens, the prefill brick's
Q8_0 path otherwise). Nothing full precision is kept.

mlx-lm protocol (0.32, ``mlx_lm/models/cache.py``): ``update_and_fetch``, ``offset``,
``state`` (arrays and the offset; mlx-lm 0.32 has no ``meta_state``: scalars ride in ``state``
and ``save_prompt_cache`` serialises them), ``from_state`` (inherited), ``is_trimmable`` /
``trim`` (so ``trim_prompt_cache`` and speculative decoding work), ``make_mask`` (what
``create_attention_mask`` asks the first layer's cache), ``size``, ``empty``, ``nbytes``.
It has no ``to_quantized`` (mlx-lm's ``--kv-bits`` conversion leaves it alone), no ``bits``
attribute (mlx-lm's attention would take it for its own affine cache) and no ``merge`` (batched
generation is not supported).

Loading: ``mlx_lm.models.cache.load_prompt_cache`` rebuilds each cache from its class *name*
looked up in its own module's globals. :func:`register_with_mlx_lm` adds ``Q8KVCache`` there
(explicitly; nothing happens at import), and :func:`load_prompt_cache` is mlx-lm's loader with
that registration done first. ``save_prompt_cache`` needs nothing.

Attention over this cache needs the bricks: mlx-lm's stock attention cannot read ``(qs, d)``
tuples. :func:`q8_0_cache_attention` is the drop-in for mlx-lm's ``scaled_dot_product_attention``
on such a layer, and :func:`route_attention` makes a model's stock attention call it for every
layer whose cache is a ``Q8KVCache`` (what the patch's ``kv_cache="q8_0"`` needs for the calls
it leaves stock, decode included).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache

from mlx_bricks import kernels
from mlx_bricks.backends import resolve_backend
from mlx_bricks.ops._checks import check_array, check_float_dtype
from mlx_bricks.ops.q8_0 import QK8_0, dequantize_q8_0, quantize_q8_0
from mlx_bricks.options import KV_CACHES


def _brick_backend(kernel: str, backend: str | None) -> str:
    """Backend for brick ``kernel`` when the cache's bricks run on ``backend``: the same, except
    ``reference`` (MLX ops, on the GPU too) where that brick has no CUDA twin, even when
    ``cuda`` was asked for explicitly (the cache mixes bricks with and without twins)."""
    name = resolve_backend(backend)
    if name == "cuda" and not kernels.has_kernel(kernel, "cuda"):
        return "reference"
    return name


class Q8KVCache(_mlx_cache._BaseCache):
    """mlx-lm KV cache holding K and V as Q8_0 blocks along head_dim.

    Args:
        backend: backend of the Q8_0 quantizer run on append (None: ``MLX_BRICKS_BACKEND``, then
            auto; resolved at the first append). On ``cuda`` the quantizer runs as MLX ops.

    Attributes:
        keys, values: None before the first append, else ``(qs, d)`` buffers: qs int8
            (B, Hkv, capacity, D), d float16 (B, Hkv, capacity, D // 32). The capacity grows as
            mlx-lm's KVCache's (by multiples of ``step``, cut to the offset first after a
            partial step), so both hold the same capacity after the same appends; a loaded
            cache holds exactly ``offset``. Positions ``>= offset`` are stale.
        offset: number of valid positions (tokens) in the cache.
        step: growth granularity in positions (256, as mlx-lm's KVCache).

    ``update_and_fetch(keys, values)``: keys/values (B, Hkv, L, D) float16/bfloat16/float32,
    ``D % 32 == 0`` (K and V head_dim may differ); returns ``((k_qs, k_d), (v_qs, v_d))`` sliced
    to ``offset`` (views of the buffers, no copy).
    """

    step = 256

    def __init__(self, backend: str | None = None):
        self.keys = None
        self.values = None
        self.offset = 0
        self.backend = backend

    # --- appending -------------------------------------------------------------------------

    def _check_new(self, keys, values):
        for name, x in (("keys", keys), ("values", values)):
            check_array(name, x, ndim=4)
            check_float_dtype(name, x)
            if x.shape[-1] % QK8_0:
                raise ValueError(f"{name}: Q8_0 needs head_dim % {QK8_0} == 0, got shape "
                                 f"{tuple(x.shape)}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} must "
                             "agree in (B, Hkv, L)")
        if self.keys is not None:
            for name, x, buf in (("keys", keys, self.keys), ("values", values, self.values)):
                have = (buf[0].shape[0], buf[0].shape[1], buf[0].shape[3])
                got = (x.shape[0], x.shape[1], x.shape[3])
                if have != got:
                    raise ValueError(f"{name} (B, Hkv, D) = {got} does not match the cache's "
                                     f"{have}")

    def _grow(self, B, H, L, dk, dv):
        prev = self.offset
        n = (self.step + L - 1) // self.step * self.step

        def new(dim):
            return (mx.zeros((B, H, n, dim), mx.int8),
                    mx.zeros((B, H, n, dim // QK8_0), mx.float16))

        if self.keys is None:
            self.keys, self.values = new(dk), new(dv)
            return
        # Drop stale positions past the offset first (after a trim), as KVCache does.
        if prev < self.keys[0].shape[2]:
            self.keys = tuple(x[..., :prev, :] for x in self.keys)
            self.values = tuple(x[..., :prev, :] for x in self.values)
        self.keys = tuple(mx.concatenate([x, y], axis=2) for x, y in zip(self.keys, new(dk)))
        self.values = tuple(mx.concatenate([x, y], axis=2)
                            for x, y in zip(self.values, new(dv)))

    def update_and_fetch(self, keys, values):
        """Quantize ``keys``/``values`` (B, Hkv, L, D) to Q8_0, append them at ``offset`` and
        return the Q8_0 views ``((k_qs, k_d), (v_qs, v_d))`` of positions ``0 .. offset - 1``.

        Raises:
            TypeError: not float mx.arrays.
            ValueError: not 4-D, head_dim not a multiple of 32, or (B, Hkv, D) different from
                what the cache holds.
        """
        self._check_new(keys, values)
        B, H, L, dk = keys.shape
        prev = self.offset
        if self.keys is None or prev + L > self.keys[0].shape[2]:
            self._grow(B, H, L, dk, values.shape[3])
        qb = _brick_backend("q8_0_quantize", self.backend)
        k_new = quantize_q8_0(keys, backend=qb)
        v_new = quantize_q8_0(values, backend=qb)
        self.offset = prev + L
        for buf, new in ((self.keys, k_new), (self.values, v_new)):
            for x, y in zip(buf, new):
                x[..., prev:self.offset, :] = y
        return self.keys_and_values()

    def keys_and_values(self):
        """``((k_qs, k_d), (v_qs, v_d))`` up to ``offset`` (views; the buffers when full)."""
        if self.offset == self.keys[0].shape[2]:
            return self.keys, self.values
        return (tuple(x[..., :self.offset, :] for x in self.keys),
                tuple(x[..., :self.offset, :] for x in self.values))

    def dequantized(self, dtype=mx.float16):
        """K and V up to ``offset`` dequantized to ``dtype`` (new arrays): for consumers that
        cannot read Q8_0 (e.g. stock attention with an array mask)."""
        (kq, kd), (vq, vd) = self.keys_and_values()
        be = _brick_backend("q8_0_dequantize", self.backend)
        return (dequantize_q8_0(kq, kd, dtype=dtype, backend=be),
                dequantize_q8_0(vq, vd, dtype=dtype, backend=be))

    # --- mlx-lm protocol -------------------------------------------------------------------

    @property
    def state(self):
        """``(k_qs, k_d, v_qs, v_d, offset)`` with arrays sliced to ``offset`` (what
        ``save_prompt_cache`` writes and ``generate`` evaluates); Nones when empty."""
        if self.keys is None:
            return None, None, None, None, 0
        (kq, kd), (vq, vd) = self.keys_and_values()
        return kq, kd, vq, vd, self.offset

    @state.setter
    def state(self, v):
        kq, kd, vq, vd, offset = v
        if kq is None:
            self.keys = self.values = None
        else:
            self.keys, self.values = (kq, kd), (vq, vd)
        self.offset = int(offset)
        if not hasattr(self, "backend"):  # from_state builds the object without __init__
            self.backend = None

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last ``min(n, offset)`` positions (they stay in the buffer, stale, and are
        overwritten by the next append); returns how many were dropped."""
        n = min(self.offset, n)
        self.offset -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """mlx-lm's mask for ``N`` new tokens at this offset, as ``KVCache.make_mask``: None for
        N = 1, ``"causal"`` for N > 1, a boolean array with ``return_array`` or a window."""
        return _mlx_cache.create_attention_mask(N, offset=self.offset, return_array=return_array,
                                                window_size=window_size)

    def size(self):
        return self.offset

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        """Bytes of the allocated buffers (capacity, like mlx-lm's KVCache.nbytes)."""
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


def register_with_mlx_lm() -> None:
    """Make ``mlx_lm.models.cache.load_prompt_cache`` (and so ``mlx_lm.generate
    --prompt-cache-file``) able to rebuild :class:`Q8KVCache` from a saved file: it looks cache
    classes up by name in that module's globals, so the class is added there under its name.

    Idempotent. Raises RuntimeError if that module already has a different ``Q8KVCache``.
    """
    have = getattr(_mlx_cache, Q8KVCache.__name__, None)
    if have is None:
        setattr(_mlx_cache, Q8KVCache.__name__, Q8KVCache)
    elif have is not Q8KVCache:
        raise RuntimeError(f"mlx_lm.models.cache already defines another {Q8KVCache.__name__}")


def load_prompt_cache(file_name, return_metadata: bool = False):
    """``mlx_lm.models.cache.load_prompt_cache`` for files that may hold :class:`Q8KVCache`
    layers (calls :func:`register_with_mlx_lm` first). Same arguments and return value."""
    register_with_mlx_lm()
    return _mlx_cache.load_prompt_cache(file_name, return_metadata=return_metadata)


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
    from mlx_bricks.ops import attention as prefill
    from mlx_bricks.ops.decode import DECODE_MAX_LQ

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


def route_attention(model):
    """Make ``model``'s stock attention read :class:`Q8KVCache` layers through the bricks.

    mlx-lm's attention modules call the module-level name ``scaled_dot_product_attention`` of
    their model file (``mlx_lm/models/llama.py`` etc., imported from ``models/base.py``). This
    replaces that name in the model's module by a function that sends a call whose ``cache`` is
    a ``Q8KVCache`` to :func:`q8_0_cache_attention` (on the cache's ``backend``) and every other
    call, unchanged, to the original; so it is harmless to other models of the same
    architecture. Routes are counted per module: the original comes back when the last one is
    undone.

    Returns:
        A function of no arguments that undoes this route (idempotent).

    Raises:
        ValueError: the model's module has no ``scaled_dot_product_attention`` (architectures
            whose attention does not go through ``models/base.py``).
    """
    name = type(model).__module__
    module = sys.modules[name]
    if name not in _ROUTES:
        original = getattr(module, "scaled_dot_product_attention", None)
        if original is None:
            raise ValueError(f"{name} has no scaled_dot_product_attention to route")

        def routed(queries, keys, values, cache, scale, mask, sinks=None):
            if isinstance(cache, Q8KVCache):
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
