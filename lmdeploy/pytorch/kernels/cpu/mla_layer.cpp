// DeepSeek's multi-head latent attention layer in the native decoder stack (LatentAttention in decoder_stack.h):
// the kernels and order of DeepseekV3Attention.forward (models/deepseek_v3.py) and LatentAttention.forward
// (nn/mla.py), so that its results are theirs.
#include <ATen/ops/einsum.h>
#include <ATen/ops/stack.h>

#include "decoder_stack.h"

LatentAttention::LatentAttention(c10::optional<Projection> q_a, c10::optional<torch::Tensor> q_a_norm, Projection q,
                                 Projection kv_a, torch::Tensor kv_a_norm, torch::Tensor kv_b, int64_t num_heads,
                                 int64_t kv_lora_rank, int64_t nope_dim, int64_t rope_dim, int64_t v_head_dim,
                                 bool interleaved_rope, double scale, double norm_eps, bool scaled_queries)
    : q_a(std::move(q_a)), q_a_norm(std::move(q_a_norm)), q(std::move(q)), kv_a(std::move(kv_a)),
      kv_a_norm(std::move(kv_a_norm)), kv_b(std::move(kv_b)), num_heads(num_heads), kv_lora_rank(kv_lora_rank),
      nope_dim(nope_dim), rope_dim(rope_dim), v_head_dim(v_head_dim), interleaved_rope(interleaved_rope),
      scale(scale), norm_eps(norm_eps), scaled_queries(scaled_queries) {
  TORCH_CHECK(this->q_a.has_value() == this->q_a_norm.has_value(), "mla: q_a and q_a_norm come together");
  TORCH_CHECK(num_heads > 0 && kv_lora_rank > 0 && nope_dim > 0 && v_head_dim > 0 && rope_dim > 0 && rope_dim % 2 == 0,
              "mla: positive sizes, an even rope_dim");
  TORCH_CHECK(this->kv_a_norm.dim() == 1 && this->kv_a_norm.size(0) == kv_lora_rank, "mla: kv_a_norm is [kv_lora_rank]");
  TORCH_CHECK(this->kv_b.dim() == 2 && this->kv_b.size(0) == num_heads * (nope_dim + v_head_dim) &&
                  this->kv_b.size(1) == kv_lora_rank,
              "mla: kv_b is kv_b_proj's dense weight [H * (nope_dim + v_head_dim), kv_lora_rank]");
}

namespace {

// apply_rope of nn/rotary.py on x [T, H, rope_dim], whose every feature turns.
torch::Tensor rope(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, bool interleaved) {
  if (interleaved) x = x.unflatten(-1, {x.size(-1) / 2, 2}).transpose(-1, -2).flatten(-2);
  return apply_rotary(x, cos, sin);
}

// quantize_kv of kernels/kv_quant.py: x [..., D] -> (codes uint8 [..., D * bits / 8], (scale, min) fp32 [..., 2]).
std::tuple<torch::Tensor, torch::Tensor> quantize_rows(const torch::Tensor& values, int64_t bits) {
  const auto x = values.to(at::kFloat);
  const auto low = x.amin(-1, true), high = x.amax(-1, true);
  const double top = static_cast<double>((1 << bits) - 1);
  const auto scale = high.sub(low).div(top).clamp_min(1e-8);
  auto codes = x.sub(low).mul(scale.reciprocal()).add(0.5).floor().clamp_(0, top).to(at::kByte);
  if (bits == 4) {
    const int64_t half = codes.size(-1) / 2;
    codes = codes.narrow(-1, 0, half).bitwise_or(codes.narrow(-1, half, half).bitwise_left_shift(4));
  }
  return std::make_tuple(codes, torch::cat({scale, low}, -1));
}

// fill_latent_cache of kernels/mla.py: latent [T, D] to block kv_blocks[i] at kv_offsets[i], quantized with
// quant_policy (the latent [:v_dim] and the rotary key each with its own scale and zero).
void fill_latent_cache(const torch::Tensor& latent, const std::vector<torch::Tensor>& cache, const StepTensors& step,
                       int64_t v_dim, int64_t quant_policy) {
  const c10::List<c10::optional<at::Tensor>> index{step.kv_blocks, step.kv_offsets};
  if (!quant_policy) {
    cache[0].index_put_(index, latent);
    return;
  }
  auto [latent_codes, latent_sz] = quantize_rows(latent.narrow(-1, 0, v_dim), quant_policy);
  auto [rope_codes, rope_sz] = quantize_rows(latent.narrow(-1, v_dim, latent.size(-1) - v_dim), quant_policy);
  cache[1].index_put_(index, at::stack({latent_sz, rope_sz}, -2));
  cache[0].index_put_(index, torch::cat({latent_codes, rope_codes}, -1));
}

}  // namespace

