"""The benchmark table, the timer and the runner behind ``python -m mlx_bricks.bench``."""
from __future__ import annotations

import os
import platform
import statistics
import sys
from typing import Callable

from mlx_bricks.bench.case import CPU, KERNEL, Benchmark
from mlx_bricks.bench.record import load_average, now, version

__all__ = ["BENCHMARKS", "CPU", "GROUPS", "KERNEL", "Benchmark", "run_benchmarks", "run_one",
           "time_call"]


def _kernel_status() -> tuple[bool, str]:
    from mlx_bricks.backends import backend_status

    why = []
    for name in ("metal", "cuda"):
        ok, reason = backend_status(name)
        if ok:
            return True, reason
        why.append(f"{name}: {reason}")
    return False, "; ".join(why)


def _cpu_status() -> tuple[bool, str]:
    ok, why = _kernel_status()
    if ok:
        return False, f"a kernel backend is available ({why}): the patch would not run on the CPU"
    return True, why


def _status(backend: str) -> tuple[bool, str]:
    from mlx_bricks.backends import backend_status

    if backend == KERNEL:
        return _kernel_status()
    if backend == CPU:
        return _cpu_status()
    return backend_status(backend)


def _check_repeats(repeats) -> None:
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")


def time_call(fn: Callable, repeats: int) -> list[float]:
    """Seconds per call of ``fn`` in each of ``repeats`` rounds, after a warm-up (see
    ``mlx_bricks.tune.timing.time_interleaved``: several calls per evaluation when one call is
    short, ``mx.synchronize`` before each clock read).

    Raises:
        ValueError: ``repeats`` < 1.
    """
    from mlx_bricks.tune.timing import time_interleaved

    _check_repeats(repeats)
    return time_interleaved({"fn": fn}, repeats=repeats).runs["fn"]


def _emulator_gemm_256():
    """The emulator speed target of issue 4: 256x256x256 float16 GEMM, 64x64 tiles, 128 threads
    per threadgroup, the emulator's default checks (bounds, unwritten elements, two schedules)."""
    import mlx.core as mx

    from mlx_bricks.ops import linear

    x = mx.random.normal((256, 256), key=mx.random.key(0)).astype(mx.float16)
    w = mx.random.normal((256, 256), key=mx.random.key(1)).astype(mx.float16)
    mx.eval(x, w)
    return (lambda: linear(x, w, tile="64x64", backend="emulator"),
            lambda: x @ w.T)


#: Forwards per evaluation in the e2e benchmarks: at M = 512 one forward of the 8B-shaped model
#: is about 2.5 ms on an H200, and rounds of 2 forwards varied by 10-15% between rounds (host
#: jitter), more than the difference being measured; 8 make a round about 20 ms.
E2E_MIN_CALLS = 8


