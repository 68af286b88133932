"""The Q8_0 KV caches: :class:`Q8KVCache` (one sequence) and :class:`BatchQ8KVCache` (a batch, as
mlx-lm's ``BatchKVCache``), in mlx-lm's cache protocol; loading saved ones. The package docstring
(``mlx_bricks.cache``) describes the format and the protocol."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import cache as _mlx_cache
from mlx_lm.models.base import create_causal_mask

from mlx_bricks import kernels
from mlx_bricks.backends import resolve_backend
from mlx_bricks.checks import check_array, check_float_dtype
from mlx_bricks.bricks.q8_0.op import QK8_0, dequantize_q8_0, quantize_q8_0


def _brick_backend(kernel: str, backend: str | None) -> str:
    """Backend for brick ``kernel`` when the cache's bricks run on ``backend``: the same, except
    ``reference`` (MLX ops, on the GPU too) where that brick has no CUDA twin, even when
    ``cuda`` was asked for explicitly (the cache mixes bricks with and without twins)."""
    name = resolve_backend(backend)
    if name == "cuda" and not kernels.has_kernel(kernel, "cuda"):
        return "reference"
    return name


def _zeros_q8(B, H, L, D):
    """Empty Q8_0 buffers ``(qs, d)`` for (B, H, L) positions of head_dim D."""
    return mx.zeros((B, H, L, D), mx.int8), mx.zeros((B, H, L, D // QK8_0), mx.float16)


class _Q8Buffers(_mlx_cache._BaseCache):
    """What the single and the batch Q8_0 caches share: ``keys`` / ``values`` as ``(qs, d)``
    buffers of capacity growing by ``step`` positions, written at a position the subclass
    tracks (``offset``, or the batch's ``_idx``), quantized once on append on ``backend``."""

    step = 256
    keys = values = None
    backend = None

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

    def _grow(self, B, H, L, dk, dv, prev):
        n = (self.step + L - 1) // self.step * self.step
        if self.keys is None:
            self.keys, self.values = _zeros_q8(B, H, n, dk), _zeros_q8(B, H, n, dv)
            return
        # Drop stale positions past ``prev`` first (after a trim), as KVCache does.
        if prev < self.keys[0].shape[2]:
            self.keys = tuple(x[..., :prev, :] for x in self.keys)
            self.values = tuple(x[..., :prev, :] for x in self.values)
        self.keys = tuple(mx.concatenate([x, y], axis=2)
                          for x, y in zip(self.keys, _zeros_q8(B, H, n, dk)))
        self.values = tuple(mx.concatenate([x, y], axis=2)
                            for x, y in zip(self.values, _zeros_q8(B, H, n, dv)))

    def _write(self, keys, values, prev: int) -> None:
        """Check, quantize and store ``keys``/``values`` (B, Hkv, L, D) at positions
        ``prev .. prev + L - 1``, growing the buffers as needed."""
        self._check_new(keys, values)
        B, H, L, dk = keys.shape
        if self.keys is None or prev + L > self.keys[0].shape[2]:
            self._grow(B, H, L, dk, values.shape[3], prev)
        qb = _brick_backend("q8_0_quantize", self.backend)
        for buf, x in ((self.keys, keys), (self.values, values)):
            for dst, src in zip(buf, quantize_q8_0(x, backend=qb)):
                dst[..., prev:prev + L, :] = src

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        """Bytes of the allocated buffers (capacity, like mlx-lm's caches' nbytes)."""
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))


