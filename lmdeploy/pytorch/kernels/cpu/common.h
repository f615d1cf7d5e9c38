// Shared by the native CPU kernels: headers and the element conversions to fp32.
#pragma once

#include "torch_headers.h"
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// t as a contiguous tensor of `dtype`; no dispatcher call when it already is one (most calls).
inline torch::Tensor contiguous_as(const torch::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(dtype).contiguous();
}

// A [gate; up] weight with its gate and up panels of `panel` rows alternating, as the fused gate/up GEMMs
// (bf16 and int8) read it.
inline torch::Tensor interleave_gate_up(const torch::Tensor& weight, int64_t panel) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % (2 * panel) == 0, "expected gate and up of a multiple of ",
              panel, " rows each");
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.reshape({2, N / 2 / panel, panel, K}).transpose(0, 1).reshape({N, K});
}

// Hands out a GEMM's tiles one at a time (in the engine the main thread's share of a static split kept
// finishing last): groups of `width` panels times blocks of `row_block` of the M rows. Runs
// tile(std::integral_constant<int, C>, first row, rows, first panel), C the group's panels (1-4). Call it
// inside an OpenMP parallel region.
template <typename Tile>
void for_each_tile(int64_t M, int64_t panels, int64_t width, int64_t row_block, const Tile& tile) {
  const int64_t groups = (panels + width - 1) / width, row_blocks = (M + row_block - 1) / row_block;
#pragma omp for collapse(2) schedule(dynamic, 1)
  for (int64_t group = 0; group < groups; ++group)
    for (int64_t block = 0; block < row_blocks; ++block) {
      const int64_t panel = group * width, first = block * row_block;
      const int64_t count = std::min<int64_t>(row_block, M - first);
      switch (std::min<int64_t>(width, panels - panel)) {
        case 1: tile(std::integral_constant<int, 1>{}, first, count, panel); break;
        case 2: tile(std::integral_constant<int, 2>{}, first, count, panel); break;
        case 3: tile(std::integral_constant<int, 3>{}, first, count, panel); break;
        default: tile(std::integral_constant<int, 4>{}, first, count, panel); break;
      }
    }
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of an fp32; a shift the compiler can vectorize.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The sums of each run of `group` values of `x` (`count` runs), in fp32: a GEMV over grouped codes with minima
// takes each group's minimum times its inputs' sum. Held per thread between calls.
inline const float* group_sums(const c10::BFloat16* x, int64_t count, int64_t group) {
  static thread_local std::vector<float> sums;
  sums.resize(count);
  for (int64_t i = 0; i < count; ++i) {
    float total = 0.f;
    for (int64_t k = 0; k < group; ++k) total += to_float(x[i * group + k]);
    sums[i] = total;
  }
  return sums.data();
}

// fp32 to T with round-to-nearest-even, written so that loops over it vectorize (no NaN branch).
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 fp32 lanes to bf16, rounding to nearest even.
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// e^x to about 3e-6 relative error, well below a bf16 step: 2^n * e^r with r = x - n ln 2 in
// [-ln 2 / 2, ln 2 / 2] and e^r = 1 + r + r^2 (1/2 + r/6 + r^2/24 + r^3/120).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.f / 120), _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// x[0:n] = softmax(x[0:n]), in fp32; a `sink` logit, when given, joins the denominator.
inline void softmax(float* x, int64_t n, const float* sink = nullptr) {
  float peak = sink ? *sink : x[0];
  for (int64_t t = 0; t < n; ++t) peak = std::max(peak, x[t]);
  float total = sink ? std::exp(*sink - peak) : 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) {
    x[t] = std::exp(x[t] - peak);
    total += x[t];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) x[t] *= inv;
}