def _e2e_benchmarks() -> dict[str, Benchmark]:
    from mlx_bricks.bench.e2e import (
        CPU_DTYPES,
        CPU_FORMATS,
        CPU_M_VALUES,
        DTYPES,
        FORMATS,
        GPT_OSS_20B_4LAYER,
        GPT_OSS_FORMAT,
        LLAMA_8B_4LAYER,
        M_VALUES,
        MOE_DTYPES,
        MOE_FORMATS,
        QWEN3_MOE_4LAYER,
        SMALL_GPT_OSS,
        SMALL_LLAMA,
        setup,
    )

    table = {}
    for suffix, fmt in FORMATS.items():
        for dtype in DTYPES if fmt is None else ("bf16",):
            for M in M_VALUES:
                name = f"e2e_llama8b_4layer_{dtype}{suffix}_m{M}"
                weights = ("" if fmt is None else
                           f", linears quantized {fmt[0]}-bit gs{fmt[1]} (nn.quantize)")
                table[name] = Benchmark(
                    name, KERNEL,
                    f"full-model prefill, M={M} tokens, {dtype}{weights}: 8B-shaped llama, 4 "
                    f"layers ({LLAMA_8B_4LAYER.describe()}), random weights; stock mlx-lm vs "
                    "patch_model(tune='auto') on the same weights",
                    lambda dtype=dtype, M=M, fmt=fmt: setup(LLAMA_8B_4LAYER, dtype, M, fmt=fmt),
                    min_calls=E2E_MIN_CALLS)
    for suffix, fmt in MOE_FORMATS.items():
        for dtype in MOE_DTYPES:
            for M in M_VALUES:
                name = f"e2e_qwen3_moe_4layer_{dtype}{suffix}_m{M}"
                weights = ("" if fmt is None else f", layers quantized {fmt[0]}-bit gs{fmt[1]} "
                           "(linears and experts; router float)")
                table[name] = Benchmark(
                    name, KERNEL,
                    f"full-model prefill, M={M} tokens, {dtype}{weights}: Qwen3-30B-A3B-shaped "
                    f"qwen3_moe, 4 layers ({QWEN3_MOE_4LAYER.describe()}), random weights; "
                    "stock mlx-lm vs patch_model(tune='auto') (each SwitchGLU through the MoE "
                    "brick where faster)",
                    lambda dtype=dtype, M=M, fmt=fmt: setup(QWEN3_MOE_4LAYER, dtype, M,
                                                            fmt=fmt),
                    min_calls=E2E_MIN_CALLS)
    for M in M_VALUES:
        name = f"e2e_gpt_oss20b_4layer_bf16_{GPT_OSS_FORMAT}_m{M}"
        table[name] = Benchmark(
            name, KERNEL,
            f"full-model prefill, M={M} tokens, bf16, experts {GPT_OSS_FORMAT}: gpt-oss-20b-"
            f"shaped gpt_oss, 4 layers ({GPT_OSS_20B_4LAYER.describe()}), random weights; "
            "stock mlx-lm vs patch_model(tune='auto') (each SwitchGLU through the MoE kind's "
            "dequant composite where faster; no kernel reads mxfp4)",
            lambda M=M: setup(GPT_OSS_20B_4LAYER, "bf16", M, fmt=GPT_OSS_FORMAT),
            min_calls=E2E_MIN_CALLS)
    for M in CPU_M_VALUES:
        name = f"e2e_small_gpt_oss_cpu_bf16_{GPT_OSS_FORMAT}_m{M}"
        table[name] = Benchmark(
            name, CPU,
            f"full-model prefill on the CPU, M={M} tokens, bf16, experts {GPT_OSS_FORMAT}: "
            f"small gpt_oss ({SMALL_GPT_OSS.layers} layers, {SMALL_GPT_OSS.describe()}), "
            "random weights; stock mlx-lm vs patch_model(tune='auto') with no kernel backend "
            "(the MoE composite)",
            lambda M=M: setup(SMALL_GPT_OSS, "bf16", M, fmt=GPT_OSS_FORMAT))
    for suffix, fmt in CPU_FORMATS.items():
        for dtype in CPU_DTYPES:
            for M in CPU_M_VALUES:
                name = f"e2e_small_llama_cpu_{dtype}{suffix}_m{M}"
                table[name] = Benchmark(
                    name, CPU,
                    f"full-model prefill on the CPU, M={M} tokens, {dtype}, linears quantized "
                    f"{fmt[0]}-bit gs{fmt[1]} (nn.quantize): small llama ({SMALL_LLAMA.layers} "
                    f"layers, {SMALL_LLAMA.describe()}), random weights; stock mlx-lm vs "
                    "patch_model(tune='auto') with no kernel backend (the composites)",
                    lambda dtype=dtype, M=M, fmt=fmt: setup(SMALL_LLAMA, dtype, M, fmt=fmt))
    return table


#: The benchmarks, by name.
BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("emulator_gemm_256", "emulator",
              "GEMM brick, M=N=K=256, float16, 64x64 tile, on the MSL emulator (CPU) vs "
              "stock x @ w.T on the MLX default device", _emulator_gemm_256),
)}
BENCHMARKS.update(_e2e_benchmarks())


