// A Llama-style decoder stack on the CPU in one call per step: the kernels and order of
// LlamaDecoderLayer (lmdeploy/pytorch/models/llama.py) on native bf16 GEMM weights, without the
// Python between them. In a 64-row decode step that Python took about 5 ms of 70: it runs three
// times slower than on its own, on caches the kernels have just flushed.
#include "common.h"

DecoderStack::DecoderStack(const std::vector<std::vector<c10::optional<torch::Tensor>>>& layers, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t quant_policy)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), quant_policy_(quant_policy), eps_(eps),
      scale_(scale) {
  for (const auto& w : layers) {
    TORCH_CHECK(w.size() == 10 && w[0] && w[1] && w[2] && w[4] && w[6] && w[8],
                "a layer is (input_norm, post_norm, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias, down, "
                "down_bias), the biases optional");
    layers_.push_back(Layer{*w[0], *w[1], *w[2], w[3], *w[4], w[5], *w[6], w[7], *w[8], w[9]});
  }
}

torch::Tensor DecoderStack::attention(const torch::Tensor& qkv, const std::vector<torch::Tensor>& cache,
                                      const StepTensors& step) const {
  TORCH_CHECK(cache.size() == (quant_policy_ ? 4u : 2u), "a layer's cache is (k, v), quantized (k, v, k_sz, v_sz)");
  const torch::Tensor &k_cache = cache[0], &v_cache = cache[1];
  const c10::optional<torch::Tensor> k_sz = quant_policy_ ? c10::optional<torch::Tensor>(cache[2]) : c10::nullopt;
  const c10::optional<torch::Tensor> v_sz = quant_policy_ ? c10::optional<torch::Tensor>(cache[3]) : c10::nullopt;
  const auto heads = qkv.view({qkv.size(0), num_heads_ + 2 * num_kv_heads_, head_dim_});
  const auto qk = apply_rotary(heads.narrow(1, 0, num_heads_ + num_kv_heads_), step.cos, step.sin);
  const auto q = qk.narrow(1, 0, num_heads_), k = qk.narrow(1, num_heads_, num_kv_heads_);
  const auto v = heads.narrow(1, num_heads_ + num_kv_heads_, num_kv_heads_);
  fill_kv_cache(k, v, k_cache, v_cache, step.kv_blocks, step.kv_offsets, k_sz, v_sz, quant_policy_);
  const int64_t prefill = step.num_prefill_tokens, rows = qkv.size(0);
  std::vector<torch::Tensor> parts;
  if (step.prefill_q_len)
    parts.push_back(paged_prefill_attention(q.narrow(0, 0, prefill), k.narrow(0, 0, prefill),
                                            v.narrow(0, 0, prefill), k_cache, v_cache, *step.prefill_block_table,
                                            *step.prefill_q_start, *step.prefill_q_len, *step.prefill_ctx_len,
                                            step.prefill_max_q_len, scale_, k_sz, v_sz, quant_policy_));
  if (step.decode_blocks)
    parts.push_back(paged_decode_attention(q.narrow(0, prefill, rows - prefill), k_cache, v_cache,
                                           *step.decode_blocks, *step.decode_kv_lens, scale_, k_sz, v_sz,
                                           quant_policy_));
  TORCH_CHECK(!parts.empty(), "a step has prefill or decode rows");
  return (parts.size() == 1 ? parts[0] : torch::cat(parts)).flatten(1);
}

std::tuple<torch::Tensor, torch::Tensor> DecoderStack::forward(
    torch::Tensor x, const std::vector<std::vector<torch::Tensor>>& kv_caches, const StepTensors& step) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "one (k_cache, v_cache) per layer");
  torch::Tensor sum;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& w = layers_[i];
    torch::Tensor h;
    std::tie(h, sum) = rms_norm(x, w.input_norm, eps_, sum.defined() ? c10::optional<torch::Tensor>(sum)
                                                                      : c10::nullopt);
    const auto attended = attention(bf16_linear(h, w.qkv, w.qkv_bias), kv_caches[i], step);
    std::tie(h, sum) = rms_norm(bf16_linear(attended, w.o, w.o_bias), w.post_norm, eps_, sum);
    x = bf16_linear(bf16_gate_up_silu(h, w.gate_up, w.gate_up_bias), w.down, w.down_bias);
  }
  return {x, sum};
}
