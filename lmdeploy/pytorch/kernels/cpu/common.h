// Shared by the native CPU kernels: headers and the element conversions to fp32.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of an fp32; a shift the compiler can vectorize.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor kv_lens, double scale);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  c10::optional<torch::Tensor> residual);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
