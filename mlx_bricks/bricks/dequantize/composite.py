"""Composite variants of the quantized kinds: dequantize the weight, then the stock float
computation, tiled over N so the transient float weight never exceeds a cap.

At prefill sizes dequantizing a weight costs O(N K) against the GEMM's O(M N K), so
``x @ dequantize(W).T`` runs at the float GEMM's speed where MLX's ``quantized_matmul`` does not
(e.g. MLX 0.32.4's CPU with float16 activations; vLLM's AWQ path dequantizes from 256 tokens
on for the same reason). Each quantized kind (``linear``, ``rms_norm_qkv``, ``swiglu_mlp``)
registers two such composites beside its kernels (:func:`dequant_composites`): one on
``mx.dequantize`` (every backend, the CPU included) and one on the dequantize brick (where the
backend has its kernel, for MLX affine weights); the tuner weighs them against stock like any
other variant. Weights in MLX's microscaling modes (``mxfp4``, ``nvfp4``, ``mxfp8``:
``formats.microscaling``) have no kernel: the ``mx.dequantize`` composite is their only
candidate besides stock.

The cap (:func:`resolve_cap`): ``patch_model(dequant_cap=...)``, else ``MLX_BRICKS_DEQUANT_CAP``,
else :data:`DEFAULT_CAP_MIB`, in MiB (any number > 0; fractions allowed). A call's weights are
dequantized in row tiles whose making holds at most the cap's bytes: the float tile and what
the dequantizer allocates besides it (:data:`MX_CPU_BYTES`: the tiled ``mx.dequantize`` on the
CPU holds 7 to 57 times a float16 tile), gate and up side by side counted together. The tiles
are made one after the other: each tile's packed rows wait, through ``mx.depends``, for the
product of the tile before. A tile has at least one row: a cap below one row's bytes is
rounded up to one row. The tiles a weight needs split its rows evenly (within one row).
A default cap (not the user's) grows per call on a GPU to the bytes the call's products write
(:func:`~mlx_bricks.options.call_cap`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx
import numpy as np

from mlx_bricks import env
from mlx_bricks.bricks.dequantize.op import has_kernel, run_dequantize
from mlx_bricks.cpu import on_cpu, one_blas_thread
from mlx_bricks.formats import FLOAT, format_of
from mlx_bricks.formats.affine import QuantizedWeight
from mlx_bricks.formats.microscaling import MicroscaledWeight
from mlx_bricks.options import (  # noqa: F401  (the cap's vocabulary, re-exported)
    CAP_SETTING,
    CAP_STRICT_SETTING,
    DEFAULT_CAP_FRACTION,
    DEFAULT_CAP_MIB,
    MIB,
    QUEUED_BACKENDS,
    call_cap,
    parse_cap,
)
from mlx_bricks.runtime.kind import Composite

#: Environment variable of the cap, in MiB.
CAP_ENV_VAR = "MLX_BRICKS_DEQUANT_CAP"




def model_cap(model_bytes: int) -> int:
    """The default cap for a model of ``model_bytes`` bytes of weights: the smaller of
    :data:`DEFAULT_CAP_MIB` and ``model_bytes / DEFAULT_CAP_FRACTION`` (at least 1 MiB)."""
    return min(DEFAULT_CAP_MIB * MIB, max(MIB, int(model_bytes) // DEFAULT_CAP_FRACTION))


def resolve_cap(value=None, model_bytes: int | None = None) -> tuple[int, str]:
    """``(bytes, source)`` of the cap: the argument ``value`` (MiB; ``source`` ``"argument"``),
    else ``MLX_BRICKS_DEQUANT_CAP`` (``"env"``; empty counts as unset), else the default
    (with ``model_bytes``: :func:`model_cap`, source ``"default, 1/32 of the weights"``).

    Raises:
        TypeError, ValueError: a bad value (:func:`parse_cap`), naming ``dequant_cap`` or the
            environment variable.
    """
    if value is not None:
        return parse_cap(value, "dequant_cap"), "argument"
    cap = env.get(CAP_ENV_VAR)
    if cap is not None:
        return cap, "env"
    if model_bytes is not None and model_cap(model_bytes) < DEFAULT_CAP_MIB * MIB:
        return model_cap(model_bytes), f"default, 1/{DEFAULT_CAP_FRACTION} of the weights"
    return DEFAULT_CAP_MIB * MIB, "default"


def cap_of(settings: dict) -> int:
    """The cap in bytes from a kind's settings (the patch puts it there), else
    :func:`resolve_cap`'s."""
    cap = settings.get(CAP_SETTING)
    return cap if cap is not None else resolve_cap()[0]


