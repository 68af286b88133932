// warp_emu.h -- run a CUDA twin's kernel body on the CPU (tests only; nothing here ships).
//
// Every CUDA thread of a block is an OS thread; __syncthreads, named barriers and __syncwarp are
// std::barriers; warp collectives (__shfl_xor_sync / _up_sync / _sync, ldmatrix, mma.sync
// m16n8k16) exchange the lanes' registers through per-warp scratch between two warp barriers
// and then compute each lane's result from the PTX ISA fragment layouts (the same layouts
// cuda_src/mma.cuh documents).
// cp.async copies land at cp_async_wait (the latest moment the PTX memory model allows), so a
// read of a tile before its wait sees stale data. The kernel source is compiled unchanged by a
// host C++20 compiler: this header replaces cuda_src/mma.cuh (same names, same semantics) and
// supplies attention.cuh's PTX-only helpers (BRICKS_HOST_EMULATION). cp.async keeps PTX's
// commit groups: cp_async_wait<N> lands every group but the newest N. The integer and paired
// half instructions of the weight conversion (PRMT, funnel shift, LOP3, HFMA2, HSUB2, HMUL2.RN,
// HADD2.RN) are computed bit-exactly: each paired result is the exact value rounded once to
// nearest even (float64 arithmetic, an exact TwoSum error term for the last bit). The GEMM's
// wgmma.cuh is not emulated (MmaPolicy gives the mma.sync WarpTile); the attention kernel's
// wgmma wrappers (attention_wgmma.cuh) are, in wgmma_emu.h.
//
// mbarriers are counters beside shared memory: cp.async.mbarrier.arrive lands the thread's
// copies, then arrives; a wait blocks until the phase of the asked parity has completed (a
// deadlock aborts after a minute).
//
// What it does not model: timing, bank conflicts, the exact rounding order inside the tensor
// core (mma sums in float, in k order), ex2.approx's error (exact exp2f here).
#pragma once

#define BRICKS_HOST_EMULATION 1
#define MLX_BRICKS_MMA_CUH 1  // the real mma.cuh is PTX; this file is its host twin
#define MLX_BRICKS_WGMMA_CUH 1  // wgmma is not emulated (MmaPolicy below)
#define MLX_BRICKS_QGEMM_WGMMA_CUH 1  // nor qgemm's wgmma consumer

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>

#include <array>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <thread>
#include <type_traits>
#include <algorithm>
#include <vector>

#define __global__
#define __grid_constant__

