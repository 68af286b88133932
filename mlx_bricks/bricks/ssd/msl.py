"""The SSD brick's MSL kernel (``metal_src/ssd.metal``): spec, tiles and launch. What it
computes: ``op.py`` (the chunked form); the kernel file documents its layout."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks import kernels

#: Tokens per chunk of the kernel and threads per threadgroup (4 SIMD-groups: one 8x8 tile
#: each of the chunk's (C x C) product).
CHUNK = 16
THREADS = 128
#: Largest state size N: the chunk's B and C rows and the state slice live in threadgroup
#: memory (29.4 KB of Apple GPUs' 32 KB at N = 128, C = 16, 16 head columns).
MAX_N = 128

kernels.register(kernels.KernelSpec(
    name="ssd",
    body="ssd.metal",
    input_names=("x", "dt", "A", "Bm", "Cm", "D", "state_in", "iparams"),
    output_names=("y", "state_out"),
))


def shared_bytes(N: int, pb: int, chunk: int = CHUNK) -> int:
    """Threadgroup (shared) memory of the kernel, bytes: the chunk's B and C rows (padded by
    one float against bank conflicts), the state slice, the (C x PB) time-step-scaled inputs
    and output tile, the (C x C) decayed C.B product, the chunk's log decays and decays."""
    return 4 * (2 * chunk * (N + 1) + N * pb + 2 * chunk * pb + chunk * chunk + 3 * chunk)


def head_block(P: int) -> int | None:
    """Head columns per threadgroup for head dim ``P`` (16 or 8), or None."""
    for pb in (16, 8):
        if P % pb == 0:
            return pb
    return None


def kernel_reason(x, B) -> str | None:
    """Why the kernel does not compute these arguments (None: it does): a state size N above
    :data:`MAX_N` or not a multiple of 8 (8x8 tiles), a head dim P not a multiple of 8."""
    P, N = x.shape[-1], B.shape[-1]
    if P == 0 or N == 0:
        return f"empty head dim or state (P {P}, N {N})"
    if N > MAX_N:
        return f"N {N} > {MAX_N}: the kernel's chunk does not fit threadgroup memory"
    if N % 8:
        return f"N {N} is not a multiple of 8 (the kernel's 8x8 tiles)"
    if head_block(P) is None:
        return f"P {P} is not a multiple of 8"
    return None


def launch_kwargs(x, dtp, A, B, C, D, state, out_dtype) -> dict:
    """The kernel call's arguments (inputs, geometry, outputs, template), shared by the MSL
    kernel and the CUDA twin (``cuda.py``)."""
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    pb = head_block(P)
    f32 = mx.float32
    return dict(
        inputs=[x, dtp.astype(f32), A.astype(f32), B, C, D.astype(f32), state.astype(f32),
                mx.array([T], mx.int32)],
        grid=(THREADS * (P // pb), H, b), threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, T, H, P), (b, H, P, N)],
        output_dtypes=[out_dtype, f32],
        template=[("InT", x.dtype), ("OutT", out_dtype), ("P", P), ("N", N), ("H", H),
                  ("G", G), ("C", CHUNK), ("PB", pb), ("NT", THREADS)],
    )


def launch_ssd(x, dtp, A, B, C, D, state, out_dtype, *, backend: str):
    """Run the kernel on ``backend`` (metal or emulator); arguments checked by the op
    (``kernel_reason`` None, a float32 state, D an (H,) array). Returns ``(y, state)``."""
    y, s = kernels.launch("ssd", backend, **launch_kwargs(x, dtp, A, B, C, D, state,
                                                          out_dtype))
    return y, s
