// dequant.cuh -- MLX affine values to T with integer and paired-half tricks: no I2F and no
// per-value float arithmetic. Needs mma.cuh before it. Used by the GEMM twins' weight loader
// (gemm.cuh AffineB) and by the dequantize brick (dequantize.cu).
//
// MLX's affine format: value k of a row is the unsigned BITS-bit field q at bits
// [k BITS, (k + 1) BITS) of the row's little-endian bit stream of uint32 words, and
// w = scale * q + bias with one (scale, bias) per group_size values.
//
// Rounding (FUSED, the default): T(s * q + b), the exact s * q + b rounded once to nearest even
// (HFMA2 / HFMA2.BF16; FFMA for float32). That is what MLX's CUDA dequantize computes on sm_90:
// ptxas contracts its `scale * T(q) + bias` into one HFMA2 / HFMA2.BF16 / FFMA (cuobjdump of the
// same expression, nvcc 13). !FUSED: T(T(s * q) + b), each operation rounded, as MLX's CPU
// dequantize computes (and its CUDA one for bfloat16 on sm_80, where the header's bf16 multiply
// and add carry explicit .rn).
//
// Integers to T without conversions: a 16-bit float whose exponent says 2^MB (MB = 10 mantissa
// bits for fp16: 0x6400 = 1024; MB = 7 for bf16: 0x4300 = 128) and whose mantissa holds an
// integer m < 2^MB is exactly 2^MB + m; HSUB2 of 2^MB leaves m exactly.
//   8-bit, fp16: one PRMT builds {0x64, q1, 0x64, q0}, i.e. (1024 + q0, 1024 + q1).
//   4-bit, 2-bit: one LOP3 (w & mask) | magic per pair of fields at the same offset of the two
//     16-bit halves of a word (fields p and p + 16 / BITS); a field at bit s > 0 of its byte is
//     taken in place (2^MB + q 2^s) when it fits, and HFMA2 by 2^-s minus 2^(MB - s) gives q
//     exactly; PRMT then restores the stream order (q_2j, q_2j+1).
//   3, 5, 6-bit: fields straddle words; each pair is two shifted fields or-ed with the magic.
//   8-bit, bf16 (q up to 255 does not fit 7 mantissa bits): PRMT into the float32 magic 2^23
//     (0x4B0000qq), FADD of -2^23, one exact float32x2 -> bf16x2 conversion.
// Then one HFMA2 (s, q, b) per pair, s and b broadcast to both halves once per segment.
// Ideas from FasterTransformer's dequantize_s4_to_fp16x2, Marlin's dequantization and CUTLASS's
// NumericArrayConverter (LOP3 with the exponent magic); written here for MLX's bit order.
#ifndef MLX_BRICKS_DEQUANT_CUH
#define MLX_BRICKS_DEQUANT_CUH

namespace bricks {
namespace dq {

template <typename T>
struct Half16;
template <>
struct Half16<__half> {
  static constexpr int MB = 10;    // mantissa bits
  static constexpr int BIAS = 15;  // exponent bias
};
template <>
struct Half16<__nv_bfloat16> {
  static constexpr int MB = 7;
  static constexpr int BIAS = 127;
};

// Bits of +-2^e in T (a normal number).
template <typename T>
__host__ __device__ constexpr uint32_t pow2_bits(int e, bool neg = false) {
  return (uint32_t(e + Half16<T>::BIAS) << Half16<T>::MB) | (neg ? 0x8000u : 0u);
}

// A 16-bit pattern in both halves of a register.
__host__ __device__ constexpr uint32_t splat(uint32_t h) { return h | (h << 16); }

// Both halves of T(s) (bits of one T) as a pair register.
__device__ __forceinline__ uint32_t splat_bits(uint16_t h) { return splat(uint32_t(h)); }

template <typename T>
__device__ __forceinline__ uint16_t bits16(T v) {
  return *reinterpret_cast<uint16_t*>(&v);
}

// x holds 2^MB + q * 2^s in each half: the exact integers q (one HSUB2 or one HFMA2).
template <typename T>
__device__ __forceinline__ uint32_t unmagic(uint32_t x, int s) {
  constexpr int MB = Half16<T>::MB;
  if (s == 0) {
    return h2_sub<T>(x, splat(pow2_bits<T>(MB)));
  }
  return h2_fma<T>(x, splat(pow2_bits<T>(-s)), splat(pow2_bits<T>(MB - s, true)));
}

// The 32 / BITS fields of word w (BITS 2 or 4) as exact-integer pairs in stream order:
// q[i] = (field 2i, field 2i + 1).
template <typename T, int BITS>
__device__ __forceinline__ void word_pairs(uint32_t w, uint32_t (&q)[16 / BITS]) {
  static_assert(BITS == 2 || BITS == 4, "word_pairs takes 2- or 4-bit fields");
  constexpr int MB = Half16<T>::MB;
  constexpr int H = 16 / BITS;  // fields per 16-bit half
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr uint32_t MAGIC = splat(pow2_bits<T>(MB));
  uint32_t r[H];  // r[p] = (field p, field p + H)
#pragma unroll
  for (int p = 0; p < H; ++p) {
    const int off = p * BITS;  // bit of field p in its half
    const int s = off % 8 + BITS <= MB ? off % 8 : 0;
    const uint32_t src = w >> (off - s);  // byte-granular shifts: shared by the fields of a byte
    r[p] = unmagic<T>(lop3_and_or(src, (MASK << s) * 0x10001u, MAGIC), s);
  }
#pragma unroll
  for (int j = 0; j < H / 2; ++j) {
    q[j] = __byte_perm(r[2 * j], r[2 * j + 1], 0x5410);          // low halves
    q[H / 2 + j] = __byte_perm(r[2 * j], r[2 * j + 1], 0x7632);  // high halves
  }
}

// Fields 2i, 2i + 1 of an 8-bit word as an exact-integer pair (i = 0, 1).
template <typename T>
__device__ __forceinline__ uint32_t byte_pair(uint32_t w, int i) {
  if constexpr (Half16<T>::MB >= 8) {
    constexpr uint32_t M = 0x64646464u;  // fp16 1024 = 0x6400 in every byte pair
    return h2_sub<T>(__byte_perm(w, M, i == 0 ? 0x4140 : 0x4342), splat(pow2_bits<T>(10)));
  } else {
    const float magic = 8388608.0f;  // 2^23: 0x4B0000qq is 2^23 + q
    const float lo = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7540 + 2 * i)) - magic;
    const float hi = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7541 + 2 * i)) - magic;
    return pack2<T>(lo, hi);  // exact: integers up to 255
  }
}

