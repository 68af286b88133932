// SSD brick, step 3 of 3: every chunk's outputs, all chunks at once. One threadgroup per
// (chunk c, head h, batch row b); with L_t the chunk's log decays (step 1) and S0 the state at
// the chunk's start (step 2):
//   M_ti = (C_t . B_i) exp(L_t - L_i) dt_i   for i <= t, 0 above     (C x C)
//   y_tp = sum_{i <= t} M_ti x_ip + exp(L_t) (C_t . S0[p, :]) + D x_tp
// bricks/ssd/op.py has the derivation (Dao & Gu 2024, section 6). Phase A walks N in slices
// of KT: C.B (lower triangle tiles only) and C.S0 from transposed slices in threadgroup memory
// (on 8x8 float simdgroup matrices where C, P and KT are multiples of 8: SG below; else 4x4
// register tiles of scalar FMAs); phase B stores M^T, overwrites the slices with the chunk's
// x, and adds M x (each row block stops at the diagonal). CUDA twin: cuda_src/ssd_chunk_out.cu
// (tensor cores for bfloat16 inputs).
//
// The scalar tiles: metal_src/tile4.h (ld4, fma_outer4, tri_row).
//
// Template: InT (x, B, C dtype), OutT (y dtype), P, N (multiples of 4), H, G, C (tokens per
// chunk, a multiple of 4), KT (a multiple of 4), NT (threads per threadgroup), SF (threadgroup
// floats: bricks/ssd/msl.py: out_floats).
// Inputs: x (B, T, H, P) InT; dt (B, T, H) float (0 at masked tokens); Bm, Cm (B, T, G, N)
//   InT; D (H) float; Lc (B, n_chunks, H, C) float (step 1); S0 (B, n_chunks, H, P, N) float
//   (step 2); iparams int32 [T, n_chunks].
// Outputs: y (B, T, H, P) OutT; every element written.
// Grid: (NT * n_chunks, H, B) threads, threadgroups of (NT, 1, 1). Threadgroup memory, in this
// order: Lt, Dt (C floats each), Mt (C x (C + 4)), then one region holding At, Bt
// (KT x (C + 4) each) and St (KT x (P + 4)) in phase A, Xs (C x P) in phase B.

const int T = iparams[0];
const int NC = iparams[1];
const int tid = int(thread_position_in_threadgroup.x);
const int c = int(threadgroup_position_in_grid.x);
const int h = int(threadgroup_position_in_grid.y);
const int b = int(threadgroup_position_in_grid.z);
const int g = h / (H / G);
const int t0 = c * C;
static_assert(C % 4 == 0 && P % 4 == 0 && N % 4 == 0 && KT % 4 == 0, "4x4 tiles");
constexpr int CS = C + 4;   // row stride of the (k, t) slices and of M^T
constexpr int PS = P + 4;
constexpr int TC = C / 4;   // tiles per row of the (C x C) product
constexpr int TP = P / 4;   // tiles per row of the (C x P) output
constexpr int TRI = TC * (TC + 1) / 2;  // the lower triangle's tiles of C.B
constexpr int MT1 = (TRI + NT - 1) / NT;
constexpr int MT2 = (TC * TP + NT - 1) / NT;
static_assert(SF >= 2 * C + C * CS + KT * (2 * CS + PS) && SF >= 2 * C + C * CS + C * P,
              "threadgroup floats");

threadgroup float sm[SF];
threadgroup float* Lt = sm;
threadgroup float* Dt = Lt + C;
threadgroup float* Mt = Dt + C;        // (i, t): M^T
threadgroup float* At = Mt + C * CS;   // (k, t): C^T slice
threadgroup float* Bt = At + KT * CS;  // (k, i): B^T slice
threadgroup float* St = Bt + KT * CS;  // (k, p): S0^T slice
threadgroup float* Xs = At;            // phase B: (i, p), over the slices

