// A Llama-style decoder stack on the CPU in one call per step: the kernels and order of
// LlamaDecoderLayer (lmdeploy/pytorch/models/llama.py, and of the GLM-4 and Gemma layers whose parts
// LayerWeights names; a MoE family's MLP is moe_block.cpp's) on native GEMM weights, without the Python
// between them. In a 64-row decode step that Python took about 5 ms of 70: it runs three times slower than
// on its own, on caches the kernels have just flushed.
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/where.h>

#include "decoder_stack.h"
#include "linear_q5k.h"

Projection::Projection(const std::string& kind_name, torch::Tensor weight, c10::optional<torch::Tensor> compensation,
                       c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias,
                       c10::optional<int64_t> outputs, c10::optional<std::string> isa)
    : weight(std::move(weight)), compensation(std::move(compensation)), scale(std::move(scale)),
      bias(std::move(bias)) {
  if (kind_name == "bf16") {
    kind = Kind::kBf16;
    TORCH_CHECK(this->weight.scalar_type() == at::kBFloat16 && this->weight.dim() == 4 && !this->compensation &&
                    !this->scale,
                "a bf16 projection is its bf16 panels (and bias, and outputs), without compensation or scale");
    const int64_t rows = this->weight.size(0) * this->weight.size(2);
    this->outputs = outputs.value_or(rows);
    TORCH_CHECK(this->outputs > rows - 2 * this->weight.size(2) && this->outputs <= rows,
                "a bf16 projection's outputs fill its last panel's rows (a gate-and-up one's last two) in part or "
                "whole");
  } else if (kind_name == "w8a8") {
    kind = Kind::kW8A8;
    TORCH_CHECK(this->weight.scalar_type() == at::kChar && this->compensation && this->scale,
                "a w8a8 projection is its packed int8 weight, compensation and scale (and bias)");
  } else if (kind_name == "int4") {
    kind = Kind::kInt4;
    TORCH_CHECK(this->weight.scalar_type() == at::kByte && !this->compensation && this->scale &&
                    this->scale->scalar_type() == at::kHalf,
                "an int4 projection is its packed 4-bit weight and fp16 scales (and bias), without compensation");
  } else if (kind_name == "q4k" || kind_name == "q4k_dequantized") {
    kind = kind_name == "q4k" ? Kind::kQ4K : Kind::kQ4KDequantized;
    TORCH_CHECK(this->weight.scalar_type() == at::kByte && !this->compensation && this->scale &&
                    this->scale->scalar_type() == at::kByte,
                "a ", kind_name,
                " projection is its packed 4-bit weight and scale bytes (and bias), without compensation");
  } else if (kind_name == "q6k") {
    kind = Kind::kQ6K;
    TORCH_CHECK(this->weight.scalar_type() == at::kByte && !this->compensation && this->scale &&
                    this->scale->scalar_type() == at::kByte,
                "a q6k projection is its packed codes and scales (and bias), without compensation");
  } else if (kind_name == "q5k" || kind_name == "q5k_dequantized" || kind_name == "q6k_dequantized") {
    kind = kind_name == "q5k" ? Kind::kQ5K : kind_name == "q5k_dequantized" ? Kind::kQ5KDequantized
                                                                             : Kind::kQ6KDequantized;
    TORCH_CHECK(this->weight.scalar_type() == at::kByte && this->weight.dim() == 3 && !this->compensation &&
                    this->scale && this->scale->scalar_type() == at::kByte,
                "a ", kind_name, " projection is its packed codes and scales (and bias), without compensation");
  } else if (kind_name == "fp32") {
    kind = Kind::kFp32;
    TORCH_CHECK(fp32_packed_linear_available(),
                "an fp32 projection runs fp32_packed_linear, built with AVX-512 or AVX2 and FMA");
    TORCH_CHECK(this->weight.scalar_type() == at::kFloat && this->weight.dim() == 3 && this->weight.size(2) == 16 &&
                    outputs && *outputs > 16 * (this->weight.size(0) - 1) && *outputs <= 16 * this->weight.size(0) &&
                    !this->compensation && !this->scale,
                "an fp32 projection is its weight's packed tiles [ceil(N / 16), K, 16] (pack_fp32_weight) and its "
                "outputs N (and bias), without compensation or scale");
    this->outputs = *outputs;
    const auto isas = fp32_packed_linear_isas();
    this->isa = isa.value_or(isas.front());
    TORCH_CHECK(std::find(isas.begin(), isas.end(), this->isa) != isas.end(), "fp32_packed_linear was not built for ",
                this->isa);
  } else if (kind_name == "mxfp4" || kind_name == "mxfp4_dequantized") {
    kind = kind_name == "mxfp4" ? Kind::kMxfp4 : Kind::kMxfp4Dequantized;
    TORCH_CHECK(this->weight.scalar_type() == at::kByte && this->weight.dim() == 3 && !this->compensation &&
                    this->scale && this->scale->scalar_type() == at::kByte,
                "an mxfp4 projection is its blocks [N, K / 32, 16] and scale bytes [N, K / 32] (and bias), without "
                "compensation");
  } else if (kind_name == "w8a8_torch") {
    kind = Kind::kW8A8Torch;
    TORCH_CHECK(this->weight.scalar_type() == at::kChar && this->weight.dim() == 2 && !this->compensation &&
                    this->scale && this->scale->scalar_type() == at::kFloat,
                "a w8a8_torch projection is its int8 weight [N, K] and fp32 scale [N, 1] (and bias), without "
                "compensation");
  } else if (kind_name == "q8" || kind_name == "q8_dequantized") {
    kind = kind_name == "q8" ? Kind::kQ8 : Kind::kQ8Dequantized;
    TORCH_CHECK(this->weight.scalar_type() == at::kChar && this->weight.dim() == 4 && !this->compensation &&
                    this->scale && this->scale->scalar_type() == at::kHalf && this->scale->dim() == 3,
                "a ", kind_name, " projection is its codes [N / 16, K / 32, 32, 16] (int8) and fp16 scales "
                "[N / 16, K / 32, 16] (and bias), without compensation");
  } else if (kind_name == "int4_torch") {
    kind = Kind::kInt4Torch;
    TORCH_CHECK(this->weight.scalar_type() == at::kByte && this->weight.dim() == 2 && !this->compensation &&
                    this->scale && this->scale->dim() == 3 && this->scale->size(1) == this->weight.size(0) &&
                    this->scale->size(2) == 2 && (2 * this->weight.size(1)) % this->scale->size(0) == 0,
                "an int4_torch projection is its packed codes [N, K / 2] (uint8) and scales_and_zeros [K / G, N, 2] "
                "(and bias), without compensation");
  } else {
    TORCH_CHECK(false, "a projection's kind is 'bf16', 'w8a8', 'int4', 'int4_torch', 'q4k', 'q4k_dequantized', "
                "'q5k', 'q5k_dequantized', 'q6k', 'q6k_dequantized', 'q8', 'q8_dequantized', 'w8a8_torch', "
                "'fp32', 'mxfp4' or 'mxfp4_dequantized', not '", kind_name, "'");
  }
  TORCH_CHECK(!outputs || kind == Kind::kBf16 || kind == Kind::kFp32, "only bf16 and fp32 projections take outputs");
  TORCH_CHECK(!isa || kind == Kind::kFp32, "only fp32 projections take an isa");
}

