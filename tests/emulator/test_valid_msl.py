"""Known-answer tests for valid MSL that the emulator used to reject or run wrongly
(/work/notes/emulator-requests.md): struct copies between address spaces, templates and
overloads on the address space, ``alignas`` threadgroup storage, and vector constructors spelled
through aliases, template parameters, ``decltype`` or macros."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import emulator as em


def run1(kernel, inputs, n_out, dtype=mx.float32, grid=(4, 1, 1), threadgroup=(4, 1, 1)):
    (o,) = kernel(inputs=inputs, grid=grid, threadgroup=threadgroup, output_shapes=[(n_out,)],
                  output_dtypes=[dtype])
    return np.array(o)


# ---------------------------------------------------------------------------------------------
# 1. struct copies between address spaces (MLX steel's BlockLoader:
#    `*((threadgroup ReadVector*)dst) = *((const device ReadVector*)src);`)

PACK = "struct alignas(16) Pack { float v[4]; };\n"


def test_struct_copy_repro_from_notes():
    k = em.metal_kernel("copy_repro", ["inp"], ["out"], """
        uint i = thread_position_in_grid.x;
        Pack p = reinterpret_cast<const device Pack*>(inp)[i];
        out[i] = p.v[0];
        """, header=PACK)
    o = run1(k, [mx.arange(16, dtype=mx.float32)], 4)
    assert o.tolist() == [0, 4, 8, 12]


COPIES_HEADER = PACK + """
struct Outer { Pack p; int n; };
struct WithCtor { Pack p; WithCtor(const device Pack* s) : p(s[0]) {} };
inline float byval(Pack p) { return p.v[1]; }
inline Pack ret(const device Pack* s) { return s[1]; }
template <typename T, short N>
struct Loader {  // the shape of MLX steel's BlockLoader
  struct alignas(16) ReadVector { uint8_t v[sizeof(T) * N]; };
  const device T* src;
  threadgroup T* dst;
  void load_unsafe() const {
    *((threadgroup ReadVector*)(&dst[0])) = *((const device ReadVector*)(&src[0]));
  }
};
#define COPY(d, s) (d) = (s)
"""

COPIES_BODY = """
uint i = thread_position_in_grid.x;
const device Pack* s = reinterpret_cast<const device Pack*>(inp) + 4 * i;
threadgroup Pack t[4 * 8];
threadgroup Pack* tt = t + 8 * i;
Pack a = s[0];                          // copy-initialisation from device
Pack b(s[1]);                           // direct
Pack c{s[2]};                           // braces
Pack arr[2] = {s[0], s[3]};             // array elements
Outer q = {s[1], 7};                    // aggregate member
WithCtor w(s + 2);                      // member initialiser
Pack r = ret(s);                        // return
tt[0] = a;                              // assignment into threadgroup
tt[1] = s[1];                           // device -> threadgroup
Loader<float, 4> L{inp + 16 * i + 8, (threadgroup float*)(tt + 2)};
L.load_unsafe();                        // inside a template, through casts
COPY(tt[3], s[3]);                      // inside a macro
Pack x = i % 2 ? s[0] : b;              // conditional
Pack y;
y = tt[1];                              // threadgroup -> thread
Outer o2 = reinterpret_cast<const device Outer*>(inp)[i];
threadgroup_barrier(mem_flags::mem_threadgroup);
device float* o = out + 16 * i;
o[0] = a.v[0]; o[1] = b.v[0]; o[2] = c.v[0]; o[3] = arr[1].v[0];
o[4] = q.p.v[0] + q.n; o[5] = w.p.v[0]; o[6] = r.v[0]; o[7] = tt[0].v[3];
o[8] = tt[1].v[2]; o[9] = tt[2].v[1]; o[10] = tt[3].v[0]; o[11] = x.v[0];
o[12] = y.v[1]; o[13] = byval(s[3]); o[14] = o2.p.v[2]; o[15] = o2.n;
"""


def test_struct_copies_between_address_spaces():
    k = em.metal_kernel("as_copies", ["inp"], ["out"], COPIES_BODY, header=COPIES_HEADER)
    x = np.arange(256, dtype=np.float32)
    x[8 * np.arange(4) + 4] = 0  # Outer::n of the four threads' Outer reads
    x.view(np.int32)[8 * np.arange(4) + 4] = 40 + np.arange(4)
    o = run1(k, [mx.array(x)], 64).reshape(4, 16)
    packs = x.reshape(64, 4)
    for i in range(4):
        P = packs[4 * i : 4 * i + 4]
        outer = x.reshape(-1, 8)[i]  # Outer: 16-byte Pack, int, padding to 32 bytes
        want = [P[0, 0], P[1, 0], P[2, 0], P[3, 0], P[1, 0] + 7, P[2, 0], P[1, 0], P[0, 3],
                P[1, 2], packs[4 * i + 2, 1], P[3, 0], P[0, 0] if i % 2 else P[1, 0], P[1, 1],
                P[3, 1], outer[2], 40 + i]
        np.testing.assert_array_equal(o[i], np.array(want, dtype=np.float32), err_msg=str(i))


@pytest.mark.parametrize("line, message", [
    # a pointer to a struct still keeps its address space
    ("threadgroup Pack* q = reinterpret_cast<device Pack*>(out); q[0] = p;",
     r"'device Pack \*'"),
    # a reference in the thread address space does not bind to a device struct
    ("thread Pack& r = reinterpret_cast<device Pack*>(out)[0]; r = p;", r"address space"),
    # what is not a copy stays an error
    ("float f = reinterpret_cast<const device Pack*>(inp)[0]; out[0] = f;",
     r"no viable conversion"),
])
def test_struct_copy_keeps_other_errors(line, message):
    k = em.metal_kernel("as_copy_errors", ["inp"], ["out"], f"""
        uint i = thread_position_in_grid.x;
        Pack p = reinterpret_cast<const device Pack*>(inp)[i];
        {line}
        out[i] = p.v[0];
        """, header=PACK)
    with pytest.raises(em.EmulatorCompileError, match=message):
        run1(k, [mx.arange(16, dtype=mx.float32)], 4)


# ---------------------------------------------------------------------------------------------
# 2. templates and overloads on the address space (MLX passes inputs with fewer than 8 elements
#    as `const constant T*`)

SPACE_HEADER = """
template <typename P> struct Space;
template <typename T> struct Space<const device T*> { static constant constexpr int value = 1; };
template <typename T> struct Space<const constant T*> { static constant constexpr int value = 2; };
template <typename T> struct Space<threadgroup T*> { static constant constexpr int value = 3; };
inline int where(const device float* p) { return 10; }
inline int where(const constant float* p) { return 20; }
inline int where(threadgroup float* p) { return 30; }
inline int where(thread float* p) { return 40; }
"""
SPACE_BODY = """
threadgroup float tg[4];
float th[1] = {0};
uint i = thread_position_in_grid.x;
tg[i] = inp[i];
out[i] = float(Space<decltype(inp + 0)>::value * 1000 + Space<decltype(&tg[0])>::value * 100)
         + float(where(inp) + where(tg) + where(th)) + inp[i];