namespace emu {

struct Dim3 {
  unsigned x = 0, y = 0, z = 0;
};

// An mbarrier's state (kept beside shared memory, keyed by its shared address).
struct MBar {
  int expected = 0;
  int pending = 0;
  uint32_t completed = 0;  // phases completed so far
};

struct Block {
  int nthreads = 0;
  std::mutex mu;  // guards mbars and lazily made named barriers
  std::condition_variable cv;
  std::map<uint32_t, MBar> mbars;
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warp;
  std::unique_ptr<std::barrier<>> named[16];
  unsigned char* smem = nullptr;
  uint32_t smem_size = 0;
  uint32_t xch[32][32][16];  // per-warp register exchange (up to 1,024 threads)
};

struct Pending {
  unsigned char* dst;
  const unsigned char* src;
  int n;
};

inline thread_local Dim3 t_idx, b_idx;
inline thread_local Block* blk = nullptr;
inline thread_local std::vector<Pending> pending;       // issued, not yet committed
inline thread_local std::deque<std::vector<Pending>> groups;  // committed, not yet landed
inline Dim3 g_dim;
inline Dim3 g_bdim;

inline int lane() { return int(t_idx.x % 32); }
inline int warp_id() { return int(t_idx.x / 32); }
inline void warp_sync() { blk->warp[warp_id()]->arrive_and_wait(); }

// All lanes' N registers: out[l][i] = lane l's mine[i].
template <int N>
inline void exchange(const uint32_t* mine, uint32_t (*out)[N]) {
  static_assert(N <= 16, "exchange width");
  uint32_t(&x)[32][16] = blk->xch[warp_id()];
  for (int i = 0; i < N; ++i) x[lane()][i] = mine[i];
  warp_sync();
  for (int l = 0; l < 32; ++l)
    for (int i = 0; i < N; ++i) out[l][i] = x[l][i];
  warp_sync();
}

inline uint32_t fbits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bitsf(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace emu

#define threadIdx emu::t_idx
#define blockIdx emu::b_idx
#define gridDim emu::g_dim
#define blockDim emu::g_bdim

inline void __syncthreads() { emu::blk->all->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_sync(); }
inline void __trap() {
  std::fprintf(stderr, "emu: __trap() in block (%u, %u, %u) thread %u\n", emu::b_idx.x,
               emu::b_idx.y, emu::b_idx.z, emu::t_idx.x);
  std::abort();
}
inline float __shfl_xor_sync(unsigned, float v, int m) {
  uint32_t mine = emu::fbits(v), all[32][1];
  emu::exchange<1>(&mine, all);
  return emu::bitsf(all[emu::lane() ^ m][0]);
}
// shfl.sync.up: lanes below the delta keep their own value (PTX ISA); idx: any source lane.
inline float __shfl_up_sync(unsigned, float v, unsigned d) {
  uint32_t mine = emu::fbits(v), all[32][1];
  emu::exchange<1>(&mine, all);
  const int l = emu::lane();
  return l >= int(d) ? emu::bitsf(all[l - int(d)][0]) : v;
}
inline float __shfl_sync(unsigned, float v, int src) {
  uint32_t mine = emu::fbits(v), all[32][1];
  emu::exchange<1>(&mine, all);
  return emu::bitsf(all[src & 31][0]);
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int __float_as_int(float f) {
  int i;
  std::memcpy(&i, &f, 4);
  return i;
}
inline float __uint_as_float(uint32_t u) { return emu::bitsf(u); }
inline uint32_t __float_as_uint(float f) { return emu::fbits(f); }
// prmt.b32 default mode with selectors 0..7 (the only ones the twins use).
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = uint64_t(x) | (uint64_t(y) << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t sel = (s >> (4 * i)) & 0xf;
    if (sel & 8) {
      std::fprintf(stderr, "emu: prmt sign-replicate selectors are not emulated\n");
      std::abort();
    }
    r |= uint32_t((v >> (8 * sel)) & 0xff) << (8 * i);
  }
  return r;
}
// shf.r.wrap: the low 32 bits of (hi:lo) >> (s & 31).
inline uint32_t __funnelshift_r(uint32_t lo, uint32_t hi, uint32_t s) {
  return uint32_t(((uint64_t(hi) << 32) | lo) >> (s & 31));
}
// Rounded float32 operations (the host compiler contracts nothing under -std=c++20).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

namespace bricks {

template <typename T>
struct Num;
template <>
struct Num<float> {
  static float to_float(float v) { return v; }
  static float from_float(float v) { return v; }
};
template <>
struct Num<__half> {
  static float to_float(__half v) { return __half2float(v); }
  static __half from_float(float v) { return __float2half_rn(v); }
};
template <>
struct Num<__nv_bfloat16> {
  static float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};
template <typename T>
inline float to_float(T v) { return Num<T>::to_float(v); }
template <typename T>
inline T from_float(float v) { return Num<T>::from_float(v); }
template <typename A, typename B>
using Same = std::is_same<A, B>;  // mma.cuh's Same

template <typename T>
inline uint32_t pack2(float lo, float hi) {
  T l = Num<T>::from_float(lo), h = Num<T>::from_float(hi);
  uint16_t a, b;
  std::memcpy(&a, &l, 2);
  std::memcpy(&b, &h, 2);
  return uint32_t(a) | (uint32_t(b) << 16);
}
template <typename T>
inline float2 unpack2(uint32_t r) {
  uint16_t a = uint16_t(r & 0xffff), b = uint16_t(r >> 16);
  T l, h;
  std::memcpy(&l, &a, 2);
  std::memcpy(&h, &b, 2);
  return make_float2(Num<T>::to_float(l), Num<T>::to_float(h));
}

// mma.cuh's ldg16_as_float_b16: 16 bytes of 8 16-bit floats as floats.
template <typename T>
inline void ldg16_as_float_b16(const T* p, float (&o)[8]) {
  uint32_t w[4];
  std::memcpy(w, p, 16);
  for (int i = 0; i < 4; ++i) {
    const float2 f = unpack2<T>(w[i]);
    o[2 * i] = f.x;
    o[2 * i + 1] = f.y;
  }
}

// mma.cuh's i8x4_to_float4, the same instructions (byte permute into the 2^23 magic, one FADD).
inline float4 i8x4_to_float4(uint32_t w) {
  const uint32_t u = w ^ 0x80808080u;
  const float bias = 8388736.0f;  // 2^23 + 128
  float4 r;
  r.x = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540)) - bias;
  r.y = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541)) - bias;
  r.z = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7542)) - bias;
  r.w = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7543)) - bias;
  return r;
}

