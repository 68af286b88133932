"""scripts/mac_check.sh's non-Mac parts (mlx_bricks.tools.mac_check): the list of
instantiations it compiles, the files it writes, and the report it assembles."""
from __future__ import annotations

import json
from functools import lru_cache

import mlx.core as mx
from mlx_bricks import kernels
from mlx_bricks.bricks.attention import msl as attention
from mlx_bricks.bricks.gemm import msl as gemm_msl
from mlx_bricks.bricks.gemm import op as gemm
from mlx_bricks.bricks.moe import msl as moe_msl
from mlx_bricks.bricks.norm_qkv import op as norm_qkv
from mlx_bricks.bricks.swiglu import msl as mlp_msl
from mlx_bricks.bricks.swiglu import op as mlp
from mlx_bricks.tools import mac_check
from tests.support import require_backend


@lru_cache(maxsize=1)
def _insts():
    require_backend("emulator")
    return mac_check.instantiations("emulator")


def test_every_msl_kernel_and_variant_is_instantiated():
    insts = _insts()
    kernels_seen = {i.kernel for i in insts}
    assert kernels_seen == {n for n in kernels.registered() if kernels.has_kernel(n, "metal")}
    assert {"dequantize", "moe_route", "moe_gate_up", "moe_down", "moe_combine"} <= kernels_seen
    cases = "\n".join(i.case for i in insts)
    for dt in (mx.float16, mx.bfloat16, mx.float32):
        dn = str(dt).split(".")[-1]
        for tile in gemm.tile_names("metal", dt):
            assert f"{dn} tile={tile} " in cases
            assert f"{dn} rms_norm_qkv tile={tile}" in cases
        for variant in mlp.variant_names("metal", dt):
            for tile in mlp.tile_names("metal", variant, dt):
                assert f"{dn} swiglu {variant} tile={tile} " in cases
        for D in attention.SUPPORTED_HEAD_DIMS:
            assert f"{dn} attention D={D} " in cases and f"{dn} decode D={D} " in cases
        for tile in moe_msl.TILES:
            assert f"{dn} moe tile={tile} activation=swiglu_oai" in cases
    # distinct functions, each within Metal's launch limits as the bricks account them
    assert len({i.function for i in insts}) == len(insts)
    assert all(1 <= i.threads <= 1024 and 0 <= i.threadgroup_bytes <= 32768 for i in insts)
    # the tile rules' real spread: BK 16 and scheduling-hint GEMMs, shared K/V attention
    gemms = [dict(i.template) for i in insts if i.kernel == "gemm"]
    assert {(t["BK"], t["STAGES"], t["SCHED"]) for t in gemms if t["T"] == "float16_t"} == {
        (bk, st, sh) for bk in ("16", "32") for st in ("1", "2") for sh in ("0", "1")}
    assert {t["BITS"] for t in gemms} == {"0", "2", "3", "4", "5", "6", "8"}
    att = [dict(i.template) for i in insts if i.kernel == "flash_attention"]
    assert {(t["D"], t["BK"], t["KV_SHARED"]) for t in att if t["T"] != "float"} >= {
        ("512", "16", "1")}
    # the padded-batch path (kv_start) at every head_dim
    assert {t["D"] for t in att if t["KV_START"] == "1"} == {
        str(D) for D in attention.SUPPORTED_HEAD_DIMS}
    # attention sinks at every head_dim
    assert {t["D"] for t in att if t["SINKS"] == "1"} == {
        str(D) for D in attention.SUPPORTED_HEAD_DIMS}


def test_sources_are_what_mlx_compiles(tmp_path):
    insts = [i for i in _insts() if i.kernel in ("q8_0_quantize", "decode_attention")][:3]
    manifest = mac_check.write_sources(tmp_path, insts)
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    assert "makeComputePipelineState" in (tmp_path / "probe.swift").read_text()
    for row, inst in zip(manifest, insts):
        text = (tmp_path / row["file"]).read_text()
        assert text == mac_check.MLX_PRELUDE + inst.source
        assert f'[[host_name("{inst.function}")]]' in text or \
            f"void {inst.function}(" in text
        assert set(row) == {"file", "kernel", "case", "function", "template", "threads",
                            "threadgroup_bytes"}


