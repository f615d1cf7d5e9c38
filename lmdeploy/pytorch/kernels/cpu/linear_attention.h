// A Gated DeltaNet linear-attention layer (Qwen3-Next, Qwen3.5) in the native decoder stack, linear_attention.cpp:
// the kernels of GatedDeltaNet.forward (models/qwen3_next.py) for decode-only steps, in its order.
#pragma once

#include "torch_headers.h"

#include <vector>

// The layer between its input projections (the stack layer's `qkv`, their outputs side by side) and its out_proj
// (the layer's `o`): with `grouped_projections` (Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped by key head)
// [qkvz | ba], else (Qwen3.5's) [qkv | z | b | a]; then the one-token causal conv1d and SiLU, the gated delta
// rule on the sequences' state rows (decay -exp(a_log) * softplus(a + dt_bias), beta = sigmoid(b)), and the
// RMSNorm of each value head times `norm_weight` times SiLU(z). `conv_weight` [C, K]; with `value_heads_tiled`
// value head i reads key head i % Hk, else i / (H / Hk).
struct LinearAttention {
  LinearAttention(int64_t num_k_heads, int64_t num_v_heads, int64_t k_dim, int64_t v_dim, bool grouped_projections,
                  bool value_heads_tiled, torch::Tensor conv_weight, torch::Tensor a_log, torch::Tensor dt_bias,
                  torch::Tensor norm_weight, double eps);
  // The layer's output before out_proj [T, H * Dv] for the projected tokens (one a sequence, of row slots[t] of
  // its state pools `state` = (conv [slots, C, K - 1], delta [slots, H, Dk, Dv] fp32), which it updates in place).
  torch::Tensor operator()(const torch::Tensor& projected, const std::vector<torch::Tensor>& state,
                           const torch::Tensor& slots) const;

  int64_t num_k_heads, num_v_heads, k_dim, v_dim;
  bool grouped_projections, value_heads_tiled;
  torch::Tensor conv_weight, a_log, dt_bias, norm_weight;
  double eps;
};