inline uint32_t smem_addr(const void* p) {
  const auto* c = static_cast<const unsigned char*>(p);
  if (c < emu::blk->smem || c > emu::blk->smem + emu::blk->smem_size) {
    std::fprintf(stderr, "emu: smem_addr of a pointer outside shared memory\n");
    std::abort();
  }
  return uint32_t(c - emu::blk->smem);
}

inline unsigned char* smem_ptr(uint32_t a, int bytes) {
  if (uint64_t(a) + uint64_t(bytes) > emu::blk->smem_size) {
    std::fprintf(stderr, "emu: shared access [%u, %u) past %u bytes\n", a, a + bytes,
                 emu::blk->smem_size);
    std::abort();
  }
  return emu::blk->smem + a;
}

inline void cp_async_n(uint32_t dst, const void* src, bool pred, int n) {
  if (dst % n) {
    std::fprintf(stderr, "emu: cp.async destination not %d-byte aligned\n", n);
    std::abort();
  }
  if (pred && (reinterpret_cast<uintptr_t>(src) % n)) {
    std::fprintf(stderr, "emu: cp.async source not %d-byte aligned\n", n);
    std::abort();
  }
  emu::pending.push_back({smem_ptr(dst, n), pred ? static_cast<const unsigned char*>(src) : nullptr, n});
}
inline void cp_async16(uint32_t dst, const void* src, bool pred = true) { cp_async_n(dst, src, pred, 16); }
inline void cp_async4(uint32_t dst, const void* src, bool pred = true) { cp_async_n(dst, src, pred, 4); }
inline void cp_async_commit() {
  emu::groups.push_back(std::move(emu::pending));
  emu::pending.clear();
}
// Lands the oldest committed groups until at most N stay in flight (PTX cp.async.wait_group).
template <int N>
inline void cp_async_wait() {
  while (emu::groups.size() > size_t(N)) {
    for (const auto& p : emu::groups.front()) {
      if (p.src) std::memcpy(p.dst, p.src, p.n);
      else std::memset(p.dst, 0, p.n);
    }
    emu::groups.pop_front();
  }
}
inline void fence_proxy_async() {}

