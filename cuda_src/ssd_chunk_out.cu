// SSD brick, step 3 of 3 (CUDA twin of metal_src/ssd_chunk_out.metal, same inputs, outputs,
// template arguments and geometry): every chunk's outputs, all chunks at once. One block per
// (chunk c, head h, batch row b); with L_t the chunk's log decays (step 1) and S0 the state at
// the chunk's start (step 2):
//   M_ti = (C_t . B_i) exp(L_t - L_i) dt_i   for i <= t, 0 above     (C x C)
//   y_tp = sum_{i <= t} M_ti x_ip + exp(L_t) (C_t . S0[p, :]) + D x_tp
// bricks/ssd/op.py has the derivation (Dao & Gu 2024, section 6). Phase A walks N in slices
// of KT: C.B (lower triangle tiles only) and C.S0; phase B stores M, overwrites the slices
// with the chunk's x, and adds M x (each row block stops at the diagonal). For bfloat16 inputs
// (MMA below) the products run on tensor cores (cuda_src/ssd_mma.cuh: C, B and x exact, S0 and
// M split in two bf16s), one 16 x 16 unit per warp at a time, M and the slices stored (row,
// k); else as 4x4 register tiles of scalar float FMAs (cuda_src/tile4.cuh) from transposed
// slices, M^T stored, as the MSL kernel.
//
// Template: InT (x, B, C dtype), OutT (y dtype), P, N (multiples of 4), H, G, C (tokens per
// chunk, a multiple of 4), KT (a multiple of 4), NT (threads per block).
// Inputs: x (B, T, H, P) InT; dt (B, T, H) float (0 at masked tokens); Bm, Cm (B, T, G, N)
//   InT; D (H) float; Lc (B, n_chunks, H, C) float (step 1); S0 (B, n_chunks, H, P, N) float
//   (step 2); iparams int32 [T, n_chunks].
// Outputs: y (B, T, H, P) OutT; every element written.
// Grid: (NT * n_chunks, H, B) threads, blocks of (NT, 1, 1). Shared memory (dynamic, in this
// order): Lt, Dt (C floats each), Mt (C x (C + 4)), then one region holding At, Bt
// (KT x (C + 4) each) and St (KT x (P + 4)) in phase A, Xs (C x P) in phase B:
// msl.out_floats (SF). MMA, after Lt and Dt, bf16s: Cs, Bs (C x (KT + 8)), Sh, Sl (P x (KT + 8))
// in phase A; Mh, Ml (C x (C + 8)), Xs (C x (P + 8)) in phase B.

const int T = iparams[0];
const int NC = iparams[1];
const int tid = int(threadIdx.x);
const int c = int(blockIdx.x);
const int h = int(blockIdx.y);
const int b = int(blockIdx.z);
const int g = h / (H / G);
const int t0 = c * C;
static_assert(C % 4 == 0 && P % 4 == 0 && N % 4 == 0 && KT % 4 == 0, "4x4 tiles");
constexpr int CS = C + 4;   // row stride of the (k, t) slices and of M^T: float4 rows
constexpr int PS = P + 4;
constexpr int TC = C / 4;   // tiles per row of the (C x C) product
constexpr int TP = P / 4;   // tiles per row of the (C x P) output
constexpr int TRI = TC * (TC + 1) / 2;  // the lower triangle's tiles of C.B
constexpr int MT1 = (TRI + NT - 1) / NT;
constexpr int MT2 = (TC * TP + NT - 1) / NT;


extern __shared__ __align__(16) unsigned char smem[];
float* Lt = reinterpret_cast<float*>(smem);
float* Dt = Lt + C;

const int64_t lc0 = ((int64_t(b) * NC + c) * H + h) * C;
for (int t = tid; t < C; t += NT) {
  Lt[t] = Lc[lc0 + t];
  Dt[t] = t0 + t < T ? dt[(int64_t(b) * T + t0 + t) * H + h] : 0.0f;
}

