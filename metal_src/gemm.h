// gemm.h -- the shared ingestion pipeline and MMA pieces of the bricks (Bricks 1 and 2).
//
// Over 600 lines on purpose: every GEMM-family kernel (gemm, swiglu, rms_norm_qkv, moe) uses
// the loaders, the MMA tile and the epilogues together; split, each spec would list the same
// headers and no kernel would include one part alone.
//
// Separable parts, each a small template named by its parameters (as in MLX steel):
//
//   TileLoader<T, ROWS, BK, LD, NTHREADS>   global (ROWS x BK slice of a row-major operand)
//                                           -> registers -> threadgroup tile with row pitch LD.
//                                           128-bit vector loads when allowed, scalar predicated
//                                           loads otherwise; an optional element transform is
//                                           applied on the way into threadgroup memory.
//   AffineTileLoader<T, ROWS, BK, LD, NTHREADS, W>
//                                           the same tile from an MLX affine-quantized weight
//                                           (W = AffineWeight<BITS, GROUP_SIZE, ...>): packed
//                                           words -> registers -> dequantized once into the
//                                           threadgroup tile in T, so the MMA is unchanged.
//   DenseWeight / AffineWeight + WeightOf   a weight operand and the loader that reads it: the
//                                           weight format is a template parameter of a kernel
//                                           (BITS = 0: float), never a copy of it.
//   SimdgroupMMA<BM, BN, BK, WM, WN, LDA, LDB>
//                                           WM x WN simdgroups; each owns a (BM/WM) x (BN/WN)
//                                           sub-tile as 8x8 simdgroup_matrix<float> accumulators.
//                                           A is read (row, k) from As, B is read (n, k) from Bs,
//                                           i.e. the nn.Linear weight layout: C = A * B^T.
//   store / store_checked + epilogue ops    accumulators -> device memory, through a functor
//                                           (bias, residual, or a brick's own, e.g. SwiGLU).
//
// gemm_k_loop<BK, STAGES>() ties them together. STAGES = 2 (ping-pong, double buffering): the
// global loads of K step s+1 are issued into registers before the MMAs of step s, and land in
// the other threadgroup buffer afterwards, so one barrier per K step suffices. STAGES = 1
// (single buffer, half the threadgroup memory): the loads of step s+1 are still in flight during
// the MMAs of step s, but are written after a second barrier.
//
// Rows past the end of an operand are clamped to its last row by the caller (their results are
// never stored), so only the K tail and the final store need predication.
//
// Using it in a kernel body (gemm.metal is the complete example):
//   1. declare the STAGES buffers at kernel scope (MSL allows threadgroup storage only there),
//      as 16-byte chunks so 128-bit stores are aligned:
//        threadgroup bricks::Vec128<T> As_store[STAGES * LoaderA::TILE / LoaderA::VW];
//   2. construct the loaders; point the x loader's src[i] at its rows (clamped) with k_stride
//      and vec; bind the weight loader with bind_weight_rows(lb, weight_operand, n0, N, K, VEC);
//   3. construct SimdgroupMMA(sg, lane) and call gemm_k_loop<BK, STAGES>(la, lb, mma, As, Bs,
//      K, op);
//   4. store through mma.store / mma.store_checked with an epilogue op, or walk mma.acc
//      yourself (lane element (row0 + 8 i, col0 + 8 j + e) is acc[i][j].thread_elements()[e];
//      call thread_elements() on a non-const matrix: the const overload returns a copy).
// Kernels with two B operands (SwiGLU gate/up) reuse the loaders and the fragment loads
// (load_a / load_b / multiply_accumulate) with their own accumulator sets.

#ifndef MLX_BRICKS_GEMM_H
#define MLX_BRICKS_GEMM_H

#include <metal_stdlib>
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>

using namespace metal;

#define BRICKS_UNROLL _Pragma("clang loop unroll(full)")

