// Gated DeltaNet's decode step in the native decoder stack: GatedDeltaNet.forward (models/qwen3_next.py) for
// steps of one token a sequence, on the same kernels (gated_delta.cpp's causal_conv1d_decode and
// gated_delta_decode) and ATen ops in the same order, so its results are the layer's bit for bit.
#include "linear_attention.h"

#include <ATen/ops/silu.h>
#include <ATen/ops/softplus.h>

#include "gated_delta.h"

LinearAttention::LinearAttention(int64_t num_k_heads, int64_t num_v_heads, int64_t k_dim, int64_t v_dim,
                                 bool grouped_projections, bool value_heads_tiled, torch::Tensor conv_weight,
                                 torch::Tensor a_log, torch::Tensor dt_bias, torch::Tensor norm_weight, double eps)
    : num_k_heads(num_k_heads), num_v_heads(num_v_heads), k_dim(k_dim), v_dim(v_dim),
      grouped_projections(grouped_projections), value_heads_tiled(value_heads_tiled),
      conv_weight(std::move(conv_weight)), a_log(std::move(a_log)), dt_bias(std::move(dt_bias)),
      norm_weight(std::move(norm_weight)), eps(eps) {
  TORCH_CHECK(num_k_heads > 0 && num_v_heads % num_k_heads == 0 && k_dim > 0 && v_dim > 0,
              "a linear-attention layer's value heads are a multiple of its key heads, its head sizes positive");
  const int64_t conv_dim = 2 * num_k_heads * k_dim + num_v_heads * v_dim;
  TORCH_CHECK(this->conv_weight.dim() == 2 && this->conv_weight.size(0) == conv_dim,
              "a linear-attention layer's conv_weight is [", conv_dim, ", K]");
  TORCH_CHECK(this->a_log.numel() == num_v_heads && this->dt_bias.numel() == num_v_heads,
              "a linear-attention layer's a_log and dt_bias hold one value per value head");
  TORCH_CHECK(this->norm_weight.dim() == 1 && this->norm_weight.size(0) == v_dim,
              "a linear-attention layer's norm_weight spans a value head");
}

torch::Tensor LinearAttention::operator()(const torch::Tensor& projected, const std::vector<torch::Tensor>& state,
                                          const torch::Tensor& slots) const {
  TORCH_CHECK(state.size() == 2, "a linear-attention layer's state is (conv, delta)");
  const int64_t rows = projected.size(0), key_size = num_k_heads * k_dim, value_size = num_v_heads * v_dim;
  const int64_t conv_dim = 2 * key_size + value_size;
  TORCH_CHECK(projected.dim() == 2 && projected.size(1) == conv_dim + value_size + 2 * num_v_heads,
              "a linear-attention layer's projections give ", conv_dim + value_size + 2 * num_v_heads, " features");
  torch::Tensor qkv, z, b, a;
  if (grouped_projections) {  // GatedDeltaNet.project: q, k, v, z and then b, a grouped by key head
    const int64_t per_key_head = num_v_heads / num_k_heads;
    const auto qkvz = projected.narrow(1, 0, conv_dim + value_size)
                          .reshape({rows, num_k_heads, 2 * k_dim + 2 * per_key_head * v_dim})
                          .split_with_sizes({k_dim, k_dim, per_key_head * v_dim, per_key_head * v_dim}, -1);
    const auto ba = projected.narrow(1, conv_dim + value_size, 2 * num_v_heads)
                        .reshape({rows, num_k_heads, 2 * per_key_head})
                        .split(per_key_head, -1);
    qkv = torch::cat({qkvz[0].flatten(1), qkvz[1].flatten(1), qkvz[2].flatten(1)}, -1);
    z = qkvz[3].reshape({rows, num_v_heads, v_dim});
    b = ba[0].reshape({rows, num_v_heads});
    a = ba[1].reshape({rows, num_v_heads});
  } else {
    qkv = projected.narrow(1, 0, conv_dim);
    z = projected.narrow(1, conv_dim, value_size).reshape({rows, num_v_heads, v_dim});
    b = projected.narrow(1, conv_dim + value_size, num_v_heads);
    a = projected.narrow(1, conv_dim + value_size + num_v_heads, num_v_heads);
  }
  const auto beta = b.sigmoid();
  const auto g = a_log.to(at::kFloat).exp().neg().mul(at::softplus(a.to(at::kFloat).add(dt_bias.to(at::kFloat))));
  const auto mixed = causal_conv1d_decode(qkv, state[0], slots, conv_weight);
  auto q = mixed.narrow(-1, 0, key_size).unflatten(-1, {num_k_heads, k_dim});
  auto k = mixed.narrow(-1, key_size, key_size).unflatten(-1, {num_k_heads, k_dim});
  const auto v = mixed.narrow(-1, 2 * key_size, value_size).unflatten(-1, {num_v_heads, v_dim});
  if (value_heads_tiled) {
    q = q.repeat({1, num_v_heads / num_k_heads, 1});
    k = k.repeat({1, num_v_heads / num_k_heads, 1});
  }
  const auto out = gated_delta_decode(q, k, v, g, beta, state[1], slots).to(projected.scalar_type());
  // GatedRMSNorm.forward
  const auto x32 = out.to(at::kFloat);
  const auto normed = x32.mul(x32.pow(2).mean(-1, true).add(eps).rsqrt());
  return norm_weight.mul(normed.to(norm_weight.scalar_type()))
      .mul(at::silu(z.to(at::kFloat)))
      .to(norm_weight.scalar_type())
      .flatten(1);
}
