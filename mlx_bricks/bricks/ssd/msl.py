"""The SSD brick's kernels: the chunked algorithm in three launches, parallel over chunks, as
mamba_ssm's ``ssd_combined`` orders the SSD steps (Dao & Gu 2024, section 6):

1. ``ssd_chunk_state`` (``metal_src/ssd_chunk_state.metal``): each chunk's log decays and its
   own state contribution (from zero), all chunks at once;
2. ``ssd_state_pass``: the chunk-to-chunk state passing, the one sequential part, one thread
   per state element;
3. ``ssd_chunk_out``: each chunk's outputs from its start state, the D skip fused.

Each MSL file has its CUDA twin of the same name in ``cuda_src/`` (same inputs, outputs,
template and geometry; ``cuda.py``). Steps 1 and 3 multiply slices held in threadgroup
(shared) memory: on Metal as 8x8 float simdgroup matrices where the sizes are multiples of 8,
else as 4x4 register tiles of float32 FMAs (``metal_src/tile4.h``; the twins:
``cuda_src/tile4.cuh``); on CUDA, for bfloat16 inputs, on tensor cores (``cuda_src/ssd_mma.cuh``:
mma.sync, float operands split in two bf16s; :func:`mma_floats`). What they compute:
``op.py``. A prompt runs in segments
of :data:`SEGMENT` tokens, the state chained between them, so the per-chunk states in flight
stay bounded (2 x SEGMENT / chunk x H x P x N floats: 134 MB at Nemotron-3-Nano's 64 x 64 x 128
with chunks of 64).
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks import kernels

#: Tokens per launch set (the state passes between segments).
SEGMENT = 2048
#: Threads per threadgroup of each step.
THREADS = 256
#: Largest P x N: step 1 holds P x N / THREADS accumulators per thread (64 registers at this)
MAX_STATE = 16384
#: Threadgroup (shared) memory a threadgroup may use, bytes: Apple GPUs' 32 KB; on CUDA the
#: 48 KB a block gets without opting in.
SHARED_LIMIT = {"cuda": 48 * 1024}
METAL_SHARED_LIMIT = 32 * 1024

for _name, _inputs, _outputs, _tiles in (
        ("ssd_chunk_state", ("x", "dt", "A", "Bm", "iparams"), ("dS", "Lc"), True),
        ("ssd_state_pass", ("dS", "Lc", "state_in", "iparams"), ("S0", "state_out"), False),
        ("ssd_chunk_out", ("x", "dt", "Bm", "Cm", "D", "Lc", "S0", "iparams"), ("y",), True)):
    kernels.register(kernels.KernelSpec(  # _tiles: the step multiplies tiles
        name=_name, body=f"{_name}.metal", input_names=_inputs, output_names=_outputs,
        headers=("tile4.h",) if _tiles else (), cuda_body=f"{_name}.cu",
        cuda_headers=("mma.cuh", "tile4.cuh", "ssd_mma.cuh") if _tiles else ("mma.cuh",)))

#: The steps, in launch order.
KERNELS = ("ssd_chunk_state", "ssd_state_pass", "ssd_chunk_out")


def state_floats(P: int, N: int, chunk: int, kt: int) -> int:
    """Step 1's threadgroup floats: the log decays and weights, the (kt x P) scaled inputs and
    (kt x N) B rows."""
    return 2 * chunk + kt * (P + N)


def out_floats(P: int, chunk: int, kt: int) -> int:
    """Step 3's threadgroup floats: log decays, time steps, M^T (chunk x (chunk + 4)), and one
    region for the C, B, S0 slices (phase A) or the chunk's x (phase B)."""
    cs = chunk + 4
    return 2 * chunk + chunk * cs + max(kt * (2 * cs + P + 4), chunk * P)


