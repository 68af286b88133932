// MoE brick, router-weighted combine: out[t, d] = sum_s scores[t, s] * y[t * k + s, d], summed in
// float32 (slots in order), one rounding to T. One thread per output element.
//
// Template: T (the output's and y's dtype).
// Inputs: y (R, D) (moe_down's output, rows in (token, slot) order); scores (tokens, k) of any
// float dtype.
// Output: out (tokens, D).
// Grid: (D, tokens, 1), threadgroup (min(D, 256), 1, 1).

const int D = y_shape[1];
const int k = scores_shape[1];
const int d = int(thread_position_in_grid.x);
const int t = int(thread_position_in_grid.y);
if (d < D) {
  float acc = 0.0f;
  for (int s = 0; s < k; ++s) {
    acc = fma(float(scores[long(t) * k + s]), float(y[(long(t) * k + s) * D + d]), acc);
  }
  out[long(t) * D + d] = T(acc);
}