namespace bricks {

// ---------------------------------------------------------------------------------------------
// Loader
// ---------------------------------------------------------------------------------------------

// 16 bytes of T (8 halfs/bfloats or 4 floats): the register chunk and the threadgroup tile
// element (threadgroup tiles are ours, so 16-byte aligned). Copies go element by element, with
// no vec<T, 8> (absent from MSL) and no type punning.
template <typename T>
struct alignas(16) Vec128 {
  T v[16 / sizeof(T)];
};

// The same 16 bytes read from device memory, with only element alignment: MLX binds a view by
// its byte offset, so a view's first element may sit at any element boundary (x[..., 1:65]).
// Promising 16-byte alignment there would be undefined behaviour; MLX steel's ReadVector makes
// the same choice (alignment 1 element).
template <typename T>
struct alignas(sizeof(T)) DeviceVec128 {
  T v[16 / sizeof(T)];
};

template <typename A, typename B>
struct SameType {
  static constant constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constant constexpr bool value = true;
};

template <typename T, typename Src>
inline void copy128(thread Vec128<T>& d, Src s) {
  BRICKS_UNROLL
  for (short j = 0; j < short(16 / sizeof(T)); ++j) d.v[j] = s->v[j];
}

// 16-byte load from an operand pointer. MLX passes inputs of fewer than 8 elements in the
// constant address space, so loaders take the pointer type as a parameter; the aligned 128-bit
// form exists for device pointers, constant ones (tiny arrays) copy element by element.
template <bool DEVICE>
struct Load128 {
  template <typename T, typename P>
  static void load(thread Vec128<T>& d, P p) {
    BRICKS_UNROLL
    for (short j = 0; j < short(16 / sizeof(T)); ++j) d.v[j] = p[j];
  }
};
template <>
struct Load128<true> {
  template <typename T, typename P>
  static void load(thread Vec128<T>& d, P p) {
    copy128(d, reinterpret_cast<const device DeviceVec128<T>*>(p));
  }
};

// The identity transform: what a plain GEMM applies to its operands.
struct NoTransform {
  template <typename T>
  void operator()(thread Vec128<T>&, short, int) const {}
};

// Row offset (in elements) of flat row m of a strided array whose first n_lead dims are the
// row dims (row-major flattening, as x.reshape(-1, K) would number the rows).
inline long strided_row_offset(
    int m, const constant int* shape, const constant int64_t* strides, int n_lead) {
  long off = 0;
  for (int d = n_lead - 1; d >= 0; --d) {
    const int s = shape[d];
    off += long(m % s) * strides[d];
    m /= s;
  }
  return off;
}

// Copies a ROWS x BK tile of a row-major (row, k) operand into threadgroup memory with row
// pitch LD, NTHREADS threads cooperating. Each thread owns NCH chunks of VW consecutive k
// (one 128-bit vector): chunk i is tile row `row + i * RSTEP`, tile columns [col, col + VW).
//
// The caller fills src[i] (pointer to element k = 0 of the chunk's row, rows clamped to the
// operand), k_stride (elements between consecutive k) and vec (128-bit path allowed: k_stride
// is 1, K % VW == 0, and every row start is 16-byte aligned). Ptr: the operand's pointer type.
template <typename T, short ROWS, short BK, short LD, short NTHREADS,
          typename Ptr = const device T*>
struct TileLoader {
  static constant constexpr short VW = 16 / sizeof(T);   // elements per 128-bit vector
  static constant constexpr short CPR = BK / VW;         // chunks per tile row
  // A tile of fewer chunks than threads (BK = 16 on a 32-row tile) leaves threads idle.
  static constant constexpr bool PARTIAL = ROWS * CPR < NTHREADS;
  static constant constexpr short RSTEP = PARTIAL ? ROWS : NTHREADS / CPR;  // rows between chunks
  static constant constexpr short NCH = PARTIAL ? 1 : ROWS / RSTEP;  // chunks per thread
  static constant constexpr int TILE = ROWS * LD;        // elements of one threadgroup buffer

  static_assert(BK % VW == 0, "BK must be a multiple of the 128-bit vector width");
  static_assert(PARTIAL || (NTHREADS % CPR == 0 && ROWS % RSTEP == 0),
                "tile does not split evenly");
  static_assert(LD % VW == 0, "the row pitch must keep 16-byte alignment (pad by VW)");

  Ptr src[NCH];
  long k_stride;
  int K;
  bool vec;
  short row;
  short col;
  int k_staged;  // first k of this thread's staged chunks
  Vec128<T> regs[NCH];

