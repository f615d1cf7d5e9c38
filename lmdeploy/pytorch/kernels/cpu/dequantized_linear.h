// Larger steps of a GGUF K-quant or Q8_0 layer (Q4_K, Q5_K, Q6_K, Q8_0): its weight dequantized to bf16 for one
// call and torch's linear (oneDNN's GEMM). Shared by the Python kernels' large steps (nn/quant/q4k_cpu.py,
// q5k_cpu.py, q6k_cpu.py, gguf_blocks.py's Q8_0Gemv) and the decoder stack's "*_dequantized" projections.
#pragma once

#include "torch_headers.h"

// Where a dequantization writes its bf16 weight [rows, cols].
using WeightBuffer = torch::Tensor (*)(int64_t rows, int64_t cols);

// A new tensor: what q4k_dequantize and the others hand back to their callers.
torch::Tensor fresh_weight(int64_t rows, int64_t cols);

// A view of this thread's scratch, grown to the largest weight asked for and kept: each call reuses the pages the
// last one touched, where a fresh tensor of tens of MB often comes as new pages whose first touch (page faults,
// zeroing) cost two to three times the dequantization (docs/engine.md). Valid until the thread's next call:
// kquant_dequantized_linear alone takes it, and nothing it returns aliases it.
torch::Tensor scratch_weight(int64_t rows, int64_t cols);

// Q8_0 is no K-quant but its large steps run the same way.
enum class KQuant { kQ4K, kQ5K, kQ6K, kQ8_0 };

// x @ W.T (+ bias), W the layer's codes and scales dequantized into this thread's scratch (as bf16, then in x's
// dtype); with gate_up (Q4_K's tiles alternating gate and up rows) W is [gate; up]. The same result as linear on
// q4k_dequantize's (or q5k_dequantize's, q6k_dequantize's, q8_dequantize's) fresh weight, bit for bit.
torch::Tensor kquant_dequantized_linear(KQuant type, const torch::Tensor& x, const torch::Tensor& codes,
                                        const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                                        bool gate_up);

// The KQuant of a kind's name: "q4k", "q5k", "q6k" or "q8_0".
KQuant kquant_of(const std::string& name);
