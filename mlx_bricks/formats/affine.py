"""MLX affine-quantized weights as the bricks take them: :class:`QuantizedWeight`.

MLX's affine format (``mx.quantize(w, group_size, bits)``, ``nn.QuantizedLinear``): a float
weight ``(N, K)`` becomes

* ``w``: uint32 ``(N, K * bits // 32)``: each row is a little-endian bit stream, value ``j`` of
  the row in bits ``[j * bits, (j + 1) * bits)`` (for bits 2, 4, 8 that is ``32 // bits``
  values per word, LSB first; 3, 5 and 6 straddle words the same way);
* ``scales``, ``biases``: ``(N, K // group_size)`` in the weight's float dtype;
* value ``w[n, k] = scales[n, k // group_size] * q[n, k] + biases[n, k // group_size]``.

Bits 2, 3, 4, 5, 6 and 8 and group sizes 32, 64 and 128 are what the bricks read (MLX's affine
set). Other modes (``mxfp4``, ``nvfp4``, ``mxfp8``) are not affine: they are
``formats.microscaling``'s; the kernel ops' :func:`as_weight` refuses them with a
``ValueError``, and the patch feeds such layers to the kinds' ``dequant`` composites only.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks.checks import FLOAT_DTYPES, check_array, dtype_name

#: Affine widths the bricks read.
BITS = (2, 3, 4, 5, 6, 8)
#: Group sizes the bricks read.
GROUP_SIZES = (32, 64, 128)
#: The only quantization mode the bricks read.
MODE = "affine"


@dataclass(frozen=True)
class QuantizedWeight:
    """An ``nn.Linear``-layout weight ``(N, K)`` in MLX's affine format (module docstring).

    Attributes:
        w: uint32 ``(N, K * bits // 32)``, packed as ``mx.quantize`` packs it.
        scales: ``(N, K // group_size)``, float16 / bfloat16 / float32.
        biases: same shape and dtype as ``scales``.
        group_size: 32, 64 or 128.
        bits: 2, 3, 4, 5, 6 or 8.
        mode: ``"affine"`` (anything else is refused by :meth:`check`).

    Build one from a layer with :meth:`from_module` or from ``mx.quantize``'s triple. The fields
    are checked by :meth:`check` (every op that takes a weight calls it).
    """

    w: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int
    bits: int
    mode: str = MODE

    @classmethod
    def from_module(cls, module) -> "QuantizedWeight":
        """The weight of an ``nn.QuantizedLinear`` (or any module with ``weight``, ``scales``,
        ``biases``, ``group_size``, ``bits`` and optionally ``mode``).

        Raises:
            TypeError: the module lacks one of those attributes.
        """
        try:
            return cls(module.weight, module.scales, module["biases"] if "biases" in module
                       else None, module.group_size, module.bits,
                       getattr(module, "mode", MODE))
        except AttributeError as e:
            raise TypeError(f"module {type(module).__name__} is not a quantized linear: {e}") \
                from None

    @property
    def shape(self) -> tuple[int, int]:
        """The float weight's ``(N, K)``."""
        return (self.w.shape[0], self.w.shape[1] * 32 // self.bits)

    @property
    def dtype(self):
        """The float dtype of the dequantized weight (``scales.dtype``)."""
        return self.scales.dtype

    def dequantize(self, dtype=None) -> mx.array:
        """``(N, K)`` float weight of ``dtype`` (None: ``scales.dtype``; ``mx.dequantize``)."""
        return mx.dequantize(self.w, self.scales, self.biases, group_size=self.group_size,
                             bits=self.bits, dtype=dtype)

    def check(self, name: str = "weight", K: int | None = None, rows: str = "N") -> None:
        """Validate the fields (and, when ``K`` is given, that the weight is ``(rows, K)``).

        Raises:
            TypeError: a field that is not an ``mx.array`` or has the wrong dtype.
            ValueError: a mode other than affine, bits or group_size MLX's affine format does
                not have, a packed width that does not match K, a group_size that does not
                divide K, or scales/biases of the wrong shape; the message names the field.
        """
        if self.mode != MODE:
            raise ValueError(f"{name}.mode must be 'affine' for the kernels, got {self.mode!r} "
                             "(mxfp4 / nvfp4 / mxfp8 reach the bricks through the dequant "
                             "composites only)")
        for field_name in ("bits", "group_size"):
            v = getattr(self, field_name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise TypeError(f"{name}.{field_name} must be an int, got {type(v).__name__}")
        if self.bits not in BITS:
            raise ValueError(f"{name}.bits must be one of {BITS}, got {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"{name}.group_size must be one of {GROUP_SIZES}, "
                             f"got {self.group_size}")
        check_array(f"{name}.w", self.w, ndim=2)
        if self.w.dtype != mx.uint32:
            raise TypeError(f"{name}.w must be uint32 (packed), got {dtype_name(self.w.dtype)}")
        check_array(f"{name}.scales", self.scales, ndim=2)
        if self.biases is None:
            raise ValueError(f"{name}.biases is missing (affine mode has scales and biases)")
        check_array(f"{name}.biases", self.biases, ndim=2)
        if self.scales.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name}.scales must be float16, bfloat16 or float32, "
                            f"got {dtype_name(self.scales.dtype)}")
        if self.biases.dtype != self.scales.dtype:
            raise TypeError(f"{name}.biases has dtype {dtype_name(self.biases.dtype)} but "
                            f"{name}.scales has {dtype_name(self.scales.dtype)}")
        N, packed = self.w.shape
        if (packed * 32) % self.bits:
            raise ValueError(f"{name}.w has {packed} words per row, not a whole number of "
                             f"{self.bits}-bit values")
        Kw = packed * 32 // self.bits
        if K is not None and Kw != K:
            raise ValueError(
                f"{name}.w has {packed} words per row, i.e. K={Kw} at {self.bits} bits; "
                f"expected K={K} ({K * self.bits // 32} words) for ({rows}, K={K})")
        if Kw % self.group_size:
            raise ValueError(f"{name}.group_size {self.group_size} must divide K={Kw}")
        want = (N, Kw // self.group_size)
        for field_name in ("scales", "biases"):
            got = tuple(getattr(self, field_name).shape)
            if got != want:
                raise ValueError(f"{name}.{field_name} must have shape {want} "
                                 f"(N, K // group_size), got {got}")


def as_weight(value, name: str = "weight", K: int | None = None, rows: str = "N"):
    """``value`` as the bricks take a weight: an ``mx.array``, a :class:`QuantizedWeight`, or an
    ``nn.QuantizedLinear`` (converted with :meth:`QuantizedWeight.from_module`). A quantized
    weight is checked (:meth:`QuantizedWeight.check` with ``K`` and ``rows``); an array is
    returned as it is (see :func:`check_weight`).

    Raises:
        TypeError: anything else.
        ValueError: a quantized weight that fails :meth:`QuantizedWeight.check`.
    """
    if isinstance(value, mx.array):
        return value
    from mlx_bricks.formats.microscaling import MicroscaledWeight

    if isinstance(value, MicroscaledWeight):
        raise ValueError(f"{name} is {value.mode}: the kernels read float and MLX affine weights "
                         "(microscaled weights reach the bricks through the dequant composites)")
    if not isinstance(value, QuantizedWeight):
        import mlx.nn as nn

        if not isinstance(value, nn.QuantizedLinear):
            raise TypeError(f"{name} must be an mx.array, a QuantizedWeight or an "
                            f"nn.QuantizedLinear, got {type(value).__name__}")
        value = QuantizedWeight.from_module(value)
    value.check(name, K, rows)
    return value


def check_weight(name: str, weight, x: mx.array, K: int | None, rows: str = "N"):
    """Validate an op's weight argument against the activations ``x`` (already checked: a float
    array) and return it as the kernels take it (:func:`as_weight`).

    A float weight must be a 2-D ``(rows, K)`` array of x's dtype; a quantized one must pass
    :meth:`QuantizedWeight.check` for ``K`` and have scales of x's dtype (the kernels compute
    in one dtype: the dequantized tile is written in it). ``K=None``: the caller checks the
    shape itself.

    Raises:
        TypeError: not an array / quantized weight, or a dtype that is not x's (the message
            names the argument, e.g. ``wq.scales``).
        ValueError: a shape that is not ``(rows, K)``, or a quantized weight MLX's affine format
            does not describe.
    """
    from mlx_bricks.checks import check_linear_weight, check_same_dtype

    weight = as_weight(weight, name, K, rows)
    if isinstance(weight, QuantizedWeight):
        if weight.dtype != x.dtype:
            raise TypeError(
                f"{name}.scales has dtype {dtype_name(weight.dtype)} but x has "
                f"{dtype_name(x.dtype)}; a quantized weight's scales must have the "
                "activations' dtype"
            )
        return weight
    check_array(name, weight, ndim=2)
    check_same_dtype("x", x, **{name: weight})
    if K is not None:
        check_linear_weight(name, weight, K, rows)
    return weight


def unsupported_reason(value, dtype=None) -> str | None:
    """Why the bricks cannot take ``value`` (a weight, ``QuantizedWeight`` or
    ``nn.QuantizedLinear``) with activations of ``dtype``; None when they can. For the patch:
    a layer it returns a reason for keeps the stock path with that reason (e.g. ``mode
    'mxfp4'``, bits 1, scales of another dtype)."""
    try:
        weight = as_weight(value)
    except (TypeError, ValueError) as e:
        return str(e)
    if dtype is not None and weight.dtype != dtype:
        return (f"weight dtype {dtype_name(weight.dtype)} differs from the activations' "
                f"{dtype_name(dtype)}")
    return None
