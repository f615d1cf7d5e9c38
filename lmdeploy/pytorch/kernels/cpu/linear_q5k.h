// GGUF Q5_K weights as the file holds them (linear_q5k.cpp); built with AVX512-BF16.
#pragma once

#include "dequantized_linear.h"

bool q5k_gemv_available();
torch::Tensor q5k_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales);
// The weights of q5k_linear's codes and scales as tiles (rounded to bf16 from the exact fp32).
TiledWeight q5k_tiled(const torch::Tensor& codes, const torch::Tensor& scales);
