// mlx_bricks MSL emulator: the subset of the Metal Shading Language standard library (and of
// the helpers MLX prepends to custom kernels) that the emulator supports, as C++ for clang.
// Over 600 lines on purpose: it stands for <metal_stdlib>, one header every kernel includes,
// compiled once into a precompiled header per toolchain.
//
// Compiled once per kernel, with device/constant/threadgroup as distinct clang address spaces
// (`thread` is the default one): address-space mistakes fail as they do on Metal, overloads and
// specialisations on the address space stay distinct, and x86-64 code generation treats the
// three as ordinary memory. EMU_FLAT (checks off) makes the keywords vanish instead.
// Anything not declared here is a compile error naming it ("use of undeclared identifier").
#pragma once
// Guard too: a PCH built from another checkout's copy has another path.
#ifndef MLX_BRICKS_EMU_METAL_SHIM_H
#define MLX_BRICKS_EMU_METAL_SHIM_H
#include <stdint.h>

#include "emu_abi.h"

#ifndef EMU_FLAT
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#else
#define device
#define constant
#define threadgroup
#endif
#define thread
#define METAL_FUNC inline __attribute__((always_inline))
#define EMU_INLINE inline __attribute__((always_inline))
// Call sites of collectives: line and column in the kernel source (see #line in the TU).
#define EMU_SITE uint32_t emu_site = (__builtin_LINE() << 12) | (__builtin_COLUMN() & 0xFFF)

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef _Float16 half;
typedef __bf16 bfloat;

namespace metal {

template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));

#define EMU_VEC_TYPES(T)                                          \
  typedef T T##2 __attribute__((ext_vector_type(2)));             \
  typedef T T##3 __attribute__((ext_vector_type(3)));             \
  typedef T T##4 __attribute__((ext_vector_type(4)));             \
  typedef T packed_##T##2 __attribute__((ext_vector_type(2), aligned(sizeof(T)))); \
  typedef T packed_##T##4 __attribute__((ext_vector_type(4), aligned(sizeof(T))));
EMU_VEC_TYPES(char)
EMU_VEC_TYPES(uchar)
EMU_VEC_TYPES(short)
EMU_VEC_TYPES(ushort)
EMU_VEC_TYPES(int)
EMU_VEC_TYPES(uint)
EMU_VEC_TYPES(long)
EMU_VEC_TYPES(ulong)
EMU_VEC_TYPES(half)
EMU_VEC_TYPES(float)
EMU_VEC_TYPES(bfloat)
#undef EMU_VEC_TYPES
typedef bool bool2 __attribute__((ext_vector_type(2)));
typedef bool bool3 __attribute__((ext_vector_type(3)));
typedef bool bool4 __attribute__((ext_vector_type(4)));

}  // namespace metal
// MLX's prepended utilities (bf16.h) say `using namespace metal;` before any kernel text.
using namespace metal;

// ---------------------------------------------------------------------------------------------
// Type machinery (no standard library: keeps compiles fast and names unambiguous)
namespace emu {
template <class T> struct vinfo { typedef T elem; static constexpr int n = 1; };
template <class T, int N> struct vinfo<T __attribute__((ext_vector_type(N)))> {
  typedef T elem; static constexpr int n = N;
};
template <class T> struct unref { typedef T type; };
template <class T> struct unref<T&> { typedef T type; };
template <class T> struct unref<T&&> { typedef T type; };
template <class T> struct uncv { typedef T type; };
template <class T> struct uncv<const T> { typedef T type; };
template <class T> struct uncv<volatile T> { typedef T type; };
template <class T> struct uncv<const volatile T> { typedef T type; };
// unas<T>: T without its address space (const stays).
template <class T> struct unas { typedef T type; };
#ifndef EMU_FLAT
template <class T> struct unas<device T> { typedef T type; };
template <class T> struct unas<constant T> { typedef T type; };
template <class T> struct unas<threadgroup T> { typedef T type; };
#endif
template <class T>
using plain = typename uncv<typename unas<typename unref<T>::type>::type>::type;
template <class T> constexpr bool is_vec = vinfo<plain<T>>::n > 1;
template <class T> using elem_t = typename vinfo<plain<T>>::elem;
template <bool B> struct enable_if {};
template <> struct enable_if<true> { typedef int type; };
template <class A, class B> constexpr bool same = false;
template <class A> constexpr bool same<A, A> = true;
template <class T> constexpr bool is_float = same<T, float> || same<T, half> || same<T, bfloat>;

template <class A> constexpr EMU_INLINE const A& only(const A& a) { return a; }
// Scalar conversions between the float types (clang has no direct __bf16 <-> _Float16 cast).
template <class To, class From> constexpr EMU_INLINE To conv(const From& x) {
  if constexpr (is_float<To> && is_float<plain<From>> && !same<To, plain<From>>) {
    return static_cast<To>(static_cast<float>(x));
  } else {
    return static_cast<To>(x);
  }
}

// Vectors from element arrays (constant evaluation cannot assign vector elements).
template <class T, T... I> struct iseq {};
template <class V, class E, int N, int... I>
constexpr EMU_INLINE V to_vec(const E (&e)[N], iseq<int, I...>) {
  return V{e[I]...};
}

// Vector conversion component by component (MSL float4(half4), static_cast<half4>(float4)).
template <class V, class A> constexpr EMU_INLINE V vconv(const A& a) {
  typedef elem_t<V> E;
  typedef elem_t<A> F;
  if constexpr (same<E, F>) {
    return a;
  } else if constexpr (is_float<E> && is_float<F> && !same<E, float> && !same<F, float>) {
    // half <-> bfloat through float (exact, then one rounding)
    typedef vec<float, vinfo<V>::n> VF;
    return __builtin_convertvector(__builtin_convertvector(static_cast<plain<A>>(a), VF), V);
  } else {
    return __builtin_convertvector(static_cast<plain<A>>(a), V);
  }
}

template <int I = 0, class E, int N, class A, class... R>
constexpr EMU_INLINE void fill(E (&e)[N], const A& a, const R&... r) {
  if constexpr (is_vec<A>) {
    for (int k = 0; k < vinfo<plain<A>>::n; ++k) e[I + k] = conv<E>(static_cast<elem_t<A>>(a[k]));
  } else {
    e[I] = conv<E>(a);
  }
  if constexpr (sizeof...(R) > 0) fill<I + vinfo<plain<A>>::n>(e, r...);
}
template <class... A> constexpr int count_elems() { return (0 + ... + vinfo<plain<A>>::n); }

// What `V(a...)` means in MSL for any type V (the rewriter sends every functional cast whose
// type it cannot rule out as a vector here: MSL vector names, vec<T, N>, typedef/using
// aliases, template type parameters, decltype(...)):
//  * V a vector: MSL's constructors: float4(x) splat, float4(half4) conversion (component by
//    component, never a bit cast), float4(a.xy, b, c);
//  * V a scalar float type: the conversion (also half <-> bfloat, which clang lacks);
//  * anything else: V(a...) itself.
// Vectors and scalars take their arguments by value (swizzles are address-space-qualified
// temporaries), classes by const reference (no non-const reference binds to a vector element,
// so a constructor taking `thread X&` through an alias or template parameter does not compile),
// references (`decltype(a[i])(x)`) the object itself.
template <class V> constexpr bool by_value = !__is_class(V) && !__is_reference(V);
template <class V, class... A, typename enable_if<by_value<V>>::type = 0>
constexpr EMU_INLINE V mk(A... a) {
  if constexpr (is_vec<V>) {
    typedef plain<V> PV;
    typedef elem_t<PV> E;
    constexpr int N = vinfo<PV>::n;
    if constexpr (sizeof...(A) == 0) {
      return PV(static_cast<E>(0));
    } else if constexpr (sizeof...(A) == 1 && count_elems<A...>() == 1) {
      return PV(conv<E>(a...));
    } else if constexpr (sizeof...(A) == 1 && count_elems<A...>() == N) {
      return vconv<PV>(a...);
    } else {
      static_assert(count_elems<A...>() == N,
                    "MSL vector constructor: wrong number of components");
      E e[N] = {};
      fill(e, a...);
      return to_vec<PV>(e, __make_integer_seq<iseq, int, N>{});
    }
  } else if constexpr (sizeof...(A) == 1 && is_float<plain<V>> && (is_float<plain<A>> && ...)) {
    return conv<plain<V>>(a...);
  } else {
    return V(a...);
  }
}
template <class V, class... A, typename enable_if<__is_class(V)>::type = 0>
constexpr EMU_INLINE V mk(const A&... a) {
  return V(a...);
}
template <class V, class A, typename enable_if<__is_reference(V)>::type = 0>
constexpr EMU_INLINE V mk(A&& a) {
  return V(static_cast<A&&>(a));
}

// static_cast<T>(x), with MSL's vector conversions (clang alone would reinterpret the bits).
template <class To, class From>
constexpr EMU_INLINE To scast(From&& x) {
  if constexpr (is_vec<To> && is_vec<From>) {
    return vconv<To>(x);
  } else if constexpr (is_vec<To>) {
    return To(conv<elem_t<To>>(x));
  } else if constexpr (is_float<plain<To>> && is_float<plain<From>>) {
    return conv<plain<To>>(x);
  } else {
    return static_cast<To>(static_cast<From&&>(x));
  }
}

// (float4)x: the rewriter turns C-style casts to the same types as mk's into
// `emu::cvt<float4>() ->* x`.
template <class V> struct cvt {};
template <class V, class A, typename enable_if<by_value<V>>::type = 0>
constexpr EMU_INLINE V operator->*(cvt<V>, A a) {
  return mk<V>(a);
}
template <class V, class A, typename enable_if<__is_class(V)>::type = 0>
constexpr EMU_INLINE V operator->*(cvt<V>, const A& a) {
  return V(a);
}
template <class V, class A, typename enable_if<__is_reference(V)>::type = 0>
constexpr EMU_INLINE V operator->*(cvt<V>, A&& a) {
  return V(static_cast<A&&>(a));
}

template <class T> EMU_INLINE T load(const void* p) { T v; __builtin_memcpy(&v, p, sizeof(T)); return v; }
template <class T> EMU_INLINE void store(void* p, const T& v) { __builtin_memcpy(p, &v, sizeof(T)); }

// as_plain(x): the same object, seen in the default (thread) address space. MSL copies a struct
// between address spaces with its implicit copy constructor / assignment (MLX steel's
// BlockLoader: `*(threadgroup RV*)dst = *(const device RV*)src;`); clang's implicit members only
// take generic-address-space objects, so compile.py wraps the operands of such copies in
// as_plain when clang refuses them (see _copy_patches there).
template <class T> EMU_INLINE typename unas<T>::type& as_plain(T& x) {
  return *(typename unas<T>::type*)__builtin_addressof(x);
}
template <class T> EMU_INLINE T&& as_plain(T&& x) { return static_cast<T&&>(x); }
}  // namespace emu

