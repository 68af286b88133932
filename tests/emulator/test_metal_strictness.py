"""The emulator refuses what Apple's compiler refuses where the two are known to differ, and
still accepts what Metal accepts (issue 28): bfloat conversions, the types of SIMD-group
functions, the 31-buffer limit; and the performance lint flags its two patterns and nothing
next to them."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import emulator as em
from mlx_bricks.emulator.lint import strided_loads


def _bf_kernel(name, body, header=""):
    return em.metal_kernel(name, ["x", "h"], ["y"], body, header)


def _run_bf(name, body, header="", template=(("T", mx.bfloat16),)):
    x = mx.array(np.linspace(-3, 3, 32).astype(np.float32))
    h = mx.array(np.linspace(1, 2, 32).astype(np.float16))
    (y,) = _bf_kernel(name, body, header)(
        inputs=[x, h], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(32,)],
        output_dtypes=[mx.float32], template=list(template))
    return np.array(y), np.array(x), np.array(h).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# bfloat: MSL 3.1 lets bfloat convert implicitly to float only.

BF_REFUSED = {
    "init_from_float": "bfloat b = 1.0f; y[i] = float(b);",
    "init_from_int": "bfloat b = 0; y[i] = float(b);",
    "init_from_float_expr": "bfloat b = x[i] * 2.0f; y[i] = float(b);",
    "template_init_from_float": "T b = x[i]; y[i] = float(b);",
    "template_init_from_zero": "T acc = 0; acc += T(x[i]); y[i] = float(acc);",
    "init_from_half": "bfloat b = h[i]; y[i] = float(b);",
    "to_half": "bfloat b = bfloat(x[i]); half v = b; y[i] = float(v);",
    "to_int": "bfloat b = bfloat(x[i]); int v = b; y[i] = float(v);",
    "assign_from_float": "T b = T(0); b = x[i]; y[i] = float(b);",
    "compound_with_float": "T b = T(x[i]); b += 1.0f; y[i] = float(b);",
    "times_int": "T b = T(x[i]); y[i] = float(b * 2);",
    "plus_half": "T b = T(x[i]); y[i] = float(b + h[i]);",
    "compare_with_int": "T b = T(x[i]); y[i] = b > 0 ? 1.0f : 0.0f;",
    "return_float_as_bfloat": "y[i] = float(f(x[i]));",
}
BF_REFUSED_HEADER = {"return_float_as_bfloat": "inline bfloat f(float v) { return v * 2.0f; }\n"}


@pytest.mark.parametrize("case", sorted(BF_REFUSED))
def test_bfloat_implicit_conversions_are_refused(case):
    body = "uint i = thread_position_in_grid.x;\n" + BF_REFUSED[case]
    # (clang refuses half -> __bf16 in the compile itself; the rest only the bfloat check)
    with pytest.raises(em.EmulatorCompileError, match="does not compile") as e:
        _run_bf(f"bf_refused_{case}", body, BF_REFUSED_HEADER.get(case, ""))
    assert "bfloat" in str(e.value)


# What Metal accepts, with the values it computes (bfloat rounding of each step).
BF_ACCEPTED = {
    "explicit_from_float": ("bfloat b = bfloat(x[i]); y[i] = b;", lambda x, h: _bf(x)),
    "explicit_from_int": ("bfloat b = bfloat(int(i)); y[i] = float(b);",
                          lambda x, h: np.arange(32, dtype=np.float32)),
    "static_cast_from_half": ("bfloat b = static_cast<bfloat>(h[i]); y[i] = b;",
                              lambda x, h: _bf(h)),
    "template_param_cast": ("T b = T(x[i]); T two = T(2); y[i] = float(b * two);",
                            lambda x, h: _bf(_bf(x) * 2)),
    "float_arithmetic": ("bfloat b = bfloat(x[i]); float f = b + 1.0f; y[i] = f;",
                         lambda x, h: _bf(x) + 1),
    "bfloat_arithmetic": ("bfloat b = bfloat(x[i]); bfloat c = b * b + b; y[i] = float(c);",
                          lambda x, h: _bf(_bf(_bf(x) * _bf(x)) + _bf(x))),
    "to_half_and_int_explicitly": (
        "bfloat b = bfloat(x[i]); y[i] = float(static_cast<half>(b)) + float(int(b));",
        lambda x, h: _bf(x).astype(np.float16).astype(np.float32) + np.trunc(_bf(x))),
    "compound_and_compare": (
        "bfloat b = bfloat(x[i]); b += bfloat(0.5f); y[i] = b > bfloat(0) ? float(b) : 0.0f;",
        lambda x, h: np.maximum(_bf(_bf(x) + 0.5), 0)),
    "math_and_limits": (
        "bfloat b = bfloat(x[i]); y[i] = float(max(abs(b), numeric_limits<bfloat>::min()));",
        lambda x, h: np.maximum(np.abs(_bf(x)), 2.0**-126)),
    "vector_elements": (
        "bfloat4 v = bfloat4(bfloat(x[i])); bfloat e = v.y; v.z = e; y[i] = float(v.z);",
        lambda x, h: _bf(x)),
}


def _bf(a):
    """float32 -> bfloat16 -> float32, round to nearest even (as the GPU and the shim)."""
    b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return b.view(np.float32)


@pytest.mark.parametrize("case", sorted(BF_ACCEPTED))
def test_bfloat_explicit_conversions_compile_and_round(case):
    body, want = BF_ACCEPTED[case]
    y, x, h = _run_bf(f"bf_accepted_{case}", "uint i = thread_position_in_grid.x;\n" + body)
    np.testing.assert_array_equal(y, want(x, h))


def test_bfloat_io_through_mlx_types():
    # MLX's signature: bfloat16_t buffers, T = bfloat16_t; the usual T(...) stores.
    k = em.metal_kernel("bf_io", ["a"], ["b"], """
        uint i = thread_position_in_grid.x;
        float v = a[i];
        b[i] = T(v * 3.0f) + a[i];
    """)
    a = mx.array(np.linspace(-2, 2, 16).astype(np.float32)).astype(mx.bfloat16)
    (b,) = k(inputs=[a], grid=(16, 1, 1), threadgroup=(16, 1, 1), output_shapes=[(16,)],
             output_dtypes=[mx.bfloat16], template=[("T", mx.bfloat16)])
    av = np.array(a.astype(mx.float32))
    np.testing.assert_array_equal(np.array(b.astype(mx.float32)), _bf(_bf(av * 3) + av))


# ---------------------------------------------------------------------------------------------
# SIMD-group functions: Metal's types only (plus MLX's bool / 64-bit shuffles).

SIMD_REFUSED = {
    "sum_bool": "bool v = i % 2; y[i] = simd_sum(v) ? 1 : 0;",
    "sum_long": "long v = i; y[i] = int(simd_sum(v));",
    "max_ulong": "ulong v = i; y[i] = int(simd_max(v));",
    "xor_shuffle_long": "long v = i; y[i] = int(simd_shuffle_xor(v, ushort(1)));",
    "broadcast_bool": "bool v = i == 3; y[i] = simd_broadcast(v, ushort(3)) ? 1 : 0;",
    "struct": "P p = {int(i)}; y[i] = simd_shuffle(p, ushort(0)).a;",
    "and_float": "float v = float(i); y[i] = int(simd_and(v));",
    "sum_long4": "long4 v = long4(i); y[i] = int(simd_sum(v).x);",
}


@pytest.mark.parametrize("case", sorted(SIMD_REFUSED))
def test_simd_functions_refuse_types_metal_lacks(case):
    k = em.metal_kernel(f"simd_refused_{case}", ["x"], ["y"],
                        "uint i = thread_position_in_grid.x;\n" + SIMD_REFUSED[case],
                        "struct P { int a; };\n")
    with pytest.raises(em.EmulatorCompileError, match="SIMD-group functions do not take"):
        k(inputs=[mx.zeros((32,), mx.int32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(32,)], output_dtypes=[mx.int32])


def test_simd_functions_take_metal_and_mlx_types():
    k = em.metal_kernel("simd_accepted", ["x"], ["y"], """
        uint i = thread_position_in_grid.x;
        ulong big = (ulong(i) << 40) | i;
        bool odd = i % 2;
        int a = int(simd_shuffle_down(big, ushort(1)) >> 40);  // MLX: 64-bit shuffles
        int b = simd_shuffle(odd, ushort(5)) ? 100 : 0;          // MLX: bool shuffles
        int c = int(simd_sum(half(1.0h)));
        int d = simd_shuffle_xor(uchar(i), ushort(1));
        int e = int(simd_sum(float4(1.0f)).w) + simd_and(int(0xFF)) + int(simd_max(short(i)));
        y[i] = a + b + c + d + e;
    """)
    (y,) = k(inputs=[mx.zeros((32,), mx.int32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
             output_shapes=[(32,)], output_dtypes=[mx.int32])
    i = np.arange(32)
    a = np.where(i < 31, i + 1, i)  # shuffle_down keeps the lane's own value past the end
    want = a + 100 + 32 + (i ^ 1) + 32 + 0xFF + 31
    np.testing.assert_array_equal(np.array(y), want)


# ---------------------------------------------------------------------------------------------
# 31 buffers


def _buffers_kernel(n_inputs, shape_of_first=False):
    names = [f"a{j}" for j in range(n_inputs)]
    body = "uint i = thread_position_in_grid.x;\ny[i] = a0[i]"
    body += " + a0_shape[0];" if shape_of_first else ";"
    k = em.metal_kernel(f"buffers_{n_inputs}_{shape_of_first}", names, ["y"], body)
    return k(inputs=[mx.ones((8,), mx.float32)] * n_inputs, grid=(8, 1, 1),
             threadgroup=(8, 1, 1), output_shapes=[(8,)], output_dtypes=[mx.float32])


def test_31_buffers_compile_32_do_not():
    (y,) = _buffers_kernel(30)  # 30 inputs + 1 output
    assert np.array(y).tolist() == [1.0] * 8
    with pytest.raises(em.EmulatorCompileError, match="needs 32 buffers; Metal allows 31"):
        _buffers_kernel(31)
    # MLX's <input>_shape parameter is a buffer too
    with pytest.raises(em.EmulatorCompileError, match="needs 32 buffers") as e:
        _buffers_kernel(30, shape_of_first=True)
    assert "past the limit: y" in str(e.value)


# ---------------------------------------------------------------------------------------------
# the lint

_LINT_HEADER = """
inline long offset(ulong e, const constant int* shape, const constant int64_t* strides, int n) {
  long off = 0;
  for (int a = n - 1; a >= 0; --a) {
    off += long(e % ulong(shape[a])) * strides[a];
    e /= ulong(shape[a]);
  }
  return off;
}
inline long offset32(uint e, const constant int* shape, const constant int64_t* strides, int n) {
  long off = 0;
  for (int a = n - 1; a >= 0; --a) {
    off += long(e % uint(shape[a])) * strides[a];
    e /= uint(shape[a]);
  }
  return off;
}
"""


def _lint(body, header=_LINT_HEADER, x=None):
    x = mx.zeros((4, 64), mx.float32) if x is None else x
    return em.lint_kernel("lint_case", ["x"], ["y"], body, header, inputs=[x],
                          output_dtypes=[mx.float32])


def test_lint_finds_64_bit_division_in_loops_only():
    findings = _lint("""
        uint i = thread_position_in_grid.x;
        ulong e = i;
        y[i] = x[offset(e, x_shape, x_strides, x_ndim)];      // 64-bit % and / in a loop
        y[i] += x[offset32(i, x_shape, x_strides, x_ndim)];   // 32-bit: fine
        y[i] += float(e / ulong(x_ndim + 1));                 // not in a loop: fine
        for (int j = 0; j < 4; ++j) y[i] += float(e / 127);   // constant divisor: fine
    """)
    assert {(f.rule, f.file, f.text.strip()) for f in findings} == {
        ("int64-division", "header", "off += long(e % ulong(shape[a])) * strides[a];"),
        ("int64-division", "header", "e /= ulong(shape[a]);"),
    }


def test_lint_finds_strided_scalar_loads_in_loops():
    text = """
