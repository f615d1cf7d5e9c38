// The native CPU decoder stack (decoder_stack.cpp) and its MoE blocks (moe_block.cpp): the weights of its
// layers and projections, the tensors of a step, and the stack itself.
#pragma once

#include "common.h"
#include "linear_attention.h"

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
  c10::optional<torch::Tensor> state_decode_slots;  // StepContext.state_decode_slots: linear_attn state rows
};

// One projection of a decoder layer, x @ W.T (+ bias), on its weight as its kernel takes it. `kind` "bf16":
// `weight` holds bf16_linear's panels and `outputs` N, the weight's rows, where zero rows pad them to whole panels
// (a router of 8 experts, a one-output shared-expert gate: NativeBf16Kernel's panels, its bias of N); "w8a8": an
// int8 weight from pack_int8_weight with its `compensation` and `scale` (int8_linear's); "int4": int4_linear's
// packed 4-bit weight with its fp16 `scale`s; "q4k": the same codes with q4k_linear's `scale` bytes; "q6k":
// q6k_linear's codes and `scale`s (its fp32 result rounded to x's dtype, then the bias added); "q5k": q5k_linear's
// codes and `scale`s, likewise; "q4k_dequantized", "q5k_dequantized", "q6k_dequantized": the same weights
// dequantized to bf16 for each call (kquant_dequantized_linear, dequantized_linear.h: into the bf16 GEMM's panels
// in cache, or with AMX the thread's scratch and torch's linear), the large stack's where the small one has the
// GEMV's. A gate-and-up projection's weight is packed for the kernel's fused SiLU (pack_bf16_gate_up, `outputs`
// 2 I, zero rows padding gate and up each to whole panels; pack_int8_gate_up; int4: gate and up tiles alternate, no
// bias). "fp32": x in fp32 times an fp32 weight
// [N, K] on fp32_packed_linear (rows independent of their number): `weight` its tiles [ceil(N / 16), K, 16] as
// pack_fp32_weight lays them out, `outputs` N, `isa` the instruction set (NativeFp32Kernel.isa: the same bits on
// each); NativeFp32Kernel's packed copy, not another (DeepSeek-V3's,
// GLM-4.5's and ERNIE 4.5's fp32 router: Fp32Router, nn/moe.py). "parts": a stacked projection whose parts run
// each on its own projection (each with its share of the
// bias), their outputs side by side. "mxfp4": an MXFP4 weight as the checkpoint holds it, `weight` its blocks
// [N, K / 32, 16] and `scale` its e8m0 scales [N, K / 32] (both uint8), on mxfp4_linear (its fp32 sums rounded to
// x's dtype, then the bias added); "mxfp4_dequantized": the same weight dequantized for each call
// (mxfp4_dequantized_linear, as kquant_dequantized_linear): Mxfp4Kernel's two paths (nn/quant/mxfp4.py), the first
// the stack of small steps'.
// "q8": GGUF Q8_0 codes [N/16, K/32, 32, 16] (int8) and fp16 `scale`s [N/16, K/32, 16] as pack_q8 lays them out, on
// q8_linear (its fp32 result rounded to x's dtype, then the bias added); "q8_dequantized": the same weight dequantized
// for each call, as "q4k_dequantized": Q8_0Gemv.layer_kernel's two paths
// (nn/quant/gguf_blocks.py).
// "w8a8_torch": an int8 `weight` [N, K] and its fp32 `scale` [N, 1] on torch's int8 GEMM, x quantized per token
// (W8A8Kernel's w8a8_linear, kernels/w8a8.py), for a linear-attention layer's few-row b and a whose rows the int8
// GEMM's panels do not fit. "int4_torch": torch's int4 kernel (_weight_int4pack_mm_for_cpu) on its packed codes
// (`weight`, uint8 [N, K / 2]) and `scale`, its scales_and_zeros [K / G, N, 2] in x's dtype (the group size G their
// rows give), then the bias added: TorchInt4Kernel's (nn/quant/int4_cpu.py), an AWQ or GPTQ checkpoint's grid where the int4 GEMV is not built.
struct Projection {
  enum class Kind {
    kBf16, kW8A8, kInt4, kQ4K, kQ6K, kFp32, kParts, kMxfp4, kMxfp4Dequantized,
    kQ4KDequantized, kQ5K, kQ5KDequantized, kQ6KDequantized, kQ8, kQ8Dequantized, kW8A8Torch, kInt4Torch
  };
  Projection(const std::string& kind, torch::Tensor weight, c10::optional<torch::Tensor> compensation,
             c10::optional<torch::Tensor> scale, c10::optional<torch::Tensor> bias, c10::optional<int64_t> outputs,
             c10::optional<std::string> isa);
  explicit Projection(std::vector<Projection> parts);
  torch::Tensor operator()(const torch::Tensor& x) const;
  // silu(gate) * up of a gate-and-up projection (gate rows, then up rows).
  torch::Tensor gate_up_silu(const torch::Tensor& x) const;