def cap_is_strict(settings: dict) -> bool:
    """Whether the cap of a kind's settings is the user's (never raised per call,
    :func:`~mlx_bricks.options.call_cap`): the patch's word, else whether
    :func:`resolve_cap` finds one set (an argument cannot reach here: the environment)."""
    if CAP_SETTING in settings:
        return settings.get(CAP_STRICT_SETTING, True)
    return resolve_cap()[1] == "env"


#: Bytes per value of a row tile that the tiled ``mx.dequantize`` + GEMM holds at its peak on
#: MLX 0.32.4's CPU (the float tile included), by output size (2: float16 / bfloat16, 4:
#: float32) and bits: the CPU evaluates ``mx.dequantize`` as a graph of unpacking ops with
#: integer and float32 temporaries, and its scheduler issues the next tile's first operations
#: before the last ones' memory is released. Measured with ``mx.get_peak_memory`` (the
#: output's bytes taken off) on an 8192 x 1024 weight in 4 MiB tiles, the largest of 3 runs,
#: plus 10% (other shapes measured up to 7% above the 4 MiB figures). On a GPU
#: ``mx.dequantize`` is one kernel: its output only.
MX_CPU_BYTES = {2: {2: 16, 3: 73, 4: 22, 5: 108, 6: 126, 8: 31},
                4: {2: 13, 3: 66, 4: 18, 5: 101, 6: 119, 8: 26}}
#: The same for the microscaling modes, by mode: measured the same way (2026-12-05, MLX 0.32.4,
#: 8192 x 1024 weights in 1 and 4 MiB tiles, float16 / bfloat16 / float32, the largest of 3
#: runs: mxfp4 19.7 / 32.0, nvfp4 19.5 / 42.8, mxfp8 11.9 / 23.7 bytes per value for 2- / 4-byte
#: outputs), plus 10%.
MX_CPU_BYTES_MICRO = {2: {"mxfp4": 22, "nvfp4": 22, "mxfp8": 14},
                      4: {"mxfp4": 36, "nvfp4": 48, "mxfp8": 27}}


@dataclass(frozen=True)
class Dequantizer:
    """How a composite dequantizes a tile: ``fn(weight, dtype, backend) -> (n, K)`` (a
    ``QuantizedWeight`` or, for ``mx``, a ``MicroscaledWeight``) and ``peak(bits, dtype,
    mode="affine") -> bytes per value`` alive while it runs (its output included): what a
    tile's rows are counted at against the cap."""

    fn: Callable
    peak: Callable


def _mx_peak(bits: int, dtype, mode: str = "affine") -> int:
    if mx.default_device() == mx.cpu:
        size = 4 if dtype.size == 4 else 2
        if mode in MX_CPU_BYTES_MICRO[size]:
            return MX_CPU_BYTES_MICRO[size][mode]
        return MX_CPU_BYTES[size][bits]
    return dtype.size


#: The dequantizers of the composites: ``mx.dequantize`` (every format) and the dequantize
#: brick (one kernel writing its output; MLX affine only).
DEQUANTIZERS = {
    "mx": Dequantizer(lambda q, dtype, backend: q.dequantize(dtype), _mx_peak),
    "brick": Dequantizer(run_dequantize, lambda bits, dtype, mode="affine": dtype.size),
}


