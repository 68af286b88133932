#!/usr/bin/env bash
# One GPU-machine session's steps, each under its own time limit, logs and JSON under $OUT.
# Usage (on the GPU machine, after MLX is installed in /tmp/site; ../shared/docs/device.md):
#   bash scripts/gpu/session.sh STEP [STEP ...]
# Steps: gemm-tests gemm-bench gemm-depth kernels attn-tests attn-check decode-tests decode-check
#        decode-quick (covering cases + 4 timings: a lease of about a minute)
#        e2e e2e-quant kv-tests attn-x (stops at the first failure) all-tests
#        shard (needs kind nvidia-h200-x2: 2 NCCL ranks, one GPU each; NVLink multicast off)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# NVLink multicast off for NCCL (and PyTorch / NVSHMEM): device notes, KINDS.md
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "import mlx.core as mx; assert mx.cuda.is_available(); print(mx.__version__, mx.device_info())" || exit 3
PYT="python3 -m pytest -q -p no:cacheprovider -rfE --maxfail=40"
step() {  # name, seconds, command...
    local name=$1 secs=$2; shift 2
    echo "=== $name ($(date +%T), limit ${secs}s)"
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name rc=$? ($(date +%T))"
    tail -n 25 "$OUT/$name.log"
}
for s in "$@"; do
    case $s in
        gemm-tests) step gemm-tests 240 $PYT -n 8 -k cuda tests/test_gemm.py tests/test_swiglu.py \
            tests/test_norm_qkv.py tests/test_quantized.py tests/test_quantized_bricks.py ;;
        gemm-bench) step gemm-bench 200 python3 scripts/gpu/gemm_cuda_check.py --out "$OUT/gemm.json" ;;
        attn-tests) step attn-tests 240 $PYT -n 8 -k cuda tests/test_attention.py ;;
        attn-x) step attn-x 130 python3 -m pytest -q -p no:cacheprovider -rfE -x -n 8 -k cuda \
            tests/test_attention.py ;;
        attn-check) step attn-check 280 python3 scripts/gpu/attention_cuda_check.py --out "$OUT/attn.json" ;;
        decode-tests) step decode-tests 150 $PYT -n 8 -k cuda tests/test_decode_attention.py tests/test_cache.py ;;
        decode-quick) step decode-quick 90 python3 scripts/gpu/decode_cuda_check.py --quick \
            --skip model --out "$OUT/decode_quick.json" ;;
        decode-check) step decode-check 200 python3 scripts/gpu/decode_cuda_check.py --out "$OUT/decode.json" ;;
        gemm-depth) step gemm-depth 150 python3 scripts/gpu/gemm_cuda_check.py --out "$OUT/gemm_depth.json" \
            --tiles wg128x256d,wg128x256d5,wg128x128d --only linear_q4,linear_bf16 ;;
        kernels) step kernels 300 python3 -m mlx_bricks.bench --backend cuda --only cuda_kernels \
            --out "$OUT/kernels.json" ;;
        e2e) step e2e 300 python3 -m mlx_bricks.bench --backend cuda --only e2e_llama8b_4layer_float \
            --repeats 5 --out "$OUT/e2e.json" ;;
        e2e-quant) step e2e-quant 300 python3 -m mlx_bricks.bench --backend cuda \
            --only e2e_llama8b_4layer_quantized --repeats 5 --out "$OUT/e2e_quant.json" ;;
        kv-tests) step kv-tests 150 $PYT -n 8 -k cuda tests/test_kv_patch.py tests/test_cache.py ;;
        shard) step shard 560 python3 scripts/gpu/shard_check.py --out "$OUT/shard.json" ;;
        all-tests) step all-tests 500 $PYT -n 8 -m "not slow" tests ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done
