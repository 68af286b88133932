// Short-conv brick: a causal depthwise convolution of K taps over a prefill, from the conv
// state, with the optional input gate, mask, bias, SiLU and output gate of bricks/short_conv/
// op.py. One thread per (channel, run of TT tokens, batch row): it keeps the last K inputs of
// its channel in registers and slides over its tokens, so adjacent threads read adjacent
// channels (coalesced rows). Per token t of channel c:
//   u_t = InT(gate_in_t * x_t), 0 where the mask is False (rounded as mlx-lm's product)
//   y_t = OutT(act(sum_k w[c][k] u_{t + k - (K - 1)} + bias[c]) * gate_out_t)
// with u at negative positions read from state_in. The threads of the first token run also
// write the next state: the K - 1 inputs of [state_in, u] starting at ends[b] (the last K - 1
// when ends[b] == T).
//
// Template: InT (x, gates, bias, state dtype), CH (channels), K (taps, 2..8), TT (tokens per
// thread), GATE_IN, GATE_OUT, BIAS, MASK, SILU (0 / 1: which parts are present).
// Inputs (row-contiguous): x, gate_in, gate_out (B, T, CH) InT (an absent gate: one element,
//   not read); w (CH, K) float; bias (CH) InT (absent: one element); state_in (B, K - 1, CH)
//   InT; mask (B, T) uint8 (absent: one element); ends (B) int32 in [0, T]; iparams int32 [T].
// Outputs: y (B, T, CH) InT; state_out (B, K - 1, CH) InT; every element written.
// Grid: (CH, ceil(T / TT), B) threads; threads past CH (a CUDA block's tail) do nothing.

const int T = iparams[0];
const int c = int(thread_position_in_grid.x);
const int run = int(thread_position_in_grid.y);
const int b = int(thread_position_in_grid.z);
static_assert(K >= 2 && K <= 8, "2 to 8 taps");
if (c < CH) {
  const int64_t row0 = int64_t(b) * T;
  float wk[K];
  for (int k = 0; k < K; ++k) {
    wk[k] = w[c * K + k];
  }
  const float bc = BIAS ? float(bias[c]) : 0.0f;
  // the window: win[j] holds u at position t - (K - 1) + j
  float win[K];
  const int t0 = run * TT;
  for (int j = 0; j < K - 1; ++j) {
    const int pos = t0 - (K - 1) + j;
    float u;
    if (pos < 0) {
      u = float(state_in[(int64_t(b) * (K - 1) + (K - 1) + pos) * CH + c]);
    } else {
      const int64_t i = (row0 + pos) * CH + c;
      u = GATE_IN ? float(InT(float(gate_in[i]) * float(x[i]))) : float(x[i]);
      if (MASK && mask[row0 + pos] == 0) {
        u = 0.0f;
      }
    }
    win[j] = u;
  }
  const int t1 = min(t0 + TT, T);
  for (int t = t0; t < t1; ++t) {
    const int64_t i = (row0 + t) * CH + c;
    float u = GATE_IN ? float(InT(float(gate_in[i]) * float(x[i]))) : float(x[i]);
    if (MASK && mask[row0 + t] == 0) {
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
      acc *= float(gate_out[i]);
    }
    y[i] = InT(acc);
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
        u = float(state_in[(int64_t(b) * (K - 1) + idx) * CH + c]);
      } else {
        const int64_t i = (row0 + idx - (K - 1)) * CH + c;
        u = GATE_IN ? float(InT(float(gate_in[i]) * float(x[i]))) : float(x[i]);
        if (MASK && mask[row0 + idx - (K - 1)] == 0) {
          u = 0.0f;
        }
      }
      state_out[(int64_t(b) * (K - 1) + j) * CH + c] = InT(u);
    }
  }
}