// A cache row's values in fp32: the row at `slot` ((block * H_kv + kv head) * block_size + token) of a
// cache in the model dtype T, or of a quantized one (kv_quant.py: codes and (scale, zero) per row).
template <typename T>
struct DenseRows {
  const T* data;
  int64_t dim;
  void operator()(int64_t slot, float* out) const {
    const T* row = data + slot * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] = to_float(row[d]);
  }
};
template <int BITS>
struct QuantRows {
  const uint8_t* codes;
  const float* scales_zeros;
  int64_t dim;
  void operator()(int64_t slot, float* out) const {
    const float scale = scales_zeros[2 * slot], zero = scales_zeros[2 * slot + 1];
    if constexpr (BITS == 8) {
      const uint8_t* row = codes + slot * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(row[d]) * scale + zero;
    } else {  // byte j: dimension j in the low nibble, j + dim / 2 in the high one
      const int64_t half = dim / 2;
      const uint8_t* row = codes + slot * half;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        out[j] = static_cast<float>(row[j] & 15) * scale + zero;
        out[j + half] = static_cast<float>(row[j] >> 4) * scale + zero;
      }
    }
  }
};

// The KV cache's scales and zero points and its quant_policy (0: a cache in the model dtype, no scales).
struct KVQuant {
  torch::Tensor k_scales_zeros, v_scales_zeros;
  int64_t bits = 0;
};
// Checks a quantized cache's shapes and makes its scales contiguous fp32 (a no-op when already).
KVQuant kv_quant(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t head_dim,
                 const c10::optional<torch::Tensor>& k_scales_zeros, const c10::optional<torch::Tensor>& v_scales_zeros,
                 int64_t quant_policy);

// The optional attention features (kernels/attention.py): off when 0 / null. `sinks` holds one fp32
// logit per query head.
struct AttnFeatures {
  int64_t sliding_window = 0;
  int64_t attention_chunk = 0;  // a layer has a sliding window or an attention chunk, not both
  float logit_softcap = 0.f;
  torch::Tensor sinks;
  // Prefill rows whose keys reach past their own position (paged_prefill_attention's key_limit): each row's
  // position + 1, from which its window reaches back; null where each row's keys end at its own position.
  const int64_t* query_ends = nullptr;
  bool bounded() const { return sliding_window > 0 || attention_chunk > 0; }
  bool on() const { return bounded() || logit_softcap > 0.f || sinks.defined(); }
  // The first key position a query at `pos` attends to: the start of its window, of its chunk, or 0.
  int64_t first_key(int64_t pos) const {
    if (sliding_window > 0) return std::max<int64_t>(0, pos - sliding_window + 1);
    if (attention_chunk > 0) return pos / attention_chunk * attention_chunk;
    return 0;
  }
  // The first of `length` context tokens that query row `row` attends to (the last of them, without query_ends).
  int64_t first(int64_t length, int64_t row) const { return first_key((query_ends ? query_ends[row] : length) - 1); }
};
AttnFeatures attn_features(const c10::optional<int64_t>& sliding_window, const c10::optional<double>& logit_softcap,
                           const c10::optional<torch::Tensor>& sinks, int64_t num_heads,
                           const c10::optional<int64_t>& attention_chunk);

// Fills `out` and returns true where the AVX-512 path applies (bf16, head_dim 64 or 128); the
// arguments are those of attention_rows in paged_attention.cpp: int64 and contiguous, but for q's
// row stride and `seqs`, which may be undefined.
bool attention_rows_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& table, const torch::Tensor& seqs, const torch::Tensor& lengths,
                           double scale, const AttnFeatures& features, torch::Tensor& out);
// The same for int8 and int4 caches (paged_attention_quant_avx512.cpp).
bool attention_rows_quant_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const KVQuant& quant, const torch::Tensor& table, const torch::Tensor& seqs,
                                 const torch::Tensor& lengths, double scale, const AttnFeatures& features,
                                 torch::Tensor& out);