// ---------------------------------------------------------------------------------------------
// Math
namespace metal {

template <class T, class U>
EMU_INLINE T as_type(const U& x) {
  static_assert(sizeof(T) == sizeof(U), "as_type: source and destination sizes differ");
  return __builtin_bit_cast(T, x);
}

#define EMU_F1(name, expr)                                                                  \
  EMU_INLINE float name(float x) { return expr; }                                           \
  EMU_INLINE half name(half x) { return static_cast<half>(name(static_cast<float>(x))); }   \
  EMU_INLINE bfloat name(bfloat x) { return static_cast<bfloat>(name(static_cast<float>(x))); } \
  template <class T, int N>                                                                 \
  EMU_INLINE vec<T, N> name(vec<T, N> v) {                                                  \
    vec<T, N> r;                                                                            \
    for (int i = 0; i < N; ++i) r[i] = name(static_cast<T>(v[i]));                          \
    return r;                                                                               \
  }
EMU_F1(exp, __builtin_expf(x))
EMU_F1(exp2, __builtin_exp2f(x))
EMU_F1(exp10, __builtin_powf(10.0f, x))
EMU_F1(log, __builtin_logf(x))
EMU_F1(log2, __builtin_log2f(x))
EMU_F1(log10, __builtin_log10f(x))
EMU_F1(log1p, __builtin_log1pf(x))
EMU_F1(sqrt, __builtin_sqrtf(x))
EMU_F1(rsqrt, 1.0f / __builtin_sqrtf(x))
EMU_F1(fabs, __builtin_fabsf(x))
EMU_F1(floor, __builtin_floorf(x))
EMU_F1(ceil, __builtin_ceilf(x))
EMU_F1(round, __builtin_roundf(x))
EMU_F1(rint, __builtin_rintf(x))
EMU_F1(trunc, __builtin_truncf(x))
EMU_F1(fract, x - __builtin_floorf(x))
EMU_F1(sin, __builtin_sinf(x))
EMU_F1(cos, __builtin_cosf(x))
EMU_F1(tan, __builtin_tanf(x))
EMU_F1(tanh, __builtin_tanhf(x))
EMU_F1(sinh, __builtin_sinhf(x))
EMU_F1(cosh, __builtin_coshf(x))
EMU_F1(asin, __builtin_asinf(x))
EMU_F1(acos, __builtin_acosf(x))
EMU_F1(atan, __builtin_atanf(x))
EMU_F1(erf, __builtin_erff(x))
EMU_F1(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
EMU_F1(sign, x > 0.0f ? 1.0f : x < 0.0f ? -1.0f : 0.0f)

#define EMU_F2(name, expr)                                                                     \
  EMU_INLINE float name(float x, float y) { return expr; }                                     \
  EMU_INLINE half name(half x, half y) {                                                       \
    return static_cast<half>(name(static_cast<float>(x), static_cast<float>(y)));              \
  }                                                                                            \
  EMU_INLINE bfloat name(bfloat x, bfloat y) {                                                 \
    return static_cast<bfloat>(name(static_cast<float>(x), static_cast<float>(y)));            \
  }                                                                                            \
  template <class T, int N>                                                                    \
  EMU_INLINE vec<T, N> name(vec<T, N> a, vec<T, N> b) {                                        \
    vec<T, N> r;                                                                               \
    for (int i = 0; i < N; ++i) r[i] = name(static_cast<T>(a[i]), static_cast<T>(b[i]));      \
    return r;                                                                                  \
  }                                                                                            \
  template <class T, int N>                                                                    \
  EMU_INLINE vec<T, N> name(vec<T, N> a, T b) { return name(a, vec<T, N>(b)); }
EMU_F2(pow, __builtin_powf(x, y))
EMU_F2(powr, __builtin_powf(x, y))
EMU_F2(fmax, __builtin_fmaxf(x, y))
EMU_F2(fmin, __builtin_fminf(x, y))
EMU_F2(fmod, __builtin_fmodf(x, y))
EMU_F2(copysign, __builtin_copysignf(x, y))
EMU_F2(atan2, __builtin_atan2f(x, y))
EMU_F2(step, y < x ? 0.0f : 1.0f)
EMU_F2(divide, x / y)

EMU_INLINE float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
EMU_INLINE half fma(half a, half b, half c) {
  return static_cast<half>(__builtin_fmaf(a, b, c));
}
EMU_INLINE bfloat fma(bfloat a, bfloat b, bfloat c) {
  return static_cast<bfloat>(__builtin_fmaf(a, b, c));
}
template <class T, int N>
EMU_INLINE vec<T, N> fma(vec<T, N> a, vec<T, N> b, vec<T, N> c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(static_cast<T>(a[i]), static_cast<T>(b[i]), static_cast<T>(c[i]));
  return r;
}
template <class T> EMU_INLINE T mix(T x, T y, T a) { return x + (y - x) * a; }
template <class T, int N> EMU_INLINE vec<T, N> mix(vec<T, N> x, vec<T, N> y, T a) { return x + (y - x) * a; }

// max / min / clamp / abs: float ones follow fmax/fmin (a NaN operand is ignored).
#define EMU_MINMAX_F(T)                                                                 \
  EMU_INLINE T max(T a, T b) { return static_cast<T>(__builtin_fmaxf(a, b)); }          \
  EMU_INLINE T min(T a, T b) { return static_cast<T>(__builtin_fminf(a, b)); }          \
  EMU_INLINE T abs(T a) { return static_cast<T>(__builtin_fabsf(a)); }                  \
  EMU_INLINE T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
EMU_MINMAX_F(float)
EMU_MINMAX_F(half)
EMU_MINMAX_F(bfloat)
#define EMU_MINMAX_I(T)                                                                 \
  EMU_INLINE T max(T a, T b) { return a > b ? a : b; }                                  \
  EMU_INLINE T min(T a, T b) { return a < b ? a : b; }                                  \
  EMU_INLINE T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
EMU_MINMAX_I(char)
EMU_MINMAX_I(uchar)
EMU_MINMAX_I(short)
EMU_MINMAX_I(ushort)
EMU_MINMAX_I(int)
EMU_MINMAX_I(uint)
EMU_MINMAX_I(long)
EMU_MINMAX_I(ulong)
EMU_MINMAX_I(signed char)
EMU_INLINE char abs(char a) { return a < 0 ? -a : a; }
EMU_INLINE short abs(short a) { return a < 0 ? -a : a; }
EMU_INLINE int abs(int a) { return a < 0 ? -a : a; }
EMU_INLINE long abs(long a) { return a < 0 ? -a : a; }
EMU_INLINE uint abs(uint a) { return a; }
template <class T, int N>
EMU_INLINE vec<T, N> max(vec<T, N> a, vec<T, N> b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = max(static_cast<T>(a[i]), static_cast<T>(b[i]));
  return r;
}
template <class T, int N>
EMU_INLINE vec<T, N> min(vec<T, N> a, vec<T, N> b) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = min(static_cast<T>(a[i]), static_cast<T>(b[i]));
  return r;
}
template <class T, int N> EMU_INLINE vec<T, N> max(vec<T, N> a, T b) { return max(a, vec<T, N>(b)); }
template <class T, int N> EMU_INLINE vec<T, N> min(vec<T, N> a, T b) { return min(a, vec<T, N>(b)); }
template <class T, int N>
EMU_INLINE vec<T, N> abs(vec<T, N> a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(static_cast<T>(a[i]));
  return r;
}
template <class T, int N>
EMU_INLINE vec<T, N> clamp(vec<T, N> x, vec<T, N> lo, vec<T, N> hi) { return min(max(x, lo), hi); }
template <class T, int N>
EMU_INLINE vec<T, N> clamp(vec<T, N> x, T lo, T hi) { return min(max(x, lo), hi); }

template <class T> EMU_INLINE bool isnan(T x) { return __builtin_isnan(static_cast<float>(x)); }
template <class T> EMU_INLINE bool isinf(T x) { return __builtin_isinf(static_cast<float>(x)); }
template <class T> EMU_INLINE bool isfinite(T x) { return __builtin_isfinite(static_cast<float>(x)); }
template <class T> EMU_INLINE bool signbit(T x) { return __builtin_signbit(static_cast<float>(x)); }

template <class T, int N>
EMU_INLINE T dot(vec<T, N> a, vec<T, N> b) {
  T s = 0;
  for (int i = 0; i < N; ++i) s += a[i] * b[i];
  return s;
}
template <class V> EMU_INLINE bool all(V v) {
  if constexpr (emu::is_vec<V>) {
    for (int i = 0; i < emu::vinfo<V>::n; ++i) if (!v[i]) return false;
    return true;
  } else {
    return static_cast<bool>(v);
  }
}
template <class V> EMU_INLINE bool any(V v) {
  if constexpr (emu::is_vec<V>) {
    for (int i = 0; i < emu::vinfo<V>::n; ++i) if (v[i]) return true;
    return false;
  } else {
    return static_cast<bool>(v);
  }
}
// select(a, b, c): c ? b : a, per component for vectors.
template <class T> EMU_INLINE T select(T a, T b, bool c) { return c ? b : a; }
template <class T, class C>
EMU_INLINE T select(T a, T b, C c) {
  static_assert(emu::is_vec<T> && emu::vinfo<C>::n == emu::vinfo<T>::n, "select: shapes differ");
  T r;
  for (int i = 0; i < emu::vinfo<T>::n; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}

EMU_INLINE uint popcount(uint x) { return __builtin_popcount(x); }
EMU_INLINE int popcount(int x) { return __builtin_popcount(x); }
EMU_INLINE ulong popcount(ulong x) { return __builtin_popcountl(x); }
EMU_INLINE uint clz(uint x) { return x ? __builtin_clz(x) : 32; }
EMU_INLINE uint ctz(uint x) { return x ? __builtin_ctz(x) : 32; }
EMU_INLINE uint mulhi(uint a, uint b) { return static_cast<uint>((static_cast<ulong>(a) * b) >> 32); }

namespace precise {
using metal::exp; using metal::exp2; using metal::exp10; using metal::log; using metal::log2;
using metal::log10; using metal::sqrt; using metal::rsqrt; using metal::fabs; using metal::floor;
using metal::ceil; using metal::round; using metal::rint; using metal::trunc; using metal::sin;
using metal::cos; using metal::tan; using metal::tanh; using metal::pow; using metal::powr;
using metal::fmax; using metal::fmin; using metal::max; using metal::min; using metal::clamp;
using metal::divide; using metal::abs; using metal::fma; using metal::saturate; using metal::fract;
using metal::copysign; using metal::sinh; using metal::cosh; using metal::atan; using metal::atan2;
using metal::asin; using metal::acos; using metal::log1p; using metal::sign;
}  // namespace precise
}  // namespace metal

// ---------------------------------------------------------------------------------------------
// Perturbed mode (MLX_BRICKS_EMULATOR_PERTURB=<seed>, see docs/emulator.md): what Metal may do
// differently within its specification. fast:: functions return values anywhere in the error
// bounds of the MSL specification's fast-math table (3.1, section 7.4; the functions it
// describes as "implemented as" a formula are computed by that formula); emu_perturb_seed is
// the launch's seed (0: off). The choice of error depends only on the seed, the function and
// the argument bits, so both schedules of a launch see the same values.
extern "C" uint32_t emu_perturb_seed;
namespace emu_fast {
EMU_INLINE uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// An integer in [-k, k]: -k or k half the time (the bound's edges stress tolerances most),
// otherwise anything in between.
EMU_INLINE int64_t pick(uint64_t h, int64_t k) {
  switch (h & 3) {
    case 0: return k;
    case 1: return -k;
    default: return int64_t((h >> 8) % uint64_t(2 * k + 1)) - k;
  }
}
EMU_INLINE uint64_t key(float x, uint32_t fn) {
  return mix((uint64_t(emu_perturb_seed) << 40) ^ (uint64_t(fn) << 32) ^
             __builtin_bit_cast(uint32_t, x));
}
// r moved by k units in the last place, never across zero or into infinity.
EMU_INLINE float ulps(float r, int64_t k) {
  uint32_t b = __builtin_bit_cast(uint32_t, r);
  int64_t mag = b & 0x7FFFFFFFu;
  if (k == 0 || mag == 0 || mag >= 0x7F800000) return r;
  mag += k;
  mag = mag < 1 ? 1 : (mag > 0x7F7FFFFF ? 0x7F7FFFFF : mag);
  return __builtin_bit_cast(float, (b & 0x80000000u) | uint32_t(mag));
}
EMU_INLINE float within_ulps(float r, float x, uint32_t fn, float bound) {
  if (!emu_perturb_seed) return r;
  float b = bound < 1048576.0f ? bound : 1048576.0f;
  return ulps(r, pick(key(x, fn), int64_t(b)));
}
EMU_INLINE float within_abs(float r, float x, uint32_t fn, float err) {
  if (!emu_perturb_seed || !__builtin_isfinite(r)) return r;
  uint64_t h = key(x, fn);
  return r + err * float(pick(h, 1024)) / 1024.0f;
}
}  // namespace emu_fast

namespace metal {
namespace fast {
// Exact in fast math too (0 ulp or correctly rounded).
using metal::fabs; using metal::floor; using metal::ceil; using metal::round; using metal::rint;
using metal::trunc; using metal::fmax; using metal::fmin; using metal::max; using metal::min;
using metal::clamp; using metal::abs; using metal::fma; using metal::saturate; using metal::fract;
using metal::copysign; using metal::sign;

EMU_INLINE float exp_ulps(float x) { return 3.0f + __builtin_floorf(__builtin_fabsf(2 * x)); }
EMU_INLINE float exp2(float x) {  // <= 3 + floor(|2 x|) ulp
  return emu_fast::within_ulps(__builtin_exp2f(x), x, 1, exp_ulps(x));
}
EMU_INLINE float exp(float x) {   // <= 3 + floor(|2 x|) ulp
  return emu_fast::within_ulps(__builtin_expf(x), x, 2, exp_ulps(x));
}
EMU_INLINE float exp10(float x) { return fast::exp2(x * 3.32192809488736234787f); }
EMU_INLINE float log2(float x) {  // absolute 2^-22 in [0.5, 2], else 3 ulp
  const float r = __builtin_log2f(x);
  return x >= 0.5f && x <= 2.0f ? emu_fast::within_abs(r, x, 3, 0x1p-22f)
                                : emu_fast::within_ulps(r, x, 3, 3.0f);
}
EMU_INLINE float log(float x) {   // absolute 2^-21 in [0.5, 2], else 3 ulp
  const float r = __builtin_logf(x);
  return x >= 0.5f && x <= 2.0f ? emu_fast::within_abs(r, x, 4, 0x1p-21f)
                                : emu_fast::within_ulps(r, x, 4, 3.0f);
}
EMU_INLINE float log10(float x) { return fast::log2(x) * 0.30102999566398119521f; }
EMU_INLINE float log1p(float x) { return fast::log(1.0f + x); }
EMU_INLINE float powr(float x, float y) { return fast::exp2(y * fast::log2(x)); }
EMU_INLINE float pow(float x, float y) { return fast::exp2(y * fast::log2(x)); }
EMU_INLINE float rsqrt(float x) {  // <= 2 ulp
  return emu_fast::within_ulps(1.0f / __builtin_sqrtf(x), x, 5, 2.0f);
}
EMU_INLINE float sqrt(float x) {   // x * rsqrt(x), special cases exact
  if (!emu_perturb_seed || x == 0.0f || !__builtin_isfinite(x) || x < 0.0f) {
    return __builtin_sqrtf(x);
  }
  return x * fast::rsqrt(x);
}
EMU_INLINE float sin(float x) { return emu_fast::within_abs(__builtin_sinf(x), x, 6, 0x1p-13f); }
EMU_INLINE float cos(float x) { return emu_fast::within_abs(__builtin_cosf(x), x, 7, 0x1p-13f); }
EMU_INLINE float tan(float x) {
  return emu_perturb_seed ? fast::sin(x) * (1.0f / fast::cos(x)) : __builtin_tanf(x);
}
EMU_INLINE float tanh(float x) {   // (t - 1) / (t + 1), t = exp(2 x): NaN once t overflows
  if (!emu_perturb_seed) return __builtin_tanhf(x);
  const float t = fast::exp(2.0f * x);
  return (t - 1.0f) / (t + 1.0f);
}
EMU_INLINE float sinh(float x) {
  return emu_perturb_seed ? 0.5f * (fast::exp(x) - fast::exp(-x)) : __builtin_sinhf(x);
}
EMU_INLINE float cosh(float x) {
  return emu_perturb_seed ? 0.5f * (fast::exp(x) + fast::exp(-x)) : __builtin_coshf(x);
}
EMU_INLINE float asin(float x) { return emu_fast::within_ulps(__builtin_asinf(x), x, 8, 5.0f); }
EMU_INLINE float acos(float x) { return emu_fast::within_ulps(__builtin_acosf(x), x, 9, 5.0f); }
EMU_INLINE float atan(float x) { return emu_fast::within_ulps(__builtin_atanf(x), x, 10, 5.0f); }
EMU_INLINE float atan2(float y, float x) {
  return emu_fast::within_ulps(__builtin_atan2f(y, x), y * 3.0f + x, 11, 5.0f);
}
EMU_INLINE float divide(float x, float y) {  // <= 2.5 ulp
  return emu_fast::within_ulps(x / y, x * 7.0f + y, 12, 2.0f);
}

// half and bfloat through the float function, one rounding; vectors component by component.
#define EMU_FAST1(name)                                                                      \
  EMU_INLINE half name(half x) { return static_cast<half>(fast::name(static_cast<float>(x))); } \
  EMU_INLINE bfloat name(bfloat x) {                                                         \
    return static_cast<bfloat>(fast::name(static_cast<float>(x)));                           \
  }                                                                                          \
  template <class T, int N>                                                                  \
  EMU_INLINE vec<T, N> name(vec<T, N> v) {                                                   \
    vec<T, N> r;                                                                             \
    for (int i = 0; i < N; ++i) r[i] = fast::name(static_cast<T>(v[i]));                     \
    return r;                                                                                \
  }
#define EMU_FAST2(name)                                                                      \
  EMU_INLINE half name(half x, half y) {                                                     \
    return static_cast<half>(fast::name(static_cast<float>(x), static_cast<float>(y)));      \
  }                                                                                          \
  EMU_INLINE bfloat name(bfloat x, bfloat y) {                                               \
    return static_cast<bfloat>(fast::name(static_cast<float>(x), static_cast<float>(y)));    \
  }                                                                                          \
  template <class T, int N>                                                                  \
  EMU_INLINE vec<T, N> name(vec<T, N> a, vec<T, N> b) {                                      \
    vec<T, N> r;                                                                             \
    for (int i = 0; i < N; ++i) r[i] = fast::name(static_cast<T>(a[i]), static_cast<T>(b[i])); \
    return r;                                                                                \
  }
EMU_FAST1(exp2) EMU_FAST1(exp) EMU_FAST1(exp10) EMU_FAST1(log2) EMU_FAST1(log) EMU_FAST1(log10)
EMU_FAST1(log1p) EMU_FAST1(rsqrt) EMU_FAST1(sqrt) EMU_FAST1(sin) EMU_FAST1(cos) EMU_FAST1(tan)
EMU_FAST1(tanh) EMU_FAST1(sinh) EMU_FAST1(cosh) EMU_FAST1(asin) EMU_FAST1(acos) EMU_FAST1(atan)
EMU_FAST2(pow) EMU_FAST2(powr) EMU_FAST2(atan2) EMU_FAST2(divide)
#undef EMU_FAST1
#undef EMU_FAST2
}  // namespace fast

// numeric_limits for the scalar types
template <class T> struct numeric_limits;
#define EMU_LIMITS_F(T, MIN, MAX, EPS, BITS_INF, BITS_NAN, U)                        \
  template <> struct numeric_limits<T> {                                              \
    static constexpr bool is_specialized = true;                                      \
    static constexpr bool is_signed = true;                                           \
    static constexpr T min() { return MIN; }                                          \
    static constexpr T max() { return MAX; }                                          \
    static constexpr T lowest() { return -(MAX); }                                    \
    static constexpr T epsilon() { return EPS; }                                      \
    static constexpr T infinity() { return __builtin_bit_cast(T, static_cast<U>(BITS_INF)); } \
    static constexpr T quiet_NaN() { return __builtin_bit_cast(T, static_cast<U>(BITS_NAN)); } \
  };
EMU_LIMITS_F(float, 1.17549435e-38f, 3.40282347e+38f, 1.1920929e-07f, 0x7F800000u, 0x7FC00000u, uint32_t)
EMU_LIMITS_F(half, static_cast<half>(6.1035156e-05f), static_cast<half>(65504.0f),
             static_cast<half>(0.0009765625f), 0x7C00u, 0x7E00u, uint16_t)
EMU_LIMITS_F(bfloat, __builtin_bit_cast(bfloat, static_cast<uint16_t>(0x0080u)),
             __builtin_bit_cast(bfloat, static_cast<uint16_t>(0x7F7Fu)),
             __builtin_bit_cast(bfloat, static_cast<uint16_t>(0x3C00u)), 0x7F80u, 0x7FC0u, uint16_t)
#define EMU_LIMITS_I(T, LO, HI, SIGNED)                                              \
  template <> struct numeric_limits<T> {                                              \
    static constexpr bool is_specialized = true;                                      \
    static constexpr bool is_signed = SIGNED;                                         \
    static constexpr T min() { return LO; }                                           \
    static constexpr T max() { return HI; }                                           \
    static constexpr T lowest() { return LO; }                                        \
  };
EMU_LIMITS_I(bool, false, true, false)
EMU_LIMITS_I(char, -128, 127, true)
EMU_LIMITS_I(signed char, -128, 127, true)
EMU_LIMITS_I(uchar, 0, 255, false)
EMU_LIMITS_I(short, -32768, 32767, true)
EMU_LIMITS_I(ushort, 0, 65535, false)
EMU_LIMITS_I(int, -2147483647 - 1, 2147483647, true)
EMU_LIMITS_I(uint, 0u, 4294967295u, false)
EMU_LIMITS_I(long, -9223372036854775807L - 1, 9223372036854775807L, true)
EMU_LIMITS_I(ulong, 0ul, 18446744073709551615ul, false)

// ---------------------------------------------------------------------------------------------
// Barriers
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                              mem_threadgroup_imageblock = 8, mem_object_data = 16 };
EMU_INLINE constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<uint>(a) | static_cast<uint>(b));
}
EMU_INLINE void threadgroup_barrier(mem_flags, EMU_SITE) { emu_tg_barrier(emu_cur(), emu_site); }
EMU_INLINE void simdgroup_barrier(mem_flags, EMU_SITE) {
  EmuLane* L = emu_cur();
  if (emu_simd_arrive(L, emu_site)) emu_simd_release(L);
}

