// Brick 4's CUDA twin: FlashAttention prefill (FlashAttention-2), GQA, causal (bottom-right),
// sliding window, soft-capping, Q8_0 K/V. Headers: mma.cuh, attention_common.cuh,
// attention_stage.cuh, attention.cuh (the algorithm and the shared-memory layout are there).
//
// Template: T (dtype of q and out; of k/v unless KV_Q8), D (head_dim), BK (keys per tile),
// MT (m16 tiles per warp: BQ = 64 * MT query rows per block), QREG (Q fragments kept in
// registers), CAUSAL, WINDOW (implies causal), SOFTCAP, KV_Q8, KV_START (a left-padded
// batch: per-row first valid key), SINKS (a learned logit per query head in the softmax).
// Inputs (any strides):
//   q (B, Hq, Lq, D) T; k, v (B, Hkv, Lk, D): T, or int8 Q8_0 codes when KV_Q8
//   k_scale, v_scale (B, Hkv, Lk, D / 32) half Q8_0 scales when KV_Q8, else (1, 1, 1, 1) dummies
//   fparams (3,) float: scale, softcap, 1 / softcap; iparams (1,) int32: window (0: none)
//   kv_start (B,) int32, any stride: batch row b's first valid key when KV_START (else a (1,)
//     dummy, never read)
//   sinks (Hq,) float, any stride: head h's sink logit when SINKS (else a (1,) dummy, never read)
// Output: out (B, Lq, Hq, D) T, row-contiguous, every element written.
// Grid: (NT * ceil(Lq / BQ), Hq, B) threads, threadgroup (NT, 1, 1), NT = 128 (256 for D = 512);
// dynamic shared memory: Config::SMEM bytes (mlx_bricks/ops/attention_cuda.py).
extern __shared__ __align__(16) unsigned char smem[];

bricks::attn::flash_attention_fwd<T, D, BK, MT, QREG, CAUSAL, WINDOW, SOFTCAP, KV_Q8,
                                  KV_START, SINKS>(
    q, k, v, k_scale, v_scale, fparams, iparams, kv_start, int64_t(kv_start_strides[0]), sinks,
    int64_t(sinks_strides[0]), out,
    bricks::attn::Dims{int(q_shape[1]), int(q_shape[2]), int(k_shape[1]), int(k_shape[2])},
    bricks::attn::Strides4{q_strides[0], q_strides[1], q_strides[2], q_strides[3]},
    bricks::attn::Strides4{k_strides[0], k_strides[1], k_strides[2], k_strides[3]},
    bricks::attn::Strides4{v_strides[0], v_strides[1], v_strides[2], v_strides[3]},
    bricks::attn::Strides4{k_scale_strides[0], k_scale_strides[1], k_scale_strides[2],
                           k_scale_strides[3]},
    bricks::attn::Strides4{v_scale_strides[0], v_scale_strides[1], v_scale_strides[2],
                           v_scale_strides[3]},
    smem);