Projection::Projection(std::vector<Projection> parts) : kind(Kind::kParts), parts(std::move(parts)) {
  TORCH_CHECK(this->parts.size() >= 2, "a stacked projection of parts has two or more");
}

namespace {

// x @ W.T (+ bias), W = weight * scale, x quantized per token on torch's int8 GEMM: W8A8Kernel's w8a8_linear
// (kernels/w8a8.py) in its order.
torch::Tensor w8a8_torch_linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& scale,
                                const c10::optional<torch::Tensor>& bias) {
  const auto xf = x.reshape({-1, x.size(-1)}).to(at::kFloat);
  const auto amax = xf.abs().amax(-1, true);
  const auto inv = at::where(amax.gt(0), at::full_like(amax, 127).div_(amax), at::zeros_like(amax));
  const auto q = xf.mul(inv).round_().clamp_(-127, 127).to(at::kChar);
  auto out = at::_int_mm(q, weight.t()).to(at::kFloat).mul(amax.div(127)).mul(scale.reshape({1, -1}));
  if (bias) out = out.add(bias->to(at::kFloat));
  return out.to(x.scalar_type());
}

}  // namespace

torch::Tensor Projection::operator()(const torch::Tensor& x) const {
  switch (kind) {
    case Kind::kParts: {
      std::vector<torch::Tensor> outs;
      for (const auto& part : parts) outs.push_back(part(x));
      return torch::cat(outs, -1);
    }
    case Kind::kBf16: return bf16_linear(x, weight, bias, outputs);
    case Kind::kW8A8: return int8_linear(x, weight, *compensation, *scale, bias);
    case Kind::kQ4K: return q4k_linear(x, weight, *scale, bias);
    case Kind::kQ4KDequantized: return kquant_dequantized_linear(KQuant::kQ4K, x, weight, *scale, bias, false);
    case Kind::kQ6K: {
      const auto out = q6k_linear(x, weight, *scale).to(x.scalar_type());
      return bias ? out.add(*bias) : out;
    }
    case Kind::kQ5K: {
      const auto out = q5k_linear(x, weight, *scale).to(x.scalar_type());
      return bias ? out.add(*bias) : out;
    }
    case Kind::kQ5KDequantized: return kquant_dequantized_linear(KQuant::kQ5K, x, weight, *scale, bias, false);
    case Kind::kQ6KDequantized: return kquant_dequantized_linear(KQuant::kQ6K, x, weight, *scale, bias, false);
    case Kind::kQ8: {
      const auto out = q8_linear(x, weight, *scale).to(x.scalar_type());
      return bias ? out.add(*bias) : out;
    }
    case Kind::kQ8Dequantized: return kquant_dequantized_linear(KQuant::kQ8_0, x, weight, *scale, bias, false);
    case Kind::kW8A8Torch: return w8a8_torch_linear(x, weight, *scale, bias);
    case Kind::kInt4Torch: {
      const auto out = at::_weight_int4pack_mm_for_cpu(x, weight, 2 * weight.size(1) / scale->size(0), *scale);
      return bias ? out.add(*bias) : out;
    }
    case Kind::kFp32: return fp32_packed_linear(x.to(at::kFloat), weight, outputs, bias, isa);
    case Kind::kMxfp4: {
      const auto out = mxfp4_linear(x, weight, *scale).to(x.scalar_type());
      return bias ? out.add(*bias) : out;
    }
    case Kind::kMxfp4Dequantized: return mxfp4_dequantized_linear(x, weight, *scale, bias);
    default: return int4_linear(x, weight, *scale, bias);
  }
}