// ---------------------------------------------------------------------------------------------
// SIMD-group functions. Every one is a synchronisation point of the lanes taking part: each
// lane publishes its value, the last one to arrive computes every lane's result, then all go on.
namespace emu_simd {
template <class T> EMU_INLINE T in(EmuSimd* S, uint l) { return emu::load<T>(S->in[l]); }

template <class T, class F>
EMU_INLINE T collective(T x, uint32_t site, F compute) {
  static_assert(sizeof(T) <= EMU_SLOT_BYTES, "SIMD-group function on a type over 32 bytes");
  EmuLane* L = emu_cur();
  EmuSimd* S = L->simd;
  uint me = L->thread_index_in_simdgroup;
  emu::store(S->in[me], x);
  if (emu_simd_arrive(L, site)) {
    compute(S, S->active);
    emu_simd_release(L);
  }
  return emu::load<T>(S->out[me]);
}

// Each lane names the lane it reads (its own argument); an inactive or out-of-range source
// gives the lane its own value (Metal: shuffle_down/up leave those lanes unchanged).
template <class T>
EMU_INLINE T permute(T x, uint32_t site, int src) {
  EmuLane* L = emu_cur();
  L->simd->ptr[L->thread_index_in_simdgroup][0] = reinterpret_cast<void*>(static_cast<intptr_t>(src));
  return collective(x, site, [](EmuSimd* S, uint32_t act) {
    for (uint32_t m = act; m; m &= m - 1) {
      uint l = __builtin_ctz(m);
      intptr_t s = reinterpret_cast<intptr_t>(S->ptr[l][0]);
      uint from = (s >= 0 && s < EMU_SIMD_WIDTH && (act >> s & 1)) ? uint(s) : l;
      __builtin_memcpy(S->out[l], S->in[from], sizeof(T));
    }
  });
}

// Perturbed mode: the active lanes in an order drawn from the seed, the site and every
// lane's value (the same in both schedules of a race-free launch).
EMU_INLINE int shuffled_lanes(EmuSimd* S, uint32_t act, uint32_t site, uint32_t bytes,
                              uint8_t (&order)[EMU_SIMD_WIDTH]) {
  uint64_t h = emu_fast::mix((uint64_t(emu_perturb_seed) << 32) ^ site ^ (uint64_t(act) << 12));
  int n = 0;
  for (uint32_t m = act; m; m &= m - 1) {
    uint32_t l = __builtin_ctz(m);
    for (uint32_t k = 0; k < bytes; ++k) h = emu_fast::mix(h ^ S->in[l][k]);
    order[n++] = uint8_t(l);
  }
  for (int i = n - 1; i > 0; --i) {  // Fisher-Yates
    h = emu_fast::mix(h);
    int j = int(h % uint64_t(i + 1));
    uint8_t t = order[i]; order[i] = order[j]; order[j] = t;
  }
  return n;
}

template <class T, class Op>
EMU_INLINE T reduce(T x, uint32_t site, Op op) {
  return collective(x, site, [&](EmuSimd* S, uint32_t act) {
    if (emu_perturb_seed) {  // one lane after the other, in a shuffled order
      uint8_t order[EMU_SIMD_WIDTH];
      int n = shuffled_lanes(S, act, site, sizeof(T), order);
      T acc = in<T>(S, order[0]);
      for (int i = 1; i < n; ++i) acc = op(acc, in<T>(S, order[i]));
      for (uint32_t m = act; m; m &= m - 1) emu::store(S->out[__builtin_ctz(m)], acc);
      return;
    }
    // butterfly order over the active lanes (lane order within pairs), same result everywhere
    T v[EMU_SIMD_WIDTH];
    bool have[EMU_SIMD_WIDTH];
    for (int l = 0; l < EMU_SIMD_WIDTH; ++l) {
      have[l] = act >> l & 1;
      if (have[l]) v[l] = in<T>(S, l);
    }
    for (int w = 1; w < EMU_SIMD_WIDTH; w *= 2) {
      for (int l = 0; l < EMU_SIMD_WIDTH; l += 2 * w) {
        if (have[l] && have[l + w]) v[l] = op(v[l], v[l + w]);
        else if (have[l + w]) { v[l] = v[l + w]; have[l] = true; }
      }
    }
    for (uint32_t m = act; m; m &= m - 1) emu::store(S->out[__builtin_ctz(m)], v[0]);
  });
}

template <class T, class Op>
EMU_INLINE T scan(T x, uint32_t site, Op op, bool inclusive, T identity) {
  return collective(x, site, [&](EmuSimd* S, uint32_t act) {
    T acc = identity;
    for (uint32_t m = act; m; m &= m - 1) {
      uint l = __builtin_ctz(m);
      T v = in<T>(S, l);
      if (inclusive) { acc = op(acc, v); emu::store(S->out[l], acc); }
      else { emu::store(S->out[l], acc); acc = op(acc, v); }
    }
  });
}
}  // namespace emu_simd