"""


@pytest.mark.parametrize("n, space", [(16, 1), (4, 2)])
def test_address_space_specialisations_and_overloads(n, space):
    k = em.metal_kernel("as_templates", ["inp"], ["out"], SPACE_BODY, header=SPACE_HEADER)
    o = run1(k, [mx.arange(n, dtype=mx.float32)], 4)
    where = 10 * space
    assert o.tolist() == [space * 1000 + 300 + where + 30 + 40 + j for j in range(4)]


def test_flat_address_spaces_still_run():
    """address_spaces=False compiles the keywords away (mismatches are then accepted)."""
    k = em.metal_kernel("as_flat", ["inp"], ["out"], """
        uint i = thread_position_in_grid.x;
        Pack p = reinterpret_cast<const device Pack*>(inp)[i];
        device float* wrong = (threadgroup float*)(out);   // accepted without the check
        wrong[i] = p.v[1];
        """, header=PACK)
    with em.checks(address_spaces=False):
        o = run1(k, [mx.arange(16, dtype=mx.float32)], 4)
    assert o.tolist() == [1, 5, 9, 13]
    with pytest.raises(em.EmulatorCompileError, match="address space"):
        run1(k, [mx.arange(16, dtype=mx.float32)], 4)


def test_program_scope_constant_data():
    """Program-scope `constant` data lives in the constant address space."""
    k = em.metal_kernel("as_globals", ["inp"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i] = kTable[i % kN] + lookup(kTable, (i + 1) % 4) * kCfg.a + kCfg.b;
        """, header="""
        constant float kTable[4] = {1.5f, 2.5f, 3.5f, 4.5f};
        constant constexpr int kN = 4;
        struct Cfg { float a; int b; };
        constant Cfg kCfg = {0.25f, 3};
        inline float lookup(const constant float* t, uint i) { return t[i]; }
        """)
    o = run1(k, [mx.zeros((8,))], 8, grid=(8, 1, 1), threadgroup=(8, 1, 1))
    t, i = np.array([1.5, 2.5, 3.5, 4.5]), np.arange(8)
    np.testing.assert_array_equal(o, t[i % 4] + t[(i + 1) % 4] * 0.25 + 3)


# ---------------------------------------------------------------------------------------------
# 3. alignas before a threadgroup declaration


