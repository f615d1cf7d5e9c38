// Gated DeltaNet's one-token decode (Qwen3-Next, Qwen3.5 linear attention; Kimi-Linear's KDA), gated_delta.cpp;
// torch twins in kernels/gated_delta.py.
#pragma once

#include "torch_headers.h"

// Whether gated_delta_decode was built (AVX-512).
bool gated_delta_available();
// The gated delta rule for one token of each of B sequences: q, k [B, Hk, Dk], v [B, H, Dv], log decay g [B, H]
// (or [B, H, Dk]: one per key feature, KDA) and beta [B, H]; sequence b updates row slots[b] of the fp32 states
// [slots, H, Dk, Dv] in place. fp32 [B, H, Dv].
torch::Tensor gated_delta_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const torch::Tensor& g, const torch::Tensor& beta, const torch::Tensor& states,
                                 const torch::Tensor& slots);
// SiLU of the depthwise causal convolution of one new input x [B, C] after row slots[b] of conv_states
// [slots, C, K - 1] by weight [C, K]; shifts x into those rows in place. [B, C] in x's dtype.
torch::Tensor causal_conv1d_decode(const torch::Tensor& x, const torch::Tensor& conv_states,
                                   const torch::Tensor& slots, const torch::Tensor& weight);