  Kind kind;
  torch::Tensor weight;
  int64_t outputs = 0;  // "bf16", "fp32": the weight's rows, which its panels or tiles pad to a multiple of 16
  std::string isa;      // "fp32": the instruction set fp32_packed_linear runs on (default: the widest built)
  c10::optional<torch::Tensor> compensation, scale, bias;
  std::vector<Projection> parts;
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
//    scaling each token's copy on its way into its expert, the experts' outputs summed over the k copies;
//  - "greedy": DeepSeek-V2's (DeepseekV3MoE.route): softmax and top-k in fp32, never renormalized, times `scaling`;
//  - "group_limited_greedy": DeepSeek-V2's group_limited_topk of kernels/moe.py: the softmax scores of the experts
//    outside the `topk_groups` of `num_groups` groups whose best score is highest set to zero, then top-k, never
//    renormalized, times `scaling`.
// The experts are either dense, `gate_up [E, 2I, H]` and `down [E, H, I]` in the model's dtype as fused_moe takes
// them (F.linear, torch's SiLU-and-mul), with `gate_up_bias [E, 2I]` and `down_bias [E, H]` where they have biases,
// or each expert's `expert_gate_up` and `expert_down` projections (gate_up_silu; each with its expert's biases), as
// the per-expert kernels of the quantized formats run them. Their `activation` is "silu" (SiLU-and-mul) or
// "clamped_swiglu" (gpt-oss's, clamped_swiglu of kernels/activation.py with `swiglu_alpha` and `swiglu_limit`:
// (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)). The shared expert (`shared_gate_up`,
// `shared_down`) is added times the sigmoid of `shared_gate` where it has one (Qwen2-MoE), as it is without
// (DeepSeek-V3, GLM-4.5, ERNIE 4.5).
struct MoEBlock {
  enum class Routing { kSoftmax, kNoauxTc, kBiasedSoftmax, kSigmoidScaledInput, kGreedy, kGroupLimitedGreedy };
  enum class Activation { kSilu, kClampedSwiGLU };
  MoEBlock(Projection router, int64_t top_k, bool renormalize, const std::string& routing,
           c10::optional<torch::Tensor> correction_bias, c10::optional<int64_t> num_groups,
           c10::optional<int64_t> topk_groups, c10::optional<double> scaling, c10::optional<double> norm_min,
           c10::optional<torch::Tensor> gate_up, c10::optional<torch::Tensor> down,
           c10::optional<torch::Tensor> gate_up_bias, c10::optional<torch::Tensor> down_bias,
           std::vector<Projection> expert_gate_up, std::vector<Projection> expert_down,
           const std::string& activation, c10::optional<double> swiglu_alpha, c10::optional<double> swiglu_limit,
           c10::optional<Projection> shared_gate_up, c10::optional<Projection> shared_down,
           c10::optional<Projection> shared_gate);
  torch::Tensor operator()(const torch::Tensor& x) const;
  // Whether a step of `tokens` tokens runs the routed experts in one parallel region (moe_block_region.cpp): up
  // to 8 tokens on per-expert projections with tiled GEMVs (int4, Q4_K, Q5_K, Q6_K, Q8_0) and SiLU, x in bf16.
  bool experts_in_one_region(int64_t tokens) const;