// The types Metal's SIMD-group functions take: scalars and vectors of float, half, bfloat
// (MLX's bf16_math.h adds those), int, uint, short, ushort; the permutations also char and
// uchar, the bitwise reductions only the integers. Not bool, 64-bit integers or structs: MLX's
// utils.h adds simd_shuffle, simd_shuffle_up and simd_shuffle_down for bool, int64_t and
// uint64_t (below, at global scope as there), nothing else.
}  // namespace metal
namespace emu {
template <class E> constexpr bool simd_int = same<E, int> || same<E, uint> || same<E, short> ||
    same<E, ushort>;
template <class E> constexpr bool simd_byte = same<E, char> || same<E, signed char> ||
    same<E, uchar>;
template <class E> constexpr bool simd_arith = is_float<E> || simd_int<E>;
template <class T> constexpr bool simd_vec_ok = vinfo<plain<T>>::n <= 4;
template <class T> constexpr bool simd_permute_type =
    simd_vec_ok<T> && (simd_arith<elem_t<T>> || simd_byte<elem_t<T>>);
template <class T> constexpr bool simd_arith_type = simd_vec_ok<T> && simd_arith<elem_t<T>>;
template <class T> constexpr bool simd_bits_type =
    simd_vec_ok<T> && (simd_int<elem_t<T>> || simd_byte<elem_t<T>>);
}  // namespace emu
namespace metal {
#define EMU_SIMD_TYPES(kind, fn)                                                              \
  static_assert(emu::simd_##kind##_type<T>, #fn ": Metal's SIMD-group functions do not take "  \
                "this type (only scalars or vectors of float, half, bfloat, int, uint, short, " \
                "ushort; permutations also char, uchar; simd_and/or/xor integers only; no bool, " \
                "64-bit or struct; MLX adds simd_shuffle/_up/_down for bool, int64_t, uint64_t)")

template <class T> EMU_INLINE T simd_shuffle(T x, ushort lane, EMU_SITE) {
  EMU_SIMD_TYPES(permute, simd_shuffle);
  return emu_simd::permute(x, emu_site, int(lane));
}
template <class T> EMU_INLINE T simd_broadcast(T x, ushort lane, EMU_SITE) {
  EMU_SIMD_TYPES(permute, simd_broadcast);
  return emu_simd::permute(x, emu_site, int(lane));
}
template <class T> EMU_INLINE T simd_shuffle_down(T x, ushort delta, EMU_SITE) {
  EMU_SIMD_TYPES(permute, simd_shuffle_down);
  return emu_simd::permute(x, emu_site, int(emu_cur()->thread_index_in_simdgroup) + int(delta));
}
template <class T> EMU_INLINE T simd_shuffle_up(T x, ushort delta, EMU_SITE) {
  EMU_SIMD_TYPES(permute, simd_shuffle_up);
  return emu_simd::permute(x, emu_site, int(emu_cur()->thread_index_in_simdgroup) - int(delta));
}
template <class T> EMU_INLINE T simd_shuffle_xor(T x, ushort mask, EMU_SITE) {
  EMU_SIMD_TYPES(permute, simd_shuffle_xor);
  return emu_simd::permute(x, emu_site, int(emu_cur()->thread_index_in_simdgroup ^ mask));
}
template <class T> EMU_INLINE T simd_broadcast_first(T x, EMU_SITE) {
  EMU_SIMD_TYPES(permute, simd_broadcast_first);
  return emu_simd::collective(x, emu_site, [](EmuSimd* S, uint32_t act) {
    uint first = __builtin_ctz(act);
    for (uint32_t m = act; m; m &= m - 1) __builtin_memcpy(S->out[__builtin_ctz(m)], S->in[first], sizeof(T));
  });
}
template <class T> EMU_INLINE T simd_sum(T x, EMU_SITE) {
  EMU_SIMD_TYPES(arith, simd_sum);
  return emu_simd::reduce(x, emu_site, [](T a, T b) { return T(a + b); });
}
template <class T> EMU_INLINE T simd_product(T x, EMU_SITE) {
  EMU_SIMD_TYPES(arith, simd_product);
  return emu_simd::reduce(x, emu_site, [](T a, T b) { return T(a * b); });
}
template <class T> EMU_INLINE T simd_max(T x, EMU_SITE) {
  EMU_SIMD_TYPES(arith, simd_max);
  return emu_simd::reduce(x, emu_site, [](T a, T b) { return metal::max(a, b); });
}
template <class T> EMU_INLINE T simd_min(T x, EMU_SITE) {
  EMU_SIMD_TYPES(arith, simd_min);
  return emu_simd::reduce(x, emu_site, [](T a, T b) { return metal::min(a, b); });
}
template <class T> EMU_INLINE T simd_and(T x, EMU_SITE) {
  EMU_SIMD_TYPES(bits, simd_and);
  return emu_simd::reduce(x, emu_site, [](T a, T b) { return T(a & b); });
}
template <class T> EMU_INLINE T simd_or(T x, EMU_SITE) {
  EMU_SIMD_TYPES(bits, simd_or);
  return emu_simd::reduce(x, emu_site, [](T a, T b) { return T(a | b); });
}
template <class T> EMU_INLINE T simd_xor(T x, EMU_SITE) {
  EMU_SIMD_TYPES(bits, simd_xor);
  return emu_simd::reduce(x, emu_site, [](T a, T b) { return T(a ^ b); });
}
template <class T> EMU_INLINE T simd_prefix_inclusive_sum(T x, EMU_SITE) {
  EMU_SIMD_TYPES(arith, simd_prefix_inclusive_sum);
  return emu_simd::scan(x, emu_site, [](T a, T b) { return T(a + b); }, true, T(0));
}
template <class T> EMU_INLINE T simd_prefix_exclusive_sum(T x, EMU_SITE) {
  EMU_SIMD_TYPES(arith, simd_prefix_exclusive_sum);
  return emu_simd::scan(x, emu_site, [](T a, T b) { return T(a + b); }, false, T(0));
}
template <class T> EMU_INLINE T simd_prefix_inclusive_product(T x, EMU_SITE) {
  EMU_SIMD_TYPES(arith, simd_prefix_inclusive_product);
  return emu_simd::scan(x, emu_site, [](T a, T b) { return T(a * b); }, true, T(1));
}
template <class T> EMU_INLINE T simd_prefix_exclusive_product(T x, EMU_SITE) {
  EMU_SIMD_TYPES(arith, simd_prefix_exclusive_product);
  return emu_simd::scan(x, emu_site, [](T a, T b) { return T(a * b); }, false, T(1));
}
EMU_INLINE bool simd_all(bool x, EMU_SITE) {
  return emu_simd::reduce(uint(x), emu_site, [](uint a, uint b) { return a & b; });
}
EMU_INLINE bool simd_any(bool x, EMU_SITE) {
  return emu_simd::reduce(uint(x), emu_site, [](uint a, uint b) { return a | b; });
}
EMU_INLINE bool simd_is_first(EMU_SITE) {
  EmuLane* L = emu_cur();
  uint me = L->thread_index_in_simdgroup;
  uint first = emu_simd::collective(me, emu_site, [](EmuSimd* S, uint32_t act) {
    uint f = __builtin_ctz(act);
    for (uint32_t m = act; m; m &= m - 1) emu::store(S->out[__builtin_ctz(m)], f);
  });
  return first == me;
}

}  // namespace metal