def quantized(*weights) -> bool:
    """Whether any of ``weights`` is quantized, affine or microscaled (where the composites
    apply)."""
    return any(format_of(w).quantized for w in weights)


def brick_reads(args: dict) -> bool:
    """Whether the dequantize brick reads every weight of ``args`` (none is microscaled)."""
    return not any(isinstance(v, MicroscaledWeight) for v in args.values())


def _rows(weight, n0: int, n1: int):
    if isinstance(weight, MicroscaledWeight):
        return weight.rows(n0, n1)
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(weight.w[n0:n1], weight.scales[n0:n1], weight.biases[n0:n1],
                               weight.group_size, weight.bits, weight.mode)
    return weight[n0:n1]


class InFlight:
    """Bounds the dequantized float bytes queued ahead of a GPU to about one cap.

    Each time half a cap of tiles has been queued since the last mark, the newest tile's output
    is submitted (``mx.async_eval``) and becomes the mark, and the host waits for the previous
    mark (``mx.eval``), which was submitted half a cap earlier: the device always has the work
    between the two marks queued (no idle gap, unlike a barrier on the newest output), and at
    most about one cap of tiles is alive. Under a transformation (``mx.compile``) there is no
    eager evaluation: nothing is bounded there. One per process (the tiles of every model and
    call count together).
    """

    def __init__(self):
        self.since = 0
        self.mark = None

    def queued(self, out, nbytes: int, cap: int) -> None:
        """Count ``nbytes`` of dequantized weight that ``out`` was computed from."""
        self.since += nbytes
        if 2 * self.since < cap:
            return
        self.since = 0
        prev, self.mark = self.mark, out
        try:
            mx.async_eval(out)
            if prev is not None:
                mx.eval(prev)
        except (RuntimeError, ValueError):  # inside mx.compile or another transformation
            self.mark = None

    def reset(self) -> None:
        """Forget the mark (tests; a new model)."""
        self.since, self.mark = 0, None


#: The process's bound (:class:`InFlight`).
IN_FLIGHT = InFlight()


def _after(weight, dep):
    """``weight`` (its arrays) evaluated only after ``dep``."""
    if isinstance(weight, MicroscaledWeight):
        return weight.with_arrays(mx.depends(weight.arrays(), [dep]))
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(*mx.depends([weight.w, weight.scales, weight.biases], [dep]),
                               weight.group_size, weight.bits, weight.mode)
    return mx.depends([weight], [dep])[0]


def _stack(parts: list):
    """Row blocks of one format stacked into one weight (gate and up side by side)."""
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], MicroscaledWeight):
        return parts[0].with_arrays([mx.concatenate([a.arrays()[i] for a in parts])
                                     for i in range(2)])
    if isinstance(parts[0], QuantizedWeight):
        p = parts[0]
        return QuantizedWeight(*(mx.concatenate([getattr(q, f) for q in parts])
                                 for f in ("w", "scales", "biases")), p.group_size, p.bits, p.mode)
    return mx.concatenate(parts)


def _stacked_bias(biases: tuple, n0: int, n1: int, dtype):
    """Rows ``n0:n1`` of each weight's bias side by side (zeros for a weight without one), or
    None when no weight has a bias."""
    if all(b is None for b in biases):
        return None
    rows = [mx.zeros((n1 - n0,), dtype) if b is None else b[n0:n1] for b in biases]
    return rows[0] if len(rows) == 1 else mx.concatenate(rows)


