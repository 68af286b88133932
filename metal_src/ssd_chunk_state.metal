// SSD brick, step 1 of 3: every chunk's own contribution to the state, all chunks at once.
// One threadgroup per (chunk c, head h, batch row b). With a_t = dt_t A and the chunk's
// inclusive log decays L_t = sum_{s <= t} a_s (float32, tokens past T count as dt = 0):
//   Lc[b, c, h, t] = L_t
//   dS[b, c, h, p, n] = sum_t x_tp dt_t exp(L_C - L_t) B_tn      (the state from zero)
// bricks/ssd/op.py has the derivation (Dao & Gu 2024, section 6, "chunk states"). The (P x N)
// product runs over KT-token slices of the chunk held in threadgroup memory (the inputs scaled
// once, as floats): on 8x8 float simdgroup matrices where P and N are multiples of 8, else as
// 4x4 register tiles of scalar FMAs. CUDA twin: cuda_src/ssd_chunk_state.cu (tensor cores for
// bfloat16 inputs).
//
// The scalar tiles: metal_src/tile4.h (ld4, fma_outer4, tri_row).
//
// Template: InT (x, B dtype), P, N (head dim, state size; multiples of 4), H, G (head h reads
// group h / (H / G)), C (tokens per chunk, a multiple of KT), KT, NT (threads per
// threadgroup), SF (threadgroup floats: 2 C + KT (P + N), bricks/ssd/msl.py: state_floats).
// Inputs: x (B, T, H, P) InT; dt (B, T, H) float (softplus, bias and clip done, 0 at masked
//   tokens); A (H) float (-exp(A_log)); Bm (B, T, G, N) InT; iparams int32 [T, n_chunks].
// Outputs: dS (B, n_chunks, H, P, N) float; Lc (B, n_chunks, H, C) float; all written.
// Grid: (NT * n_chunks, H, B) threads, threadgroups of (NT, 1, 1).

const int T = iparams[0];
const int NC = iparams[1];
const int tid = int(thread_position_in_threadgroup.x);
const int c = int(threadgroup_position_in_grid.x);
const int h = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int g = h / (H / G);
const int t0 = c * C;
static_assert(C % KT == 0 && P % 4 == 0 && N % 4 == 0, "whole slices and 4x4 tiles");
static_assert(SF >= 2 * C + KT * (P + N), "threadgroup floats");
constexpr int TN = N / 4;                 // tiles per row of the (P x N) product
constexpr int TILES = (P / 4) * TN;
constexpr int MT = (TILES + NT - 1) / NT;  // tiles per thread

threadgroup float sm[SF];
threadgroup float* Lt = sm;
threadgroup float* Wt = Lt + C;
threadgroup float* Xs = Wt + C;       // (k, p): x_tp dt_t exp(L_C - L_t)
threadgroup float* Bs = Xs + KT * P;  // (k, n)

