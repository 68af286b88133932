#!/usr/bin/env bash
# One GPU-machine session's steps, each under its own time limit, logs and JSON under $OUT.
# Usage (on the GPU machine, after MLX is installed in /tmp/site; ../shared/docs/device.md):
#   bash scripts/gpu/session.sh STEP [STEP ...]
# GPU validation is one pytest command (steps gpu-tests + cuda-tests run its two halves): every
# test marked `gpu` (tests/test_*_gpu.py, tests/test_dequantize_cuda.py: the twins' sweeps,
# every tile, the dequantize brick bit for bit against mx.dequantize) and the default suite's
# kernel tests parametrised over backends, on `cuda` (CPU-only emulation and nvcc checks out):
#   python3 -m pytest -q -n 8 -m "gpu or not slow" -k "(cuda or gpu) and not emu and not compile" tests
# Steps:
#   gpu-tests      tests marked gpu (~600 tests)
#   cuda-tests     the kernel tests on cuda (~4300 tests; more than one call: split it as below)
#   kernel-tests   GEMM / SwiGLU / RMSNorm+QKV / quantized / K,V-variant / decode on cuda (~320 s)
#   bench-tiles    per-tile GEMM / SwiGLU benchmarks, split-K included (cuda_tiles)
#   bench-kernels  GEMM family with the tile rule (cuda_kernels), dequantize (cuda_dequantize)
#   bench-attn     attention and decode twins vs SDPA (cuda_attention, cuda_decode)
#   bench-kv       16k-token prefill into the Q8_0 vs float16 cache, peak memory (cuda_kv_cache)
#   e2e e2e-quant  whole 8B-shaped 4-layer model prefill, float and 4/8-bit (patched vs stock)
#   quant-tests    the quantized-prefill tests on cuda (dequantize, composites, Q8_0 K/V variants)
#   moe-tests      the MoE brick's cuda tests (every tile; the sweep with moe-sweep)
#   bench-moe      MoE MLP at Qwen3-30B-A3B / gpt-oss-20b shapes, stock SwitchGLU vs the brick
#   moe-patch      tiny MoE models patched on cuda (tile rule and tuner) vs stock mlx-lm
#   moe-patch-off  the tile-rule half of moe-patch, failures' lines printed
#   e2e-moe-8192   the 4-bit M=8192 case of e2e-moe (stock gather_qmm fails there)
#   e2e-moe        4-layer Qwen3-30B-A3B-shaped prefill, bf16 and 4-bit (patched vs stock)
#   attn-tests     the attention, decode and KV-cache tests on cuda (padded-batch kv_start too)
#   e2e-quant-rest the 8-bit M=8192 case and the bf16 float model in one process
#   peak-probe     where the quantized composites' extra peak memory comes from (peak_probe.py)
#   first-call     fresh-process prefill of a 32-layer 8B 4-bit model in 4 chunks of 2,048,
#                  stock vs patched (tune cached), per layer (scripts/gpu/first_call.py)
#   bench-gdn      Gated DeltaNet recurrence and 4-layer Qwen3.5-35B-A3B-shaped prefill, 2k/8k
#   e2e-gpt-oss    4-layer gpt-oss-20b-shaped prefill (MXFP4 experts), M=2048
#   shard          2 NCCL ranks (needs kind nvidia-h200-x2; NVLink multicast off)
#   decode-probe   generation of 4-layer Qwen3.5-35B-A3B / gpt-oss-20b / Llama-3-8B-shaped models,
#                  stock vs patched (cached, guard, auto) in one process (decode_probe.py)
#   all-tests      the whole default suite on the GPU machine
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# NVLink multicast off for NCCL (and PyTorch / NVSHMEM): device notes, KINDS.md
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
export MLX_BRICKS_GPU_OUT=$OUT
mkdir -p "$OUT"
python3 -c "import mlx.core as mx; assert mx.cuda.is_available(); print(mx.__version__, mx.device_info())" || exit 3
PYT="python3 -m pytest -q -p no:cacheprovider -rfE --maxfail=60"
BENCH="python3 -m mlx_bricks.bench --backend cuda"
step() {  # name, seconds, command...
    local name=$1 secs=$2; shift 2
    echo "=== $name ($(date +%T), limit ${secs}s)"
    timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
    echo "=== $name rc=$? ($(date +%T))"
    tail -n 25 "$OUT/$name.log"
}
for s in "$@"; do
    case $s in
        gpu-tests) step gpu-tests 420 $PYT -n 8 -m gpu tests ;;
        cuda-tests) step cuda-tests 420 $PYT -n 8 -m "not slow" \
            -k "cuda and not emu and not compile and not gpu" tests ;;
        kernel-tests) step kernel-tests 480 $PYT -n 14 -m "gpu or not slow" \
            -k "(cuda or gpu) and not emu and not compile and not emulation" tests/test_swiglu.py \
            tests/test_norm_qkv.py tests/test_quantized_bricks.py tests/test_attention_kv_variants.py \
            tests/test_decode_gpu.py tests/test_gemm_gpu.py tests/test_gemm.py ;;
        bench-tiles) step bench-tiles 420 $BENCH --only cuda_tiles --out "$OUT/tiles.json" ;;
        bench-kernels) step bench-kernels 300 $BENCH --only cuda_kernels cuda_dequantize \
            --out "$OUT/kernels.json" ;;
        bench-attn) step bench-attn 240 $BENCH --only cuda_attention cuda_decode \
            --out "$OUT/attention.json" ;;
        bench-kv) step bench-kv 150 $BENCH --only cuda_kv_cache --out "$OUT/kv_cache.json" ;;
        e2e) step e2e 300 $BENCH --only e2e_llama8b_4layer_float --repeats 5 --out "$OUT/e2e.json" ;;
        e2e-quant) step e2e-quant 300 $BENCH --only e2e_llama8b_4layer_quantized --repeats 5 \
            --out "$OUT/e2e_quant.json" ;;
        quant-tests) step quant-tests 420 $PYT -n 8 -m "not slow" -k "cuda" \
            tests/test_dequantize.py tests/test_dequantize_cuda.py tests/test_composites.py \
            tests/test_attention_kv_variants.py ;;
        moe-tests) step moe-tests 300 $PYT -n 8 -m "not slow" \
            -k "cuda and not compile and not emulation" tests/test_moe.py ;;
        moe-sweep) step moe-sweep 420 $PYT -n 8 -m slow -k "sweep and cuda" tests/test_moe.py ;;
        bench-moe) step bench-moe 420 $BENCH --only moe --repeats 10 --out "$OUT/moe.json" ;;
        moe-patch) step moe-patch 240 $PYT -n 8 -k cuda tests/test_moe_patch.py ;;
        moe-patch-off) step moe-patch-off 180 $PYT -n 5 --tb=short -k "cuda and off" \
            tests/test_moe_patch.py; grep -E "^E |^_____" "$OUT/moe-patch-off.log" | head -80 ;;
        e2e-moe-8192) step e2e-moe-8192 240 $BENCH --repeats 5 --only \
            e2e_qwen3_moe_4layer_bf16_q4g64_m8192 --out "$OUT/e2e_moe_8192.json" ;;
        e2e-moe) step e2e-moe 420 $BENCH --only e2e_qwen3_moe_4layer --repeats 5 \
            --out "$OUT/e2e_moe.json" ;;
        attn-tests) step attn-tests 300 $PYT -n 8 -m "not slow" \
            -k "cuda and not emu and not compile and not gpu" tests/test_attention.py \
            tests/test_attention_cuda.py tests/test_decode_attention.py tests/test_cache.py ;;
        e2e-quant-rest) step e2e-quant-rest 300 $BENCH --repeats 5 --only \
            e2e_llama8b_4layer_bf16_q8g64_m8192 e2e_llama8b_4layer_bf16_q4g64_m2048 \
            e2e_llama8b_4layer_bf16_m512 \
            e2e_llama8b_4layer_bf16_m2048 e2e_llama8b_4layer_bf16_m8192 \
            --out "$OUT/e2e_quant_rest.json" ;;
        peak-probe) step peak-probe 200 python3 scripts/gpu/peak_probe.py "$OUT/peak_probe.json" \
            512 2048 8192 ;;
        shard) step shard 560 $PYT -m gpu tests/test_shard_gpu.py ;;
        first-call) step first-call 200 bash -c 'F=$OUT/first_call.jsonl; [ -d /tmp/m32 ] ||
            python3 scripts/gpu/first_call.py write /tmp/m32 || exit 1
            for m in stock stock bricks stock bricks; do
              FIRST_CALL_CHUNKS=4 python3 scripts/gpu/first_call.py run /tmp/m32 $m >> $F || exit 1
            done; cat $F' ;;
        bench-gdn) step bench-gdn 300 $BENCH --repeats 5 --only gdn_recurrence_bf16_t2048 \
            gdn_recurrence_bf16_t8192 e2e_qwen35_35b_4layer_bf16_t2048 \
            e2e_qwen35_35b_4layer_bf16_t8192 --out "$OUT/gdn.json" ;;
        e2e-gpt-oss) step e2e-gpt-oss 200 $BENCH --repeats 5 --only \
            e2e_gpt_oss20b_4layer_bf16_mxfp4_m2048 --out "$OUT/e2e_gpt_oss.json" ;;
        decode-probe) step decode-probe 420 python3 scripts/gpu/decode_probe.py \
            "$OUT/decode_probe.json" ;;
        all-tests) step all-tests 500 $PYT -n 8 -m "not slow" tests ;;
        *) echo "unknown step $s"; exit 2 ;;
    esac
done