// MLX's utils.h: the permutations of bool and 64-bit integers Metal lacks, as two 32-bit words.
#define EMU_MLX_SHUFFLE(fn, arg)                                                              \
  inline uint64_t fn(uint64_t data, uint16_t arg, EMU_SITE) {                                 \
    return as_type<uint64_t>(metal::fn(as_type<uint2>(data), arg, emu_site));                 \
  }                                                                                           \
  inline int64_t fn(int64_t data, uint16_t arg, EMU_SITE) {                                   \
    return as_type<int64_t>(metal::fn(as_type<uint2>(data), arg, emu_site));                  \
  }                                                                                           \
  inline bool fn(bool data, uint16_t arg, EMU_SITE) {                                         \
    return metal::fn(static_cast<uint32_t>(data), arg, emu_site);                             \
  }
EMU_MLX_SHUFFLE(simd_shuffle, lane)
EMU_MLX_SHUFFLE(simd_shuffle_down, delta)
EMU_MLX_SHUFFLE(simd_shuffle_up, delta)
#undef EMU_MLX_SHUFFLE

namespace metal {
// ---------------------------------------------------------------------------------------------
// simdgroup_matrix<T, 8, 8>. Lane l holds elements (r, c) and (r, c + 1) with
//   q = l / 4, r = (q & 4) + (l / 2) % 4, c = (q & 2) * 2 + (l % 2) * 2
// (the layout MLX's steel kernels rely on). Products accumulate in float for half/bfloat.
struct simdgroup_matrix_layout {
  static EMU_INLINE uint row(uint l) { return ((l / 4) & 4) + (l / 2) % 4; }
  static EMU_INLINE uint col(uint l) { return ((l / 4) & 2) * 2 + (l % 2) * 2; }
};

template <typename T, int Rows, int Cols>
struct simdgroup_matrix {
  static_assert(Rows == 8 && Cols == 8,
                "mlx_bricks emulator: only simdgroup_matrix<T, 8, 8> is supported");
  static_assert(emu::is_float<T>,
                "mlx_bricks emulator: simdgroup_matrix element type must be half, bfloat or float");
  vec<T, 2> e;
  EMU_INLINE simdgroup_matrix() {  // Metal leaves it undefined; NaN makes missing init visible
    e = vec<T, 2>(static_cast<T>(__builtin_nanf("")));
  }
  // Apple's signatures: a reference to the lane's two elements, but a copy from a const matrix
  // (so code that expects the const overload to alias the matrix fails here as on Metal).
  EMU_INLINE thread vec<T, 2>& thread_elements() thread { return e; }
  EMU_INLINE const vec<T, 2> thread_elements() const thread { return e; }
};

typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int R, int C>
EMU_INLINE simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(const T value) {
  simdgroup_matrix<T, R, C> m;
  m.e = vec<T, 2>(value);
  return m;
}

// simdgroup_load / simdgroup_store: matrix_origin is (column, row) in the memory matrix;
// transpose_matrix reads element (i, j) from memory (j, i) relative to the origin.
// Both are SIMD-group synchronisation points (loads wait for the group's earlier stores;
// stores complete before any lane goes on).
template <typename T, int R, int C, typename P>
EMU_INLINE void simdgroup_load(thread simdgroup_matrix<T, R, C>& d, P* src,
                               ulong elements_per_row = C, ulong2 matrix_origin = 0,
                               bool transpose_matrix = false, EMU_SITE) {
  EmuLane* L = emu_cur();
  if (emu_simd_arrive(L, emu_site)) emu_simd_release(L);
  uint l = L->thread_index_in_simdgroup;
  ulong r = simdgroup_matrix_layout::row(l), c = simdgroup_matrix_layout::col(l);
  P* base = src + matrix_origin.y * elements_per_row + matrix_origin.x;
  for (int k = 0; k < 2; ++k) {
    ulong i = r, j = c + k;
    d.e[k] = emu::conv<T>(transpose_matrix ? base[j * elements_per_row + i]
                                           : base[i * elements_per_row + j]);
  }
}

template <typename T, int R, int C, typename P>
EMU_INLINE void simdgroup_store(const thread simdgroup_matrix<T, R, C>& a, P* dst,
                                ulong elements_per_row = C, ulong2 matrix_origin = 0,
                                bool transpose_matrix = false, EMU_SITE) {
  EmuLane* L = emu_cur();
  uint l = L->thread_index_in_simdgroup;
  ulong r = simdgroup_matrix_layout::row(l), c = simdgroup_matrix_layout::col(l);
  P* base = dst + matrix_origin.y * elements_per_row + matrix_origin.x;
  for (int k = 0; k < 2; ++k) {
    ulong i = r, j = c + k;
    typedef emu::plain<decltype(base[0])> E;
    if (transpose_matrix) base[j * elements_per_row + i] = emu::conv<E>(static_cast<T>(a.e[k]));
    else base[i * elements_per_row + j] = emu::conv<E>(static_cast<T>(a.e[k]));
  }
  if (emu_simd_arrive(L, emu_site)) emu_simd_release(L);
}

namespace emu_mma {
template <class T>
EMU_INLINE void gather(EmuSimd* S, int which, float (&m)[8][8]) {
  for (uint l = 0; l < EMU_SIMD_WIDTH; ++l) {
    const vec<T, 2>& e = *static_cast<const vec<T, 2>*>(S->ptr[l][which]);
    uint r = simdgroup_matrix_layout::row(l), c = simdgroup_matrix_layout::col(l);
    m[r][c] = static_cast<float>(static_cast<T>(e[0]));
    m[r][c + 1] = static_cast<float>(static_cast<T>(e[1]));
  }
}
// The completing lane's work, out of line: keeps each call site small (compile time).
template <typename TD, typename TA, typename TB, typename TC>
__attribute__((noinline)) void complete(EmuSimd* S) {
  if (S->active != 0xFFFFFFFFu) {
    emu_fault("simdgroup_multiply_accumulate needs all 32 lanes of the SIMD-group "
              "(divergent control flow or a partial SIMD-group)");
  }
  float A[8][8], B[8][8], Cm[8][8];
  gather<TA>(S, 0, A);
  gather<TB>(S, 1, B);
  gather<TC>(S, 2, Cm);
  if (emu_perturb_seed) {
    // Perturbed mode: per element, the 8 products in a shuffled order and C added at a
    // shuffled point (the hardware's order is not documented), drawn from the operands.
    uint64_t h = emu_fast::mix(emu_perturb_seed);
    for (int i = 0; i < 8; ++i)
      for (int k = 0; k < 8; ++k)
        h = emu_fast::mix(h ^ __builtin_bit_cast(uint32_t, A[i][k]) ^
                          (uint64_t(__builtin_bit_cast(uint32_t, B[i][k])) << 32));
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 8; ++j) {
        uint8_t ord[8] = {0, 1, 2, 3, 4, 5, 6, 7};
        for (int t = 7; t > 0; --t) {
          h = emu_fast::mix(h);
          int u = int(h % uint64_t(t + 1));
          uint8_t w = ord[t]; ord[t] = ord[u]; ord[u] = w;
        }
        const int c_at = int((h >> 40) % 9);
        float acc = 0.0f;
        for (int t = 0; t < 8; ++t) {
          if (t == c_at) acc += Cm[i][j];
          acc = __builtin_fmaf(A[i][ord[t]], B[ord[t]][j], acc);
        }
        if (c_at == 8) acc += Cm[i][j];
        Cm[i][j] = acc;
      }
    }
  } else {
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 8; ++j) {
        float acc = Cm[i][j];
        for (int k = 0; k < 8; ++k) acc = __builtin_fmaf(A[i][k], B[k][j], acc);
        Cm[i][j] = acc;
      }
    }
  }
  for (uint l = 0; l < EMU_SIMD_WIDTH; ++l) {
    vec<TD, 2>& e = *static_cast<vec<TD, 2>*>(S->ptr[l][3]);
    uint r = simdgroup_matrix_layout::row(l), cc = simdgroup_matrix_layout::col(l);
    e[0] = static_cast<TD>(Cm[r][cc]);
    e[1] = static_cast<TD>(Cm[r][cc + 1]);
  }
}
}  // namespace emu_mma