def test_alignas_threadgroup_declaration():
    k = em.metal_kernel("tg_alignas", ["inp"], ["out"], """
        alignas(16) threadgroup float tg[16];
        uint i = thread_position_in_grid.x; alignas(32) threadgroup half h[8];
        tg[i] = inp[i];
        tg[i + 4] = 2 * inp[i];
        tg[i + 8] = 3 * inp[i];
        tg[i + 12] = 4 * inp[i];
        h[2 * i] = half(inp[i]);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        // 16-byte vector loads: the alignment is what makes them valid
        float4 v = reinterpret_cast<threadgroup float4*>(tg)[i];
        out[i] = v.x + v.y + v.z + v.w + float(h[2 * ((i + 1) % 4)]);
        """)
    x = np.array([1, 2, 3, 4], dtype=np.float32)
    o = run1(k, [mx.array(x)], 4)
    tg = np.concatenate([x, 2 * x, 3 * x, 4 * x])
    want = tg.reshape(4, 4).sum(1) + np.roll(x, -1)
    np.testing.assert_array_equal(o, want)


# ---------------------------------------------------------------------------------------------
# 4. vector constructors and casts through aliases: MSL converts component by component (a
#    same-size vector would otherwise be reinterpreted bit for bit)

CTOR_HEADER = """
template <typename T> struct Traits { using vec4 = vec<T, 4>; typedef vec<T, 2> vec2; };
typedef float4 F4;
#define V4 F4
#define CONVERT(Type, x) Type(x)
template <typename T> inline vec<T, 4> via_using(int4 x) { using T4 = vec<T, 4>; return T4(x); }
template <typename V> inline V via_param(int4 x) { return V(x); }
template <typename V> inline V via_c_cast(int4 x) { return (V)x; }
template <typename T> inline vec<T, 4> via_traits(int4 x) { return typename Traits<T>::vec4(x); }
template <typename V, typename A> inline V to(A x) { return V(x); }  // half(bfloat): via float
"""
CTOR_BODY = """
uint i = thread_position_in_grid.x;
int4 q = int4(i + 1, -2 * int(i), 100000, 7);
uint2 u = uint2(3000000000u, i);
float4 f = float4(0.5f, 1.5f, -2.5f, 65504.0f);
float4 r[11];
r[0] = via_using<float>(q);
r[1] = via_param<float4>(q);
r[2] = via_c_cast<float4>(q);
r[3] = via_traits<float>(q);
r[4] = decltype(f)(q);
r[5] = V4(q) + (F4)q * 0;
r[6] = CONVERT(float4, q);
r[7] = float4(Traits<float>::vec2(u), (typename Traits<float>::vec2)u);
r[8] = float4(to<half4>(f));
r[9] = float4(to<half>(bfloat(1.5f)), float(to<int4>(f).w), float(to<bfloat>(half(3.0h))), 0);
r[10] = float4(to<bfloat4>(to<half4>(f)));
float pair[2] = {0, 0};
thread float& e = decltype(pair[0])(pair[1]);  // a reference: the element itself
e = 5;
r[10].y += pair[1] - 5;
for (int k = 0; k < 11; ++k)
  for (int c = 0; c < 4; ++c) out[i * 44 + k * 4 + c] = r[k][c];
"""


def test_vector_constructors_through_aliases_convert():
    k = em.metal_kernel("ctor_aliases", ["inp"], ["out"], CTOR_BODY, header=CTOR_HEADER)
    o = run1(k, [mx.zeros((8,))], 176).reshape(4, 11, 4)
    for i in range(4):
        q = np.array([i + 1, -2 * i, 100000, 7], dtype=np.float32)
        for row in range(7):
            np.testing.assert_array_equal(o[i, row], q, err_msg=f"thread {i} row {row}")
        np.testing.assert_array_equal(o[i, 7], [3e9, i, 3e9, i])
        np.testing.assert_array_equal(o[i, 8], [0.5, 1.5, -2.5, 65504.0])
        np.testing.assert_array_equal(o[i, 9], [1.5, 65504.0, 3.0, 0])
        np.testing.assert_array_equal(o[i, 10], [0.5, 1.5, -2.5, 65536.0])  # bfloat rounding


def test_vector_constructor_through_alias_wrong_arity_is_an_error():
    k = em.metal_kernel("ctor_arity", ["inp"], ["out"], """
        out[thread_position_in_grid.x] = via(inp[0]).x;
        """, header="template <typename T> inline vec<T, 4> via(T x) {"
                    " using T4 = vec<T, 4>; return T4(x, x); }\n")
    with pytest.raises(em.EmulatorCompileError, match="wrong number of components"):
        run1(k, [mx.zeros((8,))], 4)