// Fills `out` and returns true where the AVX512-BF16 prefill path applies (bf16, head_dim 64 or 128);
// the arguments are paged_prefill_attention's, int64 and contiguous but for q's token stride.
bool prefill_attention_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const KVQuant& quant, const torch::Tensor& table, const torch::Tensor& starts,
                              const torch::Tensor& counts, const torch::Tensor& contexts, double scale,
                              const AttnFeatures& features, const int64_t* key_limits, torch::Tensor& out);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor kv_lens, double scale,
                                     c10::optional<torch::Tensor> k_scales_zeros,
                                     c10::optional<torch::Tensor> v_scales_zeros, int64_t quant_policy,
                                     c10::optional<int64_t> sliding_window = c10::nullopt,
                                     c10::optional<double> logit_softcap = c10::nullopt,
                                     c10::optional<torch::Tensor> sinks = c10::nullopt,
                                     c10::optional<int64_t> attention_chunk = c10::nullopt);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor q_start,
                                      torch::Tensor q_len, torch::Tensor ctx_len, int64_t max_q_len, double scale,
                                      c10::optional<torch::Tensor> k_scales_zeros,
                                      c10::optional<torch::Tensor> v_scales_zeros, int64_t quant_policy,
                                      c10::optional<int64_t> sliding_window = c10::nullopt,
                                      c10::optional<double> logit_softcap = c10::nullopt,
                                      c10::optional<torch::Tensor> sinks = c10::nullopt,
                                      c10::optional<torch::Tensor> key_limit = c10::nullopt,
                                      c10::optional<int64_t> attention_chunk = c10::nullopt);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  c10::optional<torch::Tensor> residual);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor argmax(torch::Tensor x);
void apply_token_bitmask(torch::Tensor x, torch::Tensor bitmask, std::vector<int64_t> rows);
torch::Tensor apply_rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
void fill_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor blocks, torch::Tensor offsets, c10::optional<torch::Tensor> k_scales_zeros,
                   c10::optional<torch::Tensor> v_scales_zeros, int64_t quant_policy);
void bind_worker_threads(const std::vector<int64_t>& cpus);
bool bf16_gemm_available();
torch::Tensor pack_bf16_weight(const torch::Tensor& weight);
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, c10::optional<torch::Tensor> bias);
torch::Tensor pack_bf16_gate_up(const torch::Tensor& weight);
torch::Tensor bf16_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, c10::optional<torch::Tensor> bias);
bool int8_gemm_available();
torch::Tensor pack_int8_weight(const torch::Tensor& weight);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& compensation,
                          const torch::Tensor& scale, c10::optional<torch::Tensor> bias);
bool int4_gemv_available();
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          c10::optional<torch::Tensor> bias);
torch::Tensor int4_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales);
// GGUF Q4_K on int4_linear's codes with the file's scales (linear_int4.cpp); built where int4_linear is.
torch::Tensor q4k_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                         c10::optional<torch::Tensor> bias);
torch::Tensor q4k_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales);
bool q8_gemv_available();
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales);
bool q6k_gemv_available();
torch::Tensor q6k_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales);
// MXFP4 (gpt-oss's experts) as the checkpoint holds it (linear_mxfp4.cpp); x in fp32 or bf16.
bool mxfp4_gemv_available();
torch::Tensor mxfp4_linear(const torch::Tensor& x, const torch::Tensor& blocks, const torch::Tensor& scales);
torch::Tensor mxfp4_dequantize(const torch::Tensor& blocks, const torch::Tensor& scales, at::ScalarType dtype);
torch::Tensor pack_int8_gate_up(const torch::Tensor& weight);
torch::Tensor int8_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& compensation,
                                const torch::Tensor& scale, c10::optional<torch::Tensor> bias);