// D = A * B + C over the 32 lanes' fragments (products and sums in float, one rounding to D).
template <typename TD, typename TA, typename TB, typename TC, int R, int C, int K>
inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, R, C>& d,
                                          const thread simdgroup_matrix<TA, R, K>& a,
                                          const thread simdgroup_matrix<TB, K, C>& b,
                                          const thread simdgroup_matrix<TC, R, C>& c,
                                          EMU_SITE) {
  EmuLane* L = emu_cur();
  EmuSimd* S = L->simd;
  uint me = L->thread_index_in_simdgroup;
  S->ptr[me][0] = const_cast<void*>(static_cast<const void*>(&a.e));
  S->ptr[me][1] = const_cast<void*>(static_cast<const void*>(&b.e));
  S->ptr[me][2] = const_cast<void*>(static_cast<const void*>(&c.e));
  S->ptr[me][3] = static_cast<void*>(&d.e);
  if (emu_simd_arrive(L, emu_site)) {
    emu_mma::complete<TD, TA, TB, TC>(S);
    emu_simd_release(L);
  }
}

template <typename TD, typename TA, typename TB, int R, int C, int K>
EMU_INLINE void simdgroup_multiply(thread simdgroup_matrix<TD, R, C>& d,
                                   const thread simdgroup_matrix<TA, R, K>& a,
                                   const thread simdgroup_matrix<TB, K, C>& b, EMU_SITE) {
  simdgroup_matrix<TD, R, C> zero = make_filled_simdgroup_matrix<TD, R, C>(static_cast<TD>(0));
  simdgroup_multiply_accumulate(d, a, b, zero, emu_site);
}