torch::Tensor LatentAttention::operator()(const torch::Tensor& x, const std::vector<torch::Tensor>& cache,
                                          const StepTensors& step, int64_t quant_policy) const {
  TORCH_CHECK(cache.size() == (quant_policy ? 2u : 1u), "mla: a layer's cache is (latent), quantized (codes, "
              "scales_zeros)");
  const auto queries = q_a ? q(std::get<0>(rms_norm((*q_a)(x), *q_a_norm, norm_eps, c10::nullopt))) : q(x);
  const auto heads = queries.view({-1, num_heads, nope_dim + rope_dim});
  auto q_nope = heads.narrow(-1, 0, nope_dim);
  const auto q_rope = heads.narrow(-1, nope_dim, rope_dim);
  const auto compressed = kv_a(x);
  const auto k_rope = compressed.narrow(-1, kv_lora_rank, rope_dim);
  auto q_turned = rope(q_rope.contiguous(), step.cos, step.sin, interleaved_rope);
  if (scaled_queries) {  // scale_queries of nn/rotary.py, as DeepseekV3Attention.queries_and_latent takes it
    TORCH_CHECK(step.q_scale, "an mla layer with scaled_queries needs the step's q_scale");
    const auto factors = step.q_scale->view({-1, 1, 1});
    q_nope = q_nope.mul(factors).to(heads.scalar_type());
    q_turned = q_turned.mul(factors).to(heads.scalar_type());
  }
  const auto k_turned = rope(k_rope.unsqueeze(1).contiguous(), step.cos, step.sin, interleaved_rope).squeeze(1);
  const auto normed = std::get<0>(rms_norm(compressed.narrow(-1, 0, kv_lora_rank).contiguous(), kv_a_norm, norm_eps,
                                           c10::nullopt));
  const auto latent = torch::cat({normed, k_turned}, -1);
  fill_latent_cache(latent, cache, step, kv_lora_rank, quant_policy);
  const auto w_kv = kv_b.view({num_heads, nope_dim + v_head_dim, kv_lora_rank});
  const auto absorbed = torch::cat({at::einsum("thn,hnl->thl", {q_nope, w_kv.narrow(1, 0, nope_dim)}), q_turned}, -1);
  const c10::optional<torch::Tensor> scales_zeros =
      quant_policy ? c10::optional<torch::Tensor>(cache[1]) : c10::nullopt;
  const int64_t prefill = step.num_prefill_tokens, rows = x.size(0);
  std::vector<torch::Tensor> parts;
  if (step.prefill_q_len)
    parts.push_back(mla_prefill_attention(absorbed.narrow(0, 0, prefill), latent.narrow(0, 0, prefill), cache[0],
                                          *step.prefill_block_table, *step.prefill_q_start, *step.prefill_q_len,
                                          *step.prefill_ctx_len, step.prefill_max_q_len, scale, kv_lora_rank,
                                          scales_zeros, quant_policy));
  if (step.decode_blocks)
    parts.push_back(mla_decode_attention(absorbed.narrow(0, prefill, rows - prefill), cache[0], *step.decode_blocks,
                                         *step.decode_kv_lens, scale, kv_lora_rank, scales_zeros, quant_policy));
  TORCH_CHECK(!parts.empty(), "a step has prefill or decode rows");
  const auto out = parts.size() == 1 ? parts[0] : torch::cat(parts);
  return at::einsum("thl,hvl->thv", {out, w_kv.narrow(1, nope_dim, v_head_dim)}).flatten(1);
}
