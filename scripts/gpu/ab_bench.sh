#!/usr/bin/env bash
# One benchmark, this tree (new) and .ab_base (an older commit: `git archive <rev> mlx_bricks
# cuda_src metal_src | tar -x -C .ab_base`), alternated in one call: new, base, new, ...
# Usage (after scripts/gpu/install.sh): ROUNDS=2 bash scripts/gpu/ab_bench.sh NAME
# Each run: $OUT/<side><i>.json; prints ratio, bricks and stock seconds, the decisions' winners.
set -uo pipefail
NAME=$1
OUT=${OUT:-/tmp/out}
R=$PWD
mkdir -p "$OUT"
for i in $(seq 1 "${ROUNDS:-2}"); do
  for side in new base; do
    dir=$R; [ "$side" = base ] && dir=$R/.ab_base
    (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout "${LIMIT:-200}" python3 -m mlx_bricks.bench \
       --backend cuda --repeats "${REPEATS:-7}" --only "$NAME" --out "$OUT/$side$i.json" \
       > "$OUT/$side$i.log" 2>&1)
    echo "== $side$i rc=$?"
    python3 - "$OUT/$side$i.json" <<'PY' || tail -n 4 "$OUT/$side$i.log"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(r["name"], "ratio", r.get("ratio"), "bricks", r.get("brick_s"), "stock",
          r.get("stock_s"), "peak", r.get("peak_memory"), r.get("error") or "")
    for d in (r.get("tuning") or {}).get("decisions", []):
        print("  ", d["key"][:90], d["winner"], d.get("ratio"))
PY
  done
done
