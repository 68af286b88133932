"""Weight formats: the one place that knows how a weight the bricks read is stored.

Two formats of GEMM weights reach the bricks (``nn.Linear`` layout ``(N, K)``, ``y = x @ W.T``):

* float: an ``mx.array`` of the activations' dtype (``nn.Linear``);
* MLX affine: a :class:`~mlx_bricks.formats.affine.QuantizedWeight` (``nn.QuantizedLinear``,
  ``mx.quantize``): bits 2, 3, 4, 5, 6, 8, group size 32, 64, 128.

* MLX's microscaling modes: a :class:`~mlx_bricks.formats.microscaling.MicroscaledWeight`
  (``nn.QuantizedLinear(mode=...)``, ``QuantizedSwitchLinear``): ``mxfp4``, ``nvfp4``, ``mxfp8``.
  No kernel reads them; the kinds' ``dequant`` composites do (:attr:`Format.kernels`).

K/V may come as Q8_0 blocks (``mlx_bricks.formats.q8_0``: ggml's ``block_q8_0``).

:func:`format_of` gives a weight's :class:`Format`, which answers every question the bricks, the
tuner and the patch ask of a weight: its decision key (``"float"``, ``"q4g64"``), its kernel
inputs and template parameters per backend, the stock computation (what ``nn.Linear`` /
``nn.QuantizedLinear`` compute) and its dense float value. Nothing else branches on "float,
affine or microscaled?".
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks.formats import microscaling
from mlx_bricks.formats.affine import MODE, QuantizedWeight
from mlx_bricks.formats.microscaling import MicroscaledWeight


@dataclass(frozen=True)
class Format:
    """The storage format of one GEMM weight.

    Attributes:
        bits: 0 for a float weight, else the width (affine: 2, 3, 4, 5, 6, 8; the
            microscaling modes: 4 or 8).
        group_size: 0 for a float weight, else the group size (affine: 32, 64, 128; mxfp4 and
            mxfp8: 32, nvfp4: 16).
        mode: the quantization mode: ``"affine"`` (float weights too), ``"mxfp4"``,
            ``"nvfp4"``, ``"mxfp8"``.
    """

    bits: int = 0
    group_size: int = 0
    mode: str = MODE

    @property
    def quantized(self) -> bool:
        """True for a quantized weight (affine or microscaled): what the ``dequant``
        composites apply to."""
        return self.bits != 0

    @property
    def microscaled(self) -> bool:
        """True for ``mxfp4``, ``nvfp4`` or ``mxfp8`` (``formats.microscaling``)."""
        return microscaling.is_microscaled_mode(self.mode)

    @property
    def kernels(self) -> bool:
        """Whether the MSL and CUDA kernels read this format (float and MLX affine; the
        microscaling modes reach the bricks through their composites only)."""
        return not self.microscaled

    @property
    def key(self) -> str:
        """The decision-key spelling: ``"float"``, ``"q<bits>g<group_size>"`` or the mode
        (``"mxfp4"``: its bits and group size are the mode's)."""
        if self.microscaled:
            return self.mode
        return f"q{self.bits}g{self.group_size}" if self.quantized else "float"

    def __str__(self) -> str:
        if self.microscaled:
            return f"{self.mode} gs{self.group_size}"
        return f"q{self.bits} gs{self.group_size}" if self.quantized else "float"

    def _no_kernel(self, what: str) -> None:
        if self.microscaled:
            raise ValueError(f"{what}: no kernel reads {self.mode} weights (the composites do)")

    # --- kernel inputs ---------------------------------------------------------------------

    def msl_inputs(self, weight) -> tuple[list, dict]:
        """The MSL kernels' inputs ``[w, scales, biases]`` and template flags ``BITS``,
        ``GROUP_SIZE``, row-contiguous; a float weight stands in for the absent scales and
        biases (the kernel is compiled without them and never reads them).

        Raises:
            ValueError: a microscaled weight (no kernel reads one).
        """
        self._no_kernel("msl_inputs")
        if self.quantized:
            arrays = [mx.contiguous(a) for a in (weight.w, weight.scales, weight.biases)]
            return arrays, {"BITS": self.bits, "GROUP_SIZE": self.group_size}
        w = mx.contiguous(weight)
        return [w, w, w], {"BITS": 0, "GROUP_SIZE": 0}

    def cuda_inputs(self, weight, dtype, name: str = "weight") -> tuple[tuple, int, int]:
        """``((w, scales, biases), BITS, GS)`` as the CUDA GEMM twins take a weight: a float
        weight is ``(weight, weight, weight)`` with bits 0 and GS 32 (placeholders of the
        activation dtype, never read, as the generated signature needs them).

        Raises:
            TypeError: a float weight, or affine scales, of another dtype than ``dtype``.
            ValueError: a microscaled weight (no kernel reads one).
        """
        self._no_kernel("cuda_inputs")
        if self.quantized:
            if weight.scales.dtype != dtype:
                raise TypeError(f"{name}.scales is {weight.scales.dtype} but x is {dtype}; the "
                                "CUDA twins take scales and biases of the activation dtype")
            arrays = tuple(mx.contiguous(a) for a in (weight.w, weight.scales, weight.biases))
            return arrays, self.bits, self.group_size
        if weight.dtype != dtype:
            raise TypeError(f"{name} is {weight.dtype} but x is {dtype}")
        w = mx.contiguous(weight)
        return (w, w, w), 0, 32

    # --- stock computation -----------------------------------------------------------------

    def matmul_t(self, x, weight):
        """``x @ W.T`` the stock way: ``mx.quantized_matmul(..., transpose=True)`` for an affine
        weight (what ``nn.QuantizedLinear`` calls; with ``mode`` for a microscaled one), the
        float product otherwise."""
        if self.microscaled:
            return microscaling.matmul_t(x, weight)
        if self.quantized:
            return mx.quantized_matmul(x, weight.w, weight.scales, weight.biases,
                                       transpose=True, group_size=self.group_size,
                                       bits=self.bits, mode=self.mode)
        return x @ weight.T

    def linear(self, x, weight, bias=None):
        """What ``nn.Linear`` / ``nn.QuantizedLinear`` compute for ``x`` (mlx 0.32's modules):
        ``mx.addmm(bias, x, W.T)`` for a float weight with a bias, else the product plus the
        bias."""
        if not self.quantized and bias is not None:
            return mx.addmm(bias, x, weight.T)
        y = self.matmul_t(x, weight)
        return y if bias is None else y + bias

    def dense(self, weight):
        """The ``(N, K)`` float weight (``mx.dequantize``: of the scales' dtype for an affine
        one, float32 for a microscaled one, where its values are exact)."""
        return weight.dequantize() if self.quantized else weight


#: The float format.
FLOAT = Format()


def format_of(weight) -> Format:
    """The :class:`Format` of ``weight`` (an ``mx.array``, a ``QuantizedWeight`` or a
    ``MicroscaledWeight``)."""
    if isinstance(weight, MicroscaledWeight):
        return Format(weight.bits, weight.group_size, weight.mode)
    if isinstance(weight, QuantizedWeight):
        return Format(weight.bits, weight.group_size, weight.mode)
    return FLOAT


def same_format(*weights) -> bool:
    """Whether every weight has the same :class:`Format` (one loader serves them all)."""
    return len({format_of(w) for w in weights}) <= 1


def formats_key(*weights) -> str:
    """The decision-key spelling of an op's weights: their common :attr:`Format.key`, or each
    one's joined by ``/`` in argument order when they differ (``"q3g64/q3g64/q6g64"``: a mixed
    recipe's v_proj), so ops whose weights differ in any one format get their own decisions."""
    keys = [format_of(w).key for w in weights]
    return keys[0] if len(set(keys)) == 1 else "/".join(keys)


def kernel_readable(*weights) -> bool:
    """Whether the kernels read every one of ``weights`` (:attr:`Format.kernels`): a kind
    lists no kernel variant otherwise, and its composites compete with stock alone."""
    return all(format_of(w).kernels for w in weights if w is not None)


def widest_bits(*weights) -> int | None:
    """The largest affine width among ``weights`` (None when all are float): what a CUDA tile
    must take (``max_bits``)."""
    return max(format_of(w).bits for w in weights) or None


def dense(weight):
    """The float value of ``weight`` (:meth:`Format.dense`)."""
    return format_of(weight).dense(weight)


from mlx_bricks.formats.affine import as_weight, check_weight, unsupported_reason  # noqa: E402,F401