torch::Tensor Projection::gate_up_silu(const torch::Tensor& x) const {
  switch (kind) {
    case Kind::kBf16: return bf16_gate_up_silu(x, weight, bias, outputs);
    case Kind::kW8A8: return int8_gate_up_silu(x, weight, *compensation, *scale, bias);
    case Kind::kQ4K:
      TORCH_CHECK(!bias, "a q4k gate-and-up projection has no bias");
      return q4k_gate_up_silu(x, weight, *scale);
    case Kind::kQ4KDequantized:
      return silu_and_mul(kquant_dequantized_linear(KQuant::kQ4K, x, weight, *scale, bias, true));
    case Kind::kQ6K:
    case Kind::kQ5K:
    case Kind::kQ5KDequantized:
    case Kind::kQ6KDequantized:
    case Kind::kQ8:
    case Kind::kQ8Dequantized:
    case Kind::kW8A8Torch:
    case Kind::kInt4Torch:
    case Kind::kFp32:
    case Kind::kParts:
    case Kind::kMxfp4:
    case Kind::kMxfp4Dequantized: return silu_and_mul((*this)(x));
    default:
      TORCH_CHECK(!bias, "an int4 gate-and-up projection has no bias");
      return int4_gate_up_silu(x, weight, *scale);
  }
}

