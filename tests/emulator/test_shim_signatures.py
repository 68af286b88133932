"""The emulator's shim follows Apple's signatures where a kernel could come to rely on the
difference (issue 15, review fix 1): on a const ``simdgroup_matrix``, ``thread_elements()``
returns a copy of the lane's elements, not a reference."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import emulator as em


def test_const_thread_elements_is_a_copy():
    # A reference taken through the const overload must not see later writes to the matrix
    # (on Metal it is bound to a temporary copy).
    k = em.metal_kernel(
        "const_thread_elements", ["a"], ["o"],
        """
        const uint lane = thread_index_in_simdgroup;
        simdgroup_matrix<float, 8, 8> m = make_filled_simdgroup_matrix<float, 8, 8>(a[0]);
        const thread simdgroup_matrix<float, 8, 8>& cm = m;
        const thread auto& seen = cm.thread_elements();
        m.thread_elements()[0] = 2.0f * a[0];
        o[lane] = seen[0];
        o[32 + lane] = m.thread_elements()[0];
        """,
    )
    (o,) = k(inputs=[mx.array([1.5], dtype=mx.float32)], grid=(32, 1, 1),
             threadgroup=(32, 1, 1), output_shapes=[(64,)], output_dtypes=[mx.float32])
    o = np.array(o)
    np.testing.assert_array_equal(o[:32], 1.5)  # the copy
    np.testing.assert_array_equal(o[32:], 3.0)  # the reference


def test_address_of_const_thread_elements_does_not_compile():
    k = em.metal_kernel(
        "const_thread_elements_address", ["a"], ["o"],
        """
        const simdgroup_matrix<float, 8, 8> m = make_filled_simdgroup_matrix<float, 8, 8>(a[0]);
        const thread vec<float, 2>* p = &m.thread_elements();
        o[thread_index_in_simdgroup] = (*p)[0];
        """,
    )
    with pytest.raises(em.EmulatorCompileError, match="address of an rvalue"):
        k(inputs=[mx.array([1.5], dtype=mx.float32)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(32,)], output_dtypes=[mx.float32])