const int64_t lc0 = ((int64_t(b) * NC + c) * H + h) * C;
for (int t = tid; t < C; t += NT) {
  Lt[t] = Lc[lc0 + t];
  Dt[t] = t0 + t < T ? dt[(int64_t(b) * T + t0 + t) * H + h] : 0.0f;
}

// C, P and the slice multiples of 8 (SG): the products on 8x8 float simdgroup matrices, each
// SIMD-group its C.B tiles on or below the diagonal and its (C x P) output tiles; C.B goes to
// threadgroup memory transposed (M^T), is decayed there (D on M's diagonal: y = (M + D) x), the
// state's part round-trips through the slices' region to be decayed, and the outputs leave
// through it. Else 4x4 register tiles of scalar FMAs.
static_assert(NT % 32 == 0, "whole SIMD-groups");
constexpr bool SG = C % 8 == 0 && P % 8 == 0 && KT % 8 == 0;
const int64_t s0 = ((int64_t(b) * NC + c) * H + h) * P * N;
const float d_h = D[h];
if (SG) {
  constexpr int NS = NT / 32;  // SIMD-groups
  constexpr int TB = C / 8 > 0 ? C / 8 : 1;  // 8-token blocks
  constexpr int UP = P / 8 > 0 ? P / 8 : 1;
  constexpr int TRI8 = TB * (TB + 1) / 2;
  constexpr int MS1 = (TRI8 + NS - 1) / NS;
  constexpr int MS2 = (TB * UP + NS - 1) / NS;
  const int sg = int(simdgroup_index_in_threadgroup);
  threadgroup float* R = At;  // the slices' region: C x P floats (the state's part, x, y)
  simdgroup_matrix<float, 8, 8> cb8[MS1];
  simdgroup_matrix<float, 8, 8> acc8[MS2];
  #pragma clang loop unroll(full)
  for (int m = 0; m < MS1; ++m) {
    cb8[m] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  #pragma clang loop unroll(full)
  for (int m = 0; m < MS2; ++m) {
    acc8[m] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (int n0 = 0; n0 < N; n0 += KT) {  // phase A: C.B and C.S0 over slices of N
    for (int e = tid; e < C * KT; e += NT) {
      const int t = e / KT;
      const int k = e % KT;
      const bool inside = t0 + t < T && n0 + k < N;
      const int64_t src = ((int64_t(b) * T + t0 + t) * G + g) * N + n0 + k;
      At[k * CS + t] = inside ? float(Cm[src]) : 0.0f;
      Bt[k * CS + t] = inside ? float(Bm[src]) : 0.0f;
    }
    for (int e = tid; e < P * KT; e += NT) {
      const int p = e / KT;
      const int k = e % KT;
      St[k * PS + p] = n0 + k < N ? S0[s0 + p * N + n0 + k] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    #pragma clang loop unroll(full)
    for (int m = 0; m < MS1; ++m) {
      const int unit = sg + m * NS;  // uniform in the SIMD-group
      if (unit < TRI8) {
        const int tr = bricks::tri_row(unit);
        const int t8 = tr * 8;
        const int i8 = (unit - tr * (tr + 1) / 2) * 8;
        for (int k = 0; k < KT; k += 8) {
          simdgroup_matrix<float, 8, 8> ca;
          simdgroup_matrix<float, 8, 8> bb;
          simdgroup_load(ca, At + k * CS + t8, CS, ulong2(0, 0), true);  // (t, k)
          simdgroup_load(bb, Bt + k * CS + i8, CS);                      // (k, i)
          simdgroup_multiply_accumulate(cb8[m], ca, bb, cb8[m]);
        }
      }
    }
    #pragma clang loop unroll(full)
    for (int m = 0; m < MS2; ++m) {
      const int unit = sg + m * NS;
      if (unit < TB * UP) {
        const int t8 = (unit / UP) * 8;
        const int p8 = (unit % UP) * 8;
        for (int k = 0; k < KT; k += 8) {
          simdgroup_matrix<float, 8, 8> ca;
          simdgroup_matrix<float, 8, 8> sb;
          simdgroup_load(ca, At + k * CS + t8, CS, ulong2(0, 0), true);
          simdgroup_load(sb, St + k * PS + p8, PS);  // (k, p)
          simdgroup_multiply_accumulate(acc8[m], ca, sb, acc8[m]);
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  // phase B: C.B transposed into M^T, the state's part into R; decays, time steps, D, the
  // causal mask (M^T's tiles above the diagonal were not stored: written as zeros)
  #pragma clang loop unroll(full)
  for (int m = 0; m < MS1; ++m) {
    const int unit = sg + m * NS;
    if (unit < TRI8) {
      const int tr = bricks::tri_row(unit);
      const int i8 = (unit - tr * (tr + 1) / 2) * 8;
      simdgroup_store(cb8[m], Mt + i8 * CS + tr * 8, CS, ulong2(0, 0), true);
    }
  }
  #pragma clang loop unroll(full)
  for (int m = 0; m < MS2; ++m) {
    const int unit = sg + m * NS;
    if (unit < TB * UP) {
      simdgroup_store(acc8[m], R + (unit / UP) * 8 * P + (unit % UP) * 8, P);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = tid; e < C * C; e += NT) {
    const int i = e / C;
    const int t = e % C;
    Mt[i * CS + t] = i <= t ? Mt[i * CS + t] * exp(Lt[t] - Lt[i]) * Dt[i] + (i == t ? d_h : 0.0f)
                            : 0.0f;
  }
  for (int e = tid; e < C * P; e += NT) {
    R[e] *= exp(Lt[e / P]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  #pragma clang loop unroll(full)
  for (int m = 0; m < MS2; ++m) {
    const int unit = sg + m * NS;
    if (unit < TB * UP) {
      simdgroup_load(acc8[m], R + (unit / UP) * 8 * P + (unit % UP) * 8, P);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = tid; e < C * P; e += NT) {  // the chunk's x over the state's part
    const int t = t0 + e / P;
    R[e] = t < T ? float(x[((int64_t(b) * T + t) * H + h) * P + e % P]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  #pragma clang loop unroll(full)
  for (int m = 0; m < MS2; ++m) {
    const int unit = sg + m * NS;
    if (unit < TB * UP) {
      const int t8 = (unit / UP) * 8;
      const int p8 = (unit % UP) * 8;
      for (int i8 = 0; i8 <= t8; i8 += 8) {  // M_ti = 0 for i > t
        simdgroup_matrix<float, 8, 8> ma;
        simdgroup_matrix<float, 8, 8> xb;
        simdgroup_load(ma, Mt + i8 * CS + t8, CS, ulong2(0, 0), true);  // (t, i)
        simdgroup_load(xb, R + i8 * P + p8, P);                          // (i, p)
        simdgroup_multiply_accumulate(acc8[m], ma, xb, acc8[m]);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  #pragma clang loop unroll(full)
  for (int m = 0; m < MS2; ++m) {
    const int unit = sg + m * NS;
    if (unit < TB * UP) {
      simdgroup_store(acc8[m], R + (unit / UP) * 8 * P + (unit % UP) * 8, P);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int e = tid; e < C * P; e += NT) {
    const int t = e / P;
    if (t0 + t < T) {
      y[((int64_t(b) * T + t0 + t) * H + h) * P + e % P] = OutT(R[e]);
    }
  }
} else {
  float cb[MT1][4][4] = {};
  float acc[MT2][4][4] = {};

  // phase A: C.B and C.S0 over slices of N
  for (int n0 = 0; n0 < N; n0 += KT) {
    for (int e = tid; e < C * KT; e += NT) {
      const int t = e / KT;
      const int k = e % KT;
      const bool inside = t0 + t < T && n0 + k < N;
      const int64_t src = ((int64_t(b) * T + t0 + t) * G + g) * N + n0 + k;
      At[k * CS + t] = inside ? float(Cm[src]) : 0.0f;
      Bt[k * CS + t] = inside ? float(Bm[src]) : 0.0f;
    }
    for (int e = tid; e < P * KT; e += NT) {
      const int p = e / KT;
      const int k = e % KT;
      St[k * PS + p] = n0 + k < N ? S0[s0 + p * N + n0 + k] : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    #pragma clang loop unroll(full)
    for (int m = 0; m < MT1; ++m) {
      const int tile = tid + m * NT;  // only the lower triangle's tiles: M is 0 above it
      if (tile < TRI) {
        const int tr = bricks::tri_row(tile);
        const int t4 = tr * 4;
        const int i4 = (tile - tr * (tr + 1) / 2) * 4;
        for (int k = 0; k < KT; ++k) {
          bricks::fma_outer4(cb[m], bricks::ld4(At + k * CS + t4), bricks::ld4(Bt + k * CS + i4));
        }
      }
    }
    #pragma clang loop unroll(full)
    for (int m = 0; m < MT2; ++m) {
      const int tile = tid + m * NT;
      if (tile < TC * TP) {
        const int t4 = (tile / TP) * 4;
        const int p4 = (tile % TP) * 4;
        for (int k = 0; k < KT; ++k) {
          bricks::fma_outer4(acc[m], bricks::ld4(At + k * CS + t4), bricks::ld4(St + k * PS + p4));
        }
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }

  // phase B: M^T (decays, time steps, the causal triangle), the state's part decayed from the
  // chunk's start, the chunk's x over the slices
  for (int e = tid; e < C * C; e += NT) {  // the tiles above the diagonal: zeros
    const int i = e / C;
    const int t = e % C;
    if (i / 4 > t / 4) {
      Mt[i * CS + t] = 0.0f;
    }
  }
  #pragma clang loop unroll(full)
  for (int m = 0; m < MT1; ++m) {
    const int tile = tid + m * NT;
    if (tile < TRI) {
      const int tr = bricks::tri_row(tile);
      const int t4 = tr * 4;
      const int i4 = (tile - tr * (tr + 1) / 2) * 4;
      #pragma clang loop unroll(full)
      for (int u = 0; u < 4; ++u) {
        #pragma clang loop unroll(full)
        for (int v = 0; v < 4; ++v) {
          const int t = t4 + u;
          const int i = i4 + v;
          Mt[i * CS + t] = i <= t ? cb[m][u][v] * exp(Lt[t] - Lt[i]) * Dt[i] : 0.0f;
        }
      }
    }
  }
  #pragma clang loop unroll(full)
  for (int m = 0; m < MT2; ++m) {
    const int tile = tid + m * NT;
    if (tile < TC * TP) {
      const int t4 = (tile / TP) * 4;
      #pragma clang loop unroll(full)
      for (int u = 0; u < 4; ++u) {
        const float gl = exp(Lt[t4 + u]);
        #pragma clang loop unroll(full)
        for (int v = 0; v < 4; ++v) {
          acc[m][u][v] *= gl;
        }
      }
    }
  }
  for (int e = tid; e < C * P; e += NT) {
    const int t = t0 + e / P;
    Xs[e] = t < T ? float(x[((int64_t(b) * T + t) * H + h) * P + e % P]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  #pragma clang loop unroll(full)
  for (int m = 0; m < MT2; ++m) {
    const int tile = tid + m * NT;
    if (tile < TC * TP) {
      const int t4 = (tile / TP) * 4;
      const int p4 = (tile % TP) * 4;
      for (int i = 0; i < t4 + 4; ++i) {  // M_ti = 0 for i > t
        bricks::fma_outer4(acc[m], bricks::ld4(Mt + i * CS + t4), bricks::ld4(Xs + i * P + p4));
      }
      #pragma clang loop unroll(full)
      for (int u = 0; u < 4; ++u) {
        const int t = t4 + u;
        if (t0 + t < T) {
          const int64_t dst = ((int64_t(b) * T + t0 + t) * H + h) * P + p4;
          #pragma clang loop unroll(full)
          for (int v = 0; v < 4; ++v) {
            y[dst + v] = OutT(acc[m][u][v] + d_h * Xs[t * P + p4 + v]);
          }
        }
      }
    }
  }
}
