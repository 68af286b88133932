// attention_common.cuh -- what both CUDA attention kernels share (attention.cuh, the first
// kernel; attention_fa.cuh, the fast family). Needs mma.cuh before it.
//
//   key_visible / block_tiles / tile_active / tile_needs_mask   which keys a row sees, which
//                                                               K/V tiles a block loads, which a
//                                                               unit computes and masks
//   RunParams                                                   a (batch row, head)'s run-time
//                                                               window, kv_start, scale, sink
//   softmax_probs / rescale_o / softmax_tile                    the online softmax step
//   store_rows                                                  out = O / l (0 without keys)
//   Strides4, Dims, exp2_fast, named_barrier, dynamic_smem_bytes, aligned16
#ifndef MLX_BRICKS_ATTENTION_COMMON_CUH
#define MLX_BRICKS_ATTENTION_COMMON_CUH

namespace bricks {
namespace attn {

// log2(e): scores are kept in the log2 domain so the softmax uses exp2.
constexpr float kLog2e = 1.4426950408889634f;
// Score of a masked key: the lowest finite float, so no inf - inf can appear in the update.
constexpr float kMasked = -3.4028234663852886e38f;

// PTX-only helpers; tests/cuda_emu/warp_emu.h supplies host versions (BRICKS_HOST_EMULATION)
// to run this kernel on the CPU.
#ifndef BRICKS_HOST_EMULATION
// 2^x, ex2.approx.ftz (max relative error 2^-22; subnormal results flush to 0).
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Named barrier over `nthreads` threads (a multiple of 32); id 0 is __syncthreads.
__device__ __forceinline__ void named_barrier(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(nthreads) : "memory");
}

__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t r;
  asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(r));
  return r;
}
#endif  // BRICKS_HOST_EMULATION

__host__ __device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// ---- Which keys a row sees, which tiles a block loads, which tiles a warp computes/masks ----
// (__host__ too: tests/test_attention_cuda.py checks them exhaustively on the CPU.)
// A query row at key position pos = row + Lk - Lq sees key j iff kv_lo <= j < Lk, and j <= pos
// when `upper` (causal; a window implies it), and j > pos - window when has_window. kv_lo: the
// batch row's first valid key (KV_START, a left-padded batch; 0 otherwise), in 0 .. Lk.
__host__ __device__ __forceinline__ bool key_visible(int key, int pos, int Lk, bool upper,
                                                     bool has_window, int window,
                                                     int kv_lo = 0) {
  return key >= kv_lo && key >= 0 && key < Lk && (!upper || key <= pos) &&
         (!has_window || key > pos - window);
}