  TileLoader(ushort tid, int K_)
      : k_stride(1), K(K_), vec(false), row(short(tid / CPR)), col(short((tid % CPR) * VW)),
        k_staged(0) {}

  // Tile row of chunk i (past ROWS for an idle thread of a PARTIAL tile: it binds a clamped
  // row and stages nothing).
  short tile_row(short i) const { return row + i * RSTEP; }
  bool active() const { return !PARTIAL || row < ROWS; }

  // Issue the global loads of the tile starting at k0 into registers. check_k: the tile
  // crosses K (zero-fill past it; whole chunks in the vector path since VW divides K).
  void load(int k0, bool check_k) {
    if (!active()) return;
    const int k = k0 + col;
    k_staged = k;
    if (vec) {
      BRICKS_UNROLL
      for (short i = 0; i < NCH; ++i) {
        if (!check_k || k < K) {
          Load128<SameType<Ptr, const device T*>::value>::load(regs[i], src[i] + k);
        } else {
          BRICKS_UNROLL
          for (short j = 0; j < VW; ++j) regs[i].v[j] = T(0);
        }
      }
    } else {
      BRICKS_UNROLL
      for (short i = 0; i < NCH; ++i) {
        BRICKS_UNROLL
        for (short j = 0; j < VW; ++j) {
          const int kj = k + j;
          // lint-ok: strided-scalar-load the fallback of the 128-bit path (vec)
          regs[i].v[j] = (!check_k || kj < K) ? src[i][long(kj) * k_stride] : T(0);
        }
      }
    }
  }

  // Write the staged chunks into the threadgroup buffer dst, applying op(chunk, tile_row, k)
  // to chunks that start inside K (the zero-filled tail stays zero).
  template <typename Op>
  void store(threadgroup T* dst, thread const Op& op) {
    if (!active()) return;
    BRICKS_UNROLL
    for (short i = 0; i < NCH; ++i) {
      if (k_staged < K) op(regs[i], tile_row(i), k_staged);
      threadgroup Vec128<T>* d = reinterpret_cast<threadgroup Vec128<T>*>(
          dst + tile_row(i) * LD + col);
      BRICKS_UNROLL
      for (short j = 0; j < VW; ++j) d->v[j] = regs[i].v[j];
    }
  }

  void store(threadgroup T* dst) { store(dst, NoTransform()); }

  // Weight binding (bind_weight_rows): chunk i reads row n of a dense (N, K) weight.
  template <typename W>
  void bind(short i, W weight, int n, int K_) {
    src[i] = weight.w + long(n) * K_;
  }
};

// ---------------------------------------------------------------------------------------------
// Weight operands: what a kernel's weight input is, and which loader stages it.
// ---------------------------------------------------------------------------------------------

// A float weight (N, K), row-major (the nn.Linear layout), read by TileLoader.
template <typename WPtr>
struct DenseWeight {
  WPtr w;

  template <typename T, short ROWS, short BK, short LD, short NTHREADS>
  using Loader = TileLoader<T, ROWS, BK, LD, NTHREADS, WPtr>;
};

template <typename T, short ROWS, short BK, short LD, short NTHREADS, typename W>
struct AffineTileLoader;

// An MLX affine-quantized weight (mx.quantize, nn.QuantizedLinear): w uint32 (N, K * BITS / 32),
// each row a little-endian bit stream (value k in bits [k * BITS, (k + 1) * BITS)); scales and
// biases (N, K / GROUP_SIZE) in the float dtype T; value = scale * q + bias. Read by
// AffineTileLoader. K is a multiple of GROUP_SIZE (MLX requires it).
template <short BITS, short GROUP_SIZE, typename WPtr, typename SPtr, typename BPtr>
struct AffineWeight {
  WPtr w;
  SPtr scales;
  BPtr biases;

