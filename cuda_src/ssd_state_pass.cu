// SSD brick, step 2 of 3 (CUDA twin of metal_src/ssd_state_pass.metal, same inputs, outputs,
// template arguments and geometry): the state passed from chunk to chunk, the one sequential
// part. One thread per VEC consecutive state elements e = (h, p, n) of a batch row, float32:
//   S0[b, c, e] = S                              (the state at chunk c's start)
//   S = exp(L_C of chunk c) S + dS[b, c, e]
// from S = state_in[b, e]; state_out[b, e] = S after the last chunk. VEC = 4: one 16-byte
// load of dS and store of S0 per chunk (element-wise where dS or S0 is not 16-byte aligned).
// Template: H, P, N, C (tokens per chunk), NT (threads per block), VEC (1 or 4; divides N).
// Inputs: dS (B, n_chunks, H, P, N) float; Lc (B, n_chunks, H, C) float (step 1);
//   state_in (B, H, P, N) float; iparams int32 [T, n_chunks].
// Outputs: S0 (B, n_chunks, H, P, N) float; state_out (B, H, P, N) float; all written.
// Grid: (H * P * N / VEC rounded up to NT, B) threads, blocks of (NT, 1, 1).

static_assert((VEC == 1 || VEC == 4) && N % VEC == 0, "VEC elements of one state row");
const int NC = iparams[1];
constexpr int HPN = H * P * N;
const int e = (int(blockIdx.x) * NT + int(threadIdx.x)) * VEC;
const int b = int(blockIdx.y);
if (e < HPN) {
  const int h = e / (P * N);  // the same for the VEC elements (N % VEC == 0)
  // (dS and S0 are this op's own arrays: aligned as MLX allocates, checked all the same)
  const bool vec = VEC == 4 &&
      ((reinterpret_cast<unsigned long long>(dS) | reinterpret_cast<unsigned long long>(S0)) &
       15ull) == 0;
  float s[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) s[i] = state_in[int64_t(b) * HPN + e + i];
  #pragma unroll 4  // the next chunks' loads issued ahead of the chain
  for (int c = 0; c < NC; ++c) {
    const int64_t at = (int64_t(b) * NC + c) * HPN + e;
    float d[VEC];  // independent of s: its load overlaps the chain
    if constexpr (VEC == 4) {
      if (vec) {
        const float4 v = *reinterpret_cast<const float4*>(dS + at);
        d[0] = v.x, d[1] = v.y, d[2] = v.z, d[3] = v.w;
        *reinterpret_cast<float4*>(S0 + at) = make_float4(s[0], s[1], s[2], s[3]);
      }
    }
    if (!vec) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        d[i] = dS[at + i];
        S0[at + i] = s[i];
      }
    }
    const float decay = expf(Lc[((int64_t(b) * NC + c) * H + h) * C + C - 1]);
#pragma unroll
    for (int i = 0; i < VEC; ++i) s[i] = decay * s[i] + d[i];
  }
#pragma unroll
  for (int i = 0; i < VEC; ++i) state_out[int64_t(b) * HPN + e + i] = s[i];
}
