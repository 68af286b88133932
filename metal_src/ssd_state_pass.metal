// SSD brick, step 2 of 3: the state passed from chunk to chunk, the one sequential part. One
// thread per VEC consecutive state elements e = (h, p, n) of a batch row, float32:
//   S0[b, c, e] = S                              (the state at chunk c's start)
//   S = exp(L_C of chunk c) S + dS[b, c, e]
// from S = state_in[b, e]; state_out[b, e] = S after the last chunk. CUDA twin:
// cuda_src/ssd_state_pass.cu.
// Template: H, P, N, C (tokens per chunk), NT (threads per threadgroup), VEC (1 or 4; divides
// N: the twin's 16-byte loads).
// Inputs: dS (B, n_chunks, H, P, N) float; Lc (B, n_chunks, H, C) float (step 1);
//   state_in (B, H, P, N) float; iparams int32 [T, n_chunks].
// Outputs: S0 (B, n_chunks, H, P, N) float; state_out (B, H, P, N) float; all written.
// Grid: (H * P * N / VEC rounded up to NT, B) threads, threadgroups of (NT, 1, 1).

static_assert((VEC == 1 || VEC == 4) && N % VEC == 0, "VEC elements of one state row");
const int NC = iparams[1];
constexpr int HPN = H * P * N;
const int e =
    (int(threadgroup_position_in_grid.x) * NT + int(thread_position_in_threadgroup.x)) * VEC;
const int b = int(threadgroup_position_in_grid.y);
if (e < HPN) {
  const int h = e / (P * N);  // the same for the VEC elements (N % VEC == 0)
  float s[VEC];
  for (int i = 0; i < VEC; ++i) {
    s[i] = state_in[int64_t(b) * HPN + e + i];
  }
  #pragma clang loop unroll_count(4)  // the next chunks' loads issued ahead of the chain
  for (int c = 0; c < NC; ++c) {
    const int64_t at = (int64_t(b) * NC + c) * HPN + e;
    float d[VEC];  // independent of s: its load overlaps the chain
    for (int i = 0; i < VEC; ++i) {
      d[i] = dS[at + i];
      S0[at + i] = s[i];
    }
    const float decay = exp(Lc[((int64_t(b) * NC + c) * H + h) * C + C - 1]);
    for (int i = 0; i < VEC; ++i) {
      s[i] = decay * s[i] + d[i];
    }
  }
  for (int i = 0; i < VEC; ++i) {
    state_out[int64_t(b) * HPN + e + i] = s[i];
  }
}
