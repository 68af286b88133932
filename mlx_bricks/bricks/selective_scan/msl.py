"""The selective-scan brick's MSL kernel (``metal_src/selective_scan.metal``): spec, geometry
and launch, shared with the CUDA twin (``cuda.py``). What it computes: ``op.py``; the kernel
file documents its layout."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks import kernels

#: Threads per threadgroup (CUDA block).
THREADS = 256
#: The most state entries one thread keeps in registers, and the most lanes (threads) that
#: share a channel's N entries (their partial y summed by SIMD shuffles).
MAX_PER_LANE = 16
MAX_LANES = 8

kernels.register(kernels.KernelSpec(
    name="selective_scan",
    body="selective_scan.metal",
    input_names=("x", "delta", "A", "Bm", "Cm", "D", "state_in", "iparams"),
    output_names=("y", "state_out"),
    cuda_body="selective_scan.cu",
    cuda_headers=("mma.cuh",),
))


def lanes(N: int) -> int:
    """Threads per channel for state size ``N``: the most of 8, 4, 2, 1 that divides N (more
    threads over a prefill's few thousand channels hide the scan's latency better)."""
    return next(lane for lane in (MAX_LANES, 4, 2, 1) if N % lane == 0)


def kernel_reason(N: int) -> str | None:
    """Why the kernel does not compute a state of ``N`` entries per channel (None: it does):
    each thread keeps ``N / lanes(N)`` of them in registers, at most :data:`MAX_PER_LANE`."""
    if N // lanes(N) > MAX_PER_LANE:
        return (f"N {N}: {N // lanes(N)} state entries per thread, the kernel keeps at most "
                f"{MAX_PER_LANE} in registers")
    return None


def launch_kwargs(x, delta, A, B, C, D, state, out_dtype) -> dict:
    """The kernel call's arguments (inputs, geometry, outputs, template); arguments as
    ``op.run_kernel`` takes them."""
    b, T, ch = x.shape
    N = A.shape[1]
    L = lanes(N)
    f32 = mx.float32
    d = mx.zeros((ch,), f32) if D is None else D.astype(f32)
    s = mx.zeros((b, ch, N), f32) if state is None else state.astype(f32)
    threads = -(-ch * L // THREADS) * THREADS
    return dict(
        inputs=[x, delta.astype(f32), A.astype(f32), B.astype(f32), C.astype(f32), d, s,
                mx.array([T], mx.int32)],
        grid=(threads, b, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, T, ch), (b, ch, N)],
        output_dtypes=[out_dtype, f32],
        template=[("InT", x.dtype), ("OutT", out_dtype), ("CH", ch), ("N", N), ("L", L),
                  ("NT", THREADS)],
    )


def launch(kwargs: dict, *, backend: str):
    """Run the kernel on ``backend`` (metal or emulator) with :func:`launch_kwargs`. Returns
    ``(y, state)``."""
    y, s = kernels.launch("selective_scan", backend, **kwargs)
    return y, s
