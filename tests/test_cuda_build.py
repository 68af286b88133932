"""The persistent CUDA build cache (``mlx_bricks.cuda``): the translation unit handed to
NVRTC, the cache's keys and entries, the kernel object behind ``kernels.launch`` and its
fallback to ``mx.fast.cuda_kernel``. Runs without a GPU: NVRTC compiles where ``libnvrtc`` is
found (``MLX_BRICKS_NVRTC`` or the ``nvidia-cuda-nvrtc`` wheel), launches are recorded. The
bit-for-bit comparison with ``mx.fast.cuda_kernel`` runs on the GPU machine (``@gpu`` below and
``scripts/gpu_build_cache_check.py``).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import mlx.core as mx
import pytest

from mlx_bricks import cudacheck, kernels
from mlx_bricks.cuda import build as cuda_build
from mlx_bricks.cuda import source as cuda_source
from mlx_bricks.cuda import toolchain as cuda_toolchain
from mlx_bricks.kernels import KernelSpec
import mlx_bricks.bricks.attention.msl  # noqa: F401  (registers the specs)
import mlx_bricks.bricks.gemm.msl  # noqa: F401
from tests.gpu_support import gpu

NVRTC = cuda_toolchain.find_nvrtc()
needs_nvrtc = pytest.mark.skipif(
    NVRTC is None, reason="libnvrtc not found (nvidia-cuda-nvrtc wheel or MLX_BRICKS_NVRTC)")

#: A body reading shape, strides and ndim of a row-contiguous input (no current twin reads them
#: where precompiling can pass them, so this one covers the rebuilt parameters).
SHAPED_BODY = """
const int i = blockIdx.x * blockDim.x + threadIdx.x;
if (i < x_shape[0] * x_shape[1]) {
  const int r = i / x_shape[1], c = i % x_shape[1];
  out[i] = T(float(x[r * x_strides[0] + c * x_strides[1]]) * SCALE + float(x_ndim));
}
"""


@pytest.fixture(autouse=True)
def _clean(monkeypatch, tmp_path):
    """Each test: its own home, an empty record and note set, the cache on through the
    precompiled route unless the test sets another (the default route, MLX's own JIT cache, is
    ``test_enabled_reads_the_switch``'s)."""
    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(cuda_build.ENV_VAR, "precompiled")
    monkeypatch.setattr(cuda_build, "BUILD_SECONDS", {})
    monkeypatch.setattr(cuda_build, "BUILD_SOURCES", {})
    monkeypatch.setattr(cuda_build, "BUILD_ROUTES", {})
    monkeypatch.setattr(cuda_build, "_NOTED", set())
    before = set(kernels._SPECS)
    yield
    added = [n for n in kernels._SPECS if n.startswith("test_") and n not in before]
    for name in added:
        del kernels._SPECS[name]
    if added:  # their kernel objects hold this test's stand-ins
        kernels.get_kernel.cache_clear()


def _signature(src: str) -> tuple[str, str]:
    """(the text outside the kernel's signature, the signature)."""
    m = re.search(r"(?:extern \"C\" )?__global__ void \w+\(\n.*?\) \{\n", src, re.S)
    assert m, src[-400:]
    return src[:m.start()] + src[m.end():], m.group(0)


def test_unit_is_mlx_build_with_a_c_signature():
    """Outside the signature and the rebuilt shape locals, the unit is what cudacheck
    reproduces of MLX's build_kernel; the pointers come in MLX's order."""
    kname, header, body = kernels.kernel_source("gemm", "cuda")
    spec = kernels.spec("gemm")
    ins = [(n, mx.bfloat16 if n in ("x",) else mx.uint32, 2) for n in spec.inputs_for("cuda")]
    template = [("T", mx.bfloat16), ("BM", 128), ("WGMMA", True)]
    unit = cuda_source.translation_unit("k_gemm", header, body, ins, spec.output_names,
                                       [mx.bfloat16], template, spec.ensure_row_contiguous)
    mlx_src = cudacheck.generated_source("k_gemm", header, body, ins, spec.output_names,
                                         [mx.bfloat16], template)
    rest, sig = _signature(unit.source)
    mlx_rest, mlx_sig = _signature(mlx_src)
    local = re.compile(r"  (Shape \w+_shape = \{\};|\w+_shape\[\d\] = \w+;)\n")
    assert local.sub("", rest) == mlx_rest
    assert sig.startswith('extern "C" __global__ void k_gemm(')

    def pointers(s):
        return re.findall(r"(?:const )?[\w:]+\* \w+", s)
    assert pointers(sig) == pointers(mlx_sig)
    assert "x_shape" in body and "w_shape" in body  # gemm reads M, K, N from shapes
    assert unit.shape_args == ((0, "shape"), (1, "shape"))
    assert unit.scalars([(3, 4), (5, 6)] + [(1, 1)] * (len(ins) - 2)) == [3, 4, 5, 6]
    assert "  constexpr int BM = 128;\n  constexpr bool WGMMA = true;" in unit.source


def test_shape_strides_and_ndim_become_scalars_in_order():
    unit = cuda_source.translation_unit(
        "k", "", SHAPED_BODY, [("x", mx.float16, 2), ("s", mx.float32, 0)], ["out"],
        [mx.float16], [("T", mx.float16), ("SCALE", 3)])
    _, sig = _signature(unit.source)
    params = [p.strip() for p in sig.split("(", 1)[1].rsplit(")", 1)[0].split(",")]
    assert params == ["const __half* x", "const float* s", "__half* out",
                      "int x_shape_0", "int x_shape_1",
                      "int x_strides_lo0", "int x_strides_hi0",
                      "int x_strides_lo1", "int x_strides_hi1", "int x_ndim_arg"]
    assert unit.shape_args == ((0, "shape"), (0, "strides"), (0, "ndim"))
    assert unit.scalars([(5, 7), ()]) == [5, 7, 7, 0, 1, 0, 2]
    with pytest.raises(ValueError, match="ndim 3"):
        unit.scalars([(5, 7, 1), ()])


@pytest.mark.parametrize("stride", [1, 2**31 - 1, 2**31, 2**32 + 5, 3 * 2**33 + 2**31 + 9])
def test_int64_strides_survive_the_int_halves(stride):
    """The kernel rebuilds int64((uint64(uint32(hi)) << 32) | uint64(uint32(lo))) from the
    int32 scalars; the same arithmetic here gives the stride back."""
    unit = cuda_source.translation_unit("k", "", "out[0] = x[x_strides[0]];",
                                       [("x", mx.float32, 2)], ["out"], [mx.float32])
    lo, hi = unit.scalars([(1, stride)])[0:2]
    assert all(-2**31 <= v < 2**31 for v in (lo, hi))
    back = ((hi & 0xFFFFFFFF) << 32) | (lo & 0xFFFFFFFF)
    assert back == stride  # x (1, stride): strides (stride, 1)


def test_row_contiguous_strides():
    assert cuda_source.row_contiguous_strides((2, 3, 4)) == [12, 4, 1]
    assert cuda_source.row_contiguous_strides((5,)) == [1]
    assert cuda_source.row_contiguous_strides(()) == []


def test_views_whose_strides_are_read_are_refused():
    kname, header, body = kernels.kernel_source("flash_attention", "cuda")
    spec = kernels.spec("flash_attention")
    assert cuda_source.reads_view_strides(spec.inputs_for("cuda"), body, False)
    with pytest.raises(ValueError, match="strides of views"):
        cuda_source.translation_unit("k", header, body,
                                    [(n, mx.float16, 4) for n in spec.inputs_for("cuda")],
                                    spec.output_names, [mx.float16], (), False)
    # Row-contiguous inputs have known strides: the same body is accepted then.
    assert not cuda_source.reads_view_strides(spec.inputs_for("cuda"), body, True)


@pytest.mark.parametrize("bad", ["1k", "k-1", "k k", ""])
def test_func_name_must_be_an_identifier(bad):
    with pytest.raises(ValueError, match="func_name"):
        cuda_source.translation_unit(bad, "", "", [("x", mx.float32, 1)], ["y"], [mx.float32])


def test_template_tag_is_mlx_style():
    assert cuda_source.template_tag([("T", mx.bfloat16), ("N", 64), ("F", False),
                                    ("G", True)]) == "_bfloat16_64_f_t"
    assert cuda_source.template_tag([]) == ""


def test_arch_option_adds_a_from_sm90():
    assert cuda_toolchain.arch_option((9, 0)) == "--gpu-architecture=sm_90a"
    assert cuda_toolchain.arch_option((10, 0)) == "--gpu-architecture=sm_100a"
    assert cuda_toolchain.arch_option((8, 6)) == "--gpu-architecture=sm_86"


def test_include_options_follow_mlx(tmp_path, monkeypatch):
    root = tmp_path / "site" / "mlx"
    (root / "include" / "cccl").mkdir(parents=True)
    (tmp_path / "site" / "nvidia" / "cu13" / "include").mkdir(parents=True)
    assert cuda_toolchain.include_options(13, root) == [
        f"--include-path={root / 'include'}", f"--include-path={root / 'include' / 'cccl'}",
        f"--include-path={tmp_path / 'site' / 'nvidia' / 'cu13' / 'include'}"]
    cuda = tmp_path / "cuda"
    (cuda / "include" / "cccl").mkdir(parents=True)
    monkeypatch.setenv("CUDA_HOME", str(cuda))
    assert cuda_toolchain.include_options(12, root)[-1] == f"--include-path={cuda / 'include'}"


# ---------------------------------------------------------------------------------------------
# the disk cache, with a stand-in compiler

class FakeNvrtc:
    def __init__(self, version=(13, 0), fail=False):
        self.version, self.fail, self.calls = version, fail, []

    def compile(self, source, options, headers=None, name="kernel.cu", ptx=False):
        self.calls.append(name)
        if self.fail:
            raise cuda_toolchain.CompileError("NVRTC failed:\nkernel.cu(3): error: nope")
        return b"\x7fELF" + source.encode()[-64:]


def _toolchain(nvrtc=None, cc=(9, 0), mlx_version="0.32.4"):
    nv = nvrtc or FakeNvrtc()
    return cuda_toolchain.Toolchain(nv, cc, mlx_version,
                                ("--device-as-default-execution-space",
                                 cuda_toolchain.arch_option(cc), "--include-path=/x"))


def _unit(body="out[0] = x[0];", name="k"):
    return cuda_source.translation_unit(name, "", body, [("x", mx.float32, 1)], ["out"],
                                       [mx.float32])


def test_entry_key_covers_source_toolchain_and_versions():
    base = cuda_build.entry_key(_unit(), _toolchain())
    assert base == cuda_build.entry_key(_unit(), _toolchain())
    others = [
        cuda_build.entry_key(_unit("out[0] = x[1];"), _toolchain()),
        cuda_build.entry_key(_unit(), _toolchain(cc=(10, 0))),
        cuda_build.entry_key(_unit(), _toolchain(FakeNvrtc((13, 1)))),
        cuda_build.entry_key(_unit(), _toolchain(mlx_version="0.32.5")),
        cuda_build.entry_key(cuda_source.translation_unit(
            "k", "", "out[0] = x[0];", [("x", mx.float16, 1)], ["out"], [mx.float32]),
            _toolchain()),
    ]
    assert len({base, *others}) == 1 + len(others)
    assert _toolchain().tag == "mlx0.32.4-nvrtc13.0-sm_90a"


def test_build_once_then_load_then_rebuild_a_damaged_entry(tmp_path):
    nv = FakeNvrtc()
    tc, unit = _toolchain(nv), _unit()
    data, secs, how, _ = cuda_build.load_or_build("kern", "_t", unit, tc, tmp_path)
    assert how == "compiled" and len(nv.calls) == 1 and secs >= 0
    again, _, how, _ = cuda_build.load_or_build("kern", "_t", unit, tc, tmp_path)
    assert how == "loaded" and again == data and len(nv.calls) == 1
    cubin, note = cuda_build.entry_paths("kern", "_t", cuda_build.entry_key(unit, tc), tc,
                                         tmp_path)
    assert cubin.parent == tmp_path / "cuda" / tc.tag / "kern"
    assert json.loads(note.read_text())["func_name"] == "k"
    cubin.write_bytes(b"\x7fELF damaged")
    _, _, how, _ = cuda_build.load_or_build("kern", "_t", unit, tc, tmp_path)
    assert how == "compiled" and len(nv.calls) == 2
    note.unlink()  # a cubin without its note is an unfinished entry
    _, _, how, _ = cuda_build.load_or_build("kern", "_t", unit, tc, tmp_path)
    assert how == "compiled" and len(nv.calls) == 3


def test_enabled_reads_the_switch(monkeypatch):
    monkeypatch.delenv(cuda_build.ENV_VAR, raising=False)
    assert cuda_build.enabled() and cuda_build.mode() == "mlx"  # MLX's own launch path
    for off in ("0", "off", "False", "no"):
        monkeypatch.setenv(cuda_build.ENV_VAR, off)
        assert not cuda_build.enabled() and cuda_build.mode() == "off"
    monkeypatch.setenv(cuda_build.ENV_VAR, "1")
    assert cuda_build.enabled() and cuda_build.mode() == "mlx"
    monkeypatch.setenv(cuda_build.ENV_VAR, "Precompiled")
    assert cuda_build.enabled() and cuda_build.mode() == "precompiled"
    # read at every launch (parsed once per value): a bad value fails each time, a later good
    # one is seen
    for _ in range(2):
        monkeypatch.setenv(cuda_build.ENV_VAR, "sometimes")
        with pytest.raises(cuda_build.env.EnvError, match="MLX_BRICKS_CUDA_CACHE"):
            cuda_build.mode()
    monkeypatch.setenv(cuda_build.ENV_VAR, "off")
    assert cuda_build.mode() == "off"
    monkeypatch.delenv(cuda_build.ENV_VAR)
    assert cuda_build.mode() == "mlx"


# ---------------------------------------------------------------------------------------------
# the kernel object behind kernels.launch (MLX's launches recorded: no GPU here)

@pytest.fixture
def recorded(monkeypatch):
    """mx.fast.precompiled_cuda_kernel and mx.fast.cuda_kernel replaced by recorders."""
    calls = {"pre": [], "stock_built": [], "stock": []}

    def pre(**kw):
        calls["pre"].append(kw)
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    def cuda_kernel(**kw):
        calls["stock_built"].append(kw)

        def run(**call):
            calls["stock"].append(call)
            return [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]
        return run

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", pre)
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel)
    return calls


