// SSD brick, step 2 of 3 (CUDA twin of metal_src/ssd_state_pass.metal, same inputs, outputs,
// template arguments and geometry): the state passed from chunk to chunk, the one sequential
// part. One thread per state element e = (h, p, n) of a batch row, float32:
//   S0[b, c, e] = S                              (the state at chunk c's start)
//   S = exp(L_C of chunk c) S + dS[b, c, e]
// from S = state_in[b, e]; state_out[b, e] = S after the last chunk.
// Template: H, P, N, C (tokens per chunk), NT (threads per block).
// Inputs: dS (B, n_chunks, H, P, N) float; Lc (B, n_chunks, H, C) float (step 1);
//   state_in (B, H, P, N) float; iparams int32 [T, n_chunks].
// Outputs: S0 (B, n_chunks, H, P, N) float; state_out (B, H, P, N) float; all written.
// Grid: (H * P * N rounded up to NT, B) threads, blocks of (NT, 1, 1).

const int NC = iparams[1];
constexpr int HPN = H * P * N;
const int e = int(blockIdx.x) * NT + int(threadIdx.x);
const int b = int(blockIdx.y);
if (e < HPN) {
  const int h = e / (P * N);
  float s = state_in[int64_t(b) * HPN + e];
  #pragma unroll 4  // the next chunks' loads issued ahead of the chain
  for (int c = 0; c < NC; ++c) {
    const int64_t at = (int64_t(b) * NC + c) * HPN + e;
    const float d = dS[at];  // independent of s: its load overlaps the chain
    S0[at] = s;
    s = expf(Lc[((int64_t(b) * NC + c) * H + h) * C + C - 1]) * s + d;
  }
  state_out[int64_t(b) * HPN + e] = s;
}