// The stream's bits from `bit` on (bits before the start read as 0), valid at least up to
// bit + 32 - lead: one shift when bits [bit + lead, bit + lead + BITS) sit in one word (the
// next word is then never read, so a run's last word may end the array), else one funnel
// shift. `bit` is a compile-time value after unrolling.
template <int BITS>
__device__ __forceinline__ uint32_t window(const uint32_t* w, int bit, int lead = 0) {
  if (bit < 0) return w[0] << (-bit);
  const int wi = bit / 32;
  const int off = bit % 32;
  if (off == 0) return w[wi];
  if (off + lead + BITS <= 32) return w[wi] >> off;
  return __funnelshift_r(w[wi], w[wi + 1], off);
}

// Fields idx and idx + 1 of a BITS-bit stream in w as an exact-integer pair: the even field
// shifted to bit 0 and the odd one to bit 16, masked and or-ed with the magic in two LOP3s,
// then one HSUB2.
template <typename T, int BITS>
__device__ __forceinline__ uint32_t field_pair(const uint32_t* w, int idx) {
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  constexpr uint32_t MAGIC = splat(pow2_bits<T>(Half16<T>::MB));
  const uint32_t lo = window<BITS>(w, idx * BITS);
  const uint32_t hi = window<BITS>(w, (idx + 1) * BITS - 16, 16);
  return h2_sub<T>(lop3_and_or(lo, MASK, lop3_and_or(hi, MASK << 16, MAGIC)), MAGIC);
}

// T2(s * q + b) of an exact-integer pair q2, s2 / b2 the scale / bias in both halves.
template <typename T, bool FUSED>
__device__ __forceinline__ uint32_t affine_pair(uint32_t q2, uint32_t s2, uint32_t b2) {
  if constexpr (FUSED) {
    return h2_fma<T>(s2, q2, b2);
  } else {
    return h2_add_rn<T>(h2_mul_rn<T>(s2, q2), b2);
  }
}

// Values 8c .. 8c + 7 of a run of BITS-bit fields that starts at bit 0 of w[0] (w: registers,
// c a compile-time index after unrolling), as four T pairs T(s * q + b) in stream order.
// Reads words 2c and 2c + 1 (8-bit), word c (4-bit), word c / 2 (2-bit), or the words holding
// bits [8 c BITS, 8 (c + 1) BITS) (3, 5, 6-bit).
template <typename T, int BITS, bool FUSED = true>
__device__ __forceinline__ void chunk8(const uint32_t* w, int c, uint32_t s2, uint32_t b2,
                                       uint32_t (&out)[4]) {
  static_assert(BITS >= 2 && BITS <= 8 && BITS != 7, "MLX affine bits: 2, 3, 4, 5, 6, 8");
  uint32_t q[4];
  if constexpr (BITS == 8) {
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = byte_pair<T>(w[2 * c + i / 2], i % 2);
  } else if constexpr (BITS == 4) {
    word_pairs<T, 4>(w[c], q);
  } else if constexpr (BITS == 2) {
    uint32_t all[8];
    word_pairs<T, 2>(w[c / 2], all);
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = all[(c % 2) * 4 + i];
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = field_pair<T, BITS>(w, 8 * c + 2 * i);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) out[i] = affine_pair<T, FUSED>(q[i], s2, b2);
}

