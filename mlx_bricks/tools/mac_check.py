"""The Python half of ``scripts/mac_check.sh``: the first check of the bricks on a Mac.

No Mac has run the bricks; the emulator is the only check, and Apple's compiler can still refuse
what clang and the shim accept. The script compiles every kernel instantiation the bricks can
launch with Apple's own compiler (``xcrun -sdk macosx metal``, Metal 3.1 and 3.2), makes a
compute pipeline of each (recording ``maxTotalThreadsPerThreadgroup`` and the threadgroup
memory), runs the ``metal`` tests and the bench, and writes one JSON to attach to a report
(docs/mac.md). This module does the parts that need no Mac, so they are tested on Linux:

* :func:`instantiations`: every kernel instantiation the tile rules and the ops' variant
  listings produce, found by driving the ops themselves with launches recorded instead of run
  (the MSL text MLX would build, as ``mlx_bricks.emulator.source.generate`` reproduces it);
* :func:`write_sources`: one ``.metal`` file per instantiation (MLX's prepended ``utils.h``
  included, as ``mx.fast.metal_kernel`` prepends it), a ``manifest.json`` and the pipeline
  probe (Swift, run by the script);
* :func:`report`: the JSON, from what the script left in its output folder.

CLI: ``python -m mlx_bricks.tools.mac_check sources OUT`` | ``report OUT`` | ``list``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

#: Metal language versions the script compiles for (bfloat needs 3.1: macOS 14).
METAL_STDS = ("metal3.1", "metal3.2")
#: What MLX prepends to a custom kernel (``metal::utils()``), from the MLX wheel's headers.
MLX_PRELUDE = '#include "mlx/backend/metal/kernels/utils.h"\n'


@dataclass(frozen=True)
class Instantiation:
    """One kernel instantiation: what the script compiles and makes a pipeline of.

    Attributes:
        kernel: registry name (``"gemm"``).
        case: how it arises (``"float16 tile=64x64_bk16 weight=q4g64 ragged"``).
        function: the kernel's host name in MLX's source (``custom_kernel_...``).
        source: the kernel text MLX generates (without its prepended utilities).
        template: its template arguments as MLX writes them (``("BK", "16")``).
        threads: threads per threadgroup of its launch (the pipeline must allow as many).
        threadgroup_bytes: the threadgroup memory the bricks account for it (the pipeline's
            static threadgroup memory should match).
    """

    kernel: str
    case: str
    function: str
    source: str
    template: tuple[tuple[str, str], ...]
    threads: int
    threadgroup_bytes: int


def expected_threadgroup_bytes(kernel: str, template: dict, dtype_size: int) -> int:
    """The threadgroup memory the bricks' tile rules account for one instantiation (the
    figure the launch code checks against 32 KB), from its template arguments."""
    if kernel in ("gemm", "swiglu_fused", "swiglu_split", "rms_norm_qkv", "moe_gate_up",
                  "moe_down"):
        weight_rows = 2 if kernel in ("swiglu_fused", "moe_gate_up") else 1
        return (template["STAGES"] * (template["BM"] + weight_rows * template["BN"])
                * (template["BK"] + template["PAD"]) * dtype_size)
    if kernel == "flash_attention":
        from mlx_bricks.bricks.attention.msl import attention_threadgroup_bytes

        return attention_threadgroup_bytes(template["D"], dtype_size, template["BK"],
                                           template["WQ"], template["WD"],
                                           template["KV_SHARED"], template.get("DV"))
    if kernel == "moe_route":
        from mlx_bricks.bricks.moe.msl import route_threadgroup_bytes

        return route_threadgroup_bytes(template["E"], template["NT"])
    if kernel == "decode_attention":
        from mlx_bricks.bricks.decode.op import msl_threadgroup_bytes

        return msl_threadgroup_bytes(template["D"], template["RT"])
    return 0


@contextlib.contextmanager
def recorded_msl_launches():
    """Within the block, every ``kernels.launch`` (also where a module imported it by name)
    records the launch instead of running it and returns zero arrays of the output shapes, so
    the ops' MSL paths can be driven without a GPU. Yields the list of records: (name,
    inputs, output_dtypes, template, threadgroup)."""
    import mlx.core as mx

    from mlx_bricks import kernels

    records = []
    real = kernels.launch

    def fake(name, backend, *, shared_memory=0, inputs, output_shapes, output_dtypes, grid,
             threadgroup, template=(), init_value=None):
        records.append((name, list(inputs), list(output_dtypes), list(template or []),
                        tuple(threadgroup)))
        return [mx.zeros(sh, dtype=dt) for sh, dt in zip(output_shapes, output_dtypes)]

    patched = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("mlx_bricks")
               and getattr(m, "launch", None) is real]
    try:
        for m in patched:
            m.launch = fake
        yield records
    finally:
        for m in patched:
            m.launch = real


def _drive_ops(backend: str) -> list[tuple[str, tuple]]:
    """Call every op on ``backend`` in every configuration its tile rules and variant listings
    produce, on small operands; returns (case, record) for each recorded launch."""
    import mlx.core as mx

    from mlx_bricks.bricks.attention import msl as attention_msl
    from mlx_bricks.bricks.attention import op as attention
    from mlx_bricks.bricks.decode import op as decode
    from mlx_bricks.bricks.dequantize import op as dequantize
    from mlx_bricks.bricks.gated_delta import op as gdn
    from mlx_bricks.bricks.gemm import op as gemm
    from mlx_bricks.bricks.moe import msl as moe_msl
    from mlx_bricks.bricks.moe import op as moe
    from mlx_bricks.bricks.norm_qkv import op as norm_qkv
    from mlx_bricks.bricks.q8_0 import op as q8_0
    from mlx_bricks.bricks.short_conv import op as short_conv
    from mlx_bricks.bricks.ssd import op as ssd
    from mlx_bricks.bricks.swiglu import op as mlp
    from mlx_bricks.formats.affine import QuantizedWeight

    dtypes = (mx.float16, mx.bfloat16, mx.float32)
    formats = [(bits, 64) for bits in (2, 3, 4, 5, 6, 8)] + [(4, 32), (4, 128)]

    def arr(shape, dt):
        return mx.zeros(shape, dt)

    def weight(n, k, dt, fmt):
        if fmt is None:
            return arr((n, k), dt)
        bits, gs = fmt
        w, s, b = mx.quantize(mx.ones((n, k), dt), group_size=gs, bits=bits)
        return QuantizedWeight(w, s, b, gs, bits)

    def fmt_name(fmt):
        return "float" if fmt is None else f"q{fmt[0]}g{fmt[1]}"

    out: list[tuple[str, tuple]] = []
    with recorded_msl_launches() as rec:
        def run(case, fn):
            n = len(rec)
            fn()
            out.extend((case, r) for r in rec[n:])

        for dt in dtypes:
            dn = str(dt).split(".")[-1]
            # GEMM: every tile on an aligned shape with bias and residual and a ragged one
            # (K tail, scalar loads); every weight format on the rule's tiles.
            for tile in gemm.tile_names(backend, dt):
                for fmt in (None, (4, 64)):
                    run(f"{dn} tile={tile} weight={fmt_name(fmt)} aligned",
                        lambda: gemm.linear(arr((128, 128), dt), weight(128, 128, dt, fmt),
                                            arr((128,), dt), arr((128, 128), dt), tile=tile,
                                            backend=backend))
                run(f"{dn} tile={tile} weight=float ragged",
                    lambda: gemm.linear(arr((33, 36), dt), arr((40, 36), dt), tile=tile,
                                        backend=backend))
            for fmt in formats:
                for tile in ("64x64", "32x32"):
                    run(f"{dn} tile={tile} weight={fmt_name(fmt)}",
                        lambda: gemm.linear(arr((40, 256), dt), weight(72, 256, dt, fmt),
                                            tile=tile, backend=backend))
            # SwiGLU: both variants on every tile; GELU-tanh; quantized weights.
            for variant in mlp.variant_names(backend, dt):
                for tile in mlp.tile_names(backend, variant, dt):
                    run(f"{dn} swiglu {variant} tile={tile} aligned",
                        lambda: mlp.swiglu(arr((128, 128), dt), arr((128, 128), dt),
                                           arr((128, 128), dt), b_gate=arr((128,), dt),
                                           b_up=arr((128,), dt), variant=variant, tile=tile,
                                           backend=backend))
                    run(f"{dn} swiglu {variant} tile={tile} ragged gelu",
                        lambda: mlp.swiglu(arr((33, 36), dt), arr((40, 36), dt),
                                           arr((40, 36), dt), activation="gelu_tanh",
                                           variant=variant, tile=tile, backend=backend))
                for fmt in formats:
                    run(f"{dn} swiglu {variant} weight={fmt_name(fmt)}",
                        lambda: mlp.swiglu(arr((40, 256), dt), weight(72, 256, dt, fmt),
                                           weight(72, 256, dt, fmt), variant=variant,
                                           backend=backend))
            # RMSNorm + QKV: every tile; mixed formats.
            for tile in norm_qkv.tile_names(backend, dt):
                run(f"{dn} rms_norm_qkv tile={tile}",
                    lambda: norm_qkv.rms_norm_qkv(
                        arr((1, 70, 128), dt), arr((128,), dt), 1e-5, arr((256, 128), dt),
                        arr((128, 128), dt), arr((128, 128), dt), arr((256,), dt),
                        arr((128,), dt), arr((128,), dt), n_heads=4, n_kv_heads=2,
                        head_dim=64, tile=tile, backend=backend))
            run(f"{dn} rms_norm_qkv weight=q4g64/q8g32/float ragged",
                lambda: norm_qkv.rms_norm_qkv(
                    arr((1, 33, 256), dt), arr((256,), dt), 1e-5, weight(256, 256, dt, (4, 64)),
                    weight(128, 256, dt, (8, 32)), arr((128, 256), dt), n_heads=4,
                    n_kv_heads=2, head_dim=64, backend=backend))
            # Attention: every head_dim (its tile config), masks, soft-cap, Q8_0 K/V.
            for D in attention_msl.SUPPORTED_HEAD_DIMS:
                q, kv = arr((1, 4, 40, D), dt), arr((1, 2, 70, D), dt)
                for mask, window, cap in ((None, None, None), ("causal", None, None),
                                          ("causal", 33, 50.0)):
                    for q8 in ((None, "q8_0") if D % 32 == 0 else (None,)):
                        run(f"{dn} attention D={D} mask={mask} window={window} cap={cap} "
                            f"kv={q8}",
                            lambda: attention.flash_attention(
                                q, kv, kv, scale=0.1, mask=mask, window=window, softcap=cap,
                                kv_quant=q8, backend=backend))
                # A left-padded batch (kv_start, KV_START): causal, window and soft-cap.
                qb, kvb = arr((2, 4, 40, D), dt), arr((2, 2, 70, D), dt)
                run(f"{dn} attention D={D} mask=causal window=33 cap=50.0 kv=None kv_start",
                    lambda: attention.flash_attention(
                        qb, kvb, kvb, scale=0.1, mask="causal", window=33, softcap=50.0,
                        kv_start=mx.array([0, 37], mx.int32), backend=backend))
                # Attention sinks (SINKS, gpt-oss): causal with a window.
                run(f"{dn} attention D={D} mask=causal window=33 cap=None kv=None sinks",
                    lambda: attention.flash_attention(
                        q, kv, kv, scale=0.1, mask="causal", window=33, sinks=arr((4,), dt),
                        backend=backend))
            # Multi-head latent attention's value heads narrower than q/k (DV < D).
            for D, Dv in ((192, 128), (96, 64), (256, 128)):
                q, k, v = arr((1, 4, 40, D), dt), arr((1, 4, 70, D), dt), arr((1, 4, 70, Dv), dt)
                run(f"{dn} attention D={D} Dv={Dv} mask=causal",
                    lambda: attention.flash_attention(q, k, v, scale=0.1, mask="causal",
                                                      backend=backend))
            for D in attention_msl.SUPPORTED_HEAD_DIMS:
                # Decode: one row and the largest row tile, causal, Q8_0 K/V.
                for Lq, heads in ((1, (4, 4)), (8, (8, 1))):
                    for q8 in ((None, "q8_0") if D % 32 == 0 else (None,)):
                        run(f"{dn} decode D={D} Lq={Lq} heads={heads} kv={q8}",
                            lambda: decode.decode_attention(
                                arr((1, heads[0], Lq, D), dt), arr((1, heads[1], 70, D), dt),
                                arr((1, heads[1], 70, D), dt), scale=0.1, mask="causal",
                                kv_quant=q8, backend=backend))
            # Dequantize: every affine format to this dtype, an aligned and a ragged row.
            for fmt in formats:
                for n, k in ((64, 256), (5, 96 if fmt[1] == 32 else 128 * 3)):
                    q = weight(n, k, dt, fmt)
                    run(f"{dn} dequantize weight={fmt_name(fmt)} n={n} k={k}",
                        lambda: dequantize.dequantize(q.w, q.scales, q.biases,
                                                      group_size=q.group_size, bits=q.bits,
                                                      dtype=dt, backend=backend))
            # MoE: every tile with the three activations and biases; quantized experts, mixed
            # formats; the combine.
            E, idx = 8, mx.array([[0, 3], [3, 7], [1, 0]], dtype=mx.int32)
            for tile in moe_msl.TILES:
                for act in ("silu", "gelu_tanh", "swiglu_oai"):
                    run(f"{dn} moe tile={tile} activation={act}",
                        lambda: moe.moe_mlp(arr((3, 64), dt), idx, arr((E, 96, 64), dt),
                                            arr((E, 96, 64), dt), arr((E, 64, 96), dt),
                                            b_gate=arr((E, 96), dt), b_up=arr((E, 96), dt),
                                            b_down=arr((E, 64), dt), activation=act, tile=tile,
                                            check_indices=False, backend=backend))
            for fmt in formats:
                def experts(n, k, fmt=fmt):
                    w, sc, b = mx.quantize(mx.ones((E, n, k), dt), group_size=fmt[1],
                                           bits=fmt[0])
                    return QuantizedWeight(w, sc, b, fmt[1], fmt[0])

                run(f"{dn} moe weight={fmt_name(fmt)}/float",
                    lambda: moe.moe_mlp_combine(arr((3, 256), dt), idx, arr((3, 2), dt),
                                                experts(128, 256), arr((E, 128, 256), dt),
                                                experts(256, 128), check_indices=False,
                                                backend=backend))
            # Gated DeltaNet: a chunk tail (T = 40), GQA (2 key / 4 value heads), a state
            run(f"{dn} gated_delta",
                lambda: gdn.gated_delta(arr((1, 40, 2, 64), dt), arr((1, 40, 2, 64), dt),
                                        arr((1, 40, 4, 32), dt), -mx.ones((1, 40, 4), dt),
                                        0.5 * mx.ones((1, 40, 4), dt),
                                        mx.zeros((1, 4, 32, 64), mx.float32), backend=backend))
            run(f"{dn} gated_delta per key dim",  # Kimi Delta Attention: the VEC kernel
                lambda: gdn.gated_delta(arr((1, 40, 2, 64), dt), arr((1, 40, 2, 64), dt),
                                        arr((1, 40, 2, 32), dt), mx.ones((1, 40, 2, 64), dt),
                                        0.5 * mx.ones((1, 40, 2), dt), backend=backend))
            # SSD: a chunk tail (T = 40), 2 groups of 2 heads of 16 (8-column blocks too), a
            # state; short conv: LFM2's gated 3 taps and a Mamba-2 conv (bias, SiLU, 4 taps)
            for P in (16, 24):
                run(f"{dn} ssd P={P}",
                    lambda P=P: ssd.ssd(arr((1, 40, 4, P), dt), arr((1, 40, 4), dt),
                                        mx.zeros((4,)), arr((1, 40, 2, 32), dt),
                                        arr((1, 40, 2, 32), dt), mx.ones((4,), dt),
                                        state=mx.zeros((1, 4, P, 32)), backend=backend))
            run(f"{dn} short_conv gates",
                lambda: short_conv.short_conv(arr((1, 40, 64), dt), arr((64, 3, 1), dt),
                                              gate_in=arr((1, 40, 64), dt),
                                              gate_out=arr((1, 40, 64), dt), backend=backend))
            run(f"{dn} short_conv silu",
                lambda: short_conv.short_conv(arr((1, 40, 64), dt), arr((64, 4, 1), dt),
                                              arr((64,), dt), mask=mx.ones((1, 40), mx.bool_),
                                              activation="silu", backend=backend))
            run(f"{dn} q8_0",
                lambda: q8_0.dequantize_q8_0(*q8_0.quantize_q8_0(arr((4, 64), dt),
                                                                 backend=backend),
                                             dtype=dt, backend=backend))
    return out


def generated(record: tuple):
    """The kernel MLX generates for one recorded launch (``emulator.source.Generated``)."""
    from mlx_bricks import kernels
    from mlx_bricks.emulator import source as S

    name, inputs, output_dtypes, template, _ = record
    spec = kernels.spec(name)
    kname, header, body = kernels.kernel_source(name, "metal")
    infos = [S.InputInfo(x.dtype, x.ndim, x.size) for x in inputs]
    return S.generate(kname, list(spec.input_names), list(spec.output_names), body, header,
                      infos, output_dtypes, template, spec.atomic_outputs)


def _instantiation(case: str, record: tuple) -> Instantiation:
    from mlx_bricks.emulator import source as S

    name, inputs, output_dtypes, template, threadgroup = record
    gen = generated(record)
    targs = dict(template)
    size = targs["T"].size if "T" in targs else inputs[0].dtype.size
    written = tuple((n, S._template_value(v)[1]) for n, v in template)
    return Instantiation(name, case, gen.kernel_name, gen.source, written,
                         threadgroup[0] * threadgroup[1] * threadgroup[2],
                         expected_threadgroup_bytes(name, targs, size))


def launches(backend: str | None = None) -> list[tuple[str, tuple]]:
    """(case, record) of every MSL launch the ops make in the configurations of
    :func:`instantiations` (records as :func:`recorded_msl_launches` yields them)."""
    from mlx_bricks.backends import BackendError, backend_status

    if backend is None:
        backend = next((b for b in ("metal", "emulator") if backend_status(b)), None)
        if backend is None:
            raise BackendError("neither metal nor emulator is available to drive the ops")
    return _drive_ops(backend)


def instantiations(backend: str | None = None) -> list[Instantiation]:
    """Every MSL kernel instantiation the bricks launch, one per distinct kernel function
    (the first case that produces it names it), in a stable order.

    Args:
        backend: the backend the ops are driven through (their launches are recorded, never
            run): ``"metal"`` on a Mac, ``"emulator"`` elsewhere; None picks the first that
            is available. Both build the same MSL.

    Raises:
        mlx_bricks.backends.BackendError: neither backend is available.
    """
    seen: dict[str, Instantiation] = {}
    for case, record in launches(backend):
        inst = _instantiation(case, record)
        seen.setdefault(inst.function, inst)
    return list(seen.values())


# ---------------------------------------------------------------------------------------------
# Files for the script

#: The pipeline probe the script runs (``xcrun swift probe.swift manifest.json lib.metallib``):
#: a compute pipeline per function, its limits as JSON on standard output.
PROBE_SWIFT = r"""
import Foundation
import Metal