  template <typename T, short ROWS, short BK, short LD, short NTHREADS>
  using Loader = AffineTileLoader<T, ROWS, BK, LD, NTHREADS, AffineWeight>;
};

// The operand for a kernel's weight inputs (w, scales, biases) by its format: BITS = 0 is a
// float weight (scales and biases are placeholders, never read), BITS in 2..8 MLX affine.
template <short BITS, short GROUP_SIZE, typename WPtr, typename SPtr, typename BPtr>
struct WeightOf {
  typedef AffineWeight<BITS, GROUP_SIZE, WPtr, SPtr, BPtr> type;
  static type make(WPtr w, SPtr scales, BPtr biases) {
    type op = {w, scales, biases};
    return op;
  }
};
template <short GROUP_SIZE, typename WPtr, typename SPtr, typename BPtr>
struct WeightOf<0, GROUP_SIZE, WPtr, SPtr, BPtr> {
  typedef DenseWeight<WPtr> type;
  static type make(WPtr w, SPtr, BPtr) {
    type op = {w};
    return op;
  }
};

// The same pointer's address space, another element type (MLX passes inputs of fewer than 8
// elements in the constant address space, larger ones in device).
template <typename P, typename U>
struct RebindPtr;
template <typename E, typename U>
struct RebindPtr<const device E*, U> {
  typedef const device U* type;
};
template <typename E, typename U>
struct RebindPtr<const constant E*, U> {
  typedef const constant U* type;
};

// The widest unit (1, 2 or 4 bytes) dividing a run of packed bytes.
template <short BYTES>
struct PackedUnit {
  typedef uchar type;
};
template <>
struct PackedUnit<2> {
  typedef ushort type;
};
template <>
struct PackedUnit<4> {
  typedef uint type;
};

// N units of packed bytes, read from device memory as one struct with the unit's alignment (a
// uint32 buffer promises 4 bytes; a weight view may start at any word, so wider alignment would
// be undefined behaviour, as for DeviceVec128).
template <typename U, short N>
struct alignas(sizeof(U)) PackedUnits {
  U u[N];
};

template <bool DEVICE>
struct LoadUnits {
  template <typename U, short N, typename P>
  static void load(thread PackedUnits<U, N>& d, P p) {
    BRICKS_UNROLL
    for (short j = 0; j < N; ++j) d.u[j] = p[j];
  }
};
template <>
struct LoadUnits<true> {
  template <typename U, short N, typename P>
  static void load(thread PackedUnits<U, N>& d, P p) {
    const device PackedUnits<U, N>* s = reinterpret_cast<const device PackedUnits<U, N>*>(p);
    BRICKS_UNROLL
    for (short j = 0; j < N; ++j) d.u[j] = s->u[j];
  }
};

// Value at bit position p (a compile-time constant once the caller's loop is unrolled) of a
// little-endian bit stream held in units; a value straddles at most two units (BITS <= 8).
template <short BITS, typename U, short N>
inline uint unpack_bits(thread const PackedUnits<U, N>& r, short p) {
  constexpr short UB = short(sizeof(U) * 8);
  const short i = p / UB;
  const short s = p % UB;
  uint q = uint(r.u[i]) >> s;
  if (s + BITS > UB) q |= uint(r.u[i + 1]) << (UB - s);
  return q & ((1u << BITS) - 1u);
}

// Stages a ROWS x BK tile of an affine-quantized weight (tile row r = weight row n0 + r) into
// threadgroup memory in T with row pitch LD: the same tile TileLoader stages from a float
// weight, so SimdgroupMMA and gemm_k_loop run unchanged. Dequantized once per staged tile.
//
// Each active thread owns one run of V consecutive values of one tile row: tile columns
// [col, col + V). V = max(8, ROWS * BK / NTHREADS), so a run is V * BITS / 8 whole bytes
// starting at a multiple of its own size; the run is read as one PackedUnits struct of the
// widest unit dividing it (16 bytes = 128 bits for 8-bit on the 64-row fp16 tile). Threads past
// RUNS (small tiles) stage nothing. Per K step the thread also reads its row's scale and bias
// (BK divides GROUP_SIZE, so a run never crosses a group). The stored value is
// T(fma(scale, q, bias)) computed in float, one rounding (MLX's dequantize rounds once too).
//
// K is a multiple of GROUP_SIZE >= 32 and BK divides 32, so no K step is partial: check_k is
// never true for this operand and is ignored.
template <typename T, short ROWS, short BK, short LD, short NTHREADS, short BITS,
          short GROUP_SIZE, typename WPtr, typename SPtr, typename BPtr>
struct AffineTileLoader<T, ROWS, BK, LD, NTHREADS,
                        AffineWeight<BITS, GROUP_SIZE, WPtr, SPtr, BPtr>> {
  static constant constexpr short VW = 16 / sizeof(T);  // elements per threadgroup chunk
  static constant constexpr short V =
      (ROWS * BK / NTHREADS) > 8 ? short(ROWS * BK / NTHREADS) : 8;  // values per run
  static constant constexpr short RPR = BK / V;            // runs per tile row
  static constant constexpr short RUNS = ROWS * RPR;       // runs per tile
  static constant constexpr short NCH = 1;                 // runs per thread (bind loop)
  static constant constexpr int TILE = ROWS * LD;          // elements of one threadgroup buffer
  static constant constexpr short RUN_BYTES = V * BITS / 8;
  static constant constexpr short UNIT_BYTES =
      RUN_BYTES % 4 == 0 ? 4 : (RUN_BYTES % 2 == 0 ? 2 : 1);
  static constant constexpr short NU = RUN_BYTES / UNIT_BYTES;  // units per run

  typedef typename PackedUnit<UNIT_BYTES>::type Unit;
  typedef typename RebindPtr<WPtr, Unit>::type UnitPtr;

  static_assert(BITS == 2 || BITS == 3 || BITS == 4 || BITS == 5 || BITS == 6 || BITS == 8,
                "MLX affine bits are 2, 3, 4, 5, 6 or 8");
  static_assert(GROUP_SIZE % BK == 0, "a K step must not cross a quantization group");
  static_assert(BK % V == 0 && V % VW == 0, "runs must tile the row in whole chunks");
  static_assert(RUNS <= NTHREADS, "more runs than threads");
  static_assert(LD % VW == 0, "the row pitch must keep 16-byte alignment (pad by VW)");

  UnitPtr src;      // the thread's weight row, in units
  SPtr scale_row;   // the row's scales, one per group
  BPtr bias_row;
  bool vec;         // unused (set by bind_weight_rows for both loaders)
  bool active;      // this thread stages a run
  short row;
  short col;
  PackedUnits<Unit, NU> regs;
  T scale;
  T bias;

  AffineTileLoader(ushort tid, int)
      : vec(true), active(tid < RUNS), row(short(tid / RPR)), col(short((tid % RPR) * V)) {}

  short tile_row(short) const { return row; }

  // Weight binding (bind_weight_rows): this thread's run reads weight row n.
  void bind(short, AffineWeight<BITS, GROUP_SIZE, WPtr, SPtr, BPtr> weight, int n, int K) {
    // Row pitch: K * BITS / 8 bytes, a multiple of 4 (K % 32 == 0), so of every unit.
    src = reinterpret_cast<UnitPtr>(weight.w) + long(n) * (K / 8 * BITS / UNIT_BYTES);
    scale_row = weight.scales + long(n) * (K / GROUP_SIZE);
    bias_row = weight.biases + long(n) * (K / GROUP_SIZE);
  }

  // Issue the global loads of the tile starting at k0 (packed run, scale, bias) into registers.
  void load(int k0, bool) {
    if (!active) return;
    const int k = k0 + col;
    // k is a multiple of 8, so the run starts at byte k / 8 * BITS, a multiple of its size.
    LoadUnits<SameType<WPtr, const device uint*>::value>::load(
        regs, src + (k / 8 * BITS) / UNIT_BYTES);
    scale = scale_row[k / GROUP_SIZE];
    bias = bias_row[k / GROUP_SIZE];
  }

  // Dequantize the staged run into tile row `row`, columns [col, col + V), as VW-wide chunks.
  // (The Op parameter keeps TileLoader's interface; gemm_k_loop transforms A tiles only.)
  template <typename Op>
  void store(threadgroup T* dst, thread const Op&) {
    if (!active) return;
    const float s = float(scale);
    const float b = float(bias);
    threadgroup T* d = dst + row * LD + col;
    BRICKS_UNROLL
    for (short c = 0; c < V / VW; ++c) {
      threadgroup Vec128<T>* chunk = reinterpret_cast<threadgroup Vec128<T>*>(d + c * VW);
      BRICKS_UNROLL
      for (short j = 0; j < VW; ++j) {
        const uint q = unpack_bits<BITS>(regs, short((c * VW + j) * BITS));
        chunk->v[j] = T(fma(s, float(q), b));
      }
    }
  }

  void store(threadgroup T* dst) { store(dst, NoTransform()); }
};

// Points every chunk (run) of a weight loader at row min(n0 + tile_row, N - 1) of the weight
// operand (rows past N are computed, never stored). vec: the kernel's VEC (dense weights only).
template <typename Loader, typename W>
void bind_weight_rows(thread Loader& lb, W weight, int n0, int N, int K, bool vec) {
  lb.vec = vec;
  BRICKS_UNROLL
  for (short i = 0; i < Loader::NCH; ++i) {
    lb.bind(i, weight, min(n0 + int(lb.tile_row(i)), N - 1), K);
  }
}

// ---------------------------------------------------------------------------------------------
// MMA block
// ---------------------------------------------------------------------------------------------

// WM x WN simdgroups compute a BM x BN block; simdgroup sg owns the contiguous sub-tile at
// ((sg / WN) * SM, (sg % WN) * SN) of SM x SN = (BM/WM) x (BN/WN) outputs, as TM x TN 8x8
// float accumulators. Fragments are filled from threadgroup memory through thread_elements()
// (lane layout as used by MLX's steel kernels: each lane holds (fr, fc) and (fr, fc + 1)),
// converted to float, so the multiply-accumulate runs in float for every input dtype.
// SCHED: simdgroup_barrier(mem_none) before the A loads, between A and B loads and before the
// MMAs of each 8-wide K slice: scheduling hints (no memory ordering) that keep a simdgroup's
// lanes together around the matrix unit, where MLX's steel GEMM and ggml place them.
template <short BM, short BN, short BK, short WM, short WN, short LDA, short LDB,
          bool SCHED = false>
struct SimdgroupMMA {
  static constant constexpr short SM = BM / WM;
  static constant constexpr short SN = BN / WN;
  static constant constexpr short TM = SM / 8;
  static constant constexpr short TN = SN / 8;