  Projection router;
  int64_t top_k, num_experts;
  bool renormalize;
  Routing routing;
  c10::optional<torch::Tensor> correction_bias;
  int64_t num_groups = 1, topk_groups = 1;
  double scaling = 1.0, norm_min = 0.0;
  c10::optional<torch::Tensor> gate_up, down, gate_up_bias, down_bias;
  std::vector<Projection> expert_gate_up, expert_down;
  Activation activation;
  double swiglu_alpha = 0.0, swiglu_limit = 0.0;
  c10::optional<Projection> shared_gate_up, shared_down, shared_gate;

 private:
  // The experts' activation of gate_up [rows, 2I] (gate, then up).
  torch::Tensor activate(const torch::Tensor& gate_up) const;
  // (topk_weights [T, k] fp32, topk_ids [T, k]) of the tokens x, by the block's routing.
  std::tuple<torch::Tensor, torch::Tensor> route(const torch::Tensor& x) const;
  // down_e(act(gate_up_e(rows))) of expert e.
  torch::Tensor expert(int64_t e, const torch::Tensor& rows) const;
  // sum_k w[t, k] * expert_{ids[t, k]}(x[t]), the experts in order (run_experts of kernels/moe.py).
  torch::Tensor run_experts(const torch::Tensor& x, const torch::Tensor& topk_weights,
                            const torch::Tensor& topk_ids) const;
  // run_experts' result computed in one parallel region, or none where experts_in_one_region does not hold for
  // this step (its experts' shares of it, x's dtype).
  c10::optional<torch::Tensor> run_experts_in_one_region(const torch::Tensor& x, const torch::Tensor& topk_weights,
                                                         const torch::Tensor& topk_ids) const;
};

// DeepSeek's multi-head latent attention up to its o_proj (mla_layer.cpp): DeepseekV3Attention's forward
// (models/deepseek_v3.py) and LatentAttention's (nn/mla.py), their kernels in their order. The queries: `q` on x,
// or with `q_a` (q_lora_rank) `q` on q_a(x) RMS-normed by `q_a_norm`; each head's rotary part turned. kv_a on x:
// the latent (RMS-normed by `kv_a_norm`) and the rotary key (turned), written to the layer's latent cache; the
// queries absorbed through kv_b's key rows, attended over the cache by the mla kernels (`scale`: YaRN's softmax
// mscale in it), the result taken through kv_b's value rows. `kv_b` is kv_b_proj's dense weight
// [H * (nope_dim + v_head_dim), kv_lora_rank]; the rotary parts turn in neighbouring pairs with `interleaved_rope`
// (apply_rope of nn/rotary.py); the two norms use `norm_eps`; with `scaled_queries` (Mistral 4) both parts of
// each query are multiplied by their token's factor in the step's q_scale after the rotary.
struct LatentAttention {
  LatentAttention(c10::optional<Projection> q_a, c10::optional<torch::Tensor> q_a_norm, Projection q, Projection kv_a,
                  torch::Tensor kv_a_norm, torch::Tensor kv_b, int64_t num_heads, int64_t kv_lora_rank,
                  int64_t nope_dim, int64_t rope_dim, int64_t v_head_dim, bool interleaved_rope, double scale,
                  double norm_eps, bool scaled_queries);
  // x [T, hidden] -> [T, H * v_head_dim]; `cache` is (latent cache) or (codes, scales_zeros) (kernels/mla.py).
  torch::Tensor operator()(const torch::Tensor& x, const std::vector<torch::Tensor>& cache, const StepTensors& step,
                           int64_t quant_policy) const;

