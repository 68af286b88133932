#!/usr/bin/env bash
# Issue 42's GPU measurements, one benchmark per process (JSON under $OUT, partial results kept),
# after MLX is installed (scripts/gpu/install.sh). Usage: bash scripts/gpu/issue42.sh STEP...
#   tests    the SSD and selective-scan twins and the Mamba / attention-mixer patch on cuda
#   NAME     one benchmark of `python -m mlx_bricks.bench` (e.g. e2e_jamba_4layer_bf16_t2048)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-240}
for s in "$@"; do
  echo "=== $s ($(date +%T))"
  case $s in
    tests) timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider -rfE -k "cuda" \
             tests/test_ssd.py tests/test_selective_scan.py tests/test_ssm_patch.py > "$OUT/tests.log" 2>&1
           echo "rc=$?"; tail -n 8 "$OUT/tests.log" ;;
    *) timeout "$LIMIT" python3 -m mlx_bricks.bench --backend cuda --repeats "${REPEATS:-3}" \
         --only "$s" --out "$OUT/$s.json" > "$OUT/$s.log" 2>&1
       echo "rc=$?"; python3 - "$OUT/$s.json" <<'PY' || tail -n 5 "$OUT/$s.log"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["name"], {k: r.get(k) for k in ("brick_s", "stock_s", "ratio", "stock_error",
                                          "error")})
PY
       ;;
  esac
done
