"""The microscaling formats of MLX: ``mxfp4``, ``nvfp4`` and ``mxfp8`` (:class:`MicroscaledWeight`).

``mx.quantize(w, mode=...)`` / ``nn.QuantizedLinear(mode=...)`` / mlx-lm's
``QuantizedSwitchLinear(mode=...)`` (gpt-oss ships its MoE experts as ``mxfp4``). A float weight
``(..., N, K)`` becomes

* ``w``: uint32 ``(..., N, K * bits // 32)``, each row a little-endian bit stream of ``bits``-bit
  codes (LSB first, as MLX's affine packing): 8 FP4 codes or 4 FP8 codes per word;
* ``scales``: uint8 ``(..., N, K // group_size)``, one shared scale code per group; no biases;
* value ``w[n, k] = element(q[n, k]) * scale(scales[n, k // group_size])``:

========  ====  ==========  ===============================  ===============================
mode      bits  group_size  element code                     scale code
========  ====  ==========  ===============================  ===============================
mxfp4     4     32          E2M1 (+-{0, .5, 1, 1.5, 2, 3,    E8M0: ``2 ** (e - 127)``
                            4, 6})
nvfp4     4     16          E2M1                             E4M3 (FN: bias 7, subnormals,
                                                             0x7f NaN, no inf)
mxfp8     8     32          E4M3 (FN)                        E8M0
========  ====  ==========  ===============================  ===============================

(OCP Microscaling Formats spec v1.0 for the MX modes; NVIDIA's NVFP4 for ``nvfp4``; the table is
``mx.quantize``'s.) ``nvfp4`` expert weights may carry a per-expert float32 ``global_scale``
(``QuantizedSwitchLinear(global_scale=True)``: ``(E,)``); the value is then multiplied by
``global_scale[e] / (6 * 448)`` (MLX 0.32's ``dequantize``; its ``gather_qmm`` takes it on the
GPU only). ``nn.QuantizedLinear`` has none (``mx.quantized_matmul`` takes none).

What the bricks get (the weight-format protocol, ``mlx_bricks.formats.Format``):

* key: the mode (``"mxfp4"``, ``"nvfp4"``, ``"mxfp8"``); group size and bits are the mode's;
* stock: ``mx.quantized_matmul(..., mode=...)`` (``nn.QuantizedLinear``), ``mx.gather_qmm``
  (``QuantizedSwitchLinear``);
* dense: ``mx.dequantize(..., mode=...)`` (float32 by default: every value is exact there);
* kernels: none on any backend (the MSL and CUDA bricks read float and MLX affine weights): the
  kinds offer their ``dequant`` composites for these weights (dequantize a row tile with
  ``mx.dequantize``, then the float computation; ``bricks/dequantize/composite.py``), and the
  tuner weighs them against stock on every backend, the CPU included.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks.checks import check_array, dtype_name


@dataclass(frozen=True)
class ModeSpec:
    """One microscaling mode: element width ``bits``, ``group_size`` values per scale, the
    element and scale encodings (names only: the arithmetic is ``mx.dequantize``'s)."""

    bits: int
    group_size: int
    element: str
    scale: str


#: The microscaling modes by name (MLX 0.32's ``mx.quantize`` table).
MODES = {
    "mxfp4": ModeSpec(4, 32, "e2m1", "e8m0"),
    "nvfp4": ModeSpec(4, 16, "e2m1", "e4m3"),
    "mxfp8": ModeSpec(8, 32, "e4m3", "e8m0"),
}
#: ``global_scale`` divides by the largest E2M1 times the largest E4M3 (``6 * 448``).
GLOBAL_SCALE_DIVISOR = 6.0 * 448.0


def is_microscaled_mode(mode) -> bool:
    """Whether ``mode`` names a microscaling mode (:data:`MODES`)."""
    return isinstance(mode, str) and mode in MODES


@dataclass(frozen=True)
class MicroscaledWeight:
    """A weight in a microscaling mode (module docstring): ``(N, K)`` as ``nn.Linear`` stores
    it, or stacked experts ``(E, N, K)`` as ``QuantizedSwitchLinear`` does.

    Attributes:
        w: uint32 ``(..., N, K * bits // 32)``.
        scales: uint8 ``(..., N, K // group_size)``.
        mode: ``"mxfp4"``, ``"nvfp4"`` or ``"mxfp8"``.
        global_scale: None, or (``nvfp4`` experts only) float32 ``(E,)``.

    ``group_size`` and ``bits`` are the mode's; ``biases`` is None (the interface of
    :class:`~mlx_bricks.formats.affine.QuantizedWeight`, which has them).
    """

    w: mx.array
    scales: mx.array
    mode: str
    global_scale: mx.array | None = None

    biases = None

    @property
    def bits(self) -> int:
        return MODES[self.mode].bits

    @property
    def group_size(self) -> int:
        return MODES[self.mode].group_size

    @classmethod
    def from_module(cls, module) -> "MicroscaledWeight":
        """The weight of an ``nn.QuantizedLinear`` or ``QuantizedSwitchLinear`` in a
        microscaling mode (its ``bias`` is not taken).

        Raises:
            TypeError: the module lacks ``weight``, ``scales`` or ``mode``.
        """
        try:
            return cls(module["weight"], module["scales"], module.mode,
                       getattr(module, "global_scale", None))
        except (AttributeError, KeyError) as e:
            raise TypeError(f"module {type(module).__name__} is not a microscaled quantized "
                            f"layer: {e}") from None

    @property
    def shape(self) -> tuple[int, ...]:
        """The float weight's shape ``(..., N, K)``."""
        return (*self.w.shape[:-1], self.w.shape[-1] * 32 // self.bits)

    def dequantize(self, dtype=mx.float32) -> mx.array:
        """The float weight ``(..., N, K)`` of ``dtype`` (``mx.dequantize``; float32 by default,
        where every microscaled value is exact). A ``global_scale`` is applied per expert in
        float32 before the cast (MLX's ``dequantize`` takes a scalar one only)."""
        if self.global_scale is None:
            return mx.dequantize(self.w, self.scales, None, group_size=self.group_size,
                                 bits=self.bits, mode=self.mode, dtype=dtype)
        v = mx.dequantize(self.w, self.scales, None, group_size=self.group_size,
                          bits=self.bits, mode=self.mode, dtype=mx.float32)
        g = self.global_scale.astype(mx.float32) / GLOBAL_SCALE_DIVISOR
        return (v * g.reshape(*g.shape, 1, 1)).astype(dtype)

    def rows(self, n0: int, n1: int) -> "MicroscaledWeight":
        """Rows ``n0:n1`` of N (axis -2) of every matrix (experts keep their global scale)."""
        return dataclasses.replace(self, w=self.w[..., n0:n1, :],
                                   scales=self.scales[..., n0:n1, :])

    def take(self, experts: mx.array) -> "MicroscaledWeight":
        """The stacked weight of ``experts`` (indices into axis 0), e.g. one per row."""
        gs = None if self.global_scale is None else self.global_scale[experts]
        return MicroscaledWeight(self.w[experts], self.scales[experts], self.mode, gs)

    def arrays(self) -> list:
        """The packed arrays (``w``, ``scales``)."""
        return [self.w, self.scales]

    def with_arrays(self, arrays) -> "MicroscaledWeight":
        """The same weight with ``arrays`` (as :meth:`arrays` orders them) in place."""
        w, scales = arrays
        return dataclasses.replace(self, w=w, scales=scales)

    def check(self, name: str = "weight", K: int | None = None, rows: str = "N",
              ndim: int = 2) -> None:
        """Validate the fields for a ``ndim``-D weight (2: ``(rows, K)``, 3: experts) and,
        when ``K`` is given, its input width.

        Raises:
            TypeError: a field that is not an ``mx.array`` or has the wrong dtype.
            ValueError: an unknown mode, wrong ranks or shapes (packed width vs K, scales
                width vs K // group_size), a global scale on a 2-D weight or outside
                ``nvfp4``; the message names the field.
        """
        if not is_microscaled_mode(self.mode):
            raise ValueError(f"{name}.mode must be one of {tuple(MODES)}, got {self.mode!r}")
        check_array(f"{name}.w", self.w, ndim=ndim)
        check_array(f"{name}.scales", self.scales, ndim=ndim)
        if self.w.dtype != mx.uint32:
            raise TypeError(f"{name}.w must be uint32 (packed), got {dtype_name(self.w.dtype)}")
        if self.scales.dtype != mx.uint8:
            raise TypeError(f"{name}.scales must be uint8 ({MODES[self.mode].scale} codes), got "
                            f"{dtype_name(self.scales.dtype)}")
        Kw = self.shape[-1]
        if K is not None and Kw != K:
            raise ValueError(
                f"{name}.w has {self.w.shape[-1]} words per row, i.e. K={Kw} at {self.bits} "
                f"bits; expected K={K} ({K * self.bits // 32} words) for ({rows}, K={K})")
        if Kw % self.group_size:
            raise ValueError(f"{name}: {self.mode}'s group_size {self.group_size} must divide "
                             f"K={Kw}")
        want = (*self.w.shape[:-1], Kw // self.group_size)
        if tuple(self.scales.shape) != want:
            raise ValueError(f"{name}.scales must have shape {want} (..., N, K // "
                             f"{self.group_size}), got {tuple(self.scales.shape)}")
        if self.global_scale is not None:
            if ndim != 3 or self.mode != "nvfp4":
                raise ValueError(f"{name}.global_scale applies to nvfp4 expert weights only "
                                 f"(mode {self.mode!r}, {ndim}-D)")
            check_array(f"{name}.global_scale", self.global_scale, ndim=1)
            if self.global_scale.shape[0] != self.w.shape[0]:
                raise ValueError(f"{name}.global_scale must have shape ({self.w.shape[0]},) "
                                 f"(one per expert), got {tuple(self.global_scale.shape)}")


def matmul_t(x, weight: MicroscaledWeight):
    """``x @ W.T`` as ``nn.QuantizedLinear`` computes it in a microscaling mode:
    ``mx.quantized_matmul(..., transpose=True, mode=...)``.

    Raises:
        ValueError: a weight with a ``global_scale`` (``quantized_matmul`` takes none).
    """
    if weight.global_scale is not None:
        raise ValueError("weight.global_scale: mx.quantized_matmul takes no global scale")
    return mx.quantized_matmul(x, weight.w, weight.scales, None, transpose=True,
                               group_size=weight.group_size, bits=weight.bits,
                               mode=weight.mode)


def gather_matmul_t(x, weight: MicroscaledWeight, indices, sorted_indices: bool):
    """One expert projection as ``QuantizedSwitchLinear`` computes it: ``mx.gather_qmm(x, w,
    scales, rhs_indices=indices, transpose=True, mode=..., global_scale=...)``."""
    return mx.gather_qmm(x, weight.w, weight.scales, None, rhs_indices=indices,
                         transpose=True, group_size=weight.group_size, bits=weight.bits,
                         mode=weight.mode, global_scale=weight.global_scale,
                         sorted_indices=sorted_indices)


def layer_reason(name: str, module, ndim: int = 2) -> str | None:
    """Why the quantized layer ``module`` (``nn.QuantizedLinear``: ``ndim`` 2;
    ``QuantizedSwitchLinear``: 3) in a microscaling mode cannot feed the bricks' composites
    (None: it can)."""
    try:
        MicroscaledWeight.from_module(module).check(name, ndim=ndim)
    except (TypeError, ValueError) as e:
        return str(e)
    if ndim == 2 and getattr(module, "global_scale", None) is not None:
        return f"{name}.global_scale: nn.QuantizedLinear's quantized_matmul takes none"
    if (getattr(module, "group_size", None), getattr(module, "bits", None)) != (
            MODES[module.mode].group_size, MODES[module.mode].bits):
        return (f"{name}: {module.mode} with group_size {module.group_size}, bits {module.bits} "
                f"(the mode's are {MODES[module.mode].group_size}, {MODES[module.mode].bits})")
    return None
