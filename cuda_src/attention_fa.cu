// The attention brick's fast CUDA kernel family for 16-bit q/k/v: FlashAttention-2 on mma.sync
// (sm_80+) or on wgmma warpgroups (sm_90a). Headers: mma.cuh, attention_common.cuh,
// attention_wgmma.cuh, attention_fa.cuh (the algorithm and shared-memory layout are there).
//
// Template: T (__half or __nv_bfloat16), DQK (q/k head_dim), DV (v/out head_dim), BK (keys per
// tile), NW (warps), MT (m16 tiles per warp; 1 with wgmma), NS (K/V stages), WG (wgmma
// warpgroups), LAG (warpgroup 1 one P V behind), IWO (each tile's softmax over the previous
// tile's P V), FFMA (the one-FFMA softmax on unmasked tiles), CAUSAL, WINDOW, SOFTCAP,
// KV_START, SINKS.
// Inputs (any strides): q (B, Hq, Lq, DQK), k (B, Hkv, Lk, DQK), v (B, Hkv, Lk, DV) of T;
//   fparams (3,) float: scale, softcap, 1 / softcap; iparams (1,) int32: window (0: none);
//   kv_start (B,) int32 when KV_START, sinks (Hq,) float when SINKS (else (1,) dummies).
// Output: out (B, Lq, Hq, DV) T, row-contiguous, every element written.
// Grid: (32 NW ceil(Lq / BQ), Hq, B) threads, BQ = 16 MT NW; threadgroup (32 NW, 1, 1); dynamic
// shared memory FaConfig::SMEM bytes (mlx_bricks/bricks/attention/cuda.py fa_smem_bytes).
extern __shared__ __align__(16) unsigned char smem[];

bricks::attn::fa_forward<bricks::attn::FaConfig<T, DQK, DV, BK, NW, MT, NS, WG, LAG, IWO, FFMA>, T,
                         CAUSAL, WINDOW, SOFTCAP, KV_START, SINKS>(
    q, k, v, fparams, iparams, kv_start, int64_t(kv_start_strides[0]), sinks,
    int64_t(sinks_strides[0]), out,
    bricks::attn::Dims{int(q_shape[1]), int(q_shape[2]), int(k_shape[1]), int(k_shape[2])},
    bricks::attn::Strides4{q_strides[0], q_strides[1], q_strides[2], q_strides[3]},
    bricks::attn::Strides4{k_strides[0], k_strides[1], k_strides[2], k_strides[3]},
    bricks::attn::Strides4{v_strides[0], v_strides[1], v_strides[2], v_strides[3]}, smem);
