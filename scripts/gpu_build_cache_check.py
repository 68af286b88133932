#!/usr/bin/env python3
"""GPU check of the CUDA build cache (``mlx_bricks.cuda``), on the GPU machine.

Runs every CUDA kernel variant the patch can choose for a set of representative cases (each
brick's op kind with its candidates on ``cuda``: every tile / variant / composite, float16 and
bfloat16, float and affine weights; attention with its causal / window / soft-cap / Q8_0 /
padded-batch forms at head_dim 64 and 128; decode attention), in three fresh processes:

1. ``build``: an empty ``MLX_BRICKS_HOME``; the cases' launches are recorded (outputs are zeros),
   their variants compiled in parallel (``kernels.prebuild``), then every case runs on the
   GPU through the cache;
2. ``load``: the same home; every variant must load from disk (none compiled); a launch-overhead
   probe compares a precompiled kernel with its ``mx.fast.cuda_kernel`` twin;
3. ``stock``: ``MLX_BRICKS_CUDA_CACHE=0`` and an empty ``MLX_PTX_CACHE_DIR``: MLX compiles every
   kernel itself, as before the cache.

Then each case's outputs from ``build`` and ``load`` are compared with ``stock``'s bit for bit,
and the build / load / stock wall times and per-variant routes are printed and written as JSON.

Usage (PYTHONPATH holding MLX's CUDA build and this checkout):
    python3 scripts/gpu_build_cache_check.py [--out DIR] [--full] [--workers N]
or one step per call (the machine must stay warm between them; the work directory holds the
state): ``--work DIR --phase build``, then ``load``, ``stock``, ``report``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# the cases (the same inputs in every process: explicit random keys)

def _rand(shape, dtype, seed, scale=1.0):
    import mlx.core as mx

    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


def _weight(N, K, fmt, dtype, seed):
    import mlx.core as mx

    from mlx_bricks.formats.affine import QuantizedWeight

    w = _rand((N, K), dtype, seed, K ** -0.5)
    if fmt is None:
        return w
    bits, gs = fmt
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return QuantizedWeight(q, s, b, gs, bits)


def _expert_weight(E, N, K, fmt, dtype, seed):
    import mlx.core as mx

    from mlx_bricks.formats.affine import QuantizedWeight

    w = _rand((E, N, K), dtype, seed, K ** -0.5)
    if fmt is None:
        return w
    bits, gs = fmt
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return QuantizedWeight(q, s, b, gs, bits)


def kind_args(quick: bool):
    """``[(label, kind name, args), ...]`` of the representative calls."""
    import mlx.core as mx

    from mlx_bricks.bricks.q8_0.op import quantize_q8_0

    dtypes = (mx.bfloat16,) if quick else (mx.bfloat16, mx.float16)
    fmts = (None, (4, 64)) if quick else (None, (4, 64), (8, 32), (3, 64), (6, 64))
    out, seed = [], 0

    def s():
        nonlocal seed
        seed += 1
        return seed

    for dt in dtypes:
        dn = str(dt).split(".")[-1]
        for fmt in fmts:
            fn = "float" if fmt is None else f"q{fmt[0]}g{fmt[1]}"
            x = _rand((2, 150, 512), dt, s())
            for bias, res in ((False, True), (True, False)):
                out.append((f"linear/{dn}/{fn}/bias{int(bias)}res{int(res)}", "linear", {
                    "x": x, "weight": _weight(1024, 512, fmt, dt, s()),
                    "bias": _rand((1024,), dt, s()) if bias else None,
                    "residual": _rand((2, 150, 1024), dt, s()) if res else None}))
            for act in ("silu", "gelu_tanh"):
                out.append((f"swiglu/{dn}/{fn}/{act}", "swiglu_mlp", {
                    "x": x, "w_gate": _weight(1024, 512, fmt, dt, s()),
                    "w_up": _weight(1024, 512, fmt, dt, s()),
                    "w_down": _weight(512, 1024, fmt, dt, s()),
                    "residual": _rand((2, 150, 512), dt, s()), "activation": act}))
            out.append((f"rms_norm_qkv/{dn}/{fn}", "rms_norm_qkv", {
                "x": x, "norm_weight": _rand((512,), dt, s()), "eps": 1e-5,
                "wq": _weight(512, 512, fmt, dt, s()), "wk": _weight(128, 512, fmt, dt, s()),
                "wv": _weight(128, 512, fmt, dt, s()), "n_heads": 8, "n_kv_heads": 2,
                "head_dim": 64}))
            if fmt in (None, (4, 64)):
                E, top = 8, 2
                out.append((f"moe/{dn}/{fn}", "moe_mlp", {
                    "x": _rand((1, 200, 512), dt, s()),
                    "indices": mx.random.randint(0, E, (1, 200, top), key=mx.random.key(s())),
                    "w_gate": _expert_weight(E, 256, 512, fmt, dt, s()),
                    "w_up": _expert_weight(E, 256, 512, fmt, dt, s()),
                    "w_down": _expert_weight(E, 512, 256, fmt, dt, s())}))
        for D in ((128,) if quick else (64, 128)):
            q = _rand((2, 8, 150, D), dt, s())
            k = _rand((2, 2, 170, D), dt, s())
            v = _rand((2, 2, 170, D), dt, s())
            base = {"q": q, "k": k, "v": v, "scale": D ** -0.5, "mask": "causal",
                    "kv_quant": None}
            forms = {"causal": {}, "window": {"window": 64}, "softcap": {"softcap": 30.0},
                     "q8_0": {"k": quantize_q8_0(k, backend="reference"),
                              "v": quantize_q8_0(v, backend="reference"), "kv_quant": "q8_0"},
                     "kv_start": {"kv_start": mx.array([0, 37], mx.int32)},
                     "transposed_q": {"q": _rand((2, 150, 8, D), dt, s()).transpose(0, 2, 1, 3)}}
            for name, extra in forms.items():
                out.append((f"attention/{dn}/D{D}/{name}", "attention", {**base, **extra}))
    return out


def cases(quick: bool):
    """``[(label, fn), ...]``: one per (call, candidate variant on cuda) plus decode attention;
    ``fn()`` returns the outputs."""
    import mlx.core as mx

    from mlx_bricks.bricks import kinds
    from mlx_bricks.bricks.decode.op import decode_attention
    from mlx_bricks.bricks.q8_0.op import quantize_q8_0

    K = kinds()
    out = []
    for label, kname, args in kind_args(quick):
        kind = K[kname]
        dtype = kind.dtype(args)
        try:
            variants = kind.variants("cuda", dtype, args)
        except Exception as e:  # report, do not hide: the case is listed as an error
            out.append((label, _raiser(e)))
            continue
        for v in variants:
            out.append((f"{label}/{v.name}", lambda kind=kind, v=v, args=args:
                        kind.run(v, args, "cuda")))
    seed = 10_000
    for dt in ((mx.bfloat16,) if quick else (mx.bfloat16, mx.float16)):
        for D in (64, 128):
            for q8 in (False, True):
                seed += 3
                q = _rand((1, 16, 1, D), dt, seed)
                k = _rand((1, 4, 3000, D), dt, seed + 1)
                v = _rand((1, 4, 3000, D), dt, seed + 2)
                if q8:
                    k, v = (quantize_q8_0(k, backend="reference"),
                            quantize_q8_0(v, backend="reference"))
                dn = str(dt).split(".")[-1]
                out.append((f"decode/{dn}/D{D}/q8{int(q8)}",
                            lambda q=q, k=k, v=v, q8=q8: decode_attention(
                                q, k, v, scale=q.shape[-1] ** -0.5,
                                kv_quant="q8_0" if q8 else None, backend="cuda")))
    return out


def _raiser(e):
    def f():
        raise e
    return f


def _flat(out):
    if isinstance(out, (tuple, list)):
        return [a for o in out for a in _flat(o)]
    return [out]


# ---------------------------------------------------------------------------------------------
# recording launches at the seam (for the parallel prebuild)

@contextlib.contextmanager
def recording():
    """Every kernel launch records what it would build and returns zeros instead of running."""
    import mlx.core as mx

    from mlx_bricks import cudacheck, kernels

    records = []
    real = kernels.get_kernel

    def fake(name, backend, shared_memory=0):
        if backend != "cuda":
            return real(name, backend, shared_memory)

        def call(*, inputs, output_shapes, output_dtypes, template=(), **_):
            arrays = [a if isinstance(a, mx.array) else mx.array(a) for a in inputs]
            records.append(cudacheck.Launch(name, [(a.dtype, a.ndim) for a in arrays],
                                            list(output_dtypes), list(template), shared_memory))
            return [mx.zeros(sh, dtype=dt) for sh, dt in zip(output_shapes, output_dtypes)]
        return call

    kernels.get_kernel = fake
    try:
        yield records
    finally:
        kernels.get_kernel = real


# ---------------------------------------------------------------------------------------------
# one phase (a fresh process)

def run_cases(quick: bool, out_file: Path) -> dict:
    import mlx.core as mx

    res = {"cases": {}, "errors": {}}
    arrays = {}
    t_all = time.perf_counter()
    for label, fn in cases(quick):
        t0 = time.perf_counter()
        try:
            outs = _flat(fn())
            mx.eval(*outs)
            mx.synchronize()
        except Exception as e:  # a failing case is reported, the others still run
            res["errors"][label] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            continue
        res["cases"][label] = round(time.perf_counter() - t0, 4)
        for i, a in enumerate(outs):
            arrays[f"{label}#{i}"] = a
    res["wall_s"] = round(time.perf_counter() - t_all, 3)
    mx.save_safetensors(str(out_file), arrays)
    return res


def launch_overhead(n: int = 300) -> dict:
    """Microseconds per launch of one small GEMM, ``n`` chained launches in one evaluation,
    through the precompiled kernel, through ``mx.fast.cuda_kernel`` loading from MLX's JIT
    cache (``MLX_BRICKS_CUDA_CACHE=mlx``) and through ``mx.fast.cuda_kernel`` as before."""
    import mlx.core as mx

    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    from mlx_bricks.cuda import build as cuda_build

    x = _rand((16, 512), mx.bfloat16, 7)
    w = _rand((512, 512), mx.bfloat16, 8, 0.04)
    out = {}
    for mode, env in (("precompiled", "1"), ("mlx-cache", "mlx"), ("cuda_kernel", "0")):
        os.environ[cuda_build.ENV_VAR] = env
        for _ in range(2):  # the first builds / loads
            y = x
            for _ in range(n):
                y = gemm_cuda.linear(y, w)
            t0 = time.perf_counter()
            mx.eval(y)
            mx.synchronize()
            dt = time.perf_counter() - t0
        out[mode] = round(dt / n * 1e6, 2)
    os.environ[cuda_build.ENV_VAR] = "1"
    return out


def phase(name: str, work: Path, quick: bool, workers: int) -> None:
    import mlx.core as mx

    from mlx_bricks import kernels
    from mlx_bricks.cuda import build as cuda_build

    assert mx.cuda.is_available(), "no CUDA device"
    res = {"phase": name, "mlx": mx.__version__, "device": mx.device_info().get("device_name")}
    t0 = time.perf_counter()
    if name == "build":
        with recording() as recs:
            for label, fn in cases(quick):
                with contextlib.suppress(Exception):
                    mx.eval(*_flat(fn()))
        res["recorded_launches"] = len(recs)
        t1 = time.perf_counter()
        built = kernels.prebuild(recs, workers=workers)
        res["prebuild_wall_s"] = round(time.perf_counter() - t1, 3)
        res["prebuild"] = [{"kernel": k, "tag": t, "seconds": round(sec, 3), "how": h}
                           for k, t, sec, h in built]
        res["toolchain"] = cuda_build.toolchain().tag
        res["nvrtc"] = cuda_build.toolchain().nvrtc.path
    res.update(run_cases(quick, work / f"{name}.safetensors"))
    res["process_s"] = round(time.perf_counter() - t0, 3)
    res["variants"] = [{"kernel": k, "tag": t, "route": cuda_build.BUILD_ROUTES.get((k, t)),
                        "how": cuda_build.BUILD_SOURCES.get((k, t)),
                        "seconds": round(cuda_build.BUILD_SECONDS.get((k, t), 0.0), 4)}
                       for k, t in sorted(cuda_build.BUILD_ROUTES)]
    if name == "load":
        res["launch_overhead_us"] = launch_overhead()
    (work / f"{name}.json").write_text(json.dumps(res, indent=1))


# ---------------------------------------------------------------------------------------------
# the driver

def compare(work: Path) -> dict:
    import mlx.core as mx

    stock = mx.load(str(work / "stock.safetensors"))
    report = {}
    for name in ("build", "load"):
        mine = mx.load(str(work / f"{name}.safetensors"))
        same, differ, missing = 0, [], []
        for key, ref in stock.items():
            if key not in mine:
                missing.append(key)
            elif mx.array_equal(mine[key], ref, equal_nan=True).item():
                same += 1
            else:
                err = mx.max(mx.abs(mine[key].astype(mx.float32) - ref.astype(mx.float32)))
                differ.append(f"{key} (max |diff| {err.item():.3g})")
        report[name] = {"bit_equal": same, "differ": differ, "missing": missing,
                        "extra": sorted(set(mine) - set(stock))}
    return report


def report(work: Path, out: Path, workers: int) -> int:
    """Compare the phases' outputs, print the summary, write the JSON; 0 when all is well."""
    summary = {n: json.loads((work / f"{n}.json").read_text()) for n in ("build", "load", "stock")}
    summary["compare"] = compare(work)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_build_cache_check.json").write_text(json.dumps(summary, indent=1))

    b, ld, st = summary["build"], summary["load"], summary["stock"]
    print(f"device {b['device']}, MLX {b['mlx']}, toolchain {b.get('toolchain')}")
    print(f"recorded launches {b['recorded_launches']}, distinct variants {len(b['prebuild'])}, "
          f"prebuild wall {b['prebuild_wall_s']} s with {workers} workers, "
          f"sum of compile times {sum(x['seconds'] for x in b['prebuild']):.1f} s")
    errs = [x for x in b["prebuild"] if x["how"].startswith("error")]
    for x in errs:
        print(f"  build error: {x['kernel']}{x['tag']}: {x['how']}")
    print(f"cases run: build {len(b['cases'])}, load {len(ld['cases'])}, stock {len(st['cases'])}")
    print(f"first run of every case (wall, s): build {b['wall_s']} (after prebuild), "
          f"load {ld['wall_s']}, stock (MLX compiles) {st['wall_s']}")
    compiled = [v for v in ld["variants"] if v["how"] == "compiled"]
    routes = {}
    for v in ld["variants"]:
        routes[v["route"]] = routes.get(v["route"], 0) + 1
    print(f"load phase: routes {routes}; compiled again: {len(compiled)}; "
          f"sum of load times {sum(v['seconds'] for v in ld['variants']):.3f} s")
    print(f"launch overhead (us per launch): {ld.get('launch_overhead_us')}")
    slow = sorted(ld["cases"].items(), key=lambda kv: -kv[1])[:5]
    print("slowest first runs in the load phase (s; seconds mean a compile):",
          ", ".join(f"{k} {v}" for k, v in slow))
    for k, v in slow[:3]:
        print(f"  same case in stock: {k} {st['cases'].get(k)}")
    for name in ("build", "load", "stock"):
        for label, e in summary[name]["errors"].items():
            print(f"  {name} case error: {label}: {e}")
    ok = True
    for name, c in summary["compare"].items():
        print(f"{name} vs stock: {c['bit_equal']} outputs bit-equal, {len(c['differ'])} differ, "
              f"{len(c['missing'])} missing, {len(c['extra'])} extra")
        for d in c["differ"][:20]:
            print(f"  differs: {d}")
        ok &= not c["differ"] and not c["missing"]
    ok &= not compiled and not errs
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where the JSON goes")
    p.add_argument("--full", action="store_true",
                   help="float16 too, five weight formats, every attention form (the stock "
                        "phase then compiles a few hundred kernels: run phases apart)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 4)
    p.add_argument("--work", help="working directory (kept; default: a new temporary one)")
    p.add_argument("--phase", choices=("build", "load", "stock", "report"),
                   help="run one step in a fresh process of its own (with --work), e.g. to "
                        "split the run over several calls; default: all, each in a subprocess")
    a = p.parse_args()
    quick = not a.full
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="mlx-bricks-cudacache-"))
    work.mkdir(parents=True, exist_ok=True)
    steps = [a.phase] if a.phase else ["build", "load", "stock", "report"]
    env = {**os.environ, "MLX_BRICKS_HOME": str(work / "home"), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in steps:
        if name == "report":
            return report(work, Path(a.out), a.workers)
        if a.phase and os.environ.get("_MLX_BRICKS_CHECK_CHILD"):
            phase(name, work, quick, a.workers)
            return 0
        # Each process its own empty MLX JIT cache: the load phase must put the view kernels
        # there from the home cache itself; stock must compile everything.
        penv = dict(env, MLX_PTX_CACHE_DIR=str(work / f"mlx-ptx-{name}"),
                    _MLX_BRICKS_CHECK_CHILD="1")
        if name == "stock":
            penv["MLX_BRICKS_CUDA_CACHE"] = "0"
        cmd = [sys.executable, __file__, "--phase", name, "--work", str(work),
               "--workers", str(a.workers)] + (["--full"] if a.full else [])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=penv, cwd=ROOT)
        print(f"=== {name}: rc={r.returncode}, {time.perf_counter() - t0:.1f} s (process)")
        if r.returncode != 0:
            return r.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