def _cuda_case_benchmarks() -> dict[str, dict[str, Benchmark]]:
    """The CUDA twins vs stock MLX (``mlx_bricks.bench.gpu``), by group: ``cuda_kernels``
    (linear per weight format and projection, SwiGLU fused and split, RMSNorm + QKV, tile
    rule), ``cuda_tiles`` (per tile on 4- and 8-bit gs64 weights: every sm_90 linear tile,
    split-K included, every fused SwiGLU tile, split SwiGLU and RMSNorm + QKV per wgmma
    tile), ``cuda_dequantize``, ``cuda_attention``, ``cuda_decode`` and ``cuda_kv_cache``;
    each at the llama-3-8B shapes."""
    from mlx_bricks.bench import gpu
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda
    def setup(case):
        made = case.build()
        brick, stock, flops = made[:3]
        facts = {"flop": flops, **(made[3] if len(made) > 3 else {})}
        return brick, stock, lambda: facts

    sm90 = [n for n, t in gemm_cuda.LINEAR_TILES.items() if t.wgmma]
    # split SwiGLU and RMSNorm + QKV run the plain GEMM tiles (TILES: no split-K, no ws tile;
    # the register-weight qgemm tiles have their own benchmark: scripts/gpu/gemm_bench.py)
    sm90_plain = [n for n, t in gemm_cuda.TILES.items() if t.wgmma]
    per_tile = [*gpu.linear_cases("cuda", tiles=sm90, formats=gpu.QUANT_FORMATS,
                                  shapes=("qo", "kv", "gate_up")),
                *gpu.swiglu_cases("cuda", tiles=tuple(swiglu_cuda.SWIGLU_TILES),
                                  split_tiles=sm90_plain, formats=gpu.QUANT_FORMATS),
                *gpu.rms_norm_qkv_cases("cuda", tiles=sm90_plain, formats=gpu.QUANT_FORMATS)]
    families = {
        "cuda_kernels": [*gpu.linear_cases("cuda"), *gpu.swiglu_cases("cuda"),
                         *gpu.rms_norm_qkv_cases("cuda")],
        "cuda_tiles": per_tile,
        "cuda_dequantize": list(gpu.dequantize_cases()),
        "cuda_attention": list(gpu.attention_cases()),
        "cuda_decode": list(gpu.decode_cases()),
        "cuda_kv_cache": list(gpu.kv_cache_cases()),
    }
    return {group: {f"cuda_{c.name}": Benchmark(f"cuda_{c.name}", "cuda",
                                                f"CUDA twin {c.name} (llama-3-8B shapes) vs "
                                                "stock MLX", lambda c=c: setup(c))
                    for c in cases}
            for group, cases in families.items()}


CUDA_GROUPS = _cuda_case_benchmarks()
for _members in CUDA_GROUPS.values():
    BENCHMARKS.update(_members)


def _moe_benchmarks() -> dict[str, Benchmark]:
    """The MoE MLP, stock SwitchGLU vs the MoE brick: ``mlx_bricks.bench.moe``."""
    from mlx_bricks.bench.moe import benchmarks

    return benchmarks()


BENCHMARKS.update(_moe_benchmarks())


def _gated_delta_benchmarks() -> dict[str, Benchmark]:
    """The Gated DeltaNet recurrence and Qwen3.5-shaped prefills: ``bench.gated_delta``."""
    from mlx_bricks.bench.gated_delta import benchmarks

    return benchmarks()


def _formats_benchmarks() -> dict[str, Benchmark]:
    """The microscaled formats' composites vs stock on the CPU: ``mlx_bricks.bench.formats``."""
    from mlx_bricks.bench.formats import benchmarks

    return benchmarks()


def _ssm_benchmarks() -> dict[str, Benchmark]:
    """The SSD scan, the short conv and Nemotron-H / LFM2-shaped prefills: ``bench.ssm``."""
    from mlx_bricks.bench.ssm import benchmarks

    return benchmarks()


def _mla_benchmarks() -> dict[str, Benchmark]:
    """The DeepSeek-V3-shaped prefill and decode, the small CPU case: ``bench.mla``."""
    from mlx_bricks.bench.mla import benchmarks

    return benchmarks()


BENCHMARKS.update(_formats_benchmarks())
BENCHMARKS.update(_gated_delta_benchmarks())
BENCHMARKS.update(_ssm_benchmarks())
BENCHMARKS.update(_mla_benchmarks())


def _user_path_benchmarks() -> dict[str, Benchmark]:
    """mlx-lm's CLIs in fresh processes, stock and ``--use-bricks``: ``bench.user_path``."""
    from mlx_bricks.bench.user_path import benchmarks

    return benchmarks()


BENCHMARKS.update(_user_path_benchmarks())


def _server_benchmarks() -> dict[str, Benchmark]:
    """``mlx_lm.server`` stock vs ``--use-bricks`` with the openai client: ``bench.server``."""
    from mlx_bricks.bench.server import benchmarks

    return benchmarks()


BENCHMARKS.update(_server_benchmarks())
#: Benchmarks that run only when named (``--only``): the user's path and the server bench write
#: model directories (GBs at full size) and run dozens of processes.
ON_REQUEST = frozenset(n for n in BENCHMARKS if n.startswith(("user_path_", "server_")))

