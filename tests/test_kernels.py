"""Kernel registry: lazy, built once per backend, unique names, sources from package data."""
import importlib.resources

import mlx.core as mx
import pytest

from mlx_bricks import kernels
from mlx_bricks.kernels import KernelSpec


def test_every_registered_spec_has_its_sources():
    import mlx_bricks.bricks.attention.msl, mlx_bricks.bricks.gemm.msl  # noqa: F401
    import mlx_bricks.bricks.norm_qkv.msl, mlx_bricks.bricks.q8_0.op  # noqa: F401
    import mlx_bricks.bricks.swiglu.msl  # noqa: F401

    for name in kernels.registered():
        if kernels.has_kernel(name, "metal"):
            kname, header, body = kernels.kernel_source(name)
            assert kname.startswith(f"mlx_bricks_{name}_") and body.strip()
        if kernels.has_kernel(name, "cuda"):
            kname, header, body = kernels.kernel_source(name, "cuda")
            assert kname.startswith(f"mlx_bricks_cu_{name}_") and body.strip()
        assert kernels.has_kernel(name, "metal") or kernels.has_kernel(name, "cuda"), name


def test_cuda_sources_load_through_importlib_resources():
    files = importlib.resources.files("mlx_bricks.cuda_src")
    cuda = [p.name for p in files.iterdir() if p.name.endswith((".cu", ".cuh"))]
    assert "gemm.cuh" in cuda and "mma.cuh" in cuda
    for fname in cuda:
        assert kernels.read_source(fname, kernels.CUDA_SOURCE_PACKAGE) == \
            files.joinpath(fname).read_text()


def test_a_cuda_only_kernel_has_no_msl(monkeypatch):
    monkeypatch.setattr(kernels, "_SPECS", {})  # keep the throwaway spec out of the registry
    kernels.register(KernelSpec("test_cuda_only", None, ("inp",), ("out",), cuda_body="x.cu"))
    assert not kernels.has_kernel("test_cuda_only", "metal")
    assert kernels.has_kernel("test_cuda_only", "cuda")
    with pytest.raises(NotImplementedError, match="CUDA-only"):
        kernels.kernel_source("test_cuda_only", "metal")


def test_source_loads_through_importlib_resources():
    files = importlib.resources.files("mlx_bricks.metal_src")
    metal = [p.name for p in files.iterdir() if p.name.endswith((".metal", ".h"))]
    for fname in metal:
        assert kernels.read_source(fname) == files.joinpath(fname).read_text()


def test_missing_source_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no_such_file.metal"):
        kernels.read_source("no_such_file.metal")



@pytest.fixture(autouse=True)
def _registry_kept_clean():
    """The throwaway specs these tests register (named ``test_*``) leave the process's registry
    afterwards (other tests of the same worker compare the registry with every kernel the
    bricks drive); kernels that imports registered meanwhile stay."""
    before = set(kernels._SPECS)
    yield
    for name in [n for n in kernels._SPECS if n.startswith("test_") and n not in before]:
        del kernels._SPECS[name]

def test_unknown_kernel_lists_registered():
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.spec("no-such-kernel")


def test_reregistering_a_different_spec_is_refused():
    a = KernelSpec("test_dup", body="a.metal", input_names=("x",), output_names=("y",))
    kernels.register(a)
    kernels.register(a)  # same spec again: fine
    with pytest.raises(ValueError, match="already registered"):
        kernels.register(KernelSpec("test_dup", body="b.metal", input_names=("x",),
                                    output_names=("y",)))


def test_kernel_names_differ_by_source(monkeypatch, tmp_path):
    src = {"one.metal": "out[0] = inp[0];", "two.metal": "out[0] = 2 * inp[0];"}
    monkeypatch.setattr(kernels, "read_source", lambda f: src[f])
    kernels.register(KernelSpec("test_one", "one.metal", ("inp",), ("out",)))
    kernels.register(KernelSpec("test_two", "two.metal", ("inp",), ("out",)))
    assert kernels.kernel_source("test_one")[0] != kernels.kernel_source("test_two")[0]


def test_each_kernel_is_built_once(monkeypatch):
    built = []

    def fake_factory(**kw):
        built.append(kw["name"])
        return lambda **call: [call["inputs"][0] * 2]

    monkeypatch.setattr(mx.fast, "metal_kernel", fake_factory)
    monkeypatch.setattr(kernels, "read_source", lambda f: "out[0] = 2 * inp[0];")
    kernels.register(KernelSpec("test_once", "once.metal", ("inp",), ("out",)))
    kernels.get_kernel.cache_clear()
    before = kernels.BUILD_COUNTS[("test_once", "metal")]
    for _ in range(3):
        (y,) = kernels.launch("test_once", "metal", inputs=[mx.array([1.0])])
        assert y.item() == 2.0
    assert len(built) == 1
    assert kernels.BUILD_COUNTS[("test_once", "metal")] == before + 1
    assert kernels.LAUNCH_COUNTS[("test_once", "metal")] >= 3


def test_reference_backend_has_no_kernels():
    kernels.register(KernelSpec("test_ref", "x.metal", ("inp",), ("out",)))
    with pytest.raises(ValueError, match="has no kernels"):
        kernels.get_kernel("test_ref", "reference")
