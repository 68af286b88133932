// dequantize.h -- the dequantize brick: MLX affine weights (mx.quantize; 2, 3, 4, 5, 6, 8 bits,
// group_size 32, 64, 128) to their float values, bit-exact against mx.dequantize.
//
// The packed weight w (N, K * BITS / 32) is row-contiguous and K is a multiple of GROUP_SIZE, so
// the whole matrix is one little-endian bit stream: flat value v = n * K + k sits at bits
// [v BITS, (v + 1) BITS) and belongs to group v / GROUP_SIZE of the flattened scales and biases.
// A thread dequantizes one run of Run<BITS>::VALUES consecutive values (a whole number of
// 128-bit words of w, a multiple of 32 values), in chunks of 32 values (BITS words, one group).
//
// Conversion (no integer-to-float instruction): the codes of a pair of values are placed in the
// two low mantissas of 0x64006400 (the half pair 1024 + q: exact for q < 1024) and 1024 is
// subtracted, giving q exactly as a half2. For 2, 4 and 8 bits one AND with a doubled mask takes
// both codes of a pair straight from one word (values j and j + 16 / BITS of the word: the
// exponent magic per pair, then ORed in); the results are written back in order through
// registers. For 3, 5 and 6 bits a value may straddle two words: each code is taken with a
// shift, an OR of the next word's low bits where it straddles (decided at compile time: the
// positions are constants once the loops are unrolled) and a mask, and two consecutive codes
// are joined into one pair word for the same magic.
//
// Rounding, as mx.dequantize computes it in the scales' dtype T (measured on MLX 0.32.4's CPU):
// FUSED = false: T(T(s q) + b), a multiply and an add, each rounded to T; FUSED = true:
// T(s q + b) rounded once (an fma). half: half2 multiply and add (IEEE, one rounding each);
// bfloat: float arithmetic with each result converted to bfloat (s q is exact in float, and a
// float sum rounded to bfloat equals the bfloat sum: 24 >= 2 * 8 + 2 bits); float: a float
// multiply and a float add. The multiply and the add are separate statements: MLX builds its
// Metal kernels with fast math off, under which the compiler contracts a * b + c into an fma
// only within one expression. The result is then converted to the output dtype O.

#ifndef MLX_BRICKS_DEQUANTIZE_H
#define MLX_BRICKS_DEQUANTIZE_H

#include <metal_stdlib>

using namespace metal;

#define BRICKS_DQ_UNROLL _Pragma("clang loop unroll(full)")

