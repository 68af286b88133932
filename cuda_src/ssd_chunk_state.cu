// SSD brick, step 1 of 3 (CUDA twin of metal_src/ssd_chunk_state.metal, same inputs, outputs,
// template arguments and geometry): every chunk's own contribution to the state, all chunks
// at once. One block per (chunk c, head h, batch row b). With a_t = dt_t A and the chunk's
// inclusive log decays L_t = sum_{s <= t} a_s (float32, tokens past T count as dt = 0):
//   Lc[b, c, h, t] = L_t
//   dS[b, c, h, p, n] = sum_t x_tp dt_t exp(L_C - L_t) B_tn      (the state from zero)
// bricks/ssd/op.py has the derivation (Dao & Gu 2024, section 6, "chunk states").
// The (P x N) product runs over KT-token slices of the chunk held in shared memory (the inputs
// scaled once): for bfloat16 inputs (MMA below) on tensor cores, x dt exp(L_C - L_t) split in
// two bf16s times B (cuda_src/ssd_mma.cuh), one 16 x 16 output unit per warp at a time; else as
// 4x4 register tiles of scalar float FMAs (cuda_src/tile4.cuh), as the MSL kernel.
//
// Template: InT (x, B dtype), P, N (head dim, state size; multiples of 4), H, G (head h reads
// group h / (H / G)), C (tokens per chunk, a multiple of KT), KT, NT (threads per block).
// Inputs: x (B, T, H, P) InT; dt (B, T, H) float (softplus, bias and clip done, 0 at masked
//   tokens); A (H) float (-exp(A_log)); Bm (B, T, G, N) InT; iparams int32 [T, n_chunks].
// Outputs: dS (B, n_chunks, H, P, N) float; Lc (B, n_chunks, H, C) float; all written.
// Grid: (NT * n_chunks, H, B) threads, blocks of (NT, 1, 1). Shared memory (dynamic, in this
// order): Lt, Wt (C floats each), then Xs (KT x P), Bs (KT x N) floats (msl.state_floats: SF);
// MMA: Xh, Xl (KT x (P + 8)) and Bs (KT x (N + 8)) bf16s in the same bytes.

const int T = iparams[0];
const int NC = iparams[1];
const int tid = int(threadIdx.x);
const int c = int(blockIdx.x);
const int h = int(blockIdx.y);
const int b = int(blockIdx.z);
const int g = h / (H / G);
const int t0 = c * C;
static_assert(C % KT == 0 && P % 4 == 0 && N % 4 == 0 && NT % 32 == 0,
              "whole slices, 4x4 tiles and warps");

constexpr int TN = N / 4;                 // tiles per row of the (P x N) product
constexpr int TILES = (P / 4) * TN;
constexpr int MT = (TILES + NT - 1) / NT;  // tiles per thread

extern __shared__ __align__(16) unsigned char smem[];
float* Lt = reinterpret_cast<float*>(smem);
float* Wt = Lt + C;

const float a_h = A[h];
for (int t = tid; t < C; t += NT) {  // the time steps loaded in parallel, summed by warp 0
  Lt[t] = t0 + t < T ? dt[(int64_t(b) * T + t0 + t) * H + h] * a_h : 0.0f;
}
__syncthreads();
if (tid < 32) {  // inclusive sums in pieces of 32: a shuffle scan each, the carry broadcast
  float carry = 0.0f;
  for (int t0s = 0; t0s < C; t0s += 32) {
    float v = t0s + tid < C ? Lt[t0s + tid] : 0.0f;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const float u = __shfl_up_sync(0xffffffffu, v, unsigned(d));
      v += tid >= d ? u : 0.0f;
    }
    v += carry;
    if (t0s + tid < C) Lt[t0s + tid] = v;
    carry = __shfl_sync(0xffffffffu, v, 31);
  }
}
__syncthreads();
const float l_end = Lt[C - 1];
for (int t = tid; t < C; t += NT) {
  Lc[((int64_t(b) * NC + c) * H + h) * C + t] = Lt[t];
  Wt[t] = t0 + t < T ? dt[(int64_t(b) * T + t0 + t) * H + h] * expf(l_end - Lt[t]) : 0.0f;
}
__syncthreads();

// bf16 inputs in whole 16 x 16 units whose arrays fit SF (msl.mma_floats sizes it): tensor cores
constexpr bool MMA = bricks::Same<InT, __nv_bfloat16>::value && P % 16 == 0 &&
                     N % 16 == 0 && KT % 16 == 0 &&
                     8 * C + 2 * KT * (2 * (P + 8) + N + 8) <= 4 * SF;
