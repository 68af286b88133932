"""The Python half of ``scripts/mac_check.sh``: the first check of the bricks on a Mac.

No Mac has run the bricks; the emulator is the only check, and Apple's compiler can still refuse
what clang and the shim accept. The script compiles every kernel instantiation the bricks can
launch with Apple's own compiler (``xcrun -sdk macosx metal``, Metal 3.1 and 3.2), makes a
compute pipeline of each (recording ``maxTotalThreadsPerThreadgroup`` and the threadgroup
memory), runs the ``metal`` tests and the bench, and writes one JSON to attach to a report
(docs/mac.md). This module does the parts that need no Mac, so they are tested on Linux:

* :func:`instantiations`: every kernel instantiation the tile rules and the ops' variant
  listings produce, found by driving the ops themselves with launches recorded instead of run
  (``tools.msl_launches``: the MSL text MLX would build, as ``emulator.source.generate``
  reproduces it);
* :func:`write_sources`: one ``.metal`` file per instantiation (MLX's prepended ``utils.h``
  included, as ``mx.fast.metal_kernel`` prepends it), a ``manifest.json`` and the pipeline
  probe (Swift, run by the script);
* :func:`report`: the JSON, from what the script left in its output folder.

CLI: ``python -m mlx_bricks.tools.mac_check sources OUT`` | ``report OUT`` | ``list``.
"""
from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

from mlx_bricks.tools.msl_launches import (  # noqa: F401  (recorded_msl_launches re-exported)
    generated,
    launches,
    recorded_msl_launches,
)

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
                  "moe_up", "moe_down"):
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