// ---- mbarriers and named barriers (mma.cuh's mbar_* and bar_sync) ----
inline emu::MBar& mbar_at(uint32_t a) {
  auto it = emu::blk->mbars.find(a);
  if (it == emu::blk->mbars.end()) {
    std::fprintf(stderr, "emu: mbarrier at %u used before mbar_init\n", a);
    std::abort();
  }
  return it->second;
}
inline void mbar_init(uint64_t* bar, int count) {
  const uint32_t a = smem_addr(bar);
  std::lock_guard<std::mutex> lk(emu::blk->mu);
  emu::blk->mbars[a] = emu::MBar{count, count, 0};
}
inline void mbar_arrive(uint64_t* bar) {
  const uint32_t a = smem_addr(bar);
  std::lock_guard<std::mutex> lk(emu::blk->mu);
  emu::MBar& m = mbar_at(a);
  if (--m.pending == 0) {
    m.pending = m.expected;
    ++m.completed;
    emu::blk->cv.notify_all();
  } else if (m.pending < 0) {
    std::fprintf(stderr, "emu: mbarrier at %u over-arrived\n", a);
    std::abort();
  }
}
inline void cp_async_mbar_arrive(uint64_t* bar) {
  cp_async_commit();
  cp_async_wait<0>();  // the copies land, then the arrival
  mbar_arrive(bar);
}
inline void mbar_wait(uint64_t* bar, uint32_t parity) {
  const uint32_t a = smem_addr(bar);
  std::unique_lock<std::mutex> lk(emu::blk->mu);
  const bool ok = emu::blk->cv.wait_for(lk, std::chrono::seconds(60), [&] {
    return (mbar_at(a).completed & 1u) != (parity & 1u);
  });
  if (!ok) {
    std::fprintf(stderr, "emu: mbarrier wait at %u (parity %u) timed out: deadlock\n", a, parity);
    std::abort();
  }
}
inline void bar_sync(int id, int threads) {
  std::barrier<>* b;
  {
    std::lock_guard<std::mutex> lk(emu::blk->mu);
    if (id <= 0 || id >= 16) {
      std::fprintf(stderr, "emu: named barrier id %d\n", id);
      std::abort();
    }
    if (!emu::blk->named[id]) emu::blk->named[id] = std::make_unique<std::barrier<>>(threads);
    b = emu::blk->named[id].get();
  }
  b->arrive_and_wait();
}
inline void fence_reg(uint32_t&) {}
inline uint32_t dynamic_smem_size() { return emu::blk->smem_size; }
template <int REGS>
inline void setmaxnreg_dec() {}
template <int REGS>
inline void setmaxnreg_inc() {}

// ---- paired 16-bit arithmetic, bit-exact (mma.cuh's h2_* and lop3_and_or) ----
inline uint32_t lop3_and_or(uint32_t a, uint32_t b, uint32_t c) { return (a & b) | c; }

template <typename T>
struct Half16Fmt;
template <>
struct Half16Fmt<__half> {
  static constexpr int P = 11, EMIN = -14;  // precision, smallest normal exponent
  static constexpr double MAX = 65504.0;
};
template <>
struct Half16Fmt<__nv_bfloat16> {
  static constexpr int P = 8, EMIN = -126;
  static constexpr double MAX = 3.3895313892515355e38;
};

template <typename T>
inline double h16_value(uint16_t b) {
  T v;
  std::memcpy(&v, &b, 2);
  return double(Num<T>::to_float(v));
}

// T bits of the exact value s + e (|e| <= half an ulp of s, from TwoSum), rounded once to
// nearest even: s is rounded at T's precision; when s is exactly halfway between two T values
// the sign of e decides, otherwise it cannot change the result.
template <typename T>
inline uint16_t round_exact(double s, double e) {
  using F = Half16Fmt<T>;
  if (std::isnan(s)) return uint16_t(0x7fff);
  const bool neg = std::signbit(s);
  const double a = std::fabs(s);
  const double ea = neg ? -e : e;  // error in the direction of |s|
  double r;
  if (a == 0.0 || std::isinf(a)) {
    r = a;
  } else {
    int ex;
    std::frexp(a, &ex);  // a = f 2^ex, f in [0.5, 1)
    const int ue = std::max(ex - 1, F::EMIN) - (F::P - 1);  // exponent of T's ulp at a
    const double m = std::ldexp(a, -ue);                      // exact
    const double fl = std::floor(m);
    const double frac = m - fl;
    double k;
    if (frac > 0.5 || (frac == 0.5 && (ea > 0 || (ea == 0 && std::fmod(fl, 2.0) != 0.0)))) {
      k = fl + 1.0;
    } else {
      k = fl;
    }
    r = std::ldexp(k, ue);
  }
  if (r > F::MAX) r = INFINITY;
  const float f = float(neg ? -r : r);  // exact: r is a T value
  T t = Num<T>::from_float(f);
  uint16_t bits;
  std::memcpy(&bits, &t, 2);
  return bits;
}