namespace bricks_dq {

// Values and words of w per thread: whole 128-bit words (4 uints) and a multiple of 32 values.
template <short BITS>
struct Run {
  static constant constexpr short VALUES = (BITS == 3 || BITS == 5) ? 128
                                           : (BITS == 2 || BITS == 6) ? 64 : 32;
  static constant constexpr short WORDS = VALUES * BITS / 32;  // 4, 12, 4, 20, 12, 8
  static constant constexpr short CHUNKS = VALUES / 32;
};

// N packed words of w, read as one struct with the alignment of a uint only: MLX binds a view
// of the uint32 buffer at its byte offset, so a run may start at any word, and promising 16
// bytes would be undefined behaviour (gemm.h's PackedUnits makes the same choice).
template <short N>
struct alignas(4) Words {
  uint u[N];
};

// 16 bytes of the output, stored as one struct: the output buffer is the kernel's own and every
// chunk starts at a multiple of 32 values, so the stores are 16-byte aligned.
template <typename O>
struct alignas(16) Out16 {
  O v[16 / sizeof(O)];
};

// The run at p: one struct load from device memory; element by element elsewhere (MLX passes
// inputs of fewer than 8 elements in the constant address space).
template <short N, typename P>
inline void load_words(thread Words<N>& r, P p) {
  BRICKS_DQ_UNROLL
  for (short i = 0; i < N; ++i) r.u[i] = p[i];
}
template <short N>
inline void load_words(thread Words<N>& r, const device uint* p) {
  const device Words<N>* s = reinterpret_cast<const device Words<N>*>(p);
  BRICKS_DQ_UNROLL
  for (short i = 0; i < N; ++i) r.u[i] = s->u[i];
}

// Code j of the chunk whose BITS words start at word w0 of r (j, w0 compile-time constants).
template <short BITS, short N>
inline uint code_at(thread const Words<N>& r, short w0, short j) {
  const short p = j * BITS;
  const short i = w0 + p / 32;
  const short s = p % 32;
  uint q = r.u[i] >> s;
  if (s + BITS > 32) q |= r.u[i + 1] << (32 - s);
  return q & ((1u << BITS) - 1u);
}

// Pair p (0..15) of a chunk: the chunk indices of its two values and their codes in the low
// bits of each 16-bit half of one word.
template <short BITS>
inline short pair_lo(short p) {
  if (32 % BITS == 0) return (p / (16 / BITS)) * (32 / BITS) + p % (16 / BITS);
  return 2 * p;
}
template <short BITS>
inline short pair_hi(short p) {
  if (32 % BITS == 0) return pair_lo<BITS>(p) + 16 / BITS;
  return 2 * p + 1;
}
template <short BITS, short N>
inline uint pair_codes(thread const Words<N>& r, short w0, short p) {
  if (32 % BITS == 0) {  // 2, 4, 8 bits: values j and j + 16 / BITS of one word
    const uint mask = ((1u << BITS) - 1u) * 0x00010001u;
    return (r.u[w0 + p / (16 / BITS)] >> (BITS * (p % (16 / BITS)))) & mask;
  }
  return code_at<BITS>(r, w0, short(2 * p)) | (code_at<BITS>(r, w0, short(2 * p + 1)) << 16);
}

// Both codes of a pair as exact halves: the exponent magic 1024 (0x6400) and one subtraction.
inline half2 pair_values(uint codes) {
  return as_type<half2>(codes | 0x64006400u) - half2(half(1024.0f));
}

// scale * q + bias for a pair, in T with mx.dequantize's rounding (header comment).
template <typename T, bool FUSED>
struct Affine {
  static vec<T, 2> apply(half2 q, T s, T b) {
    const float2 qf = float2(q);
    if (FUSED) return vec<T, 2>(fma(float2(float(s)), qf, float2(float(b))));
    const vec<T, 2> p = vec<T, 2>(float(s) * qf);  // T(s q): exact in float, one rounding
    return vec<T, 2>(float2(p) + float(b));        // T(p + b): the second rounding
  }
};
template <bool FUSED>
struct Affine<half, FUSED> {
  static half2 apply(half2 q, half s, half b) {
    if (FUSED) return fma(half2(s), q, half2(b));
    const half2 p = half2(s) * q;
    return p + half2(b);
  }
};

// One chunk of 32 values (the BITS words at w0 of r, one group's scale s and bias b) to out.
template <typename T, typename O, short BITS, bool FUSED, short N>
inline void dequantize_chunk(thread const Words<N>& r, short w0, T s, T b, device O* out) {
  O v[32];
  BRICKS_DQ_UNROLL
  for (short p = 0; p < 16; ++p) {
    const vec<T, 2> x = Affine<T, FUSED>::apply(pair_values(pair_codes<BITS>(r, w0, p)), s, b);
    v[pair_lo<BITS>(p)] = O(x.x);
    v[pair_hi<BITS>(p)] = O(x.y);
  }
  constexpr short E = 16 / sizeof(O);
  device Out16<O>* o = reinterpret_cast<device Out16<O>*>(out);
  BRICKS_DQ_UNROLL
  for (short i = 0; i < 32 / E; ++i) {
    BRICKS_DQ_UNROLL
    for (short e = 0; e < E; ++e) o[i].v[e] = v[i * E + e];
  }
}

// The run of values [base, base + Run<BITS>::VALUES) of the flat stream of `total` values
// (base a multiple of the run, total a multiple of 32): a full run is one struct load of its
// words; the stream's last run may be short and goes chunk by chunk with word loads.
template <typename T, typename O, short BITS, short GROUP_SIZE, bool FUSED, typename WP,
          typename SP, typename BP>
inline void dequantize_run(WP w, SP scales, BP biases, device O* out, ulong base, ulong total) {
  typedef Run<BITS> R;
  if (base + R::VALUES <= total) {
    Words<R::WORDS> r;
    load_words(r, w + base / 32 * BITS);
    BRICKS_DQ_UNROLL
    for (short c = 0; c < R::CHUNKS; ++c) {
      const ulong g = (base + 32 * c) / GROUP_SIZE;
      dequantize_chunk<T, O, BITS, FUSED>(r, short(c * BITS), T(scales[g]), T(biases[g]),
                                          out + base + 32 * c);
    }
    return;
  }
  for (ulong v = base; v < total; v += 32) {
    Words<BITS> r;
    load_words(r, w + v / 32 * BITS);
    dequantize_chunk<T, O, BITS, FUSED>(r, 0, T(scales[v / GROUP_SIZE]),
                                        T(biases[v / GROUP_SIZE]), out + v);
  }
}

}  // namespace bricks_dq

#endif  // MLX_BRICKS_DEQUANTIZE_H