const float a_h = A[h];
for (int t = tid; t < C; t += NT) {  // the time steps loaded in parallel, summed by SIMD-group 0
  Lt[t] = t0 + t < T ? dt[(int64_t(b) * T + t0 + t) * H + h] * a_h : 0.0f;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (simdgroup_index_in_threadgroup == 0) {  // inclusive sums in pieces of 32, the carry broadcast
  const int lane = int(thread_index_in_simdgroup);
  float carry = 0.0f;
  for (int t0s = 0; t0s < C; t0s += 32) {
    const float v = simd_prefix_inclusive_sum(t0s + lane < C ? Lt[t0s + lane] : 0.0f) + carry;
    if (t0s + lane < C) {
      Lt[t0s + lane] = v;
    }
    carry = simd_broadcast(v, 31);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float l_end = Lt[C - 1];
for (int t = tid; t < C; t += NT) {
  Lc[((int64_t(b) * NC + c) * H + h) * C + t] = Lt[t];
  Wt[t] = t0 + t < T ? dt[(int64_t(b) * T + t0 + t) * H + h] * exp(l_end - Lt[t]) : 0.0f;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// P, N and the slice multiples of 8: the product on 8x8 float simdgroup matrices, each
// SIMD-group a run of the (P / 8) x (N / 8) output tiles (SG); else 4x4 register tiles
static_assert(NT % 32 == 0, "whole SIMD-groups");
constexpr bool SG = P % 8 == 0 && N % 8 == 0 && KT % 8 == 0;
constexpr int NS = NT / 32;  // SIMD-groups
constexpr int TN8 = N / 8 > 0 ? N / 8 : 1;
constexpr int TILES8 = (P / 8) * TN8;
constexpr int MS = TILES8 > 0 ? (TILES8 + NS - 1) / NS : 1;  // tiles per SIMD-group
const int sg = int(simdgroup_index_in_threadgroup);
simdgroup_matrix<float, 8, 8> acc8[MS];
#pragma clang loop unroll(full)
for (int m = 0; m < MS; ++m) {
  acc8[m] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
}
float acc[MT][4][4] = {};
for (int k0 = 0; k0 < C; k0 += KT) {
  for (int e = tid; e < KT * P; e += NT) {
    const int k = e / P;
    const int t = t0 + k0 + k;
    Xs[e] = t < T ? Wt[k0 + k] * float(x[((int64_t(b) * T + t) * H + h) * P + e % P]) : 0.0f;
  }
  for (int e = tid; e < KT * N; e += NT) {
    const int t = t0 + k0 + e / N;
    Bs[e] = t < T ? float(Bm[((int64_t(b) * T + t) * G + g) * N + e % N]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (SG) {
    #pragma clang loop unroll(full)
    for (int m = 0; m < MS; ++m) {
      const int tile = sg * MS + m;  // uniform in the SIMD-group
      if (tile < TILES8) {
        const int p8 = (tile / TN8) * 8;
        const int n8 = (tile % TN8) * 8;
        for (int k = 0; k < KT; k += 8) {
          simdgroup_matrix<float, 8, 8> xa;
          simdgroup_matrix<float, 8, 8> bb;
          simdgroup_load(xa, Xs + k * P + p8, P, ulong2(0, 0), true);  // (p, k): Xs^T
          simdgroup_load(bb, Bs + k * N + n8, N);
          simdgroup_multiply_accumulate(acc8[m], xa, bb, acc8[m]);
        }
      }
    }
  } else {
    #pragma clang loop unroll(full)
    for (int m = 0; m < MT; ++m) {
      const int tile = tid + m * NT;
      if (tile < TILES) {
        const int p4 = (tile / TN) * 4;
        const int n4 = (tile % TN) * 4;
        for (int k = 0; k < KT; ++k) {
          bricks::fma_outer4(acc[m], bricks::ld4(Xs + k * P + p4), bricks::ld4(Bs + k * N + n4));
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

const int64_t ds0 = ((int64_t(b) * NC + c) * H + h) * P * N;
if (SG) {
  #pragma clang loop unroll(full)
  for (int m = 0; m < MS; ++m) {
    const int tile = sg * MS + m;
    if (tile < TILES8) {
      const int p8 = (tile / TN8) * 8;
      const int n8 = (tile % TN8) * 8;
      simdgroup_store(acc8[m], dS + ds0 + p8 * N + n8, N);
    }
  }
} else {
  #pragma clang loop unroll(full)
  for (int m = 0; m < MT; ++m) {
    const int tile = tid + m * NT;
    if (tile < TILES) {
      const int p4 = (tile / TN) * 4;
      const int n4 = (tile % TN) * 4;
      const int64_t dst = ds0 + p4 * N + n4;
      #pragma clang loop unroll(full)
      for (int u = 0; u < 4; ++u) {
        #pragma clang loop unroll(full)
        for (int v = 0; v < 4; ++v) {
          dS[dst + u * N + v] = acc[m][u][v];
        }
      }
    }
  }
}
