"""The short-conv brick's MSL kernel (``metal_src/short_conv.metal``): spec and launch. What it
computes: ``op.py``; the kernel file documents its layout."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks import kernels

#: Tokens per thread (a thread reloads K - 1 inputs per run) and threads per threadgroup.
TOKENS = 16
THREADS = 128
#: Taps the kernel keeps in registers.
MIN_K, MAX_K = 2, 8

kernels.register(kernels.KernelSpec(
    name="short_conv",
    body="short_conv.metal",
    input_names=("x", "gate_in", "gate_out", "w", "bias", "state_in", "mask", "ends"),
    output_names=("y", "state_out"),
    # views (the in-projection's column blocks, a cache's state) are read in place
    ensure_row_contiguous=False,
    cuda_body="short_conv.cu",
    cuda_headers=("mma.cuh",),
))


#: The most threadgroups along a CUDA grid's y and z (token runs, batch rows).
MAX_GRID_YZ = 65535


def kernel_reason(weight, shape=None) -> str | None:
    """Why the kernel does not compute a convolution of these taps over an input of ``shape``
    ``(b, T, C)`` (None: it does)."""
    K = weight.shape[1]
    if not MIN_K <= K <= MAX_K:
        return f"K {K} taps: the kernel keeps {MIN_K} to {MAX_K} in registers"
    if shape is not None and (-(-shape[1] // TOKENS) > MAX_GRID_YZ or shape[0] > MAX_GRID_YZ):
        return (f"{shape[0]} rows of {shape[1]} tokens: over the grid's {MAX_GRID_YZ} batch "
                f"rows or runs of {TOKENS} tokens")
    return None


#: One-element arrays standing for absent byte and int32 inputs, by dtype (never read; made
#: once, so a launch adds no operation for them).
_ABSENT: dict = {}


def _absent(dtype):
    a = _ABSENT.get(dtype)
    if a is None:
        a = mx.zeros((1,), dtype)
        mx.eval(a)  # evaluated: a lazy array belongs to its maker's thread's stream
        _ABSENT[dtype] = a
    return a


def launch_kwargs(x, weight, bias=None, state=None, mask=None, gate_in=None, gate_out=None,
                  activation=None, lengths=None) -> dict:
    """The kernel call's arguments (inputs, geometry, outputs, template), shared by the MSL
    kernel and the CUDA twin; arguments as the op takes them (checked). The arrays go as
    they are (views included; an absent gate, bias or state: ``x``, never read): the only
    operations besides the launch are the mask's cast to bytes and the lengths' clip."""
    b, T, C = x.shape
    K = weight.shape[1]
    ends = None if lengths is None else mx.clip(lengths, 0, T).astype(mx.int32)
    return dict(
        inputs=[x, x if gate_in is None else gate_in, x if gate_out is None else gate_out,
                weight, x if bias is None else bias, x if state is None else state,
                _absent(mx.uint8) if mask is None else mask.astype(mx.uint8),
                _absent(mx.int32) if ends is None else ends],
        grid=(C, max(1, -(-T // TOKENS)), b), threadgroup=(min(THREADS, C), 1, 1),
        output_shapes=[(b, T, C), (b, K - 1, C)],
        output_dtypes=[x.dtype, x.dtype],
        template=[("InT", x.dtype), ("CH", C), ("K", K), ("TT", TOKENS),
                  ("GATE_IN", int(gate_in is not None)), ("GATE_OUT", int(gate_out is not None)),
                  ("BIAS", int(bias is not None)), ("STATE", int(state is not None)),
                  ("MASK", int(mask is not None)), ("ENDS", int(ends is not None)),
                  ("SILU", int(activation == "silu"))],
    )


def launch_short_conv(*args, backend: str):
    """Run the kernel on ``backend`` (metal or emulator) on checked arguments (those of
    ``op.short_conv``, positionally, ``kernel_reason`` None). Returns ``(y, state)``."""
    y, s = kernels.launch("short_conv", backend, **launch_kwargs(*args))
    return y, s
