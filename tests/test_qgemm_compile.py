"""The register-dequantizing GEMM kernels (``ws`` tiles: ``cuda_src/qgemm*.cu``) compile as MLX
builds them, for every architecture the package targets, and stay in registers.

The mma.sync consumer builds for sm_80, sm_86, sm_89, sm_90a, sm_120 and sm_121 (shared memory
and so the ring depth as on each: ``gemm_cuda.ws_plan``), the wgmma consumer for sm_90a. Every
kernel carries ``__launch_bounds__(384, 1)`` through qgemm.cuh's ``__global__`` macro, so ptxas
holds it to 168 registers per thread (the sm_90a consumers raise theirs to 224 with setmaxnreg):
a spill, a stack frame, a serialized wgmma or a missing bound fails here. Whether the kernels
compute the right values: tests/test_qgemm_cuda_emu.py (mma.sync, CPU emulation) and
tests/test_gemm_gpu.py (every tile on the GPU). Skipped without nvcc.
"""
from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_bricks.bricks.gemm.msl  # noqa: F401  (registers the kernel specs)
from mlx_bricks import cudacheck
from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
from tests.quant_support import weight

pytestmark = pytest.mark.skipif(cudacheck.find_nvcc() is None, reason="nvcc not found")

F16, BF16 = mx.float16, mx.bfloat16
#: Compute capability per target architecture.
ARCHS = {"sm_80": (8, 0), "sm_86": (8, 6), "sm_89": (8, 9), "sm_90a": (9, 0),
         "sm_120": (12, 0), "sm_121": (12, 1)}
#: Registers per thread ptxas may use at 384 threads (12 warps: 3 per SM sub-partition).
MAX_REGISTERS = 168


def _record(monkeypatch, arch, kind, tile, fmt, dtype, bias):
    monkeypatch.setattr(gemm_cuda, "device_capability", lambda: ARCHS[arch])
    M, N, K = 300, 520, 512
    x = mx.zeros((M, K), dtype=dtype)
    b = mx.zeros((N,), dtype=dtype) if bias else None
    with cudacheck.recorded_launches(gemm_cuda, swiglu_cuda) as rec:
        if kind == "linear":
            out = gemm_cuda.linear(x, weight(N, K, fmt, dtype, 1), b,
                                   mx.zeros((M, N), dtype=dtype) if bias else None, tile=tile)
        else:
            out = swiglu_cuda.swiglu(x, weight(N, K, fmt, dtype, 1), weight(N, K, fmt, dtype, 2),
                                     b, b, tile=tile, act=1 if bias else 0)
    assert out.shape == (M, N)
    (launch,) = rec
    assert launch.name == ("qgemm" if kind == "linear" else "qgemm_swiglu")
    assert launch.threadgroup == (gemm_cuda.WS_THREADS, 1, 1)
    assert launch.shared_memory <= gemm_cuda.max_shared_memory(ARCHS[arch])
    return launch


def _check(launch, arch):
    res = launch.compile(arch)
    assert res.stack == 0 and res.spill_stores == 0 and res.spill_loads == 0, (
        f"{launch.template}: {res} (local memory)")
    assert res.registers <= MAX_REGISTERS, (launch.template, res)  # the launch bound took
    assert not res.perf_notes, res.perf_notes


def _mma_cases():
    for arch in ARCHS:
        yield pytest.param("linear", "qmma128x128", (4, 64), BF16, True, arch,
                           id=f"linear-{arch}")
        slow = () if arch in ("sm_80", "sm_120") else pytest.mark.slow
        yield pytest.param("swiglu", "qmma128x64", (8, 32), F16, True, arch,
                           id=f"swiglu-{arch}", marks=slow)


def _wgmma_cases():
    fmts = (((4, 64), BF16, True), ((8, 32), F16, False), ((8, 128), BF16, True))
    for kind, table in (("linear", gemm_cuda.LINEAR_TILES), ("swiglu", swiglu_cuda.SWIGLU_TILES)):
        for tile in (n for n, t in table.items() if t.ws and t.wgmma):
            for i, (fmt, dtype, bias) in enumerate(fmts):
                yield pytest.param(kind, tile, fmt, dtype, bias, "sm_90a",
                                   id=f"{kind}-{tile}-{fmt[0]}bit-gs{fmt[1]}",
                                   marks=() if i == 0 else pytest.mark.slow)


@pytest.mark.parametrize("kind, tile, fmt, dtype, bias, arch",
                         [*_mma_cases(), *_wgmma_cases()])
def test_ws_kernel_compiles_in_registers(monkeypatch, kind, tile, fmt, dtype, bias, arch):
    _check(_record(monkeypatch, arch, kind, tile, fmt, dtype, bias), arch)


def test_ws_kernels_carry_their_launch_bound(monkeypatch):
    launch = _record(monkeypatch, "sm_90a", "linear", "qwg128x128", (4, 64), BF16, False)
    assert "__launch_bounds__(::bricks::kQThreads, 1)" in launch.source()


@pytest.mark.skipif(cudacheck.find_nvrtc() is None,
                    reason="libnvrtc not found (pip install nvidia-cuda-nvrtc, or MLX_BRICKS_NVRTC)")
def test_ws_kernels_compile_under_nvrtc(monkeypatch):
    for kind, tile in (("linear", "qwg256x128"), ("swiglu", "qwg128x128"),
                       ("linear", "qmma128x128")):
        cudacheck.compile_source_nvrtc(
            _record(monkeypatch, "sm_90a", kind, tile, (4, 64), BF16, True).source())
