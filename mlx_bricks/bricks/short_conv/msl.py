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
    input_names=("x", "gate_in", "gate_out", "w", "bias", "state_in", "mask", "ends",
                 "iparams"),
    output_names=("y", "state_out"),
    cuda_body="short_conv.cu",
    cuda_headers=("mma.cuh",),
))


def kernel_reason(weight) -> str | None:
    """Why the kernel does not compute a convolution of these taps (None: it does)."""
    K = weight.shape[1]
    if not MIN_K <= K <= MAX_K:
        return f"K {K} taps: the kernel keeps {MIN_K} to {MAX_K} in registers"
    return None


def launch_kwargs(x, weight, bias=None, state=None, mask=None, gate_in=None, gate_out=None,
                  activation=None, lengths=None) -> dict:
    """The kernel call's arguments (inputs, geometry, outputs, template), shared by the MSL
    kernel and the CUDA twin; arguments as the op takes them (checked)."""
    b, T, C = x.shape
    K = weight.shape[1]
    dummy = mx.zeros((1,), x.dtype)
    if state is None:
        state = mx.zeros((b, K - 1, C), x.dtype)
    ends = (mx.full((b,), T, mx.int32) if lengths is None
            else mx.clip(lengths, 0, T).astype(mx.int32))
    return dict(
        inputs=[x, dummy if gate_in is None else gate_in, dummy if gate_out is None else gate_out,
                weight.reshape(C, K).astype(mx.float32), dummy if bias is None else bias, state,
                mx.zeros((1,), mx.uint8) if mask is None else mask.astype(mx.uint8), ends,
                mx.array([T], mx.int32)],
        grid=(C, max(1, -(-T // TOKENS)), b), threadgroup=(min(THREADS, C), 1, 1),
        output_shapes=[(b, T, C), (b, K - 1, C)],
        output_dtypes=[x.dtype, x.dtype],
        template=[("InT", x.dtype), ("CH", C), ("K", K), ("TT", TOKENS),
                  ("GATE_IN", int(gate_in is not None)), ("GATE_OUT", int(gate_out is not None)),
                  ("BIAS", int(bias is not None)), ("MASK", int(mask is not None)),
                  ("SILU", int(activation == "silu"))],
    )


def launch_short_conv(*args, backend: str):
    """Run the kernel on ``backend`` (metal or emulator) on checked arguments (those of
    ``op.short_conv``, positionally, ``kernel_reason`` None). Returns ``(y, state)``."""
    y, s = kernels.launch("short_conv", backend, **launch_kwargs(*args))
    return y, s