class Q8KVCache(_Q8Buffers):
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
    to ``offset`` (views of the buffers, no copy). ``merge`` (a list of these, one per
    sequence) gives the :class:`BatchQ8KVCache` mlx-lm's ``BatchGenerator`` batches with.
    """

    def __init__(self, backend: str | None = None):
        self.keys = None
        self.values = None
        self.offset = 0
        self.backend = backend

    def update_and_fetch(self, keys, values):
        """Quantize ``keys``/``values`` (B, Hkv, L, D) to Q8_0, append them at ``offset`` and
        return the Q8_0 views ``((k_qs, k_d), (v_qs, v_d))`` of positions ``0 .. offset - 1``.

        Raises:
            TypeError: not float mx.arrays.
            ValueError: not 4-D, head_dim not a multiple of 32, or (B, Hkv, D) different from
                what the cache holds.
        """
        self._write(keys, values, self.offset)
        self.offset += keys.shape[2]
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

    @classmethod
    def merge(cls, caches):
        """The :class:`BatchQ8KVCache` of ``caches`` (one per sequence): what mlx-lm's
        ``BatchGenerator`` calls to batch sequences (``KVCache.merge`` gives BatchKVCache)."""
        return BatchQ8KVCache.merge(caches)


class BatchQ8KVCache(_Q8Buffers):
    """Q8_0 K/V of a batch of sequences, laid out as mlx-lm's ``BatchKVCache`` lays out its
    float K/V, so ``BatchGenerator`` (and ``mlx_lm.server``) batches a Q8_0 model as it batches a
    stock one. Built by ``Q8KVCache.merge``; each sequence comes back out as a
    :class:`Q8KVCache` through ``extract``.

    Layout (mlx-lm 0.32, ``BatchKVCache``): sequences are left-aligned to a common write index
    ``_idx``; ``left_padding[b]`` positions at the start of row b are padding, and the rest up
    to ``_idx`` are its tokens, so ``offset[b] = _idx - left_padding[b]`` is its length. A
    prefill chunk of sequences of different lengths comes right-padded: ``prepare(lengths=...,
    right_padding=...)`` before it, ``finalize()`` after it rolls each row right by its padding
    (the padding becomes left padding). ``make_mask`` is mlx-lm's
    ``create_causal_mask(N, offset=_idx, left_padding=left_padding)``: boolean (B, 1, N,
    _idx + N). Padding positions hold zeros (Q8_0 blocks with scale 0).

    Args:
        left_padding: padding positions per sequence (list of int, length B).
        backend: backend of the Q8_0 quantizer (as :class:`Q8KVCache`).

    Attributes:
        keys, values: None, or ``(qs, d)`` buffers (B, Hkv, capacity, D) int8 and
            (B, Hkv, capacity, D // 32) float16.
        offset: mx.array (B,) int32, the tokens of each sequence (what RoPE offsets by).
        left_padding: mx.array (B,) int32.
    """

    def __init__(self, left_padding, backend: str | None = None):
        self.keys = None
        self.values = None
        self.left_padding = mx.array(left_padding, dtype=mx.int32)
        self.offset = -self.left_padding
        self._idx = 0
        self._right_padding = None
        self.backend = backend

    def update_and_fetch(self, keys, values):
        """Quantize and append ``keys``/``values`` (B, Hkv, L, D) at ``_idx``; returns the
        Q8_0 views ``((k_qs, k_d), (v_qs, v_d))`` of positions ``0 .. _idx - 1``.

        Raises:
            TypeError, ValueError: as :meth:`Q8KVCache.update_and_fetch`.
        """
        self._write(keys, values, self._idx)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self.keys_and_values()

    def keys_and_values(self):
        """``((k_qs, k_d), (v_qs, v_d))`` of positions ``0 .. _idx - 1`` (views)."""
        return (tuple(x[..., :self._idx, :] for x in self.keys),
                tuple(x[..., :self._idx, :] for x in self.values))

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """Before a prefill chunk: more left padding (empty cache only), or the right padding
        of a chunk whose sequences differ in length (undone by :meth:`finalize`)."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left_padding can only be added to an empty BatchQ8KVCache")
            left_padding = mx.array(left_padding, dtype=mx.int32)
            self.left_padding = self.left_padding + left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding, dtype=mx.int32)

    def finalize(self):
        """After a right-padded chunk: roll each row right by its padding, which becomes left
        padding."""
        if self._right_padding is None:
            return
        pad = self._right_padding[:, None]
        self.keys = tuple(_mlx_cache.dynamic_roll(x, pad, axis=2) for x in self.keys)
        self.values = tuple(_mlx_cache.dynamic_roll(x, pad, axis=2) for x in self.values)
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

    @property
    def state(self):
        """``(k_qs, k_d, v_qs, v_d, offset, left_padding, _idx)`` (Nones when empty)."""
        kq, kd = self.keys if self.keys is not None else (None, None)
        vq, vd = self.values if self.values is not None else (None, None)
        return kq, kd, vq, vd, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v):
        kq, kd, vq, vd, self.offset, self.left_padding, self._idx = v
        self.keys, self.values = (None, None) if kq is None else ((kq, kd), (vq, vd))
        self._right_padding = getattr(self, "_right_padding", None)

    def is_trimmable(self):
        return True

    def trim(self, n):
        """Drop the last ``min(n, _idx)`` positions of every row; returns how many."""
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        """mlx-lm's batch mask: boolean (B, 1, N, _idx + N), causal and without the left
        padding (``BatchKVCache.make_mask``)."""
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices):
        """Keep the rows ``batch_indices`` (in place), then drop left padding every row has."""
        if self.keys is not None:
            self.keys = tuple(x[batch_indices] for x in self.keys)
            self.values = tuple(x[batch_indices] for x in self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shift = min(self.left_padding.tolist())
        if shift > 0:
            if self.keys is not None:
                self.keys = tuple(x[..., shift:, :] for x in self.keys)
                self.values = tuple(x[..., shift:, :] for x in self.values)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: "BatchQ8KVCache"):
        """Append the rows of ``other`` (in place), both right-aligned at the larger ``_idx``."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        ref = self if self.keys is not None else other
        H, dk, dv = ref.keys[0].shape[1], ref.keys[0].shape[3], ref.values[0].shape[3]
        idx = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def aligned(c):
            k, v = c.keys, c.values
            if k is None:
                rows = c.offset.shape[0]
                k, v = _zeros_q8(rows, H, 0, dk), _zeros_q8(rows, H, 0, dv)
            left = idx - c._idx
            right = size - k[0].shape[2] - left
            if right < 0:  # stale capacity past _idx
                k = tuple(x[..., :right, :] for x in k)
                v = tuple(x[..., :right, :] for x in v)
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k = tuple(mx.pad(x, widths) for x in k)
                v = tuple(mx.pad(x, widths) for x in v)
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = aligned(self), aligned(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = idx

    def extract(self, idx: int) -> Q8KVCache:
        """Row ``idx`` as a :class:`Q8KVCache` of its own tokens (padding dropped; copies)."""
        cache = Q8KVCache(backend=self.backend)
        if self.keys is None:
            return cache
        pad = self.left_padding.tolist()[idx]
        cache.keys = tuple(mx.contiguous(x[idx:idx + 1, :, pad:self._idx]) for x in self.keys)
        cache.values = tuple(mx.contiguous(x[idx:idx + 1, :, pad:self._idx])
                             for x in self.values)
        cache.offset = self._idx - pad
        return cache

    @classmethod
    def merge(cls, caches) -> "BatchQ8KVCache":
        """One batch of ``caches`` (a :class:`Q8KVCache` per sequence), left-padded to the
        longest (the quantized blocks are copied, not re-quantized).

        Raises:
            TypeError: an element is not a :class:`Q8KVCache`.
        """
        for c in caches:
            if type(c) is not Q8KVCache:
                raise TypeError(f"caches: expected Q8KVCache elements, got {type(c).__name__}")
        backend = next((c.backend for c in caches if c.backend is not None), None)
        lengths = [c.offset for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), backend=backend)
        full = [c for c in caches if c.offset > 0]
        H, dk, dv = full[0].keys[0].shape[1], full[0].keys[0].shape[3], full[0].values[0].shape[3]
        B = len(caches)
        keys, values = _zeros_q8(B, H, longest, dk), _zeros_q8(B, H, longest, dv)
        for i, c in enumerate(caches):
            if c.offset == 0:
                continue
            p = longest - c.offset
            kv = c.keys_and_values()
            for buf, src in ((keys, kv[0]), (values, kv[1])):
                for dst, x in zip(buf, src):
                    dst[i:i + 1, :, p:] = x
        batch = cls([longest - n for n in lengths], backend=backend)
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def size(self):
        return self._idx


#: The cache classes whose layers the routed attention reads as Q8_0.
Q8_CACHES = (Q8KVCache, BatchQ8KVCache)


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