DecoderStack::DecoderStack(std::vector<LayerWeights> layers, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, double eps, double scale, int64_t quant_policy)
    : layers_(std::move(layers)), num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim),
      quant_policy_(quant_policy), eps_(eps), scale_(scale) {
  for (const auto& w : layers_) {
    TORCH_CHECK(w.qkv.has_value() != w.mla.has_value(), "a layer's attention is its qkv projection or its mla block");
    TORCH_CHECK(!w.mla || (!w.q_norm && !w.post_norms_only && w.rotary_dim == 0 && !w.sliding_window &&
                           !w.attention_chunk && !w.sinks && !w.logit_softcap && !w.output_gate && !w.linear_attn),
                "an mla layer has none of the options of a qkv layer's attention (rotary_dim 0)");
    TORCH_CHECK(w.q_norm.has_value() == w.k_norm.has_value(), "a layer has both q and k norms or neither");
    if (w.q_norm) {
      const int64_t q_size = w.qk_norm_across_heads ? num_heads_ * head_dim_ : head_dim_;
      const int64_t k_size = w.qk_norm_across_heads ? num_kv_heads_ * head_dim_ : head_dim_;
      TORCH_CHECK(w.q_norm->dim() == 1 && w.q_norm->size(0) == q_size && w.k_norm->dim() == 1 &&
                      w.k_norm->size(0) == k_size,
                  "a layer's q and k norms span a head, or all heads with qk_norm_across_heads");
    } else {
      TORCH_CHECK(!w.qk_norm_across_heads, "qk_norm_across_heads needs the q and k norms");
    }
    if (w.post_norms_only) {
      TORCH_CHECK(!w.input_norm && !w.post_norm && w.attn_out_norm && w.mlp_out_norm && w.residual_scale == 1.0,
                  "a post_norms_only layer has attn_out_norm and mlp_out_norm, no input_norm, post_norm nor "
                  "residual_scale");
    } else if (w.parallel_block) {
      TORCH_CHECK(w.input_norm && !w.post_norm && !w.attn_out_norm && !w.mlp_out_norm && w.residual_scale == 1.0 &&
                      !w.mla && !w.linear_attn,
                  "a parallel_block layer has its input_norm and qkv attention, no post_norm, output norms nor "
                  "residual_scale");
    } else {
      TORCH_CHECK(w.input_norm && w.post_norm, "a layer has its input_norm and post_norm (or is post_norms_only)");
    }
    TORCH_CHECK(!w.layer_norm || w.input_norm, "a layer_norm layer has its input_norm");
    TORCH_CHECK(w.layer_norm || (!w.input_norm_bias && !w.post_norm_bias),
                "only a layer_norm layer's norms have biases");
    TORCH_CHECK(!w.qk_norm_after_rope || w.q_norm, "qk_norm_after_rope needs the q and k norms");
    TORCH_CHECK(!w.ungated_mlp || ((*w.ungated_mlp == "relu2" || *w.ungated_mlp == "gelu_tanh" ||
                                    *w.ungated_mlp == "xielu") && w.gate_up && !w.gelu_tanh_mlp),
                "an ungated_mlp is 'relu2', 'gelu_tanh' or 'xielu', on the layer's up (gate_up) and down projections, "
                "without gelu_tanh_mlp");
    const bool xielu = w.ungated_mlp && *w.ungated_mlp == "xielu";
    TORCH_CHECK(w.xielu.has_value() == xielu && (!xielu || w.xielu->size() == 4),
                "an xielu MLP, and only it, has its xielu coefficients (alpha_p, alpha_n, beta, eps)");
    TORCH_CHECK(w.rotary_dim >= 0 && w.rotary_dim <= head_dim_ && w.rotary_dim % 2 == 0,
                "a layer's rotary_dim is even, from 0 to head_dim");
    TORCH_CHECK(!w.sliding_window || *w.sliding_window > 0, "a layer's sliding window is positive");
    TORCH_CHECK(!w.attention_chunk || (*w.attention_chunk > 0 && !w.sliding_window),
                "a layer's attention chunk is positive, and it has no sliding window with it");
    TORCH_CHECK(!w.qk_l2_norm_eps || (*w.qk_l2_norm_eps > 0 && !w.q_norm),
                "a layer's qk_l2_norm_eps is positive, and it has no q and k norms with it");
    TORCH_CHECK(w.gate_up.has_value() == w.down.has_value() && w.gate_up.has_value() != w.moe.has_value(),
                "a layer's MLP is its gate_up and down projections or its moe block");
    TORCH_CHECK(!w.sinks || (w.sinks->scalar_type() == at::kFloat && w.sinks->dim() == 1 &&
                             w.sinks->size(0) == num_heads_ && w.sinks->is_contiguous()),
                "a layer's sinks are one contiguous fp32 logit per query head");
    TORCH_CHECK(!w.linear_attn || (!w.output_gate && !w.q_norm && !w.sinks && !w.post_norms_only),
                "a linear-attention layer has no output gate, q/k norms, sinks nor post_norms_only");
  }
}

