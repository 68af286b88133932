#!/usr/bin/env bash
# The first check of mlx-bricks on a Mac (docs/mac.md): every kernel instantiation the bricks
# can launch compiled by Apple's compiler for Metal 3.1 and 3.2, a compute pipeline made of each
# (maxTotalThreadsPerThreadgroup and threadgroup memory recorded and checked against the
# launches), the `metal` tests and the bench; one JSON to attach to a report.
#
# Usage: bash scripts/mac_check.sh [OUT_DIR]        (default: mac_check_<date>)
# Environment:
#   MAC_CHECK_JOBS=N     parallel compiles (default: the number of CPUs)
#   MAC_CHECK_SKIP=...   any of "tests bench" to leave those out (e.g. MAC_CHECK_SKIP=bench)
#   MAC_CHECK_EVERY=N    compile only every N-th instantiation (a quick look; default 1: all)
# Output: OUT_DIR/mac_check.json (attach this), and the pieces it is made of: src/ (the .metal
# files), compile/<std>/*.log, lib.<std>.metallib, pipelines.<std>.json, tests.xml,
# bench.json, system.json.
set -uo pipefail
cd "$(dirname "$0")/.."

die() { echo "mac_check.sh: error: $*" >&2; exit 2; }
note() { echo "mac_check.sh: $*" >&2; }

[ "$(uname -s)" = Darwin ] || die "needs macOS (Apple's Metal compiler and a Metal device)"
xcrun -sdk macosx -f metal >/dev/null 2>&1 \
    || die "xcrun cannot find the metal compiler: install Xcode (or its command line tools" \
           "and the Metal toolchain: xcodebuild -downloadComponent MetalToolchain)"
xcrun -f swift >/dev/null 2>&1 || die "xcrun cannot find swift (Xcode command line tools)"

OUT=${1:-mac_check_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$OUT" || die "cannot create $OUT"
OUT=$(cd "$OUT" && pwd)
JOBS=${MAC_CHECK_JOBS:-$(sysctl -n hw.ncpu)}
SKIP=${MAC_CHECK_SKIP:-}
EVERY=${MAC_CHECK_EVERY:-1}

bash scripts/setup.sh || die "scripts/setup.sh failed"
PY=.venv/bin/python

# The system, for the report.
{
    echo "{"
    echo "  \"macos\": \"$(sw_vers -productVersion)\","
    echo "  \"build\": \"$(sw_vers -buildVersion)\","
    echo "  \"chip\": \"$(sysctl -n machdep.cpu.brand_string)\","
    echo "  \"metal_compiler\": \"$(xcrun -sdk macosx metal --version 2>&1 | head -1)\","
    echo "  \"git\": \"$(git rev-parse HEAD 2>/dev/null)\","
    echo "  \"mlx\": $($PY -c 'import json, mlx.core as mx
info = {k: str(v) for k, v in mx.device_info().items()}
print(json.dumps({"version": mx.__version__, "device_info": info}))')"
    echo "}"
} > "$OUT/system.json"

# 1. The instantiations (the same Python function the Linux tests check).
$PY -m mlx_bricks.tools.mac_check sources "$OUT" || die "writing the kernel sources failed"
MLX_INCLUDE=$($PY -c 'import mlx, pathlib; print(pathlib.Path(mlx.__file__).parent / "include")')
[ -f "$MLX_INCLUDE/mlx/backend/metal/kernels/utils.h" ] \
    || die "MLX's kernel headers are not in $MLX_INCLUDE"

# 2. Compile each one per Metal version; a file's log is empty when it compiled.
FILES=$(cd "$OUT" && ls src/*.metal | awk -v n="$EVERY" 'NR % n == 1 || n == 1')
for STD in metal3.1 metal3.2; do
    mkdir -p "$OUT/compile/$STD" "$OUT/air/$STD"
    note "compiling $(echo "$FILES" | wc -l | tr -d ' ') instantiations for $STD ($JOBS at a time)"
    echo "$FILES" | xargs -P "$JOBS" -I{} sh -c '
        f="{}"; b=$(basename "$f" .metal)
        xcrun -sdk macosx metal -std='"$STD"' -I "'"$MLX_INCLUDE"'" -c "'"$OUT"'/$f" \
            -o "'"$OUT"'/air/'"$STD"'/$b.air" > "'"$OUT"'/compile/'"$STD"'/$b.log" 2>&1 \
            || echo "error: exit status $?" >> "'"$OUT"'/compile/'"$STD"'/$b.log"'
    if ls "$OUT/air/$STD/"*.air >/dev/null 2>&1; then
        xcrun -sdk macosx metallib "$OUT/air/$STD/"*.air -o "$OUT/lib.$STD.metallib" \
            || note "metallib for $STD failed"
        # 3. A pipeline of every function: its thread and threadgroup-memory limits.
        xcrun swift "$OUT/probe.swift" "$OUT/manifest.json" "$OUT/lib.$STD.metallib" \
            > "$OUT/pipelines.$STD.json" || note "the pipeline probe for $STD failed"
    fi
done

# 4. The metal tests (the default suite's cases on the metal backend) and 5. the bench.
if [[ " $SKIP " != *" tests "* ]]; then
    note "running the metal tests"
    $PY -m pytest tests -m "not slow" -k metal -q -p no:cacheprovider \
        --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
    tail -3 "$OUT/tests.log" >&2
fi
if [[ " $SKIP " != *" bench "* ]]; then
    note "running the bench"
    $PY -m mlx_bricks.bench --backend metal --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1 \
        || note "the bench failed (see $OUT/bench.log)"
fi

# 6. One JSON.
$PY -m mlx_bricks.tools.mac_check report "$OUT" > "$OUT/mac_check.json" \
    || die "assembling the report failed"
$PY - "$OUT/mac_check.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for std, s in r["metal"].items():
    print(f"{std}: {s['compiled']}/{r['instantiations']} compiled, {s['with_pipeline']} pipelines")
print(f"problems: {len(r['problems'])}; tests: {r['tests'].get('tests')} run, "
      f"{r['tests'].get('failures')} failed, {r['tests'].get('errors')} errors")
print(f"report: {sys.argv[1]}")
EOF