__host__ __device__ __forceinline__ int clamp_int(int x, int lo, int hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// K/V tiles [t_begin, t_end) of BK keys that rows row0 .. row_last may see; later and (with a
// window or kv_lo) earlier tiles are never loaded.
struct TileRange {
  int t_begin, t_end;
};

__host__ __device__ __forceinline__ TileRange block_tiles(int row0, int row_last, int diag,
                                                          int Lk, int BK, bool upper,
                                                          bool has_window, int window,
                                                          int kv_lo = 0) {
  const int hi = upper ? clamp_int(row_last + diag + 1, 0, Lk) : Lk;
  int lo = has_window ? clamp_int(row0 + diag - window + 1, 0, hi) : 0;
  if (kv_lo > lo) lo = kv_lo < hi ? kv_lo : hi;
  const int tb = lo / BK;
  return TileRange{tb, hi > lo ? (hi + BK - 1) / BK : tb};
}

// Whether rows row0 .. row_last see any key of tile [kv0, kv0 + BK) (else the warp skips it).
__host__ __device__ __forceinline__ bool tile_active(int kv0, int BK, int row0, int row_last,
                                                     int diag, bool upper, bool has_window,
                                                     int window, int kv_lo = 0) {
  return !(upper && kv0 > row_last + diag) &&
         !(has_window && kv0 + BK - 1 <= row0 + diag - window) && kv0 + BK > kv_lo;
}

// Whether some row of row0 .. row_last does not see some key of the tile (else no mask).
__host__ __device__ __forceinline__ bool tile_needs_mask(int kv0, int BK, int row0,
                                                         int row_last, int diag, int Lk,
                                                         bool upper, bool has_window,
                                                         int window, int kv_lo = 0) {
  return kv0 + BK > Lk || (upper && kv0 + BK - 1 > row0 + diag) ||
         (has_window && kv0 <= row_last + diag - window) || kv0 < kv_lo;
}

// The run-time parameters of one (batch row b, head h): the window, the first valid key (kv_lo,
// clamped to 0 .. Lk), the score mapping to the log2 domain (s * pre, or tanh(s * pre) * post
// with soft-capping: s * scale * log2 e, or softcap * tanh(s * scale / softcap) * log2 e) and
// the sink's score in that domain (neither scaled nor capped). fparams = (scale, softcap,
// 1 / softcap), iparams = (window,); kv_start and sinks are read only when their flag is set.
template <bool WINDOW, bool SOFTCAP, bool KV_START, bool SINKS>
struct RunParams {
  int window, kv_lo;
  float pre, post, sink2;
  __device__ __forceinline__ RunParams(const float* fparams, const int32_t* iparams,
                                       const int32_t* kv_start, int64_t kv_start_stride,
                                       const float* sinks, int64_t sinks_stride, int b, int h,
                                       int Lk) {
    const float scale = fparams[0];
    const float softcap = SOFTCAP ? fparams[1] : 1.0f;
    window = WINDOW ? iparams[0] : 0;
    kv_lo = KV_START ? clamp_int(kv_start[int64_t(b) * kv_start_stride], 0, Lk) : 0;
    pre = SOFTCAP ? scale / softcap : scale * kLog2e;
    post = softcap * kLog2e;
    sink2 = SINKS ? sinks[int64_t(h) * sinks_stride] * kLog2e : 0.0f;
  }
};

// Strides of one (B, H, L, D) input, in elements.
struct Strides4 {
  int64_t b, h, l, d;
};

struct Dims {
  int Hq, Lq, Hkv, Lk;
};

// Step 3: scores to the log2 domain (scale, soft-cap), mask (only when the tile needs it), and
// the online softmax update: s becomes P, m_run / l_run are updated and factor is what O must
// be multiplied by (softmax_tile does it; the fast family may do it later, once its in-flight
// P V has completed). FAST (only for a tile without soft-cap or mask and with pre > 0; the
// caller branches once per tile, so no score pays for both forms): the row max is taken over the
// raw scores and p = 2^(s pre - m) is one FFMA and one ex2 per score.
template <bool F32, bool SOFTCAP, bool UPPER, bool WINDOW, int BK, int MT, bool FAST = false>
__device__ __forceinline__ void softmax_probs(float (&s)[MT][BK / 8][4], float (&m_run)[MT][2],
                                              float (&l_run)[MT][2], float (&factor)[MT][2],
                                              float pre, float post, bool need_mask, int wrow0,
                                              int diag, int kv0, int Lk, int window, int kv_lo,
                                              int g, int tq) {
  constexpr int NB = BK / 8;
  static_assert(!FAST || (!SOFTCAP && !F32), "the FFMA form is for unmasked, uncapped tiles");
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    float mx[2] = {m_run[m][0], m_run[m][1]};
    if constexpr (FAST) {
      float raw[2] = {kMasked, kMasked};
#pragma unroll
      for (int j = 0; j < NB; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) raw[e / 2] = fmaxf(raw[e / 2], s[m][j][e]);
#pragma unroll
      for (int r = 0; r < 2; ++r) mx[r] = fmaxf(mx[r], quad_max(raw[r]) * pre);
    } else {
#pragma unroll
      for (int j = 0; j < NB; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = SOFTCAP ? tanhf(s[m][j][e] * pre) * post : s[m][j][e] * pre;
          if (need_mask) {
            const int pos = wrow0 + m * 16 + g + (e / 2) * 8 + diag;  // key position of the row
            const int key = kv0 + j * 8 + 2 * tq + (e % 2);
            x = key_visible(key, pos, Lk, UPPER, WINDOW, window, kv_lo) ? x : kMasked;
          }
          s[m][j][e] = x;
          mx[e / 2] = fmaxf(mx[e / 2], x);
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) mx[r] = quad_max(mx[r]);
    }
    bool live[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      live[r] = mx[r] > kMasked;  // the row has seen a visible key
      factor[m][r] = F32 ? exp2f(m_run[m][r] - mx[r]) : exp2_fast(m_run[m][r] - mx[r]);
      m_run[m][r] = mx[r];
    }
    float lsum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < NB; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float p;
        if constexpr (FAST) {
          p = exp2_fast(fmaf(s[m][j][e], pre, -mx[e / 2]));
        } else {
          const float d = s[m][j][e] - mx[e / 2];
          p = live[e / 2] ? (F32 ? exp2f(d) : exp2_fast(d)) : 0.0f;
        }
        s[m][j][e] = p;
        lsum[e / 2] += p;
      }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l_run[m][r] = l_run[m][r] * factor[m][r] + lsum[r];
  }
}