  c10::optional<Projection> q_a;
  c10::optional<torch::Tensor> q_a_norm;
  Projection q, kv_a;
  torch::Tensor kv_a_norm, kv_b;
  int64_t num_heads, kv_lora_rank, nope_dim, rope_dim, v_head_dim;
  bool interleaved_rope;
  double scale, norm_eps;
  bool scaled_queries;
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
// residual adds them (Granite's residual_multiplier); `sinks`: one fp32 logit per query head that joins the softmax
// denominator (gpt-oss); `output_gate`: the query rows of `qkv` hold, per head, the query and then its output gate,
// the attention output is multiplied by the gate's sigmoid before `o` (Qwen3-Next's and Qwen3.5's full attention).
// A layer's attention is its qkv projection, or its `mla` block (DeepSeek; o applies to its output and the options
// above are unset), or its `linear_attn` (Qwen3-Next's and Qwen3.5's Gated DeltaNet, in decode-only steps: `qkv` is
// its input projections, `o` its out_proj). A layer's MLP is its gate_up and down projections, or its `moe` block.
// `parallel_block` (Cohere2): the layer has no post_norm, attention and the MLP both read its input norm's output and
// their outputs are added together; `layer_norm`: its norms are LayerNorms (the mean subtracted, in fp32) instead
// of RMSNorms, with `input_norm_bias` and `post_norm_bias` where they have biases (StarCoder2; not Cohere2). `qk_norm_after_rope` (Hunyuan): the q and k norms apply to the rotated
// queries and keys instead of before the rotary. `ungated_mlp`: the MLP is down(act(up(h))), `gate_up` its up
// projection and act "relu2" (relu(x)², Arcee), "gelu_tanh" (StarCoder2) or "xielu" (Apertus: alpha_p x² + beta x where x > 0, else
// (expm1(min(x, eps)) - x) alpha_n + beta x, its `xielu` coefficients (alpha_p, alpha_n, beta, eps) as
// XIELU.coefficients in models/apertus.py gives them).
struct LayerWeights {
  c10::optional<torch::Tensor> input_norm, post_norm;
  c10::optional<Projection> qkv;
  Projection o;
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
  c10::optional<torch::Tensor> sinks;
  c10::optional<LatentAttention> mla;
  bool output_gate;
  c10::optional<LinearAttention> linear_attn;
  bool parallel_block, layer_norm, qk_norm_after_rope;
  c10::optional<std::string> ungated_mlp;
  c10::optional<std::vector<torch::Tensor>> xielu;
  c10::optional<torch::Tensor> input_norm_bias, post_norm_bias;
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
  // The layer's attention output before `o` for its projected queries, keys and values (and output gates).
  torch::Tensor attention(const LayerWeights& w, const torch::Tensor& projected,
                          const std::vector<torch::Tensor>& cache, const StepTensors& step) const;
  // A linear_attn layer's output before `o`, of its normed input h (decode-only steps).
  torch::Tensor linear_attention(const LayerWeights& w, const torch::Tensor& h, const std::vector<torch::Tensor>& state,
                                 const StepTensors& step) const;
  // The queries and keys qk [T, H + H_kv, head_dim] normed by the layer's q/k norms (qk itself without them).
  torch::Tensor normed_qk(const LayerWeights& w, const torch::Tensor& qk) const;
  // The layer's MLP (or MoE block) on h, its output norm applied.
  torch::Tensor mlp(const LayerWeights& w, const torch::Tensor& h) const;
  // The layer's rotary embedding of the query and key heads qk [T, H + H_kv, head_dim].
  torch::Tensor rotate(const LayerWeights& w, const torch::Tensor& qk, const StepTensors& step) const;
  std::vector<LayerWeights> layers_;
  int64_t num_heads_, num_kv_heads_, head_dim_, quant_policy_;
  double eps_, scale_;
};
