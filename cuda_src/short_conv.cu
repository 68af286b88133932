// Short-conv brick: CUDA twin of metal_src/short_conv.metal (same inputs, outputs, template
// arguments, launch geometry and steps; that file documents them). Header: mma.cuh.
// MLX launches ceil(grid / threadgroup) blocks: threads past CH do nothing.

const int T = int(x_shape[1]);
const int c = int(blockIdx.x * blockDim.x + threadIdx.x);
const int run = int(blockIdx.y * blockDim.y + threadIdx.y);
const int b = int(blockIdx.z * blockDim.z + threadIdx.z);
static_assert(K >= 2 && K <= 8, "2 to 8 taps");
if (c < CH) {
  // the strides of the rows (t) walked in the loops; adjacent threads read adjacent channels
  // (an absent part's strides are never read: its input may have fewer dimensions)
  const int64_t xt = x_strides[1];
  const int64_t xb = int64_t(b) * x_strides[0] + int64_t(c) * x_strides[2];
  const int64_t gt = GATE_IN ? gate_in_strides[1] : 0;
  const int64_t gb = GATE_IN ? int64_t(b) * gate_in_strides[0] + int64_t(c) * gate_in_strides[2]
                             : 0;
  const int64_t ot = GATE_OUT ? gate_out_strides[1] : 0;
  const int64_t ob = GATE_OUT ? int64_t(b) * gate_out_strides[0] +
                                    int64_t(c) * gate_out_strides[2] : 0;
  const int64_t mt = MASK ? mask_strides[1] : 0;
  const int64_t mb = MASK ? int64_t(b) * mask_strides[0] : 0;
  const int64_t st = STATE ? state_in_strides[1] : 0;
  const int64_t sb = STATE ? int64_t(b) * state_in_strides[0] + int64_t(c) * state_in_strides[2]
                           : 0;
  const int64_t yb = int64_t(b) * T * CH + c;
  float wk[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    wk[k] = bricks::to_float(w[int64_t(c) * w_strides[0] + int64_t(k) * w_strides[1]]);
  }
  const float bc = BIAS ? bricks::to_float(bias[int64_t(c) * bias_strides[0]]) : 0.0f;
  // the window: win[j] holds u at position t - (K - 1) + j
  float win[K];
  const int t0 = run * TT;
#pragma unroll
  for (int j = 0; j < K - 1; ++j) {
    const int pos = t0 - (K - 1) + j;
    float u = 0.0f;
    if (pos < 0) {
      if (STATE) {
        u = bricks::to_float(state_in[sb + int64_t(K - 1 + pos) * st]);
      }
    } else {
      u = GATE_IN ? bricks::to_float(bricks::from_float<InT>(
                        bricks::to_float(gate_in[gb + pos * gt]) *
                        bricks::to_float(x[xb + pos * xt])))
                  : bricks::to_float(x[xb + pos * xt]);
      if (MASK && mask[mb + pos * mt] == 0) {
        u = 0.0f;
      }
    }
    win[j] = u;
  }
  const int t1 = min(t0 + TT, T);
  // each input's element at token t, advanced by its row stride (no multiply per token)
  int64_t ix = xb + t0 * xt, ig = gb + t0 * gt, io = ob + t0 * ot, im = mb + t0 * mt;
  int64_t iy = yb + int64_t(t0) * CH;
  for (int t = t0; t < t1; ++t) {
    float u = GATE_IN ? bricks::to_float(bricks::from_float<InT>(
                            bricks::to_float(gate_in[ig]) * bricks::to_float(x[ix])))
                      : bricks::to_float(x[ix]);
    if (MASK && mask[im] == 0) {
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
      acc *= bricks::to_float(gate_out[io]);
    }
    y[iy] = bricks::from_float<InT>(acc);
#pragma unroll
    for (int k = 0; k < K - 1; ++k) {
      win[k] = win[k + 1];
    }
    ix += xt;
    ig += gt;
    io += ot;
    im += mt;
    iy += CH;
  }
  // the next state (the first run's threads): [state_in, u][ends + j], j < K - 1
  if (run == 0) {
    const int e0 = ENDS ? ends[int64_t(b) * ends_strides[0]] : T;
    for (int j = 0; j < K - 1; ++j) {
      const int idx = e0 + j;  // position in [state_in, u]
      float u = 0.0f;
      if (idx < K - 1) {
        if (STATE) {
          u = bricks::to_float(state_in[sb + int64_t(idx) * st]);
        }
      } else {
        const int64_t p = idx - (K - 1);
        u = GATE_IN ? bricks::to_float(bricks::from_float<InT>(
                          bricks::to_float(gate_in[gb + p * gt]) *
                          bricks::to_float(x[xb + p * xt])))
                    : bricks::to_float(x[xb + p * xt]);
        if (MASK && mask[mb + p * mt] == 0) {
          u = 0.0f;
        }
      }
      state_out[(int64_t(b) * (K - 1) + j) * CH + c] = bricks::from_float<InT>(u);
    }
  }
}