namespace {

// gelu_tanh(gate) * up of gate_up [T, 2I] holding gate then up: gelu_tanh_and_mul of kernels/activation.py.
torch::Tensor gelu_tanh_and_mul(const torch::Tensor& gate_up) {
  const auto parts = gate_up.chunk(2, -1);
  return at::gelu(parts[0], "tanh").mul(parts[1]);
}

// An ungated MLP's activation of its up projection's output x, the ops of ReluSquared (models/arcee.py), GeluTanh
// (models/starcoder2.py) or XIELU (models/apertus.py) in their order.
torch::Tensor ungated_activation(const LayerWeights& w, const torch::Tensor& x) {
  if (*w.ungated_mlp == "relu2") return x.relu().square();
  if (*w.ungated_mlp == "gelu_tanh") return at::gelu(x, "tanh");
  const auto &alpha_p = (*w.xielu)[0], &alpha_n = (*w.xielu)[1], &beta = (*w.xielu)[2], &eps = (*w.xielu)[3];
  return at::where(x.gt(0), alpha_p.mul(x).mul(x).add(beta.mul(x)),
                   x.minimum(eps).expm1().sub(x).mul(alpha_n).add(beta.mul(x)));
}

// LayerNorm of nn/norm.py: x normed in fp32 by weight (and bias), in x's dtype.
torch::Tensor layer_normed(const torch::Tensor& x, const torch::Tensor& weight,
                           const c10::optional<torch::Tensor>& bias, double eps) {
  const auto fp32_bias = bias ? c10::optional<torch::Tensor>(bias->to(at::kFloat)) : c10::nullopt;
  return at::layer_norm(x.to(at::kFloat), {x.size(-1)}, weight.to(at::kFloat), fp32_bias, eps).to(x.scalar_type());
}

}  // namespace

torch::Tensor DecoderStack::rotate(const LayerWeights& w, const torch::Tensor& qk, const StepTensors& step) const {
  if (w.rotary_dim == 0) return qk;
  auto rot = qk.narrow(2, 0, w.rotary_dim);
  if (w.interleaved_rope) rot = rot.unflatten(2, {w.rotary_dim / 2, 2}).transpose(-1, -2).flatten(-2);
  TORCH_CHECK(!w.local_rope || (step.local_cos && step.local_sin), "a layer with local_rope needs local tables");
  rot = w.local_rope ? apply_rotary(rot, *step.local_cos, *step.local_sin) : apply_rotary(rot, step.cos, step.sin);
  if (w.rotary_dim == head_dim_) return rot;
  return torch::cat({rot, qk.narrow(2, w.rotary_dim, head_dim_ - w.rotary_dim)}, 2);
}

torch::Tensor DecoderStack::normed_qk(const LayerWeights& w, const torch::Tensor& qk) const {
  if (!w.q_norm) return qk;
  const int64_t rows = qk.size(0);
  const auto norm = [&](int64_t start, int64_t heads, const torch::Tensor& weight) {
    const auto part = qk.narrow(1, start, heads);
    if (w.qk_norm_across_heads)  // OlmoAttention's: the rows of all heads at once
      return std::get<0>(rms_norm(part.reshape({rows, heads * head_dim_}), weight, eps_, c10::nullopt))
          .view({rows, heads, head_dim_});
    return std::get<0>(rms_norm(part, weight, eps_, c10::nullopt));
  };
  return torch::cat({norm(0, num_heads_, *w.q_norm), norm(num_heads_, num_kv_heads_, *w.k_norm)}, 1);
}