// The tensors of one engine step that every decoder layer reads (see StepContext in step_context.py);
// local_cos and local_sin: the rotary tables of the layers with `local_rope` (Gemma 3's local layers).
struct StepTensors {
  torch::Tensor cos, sin, kv_blocks, kv_offsets;
  int64_t num_prefill_tokens;
  c10::optional<torch::Tensor> prefill_block_table, prefill_q_start, prefill_q_len, prefill_ctx_len;
  int64_t prefill_max_q_len;
  c10::optional<torch::Tensor> decode_blocks, decode_kv_lens, local_cos, local_sin;
  // The sliding-window layers' own pool (StepContext.tables): these replace kv_blocks, prefill_block_table and
  // decode_blocks for a layer with a sliding window when window_kv_blocks is given.
  c10::optional<torch::Tensor> window_kv_blocks, window_prefill_block_table, window_decode_blocks;
  c10::optional<torch::Tensor> prefill_key_limit;  // StepContext.prefill_key_limit
  c10::optional<torch::Tensor> q_scale;            // StepContext.q_scale: the layers with scaled_queries need it
};

// One projection of a decoder layer, x @ W.T (+ bias), on its weight as its kernel takes it. `kind` "bf16":
// `weight` holds bf16_linear's panels; "w8a8": an int8 weight from pack_int8_weight with its `compensation`
// and `scale` (int8_linear's); "int4": int4_linear's packed 4-bit weight with its fp16 `scale`s; "q4k": the same
// codes with q4k_linear's `scale` bytes; "q6k":
// q6k_linear's codes and `scale`s (its fp32 result rounded to x's dtype, then the bias added). A
// gate-and-up projection's weight is packed for the kernel's fused SiLU (pack_bf16_gate_up,
// pack_int8_gate_up; int4: gate and up tiles alternate, no bias). "onednn": oneDNN's GEMM
// (mkldnn::_linear_pointwise) on its blocked weight, for a MoE block's router and shared-expert gate; "fp32": x in
// fp32 times an fp32 weight (torch's linear), DeepSeek-V3's and GLM-4.5's fp32 router. "parts": a
// stacked projection whose parts run each on its own projection (each with its share of the bias), their outputs
// side by side. "steps": inputs of at most `small_step_rows` rows on `parts[0]`, more on `parts[1]` (an expert's
// share of a step, whatever its size).
struct Projection {
  enum class Kind { kBf16, kW8A8, kInt4, kQ4K, kQ6K, kOneDnn, kFp32, kParts, kSteps };
  Projection(const std::string& kind, torch::Tensor weight, c10::optional<torch::Tensor> compensation,
             c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias);
  explicit Projection(std::vector<Projection> parts);
  Projection(Projection small, Projection large, int64_t small_step_rows);
  torch::Tensor operator()(const torch::Tensor& x) const;
  // silu(gate) * up of a gate-and-up projection (gate rows, then up rows).
  torch::Tensor gate_up_silu(const torch::Tensor& x) const;

  Kind kind;
  torch::Tensor weight;
  c10::optional<torch::Tensor> compensation, scale, bias;
  std::vector<Projection> parts;
  int64_t small_step_rows = 0;
};