for (int d = 0; d < D; ++d) acc += p[d * k_stride];
for (int d = 0; d < D; ++d) {
  acc += q[o + d * q_strides[3]];
  out[d * k_stride] = acc;           // a store
  acc += r[d];                       // unit stride
  acc += w[d * 4];                   // constant stride
  // lint-ok: strided-scalar-load the fallback of a vector path
  acc += p[d * k_stride];
}
acc += p[3 * k_stride];              // not in a loop
"""
    found = strided_loads("source", text)
    assert [(f.line, f.rule) for f in found] == [(2, "strided-scalar-load"),
                                                 (4, "strided-scalar-load")]


def test_lint_waiver_covers_int64_division():
    header = _LINT_HEADER.replace("    e /= ulong(shape[a]);",
                                  "    e /= ulong(shape[a]);  // lint-ok: int64-division why")
    findings = _lint("uint i = thread_position_in_grid.x;\n"
                     "y[i] = x[offset(ulong(i), x_shape, x_strides, x_ndim)];", header)
    assert [f.text.strip() for f in findings] == [
        "off += long(e % ulong(shape[a])) * strides[a];"]


def test_lint_rejects_unknown_rules():
    with pytest.raises(ValueError, match="unknown lint rules"):
        em.lint_kernel("k", ["x"], ["y"], "y[0] = x[0];", inputs=[mx.zeros((8,))],
                       output_dtypes=[mx.float32], rules=["nope"])
