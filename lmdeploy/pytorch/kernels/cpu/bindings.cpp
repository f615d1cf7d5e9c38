// The Python module of the native CPU kernels; each has a torch twin in lmdeploy/pytorch/kernels.
#include <torch/csrc/utils/pybind.h>

#include "decoder_stack.h"
#include "gated_delta.h"
#include "linear_q5k.h"
#include "mamba1.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_table"), py::arg("kv_lens"), py::arg("scale"),
        py::arg("k_scales_zeros") = py::none(), py::arg("v_scales_zeros") = py::none(), py::arg("quant_policy") = 0,
        py::arg("sliding_window") = py::none(), py::arg("logit_softcap") = py::none(),
        py::arg("sinks") = py::none(), py::arg("attention_chunk") = py::none());
  m.def("paged_prefill_attention", &paged_prefill_attention, "causal attention of prefill chunks over the caches",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("q_start"), py::arg("q_len"), py::arg("ctx_len"), py::arg("max_q_len"), py::arg("scale"),
        py::arg("k_scales_zeros") = py::none(), py::arg("v_scales_zeros") = py::none(), py::arg("quant_policy") = 0,
        py::arg("sliding_window") = py::none(), py::arg("logit_softcap") = py::none(),
        py::arg("sinks") = py::none(), py::arg("key_limit") = py::none(), py::arg("attention_chunk") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm with an optional fused residual add", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("eps"), pybind11::arg("residual") = pybind11::none());
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("argmax", &argmax, "the first index of each row's largest value");
  m.def("apply_token_bitmask", &apply_token_bitmask, "-inf where a grammar's token bitmask has a 0 bit");
  m.def("apply_rotary", &apply_rotary, "rotary embedding, rotate-half layout");
  m.def("bind_worker_threads", &bind_worker_threads, "pin the calling thread's OpenMP workers to CPUs");
  m.def("fill_kv_cache", &fill_kv_cache, "write K/V rows (or their int8/int4 codes) into the paged caches",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("blocks"), py::arg("offsets"),
        py::arg("k_scales_zeros") = py::none(), py::arg("v_scales_zeros") = py::none(), py::arg("quant_policy") = 0);
  m.def("bf16_gemm_available", &bf16_gemm_available, "whether bf16_linear was built (AVX512-BF16)");
  m.def("pack_bf16_weight", &pack_bf16_weight, "a bf16 [N, K] weight in bf16_linear's panel layout");
  m.def("bf16_linear", &bf16_linear,
        "x @ W.T (+ bias) on a weight from pack_bf16_weight, its first `outputs` rows (default: all)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("outputs") = pybind11::none());
  m.def("pack_bf16_gate_up", &pack_bf16_gate_up, "a [gate; up] bf16 weight packed for bf16_gate_up_silu");
  m.def("bf16_gate_up_silu", &bf16_gate_up_silu,
        "silu(x @ G.T) * (x @ U.T) on a weight from pack_bf16_gate_up, G's and U's first `outputs` / 2 rows each "
        "(default: all)",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("bias") = pybind11::none(),
        pybind11::arg("outputs") = pybind11::none());
  m.def("int8_gemm_available", &int8_gemm_available, "whether int8_linear was built (AVX512-VNNI)");
  m.def("pack_int8_weight", &pack_int8_weight, "an int8 [N, K] weight in int8_linear's panel layout");
  m.def("int8_linear", &int8_linear,
        "(qx @ W.T) * sx * scale (+ bias), x quantized per row, on a weight from pack_int8_weight",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("compensation"), pybind11::arg("scale"),
        pybind11::arg("bias") = pybind11::none());
  m.def("int4_gemv_available", &int4_gemv_available, "whether int4_linear was built (AVX512-BF16)");
  m.def("int4_linear", &int4_linear, "x @ W.T (+ bias) on 4-bit weight groups (linear_int4.cpp), x in bf16",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias") = py::none());
  m.def("int4_gate_up_silu", &int4_gate_up_silu, "silu(x @ G.T) * (x @ U.T) on 4-bit gate and up tiles",
        py::arg("x"), py::arg("packed"), py::arg("scales"));
  m.def("q4k_linear", &q4k_linear, "x @ W.T (+ bias) on GGUF Q4_K codes and scales (linear_int4.cpp), x in bf16",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias") = py::none());
  m.def("q4k_gate_up_silu", &q4k_gate_up_silu, "silu(x @ G.T) * (x @ U.T) on GGUF Q4_K gate and up tiles",
        py::arg("x"), py::arg("packed"), py::arg("scales"));
  m.def(
      "q4k_dequantize",
      [](const torch::Tensor& packed, const torch::Tensor& scales, bool gate_up) {
        return dequantize_tiles(q4k_tiled(packed, scales, gate_up), fresh_weight);
      },
      "bf16 W of q4k_linear's codes and scales ([gate; up] with gate_up)", py::arg("packed"), py::arg("scales"),
      py::arg("gate_up") = false);
  m.def("fp32_packed_linear_available", &fp32_packed_linear_available,
        "whether fp32_packed_linear was built (AVX-512, or AVX2 with FMA)");
  m.def("fp32_packed_linear_isas", &fp32_packed_linear_isas,
        "the instruction sets fp32_packed_linear was built for, widest first ('avx512', 'avx2')");
  m.def("pack_fp32_weight", &pack_fp32_weight,
        "an fp32 weight [N, K] as fp32_packed_linear's tiles [ceil(N/16), K, 16]", py::arg("weight"));
  m.def("fp32_packed_linear", &fp32_packed_linear,
        "fp32 x @ W.T + bias on pack_fp32_weight's tiles of W [n, K], rows independent of their number; on the "
        "instruction set `isa` (one of fp32_packed_linear_isas(); empty: the widest)",
        py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(), py::arg("isa") = "");
  m.def("q8_gemv_available", &q8_gemv_available, "whether q8_linear was built (AVX512-BF16)");
  m.def("q8_linear", &q8_linear, "fp32 x @ W.T on 8-bit weight groups (linear_q8.cpp)", py::arg("x"),
        py::arg("packed"), py::arg("scales"));
  m.def(
      "q8_dequantize",
      [](const torch::Tensor& packed, const torch::Tensor& scales) {
        return dequantize_tiles(q8_tiled(packed, scales), fresh_weight);
      },
      "bf16 W of q8_linear's codes and scales", py::arg("packed"), py::arg("scales"));
  m.def("q6k_gemv_available", &q6k_gemv_available, "whether q6k_linear was built (AVX512-BF16)");
  m.def("q6k_linear", &q6k_linear, "fp32 x @ W.T on GGUF Q6_K codes and scales (linear_q6k.cpp), x in bf16",
        py::arg("x"), py::arg("codes"), py::arg("scales"));
  m.def(
      "q6k_dequantize",
      [](const torch::Tensor& codes, const torch::Tensor& scales) {
        return dequantize_tiles(q6k_tiled(codes, scales), fresh_weight);
      },
      "bf16 W of q6k_linear's codes and scales", py::arg("codes"), py::arg("scales"));
  m.def("q5k_gemv_available", &q5k_gemv_available, "whether q5k_linear was built (AVX512-BF16)");
  m.def("q5k_linear", &q5k_linear, "fp32 x @ W.T on GGUF Q5_K codes and scales (linear_q5k.cpp), x in bf16",
        py::arg("x"), py::arg("codes"), py::arg("scales"));
  m.def(
      "q5k_dequantize",
      [](const torch::Tensor& codes, const torch::Tensor& scales) {
        return dequantize_tiles(q5k_tiled(codes, scales), fresh_weight);
      },
      "bf16 W of q5k_linear's codes and scales", py::arg("codes"), py::arg("scales"));
  m.def(
      "kquant_dequantized_linear",
      [](const torch::Tensor& x, const std::string& kind, const torch::Tensor& codes, const torch::Tensor& scales,
         const c10::optional<torch::Tensor>& bias, bool gate_up) {
        return kquant_dequantized_linear(kquant_of(kind), x, codes, scales, bias, gate_up);
      },
      "x @ W.T (+ bias), W a GGUF layer's codes and scales ('q4k', 'q5k', 'q6k', 'q8_0') dequantized for the call "
      "(dequantized_linear.h)",
      py::arg("x"), py::arg("kind"), py::arg("codes"), py::arg("scales"), py::arg("bias") = py::none(),
      py::arg("gate_up") = false);
  m.def("mxfp4_gemv_available", &mxfp4_gemv_available, "whether mxfp4_linear was built (AVX-512)");
  m.def("mxfp4_linear", &mxfp4_linear, "fp32 x @ W.T on MXFP4 blocks and scales (linear_mxfp4.cpp), x in fp32 or bf16",
        py::arg("x"), py::arg("blocks"), py::arg("scales"));
  m.def("mxfp4_dequantize", &mxfp4_dequantize, "MXFP4 blocks and scales as a [N, K] fp32 or bf16 weight",
        py::arg("blocks"), py::arg("scales"), py::arg("dtype"));
  m.def("mxfp4_dequantized_linear", &mxfp4_dequantized_linear,
        "x @ W.T (+ bias), W MXFP4 blocks and scales dequantized for the call (dequantized_linear.h)", py::arg("x"),
        py::arg("blocks"), py::arg("scales"), py::arg("bias") = py::none());
  m.def("dequantizing_gemm_available", &dequantizing_gemm_available,
        "whether bf16 large steps of block-quantized weights dequantize into the native bf16 GEMM's panels "
        "(AVX512-BF16 without AMX)");
  m.def("gated_delta_available", &gated_delta_available, "whether gated_delta_decode was built (AVX-512)");
  m.def("gated_delta_decode", &gated_delta_decode,
        "one token of each sequence through the gated delta rule, on its row of the fp32 state pool (in place)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("g"), py::arg("beta"), py::arg("states"), py::arg("slots"));
  m.def("mamba1_scan_available", &mamba1_scan_available, "whether mamba1_scan was built (AVX-512)");
  m.def("mamba1_scan", &mamba1_scan,
        "segments of tokens through Mamba-1's selective scan, each on its row of the fp32 state pool (in place)",
        py::arg("x"), py::arg("dt"), py::arg("A"), py::arg("B"), py::arg("C"), py::arg("states"), py::arg("slots"),
        py::arg("lengths"));
  m.def("causal_conv1d_decode", &causal_conv1d_decode,
        "SiLU of the depthwise causal convolution of one input per sequence, shifting it into its row of the state pool",
        py::arg("x"), py::arg("conv_states"), py::arg("slots"), py::arg("weight"));
  m.def("mla_decode_attention", &mla_decode_attention, "multi-head latent attention of one token per sequence",
        py::arg("q"), py::arg("cache"), py::arg("block_table"), py::arg("kv_lens"), py::arg("scale"), py::arg("v_dim"),
        py::arg("scales_zeros") = py::none(), py::arg("quant_policy") = 0);
  m.def("mla_prefill_attention", &mla_prefill_attention, "causal multi-head latent attention of prefill chunks",
        py::arg("q"), py::arg("latent"), py::arg("cache"), py::arg("block_table"), py::arg("q_start"),
        py::arg("q_len"), py::arg("ctx_len"), py::arg("max_q_len"), py::arg("scale"), py::arg("v_dim"),
        py::arg("scales_zeros") = py::none(), py::arg("quant_policy") = 0);
  m.def("pack_int8_gate_up", &pack_int8_gate_up, "a [gate; up] int8 weight packed for int8_gate_up_silu");
  m.def("int8_gate_up_silu", &int8_gate_up_silu, "silu(x @ G.T) * (x @ U.T), W8A8, on a weight from pack_int8_gate_up",
        py::arg("x"), py::arg("packed"), py::arg("compensation"), py::arg("scale"), py::arg("bias") = py::none());
  // By keyword only, so that a field given under a wrong name or left out raises instead of shifting the others.
  using Optional = c10::optional<torch::Tensor>;
  py::class_<StepTensors>(m, "StepTensors", "the step's tensors that every decoder layer reads")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, Optional, Optional, Optional,
                    Optional, int64_t, Optional, Optional, Optional, Optional, Optional, Optional, Optional, Optional,
                    Optional, Optional>(),
           py::kw_only(), py::arg("cos"), py::arg("sin"), py::arg("kv_blocks"), py::arg("kv_offsets"),
           py::arg("num_prefill_tokens"), py::arg("prefill_block_table"), py::arg("prefill_q_start"),
           py::arg("prefill_q_len"), py::arg("prefill_ctx_len"), py::arg("prefill_max_q_len"),
           py::arg("decode_blocks"), py::arg("decode_kv_lens"), py::arg("local_cos"), py::arg("local_sin"),
           py::arg("window_kv_blocks"), py::arg("window_prefill_block_table"), py::arg("window_decode_blocks"),
           py::arg("prefill_key_limit") = py::none(), py::arg("q_scale") = py::none(),
           py::arg("state_decode_slots") = py::none());
  py::class_<Projection>(m, "Projection", "a decoder layer's projection on its native GEMM's weight")
      .def(py::init<const std::string&, torch::Tensor, Optional, Optional, Optional, c10::optional<int64_t>,
                    c10::optional<std::string>>(),
           py::kw_only(), py::arg("kind"), py::arg("weight"), py::arg("compensation") = py::none(),
           py::arg("scale") = py::none(), py::arg("bias") = py::none(), py::arg("outputs") = py::none(),
           py::arg("isa") = py::none())
      .def(py::init<std::vector<Projection>>(), py::kw_only(), py::arg("parts"))
      .def("__call__", &Projection::operator(), py::call_guard<py::gil_scoped_release>(), py::arg("x"))
      .def("gate_up_silu", &Projection::gate_up_silu, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
           "silu(gate) * up of a gate-and-up projection, as the stack's MLP runs it")
      .def_readonly("weight", &Projection::weight, "the weight as its kernel takes it (undefined for parts)")
      .def_readonly("outputs", &Projection::outputs, "bf16, fp32: the weight's rows")
      .def_readonly("isa", &Projection::isa, "fp32: the instruction set its GEMM runs on");
  py::class_<MoEBlock>(m, "MoEBlock", "a decoder layer's mixture-of-experts MLP")
      .def(py::init<Projection, int64_t, bool, const std::string&, Optional, c10::optional<int64_t>,
                    c10::optional<int64_t>, c10::optional<double>, c10::optional<double>, Optional, Optional, Optional,
                    Optional, std::vector<Projection>, std::vector<Projection>, const std::string&,
                    c10::optional<double>, c10::optional<double>, c10::optional<Projection>,
                    c10::optional<Projection>, c10::optional<Projection>>(),
           py::kw_only(), py::arg("router"), py::arg("top_k"), py::arg("renormalize"), py::arg("routing"),
           py::arg("correction_bias") = py::none(), py::arg("num_groups") = py::none(),
           py::arg("topk_groups") = py::none(), py::arg("scaling") = py::none(), py::arg("norm_min") = py::none(),
           py::arg("gate_up") = py::none(), py::arg("down") = py::none(), py::arg("gate_up_bias") = py::none(),
           py::arg("down_bias") = py::none(), py::arg("expert_gate_up") = std::vector<Projection>(),
           py::arg("expert_down") = std::vector<Projection>(), py::arg("activation") = "silu",
           py::arg("swiglu_alpha") = py::none(), py::arg("swiglu_limit") = py::none(),
           py::arg("shared_gate_up") = py::none(),
           py::arg("shared_down") = py::none(), py::arg("shared_gate") = py::none())
      .def("__call__", &MoEBlock::operator(), py::call_guard<py::gil_scoped_release>(), py::arg("x"))
      .def("experts_in_one_region", &MoEBlock::experts_in_one_region, py::arg("tokens"));
  py::class_<LatentAttention>(m, "LatentAttention", "a decoder layer's multi-head latent attention (DeepSeek)")
      .def(py::init<c10::optional<Projection>, Optional, Projection, Projection, torch::Tensor, torch::Tensor, int64_t,
                    int64_t, int64_t, int64_t, int64_t, bool, double, double, bool>(),
           py::kw_only(), py::arg("q_a") = py::none(), py::arg("q_a_norm") = py::none(), py::arg("q"),
           py::arg("kv_a"), py::arg("kv_a_norm"), py::arg("kv_b"), py::arg("num_heads"), py::arg("kv_lora_rank"),
           py::arg("nope_dim"), py::arg("rope_dim"), py::arg("v_head_dim"), py::arg("interleaved_rope"),
           py::arg("scale"), py::arg("norm_eps"), py::arg("scaled_queries") = false);
  py::class_<LinearAttention>(m, "LinearAttention", "a decoder layer's Gated DeltaNet linear attention")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, bool, bool, torch::Tensor, torch::Tensor, torch::Tensor,
                    torch::Tensor, double>(),
           py::kw_only(), py::arg("num_k_heads"), py::arg("num_v_heads"), py::arg("k_dim"), py::arg("v_dim"),
           py::arg("grouped_projections"), py::arg("value_heads_tiled"), py::arg("conv_weight"), py::arg("a_log"),
           py::arg("dt_bias"), py::arg("norm_weight"), py::arg("eps"));
  py::class_<LayerWeights>(m, "LayerWeights", "a Llama-style decoder layer's weights")
      .def(py::init<Optional, Optional, c10::optional<Projection>, Projection, c10::optional<Projection>,
                    c10::optional<Projection>,
                    c10::optional<MoEBlock>, Optional, Optional, Optional, Optional, int64_t, bool, bool,
                    c10::optional<int64_t>, c10::optional<double>, bool, bool, double, bool, bool,
                    c10::optional<int64_t>, c10::optional<double>, Optional, c10::optional<LatentAttention>, bool,
                    c10::optional<LinearAttention>, bool, bool, bool, c10::optional<std::string>,
                    c10::optional<std::vector<torch::Tensor>>, Optional, Optional>(),
           py::kw_only(), py::arg("input_norm") = py::none(), py::arg("post_norm") = py::none(),
           py::arg("qkv") = py::none(),
           py::arg("o"),
           py::arg("gate_up") = py::none(), py::arg("down") = py::none(), py::arg("moe") = py::none(),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("attn_out_norm") = py::none(), py::arg("mlp_out_norm") = py::none(), py::arg("rotary_dim"),
           py::arg("interleaved_rope") = false, py::arg("local_rope") = false, py::arg("sliding_window") = py::none(),
           py::arg("logit_softcap") = py::none(), py::arg("gelu_tanh_mlp") = false,
           py::arg("scaled_queries") = false, py::arg("residual_scale") = 1.0,
           py::arg("qk_norm_across_heads") = false, py::arg("post_norms_only") = false,
           py::arg("attention_chunk") = py::none(), py::arg("qk_l2_norm_eps") = py::none(),
           py::arg("sinks") = py::none(), py::arg("mla") = py::none(), py::arg("output_gate") = false,
           py::arg("linear_attn") = py::none(), py::arg("parallel_block") = false, py::arg("layer_norm") = false,
           py::arg("qk_norm_after_rope") = false, py::arg("ungated_mlp") = py::none(), py::arg("xielu") = py::none(),
           py::arg("input_norm_bias") = py::none(), py::arg("post_norm_bias") = py::none());
  py::class_<DecoderStack>(m, "DecoderStack", "Llama-style decoder layers in one call per step")
      .def(py::init<std::vector<LayerWeights>, int64_t, int64_t, int64_t, double, double, int64_t>(), py::kw_only(),
           py::arg("layers"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"), py::arg("quant_policy"))
      .def("forward", &DecoderStack::forward, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
           py::arg("kv_caches"), py::arg("step"));
}