// bf16 inputs in whole 16 x 16 units whose arrays fit SF (msl.mma_floats sizes it): tensor cores
constexpr int KP = KT + 8;  // MMA row strides (bf16s)
constexpr int CP = C + 8;
constexpr int PP = P + 8;
constexpr int MMA_BYTES_A = 4 * KP * (C + P);
constexpr int MMA_BYTES_B = 2 * (2 * C * CP + C * PP);
constexpr bool MMA = bricks::Same<InT, __nv_bfloat16>::value && C % 16 == 0 &&
                     P % 16 == 0 && N % 16 == 0 && KT % 16 == 0 &&
                     8 * C + (MMA_BYTES_A > MMA_BYTES_B ? MMA_BYTES_A : MMA_BYTES_B) <= 4 * SF;
const int64_t s0 = ((int64_t(b) * NC + c) * H + h) * P * N;  // this chunk's S0
const float d_h = D[h];
static_assert(MMA || (SF >= 2 * C + C * CS + KT * (2 * CS + PS) && SF >= 2 * C + C * CS + C * P),
              "shared floats");
if constexpr (MMA) {
  constexpr int NW = NT / 32;
  // (at least 1: the branch is compiled, not run, for shapes without whole units)
  constexpr int TB = C / 16 > 0 ? C / 16 : 1;  // 16-token blocks
  constexpr int UP = P / 16 > 0 ? P / 16 : 1;
  constexpr int TRI16 = TB * (TB + 1) / 2;     // C.B units on or below the diagonal
  constexpr int MU1 = (TRI16 + NW - 1) / NW;
  constexpr int MU2 = (TB * UP + NW - 1) / NW;
  __nv_bfloat16* R = reinterpret_cast<__nv_bfloat16*>(Dt + C);
  __nv_bfloat16* Cs = R;              // phase A: (t, k)
  __nv_bfloat16* Bs = Cs + C * KP;    // (i, k)
  __nv_bfloat16* Sh = Bs + C * KP;    // (p, k), hi and lo
  __nv_bfloat16* Sl = Sh + P * KP;
  __nv_bfloat16* Mh = R;              // phase B: (t, i), hi and lo
  __nv_bfloat16* Ml = Mh + C * CP;
  __nv_bfloat16* Xs = Ml + C * CP;    // (i, p)
  const int warp = tid / 32;
  const int lg = (tid % 32) / 4;
  const int lt = tid % 4;
  float cb[MU1][2][4] = {};
  float acc[MU2][2][4] = {};
  // rows of 8 bf16s / 4 floats in one 16-byte load each (N, KT, P multiples of 16: a vector
  // lies wholly inside N or wholly past it; any alignment of x, B, C served)
  const bool vc = bricks::aligned16(Cm) && bricks::aligned16(Bm);
  const bool vx = bricks::aligned16(x);
  const bool vs = bricks::aligned16(S0);  // step 2's output: aligned as MLX allocates

  // phase A: C.B and C.S0 over slices of N
  for (int n0 = 0; n0 < N; n0 += KT) {
    bricks::fill<C * KT / 8, NT>(tid, [&](int e) {
      const int t = e / bricks::V8<KT>;
      const int k = (e % bricks::V8<KT>) * 8;
      const bool inside = t0 + t < T && n0 + k < N;
      const int64_t src = ((int64_t(b) * T + t0 + t) * G + g) * N + n0 + k;
      bricks::st8(Cs + t * KP + k, bricks::ld8(Cm, src, inside, vc));
      bricks::st8(Bs + t * KP + k, bricks::ld8(Bm, src, inside, vc));
    });
    bricks::fill<P * KT / 4, NT>(tid, [&](int e) {
      const int p = e / bricks::V4<KT>;
      const int k = (e % bricks::V4<KT>) * 4;
      bricks::split4(bricks::ld4f(S0, s0 + p * N + n0 + k, n0 + k < N, vs), Sh + p * KP + k,
                     Sl + p * KP + k);
    });
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MU1; ++m) {
      const int unit = warp + m * NW;  // warp-uniform
      if (unit < TRI16) {
        const int tr = bricks::tri_row(unit);
        const int ti = unit - tr * (tr + 1) / 2;
#pragma unroll
        for (int kk = 0; kk < KT; kk += 16) {
          uint32_t a[4], bb[4];
          bricks::frag_a(a, Cs, KP, tr * 16, kk);
          bricks::frag_b2(bb, Bs, KP, ti * 16, kk);
          bricks::mma2(cb[m], a, bb);
        }
      }
    }
#pragma unroll
    for (int m = 0; m < MU2; ++m) {
      const int unit = warp + m * NW;
      if (unit < TB * UP) {
        const int tb = unit / UP;
        const int p0 = (unit % UP) * 16;
#pragma unroll
        for (int kk = 0; kk < KT; kk += 16) {
          uint32_t a[4], bh[4], bl[4];
          bricks::frag_a(a, Cs, KP, tb * 16, kk);
          bricks::frag_b2(bh, Sh, KP, p0, kk);
          bricks::frag_b2(bl, Sl, KP, p0, kk);
          bricks::mma2(acc[m], a, bh);
          bricks::mma2(acc[m], a, bl);
        }
      }
    }
    __syncthreads();
  }

  // phase B: M (decays, time steps, the causal mask in the diagonal units; units above the
  // diagonal are never read), the state's part decayed from the chunk's start, the chunk's x
