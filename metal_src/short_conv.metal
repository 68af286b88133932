// Short-conv brick: a causal depthwise convolution of K taps over a prefill, from the conv
// state, with the optional input gate, mask, bias, SiLU and output gate of bricks/short_conv/
// op.py. One thread per (channel, run of TT tokens, batch row): it keeps the last K inputs of
// its channel in registers and slides over its tokens, so adjacent threads read adjacent
// channels (coalesced rows). Per token t of channel c:
//   u_t = InT(gate_in_t * x_t), 0 where the mask is False (rounded as mlx-lm's product)
//   y_t = OutT(act(sum_k w[c][k] u_{t + k - (K - 1)} + bias[c]) * gate_out_t)
// with u at negative positions read from state_in (zeros without one). The threads of the
// first token run also write the next state: the K - 1 inputs of [state_in, u] starting at
// ends[b] (the last K - 1 when ends[b] == T, or without ends).
//
// Template: InT (x and gates dtype), CH (channels), K (taps, 2..8), TT (tokens per thread),
// GATE_IN, GATE_OUT, BIAS, STATE, MASK, ENDS, SILU (0 / 1: which parts are present).
// Inputs, read through their strides (views such as the three column blocks of one in-
// projection's output come without a copy): x, gate_in, gate_out (B, T, CH) InT; w (CH, K, ...)
// any float; bias (CH) any float; state_in (B, K - 1, CH) any float; mask (B, T) uint8; ends
// (B) int32 in [0, T]. An absent part's input is any array, never read. T is x_shape[1].
// Outputs: y (B, T, CH) InT; state_out (B, K - 1, CH) InT; every element written.
// Grid: (CH, ceil(T / TT), B) threads; threads past CH (a CUDA block's tail) do nothing.

const int T = int(x_shape[1]);
const int c = int(thread_position_in_grid.x);
const int run = int(thread_position_in_grid.y);
const int b = int(thread_position_in_grid.z);
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
  for (int k = 0; k < K; ++k) {
    // lint-ok: strided-scalar-load K <= 8 taps, read once per thread
    wk[k] = float(w[int64_t(c) * w_strides[0] + int64_t(k) * w_strides[1]]);
  }
  const float bc = BIAS ? float(bias[int64_t(c) * bias_strides[0]]) : 0.0f;
  // the window: win[j] holds u at position t - (K - 1) + j
  float win[K];
  const int t0 = run * TT;
  for (int j = 0; j < K - 1; ++j) {
    const int pos = t0 - (K - 1) + j;
    float u = 0.0f;
    if (pos < 0) {
      if (STATE) {
        // lint-ok: strided-scalar-load K - 1 state rows per thread, adjacent threads' channels
        u = float(state_in[sb + int64_t(K - 1 + pos) * st]);
      }
    } else {
      // lint-ok: strided-scalar-load adjacent threads read adjacent channels of each row
      u = GATE_IN ? float(InT(float(gate_in[gb + pos * gt]) * float(x[xb + pos * xt])))
                  : float(x[xb + pos * xt]);  // lint-ok: strided-scalar-load (as above)
      // lint-ok: strided-scalar-load one byte per row, the same for a threadgroup
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
    float u = GATE_IN ? float(InT(float(gate_in[ig]) * float(x[ix]))) : float(x[ix]);
    if (MASK && mask[im] == 0) {
      u = 0.0f;
    }
    win[K - 1] = u;
    float acc = bc;
    for (int k = 0; k < K; ++k) {
      acc += wk[k] * win[k];
    }
    if (SILU) {
      acc = acc / (1.0f + exp(-acc));
    }
    if (GATE_OUT) {
      acc *= float(gate_out[io]);
    }
    y[iy] = InT(acc);
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
          // lint-ok: strided-scalar-load K - 1 state rows per thread, adjacent channels
          u = float(state_in[sb + int64_t(idx) * st]);
        }
      } else {
        const int64_t p = idx - (K - 1);
        // lint-ok: strided-scalar-load K - 1 rows per thread, adjacent threads' channels
        u = GATE_IN ? float(InT(float(gate_in[gb + p * gt]) * float(x[xb + p * xt])))
                    : float(x[xb + p * xt]);  // lint-ok: strided-scalar-load (as above)
        // lint-ok: strided-scalar-load one byte per row
        if (MASK && mask[mb + p * mt] == 0) {
          u = 0.0f;
        }
      }
      state_out[(int64_t(b) * (K - 1) + j) * CH + c] = InT(u);
    }
  }
}