def _register_shaped(name="test_shaped"):
    kernels.register(KernelSpec(name, None, ("x",), ("out",), cuda_body="gemm_splitk_reduce.cu"))
    return name


def _launch(name, template=(("T", mx.float16), ("SCALE", 2)), smem=0, x=None):
    x = mx.zeros((4, 6), mx.float16) if x is None else x
    return kernels.launch(name, "cuda", shared_memory=smem, inputs=[x], grid=(24, 1, 1),
                          threadgroup=(32, 1, 1), output_shapes=[(4, 6)],
                          output_dtypes=[mx.float16], template=list(template))


def test_launch_builds_once_then_serves_precompiled(monkeypatch, recorded, tmp_path):
    nv = FakeNvrtc()
    monkeypatch.setattr(cuda_build, "toolchain", lambda: _toolchain(nv))
    monkeypatch.setattr(kernels, "read_source", lambda f, p=None: SHAPED_BODY
                        if f.endswith(".cu") else "")
    name = _register_shaped()
    for _ in range(3):
        _launch(name, smem=1024)
    assert len(nv.calls) == 1 and not recorded["stock_built"]
    pre = recorded["pre"]
    assert len(pre) == 3
    kname = kernels.kernel_source(name, "cuda")[0]
    assert pre[0]["name"] == f"{kname}_float16_2_smem1024"
    assert pre[0]["scalars"] == [4, 6, 6, 0, 1, 0, 2]
    assert pre[0]["grid"] == (24, 1, 1) and pre[0]["shared_memory"] == 1024
    assert pre[0]["ensure_row_contiguous"] is True
    assert pre[0]["compiled_source"].startswith(b"\x7fELF")
    key = (name, "_float16_2")
    assert cuda_build.BUILD_SOURCES[key] == "compiled"
    assert cuda_build.BUILD_ROUTES[key] == "precompiled"
    assert cuda_build.build_cost(name) == cuda_build.build_cost(name, [("T", mx.float16),
                                                                        ("SCALE", 2)]) >= 0
    assert cuda_build.build_cost(name, [("T", mx.float16), ("SCALE", 3)]) is None
    assert cuda_build.is_built(name) and cuda_build.is_built(name, [("T", mx.float16),
                                                                   ("SCALE", 2)])
    assert not cuda_build.is_built(name, [("T", mx.float16), ("SCALE", 3)])
    assert kernels.is_built(name) and kernels.build_cost(name) == cuda_build.build_cost(name)
    # A new process (a fresh kernel object) loads the entry: no compile.
    kernels.get_kernel.cache_clear()
    cuda_build.BUILD_SOURCES.clear()
    _launch(name, smem=1024)
    assert len(nv.calls) == 1 and cuda_build.BUILD_SOURCES[key] == "loaded"


