// GGUF Q5_K weights as the file holds them (linear_q5k.cpp); built with AVX512-BF16.
#pragma once

#include "dequantized_linear.h"

bool q5k_gemv_available();
torch::Tensor q5k_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales);
// The weights of q5k_linear's codes and scales, bf16 [N, K] (rounded from the exact fp32).
torch::Tensor q5k_dequantize(const torch::Tensor& codes, const torch::Tensor& scales,
                             WeightBuffer buffer = fresh_weight);