let args = CommandLine.arguments
let manifest = try! JSONSerialization.jsonObject(
    with: Data(contentsOf: URL(fileURLWithPath: args[1]))) as! [[String: Any]]
let device = MTLCreateSystemDefaultDevice()!
var library: MTLLibrary? = nil
var libraryError = ""
do {
  library = try device.makeLibrary(URL: URL(fileURLWithPath: args[2]))
} catch {
  libraryError = "\(error)"
}
var out: [[String: Any]] = []
for entry in manifest {
  let name = entry["function"] as! String
  var row: [String: Any] = ["function": name]
  if let lib = library, let fn = lib.makeFunction(name: name) {
    do {
      let p = try device.makeComputePipelineState(function: fn)
      row["max_total_threads_per_threadgroup"] = p.maxTotalThreadsPerThreadgroup
      row["static_threadgroup_memory_length"] = p.staticThreadgroupMemoryLength
      row["thread_execution_width"] = p.threadExecutionWidth
    } catch {
      row["error"] = "\(error)"
    }
  } else {
    row["error"] = library == nil ? "library: \(libraryError)" : "function not in the library"
  }
  out.append(row)
}
let info: [String: Any] = ["device": device.name, "pipelines": out]
let data = try! JSONSerialization.data(withJSONObject: info, options: [.sortedKeys])
FileHandle.standardOutput.write(data)
"""


def write_sources(out: Path, insts: list[Instantiation] | None = None) -> list[dict]:
    """``out/src/kNNNN.metal`` for each instantiation (MLX's prelude, then the kernel text),
    ``out/manifest.json`` (file, kernel, case, function, template, threads,
    threadgroup_bytes) and ``out/probe.swift``. Returns the manifest (rows as JSON has them)."""
    insts = instantiations() if insts is None else insts
    src = out / "src"
    src.mkdir(parents=True, exist_ok=True)
    manifest = []
    for i, inst in enumerate(insts):
        f = src / f"k{i:04d}.metal"
        f.write_text(MLX_PRELUDE + inst.source)
        row = asdict(inst)
        del row["source"]
        row["template"] = [list(t) for t in inst.template]
        manifest.append({"file": f"src/{f.name}", **row})
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "probe.swift").write_text(PROBE_SWIFT)
    return manifest


# ---------------------------------------------------------------------------------------------
# The report


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"missing": f"{path.name}: {e}"}


def _junit(path: Path) -> dict:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return {"missing": f"{path.name}: {e}"}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites)
             for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                           "message": (bad.get("message") or "")[:500]})
    return {**total, "failed": failed}


def report(out: Path) -> dict:
    """The mac_check JSON from the script's output folder ``out``: the manifest, per Metal
    version the compile log of each file (``compile/<std>/kNNNN.log``, empty when it compiled)
    and the pipeline probe (``pipelines.<std>.json``), the tests (``tests.xml``, JUnit), the
    bench (``bench.json``) and the system (``system.json``). Flags every instantiation that
    does not compile, has no pipeline, allows fewer threads than its launch uses, or whose
    static threadgroup memory differs from the bricks' accounting."""
    manifest = _read_json(out / "manifest.json")
    if not isinstance(manifest, list):
        manifest = []
    stds = {}
    problems = []
    for std in METAL_STDS:
        probe = _read_json(out / f"pipelines.{std}.json")
        pipes = {p.get("function"): p for p in probe.get("pipelines", [])} \
            if isinstance(probe, dict) else {}
        rows = []
        for entry in manifest:
            log = out / "compile" / std / (Path(entry["file"]).stem + ".log")
            text = log.read_text() if log.exists() else None
            row = {"file": entry["file"], "kernel": entry["kernel"], "case": entry["case"],
                   "threads": entry["threads"],
                   "threadgroup_bytes": entry["threadgroup_bytes"],
                   "compiled": text is not None and "error:" not in text,
                   "compile_log": (text or "not compiled")[:4000] if text != "" else ""}
            pipe = pipes.get(entry["function"], {})
            for key in ("max_total_threads_per_threadgroup", "static_threadgroup_memory_length",
                        "thread_execution_width", "error"):
                if key in pipe:
                    row[key] = pipe[key]
            why = []
            if not row["compiled"]:
                why.append("does not compile")
            elif "max_total_threads_per_threadgroup" not in row:
                why.append(f"no pipeline ({row.get('error', 'not probed')})")
            else:
                if row["max_total_threads_per_threadgroup"] < entry["threads"]:
                    why.append(f"pipeline allows {row['max_total_threads_per_threadgroup']} "
                               f"threads per threadgroup, the launch uses {entry['threads']}")
                if row["static_threadgroup_memory_length"] != entry["threadgroup_bytes"]:
                    why.append(f"static threadgroup memory "
                               f"{row['static_threadgroup_memory_length']} bytes, the bricks "
                               f"account {entry['threadgroup_bytes']}")
            if why:
                problems.append({"std": std, "kernel": entry["kernel"], "case": entry["case"],
                                 "file": entry["file"], "problems": why})
            rows.append(row)
        stds[std] = {"device": probe.get("device") if isinstance(probe, dict) else None,
                     "instantiations": rows,
                     "compiled": sum(r["compiled"] for r in rows),
                     "with_pipeline": sum("max_total_threads_per_threadgroup" in r
                                          for r in rows)}
    return {
        "format": 1,
        "system": _read_json(out / "system.json"),
        "instantiations": len(manifest),
        "metal": stds,
        "problems": problems,
        "tests": _junit(out / "tests.xml"),
        "bench": _read_json(out / "bench.json"),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_bricks.tools.mac_check",
        description="Python half of scripts/mac_check.sh (docs/mac.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the instantiations (kernel, case, threads, bytes)")
    p = sub.add_parser("sources", help="write OUT/src/*.metal, OUT/manifest.json, probe.swift")
    p.add_argument("out", type=Path)
    p = sub.add_parser("report", help="print the JSON report of the script's folder OUT")
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "list":
        for inst in instantiations():
            print(f"{inst.kernel}\t{inst.case}\t{inst.threads}\t{inst.threadgroup_bytes}")
    elif args.command == "sources":
        manifest = write_sources(args.out)
        print(f"{len(manifest)} instantiations written to {args.out}", file=sys.stderr)
    else:
        json.dump(report(args.out), sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
