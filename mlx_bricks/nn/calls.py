"""Per-call checks of the patched attention and block modules: whether this call (its input,
mask, cache, extra arguments) is one the bricks compute, and the call-shape key their choices
are remembered under. The structure of the module is checked apart (``nn.structure``)."""
from __future__ import annotations

import functools
import weakref

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, ChunkedKVCache, KVCache, RotatingKVCache

from mlx_bricks.bricks.attention.piece import kv_length
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name

#: Stock-call reason for single-token steps: decode is stock by design, not a fallback.
DECODE = "decode (L == 1): stock path by design"

_Q8KVCache: list = []  # mlx_bricks.cache.Q8KVCache, imported late (that module imports the ops)


def is_q8_cache(cache) -> bool:
    """True for a ``mlx_bricks.cache.Q8KVCache`` (exact type)."""
    if not _Q8KVCache:
        from mlx_bricks.cache import Q8KVCache

        _Q8KVCache.append(Q8KVCache)
    return type(cache) is _Q8KVCache[0]


def layer_window(attn, layout, sliding=None) -> tuple[int | None, str | None]:
    """``(window, reason)`` of an attention module: ``(None, None)`` on a global layer,
    ``(layout.sliding_window, None)`` on a sliding-window layer, ``(None, reason)`` when the
    window length is unknown. ``sliding``: whether the layer slides, decided at patch time from
    the layer or the model's args (``BricksState.sliding``); None: ``layout.sliding`` set on
    the module."""
    if sliding is None:
        sliding = layout.sliding is not None and bool(getattr(attn, layout.sliding, False))
    if not sliding:
        return None, None
    if layout.sliding_window is None:
        return None, ("sliding-window layer: the model's args have no "
                      f"{layout.window_arg or 'window length'}")
    return layout.sliding_window, None


def _array_mask_reason(mask, cache, L: int, window, keys=None) -> str | None:
    """On a sliding-window layer (``window`` set) or a model that passes its causal mask as an
    array (``BlockLayout.causal_array``): None when the brick's causal mask (with ``window``,
    bottom-right aligned over the keys the cache returns) computes what mlx-lm's mask does.

    mlx-lm (``base.create_attention_mask``, ``RotatingKVCache.make_mask``) gives a sliding layer
    ``"causal"`` while the window cannot exclude a key, else the 2-D boolean
    ``create_causal_mask(L, offset, window_size)`` of shape (L, keys); ``return_array=True``
    gives the same without a window. Batch padding masks are 4-D and fall back. A
    ``RotatingKVCache`` (sliding layers only) returns its keys in temporal order when
    ``keep == 0`` (``_update_concat``), which the bottom-right alignment needs. ``keys``: the
    number of keys when they do not come from ``cache`` (gemma4's shared K/V), else None."""
    caches = (KVCache, RotatingKVCache) if window is not None else (KVCache,)
    if cache is not None and type(cache) not in caches:
        names = " or ".join(c.__name__ for c in caches)
        return f"cache is {type(cache).__name__}, not {names}"
    if type(cache) is RotatingKVCache and cache.keep:
        return f"RotatingKVCache keeps {cache.keep} leading tokens: keys are not contiguous"
    if isinstance(mask, str) and mask == "causal":
        return None
    if (isinstance(mask, mx.array) and mask.dtype == mx.bool_
            and tuple(mask.shape) == (L, kv_length(cache, L) if keys is None else keys)):
        return None
    what = f"an array {tuple(mask.shape)}" if isinstance(mask, mx.array) else repr(mask)
    kind = "sliding-window" if window is not None else "causal"
    return f"mask is {what}: not mlx-lm's (L, keys) {kind} mask"


#: Masks ``BatchKVCache.make_mask`` returned without a window: ``id(mask) -> weakref``. A
#: padded batch is admitted only with one of these, so a mask of the same shape built otherwise
#: (a caller's own, a window, a VLM's extra masking) is never read as causal + left padding.
_BATCH_MASKS: dict[int, weakref.ref] = {}