def _fake_out(tmp_path, std_ok=True):
    manifest = [{"file": "src/k0000.metal", "kernel": "gemm", "case": "c0", "function": "f0",
                 "threads": 128, "threadgroup_bytes": 20480},
                {"file": "src/k0001.metal", "kernel": "decode_attention", "case": "c1",
                 "function": "f1", "threads": 128, "threadgroup_bytes": 2304}]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    for std in mac_check.METAL_STDS:
        logs = tmp_path / "compile" / std
        logs.mkdir(parents=True)
        (logs / "k0000.log").write_text("")
        (logs / "k0001.log").write_text("" if std_ok else "k0001.metal:3:1: error: nope\n")
        pipes = [{"function": "f0", "max_total_threads_per_threadgroup": 1024,
                  "static_threadgroup_memory_length": 20480, "thread_execution_width": 32}]
        if std_ok:
            pipes.append({"function": "f1", "max_total_threads_per_threadgroup": 64,
                          "static_threadgroup_memory_length": 2304,
                          "thread_execution_width": 32})
        (tmp_path / f"pipelines.{std}.json").write_text(
            json.dumps({"device": "Apple M4", "pipelines": pipes}))
    (tmp_path / "tests.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_gemm" name="test_a[metal]"/>'
        '<testcase classname="tests.test_gemm" name="test_b[metal]">'
        '<failure message="boom">trace</failure></testcase>'
        '<testcase classname="tests.test_gemm" name="test_c[metal]"><skipped/></testcase>'
        '</testsuite></testsuites>')
    (tmp_path / "bench.json").write_text(json.dumps({"results": []}))
    (tmp_path / "system.json").write_text(json.dumps({"macos": "15.1"}))


def test_report_flags_compile_errors_and_pipeline_limits(tmp_path):
    _fake_out(tmp_path, std_ok=False)
    r = mac_check.report(tmp_path)
    assert r["instantiations"] == 2 and r["system"] == {"macos": "15.1"}
    for std in mac_check.METAL_STDS:
        assert r["metal"][std]["compiled"] == 1 and r["metal"][std]["with_pipeline"] == 1
        assert r["metal"][std]["device"] == "Apple M4"
    assert {(p["std"], p["case"], p["problems"][0]) for p in r["problems"]} == {
        (std, "c1", "does not compile") for std in mac_check.METAL_STDS}
    assert r["tests"]["tests"] == 3 and r["tests"]["failures"] == 1
    assert r["tests"]["failed"] == [{"test": "tests.test_gemm::test_b[metal]",
                                     "message": "boom"}]
    assert r["bench"] == {"results": []}


def test_report_flags_a_pipeline_with_too_few_threads(tmp_path):
    _fake_out(tmp_path, std_ok=True)
    r = mac_check.report(tmp_path)
    assert [(p["case"], p["problems"]) for p in r["problems"]][:1] == [
        ("c1", ["pipeline allows 64 threads per threadgroup, the launch uses 128"])]


def test_report_of_an_empty_folder_says_what_is_missing(tmp_path):
    r = mac_check.report(tmp_path)
    assert r["instantiations"] == 0 and "missing" in r["tests"] and "missing" in r["bench"]


def test_cli_lists(capsys):
    require_backend("emulator")
    assert mac_check.main(["list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(_insts()) and all(len(ln.split("\t")) == 4 for ln in lines)


def test_threadgroup_accounting_matches_the_plans():
    # the report compares the pipelines' static threadgroup memory with this figure
    plan = gemm_msl.plan_gemm(100, 100, 100, mx.bfloat16, tile="64x64_bk16_sb")
    t = dict(plan.template(mx.bfloat16))
    assert mac_check.expected_threadgroup_bytes("gemm", t, 2) == plan.threadgroup_bytes == 6144
    fused = mlp_msl.plan_fused(100, 100, 100, mx.float16, tile="64x32")
    assert mac_check.expected_threadgroup_bytes(
        "swiglu_fused", dict(fused.template(mx.float16)), 2) == fused.threadgroup_bytes
    tiles = attention.attention_tile_config(512, mx.float16)
    assert mac_check.expected_threadgroup_bytes(
        "flash_attention", {"D": 512, "BK": tiles.bk, "WQ": tiles.wq, "WD": tiles.wd,
                            "KV_SHARED": tiles.kv_shared}, 2) == tiles.threadgroup_bytes
    assert norm_qkv.tile_names("metal", mx.float16) == gemm.tile_names("metal", mx.float16)


def test_script_refuses_to_run_off_a_mac(tmp_path):
    import platform
    import subprocess
    from pathlib import Path

    if platform.system() == "Darwin":
        return  # the real run; nothing to check cheaply here
    script = Path(__file__).resolve().parents[1] / "scripts" / "mac_check.sh"
    r = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "needs macOS" in r.stderr
    assert not (tmp_path / "out").exists()  # nothing written before the checks