// A mixture-of-experts MLP (moe_block.cpp), the kernels and order of its layer's Python forward: the router's
// logits and the `routing` the block was built with, then each routed expert on its rows (the experts in order, as
// run_experts in kernels/moe.py), then the shared expert. Routings (by name):
//  - "softmax": SparseMoeBlock's (lmdeploy/pytorch/models/moe.py): softmax and top-k in fp32, renormalized when
//    `renormalize` (Qwen's norm_topk_prob, Mixtral's top-k then softmax);
//  - "noaux_tc": DeepseekV3MoE's (models/deepseek_v3.py, GLM-4.5's too): grouped_topk of kernels/moe.py, sigmoid
//    scores, chosen with `correction_bias` added among the `topk_groups` best of `num_groups` groups, weighted
//    by the unbiased scores (renormalized when `renormalize`) times `scaling`;
//  - "biased_softmax": Ernie4_5MoE's (models/ernie.py): biased_softmax_topk of kernels/moe.py, softmax scores in
//    fp32, chosen with `correction_bias` added, weighted by the unbiased scores over their sum (at least
//    `norm_min`; `renormalize` is set);
//  - "sigmoid_scaled_input": Llama4MoE's (models/llama4.py): the top-k router logits, their sigmoid (in x's dtype)
//    scaling each token's copy on its way into its expert, the experts' outputs summed over the k copies.
// The experts are either dense, `gate_up [E, 2I, H]` and `down [E, H, I]` in the model's dtype as fused_moe takes
// them (F.linear, torch's SiLU-and-mul), or each expert's `expert_gate_up` and `expert_down` projections
// (gate_up_silu), as the per-expert kernels of the quantized formats run them. The shared expert (`shared_gate_up`,
// `shared_down`) is added times the sigmoid of `shared_gate` where it has one (Qwen2-MoE), as it is without
// (DeepSeek-V3, GLM-4.5, ERNIE 4.5).
struct MoEBlock {
  enum class Routing { kSoftmax, kNoauxTc, kBiasedSoftmax, kSigmoidScaledInput };
  MoEBlock(Projection router, int64_t top_k, bool renormalize, const std::string& routing,
           c10::optional<torch::Tensor> correction_bias, c10::optional<int64_t> num_groups,
           c10::optional<int64_t> topk_groups, c10::optional<double> scaling, c10::optional<double> norm_min,
           c10::optional<torch::Tensor> gate_up,
           c10::optional<torch::Tensor> down, std::vector<Projection> expert_gate_up,
           std::vector<Projection> expert_down, c10::optional<Projection> shared_gate_up,
           c10::optional<Projection> shared_down, c10::optional<Projection> shared_gate);
  torch::Tensor operator()(const torch::Tensor& x) const;

  Projection router;
  int64_t top_k, num_experts;
  bool renormalize;
  Routing routing;
  c10::optional<torch::Tensor> correction_bias;
  int64_t num_groups = 1, topk_groups = 1;
  double scaling = 1.0, norm_min = 0.0;
  c10::optional<torch::Tensor> gate_up, down;
  std::vector<Projection> expert_gate_up, expert_down;
  c10::optional<Projection> shared_gate_up, shared_down, shared_gate;

 private:
  // (topk_weights [T, k] fp32, topk_ids [T, k]) of the tokens x, by the block's routing.
  std::tuple<torch::Tensor, torch::Tensor> route(const torch::Tensor& x) const;
  // down_e(act(gate_up_e(rows))) of expert e.
  torch::Tensor expert(int64_t e, const torch::Tensor& rows) const;
  // sum_k w[t, k] * expert_{ids[t, k]}(x[t]), the experts in order (run_experts of kernels/moe.py).
  torch::Tensor run_experts(const torch::Tensor& x, const torch::Tensor& topk_weights,
                            const torch::Tensor& topk_ids) const;
};