def track_batch_masks() -> None:
    """Wrap ``BatchKVCache.make_mask`` (once per process) so that the masks it makes without a
    ``window_size`` are recorded (:data:`_BATCH_MASKS`, weak references: no mask is kept
    alive). The value it returns is unchanged. Called by ``patch_model``."""
    original = BatchKVCache.make_mask
    if getattr(original, "_bricks_tracked", False):
        return

    @functools.wraps(original)
    def make_mask(self, *args, **kwargs):
        mask = original(self, *args, **kwargs)
        if isinstance(mask, mx.array) and kwargs.get("window_size") is None:
            key = id(mask)
            _BATCH_MASKS[key] = weakref.ref(mask, lambda _, key=key: _BATCH_MASKS.pop(key, None))
        return mask

    make_mask._bricks_tracked = True
    BatchKVCache.make_mask = make_mask


def _made_by_batch_cache(mask) -> bool:
    ref = _BATCH_MASKS.get(id(mask))
    return ref is not None and ref() is mask


def _batch_mask_reason(x, mask, cache, window) -> str | None:
    """A ``BatchKVCache`` call (mlx-lm's ``BatchGenerator``, a padded batch): None when the
    mask is the one ``cache.make_mask(L)`` builds, decided from types and shapes (no host
    sync): boolean, shape (B, 1, L, ``_idx + L``). The brick then takes it as causal plus
    ``kv_start = cache.left_padding`` (``bricks.attention.piece.masking``). Sliding-window
    layers (``BatchRotatingKVCache``, or a window over a ``BatchKVCache``) stay stock."""
    B, L = x.shape[0], x.shape[1]
    if window is not None:
        return (f"cache is BatchKVCache on a sliding-window layer (window {window}): the "
                "padded batch with a window runs stock")
    want = (B, 1, L, kv_length(cache, L))
    lp = getattr(cache, "left_padding", None)
    if not isinstance(lp, mx.array) or tuple(lp.shape) != (B,):
        return "BatchKVCache without a (B,) left_padding array: padded batch runs stock"
    if (isinstance(mask, mx.array) and mask.dtype == mx.bool_
            and tuple(mask.shape) == want):
        if _made_by_batch_cache(mask):
            return None
        return (f"mask is a {want} array that BatchKVCache.make_mask did not make (without a "
                "window): padded batch runs stock")
    what = f"an array {tuple(mask.shape)}" if isinstance(mask, mx.array) else repr(mask)
    return f"mask is {what}: not BatchKVCache.make_mask's {want} padded-batch mask"


def mask_key(mask, cache, L: int, keys=None):
    """The mask as a call-shape key: an accepted array mask by its key count (``keys`` when
    they do not come from ``cache``), a padded batch's (``BatchKVCache``) as its own flag."""
    if type(cache) is BatchKVCache and isinstance(mask, mx.array):
        return ("padded", kv_length(cache, L))
    n = kv_length(cache, L) if keys is None else keys
    return ("array", n) if isinstance(mask, mx.array) else mask


def cache_offset(cache) -> int:
    """The cache's position as a call-shape key part: ``offset`` (an int), ``_idx`` for a
    ``BatchKVCache`` (whose ``offset`` is a per-row array), 0 without a cache."""
    if cache is None:
        return 0
    return cache._idx if type(cache) is BatchKVCache else cache.offset


