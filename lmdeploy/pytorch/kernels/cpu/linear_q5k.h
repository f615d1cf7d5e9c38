// GGUF Q5_K weights as the file holds them (linear_q5k.cpp); built with AVX512-BF16.
#pragma once

#include "torch_headers.h"

bool q5k_gemv_available();
torch::Tensor q5k_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales);
