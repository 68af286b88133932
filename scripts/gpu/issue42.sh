#!/usr/bin/env bash
# Issue 42's GPU measurements, one benchmark per process (JSON under $OUT, partial results kept),
# after MLX is installed (scripts/gpu/install.sh). Usage: bash scripts/gpu/issue42.sh STEP...
#   tests    the SSD and selective-scan twins and the Mamba / attention-mixer patch on cuda
#   ncu      kernel time per forward of the Nemotron-3-Nano-shaped model at 8,192 (ncu_forward.sh)
#   variants the SSD twin's geometry variants at 2,048 and 8,192 tokens (ssd_variants.py)
#   last     a whole-prompt forward against mlx-lm's prefill step (nemotron_last_step.py)
#   gemm-lfm2     LFM2-1.2B's 4-bit projections at M 2,048: ws tiles, stock qmm, cuBLAS bf16,
#                 the dequant composite at 256 and 12.4 MiB caps (gemm_bench.py --model lfm2)
#   overhead-lfm2 the 4-bit LFM2-shaped forward's graph building vs evaluation (tunes first)
#   ncu-lfm2      its kernels per forward at 2,048, stock and patched (ncu_forward.sh)
#   lfm2-cap      its benchmark (2,048 tokens) tuned afresh with the dequant cap at CAP MiB
#                 (default 64) in a copy of the home without its tuning decisions
#   NAME     one benchmark of `python -m mlx_bricks.bench` (e.g. e2e_jamba_4layer_bf16_t2048)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LIMIT=${LIMIT:-240}
for s in "$@"; do
  echo "=== $s ($(date +%T))"
  case $s in
    tests) timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider -rfE -n 4 -k "cuda" \
             tests/test_ssd.py tests/test_selective_scan.py tests/test_ssm_patch.py > "$OUT/tests.log" 2>&1
           echo "rc=$?"; tail -n 8 "$OUT/tests.log" ;;
    ncu) OUT="$OUT/ncu" timeout "$LIMIT" bash scripts/gpu/ncu_forward.sh 8192 1 ;;
    gemm-lfm2) MLX_ENABLE_TF32=0 timeout "$LIMIT" python3 scripts/gpu/gemm_bench.py --model lfm2 \
                 --budget $((LIMIT - 40)) --out "$OUT/gemm_lfm2.json" > "$OUT/gemm_lfm2.log" 2>&1
               echo "rc=$?"; grep -v "^ " "$OUT/gemm_lfm2.log" | cut -c1-110 | tail -n 45 ;;
    overhead-lfm2) (cd scripts/gpu && MODEL=lfm2_q4 timeout "$LIMIT" python3 forward_overhead.py \
                     2048 > "$OUT/overhead_lfm2.json" 2> "$OUT/overhead_lfm2.err")
                   echo "rc=$?"; cat "$OUT/overhead_lfm2.json"; tail -n 3 "$OUT/overhead_lfm2.err" ;;
    lfm2-cap) h=$(python3 -c "from mlx_bricks.home import home; print(home())")
              rm -rf /tmp/hcap && cp -r "$h" /tmp/hcap && rm -rf /tmp/hcap/tune
              MLX_BRICKS_HOME=/tmp/hcap MLX_BRICKS_DEQUANT_CAP=${CAP:-64} OUT="$OUT/cap${CAP:-64}" \
                LIMIT=$LIMIT bash "$0" e2e_lfm2_1b_4layer_bf16_q4g64_t2048 ;;
    ncu-lfm2) MODEL=lfm2_q4 OUT="$OUT/ncu_lfm2" timeout "$LIMIT" bash scripts/gpu/ncu_forward.sh 2048 1 ;;
    variants) (cd scripts/gpu && timeout "$LIMIT" python3 ssd_variants.py 2048 8192 \
                 > "$OUT/ssd_variants.jsonl" 2> "$OUT/ssd_variants.err")
              echo "rc=$?"; cat "$OUT/ssd_variants.jsonl" ;;
    last) (cd scripts/gpu && timeout "$LIMIT" python3 nemotron_last_step.py 2048 8192 \
             > "$OUT/last_step.jsonl" 2> "$OUT/last_step.err")
          echo "rc=$?"; cat "$OUT/last_step.jsonl" ;;
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
