// wgmma_emu.h -- host twins of cuda_src/attention_wgmma.cuh's warpgroup MMA wrappers (tests
// only; included by warp_emu.h).
//
// Semantics kept from the PTX ISA (8.x, "Asynchronous Warpgroup Level Matrix Multiply-
// Accumulate"): an issued wgmma is a pending operation of its thread; wgmma.commit_group closes
// a group; wgmma.wait_group N completes every group but the newest N, in order. An operation
// runs when it completes, not when issued: it reads shared memory then (a tile overwritten
// before the wait gives wrong values, as a race on the GPU may), and reads and writes the
// accumulator then. The accumulator must not change between issue and completion (checked:
// abort). Each thread computes its own fragment: warp w of the warpgroup owns rows 16 w ..
// 16 w + 15, d[4 j + e] = (g + 8 (e / 2), 8 j + 2 t + e % 2), lane = 4 g + t; A in registers
// has the mma.sync m16n8k16 A layout per warp (gathered from the warp's lanes, which complete
// the same operations together, as .sync.aligned requires).
//
// Shared-memory operands are read through their matrix descriptors as the PTX canonical
// layouts define them, for the 128-byte swizzle mode with base offset 0 only (anything else
// aborts): K-major ((8, m), (8, 2)) : ((64, SBO), (1, 8)) and MN-major ((8, 8, m), (8, k)) :
// ((1, 8, LBO), (64, SBO)), in 16-bit elements, then the swizzle XORs byte-address bits 4-6 with
// bits 7-9. Sums: float fma in k order (the tensor core's internal order is not modelled).
#pragma once

namespace bricks {
namespace attn {

struct WgOp {
  float* d;
  int n;           // N: columns of the accumulator
  bool rs;         // A from registers (else from shared memory)
  bool trans_b;    // B MN-major
  bool bf16;
  bool acc;        // scale-d: D = A B + D (else D = A B)
  uint32_t a[4];   // A registers (rs)
  uint64_t da, db;
  std::vector<float> snap;  // d at issue (empty: an earlier in-flight op writes d first)
};

inline thread_local std::vector<WgOp> wg_pending;
inline thread_local std::deque<std::vector<WgOp>> wg_groups;

// Byte address of element (mn, k) of a 16-bit operand described by desc.
inline uint32_t wg_addr(uint64_t desc, int mn, int k, bool mn_major) {
  const uint32_t start = uint32_t(desc & 0x3FFF) << 4;
  const uint32_t lbo = uint32_t((desc >> 16) & 0x3FFF) << 4;
  const uint32_t sbo = uint32_t((desc >> 32) & 0x3FFF) << 4;
  if ((desc >> 62) != 1 || ((desc >> 49) & 7) != 0) {
    std::fprintf(stderr, "emu: wgmma descriptor mode other than 128B swizzle, base 0\n");
    std::abort();
  }
  uint32_t a;
  if (mn_major) {
    a = start + uint32_t(mn / 64) * lbo + uint32_t(k / 8) * sbo + uint32_t(k % 8) * 128 +
        uint32_t(mn % 64) * 2;
  } else {
    a = start + uint32_t(mn / 8) * sbo + uint32_t(mn % 8) * 128 + uint32_t(k) * 2;
  }
  return a ^ (((a >> 7) & 7) << 4);
}

inline float wg_elem(uint32_t addr, bool bf16) {
  uint16_t b;
  std::memcpy(&b, smem_ptr(addr, 2), 2);
  return bf16 ? float(h16_value<__nv_bfloat16>(b)) : float(h16_value<__half>(b));
}

inline void wg_run(WgOp& op) {
  const int wi = emu::warp_id() % 4, g = emu::lane() / 4, t = emu::lane() % 4;
  uint32_t all[32][4];
  if (op.rs) emu::exchange<4>(op.a, all);  // every lane of the warp runs the same ops
  for (size_t i = 0; i < op.snap.size(); ++i) {
    if (std::memcmp(&op.d[i], &op.snap[i], 4) != 0) {
      std::fprintf(stderr, "emu: wgmma accumulator changed while the operation was in flight\n");
      std::abort();
    }
  }
  auto a_at = [&](int r, int k) -> float {  // r: row of the warpgroup's 64
    if (!op.rs) return wg_elem(wg_addr(op.da, r, k, false), op.bf16);
    const int rr = r - 16 * wi;  // the warp's own rows only
    const int lane = 4 * (rr % 8) + (k % 8) / 2, reg = rr / 8 + 2 * (k / 8);
    const float2 v = op.bf16 ? unpack2<__nv_bfloat16>(all[lane][reg])
                             : unpack2<__half>(all[lane][reg]);
    return k % 2 ? v.y : v.x;
  };
  for (int j = 0; j < op.n / 8; ++j) {
    for (int e = 0; e < 4; ++e) {
      const int row = 16 * wi + g + 8 * (e / 2), col = 8 * j + 2 * t + e % 2;
      float acc = op.acc ? op.d[4 * j + e] : 0.0f;
      for (int k = 0; k < 16; ++k) {
        acc = std::fma(a_at(row, k), wg_elem(wg_addr(op.db, col, k, op.trans_b), op.bf16), acc);
      }
      op.d[4 * j + e] = acc;
    }
  }
}

inline void wg_fence() {}
inline void wg_commit() {
  wg_groups.push_back(std::move(wg_pending));
  wg_pending.clear();
}
template <int N>
inline void wg_wait() {
  while (wg_groups.size() > size_t(N)) {
    for (auto& op : wg_groups.front()) wg_run(op);
    wg_groups.pop_front();
  }
}
inline void wg_reg_fence(float&) {}

template <int N, typename T>
inline void wg_issue(float (&d)[N / 2], bool rs, const uint32_t* a, uint64_t da, uint64_t db,
                     bool trans_b, bool acc) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "16-bit types");
  static_assert(N % 8 == 0 && N >= 8 && N <= 256, "wgmma N");
  bool chained = false;  // an op issued earlier and not completed writes the same d
  for (const auto& p : wg_pending) chained |= p.d == d;
  for (const auto& grp : wg_groups)
    for (const auto& p : grp) chained |= p.d == d;
  WgOp op{d, N, rs, trans_b, std::is_same_v<T, __nv_bfloat16>, acc, {0, 0, 0, 0}, da, db,
          chained ? std::vector<float>() : std::vector<float>(d, d + N / 2)};
  if (rs) std::memcpy(op.a, a, 16);
  wg_pending.push_back(std::move(op));
}

template <int N, typename T>
struct WgSS {
  static void run(float (&d)[N / 2], uint64_t da, uint64_t db, uint32_t acc) {
    wg_issue<N, T>(d, false, nullptr, da, db, false, acc != 0);
  }
};
template <int N, typename T>
struct WgRS {
  static void run(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t db) {
    wg_issue<N, T>(d, true, a, 0, db, true, true);
  }
};

}  // namespace attn
}  // namespace bricks