// A Llama-style decoder layer's weights; q_norm and k_norm (per head, before the rotary embedding) where the
// family has them (Qwen3), over the whole projected queries and keys with `qk_norm_across_heads` (OLMo 2/3);
// attn_out_norm and mlp_out_norm, on the outputs of attention and of the MLP before the residual adds them, where
// it has those (GLM-4). `post_norms_only` (OLMo 2/3): the layer has no input_norm nor post_norm, attention and the
// MLP read the residual stream itself and their normed outputs are added to it. Its options: the rotary embedding
// turns the first
// `rotary_dim` features of each query and key head (all of them, a part (Phi-4-mini, GLM) or none (SmolLM3's
// NoPE layers)), in halves or, `interleaved_rope`, in neighbouring pairs (GLM: the pairs are regrouped into
// halves first, as apply_rope in nn/rotary.py does), by the step's local tables where `local_rope` is set
// (Gemma 3's local layers; the others by its cos and sin); `sliding_window` limits its attention to the last that
// many tokens, `attention_chunk` to the keys of the query's own chunk of that many positions (Llama 4's chunked
// layers), `logit_softcap` soft-caps its scores (Gemma 2); `qk_l2_norm_eps`: the rotated queries and keys are
// RMS-normed without weight, in fp32, with that epsilon (Llama 4's use_qk_norm); `gelu_tanh_mlp`: the MLP is
// gelu_tanh(gate) * up on a plain gate-and-up projection, gate rows then up rows (Gemma), instead of the
// fused SiLU one; `scaled_queries`: its rotated queries are multiplied by their token's factor in the step's
// q_scale (Ministral 3); `residual_scale`: the outputs of attention and of the MLP are multiplied by it before the
// residual adds them (Granite's residual_multiplier). A layer's MLP is its gate_up and down projections, or its
// `moe` block.
struct LayerWeights {
  c10::optional<torch::Tensor> input_norm, post_norm;
  Projection qkv, o;
  c10::optional<Projection> gate_up, down;
  c10::optional<MoEBlock> moe;
  c10::optional<torch::Tensor> q_norm, k_norm, attn_out_norm, mlp_out_norm;
  int64_t rotary_dim;
  bool interleaved_rope, local_rope;
  c10::optional<int64_t> sliding_window;
  c10::optional<double> logit_softcap;
  bool gelu_tanh_mlp, scaled_queries;
  double residual_scale;
  bool qk_norm_across_heads, post_norms_only;
  c10::optional<int64_t> attention_chunk;
  c10::optional<double> qk_l2_norm_eps;
};

// Llama-style decoder layers (decoder_stack.cpp): the kernels of LlamaDecoderLayer's forward, in its order.
class DecoderStack {
 public:
  DecoderStack(std::vector<LayerWeights> layers, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               double eps, double scale, int64_t quant_policy);
  // The embeddings x through every layer: (hidden states, residual), as the layers' forward leaves them.
  // A layer's cache is (k, v), or (k codes, v codes, k scales and zeros, v scales and zeros).
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x,
                                                   const std::vector<std::vector<torch::Tensor>>& kv_caches,
                                                   const StepTensors& step) const;

 private:
  torch::Tensor attention(const LayerWeights& w, const torch::Tensor& qkv, const std::vector<torch::Tensor>& cache,
                          const StepTensors& step) const;
  // The layer's queries and keys [T, H + H_kv, head_dim] of qkv, normed where it has q/k norms.
  torch::Tensor normed_qk(const LayerWeights& w, const torch::Tensor& qkv) const;
  // The layer's MLP (or MoE block) on h, its output norm applied.
  torch::Tensor mlp(const LayerWeights& w, const torch::Tensor& h) const;
  // The layer's rotary embedding of the query and key heads qk [T, H + H_kv, head_dim].
  torch::Tensor rotate(const LayerWeights& w, const torch::Tensor& qk, const StepTensors& step) const;
  std::vector<LayerWeights> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_, quant_policy_;
  double eps_, scale_;
};

// Multi-head latent attention over the paged latent cache [num_blocks, block_size, D] (mla.cpp): absorbed
// queries [rows, H, D] -> [rows, H, v_dim], the score-weighted sums of the cached latents [:v_dim]. With
// quant_policy 8 or 4 the cache holds codes and scales_zeros [num_blocks, block_size, 2, 2] (kernels/mla.py).
torch::Tensor mla_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
                                   torch::Tensor kv_lens, double scale, int64_t v_dim,
                                   const c10::optional<torch::Tensor>& scales_zeros, int64_t quant_policy);
torch::Tensor mla_prefill_attention(torch::Tensor q, const torch::Tensor& latent, torch::Tensor cache,
                                    torch::Tensor block_table, torch::Tensor q_start, torch::Tensor q_len,
                                    torch::Tensor ctx_len, int64_t max_q_len, double scale, int64_t v_dim,
                                    const c10::optional<torch::Tensor>& scales_zeros, int64_t quant_policy);