#: Names that stand for several benchmarks (``--only GROUP``).
GROUPS: dict[str, list[str]] = {
    **{group: list(members) for group, members in CUDA_GROUPS.items()},
    "moe": [n for n in BENCHMARKS if n.startswith("moe_")],
    "formats_cpu": [n for n in BENCHMARKS if n.startswith("formats_cpu_")],
    "e2e_llama8b_4layer": [n for n in BENCHMARKS if n.startswith("e2e_llama8b_4layer_")],
    "e2e_llama8b_4layer_float": [n for n in BENCHMARKS if n.startswith("e2e_llama8b_4layer_")
                                 and "_q" not in n],
    "e2e_llama8b_4layer_quantized": [n for n in BENCHMARKS
                                     if n.startswith("e2e_llama8b_4layer_") and "_q" in n],
    "e2e_small_llama_cpu": [n for n in BENCHMARKS if n.startswith("e2e_small_llama_cpu_")],
    "e2e_qwen3_moe_4layer": [n for n in BENCHMARKS if n.startswith("e2e_qwen3_moe_4layer_")],
    "user_path_cpu": [n for n in BENCHMARKS if n.startswith("user_path_cpu_")],
    "user_path_gpu": [n for n in BENCHMARKS if n.startswith("user_path_gpu_")],
    "server_cpu": [n for n in BENCHMARKS if n.startswith("server_cpu_")],
    "server_gpu": [n for n in BENCHMARKS if n.startswith("server_gpu_")],
    "gated_delta": [n for n in BENCHMARKS if n.startswith(("gdn_", "e2e_qwen35_", "kda_",
                                                            "e2e_kimi_", "decode_kimi_"))],
    "ssm": [n for n in BENCHMARKS if n.startswith(("ssd_scan_bf16", "short_conv_bf16",
                                                    "e2e_nemotron3_4layer", "e2e_lfm2_1b",
                                                    "decode_nemotron3", "decode_lfm2"))],
    "mamba1": [n for n in BENCHMARKS if n.startswith(("selective_scan_bf16", "e2e_jamba_4layer",
                                                      "e2e_falcon_mamba_4layer",
                                                      "decode_jamba", "decode_falcon_mamba"))],
    "ssm_cpu": [n for n in BENCHMARKS if n.startswith(("ssd_scan_cpu", "e2e_nemotron3_small",
                                                        "e2e_lfm2_small", "selective_scan_cpu",
                                                        "e2e_jamba_small"))],
    "e2e_deepseek_v3_4layer": [n for n in BENCHMARKS if n.startswith("e2e_deepseek_v3_4layer_")],
    "e2e_gpt_oss20b_4layer": [n for n in BENCHMARKS if n.startswith("e2e_gpt_oss20b_4layer_")],
    "e2e_small_gpt_oss_cpu": [n for n in BENCHMARKS if n.startswith("e2e_small_gpt_oss_cpu_")],
}


def expand(names) -> list[str]:
    """Benchmark names with groups replaced by their members (order kept, no duplicates).

    Raises:
        ValueError: an unknown name (listing the known ones).
    """
    out = []
    unknown = []
    for n in names:
        members = GROUPS.get(n, [n])
        for m in members:
            if m not in BENCHMARKS:
                unknown.append(n)
            elif m not in out:
                out.append(m)
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: "
                         f"{', '.join([*BENCHMARKS, *GROUPS])}")
    return out


def _peak_of(fn) -> dict:
    """Bytes of one evaluated call of ``fn`` (warm: after the timing): the peak of MLX's
    memory during it (``mx.get_peak_memory``, reset first) and the active memory before it
    (the inputs and weights), so ``peak - before`` is what the call itself allocated."""
    import mlx.core as mx

    mx.synchronize()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    return {"peak": mx.get_peak_memory(), "before": before}