def chunked_reason(mask, cache, L: int, chunk: int) -> str | None:
    """A chunked-attention call (llama4's RoPE layers: ``ChunkedKVCache``, the mask
    ``(block_pos == 0) & (key <= query)`` over the keys from ``cache.start_position``): None
    when the queries and keys all lie in one chunk of ``chunk`` tokens, where that mask is
    plain bottom-right causal; a call across a chunk boundary runs stock."""
    if cache is not None and type(cache) is not ChunkedKVCache:
        return f"cache is {type(cache).__name__} on a chunked-attention layer, not ChunkedKVCache"
    start = 0 if cache is None else cache.start_position
    end = L if cache is None else cache.offset + L
    if start // chunk != (end - 1) // chunk:
        return (f"chunked attention across a chunk boundary (keys {start}..{end - 1}, chunks "
                f"of {chunk}): the block-diagonal mask runs stock")
    want = (L, end - start)
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_ and tuple(mask.shape) == want:
        return None
    what = f"an array {tuple(mask.shape)}" if isinstance(mask, mx.array) else repr(mask)
    return f"mask is {what}: not mlx-lm's {want} chunked-attention mask"


def call_reason(x, mask, cache, args, kwargs, window=None, causal_array=False,
                keys=None, chunk=None) -> str | None:
    """Per-call conditions shared by attention and block (cheap checks first); ``window``:
    the layer's sliding window (:func:`layer_window`), ``causal_array``: the layout's (both
    accept mlx-lm's array masks, :func:`_array_mask_reason`); ``keys``: the key count when
    the keys do not come from ``cache`` (gemma4's shared K/V); ``chunk``: the chunk length of
    a chunked-attention layer (:func:`chunked_reason`)."""
    if args or kwargs:
        extra = [f"{len(args)} extra positional"] if args else []
        extra += sorted(kwargs)
        return f"extra call arguments ({', '.join(extra)}): passed to the stock path"
    if not isinstance(x, mx.array) or x.ndim != 3:
        return "input is not a (B, L, D) array"
    if x.shape[1] == 1:
        return DECODE
    if x.dtype not in FLOAT_DTYPES:
        return f"input dtype {dtype_name(x.dtype)} is not float16/bfloat16/float32"
    if chunk is not None:
        return chunked_reason(mask, cache, x.shape[1], chunk)
    if type(cache) is BatchKVCache:
        return _batch_mask_reason(x, mask, cache, window)
    if window is not None or causal_array:
        return _array_mask_reason(mask, cache, x.shape[1], window, keys)
    if mask is not None and not (isinstance(mask, str) and mask == "causal"):
        what = "an array" if isinstance(mask, mx.array) else repr(mask)
        return f"mask is {what} (sliding window or padding): the attention brick takes causal only"
    if cache is not None and type(cache) is not KVCache and not is_q8_cache(cache):
        return f"cache is {type(cache).__name__}, not KVCache or Q8KVCache"
    return None


def split_call(names: tuple[str, ...], args, kwargs) -> tuple[dict, tuple, dict]:
    """``(values, rest, rest_kwargs)``: a module call's arguments after ``x`` bound to the
    layout's ``names`` (``BlockLayout.call_args``: positionally, then by keyword; None where
    not given), and the arguments left over (a leftover sends the call to the stock path)."""
    values = dict(zip(names, args))
    rest_kwargs = {}
    for k, v in kwargs.items():
        if k in names and k not in values:
            values[k] = v
        else:
            rest_kwargs[k] = v
    for n in names:
        values.setdefault(n, None)
    return values, tuple(args[len(names):]), rest_kwargs


def call_args(names: tuple[str, ...], values: dict, cache) -> tuple:
    """The positional arguments after ``x`` of a call with ``values`` and ``cache``."""
    return tuple(cache if n == "cache" else values[n] for n in names)


def piece_call_reason(x, args, kwargs) -> str | None:
    """Per-call conditions of a single-piece module (an MLP): ``(..., L, D)`` float input,
    L > 1 (decode stays stock), no extra call arguments."""
    if args or kwargs:
        return f"extra call arguments ({len(args)} positional, {sorted(kwargs)}): stock"
    if not isinstance(x, mx.array) or x.ndim < 2:
        return "input is not a (..., L, D) array"
    if x.shape[-2] == 1:
        return DECODE
    if x.dtype not in FLOAT_DTYPES:
        return f"input dtype {dtype_name(x.dtype)} is not float16/bfloat16/float32"
    return None