// float32 output (the dequantize brick): values 4c .. 4c + 3 as float s * q + b, q made exact
// with the float32 magic 2^23 (one LOP3 or PRMT and one FADD per value), then one FFMA (FUSED)
// or a rounded multiply and add.
template <int BITS, bool FUSED = true>
__device__ __forceinline__ void chunk4_f32(const uint32_t* w, int c, float s, float b,
                                           float (&out)[4]) {
  const float magic = 8388608.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    uint32_t bitsf;
    if constexpr (BITS == 8) {
      bitsf = __byte_perm(w[c], 0x4B000000u, 0x7540 + i);
    } else {
      bitsf = lop3_and_or(window<BITS>(w, (4 * c + i) * BITS), (1u << BITS) - 1u, 0x4B000000u);
    }
    const float q = __uint_as_float(bitsf) - magic;
    out[i] = FUSED ? fmaf(s, q, b) : __fadd_rn(__fmul_rn(s, q), b);
  }
}

// ---------------------------------------------------------------------------------------------
// The dequantize brick (dequantize.cu): one thread per run of UNIT values of one row
// ---------------------------------------------------------------------------------------------

// Two T of a pair register (computed in T) stored as two O at dst (O = T: the bits as they are;
// else each converted from T through float, rounded to nearest even: MLX's astype).
template <typename T, typename O>
__device__ __forceinline__ void store_pairs(const uint32_t (&p)[4], O* dst) {
  if constexpr (Same<T, O>::value) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(p[0], p[1], p[2], p[3]);
  } else if constexpr (sizeof(O) == 4) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float2 a = unpack2<T>(p[2 * i]);
      const float2 b = unpack2<T>(p[2 * i + 1]);
      *reinterpret_cast<float4*>(dst + 4 * i) = make_float4(a.x, a.y, b.x, b.y);
    }
  } else {
    uint32_t o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 a = unpack2<T>(p[i]);
      o[i] = pack2<O>(a.x, a.y);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

template <typename O>
__device__ __forceinline__ void store_floats(const float (&v)[4], O* dst) {
  if constexpr (sizeof(O) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack2<O>(v[0], v[1]), pack2<O>(v[2], v[3]));
  }
}

// Values k0 .. k0 + UNIT - 1 of one row: w the row's first word of the run, s_row / b_row the
// row's scales and biases (T), out the output row at k0. UNIT = 128 (K % 128 == 0: BITS
// 16-byte loads) or 32 (BITS words; 16-byte loads for 4- and 8-bit). vec16: the words may be
// read 16 bytes at a time (the run's first word is 16-byte aligned).
template <typename T, typename O, int BITS, int GS, bool FUSED, int UNIT>
__device__ __forceinline__ void dequantize_run(const uint32_t* w, const T* s_row, const T* b_row,
                                               O* out, int k0, bool vec16) {
  constexpr int UW = UNIT * BITS / 32;  // words of the run
  static_assert(UNIT % 32 == 0 && GS % 32 == 0, "runs are whole 32-value segments of a group");
  uint32_t words[UW];
  if (UW % 4 == 0 && vec16) {
#pragma unroll
    for (int i = 0; i < UW; i += 4) {
      const uint4 v = *reinterpret_cast<const uint4*>(w + i);
      words[i] = v.x;
      words[i + 1] = v.y;
      words[i + 2] = v.z;
      words[i + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int i = 0; i < UW; ++i) words[i] = w[i];
  }
#pragma unroll
  for (int j = 0; j < UNIT / 32; ++j) {  // 32-value segments, one (scale, bias) each
    const int g = (k0 + 32 * j) / GS;
    const uint32_t* seg = words + j * BITS;
    if constexpr (sizeof(T) == 2) {
      const uint32_t s2 = splat_bits(bits16(s_row[g]));
      const uint32_t b2 = splat_bits(bits16(b_row[g]));
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        uint32_t p[4];
        chunk8<T, BITS, FUSED>(seg, c, s2, b2, p);
        store_pairs<T>(p, out + 32 * j + 8 * c);
      }
    } else {
      const float sf = s_row[g];
      const float bf = b_row[g];
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        float v[4];
        chunk4_f32<BITS, FUSED>(seg, c, sf, bf, v);
        store_floats(v, out + 32 * j + 4 * c);
      }
    }
  }
}

}  // namespace dq
}  // namespace bricks

#endif  // MLX_BRICKS_DEQUANT_CUH
