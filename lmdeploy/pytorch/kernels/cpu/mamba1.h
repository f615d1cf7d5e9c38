// Mamba-1's selective scan (Jamba, Mamba, Falcon Mamba), mamba1.cpp; torch twin in kernels/mamba1.py.
#pragma once

#include "torch_headers.h"

// Whether mamba1_scan was built (AVX-512).
bool mamba1_scan_available();
// Segments of tokens through the selective scan: segment s is the next lengths[s] rows of x, dt [T, D] (dt after
// its softplus), B, C [T, N] (all fp32, contiguous) and steps row slots[s] of the fp32 states [slots, D, N] in place,
// S = exp(dt A) S + (dt x) B per token, with A [D, N]; returns y = S C per token and channel, fp32 [T, D]. Every
// (token, channel) takes the same instructions wherever its segment starts, so a prefill split anywhere and a
// decode give the same bits.
torch::Tensor mamba1_scan(const torch::Tensor& x, const torch::Tensor& dt, const torch::Tensor& A,
                          const torch::Tensor& B, const torch::Tensor& C, const torch::Tensor& states,
                          const torch::Tensor& slots, const torch::Tensor& lengths);