// Exact a * b + c of T values: the product is exact in float64 (at most 22 significant bits),
// the sum's rounding error is recovered by TwoSum.
template <typename T>
inline uint16_t h16_fma(uint16_t a, uint16_t b, uint16_t c) {
  const double p = h16_value<T>(a) * h16_value<T>(b);
  const double cc = h16_value<T>(c);
  const double s = p + cc;
  const double bp = s - cc;
  const double e = (p - bp) + (cc - (s - bp));
  return round_exact<T>(s, std::isfinite(s) ? e : 0.0);
}

template <typename T, typename F>
inline uint32_t h2_map(uint32_t a, uint32_t b, uint32_t c, F op) {
  const uint16_t lo = op(uint16_t(a), uint16_t(b), uint16_t(c));
  const uint16_t hi = op(uint16_t(a >> 16), uint16_t(b >> 16), uint16_t(c >> 16));
  return uint32_t(lo) | (uint32_t(hi) << 16);
}

inline uint16_t h16_neg(uint16_t x) { return uint16_t(x ^ 0x8000u); }

template <typename T>
inline uint32_t h2_fma(uint32_t a, uint32_t b, uint32_t c) {
  return h2_map<T>(a, b, c, [](uint16_t x, uint16_t y, uint16_t z) { return h16_fma<T>(x, y, z); });
}
template <typename T>
inline uint32_t h2_sub(uint32_t a, uint32_t b) {
  constexpr uint16_t one = std::is_same_v<T, __half> ? 0x3c00 : 0x3f80;
  return h2_map<T>(a, b, 0, [](uint16_t x, uint16_t y, uint16_t) {
    return h16_fma<T>(y, h16_neg(one), x);  // x - y, rounded once
  });
}
template <typename T>
inline uint32_t h2_mul_rn(uint32_t a, uint32_t b) {
  return h2_map<T>(a, b, 0, [](uint16_t x, uint16_t y, uint16_t) {
    return round_exact<T>(h16_value<T>(x) * h16_value<T>(y), 0.0);  // exact product
  });
}
template <typename T>
inline uint32_t h2_add_rn(uint32_t a, uint32_t b) {
  constexpr uint16_t one = std::is_same_v<T, __half> ? 0x3c00 : 0x3f80;
  return h2_map<T>(a, b, 0, [](uint16_t x, uint16_t y, uint16_t) { return h16_fma<T>(x, one, y); });
}

// wgmma is not emulated: every GEMM body gets the mma.sync warp tile (gemm.cuh).
template <class Cfg>
struct WarpTile;
template <class Cfg, bool WGMMA>
struct MmaPolicy {
  static_assert(!WGMMA, "the CUDA emulator runs the mma.sync path only (WGMMA = false)");
  using type = WarpTile<Cfg>;
};

// ldmatrix: lane l addresses row l % 8 of matrix l / 8; lane (g, t) receives row g, 32-bit word
// t of each matrix (trans: elements (2t, g) and (2t + 1, g)).
template <int NM, bool TRANS>
inline void ldmatrix_n(uint32_t* r, uint32_t addr) {
  uint32_t all[32][1];
  emu::exchange<1>(&addr, all);
  const int g = emu::lane() / 4, t = emu::lane() % 4;
  for (int i = 0; i < NM; ++i) {
    if (!TRANS) {
      std::memcpy(&r[i], smem_ptr(all[8 * i + g][0] + 4 * t, 4), 4);
    } else {
      uint16_t lo, hi;
      std::memcpy(&lo, smem_ptr(all[8 * i + 2 * t][0] + 2 * g, 2), 2);
      std::memcpy(&hi, smem_ptr(all[8 * i + 2 * t + 1][0] + 2 * g, 2), 2);
      r[i] = uint32_t(lo) | (uint32_t(hi) << 16);
    }
  }
}
inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) { ldmatrix_n<4, false>(r, addr); }
inline void ldmatrix_x2(uint32_t (&r)[2], uint32_t addr) { ldmatrix_n<2, false>(r, addr); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) { ldmatrix_n<4, true>(r, addr); }
inline void ldmatrix_x2_trans(uint32_t (&r)[2], uint32_t addr) { ldmatrix_n<2, true>(r, addr); }