def run_one(b: Benchmark, repeats: int) -> dict:
    """Run benchmark ``b`` (its backend is available) and return its result entry.

    Where stock raises ``RuntimeError`` on its first evaluation (no implementation for the
    shape on this backend), the entry holds ``stock_error`` and no stock figure (``ratio``,
    ``stock_s``, its runs, ``stock_tflops``, ``max_abs_diff`` None); the brick is timed alone."""
    import mlx.core as mx

    from mlx_bricks.tune.timing import time_interleaved

    mx.reset_peak_memory()
    made = b.setup()
    brick, stock = made[0], made[1]
    info = made[2] if len(made) > 2 else None
    entry = {}
    stock_error = None
    try:
        want = stock().astype(mx.float32)
        mx.eval(want)
    except RuntimeError as e:  # stock cannot run this case (MLX 0.32.4 CUDA: gather_qmm at
        # 65,536 rows): the stock side becomes the brick's own call and no stock figure exists
        stock_error, stock = str(e)[:500], brick
        want = None
    # a benchmark of a wrong result is meaningless: report how far apart they are
    if want is not None:
        entry["max_abs_diff"] = mx.abs(brick().astype(mx.float32) - want).max().item()
    timing = time_interleaved({"brick": brick, "stock": stock}, repeats=repeats,
                              min_calls=b.min_calls)
    entry["peak_memory"] = {"case": mx.get_peak_memory(),
                            **{side: _peak_of(fn) for side, fn in (("brick", brick),
                                                                   ("stock", stock))}}
    brick_runs, stock_runs = timing.runs["brick"], timing.runs["stock"]
    entry.update(brick_s=statistics.median(brick_runs), stock_s=statistics.median(stock_runs),
                 brick_runs_s=brick_runs, stock_runs_s=stock_runs,
                 calls_per_eval={"brick": timing.calls["brick"], "stock": timing.calls["stock"]})
    entry["ratio"] = entry["stock_s"] / entry["brick_s"]
    if info is not None:
        entry.update(info())
    if stock_error is not None:
        entry.setdefault("stock_error", stock_error)
    if "flop" in entry:
        entry["brick_tflops"] = entry["flop"] / entry["brick_s"] / 1e12
        entry["stock_tflops"] = entry["flop"] / entry["stock_s"] / 1e12
    if "stock_error" in entry:  # the "stock" side ran the brick: no stock figure exists
        for key in ("ratio", "stock_s", "stock_runs_s", "stock_tflops"):
            entry[key] = None
        entry["max_abs_diff"] = None
        entry["peak_memory"].pop("stock", None)
    return entry


def run_benchmarks(names=None, repeats: int = 3, on_result=None) -> dict:
    """Run the benchmarks ``names`` (default: all but :data:`ON_REQUEST`; group names expand)
    and return the JSON-ready result; ``on_result(partial)``, if given, gets the result so far
    after each benchmark (the CLI writes it, so a run stopped by a time limit keeps what it
    measured). A benchmark with ``run`` measures itself: its entry is what ``run`` returns.

    Returns:
        ``{"machine": ..., "mlx": version, "results": [...]}``; each result has ``name``,
        ``backend``, ``what`` and either ``max_abs_diff`` (brick vs stock output),
        ``brick_s``/``stock_s`` (median seconds per call), ``brick_runs_s``/``stock_runs_s``
        (every round), ``calls_per_eval`` and ``ratio`` (stock_s / brick_s: above 1 the brick is
        faster), ``peak_memory`` (bytes: ``case``, the peak since the benchmark's setup began,
        tuning included; ``brick`` / ``stock``, ``peak`` and ``before`` of one warm call each)
        and ``load_average`` (before and after), plus the benchmark's own facts, or
        ``skipped`` with the reason. At the top: ``date`` and ``finished`` (UTC), the MLX,
        mlx-lm and mlx-bricks versions.

    Raises:
        ValueError: an unknown name (listing the known ones), ``repeats`` < 1.
    """
    import mlx.core as mx

    _check_repeats(repeats)  # before any setup: a kernel build is not free
    names = ([n for n in BENCHMARKS if n not in ON_REQUEST] if names is None
             else expand(names))
    results = []
    started = now()

    def document():
        return {"date": started, "finished": now(),
                "machine": {"platform": platform.platform(), "processor": platform.machine(),
                            "cpus": os.cpu_count(), "device": str(mx.default_device()),
                            "device_info": {k: str(v) for k, v in mx.device_info().items()}},
                "mlx": mx.__version__, "mlx_lm": version("mlx-lm"),
                "mlx_bricks": version("mlx-bricks"), "repeats": repeats, "results": results}

    from tqdm import tqdm

    # progress on stderr where it is a terminal (a whole CPU run takes many minutes)
    bar = tqdm(names, desc="mlx-bricks bench", unit="case", file=sys.stderr, leave=False,
               disable=not sys.stderr.isatty())
    for name in bar:
        bar.set_postfix_str(name)
        b = BENCHMARKS[name]
        entry = {"name": b.name, "backend": b.backend, "what": b.what}
        ok, why = _status(b.backend)
        if not ok:
            entry["skipped"] = f"backend {b.backend} unavailable: {why}"
        else:
            entry["load_average"] = {"before": load_average()}
            entry.update(b.run(repeats) if b.run is not None else run_one(b, repeats))
            entry["load_average"]["after"] = load_average()
        results.append(entry)
        if on_result is not None:
            on_result(document())
    return document()