torch::Tensor DecoderStack::mlp(const LayerWeights& w, const torch::Tensor& h) const {
  auto out = w.moe             ? (*w.moe)(h)
             : w.ungated_mlp   ? (*w.down)(ungated_activation(w, (*w.gate_up)(h)))
             : w.gelu_tanh_mlp ? (*w.down)(gelu_tanh_and_mul((*w.gate_up)(h)))
                               : (*w.down)(w.gate_up->gate_up_silu(h));
  if (w.mlp_out_norm) out = std::get<0>(rms_norm(out, *w.mlp_out_norm, eps_, c10::nullopt));
  return w.residual_scale == 1.0 ? out : out.mul(w.residual_scale);
}

torch::Tensor DecoderStack::attention(const LayerWeights& w, const torch::Tensor& projected,
                                      const std::vector<torch::Tensor>& cache, const StepTensors& step) const {
  TORCH_CHECK(cache.size() == (quant_policy_ ? 4u : 2u), "a layer's cache is (k, v), quantized (k, v, k_sz, v_sz)");
  const torch::Tensor &k_cache = cache[0], &v_cache = cache[1];
  const c10::optional<torch::Tensor> k_sz = quant_policy_ ? c10::optional<torch::Tensor>(cache[2]) : c10::nullopt;
  const c10::optional<torch::Tensor> v_sz = quant_policy_ ? c10::optional<torch::Tensor>(cache[3]) : c10::nullopt;
  torch::Tensor qkv = projected, gate;
  if (w.output_gate) {  // GatedAttention.forward: per head the query, then its gate
    const int64_t q_size = num_heads_ * head_dim_;
    const auto q_gate = projected.narrow(1, 0, 2 * q_size).view({projected.size(0), num_heads_, 2 * head_dim_});
    gate = q_gate.narrow(2, head_dim_, head_dim_);
    qkv = torch::cat({q_gate.narrow(2, 0, head_dim_).flatten(1),
                      projected.narrow(1, 2 * q_size, 2 * num_kv_heads_ * head_dim_)}, 1);
  }
  const auto heads = qkv.view({qkv.size(0), num_heads_ + 2 * num_kv_heads_, head_dim_});
  const auto unrotated = heads.narrow(1, 0, num_heads_ + num_kv_heads_);
  auto qk = w.qk_norm_after_rope ? normed_qk(w, rotate(w, unrotated, step)) : rotate(w, normed_qk(w, unrotated), step);
  if (w.qk_l2_norm_eps) {  // l2_norm of models/llama4.py
    const auto x32 = qk.to(at::kFloat);
    qk = x32.mul(x32.pow(2).mean(-1, true).add(*w.qk_l2_norm_eps).rsqrt()).to(qk.scalar_type());
  }
  auto q = qk.narrow(1, 0, num_heads_);
  const auto k = qk.narrow(1, num_heads_, num_kv_heads_);
  if (w.scaled_queries) {
    TORCH_CHECK(step.q_scale, "a layer with scaled_queries needs the step's q_scale");
    q = q.mul(step.q_scale->view({-1, 1, 1})).to(qk.scalar_type());  // scale_queries of nn/rotary.py
  }
  const auto v = heads.narrow(1, num_heads_ + num_kv_heads_, num_kv_heads_);
  const bool own_pool = (w.sliding_window || w.attention_chunk) && step.window_kv_blocks;
  const auto& kv_blocks = own_pool ? *step.window_kv_blocks : step.kv_blocks;
  const auto& prefill_block_table = own_pool ? step.window_prefill_block_table : step.prefill_block_table;
  const auto& decode_blocks = own_pool ? step.window_decode_blocks : step.decode_blocks;
  fill_kv_cache(k, v, k_cache, v_cache, kv_blocks, step.kv_offsets, k_sz, v_sz, quant_policy_);
  const int64_t prefill = step.num_prefill_tokens, rows = qkv.size(0);
  std::vector<torch::Tensor> parts;
  if (step.prefill_q_len)
    parts.push_back(paged_prefill_attention(q.narrow(0, 0, prefill), k.narrow(0, 0, prefill),
                                            v.narrow(0, 0, prefill), k_cache, v_cache, *prefill_block_table,
                                            *step.prefill_q_start, *step.prefill_q_len, *step.prefill_ctx_len,
                                            step.prefill_max_q_len, scale_, k_sz, v_sz, quant_policy_,
                                            w.sliding_window, w.logit_softcap, w.sinks, step.prefill_key_limit,
                                            w.attention_chunk));
  if (step.decode_blocks)
    parts.push_back(paged_decode_attention(q.narrow(0, prefill, rows - prefill), k_cache, v_cache,
                                           *decode_blocks, *step.decode_kv_lens, scale_, k_sz, v_sz,
                                           quant_policy_, w.sliding_window, w.logit_softcap, w.sinks,
                                           w.attention_chunk));
  TORCH_CHECK(!parts.empty(), "a step has prefill or decode rows");
  const auto out = (parts.size() == 1 ? parts[0] : torch::cat(parts)).flatten(1);
  return gate.defined() ? out.mul(gate.reshape(out.sizes()).sigmoid()) : out;
}

