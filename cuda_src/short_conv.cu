// Short-conv brick: CUDA twin of metal_src/short_conv.metal (same inputs, outputs, template
// arguments, launch geometry and steps; that file documents them). Header: mma.cuh.
// MLX launches ceil(grid / threadgroup) blocks: threads past CH do nothing.

const int T = iparams[0];
const int c = int(blockIdx.x * blockDim.x + threadIdx.x);
const int run = int(blockIdx.y * blockDim.y + threadIdx.y);
const int b = int(blockIdx.z * blockDim.z + threadIdx.z);
static_assert(K >= 2 && K <= 8, "2 to 8 taps");
if (c < CH) {
  const int64_t row0 = int64_t(b) * T;
  float wk[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    wk[k] = w[c * K + k];
  }
  const float bc = BIAS ? bricks::to_float(bias[c]) : 0.0f;
  // the window: win[j] holds u at position t - (K - 1) + j
  float win[K];
  const int t0 = run * TT;
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    const int pos = t0 - (K - 1) + j;
    float u;
    if (pos < 0) {
      u = bricks::to_float(state_in[(int64_t(b) * (K - 1) + (K - 1) + pos) * CH + c]);
    } else {
      const int64_t i = (row0 + pos) * CH + c;
      u = GATE_IN ? bricks::to_float(bricks::from_float<InT>(
                        bricks::to_float(gate_in[i]) * bricks::to_float(x[i])))
                  : bricks::to_float(x[i]);
      if (MASK && mask[row0 + pos] == 0) {
        u = 0.0f;
      }
    }
    win[j] = u;
  }
  const int t1 = min(t0 + TT, T);
  for (int t = t0; t < t1; ++t) {
    const int64_t i = (row0 + t) * CH + c;
    float u = GATE_IN ? bricks::to_float(bricks::from_float<InT>(
                            bricks::to_float(gate_in[i]) * bricks::to_float(x[i])))
                      : bricks::to_float(x[i]);
    if (MASK && mask[row0 + t] == 0) {
      u = 0.0f;
    }
    win[K - 1] = u;
    float acc = bc;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      acc += wk[k] * win[k];
    }
    if (SILU) {
      acc = acc / (1.0f + expf(-acc));
    }
    if (GATE_OUT) {
      acc *= bricks::to_float(gate_out[i]);
    }
    y[i] = bricks::from_float<InT>(acc);
#pragma unroll
    for (int k = 0; k < K - 1; ++k) {
      win[k] = win[k + 1];
    }
  }
  // the next state (the first run's threads): [state_in, u][ends + j], j < K - 1
  if (run == 0) {
    const int e0 = ends[b];
    for (int j = 0; j < K - 1; ++j) {
      const int idx = e0 + j;  // position in [state_in, u]
      float u;
      if (idx < K - 1) {
        u = bricks::to_float(state_in[(int64_t(b) * (K - 1) + idx) * CH + c]);
      } else {
        const int64_t i = (row0 + idx - (K - 1)) * CH + c;
        u = GATE_IN ? bricks::to_float(bricks::from_float<InT>(
                          bricks::to_float(gate_in[i]) * bricks::to_float(x[i])))
                    : bricks::to_float(x[i]);
        if (MASK && mask[row0 + idx - (K - 1)] == 0) {
          u = 0.0f;
        }
      }
      state_out[(int64_t(b) * (K - 1) + j) * CH + c] = bricks::from_float<InT>(u);
    }
  }
}