#pragma unroll
  for (int m = 0; m < MU1; ++m) {
    const int unit = warp + m * NW;
    if (unit < TRI16) {
      const int tr = bricks::tri_row(unit);
      const int ti = unit - tr * (tr + 1) / 2;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int t = tr * 16 + lg + (q / 2) * 8;
          const int i = ti * 16 + 8 * j + 2 * lt + q % 2;
          const float v = i <= t ? cb[m][j][q] * expf(Lt[t] - Lt[i]) * Dt[i] : 0.0f;
          bricks::split_bf16(v, Mh[t * CP + i], Ml[t * CP + i]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MU2; ++m) {
    const int tb = (warp + m * NW) / UP;
    const float g0 = expf(Lt[(tb * 16 + lg) % C]);  // rows past C: units past the last
    const float g1 = expf(Lt[(tb * 16 + lg + 8) % C]);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      acc[m][j][0] *= g0;
      acc[m][j][1] *= g0;
      acc[m][j][2] *= g1;
      acc[m][j][3] *= g1;
    }
  }
  bricks::fill<C * P / 8, NT>(tid, [&](int e) {
    const int i = e / bricks::V8<P>;
    const int p = (e % bricks::V8<P>) * 8;
    bricks::st8(Xs + i * PP + p,
                bricks::ld8(x, ((int64_t(b) * T + t0 + i) * H + h) * P + p, t0 + i < T, vx));
  });
  __syncthreads();

#pragma unroll
  for (int m = 0; m < MU2; ++m) {
    const int unit = warp + m * NW;
    if (unit < TB * UP) {
      const int tb = unit / UP;
      const int p0 = (unit % UP) * 16;
      for (int kk = 0; kk <= tb * 16; kk += 16) {  // M_ti = 0 for i > t
        uint32_t ah[4], al[4], bx[4];
        bricks::frag_a(ah, Mh, CP, tb * 16, kk);
        bricks::frag_a(al, Ml, CP, tb * 16, kk);
        bricks::frag_b2_t(bx, Xs, PP, kk, p0);
        bricks::mma2(acc[m], ah, bx);
        bricks::mma2(acc[m], al, bx);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // rows lg and lg + 8: two adjacent outputs per store
        // (y is this launch's own output: aligned as MLX allocates; p is even)
        const int t = tb * 16 + lg + r * 8;
        if (t0 + t < T) {
          const int64_t dst = ((int64_t(b) * T + t0 + t) * H + h) * P;
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int p = p0 + 8 * j + 2 * lt;
            const float2 xs = bricks::unpack2<__nv_bfloat16>(
                *reinterpret_cast<const uint32_t*>(Xs + t * PP + p));
            bricks::st2(y + dst + p, acc[m][j][2 * r] + d_h * xs.x,
                        acc[m][j][2 * r + 1] + d_h * xs.y);
          }
        }
      }
    }
  }
} else {
  float* Mt = Dt + C;       // (i, t): M^T
  float* At = Mt + C * CS;  // (k, t): C^T slice
  float* Bt = At + KT * CS; // (k, i): B^T slice
  float* St = Bt + KT * CS; // (k, p): S0^T slice
  float* Xs = At;           // phase B: (i, p), over the slices

  float cb[MT1][4][4] = {};
  float acc[MT2][4][4] = {};

  // phase A: C.B and C.S0 over slices of N
  for (int n0 = 0; n0 < N; n0 += KT) {
    for (int e = tid; e < C * KT; e += NT) {
      const int t = e / KT;
      const int k = e % KT;
      const bool inside = t0 + t < T && n0 + k < N;
      const int64_t src = ((int64_t(b) * T + t0 + t) * G + g) * N + n0 + k;
      At[k * CS + t] = inside ? bricks::to_float(Cm[src]) : 0.0f;
      Bt[k * CS + t] = inside ? bricks::to_float(Bm[src]) : 0.0f;
    }
    for (int e = tid; e < P * KT; e += NT) {
      const int p = e / KT;
      const int k = e % KT;
      St[k * PS + p] = n0 + k < N ? S0[s0 + p * N + n0 + k] : 0.0f;
    }
    __syncthreads();
  #pragma unroll
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
  #pragma unroll
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
    __syncthreads();
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
  #pragma unroll
  for (int m = 0; m < MT1; ++m) {
    const int tile = tid + m * NT;
    if (tile < TRI) {
      const int tr = bricks::tri_row(tile);
      const int t4 = tr * 4;
      const int i4 = (tile - tr * (tr + 1) / 2) * 4;
  #pragma unroll
      for (int u = 0; u < 4; ++u) {
  #pragma unroll
        for (int v = 0; v < 4; ++v) {
          const int t = t4 + u;
          const int i = i4 + v;
          Mt[i * CS + t] = i <= t ? cb[m][u][v] * expf(Lt[t] - Lt[i]) * Dt[i] : 0.0f;
        }
      }
    }
  }
  #pragma unroll
  for (int m = 0; m < MT2; ++m) {
    const int tile = tid + m * NT;
    if (tile < TC * TP) {
      const int t4 = (tile / TP) * 4;
  #pragma unroll
      for (int u = 0; u < 4; ++u) {
        const float gl = expf(Lt[t4 + u]);
  #pragma unroll
        for (int v = 0; v < 4; ++v) {
          acc[m][u][v] *= gl;
        }
      }
    }
  }
  for (int e = tid; e < C * P; e += NT) {
    const int t = t0 + e / P;
    Xs[e] = t < T ? bricks::to_float(x[((int64_t(b) * T + t) * H + h) * P + e % P]) : 0.0f;
  }
  __syncthreads();

  #pragma unroll
  for (int m = 0; m < MT2; ++m) {
    const int tile = tid + m * NT;
    if (tile < TC * TP) {
      const int t4 = (tile / TP) * 4;
      const int p4 = (tile % TP) * 4;
      for (int i = 0; i < t4 + 4; ++i) {  // M_ti = 0 for i > t
        bricks::fma_outer4(acc[m], bricks::ld4(Mt + i * CS + t4), bricks::ld4(Xs + i * P + p4));
      }
  #pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int t = t4 + u;
        if (t0 + t < T) {
          const int64_t dst = ((int64_t(b) * T + t0 + t) * H + h) * P + p4;
  #pragma unroll
          for (int v = 0; v < 4; ++v) {
            y[dst + v] = bricks::from_float<OutT>(acc[m][u][v] + d_h * Xs[t * P + p4 + v]);
          }
        }
      }
    }
  }
}