std::tuple<torch::Tensor, torch::Tensor> DecoderStack::forward(
    torch::Tensor x, const std::vector<std::vector<torch::Tensor>>& kv_caches, const StepTensors& step) const {
  TORCH_CHECK(kv_caches.size() == layers_.size(), "one (k_cache, v_cache) per layer");
  torch::Tensor sum;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const LayerWeights& w = layers_[i];
    if (w.post_norms_only) {  // OlmoDecoderLayer's forward
      sum = sum.defined() ? x.add(sum) : x;
      const auto attended = w.o(attention(w, (*w.qkv)(sum), kv_caches[i], step));
      sum = sum.add(std::get<0>(rms_norm(attended, *w.attn_out_norm, eps_, c10::nullopt)));
      x = mlp(w, sum);
      continue;
    }
    torch::Tensor h;
    if (w.layer_norm) {
      sum = sum.defined() ? x.add(sum) : x;
      h = layer_normed(sum, *w.input_norm, w.input_norm_bias, eps_);
    } else {
      std::tie(h, sum) = rms_norm(x, *w.input_norm, eps_, sum.defined() ? c10::optional<torch::Tensor>(sum)
                                                                         : c10::nullopt);
    }
    if (w.parallel_block) {  // Cohere2DecoderLayer's forward
      x = w.o(attention(w, (*w.qkv)(h), kv_caches[i], step)).add(mlp(w, h));
      continue;
    }
    auto attended = w.o(w.mla           ? (*w.mla)(h, kv_caches[i], step, quant_policy_)
                        : w.linear_attn ? linear_attention(w, h, kv_caches[i], step)
                                        : attention(w, (*w.qkv)(h), kv_caches[i], step));
    if (w.attn_out_norm) attended = std::get<0>(rms_norm(attended, *w.attn_out_norm, eps_, c10::nullopt));
    if (w.residual_scale != 1.0) attended = attended.mul(w.residual_scale);
    if (w.layer_norm) {
      sum = attended.add(sum);
      h = layer_normed(sum, *w.post_norm, w.post_norm_bias, eps_);
    } else {
      std::tie(h, sum) = rms_norm(attended, *w.post_norm, eps_, sum);
    }
    x = mlp(w, h);
  }
  return {x, sum};
}

torch::Tensor DecoderStack::linear_attention(const LayerWeights& w, const torch::Tensor& h,
                                             const std::vector<torch::Tensor>& state, const StepTensors& step) const {
  TORCH_CHECK(step.num_prefill_tokens == 0 && step.state_decode_slots,
              "a linear-attention layer runs in the stack in decode-only steps, with the step's state_decode_slots");
  return (*w.linear_attn)((*w.qkv)(h), state, *step.state_decode_slots);
}