// D = A B + C for m16n8k16 with the PTX fragment layouts (see mma.cuh).
template <typename T>
inline void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  uint32_t mine[6] = {a[0], a[1], a[2], a[3], b[0], b[1]};
  uint32_t all[32][6];
  emu::exchange<6>(mine, all);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    const int ar[4] = {g, g + 8, g, g + 8}, ac[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int i = 0; i < 4; ++i) {
      const float2 v = unpack2<T>(all[l][i]);
      A[ar[i]][ac[i]] = v.x;
      A[ar[i]][ac[i] + 1] = v.y;
    }
    for (int i = 0; i < 2; ++i) {
      const float2 v = unpack2<T>(all[l][4 + i]);
      B[2 * t + 8 * i][g] = v.x;
      B[2 * t + 8 * i + 1][g] = v.y;
    }
  }
  const int g = emu::lane() / 4, t = emu::lane() % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e / 2), col = 2 * t + (e % 2);
    float acc = d[e];
    for (int kk = 0; kk < 16; ++kk) acc = std::fma(A[row][kk], B[kk][col], acc);
    d[e] = acc;
  }
}

inline float quad_max(float v) {
  v = std::fmax(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return std::fmax(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
inline float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

namespace attn {
inline float exp2_fast(float x) { return std::exp2(x); }
inline void named_barrier(int id, int nthreads) {
  if (id <= 0 || id >= 16 || !emu::blk->named[id]) {
    std::fprintf(stderr, "emu: named barrier %d not set up\n", id);
    std::abort();
  }
  (void)nthreads;
  emu::blk->named[id]->arrive_and_wait();
}
inline uint32_t dynamic_smem_bytes() { return emu::blk->smem_size; }
}  // namespace attn

}  // namespace bricks

#include "wgmma_emu.h"

namespace emu {

// Run `kernel` (a callable run by every thread) over grid x block, with `smem_bytes` of dynamic
// shared memory (filled with a poison byte) and named barriers 1 .. n_named of `named_count`
// threads each.
template <typename F>
inline void launch(Dim3 grid, int nthreads, uint32_t smem_bytes, int n_named, int named_count,
                   F kernel) {
  if (nthreads <= 0 || nthreads > 1024) {  // CUDA's limit, and xch's 32 warps
    std::fprintf(stderr, "emu: %d threads per block (1 to 1,024)\n", nthreads);
    std::abort();
  }
  g_dim = grid;
  g_bdim = Dim3{unsigned(nthreads), 1, 1};
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b;
        b.nthreads = nthreads;
        b.all = std::make_unique<std::barrier<>>(nthreads);
        for (int w = 0; w < (nthreads + 31) / 32; ++w)
          b.warp.push_back(std::make_unique<std::barrier<>>(32));
        for (int i = 1; i <= n_named; ++i) b.named[i] = std::make_unique<std::barrier<>>(named_count);
        std::vector<unsigned char> sm(smem_bytes + 16, 0xA5);
        b.smem = sm.data();
        b.smem_size = smem_bytes;
        std::vector<std::thread> th;
        for (int t = 0; t < nthreads; ++t) {
          th.emplace_back([&, t] {
            t_idx = Dim3{unsigned(t), 0, 0};
            b_idx = Dim3{bx, by, bz};
            blk = &b;
            kernel();
            if (!pending.empty() || !groups.empty()) {
              std::fprintf(stderr, "emu: cp.async still pending at kernel end\n");
              std::abort();
            }
            if (!bricks::attn::wg_pending.empty() || !bricks::attn::wg_groups.empty()) {
              std::fprintf(stderr, "emu: wgmma still in flight at kernel end\n");
              std::abort();
            }
          });
        }
        for (auto& x : th) x.join();
      }
}

}  // namespace emu