// O *= factor, row by row (the C layout: elements 0, 1 of row g, 2, 3 of row g + 8).
template <int MT, int ND>
__device__ __forceinline__ void rescale_o(float (&o)[MT][ND][4], const float (&factor)[MT][2]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int i = 0; i < ND; ++i) {
      o[m][i][0] *= factor[m][0];
      o[m][i][1] *= factor[m][0];
      o[m][i][2] *= factor[m][1];
      o[m][i][3] *= factor[m][1];
    }
}

template <bool F32, bool SOFTCAP, bool UPPER, bool WINDOW, int BK, int MT, int ND>
__device__ __forceinline__ void softmax_tile(float (&s)[MT][BK / 8][4], float (&m_run)[MT][2],
                                             float (&l_run)[MT][2], float (&o)[MT][ND][4],
                                             float pre, float post, bool need_mask, int wrow0,
                                             int diag, int kv0, int Lk, int window, int kv_lo,
                                             int g, int tq) {
  float factor[MT][2];
  softmax_probs<F32, SOFTCAP, UPPER, WINDOW, BK, MT>(s, m_run, l_run, factor, pre, post,
                                                     need_mask, wrow0, diag, kv0, Lk, window,
                                                     kv_lo, g, tq);
  rescale_o<MT, ND>(o, factor);
}

// Step 5: out[b, row, h, :] = O / l for this warp's rows and columns; a row that saw no key
// gives 0.
template <class C, typename T, int D, int MT, int ND>
__device__ __forceinline__ void store_rows(T* out, const float (&o)[MT][ND][4],
                                           const float (&l_run)[MT][2], int64_t b, int h,
                                           int Lq, int Hq, int wrow0, int dcol0, int g, int tq) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_run[m][r]);
      const float inv = l > 0.0f ? 1.0f / l : 0.0f;
      const int row = wrow0 + m * 16 + g + 8 * r;
      if (row < Lq) {
        T* dst = out + ((b * Lq + row) * Hq + h) * D + dcol0 + 2 * tq;
#pragma unroll
        for (int i = 0; i < ND; ++i) {
          const float x0 = o[m][i][2 * r] * inv;
          const float x1 = o[m][i][2 * r + 1] * inv;
          if constexpr (C::F32) {
            *reinterpret_cast<float2*>(dst + i * 8) = make_float2(x0, x1);
          } else {
            *reinterpret_cast<uint32_t*>(dst + i * 8) = pack2<T>(x0, x1);
          }
        }
      }
    }
  }
}

}  // namespace attn
}  // namespace bricks

#endif  // MLX_BRICKS_ATTENTION_COMMON_CUH
