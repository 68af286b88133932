"""The emulator's on-disk cache survives a fresh checkout: a clone gives metal_shim.h a new
mtime, and clang refuses a precompiled header whose recorded mtime differs (CI, 2026-12-01:
nine compile-error tests failed on "has been modified since the precompiled header")."""
from __future__ import annotations

import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlx_bricks import emulator as em
from mlx_bricks.emulator import compile as emc


@pytest.fixture
def fresh_shim(tmp_path, monkeypatch):
    """A private copy of the shim and an empty cache, so touching files here races nobody."""
    shim = tmp_path / "shim"
    shutil.copytree(emc.SHIM_DIR, shim)
    monkeypatch.setattr(emc, "SHIM_DIR", shim)
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path / "home"))
    return shim


def _kernel(name, scale):
    return em.metal_kernel(name, ["inp"], ["out"], f"""
        uint i = thread_position_in_grid.x;
        out[i] = inp[i] * {scale}.0f;
        """)


def _run(k):
    (o,) = k(inputs=[mx.arange(4, dtype=mx.float32)], grid=(4, 1, 1), threadgroup=(4, 1, 1),
             output_shapes=[(4,)], output_dtypes=[mx.float32])
    return np.array(o)


def test_new_shim_mtime_does_not_break_compiles(fresh_shim):
    assert _run(_kernel("pch_before", 2)).tolist() == [0, 2, 4, 6]
    assert list((fresh_shim.parent / "home" / "emulator").glob("shim_*.pch"))
    for n in ("metal_shim.h", "emu_abi.h"):
        st = (fresh_shim / n).stat()
        os.utime(fresh_shim / n, ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))
    # a kernel never compiled before: it must build against a valid header, not the stale PCH
    assert _run(_kernel("pch_after", 3)).tolist() == [0, 3, 6, 9]


def test_compile_error_after_new_mtime_is_the_kernels_own(fresh_shim):
    _run(_kernel("pch_warm", 2))
    st = (fresh_shim / "metal_shim.h").stat()
    os.utime(fresh_shim / "metal_shim.h", ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))
    k = em.metal_kernel("pch_bad", ["inp"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i] = undeclared_name;
        """)
    with pytest.raises(em.EmulatorCompileError, match="undeclared_name") as e:
        _run(k)
    assert "precompiled header" not in str(e.value)


def test_stale_pch_handed_to_a_compile_is_dropped(fresh_shim, monkeypatch):
    # a header touched between taking the PCH key and compiling (another process, a checkout)
    _run(_kernel("pch_first", 2))
    (old,) = (fresh_shim.parent / "home" / "emulator").glob("shim_*.pch")
    st = (fresh_shim / "metal_shim.h").stat()
    os.utime(fresh_shim / "metal_shim.h", ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))
    monkeypatch.setattr(emc, "_precompiled_shim", lambda *a: ["-include-pch", str(old)])
    assert _run(_kernel("pch_stale", 5)).tolist() == [0, 5, 10, 15]


def test_a_changed_compiler_driver_does_not_reuse_kernel_objects(fresh_shim, monkeypatch):
    # The copy patches and link flags live in compile.py: an object built by another version of
    # it must not be served from the cache.
    cache = fresh_shim.parent / "home" / "emulator"
    _run(_kernel("driver_v1", 2))
    before = set(cache.glob("k_*.so"))
    monkeypatch.setattr(emc, "_driver_text", lambda: "another compile.py")
    monkeypatch.setattr(emc, "_loaded", {})
    monkeypatch.setattr(emc, "_by_source", {})
    assert _run(_kernel("driver_v1", 2)).tolist() == [0, 2, 4, 6]
    assert len(set(cache.glob("k_*.so")) - before) == 1