  static_assert(SM % 8 == 0 && SN % 8 == 0 && BK % 8 == 0, "tiles must be multiples of 8");

  simdgroup_matrix<float, 8, 8> acc[TM][TN];
  simdgroup_matrix<float, 8, 8> a_frag[TM];
  simdgroup_matrix<float, 8, 8> b_frag[TN];
  short fr;    // this lane's row inside every 8x8 fragment
  short fc;    // this lane's first column inside every 8x8 fragment (it also holds fc + 1)
  short row0;  // block-relative row of this lane's first element in acc[0][0]
  short col0;  // block-relative column of this lane's first element in acc[0][0]

  SimdgroupMMA(ushort sg, ushort lane) {
    const short qid = short(lane / 4);
    fr = (qid & 4) + short((lane / 2) % 4);
    fc = (qid & 2) * 2 + short(lane % 2) * 2;
    row0 = short(sg / WN) * SM + fr;
    col0 = short(sg % WN) * SN + fc;
    BRICKS_UNROLL
    for (short i = 0; i < TM; ++i) {
      BRICKS_UNROLL
      for (short j = 0; j < TN; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }

  // Load the A fragments of k-slice kk: As holds (row, k) with pitch LDA.
  template <typename T>
  void load_a(const threadgroup T* As, short kk) {
    BRICKS_UNROLL
    for (short i = 0; i < TM; ++i) {
      const threadgroup T* p = As + (row0 + i * 8) * LDA + kk + fc;
      a_frag[i].thread_elements()[0] = float(p[0]);
      a_frag[i].thread_elements()[1] = float(p[1]);
    }
  }

  // Load the B fragments of k-slice kk: Bs holds (n, k) with pitch LDB, the fragment is B^T.
  template <typename T>
  void load_b(const threadgroup T* Bs, short kk) {
    BRICKS_UNROLL
    for (short j = 0; j < TN; ++j) {
      const threadgroup T* p = Bs + (col0 + j * 8) * LDB + kk + fr;
      b_frag[j].thread_elements()[0] = float(p[0]);
      b_frag[j].thread_elements()[1] = float(p[LDB]);
    }
  }

  void multiply_accumulate() {
    BRICKS_UNROLL
    for (short i = 0; i < TM; ++i) {
      BRICKS_UNROLL
      for (short j = 0; j < TN; ++j) {
        simdgroup_multiply_accumulate(acc[i][j], a_frag[i], b_frag[j], acc[i][j]);
      }
    }
  }

  // A scheduling hint (SCHED), nothing otherwise.
  static void hint() {
    if (SCHED) simdgroup_barrier(mem_flags::mem_none);
  }

  // acc += As (BM x BK) * Bs (BN x BK)^T for one threadgroup buffer pair.
  template <typename T>
  void mma(const threadgroup T* As, const threadgroup T* Bs) {
    BRICKS_UNROLL
    for (short kk = 0; kk < BK; kk += 8) {
      hint();
      load_a(As, kk);
      hint();
      load_b(Bs, kk);
      hint();
      multiply_accumulate();
    }
  }

  // Epilogue without bounds checks: C points at the block's (0, 0), row pitch ldc;
  // op(acc, row, col) (block-relative indices) returns the float value to store.
  // Not a const method: on a const matrix thread_elements() returns a copy of the elements
  // (Apple's const overload returns by value), the non-const overload a reference.
  template <typename T, typename Op>
  void store(device T* C, int ldc, thread const Op& op) {
    BRICKS_UNROLL
    for (short i = 0; i < TM; ++i) {
      const short r = row0 + i * 8;
      device T* crow = C + long(r) * ldc;
      BRICKS_UNROLL
      for (short j = 0; j < TN; ++j) {
        const short c = col0 + j * 8;
        thread auto& e = acc[i][j].thread_elements();
        crow[c] = T(op(e[0], r, c));
        crow[c + 1] = T(op(e[1], r, c + 1));
      }
    }
  }

  // Epilogue with predication: only rows < rows_left and columns < cols_left are written
  // (and only those are passed to op, so op may read device memory at (row, col)).
  template <typename T, typename Op>
  void store_checked(device T* C, int ldc, int rows_left, int cols_left,
                     thread const Op& op) {
    BRICKS_UNROLL
    for (short i = 0; i < TM; ++i) {
      const short r = row0 + i * 8;
      if (r >= rows_left) continue;
      device T* crow = C + long(r) * ldc;
      BRICKS_UNROLL
      for (short j = 0; j < TN; ++j) {
        const short c = col0 + j * 8;
        thread auto& e = acc[i][j].thread_elements();
        if (c < cols_left) crow[c] = T(op(e[0], r, c));
        if (c + 1 < cols_left) crow[c + 1] = T(op(e[1], r, c + 1));
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Epilogue ops: float operator()(float acc, short row, short col), block-relative indices.
// ---------------------------------------------------------------------------------------------

// acc (+ bias[col]) (+ residual[row, col]), summed in float and rounded once by the store.
template <bool HAS_BIAS, bool HAS_RESIDUAL, typename BiasPtr, typename ResidualPtr>
struct BiasResidualEpilogue {
  BiasPtr bias;          // at the block's first column
  ResidualPtr residual;  // at the block's (0, 0)
  int ldr;               // residual row pitch

  float operator()(float v, short r, short c) const {
    if (HAS_BIAS) v += float(bias[c]);
    if (HAS_RESIDUAL) v += float(residual[long(r) * ldr + c]);
    return v;
  }
};

// ---------------------------------------------------------------------------------------------
// Ingestion transforms: op(thread Vec128<T>& chunk, short tile_row, int k) applied by
// TileLoader::store to A chunks that start inside K (elements at k + j >= K are zero padding).
// ---------------------------------------------------------------------------------------------

// RMSNorm on the fly, as mx.fast.rms_norm (MLX 0.32) rounds it:
// h = T(w * T(x * inv_rms)), the inner product in float, w * T(...) exact in float then rounded.
// inv_rms comes from the rms_norm_inv kernel (one value per row, computed once per row rather
// than once per column tile).
template <typename WPtr, typename RPtr>
struct RmsNormTransform {
  RPtr inv_rms;   // (M,) float, at the tile's first row
  int rows_left;  // M - m0: tile rows past it are clamped as the loader clamps them
  WPtr weight;    // (K,) RMSNorm weight
  int K;

  template <typename T>
  void operator()(thread Vec128<T>& c, short row, int k) const {
    const float s = inv_rms[min(int(row), rows_left - 1)];
    BRICKS_UNROLL
    for (short j = 0; j < short(16 / sizeof(T)); ++j) {
      if (k + j < K) c.v[j] = T(float(weight[k + j]) * float(T(float(c.v[j]) * s)));
    }
  }
};

// Sum of squares of one row of x (K values) over the 32 lanes of a simdgroup, in float as
// mx.fast.rms_norm accumulates it: 128-bit chunks (vec) or coalesced scalars along k_stride.
// Returns the full sum in every lane.
template <typename T, typename Ptr>
float row_sum_squares(Ptr row, int K, long k_stride, bool vec, ushort lane) {
  constexpr short VW = 16 / sizeof(T);
  float acc = 0.0f;
  if (vec) {
    for (int k = int(lane) * VW; k < K; k += 32 * VW) {
      Vec128<T> c;
      Load128<SameType<Ptr, const device T*>::value>::load(c, row + k);
      BRICKS_UNROLL
      for (short j = 0; j < VW; ++j) acc += float(c.v[j]) * float(c.v[j]);
    }
  } else {
    for (int k = int(lane); k < K; k += 32) {
      // lint-ok: strided-scalar-load the fallback of the 128-bit path (vec)
      const float v = float(row[long(k) * k_stride]);
      acc += v * v;
    }
  }
  return simd_sum(acc);
}

// ---------------------------------------------------------------------------------------------
// Pipeline
// ---------------------------------------------------------------------------------------------

// The K loop of one block over STAGES threadgroup buffers per operand (LoaderX::TILE elements
// apart). op_a transforms A chunks on their way into threadgroup memory (NoTransform for a GEMM).
//
// STAGES = 2 (ping-pong): step s computes on buffer s & 1 while the loads of step s + 1 are in
// flight and then written into buffer (s + 1) & 1; the single barrier per step orders both the
// reads of step s - 1 before those writes and the writes before the reads of step s + 1.
//
// STAGES = 1 (single buffer, half the threadgroup memory): the loads of step s + 1 are issued
// before the MMAs of step s as above, but can only be written once every simdgroup has finished
// reading the buffer, so each step has two barriers (after the writes, after the MMAs; none
// after the last step's MMAs: whatever follows the loop must not write As/Bs without one).
template <short BK, short STAGES, typename LoaderA, typename LoaderB, typename MMA, typename T,
          typename OpA>
void gemm_k_loop(thread LoaderA& la, thread LoaderB& lb, thread MMA& mma,
                 threadgroup T* As, threadgroup T* Bs, int K, thread const OpA& op_a) {
  static_assert(STAGES == 1 || STAGES == 2, "STAGES is 1 (single buffer) or 2 (ping-pong)");
  const int full = K / BK;                  // steps without a K tail
  const int steps = full + (K % BK != 0);   // the last one may be partial
  la.load(0, full == 0);
  lb.load(0, full == 0);
  if (STAGES == 1) {
    for (int s = 0; s < steps; ++s) {
      la.store(As, op_a);
      lb.store(Bs);
      threadgroup_barrier(mem_flags::mem_threadgroup);
      const bool more = s + 1 < steps;
      if (more) {
        la.load((s + 1) * BK, s + 1 == full);
        lb.load((s + 1) * BK, s + 1 == full);
      }
      mma.mma(As, Bs);
      if (more) threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    return;
  }
  la.store(As, op_a);
  lb.store(Bs);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int s = 0; s < steps; ++s) {
    const bool more = s + 1 < steps;
    const int cur = s & 1;
    if (more) {
      la.load((s + 1) * BK, s + 1 == full);
      lb.load((s + 1) * BK, s + 1 == full);
    }
    mma.mma(As + cur * LoaderA::TILE, Bs + cur * LoaderB::TILE);
    if (more) {
      la.store(As + (cur ^ 1) * LoaderA::TILE, op_a);
      lb.store(Bs + (cur ^ 1) * LoaderB::TILE);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

}  // namespace bricks

#endif  // MLX_BRICKS_GEMM_H