// ---------------------------------------------------------------------------------------------
// Atomics (device or threadgroup memory)
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release,
                    memory_order_acq_rel, memory_order_seq_cst };
template <class T>
struct atomic {
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomic<T>: T must be 4 or 8 bytes");
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;

namespace emu_atomic {
template <class T, class P> EMU_INLINE T* addr(P* p) {
  return (T*)(p);  // C-style: also drops the address space in the checking pass
}
template <class T, class F>
EMU_INLINE T rmw(T* p, F f) {
  T old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    T nw = f(old);
    if (__atomic_compare_exchange(p, &old, &nw, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return old;
  }
}
}  // namespace emu_atomic

#define EMU_ATOMIC_RMW(name, expr)                                                         \
  template <class A, class U>                                                              \
  EMU_INLINE auto atomic_##name##_explicit(A* obj, U operand, memory_order)                \
      -> decltype(obj->value) {                                                            \
    typedef emu::plain<decltype(obj->value)> T;                                            \
    T v = static_cast<T>(operand);                                                         \
    T* p = emu_atomic::addr<T>(&obj->value);                                               \
    if constexpr (emu::is_float<T>) {                                                      \
      uint32_t* bits = emu_atomic::addr<uint32_t>(p);                                      \
      uint32_t old = emu_atomic::rmw(bits, [&](uint32_t o) {                               \
        T a = __builtin_bit_cast(T, o);                                                    \
        T b = v;                                                                           \
        return __builtin_bit_cast(uint32_t, static_cast<T>(expr));                         \
      });                                                                                  \
      return __builtin_bit_cast(T, old);                                                   \
    } else {                                                                               \
      return emu_atomic::rmw(p, [&](T a) { T b = v; return static_cast<T>(expr); });       \
    }                                                                                      \
  }
EMU_ATOMIC_RMW(fetch_add, a + b)
EMU_ATOMIC_RMW(fetch_sub, a - b)
EMU_ATOMIC_RMW(fetch_max, a > b ? a : b)
EMU_ATOMIC_RMW(fetch_min, a < b ? a : b)
EMU_ATOMIC_RMW(fetch_and, a & b)
EMU_ATOMIC_RMW(fetch_or, a | b)
EMU_ATOMIC_RMW(fetch_xor, a ^ b)
EMU_ATOMIC_RMW(exchange, ((void)a, b))
#undef EMU_ATOMIC_RMW

template <class A>
EMU_INLINE auto atomic_load_explicit(A* obj, memory_order) -> emu::plain<decltype(obj->value)> {
  typedef emu::plain<decltype(obj->value)> T;
  return __atomic_load_n(emu_atomic::addr<T>(&obj->value), __ATOMIC_RELAXED);
}
template <class A, class U>
EMU_INLINE void atomic_store_explicit(A* obj, U v, memory_order) {
  typedef emu::plain<decltype(obj->value)> T;
  T x = static_cast<T>(v);
  __atomic_store(emu_atomic::addr<T>(&obj->value), &x, __ATOMIC_RELAXED);
}
template <class A, class U>
EMU_INLINE bool atomic_compare_exchange_weak_explicit(A* obj, U* expected, U desired,
                                                      memory_order, memory_order) {
  typedef emu::plain<decltype(obj->value)> T;
  T d = static_cast<T>(desired);
  return __atomic_compare_exchange(emu_atomic::addr<T>(&obj->value), emu_atomic::addr<T>(expected),
                                   &d, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
}

}  // namespace metal

// ---------------------------------------------------------------------------------------------
// What MLX prepends to every custom kernel (mlx/backend/metal/kernels/utils.h, bf16.h): the
// subset custom kernels use. Our own definitions with MLX's names and signatures.
typedef half float16_t;
typedef bfloat bfloat16_t;

template <typename U>
struct Limits {
  static constexpr U max = metal::numeric_limits<U>::max();
  static constexpr U min = metal::numeric_limits<U>::min();
  static constexpr U finite_max = metal::numeric_limits<U>::max();
  static constexpr U finite_min = metal::numeric_limits<U>::min();
};
#define EMU_FLOAT_LIMITS(T)                                                 \
  template <> struct Limits<T> {                                            \
    static constexpr T max = metal::numeric_limits<T>::infinity();          \
    static constexpr T min = -metal::numeric_limits<T>::infinity();         \
    static constexpr T finite_max = metal::numeric_limits<T>::max();        \
    static constexpr T finite_min = -metal::numeric_limits<T>::max();       \
  };
EMU_FLOAT_LIMITS(half)
EMU_FLOAT_LIMITS(float)
EMU_FLOAT_LIMITS(bfloat)
#undef EMU_FLOAT_LIMITS

template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(uint elem, constant const int* shape, constant const int64_t* strides,
                            int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += static_cast<IdxT>(elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(uint3 elem, constant const int* shape, constant const int64_t* strides,
                            int ndim) {
  IdxT loc = elem.x * IdxT(strides[ndim - 1]) + elem.y * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += (elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_1(uint elem, constant const int64_t& stride) {
  return elem * IdxT(stride);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_2(uint2 elem, constant const int64_t* strides) {
  return elem.x * IdxT(strides[1]) + elem.y * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc_3(uint3 elem, constant const int64_t* strides) {
  return elem.x * IdxT(strides[2]) + elem.y * IdxT(strides[1]) + elem.z * IdxT(strides[0]);
}
template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}
#endif  // MLX_BRICKS_EMU_METAL_SHIM_H