def test_compile_error_falls_back_to_cuda_kernel_once(monkeypatch, recorded, capsys):
    monkeypatch.setattr(cuda_build, "toolchain", lambda: _toolchain(FakeNvrtc(fail=True)))
    name = _register_shaped()
    _launch(name)
    _launch(name)
    assert not recorded["pre"] and len(recorded["stock"]) == 2
    assert len(recorded["stock_built"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not cached" in err[0] and "NVRTC failed" in err[0]
    assert cuda_build.BUILD_ROUTES[(name, "_float16_2")] == "cuda_kernel"
    assert (name, "_float16_2") not in cuda_build.BUILD_SOURCES
    assert cuda_build.build_cost(name) is None


def test_no_toolchain_falls_back_with_one_note(monkeypatch, recorded, capsys):
    def none():
        raise cuda_toolchain.Unavailable("no libnvrtc found")
    monkeypatch.setattr(cuda_build, "toolchain", none)
    name = _register_shaped()
    _launch(name)
    _launch(name, template=(("T", mx.float16), ("SCALE", 5)))
    assert not recorded["pre"] and len(recorded["stock"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no libnvrtc found" in err[0]
    assert not cuda_build.is_built(name)


def test_an_mlx_without_precompiled_kernels_falls_back(monkeypatch, recorded, capsys):
    nv = FakeNvrtc()
    monkeypatch.setattr(cuda_build, "toolchain", lambda: _toolchain(nv))
    monkeypatch.delattr(mx.fast, "precompiled_cuda_kernel")
    name = _register_shaped()
    _launch(name)
    assert not nv.calls and len(recorded["stock"]) == 1
    assert "no mx.fast.precompiled_cuda_kernel" in capsys.readouterr().err


def test_switch_off_is_cuda_kernel_as_before(monkeypatch, recorded, capsys):
    nv = FakeNvrtc()
    monkeypatch.setattr(cuda_build, "toolchain", lambda: _toolchain(nv))
    monkeypatch.setenv(cuda_build.ENV_VAR, "0")
    name = _register_shaped()
    _launch(name, smem=2048)
    assert not nv.calls and not recorded["pre"] and len(recorded["stock"]) == 1
    built = recorded["stock_built"][0]
    assert built["name"].endswith("_smem2048") and built["shared_memory"] == 2048
    assert capsys.readouterr().err == ""


class FakeNamedNvrtc(FakeNvrtc):
    def compile_named(self, source, options, headers=None, name="kernel.cu", ptx=False,
                      expressions=()):
        return self.compile(source, options, headers, name, ptx), {
            e: f"_ZN3mlx4core2cu{len(e)}lowered" for e in expressions}


def test_view_strided_kernel_is_put_in_mlx_jit_cache(monkeypatch, recorded, tmp_path):
    """A body reading the strides of views runs on the cuda_kernel object; its exact source is
    compiled once and its cubin put where MLX's JIT reads it, under MLX's module name."""
    nv = FakeNamedNvrtc()
    monkeypatch.setattr(cuda_build, "toolchain", lambda: _toolchain(nv))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    kernels.register(KernelSpec("test_views", None, ("x",), ("out",), cuda_body="v.cu",
                                ensure_row_contiguous=False))
    monkeypatch.setattr(kernels, "read_source", lambda f, p=None: SHAPED_BODY)
    template = (("T", mx.float16), ("SCALE", 2))
    _launch("test_views", template=template, smem=512)
    assert not recorded["pre"] and len(recorded["stock"]) == 1
    built = recorded["stock_built"][0]
    kname = kernels.kernel_source("test_views", "cuda")[0]
    assert built["name"] == f"{kname}_smem512"
    func = f"custom_kernel_{kname}_smem512_float16_t_2"
    src = cudacheck.generated_source(func, "", built["source"], [("x", mx.float16, 2)],
                                     ("out",), [mx.float16], list(template))
    module = f"{func}_{cuda_source.std_hash(src.encode()):x}"
    ptx = tmp_path / "ptx" / f"{module}.ptx"
    assert ptx.read_bytes().startswith(b"\x7fELF")
    expr = f"mlx::core::cu::{func}"
    assert ptx.with_suffix(".txt").read_text() == f"{expr}\t_ZN3mlx4core2cu{len(expr)}lowered\n"
    assert cuda_build.BUILD_ROUTES[("test_views", "_float16_2")] == "mlx-cache"
    assert cuda_build.BUILD_SOURCES[("test_views", "_float16_2")] == "compiled"
    # A later process: loaded from the home cache, MLX's file rewritten if it went away.
    ptx.unlink()
    kernels.get_kernel.cache_clear()
    _launch("test_views", template=template, smem=512)
    assert len(nv.calls) == 1 and ptx.is_file()
    assert cuda_build.BUILD_SOURCES[("test_views", "_float16_2")] == "loaded"


def test_mlx_route_sends_every_kernel_through_mlx_jit_cache(monkeypatch, recorded, tmp_path):
    nv = FakeNamedNvrtc()
    monkeypatch.setattr(cuda_build, "toolchain", lambda: _toolchain(nv))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(kernels, "read_source", lambda f, p=None: SHAPED_BODY
                        if f.endswith(".cu") else "")
    name = _register_shaped()
    monkeypatch.setenv(cuda_build.ENV_VAR, "mlx")
    _launch(name)
    assert not recorded["pre"] and len(recorded["stock"]) == 1 and len(nv.calls) == 1
    assert cuda_build.BUILD_ROUTES[(name, "_float16_2")] == "mlx-cache"
    assert len(list((tmp_path / "ptx").glob("custom_kernel_*.ptx"))) == 1
    monkeypatch.setenv(cuda_build.ENV_VAR, "precompiled")  # the same object, the other route
    _launch(name)
    assert len(recorded["pre"]) == 1 and len(nv.calls) == 2
    assert cuda_build.BUILD_ROUTES[(name, "_float16_2")] == "precompiled"


def test_mlx_names_and_paths():
    assert cuda_source.mlx_kernel_name("k", [("T", mx.bfloat16), ("N", 3), ("B", True),
                                            ("U", mx.float32)]) == \
        "custom_kernel_k_bfloat16_t_3_t_float"
    long = "m" * 600
    p = cuda_build.mlx_ptx_path(cuda_build.Path("/c"), long)
    assert p == cuda_build.Path("/c", "m" * 245, "m" * 245, "m" * 110 + ".ptx")
    assert cuda_build.mlx_ptx_path(cuda_build.Path("/c"), "ab") == cuda_build.Path("/c/ab.ptx")


def test_mlx_ptx_cache_dir(monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", "/x/y")
    assert cuda_build.mlx_ptx_cache_dir() == cuda_build.Path("/x/y")
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("TMP", "/scratch")
    assert cuda_build.mlx_ptx_cache_dir() == cuda_build.Path("/scratch/mlx", mx.__version__,
                                                             "ptx")


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not found")
def test_std_hash_is_libstdcxx(tmp_path):
    """Against std::hash<std::string> of a program built here with g++ (libstdc++)."""
    prog = tmp_path / "h.cpp"
    prog.write_text('#include <cstdio>\n#include <iostream>\n#include <iterator>\n'
                    '#include <string>\nint main() { std::string s((std::istreambuf_iterator'
                    '<char>(std::cin)), std::istreambuf_iterator<char>());\n'
                    'std::printf("%zx\\n", std::hash<std::string>{}(s)); }\n')
    exe = tmp_path / "h"
    subprocess.run(["g++", "-O1", "-o", str(exe), str(prog)], check=True)
    kname, header, body = kernels.kernel_source("flash_attention", "cuda")
    for data in (b"", b"a", b"1234567", b"12345678", b"123456789", header.encode(),
                 (header + body).encode()):
        out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
        assert int(out, 16) == cuda_source.std_hash(data), data[:20]


# ---------------------------------------------------------------------------------------------
# NVRTC itself (where libnvrtc is at hand)

@needs_nvrtc
def test_nvrtc_builds_a_cubin_with_the_plain_symbol(tmp_path):
    tc = cuda_toolchain.make_toolchain((9, 0), NVRTC)
    unit = cuda_source.translation_unit(
        "mlx_bricks_test_shaped", "", SHAPED_BODY, [("x", mx.bfloat16, 2)], ["out"],
        [mx.bfloat16], [("T", mx.bfloat16), ("SCALE", 3)])
    data, _, how, _ = cuda_build.load_or_build("test_shaped", "_x", unit, tc, tmp_path)
    assert how == "compiled" and data.startswith(b"\x7fELF")
    assert b"mlx_bricks_test_shaped\0" in data  # extern "C": unmangled, as MLX looks it up
    with pytest.raises(cuda_toolchain.CompileError, match="NVRTC failed"):
        tc.compile(_unit("out[0] = undeclared_name;"))


@needs_nvrtc
def test_nvrtc_builds_a_gemm_twin_from_a_recorded_launch(monkeypatch, tmp_path):
    """One real twin, driven through its op with launches recorded (as test_cuda_compile)."""
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
    from mlx_bricks.bricks.norm_qkv import cuda as qkv_cuda

    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (8, 0))
    x = mx.zeros((40, 128), dtype=mx.float16)
    with cudacheck.recorded_launches(gemm_cuda, swiglu_cuda, qkv_cuda) as rec:
        gemm_cuda.linear(x, mx.zeros((64, 128), dtype=mx.float16), tile="64x64")
    (r,) = rec
    spec = kernels.spec(r.name)
    kname, header, body = kernels.kernel_source(r.name, "cuda")
    unit = cuda_source.translation_unit(
        f"{kname}{cuda_source.template_tag(r.template)}", header, body,
        [(n, d, nd) for n, (d, nd) in zip(spec.inputs_for("cuda"), r.inputs)],
        spec.output_names, r.output_dtypes, r.template, spec.ensure_row_contiguous)
    data = cuda_toolchain.make_toolchain((8, 0), NVRTC).compile(unit)
    assert data.startswith(b"\x7fELF") and unit.func_name.encode() + b"\0" in data


# ---------------------------------------------------------------------------------------------
# on the GPU: the cached kernel gives cuda_kernel's output bit for bit

@gpu
def test_cached_gemm_equals_cuda_kernel_bit_for_bit(monkeypatch):
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda

    x = mx.random.normal((300, 512)).astype(mx.bfloat16)
    w = mx.random.normal((256, 512)).astype(mx.bfloat16)
    y_cached = gemm_cuda.linear(x, w)
    mx.eval(y_cached)
    hows = {v for k, v in cuda_build.BUILD_SOURCES.items() if k[0] == "gemm"}
    assert hows and hows <= {"compiled", "loaded"}, hows
    monkeypatch.setenv(cuda_build.ENV_VAR, "0")
    y_stock = gemm_cuda.linear(x, w)
    assert mx.array_equal(y_cached, y_stock).item()


@needs_nvrtc
def test_nvrtc_builds_the_exact_mlx_source_of_a_view_kernel():
    """decode_attention reads the strides of views: its unit is MLX's own source, and the
    lowered name NVRTC reports for MLX's C++ name is the cubin's symbol."""
    import mlx_bricks.bricks.decode.op  # noqa: F401

    kname, header, body = kernels.kernel_source("decode_attention", "cuda")
    spec = kernels.spec("decode_attention")
    dts = [mx.float16] * 5 + [mx.int32, mx.float32]
    ins = [(n, d, 4 if i < 5 else 1) for i, (n, d) in enumerate(zip(spec.inputs_for("cuda"), dts))]
    template = [("T", mx.float16), ("D", 128), ("RT", 8), ("KV_Q8", False), ("CAUSAL", False)]
    unit = cuda_source.jit_unit(kname, header, body, ins, spec.output_names,
                               [mx.float32, mx.float32], template)
    assert unit.func_name == f"custom_kernel_{kname}_float16_t_128_8_f_f"
    assert unit.source == cudacheck.generated_source(unit.func_name, header, body, ins,
                                                     spec.output_names,
                                                     [mx.float32, mx.float32], template)
    data, meta = unit.build(cuda_toolchain.make_toolchain((9, 0), NVRTC))
    assert data.startswith(b"\x7fELF")
    lowered = meta["lowered"]
    assert unit.func_name in lowered and lowered.encode() + b"\0" in data


@needs_nvrtc
def test_prebuild_compiles_each_variant_once_in_parallel(monkeypatch, tmp_path):
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
    from mlx_bricks.bricks.norm_qkv import cuda as qkv_cuda

    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: (8, 0))
    monkeypatch.setattr(cuda_build, "toolchain",
                        lambda: cuda_toolchain.make_toolchain((8, 0), NVRTC))
    x = mx.zeros((40, 128), dtype=mx.float16)
    with cudacheck.recorded_launches(gemm_cuda, swiglu_cuda, qkv_cuda) as rec:
        for _ in range(2):  # the same variants twice: built once
            gemm_cuda.linear(x, mx.zeros((64, 128), dtype=mx.float16), tile="128x128k2")
    assert [r.name for r in rec] == ["gemm_splitk", "gemm_splitk_reduce"] * 2
    done = kernels.prebuild(rec, workers=2, root=tmp_path)
    assert sorted((k, how) for k, _, _, how in done) == [
        ("gemm_splitk", "compiled"), ("gemm_splitk_reduce", "compiled")]
    again = kernels.prebuild(rec, workers=2, root=tmp_path)
    assert {how for *_, how in again} == {"loaded"}
    tc = cuda_build.toolchain()
    assert len(list((tmp_path / "cuda" / tc.tag).glob("*/*.cubin"))) == 2


def _mlx_cuda_headers() -> dict[str, str] | None:
    """MLX's own device headers utils.cuh and complex.cuh, read out of its CUDA build's
    ``libmlx.so`` (``$MLX_BRICKS_MLX_LIB``, else the installed MLX's), where they are embedded
    as NUL-terminated text; None with a CPU build."""
    import os
    from pathlib import Path

    lib = Path(os.environ.get("MLX_BRICKS_MLX_LIB") or Path(mx.__file__).parent / "lib" /
               "libmlx.so")
    try:
        data = lib.read_bytes()
    except OSError:
        return None
    out = {}
    for name, anchor in (("utils.cuh", b"using Strides = cuda::std::array<int64_t, MAX_NDIM>;"),
                         ("complex.cuh", b"struct is_complex : cuda::std::false_type {};")):
        i = data.find(anchor)
        if i < 0:
            return None
        out[f"mlx/backend/cuda/device/{name}"] = data[data.rfind(b"\0", 0, i) + 1:
                                                       data.find(b"\0", i)].decode()
    return out


@needs_nvrtc
def test_stand_in_header_gives_the_cubin_of_mlx_own_headers():
    """With MLX's real device headers (from a CUDA build of MLX) NVRTC makes byte for byte the
    cubin it makes with DEVICE_HEADER: for a precompiled unit and for MLX's exact source of a
    view kernel (whose cubin MLX then loads as its own). Seen passing with MLX 0.32.4's
    libmlx.so (MLX_BRICKS_MLX_LIB) and the NVRTC 13.0 wheel."""
    from pathlib import Path

    real = _mlx_cuda_headers()
    if real is None:
        pytest.skip("no CUDA build of MLX here (set MLX_BRICKS_MLX_LIB to its libmlx.so)")
    import os

    lib = Path(os.environ.get("MLX_BRICKS_MLX_LIB") or Path(mx.__file__).parent / "lib" /
               "libmlx.so")
    tc = cuda_toolchain.make_toolchain((9, 0), NVRTC, mlx_root=lib.parent.parent)
    stand_in = {cuda_source.DEVICE_HEADER_NAME: cuda_source.DEVICE_HEADER}
    import mlx_bricks.bricks.decode.op  # noqa: F401
    import mlx_bricks.bricks.gemm.cuda  # noqa: F401

    kname, header, body = kernels.kernel_source("decode_attention", "cuda")
    spec = kernels.spec("decode_attention")
    dts = [mx.float16] * 5 + [mx.int32, mx.float32]
    ins = [(n, d, 4 if i < 5 else 1)
           for i, (n, d) in enumerate(zip(spec.inputs_for("cuda"), dts))]
    ju = cuda_source.jit_unit(kname, header, body, ins, spec.output_names,
                             [mx.float32, mx.float32],
                             [("T", mx.float16), ("D", 128), ("RT", 8), ("KV_Q8", False),
                              ("CAUSAL", False)])
    mine = tc.nvrtc.compile_named(ju.source, tc.options, stand_in, expressions=[ju.expression])
    theirs = tc.nvrtc.compile_named(ju.source, tc.options, real, expressions=[ju.expression])
    assert mine == theirs
    kname, header, body = kernels.kernel_source("gemm_splitk_reduce", "cuda")
    spec = kernels.spec("gemm_splitk_reduce")
    unit = cuda_source.translation_unit(
        "k", header, body, [(n, mx.float32 if n == "partial" else mx.bfloat16, 2)
                            for n in spec.inputs_for("cuda")],
        spec.output_names, [mx.bfloat16],
        [("T", mx.bfloat16), ("SPLIT", 2), ("HAS_BIAS", True), ("HAS_RESIDUAL", False)])
    assert tc.nvrtc.compile(unit.source, tc.options, stand_in) == \
        tc.nvrtc.compile(unit.source, tc.options, real)


#: One process's attention (a view kernel: MLX's JIT cache route) and GEMM (precompiled) on
#: the GPU, outputs saved for the comparison in the test below.
_GPU_CHILD = """
import sys, mlx.core as mx
from mlx_bricks.cuda import build as cuda_build
from mlx_bricks.bricks.attention.op import flash_attention
from mlx_bricks.bricks.gemm import cuda as gemm_cuda
k = [mx.random.key(i) for i in range(5)]
q = mx.random.normal((1, 150, 8, 128), key=k[0]).astype(mx.bfloat16).transpose(0, 2, 1, 3)
kk = mx.random.normal((1, 2, 170, 128), key=k[1]).astype(mx.bfloat16)
v = mx.random.normal((1, 2, 170, 128), key=k[2]).astype(mx.bfloat16)
x = mx.random.normal((300, 512), key=k[3]).astype(mx.bfloat16)
w = (mx.random.normal((256, 512), key=k[4]) * 0.05).astype(mx.bfloat16)
o = flash_attention(q, kk, v, scale=128 ** -0.5, mask="causal", backend="cuda")
y = gemm_cuda.linear(x, w)
mx.save_safetensors(sys.argv[1], {"o": o, "y": y})
print(sorted(set(cuda_build.BUILD_ROUTES.values())))
"""


@gpu
def test_cached_kernels_equal_cuda_kernel_in_fresh_processes(tmp_path):
    """Three fresh processes: the cache builds (empty home), the cache loads (same home, an
    empty MLX JIT cache: the view kernel's cubin must be put back there), and stock
    mx.fast.cuda_kernel (cache off, its own empty MLX JIT cache, MLX compiles); the outputs are
    equal bit for bit."""
    import os
    import sys

    def run(tag, cache):
        env = dict(os.environ, MLX_BRICKS_HOME=str(tmp_path / "home"),
                   MLX_PTX_CACHE_DIR=str(tmp_path / f"ptx-{tag}"),
                   MLX_BRICKS_CUDA_CACHE=cache)
        out = tmp_path / f"{tag}.safetensors"
        r = subprocess.run([sys.executable, "-c", _GPU_CHILD, str(out)], env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        return mx.load(str(out)), r.stdout

    built, routes = run("build", "1")
    assert "mlx-cache" in routes and "precompiled" in routes, routes
    loaded, _ = run("load", "1")
    assert list((tmp_path / "ptx-load").rglob("*.ptx")), "the view kernel was not put back"
    stock, routes = run("stock", "0")
    for name in ("o", "y"):
        assert mx.array_equal(built[name], stock[name]).item(), name
        assert mx.array_equal(loaded[name], stock[name]).item(), name
