"""The SSD brick's CUDA twin: the chunked algorithm in three launches, parallel over chunks
(``cuda_src/ssd_chunk_state.cu``: each chunk's own state and log decays;
``ssd_state_pass.cu``: the chunk-to-chunk state passing, the one sequential part, one thread per
state element; ``ssd_chunk_out.cu``: each chunk's outputs from its start state), as mamba_ssm's
``ssd_combined`` orders the SSD steps (Dao & Gu 2024, section 6).

A prompt runs in segments of :data:`SEGMENT` tokens, the state chained between them, so the
per-chunk states in flight stay bounded (2 x SEGMENT / chunk x H x P x N floats: 134 MB at
Nemotron-3-Nano's 64 x 64 x 128 and 2,048 tokens)."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.kernels import launch

#: Tokens per launch set (the state passes between segments).
SEGMENT = 2048
#: Threads per block of each step.
THREADS = 256
#: Slice of the chunk (step 1, tokens) and of N (step 3) held in shared memory at once.
K_SLICE = 32
#: Shared memory a block gets without opting in, bytes.
SHARED_LIMIT = 48 * 1024

for _name, _inputs, _outputs in (
        ("ssd_chunk_state", ("x", "dt", "A", "Bm", "iparams"), ("dS", "Lc")),
        ("ssd_state_pass", ("dS", "Lc", "state_in", "iparams"), ("S0", "state_out")),
        ("ssd_chunk_out", ("x", "dt", "Bm", "Cm", "D", "Lc", "S0", "iparams"), ("y",))):
    kernels.register(kernels.KernelSpec(
        name=_name, body=None, input_names=_inputs, output_names=_outputs,
        cuda_body=f"{_name}.cu", cuda_headers=("mma.cuh",)))

KERNELS = ("ssd_chunk_state", "ssd_state_pass", "ssd_chunk_out")


def state_shared_bytes(P: int, N: int, chunk: int) -> int:
    """Step 1's shared memory, bytes: the log decays and weights, the (K_SLICE x P) scaled
    inputs and (K_SLICE x N) B rows."""
    return 4 * (2 * chunk + K_SLICE * (P + N))


def out_shared_bytes(P: int, chunk: int) -> int:
    """Step 3's shared memory, bytes: log decays, time steps, M^T (chunk x (chunk + 4)), and
    one region for the C, B, S0 slices (phase A) or the chunk's x (phase B)."""
    cs = chunk + 4
    region = max(K_SLICE * (2 * cs + P + 4), chunk * P)
    return 4 * (2 * chunk + chunk * cs + region)


def chunk_size(P: int, N: int) -> int:
    """Tokens per chunk: the largest of 64, 32, 16 whose steps fit :data:`SHARED_LIMIT`."""
    for chunk in (64, 32, 16):
        if max(state_shared_bytes(P, N, chunk), out_shared_bytes(P, chunk)) <= SHARED_LIMIT:
            return chunk
    return 16


def _segment(x, dtp, A, B, C, D, state, out_dtype, chunk):
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    nc = -(-T // chunk)
    ip = mx.array([T, nc], mx.int32)
    geo = [("P", P), ("N", N), ("H", H), ("G", G), ("C", chunk), ("KT", K_SLICE),
           ("NT", THREADS)]
    dS, Lc = launch(
        "ssd_chunk_state", "cuda", shared_memory=state_shared_bytes(P, N, chunk),
        inputs=[x, dtp, A, B, ip], grid=(THREADS * nc, H, b), threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, nc, H, P, N), (b, nc, H, chunk)],
        output_dtypes=[mx.float32, mx.float32], template=[("InT", x.dtype)] + geo)
    hpn = H * P * N
    S0, S = launch(
        "ssd_state_pass", "cuda", inputs=[dS, Lc, state, ip],
        grid=(-(-hpn // THREADS) * THREADS, b, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(b, nc, H, P, N), (b, H, P, N)],
        output_dtypes=[mx.float32, mx.float32],
        template=[("H", H), ("P", P), ("N", N), ("C", chunk), ("NT", THREADS)])
    (y,) = launch(
        "ssd_chunk_out", "cuda", shared_memory=out_shared_bytes(P, chunk),
        inputs=[x, dtp, B, C, D, Lc, S0, ip], grid=(THREADS * nc, H, b),
        threadgroup=(THREADS, 1, 1), output_shapes=[(b, T, H, P)], output_dtypes=[out_dtype],
        template=[("InT", x.dtype), ("OutT", out_dtype)] + geo)
    return y, S


def launch_ssd_cuda(x, dtp, A, B, C, D, state, out_dtype):
    """Run the twin on checked arguments (as ``msl.launch_ssd``: ``dtp`` (batch, T, H) and
    ``A`` (H,) float32 from ``op.ssd_gates``, D (H,), a float32 state (batch, H, P, N); P and N
    multiples of 8). Returns ``(y, state)``: y (batch, T, H, P) in ``out_dtype``, the final
    state float32."""
    T, P, N = x.shape[1], x.shape[-1], B.shape[-1]
    f32 = mx.float32
    dtp, A, D, S = dtp.astype(f32), A.astype(f32), D.astype(f32), state.astype(f32)
    chunk = chunk_size(P, N)
    if T == 0:  # no chunk to launch: no output, the state passes through
        return mx.zeros(x.shape, out_dtype), S
    if T <= SEGMENT:
        return _segment(x, dtp, A, B, C, D, S, out_dtype, chunk)
    ys = []
    for s in range(0, T, SEGMENT):
        e = min(T, s + SEGMENT)
        y, S = _segment(x[:, s:e], dtp[:, s:e], A, B[:, s:e], C[:, s:e], D, S, out_dtype,
                        chunk)
        ys.append(y)
    return mx.concatenate(ys, axis=1), S