static_assert(MMA || SF >= 2 * C + KT * (P + N), "shared floats");
if constexpr (MMA) {
  constexpr int PP = P + 8;
  constexpr int NP = N + 8;
  constexpr int NW = NT / 32;
  // (at least 1: the branch is compiled, not run, for shapes without whole units)
  constexpr int UN = N / 16 > 0 ? N / 16 : 1;  // 16 x 16 output units per row of units
  constexpr int UNITS = (P / 16) * UN;
  constexpr int MU = UNITS > 0 ? (UNITS + NW - 1) / NW : 1;  // units per warp, consecutive
  __nv_bfloat16* Xh = reinterpret_cast<__nv_bfloat16*>(Wt + C);  // (k, p), hi and lo
  __nv_bfloat16* Xl = Xh + KT * PP;
  __nv_bfloat16* Bs = Xl + KT * PP;  // (k, n)
  const int warp = tid / 32;
  // rows of 8 bf16s in one 16-byte load each (P, N multiples of 16; any alignment served)
  const bool vx = bricks::aligned16(x);
  const bool vb = bricks::aligned16(Bm);
  float acc[MU][2][4] = {};
  for (int k0 = 0; k0 < C; k0 += KT) {
    bricks::fill<KT * P / 8, NT>(tid, [&](int e) {
      const int k = e / bricks::V8<P>;
      const int p = (e % bricks::V8<P>) * 8;
      const int t = t0 + k0 + k;
      const uint4 v = bricks::ld8(x, ((int64_t(b) * T + t) * H + h) * P + p, t < T, vx);
      bricks::split8(v, Wt[k0 + k], Xh + k * PP + p, Xl + k * PP + p);  // Wt is 0 past T
    });
    bricks::fill<KT * N / 8, NT>(tid, [&](int e) {
      const int k = e / bricks::V8<N>;
      const int n = (e % bricks::V8<N>) * 8;
      const int t = t0 + k0 + k;
      bricks::st8(Bs + k * NP + n,
                  bricks::ld8(Bm, ((int64_t(b) * T + t) * G + g) * N + n, t < T, vb));
    });
    __syncthreads();
#pragma unroll
    for (int u = 0; u < MU; ++u) {
      const int unit = warp * MU + u;  // warp-uniform
      if (unit < UNITS) {
        const int p0 = (unit / UN) * 16;
        const int n0 = (unit % UN) * 16;
#pragma unroll
        for (int kk = 0; kk < KT; kk += 16) {
          uint32_t ah[4], al[4], bb[4];
          bricks::frag_a_t(ah, Xh, PP, p0, kk);
          bricks::frag_a_t(al, Xl, PP, p0, kk);
          bricks::frag_b2_t(bb, Bs, NP, kk, n0);
          bricks::mma2(acc[u], ah, bb);
          bricks::mma2(acc[u], al, bb);
        }
      }
    }
    __syncthreads();
  }
  const int lg = (tid % 32) / 4;
  const int lt = tid % 4;
#pragma unroll
  for (int u = 0; u < MU; ++u) {
    const int unit = warp * MU + u;
    if (unit < UNITS) {
      const int p0 = (unit / UN) * 16;
      const int n0 = (unit % UN) * 16;
      float* dst = dS + (((int64_t(b) * NC + c) * H + h) * P + p0 + lg) * N + n0 + 2 * lt;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        *reinterpret_cast<float2*>(dst + 8 * j) = make_float2(acc[u][j][0], acc[u][j][1]);
        *reinterpret_cast<float2*>(dst + 8 * N + 8 * j) = make_float2(acc[u][j][2], acc[u][j][3]);
      }
    }
  }
} else {
  float* Xs = Wt + C;       // (k, p): x_tp dt_t exp(L_C - L_t)
  float* Bs = Xs + KT * P;  // (k, n)
  float acc[MT][4][4] = {};
  for (int k0 = 0; k0 < C; k0 += KT) {
    for (int e = tid; e < KT * P; e += NT) {
      const int k = e / P;
      const int t = t0 + k0 + k;
      Xs[e] = t < T ? Wt[k0 + k] * bricks::to_float(x[((int64_t(b) * T + t) * H + h) * P + e % P])
                    : 0.0f;
    }
    for (int e = tid; e < KT * N; e += NT) {
      const int t = t0 + k0 + e / N;
      Bs[e] = t < T ? bricks::to_float(Bm[((int64_t(b) * T + t) * G + g) * N + e % N]) : 0.0f;
    }
    __syncthreads();
  #pragma unroll
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
    __syncthreads();
  }

  #pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int tile = tid + m * NT;
    if (tile < TILES) {
      const int p4 = (tile / TN) * 4;
      const int n4 = (tile % TN) * 4;
      float* dst = dS + (((int64_t(b) * NC + c) * H + h) * P + p4) * N + n4;
  #pragma unroll
      for (int u = 0; u < 4; ++u) {
        *reinterpret_cast<float4*>(dst + u * N) =
            make_float4(acc[m][u][0], acc[m][u][1], acc[m][u][2], acc[m][u][3]);
      }
    }
  }
}