def mma_floats(P: int, N: int, chunk: int, kt: int) -> tuple[int, int] | None:
    """The CUDA twin's shared floats of steps 1 and 3 on tensor cores (bfloat16 inputs, P, N,
    chunk and slice multiples of 16; ``cuda_src/ssd_chunk_state.cu`` and ``ssd_chunk_out.cu``
    lay them out: bf16 arrays with rows padded by 8), or None where the products run as
    scalar tiles."""
    if P % 16 or N % 16 or chunk % 16 or kt % 16:
        return None
    state = 8 * chunk + 2 * kt * (2 * (P + 8) + N + 8)
    out = 8 * chunk + max(4 * (kt + 8) * (chunk + P),
                          2 * (2 * chunk * (chunk + 8) + chunk * (P + 8)))
    return -(-state // 4), -(-out // 4)


#: State elements per thread of step 2 by backend (1 or 4: the CUDA twin's 16-byte loads and
#: stores; unmeasured: 1 until a GPU run shows 4 pays, scripts/gpu/ssd_variants.py).
STATE_VEC = {"cuda": 1}

#: The largest slice each tensor-core step takes (step 1: tokens, step 3: state columns).
#: H100, one Nemotron-3-Nano layer (bench/results/2026-12-07-h100-session7.md): 64 / 64 took
#: the op 0.717 -> 0.493 ms at 2,048 tokens, 1.764 -> 1.660 at 8,192 against 32 / 32.
MMA_SLICE_MAX = {"ssd_chunk_state": 64, "ssd_chunk_out": 64}


def mma_slice(P: int, N: int, chunk: int, backend: str, step: str) -> int | None:
    """The slice of the CUDA twin's tensor-core ``step``, a multiple of 16 up to its
    :data:`MMA_SLICE_MAX` whose :func:`mma_floats` fit the backend's shared memory, or None
    (none fits: the step runs scalar tiles). Step 1 (``ssd_chunk_state``) walks the chunk's
    tokens: the largest that divides ``chunk``. Step 3 (``ssd_chunk_out``) walks N: the one
    with the fewest columns past N (the last slice's zeros), then the largest (fewer fills and
    barriers per chunk, more registers)."""
    if mma_floats(P, N, chunk, 16) is None:  # P, N or chunk not a multiple of 16
        return None
    limit = SHARED_LIMIT.get(backend, METAL_SHARED_LIMIT)
    i = KERNELS.index(step) // 2  # mma_floats' entry: 0 for step 1, 1 for step 3
    fits = [s for s in range(16, MMA_SLICE_MAX[step] + 1, 16)
            if 4 * mma_floats(P, N, chunk, s)[i] <= limit and (i or chunk % s == 0)]
    if not fits:
        return None
    return max(fits) if i == 0 else min(fits, key=lambda s: (-(-N // s) * s, -s))


def tiles(P: int, N: int, backend: str) -> tuple[int, int] | None:
    """``(chunk, kt)``: tokens per chunk and the slice held in threadgroup memory at once, the
    largest (64, 32, 16 tokens; slices of 32, 16, 8) whose steps fit the backend's threadgroup
    memory; None when none does."""
    limit = SHARED_LIMIT.get(backend, METAL_SHARED_LIMIT)
    for chunk in (64, 32, 16):
        for kt in (32, 16, 8):
            if 4 * max(state_floats(P, N, chunk, kt), out_floats(P, chunk, kt)) <= limit:
                return chunk, kt
    return None


def kernel_reason(x, B, backend: str = "metal") -> str | None:
    """Why the kernels do not compute these arguments (None: they do): a head dim P or state
    size N not a multiple of 4 (4x4 tiles), a state P x N above :data:`MAX_STATE`
    (registers), or slices too large for threadgroup memory."""
    P, N = x.shape[-1], B.shape[-1]
    if P == 0 or N == 0:
        return f"empty head dim or state (P {P}, N {N})"
    if P % 4 or N % 4:
        return f"P {P} and N {N} must be multiples of 4 (the kernels' 4x4 tiles)"
    if P * N > MAX_STATE:
        return f"P {P} x N {N} > {MAX_STATE}: too many accumulators per thread"
    if tiles(P, N, backend) is None:
        return f"P {P}, N {N}: the kernels' slices do not fit threadgroup memory"
    return None


def _segment(launch, backend, x, dtp, A, B, C, D, state, out_dtype):
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    chunk, kt = tiles(P, N, backend)
    nc = -(-T // chunk)
    ip = mx.array([T, nc], mx.int32)
    f32 = mx.float32
    shared = (lambda floats: 4 * floats) if backend == "cuda" else (lambda floats: 0)
    sf, of = state_floats(P, N, chunk, kt), out_floats(P, chunk, kt)
    kt1 = kt3 = kt
    if backend == "cuda" and x.dtype == mx.bfloat16:
        # the tensor-core path's own slices and bytes (more blocks per SM), step by step
        s1, s3 = (mma_slice(P, N, chunk, backend, k) for k in KERNELS[::2])
        if s1 is not None:
            kt1, sf = s1, mma_floats(P, N, chunk, s1)[0]
        if s3 is not None:
            kt3, of = s3, mma_floats(P, N, chunk, s3)[1]
    geo = [("P", P), ("N", N), ("H", H), ("G", G), ("C", chunk), ("NT", THREADS)]
    dS, Lc = launch(
        "ssd_chunk_state", backend, shared_memory=shared(sf),
        inputs=[x, dtp, A, B, ip], grid=(THREADS * nc, H, b), threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, nc, H, P, N), (b, nc, H, chunk)], output_dtypes=[f32, f32],
        template=[("InT", x.dtype)] + geo + [("KT", kt1), ("SF", sf)])
    vec = STATE_VEC.get(backend, 1) if N % 4 == 0 else 1
    threads = -(-H * P * N // vec)
    S0, S = launch(
        "ssd_state_pass", backend, inputs=[dS, Lc, state, ip],
        grid=(-(-threads // THREADS) * THREADS, b, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, nc, H, P, N), (b, H, P, N)], output_dtypes=[f32, f32],
        template=[("H", H), ("P", P), ("N", N), ("C", chunk), ("NT", THREADS), ("VEC", vec)])
    (y,) = launch(
        "ssd_chunk_out", backend, shared_memory=shared(of),
        inputs=[x, dtp, B, C, D, Lc, S0, ip], grid=(THREADS * nc, H, b),
        threadgroup=(THREADS, 1, 1), output_shapes=[(b, T, H, P)], output_dtypes=[out_dtype],
        template=[("InT", x.dtype), ("OutT", out_dtype)] + geo + [("KT", kt3), ("SF", of)])
    return y, S


def run_steps(x, dtp, A, B, C, D, state, out_dtype, *, backend: str, launch=None):
    """Run the three steps on ``backend`` (metal, emulator, cuda) for checked arguments
    (``kernel_reason`` None): x (batch, T, H, P), ``dtp`` (batch, T, H) and ``A`` (H,) from
    ``op.ssd_gates``, B, C (batch, T, G, N), D (H,), a float32 state (batch, H, P, N).
    ``launch``: ``kernels.launch`` or a module's copy of it (the CUDA twin's). Returns
    ``(y, state)``: y in ``out_dtype``, the final state float32."""
    launch = launch or kernels.launch
    T = x.shape[1]
    f32 = mx.float32
    dtp, A, D, S = dtp.astype(f32), A.astype(f32), D.astype(f32), state.astype(f32)
    # one contiguous copy each (a model's x, B, C are slices of its conv output), not one per
    # launch that reads them
    x, B, C = mx.contiguous(x), mx.contiguous(B), mx.contiguous(C)
    if T == 0:  # no chunk to launch: no output, the state passes through
        return mx.zeros(x.shape, out_dtype), S
    ys = []
    for s in range(0, T, SEGMENT):
        e = min(T, s + SEGMENT)
        part = (slice(None), slice(s, e))
        y, S = _segment(launch, backend, x[part], dtp[part], A, B[part], C[part], D, S,
                        out_dtype)
        ys.append(y)
    return (ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=1)), S