class DenseTiles:
    """The float row tiles of one composite call (module docstring): each weight handed to
    :meth:`linear` is dequantized in tiles of at most ``cap`` bytes, one after the other.

    Args:
        cap: bytes of float weight one tile may hold.
        how: a key of :data:`DEQUANTIZERS`.
        backend: the resolved backend (the brick's dequantize runs on it).
        gemm: ``"mlx"``: each tile's product is MLX's (lazy); ``"blas"``: NumPy's float32
            product through its BLAS, eagerly (:func:`blas_linear`; for the CPU).
        strict: ``cap`` is the user's; False: each :meth:`linear` call's cap is
            :func:`~mlx_bricks.options.call_cap`'s (raised to the call's output bytes on a
            GPU).
    """

    def __init__(self, cap: int, how: str, backend: str, gemm: str = "mlx",
                 strict: bool = True):
        self.cap = cap
        self.strict = strict
        self.dequantizer = DEQUANTIZERS[how]
        self.backend = backend
        self.gemm = gemm
        self.last = None  # the output of the last tile (the next one waits for it)
        self._host = None  # (x, (m0, m1), those rows of x in float32 NumPy) (blas)

    def _value_bytes(self, weights: tuple, dtype) -> float:
        """Bytes alive per value of a tile row while it is made: the dequantizer's peak, and
        the copy that stacks several weights' rows or casts a float weight's rows to ``dtype``
        (a single float weight's rows in its own dtype are a view)."""
        total = 0.0
        for w in weights:
            f = format_of(w)
            if f.quantized:
                total += self.dequantizer.peak(f.bits, dtype, f.mode)
                if len(weights) > 1:  # the stacked packed rows, scales and biases (if any)
                    fields = 1 if f.microscaled else 2
                    total += f.bits / 8 + fields * w.scales.dtype.size / f.group_size
            else:  # the stacked copy of several weights' rows, the cast to dtype
                total += (w.dtype.size if len(weights) > 1 else 0) + \
                    (dtype.size if w.dtype != dtype else 0)
        return total

    def linear(self, x, weights: tuple, biases: tuple, finish=None):
        """``x @ W.T + b`` for ``weights`` of one shape ``(N, K)`` and format, side by side:
        per tile of rows ``n0:n1`` of each, one float GEMM (``mx.addmm`` with the biases, as
        ``nn.Linear`` computes) on the stacked dequantized rows, its output split back per
        weight and passed to ``finish`` (default: the single weight's product); the tiles'
        results concatenated along the last axis.

        Returns:
            ``(..., N)`` of x's dtype.
        """
        dtype = x.dtype
        N, K = weights[0].shape
        if self.gemm == "blas":
            return self._blas_linear(x, weights, biases, finish)
        cap = call_cap(self.cap, self.strict, self.backend,
                       x.size // max(1, K) * N * len(weights) * dtype.size)
        rows = max(1, min(N, int(cap // max(1.0, K * self._value_bytes(weights, dtype)))))
        n_tiles = -(-N // rows)  # the fewest tiles, their rows within one of each other
        outs = []
        for i in range(n_tiles):  # (no small last GEMM)
            n0, n1 = i * N // n_tiles, (i + 1) * N // n_tiles
            parts = [_rows(wt, n0, n1) for wt in weights]
            # Wait for the tile before (one tile alive at a time); the first tile waits for x,
            # so no layer's weights are dequantized before the layers ahead of it have run.
            dep = x if self.last is None else self.last
            parts = [_after(p, dep) for p in parts]
            w = _stack(parts)
            if format_of(w).quantized:
                w = self.dequantizer.fn(w, dtype, self.backend)
            y = FLOAT.linear(x, w, _stacked_bias(biases, n0, n1, dtype))
            parts = mx.split(y, len(weights), axis=-1) if len(weights) > 1 else [y]
            out = finish(*parts) if finish is not None else parts[0]
            outs.append(out)
            self.last = out
            if self.backend in QUEUED_BACKENDS:
                IN_FLIGHT.queued(out, (n1 - n0) * K * dtype.size * len(weights), cap)
        return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)

    def _blas_linear(self, x, weights: tuple, biases: tuple, finish=None):
        """:meth:`linear` with each tile's product through NumPy's float32 BLAS on one thread
        (``cpu.one_blas_thread``), eagerly. What a tile holds stays within the cap: a block of
        x's rows in float32 (at most a quarter of the cap), the weight rows dequantized or
        cast to float32, the product's float32 columns (NumPy's and MLX's copy). With more
        than one tile the results are written into one output allocated up front (no
        concatenation holding every tile beside the output)."""
        N, K = weights[0].shape
        lead = x.shape[:-1]
        M = math.prod(lead)
        if M == 0:
            return mx.zeros((*lead, N), x.dtype)
        x2 = x.reshape(M, K)
        m_rows = max(1, min(M, int(self.cap // 4 // (4 * K))))
        per_row = K * self._value_bytes(weights, mx.float32) + 2 * 4 * m_rows * len(weights)
        rows = max(1, min(N, int((self.cap - 4 * K * m_rows) // max(1.0, per_row))))
        out = view = None
        for n0 in range(0, N, rows):
            n1 = min(N, n0 + rows)
            w = _stack([_rows(wt, n0, n1) for wt in weights])
            f = format_of(w)
            wf = np.asarray(self.dequantizer.fn(w, mx.float32, self.backend) if f.quantized
                            else w.astype(mx.float32))
            bias = _stacked_bias(biases, n0, n1, mx.float32)
            bias = None if bias is None else np.asarray(bias.astype(mx.float32))
            for m0 in range(0, M, m_rows):
                m1 = min(M, m0 + m_rows)
                with one_blas_thread():
                    y = self._host_rows(x, x2, m0, m1) @ wf.T
                if bias is not None:
                    y += bias
                y = mx.array(y).astype(x.dtype)
                parts = mx.split(y, len(weights), axis=-1) if len(weights) > 1 else [y]
                t = finish(*parts) if finish is not None else parts[0]
                if n1 - n0 == N and m1 - m0 == M:
                    return t.reshape(*lead, t.shape[-1])
                if out is None:
                    out, view = _host_writable((M, N), t.dtype)
                mx.eval(t)
                view[m0:m1, n0:n1] = _host_view(t)
            del wf, bias  # this tile's rows go before the next tile's are made
        return out.reshape(*lead, N)

    def _host_rows(self, x, x2, m0: int, m1: int):
        """Rows ``m0:m1`` of ``x2`` (``x`` as 2-D) as float32 NumPy rows, kept for the next
        tile and the next call on the same ``x`` (a QKV piece's three projections)."""
        if self._host is None or self._host[0] is not x or self._host[1] != (m0, m1):
            self._host = None  # the previous block's rows go before the next are made
            self._host = (x, (m0, m1), np.asarray(x2[m0:m1].astype(mx.float32)))
        return self._host[2]


def _host_view(a):
    """A NumPy view of evaluated ``a``'s buffer (2-byte floats as uint16: NumPy has no
    bfloat16)."""
    return np.asarray(a.view(mx.uint16) if a.dtype.size == 2 else a)


def _host_writable(shape, dtype):
    """An evaluated MLX array of ``shape`` and ``dtype`` that nothing else references, and a
    writable NumPy view of its buffer (where MLX runs on the CPU its memory is the host's):
    the BLAS tiles are written into it in place."""
    out = mx.zeros(shape, dtype)
    mx.eval(out)
    view = _host_view(out)
    ok = view.flags.writeable and view.size == out.size and view.flags.c_contiguous
    if ok:  # a view, not a copy: a value written through it is read back from the array
        view.reshape(-1)[0] = 1
        ok = out.reshape(-1)[0].item() != 0
        view.reshape(-1)[0] = 0
    if not ok:
        raise RuntimeError("MLX gave no writable host view of a fresh array")
    return out, view


#: Backends whose composites pay one-off first-use costs in a fresh process worth paying while
#: the model loads (:func:`warm_first_use`).
WARM_BACKENDS = ("cuda",)
#: Rows of the warm-up's dequantize and GEMM (a few: the point is the first use, not speed).
WARM_ROWS = 16


def warm_first_use(modules, backend: str) -> float:
    """Pay at patch time what the composites' first call in a fresh process would otherwise add
    to the first prompt's time: the float GEMM library's first use (cuBLAS on CUDA: its handle
    and first heuristic query, 0.083 s on an H100, bench/results/2026-12-06-h100-first-call.jsonl)
    and MLX's dequantize kernel of each (dtype, bits, group_size, mode) the ``modules``'
    ``nn.QuantizedLinear`` layers hold: one ``WARM_ROWS``-row slice of a real weight of each
    format dequantized and multiplied, evaluated.

    Args:
        modules: the patched modules (their quantized dense linears are read).
        backend: the bricks' backend; nothing is done off :data:`WARM_BACKENDS`.

    Returns:
        Seconds spent (0.0 where nothing was done).
    """
    import time

    import mlx.nn as nn

    if backend not in WARM_BACKENDS:
        return 0.0
    t0 = time.perf_counter()
    seen, outs = set(), []
    for module in modules:
        for sub in module.modules():
            if not isinstance(sub, nn.QuantizedLinear):
                continue
            mode = getattr(sub, "mode", "affine")
            key = (sub.scales.dtype, sub.bits, sub.group_size, mode)
            if key in seen:
                continue
            seen.add(key)
            biases = getattr(sub, "biases", None)
            w = mx.dequantize(sub.weight[:WARM_ROWS], sub.scales[:WARM_ROWS],
                              None if biases is None else biases[:WARM_ROWS],
                              group_size=sub.group_size, bits=sub.bits, mode=mode)
            outs.append(mx.ones((WARM_ROWS, w.shape[1]), dtype=w.dtype) @ w.T)
    if not outs:
        return 0.0
    mx.eval(outs)
    return time.perf_counter() - t0


def dequant_composites(fn, applies, *, suffix: str = "", kwargs: dict | None = None,
                       blas_applies=None) -> tuple[Composite, Composite, Composite]:
    """The three composites of a quantized kind computing ``fn(args, tiles)`` (``tiles`` a
    :class:`DenseTiles`): ``"dequant" + suffix`` on ``mx.dequantize``, applying wherever
    ``applies(args)`` (every backend); ``"dequant_brick" + suffix`` on the dequantize brick,
    applying where the backend also has its kernel and no weight is microscaled
    (:func:`brick_reads`); ``"blas" + suffix``: the tiles' products in float32 through NumPy's
    BLAS, on the CPU only (:func:`~mlx_bricks.checks.on_cpu`), for float weights too where
    ``blas_applies(args)`` (default: always). MLX 0.32.4's CPU matmuls run at 1-5 GFLOP/s (its
    own loops for half types, a reference BLAS for float32); NumPy's OpenBLAS ran a bf16
    512 x 2048 x 2048 product, conversions included, in 31 ms against MLX's 804 ms (26x) on the
    2-core x86 machine of the tests (2026-12-06). ``kwargs``: what the composites record (e.g.
    the SwiGLU style, ``{"variant": "fused"}``)."""
    def run(how, gemm="mlx"):
        def composite(args, backend, settings):
            return fn(args, DenseTiles(cap_of(settings), how, backend, gemm,
                                       cap_is_strict(settings)))
        return composite

    kw = dict(kwargs or {})
    blas_ok = blas_applies or (lambda args: True)
    return (Composite(f"dequant{suffix}", run("mx"), lambda args, backend: applies(args), kw),
            Composite(f"dequant_brick{suffix}", run("brick"),
                      lambda args, backend: has_kernel(backend) and brick_reads(args)
                      and applies(args), kw, builds=True, cuda_kernels=("dequantize",)),
            Composite(f"blas{suffix}", run("mx", "blas"),
                      lambda args, backend: on_cpu() and blas_ok(args), kw))

