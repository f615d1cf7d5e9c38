// Larger steps of a block-quantized layer (GGUF Q4_K, Q5_K, Q6_K, Q8_0; MXFP4): x @ W.T on a weight that is
// dequantized for the call. With AVX512-BF16 and no AMX, each thread dequantizes a group of 16-row tiles into the
// native bf16 GEMM's packed panels in cache and runs that GEMM's tiles over every row of x on them
// (bf16_dequantizing_linear in linear_bf16.cpp): each weight byte is read once, the bf16 copy never reaches memory,
// and a row's outputs equal those of pack_bf16_weight and bf16_linear on the dequantized weight bit for bit,
// whatever the number of rows (one or two rows take each tile's weights straight into their sums, in that GEMM's
// order: no panel written and read back). Elsewhere (AMX, whose oneDNN GEMM is several times faster at many rows;
// fp32 x; no AVX512-BF16) the whole weight goes to bf16 in this thread's reused scratch and torch's linear (oneDNN).
// Shared by the Python kernels' large steps (nn/quant/q4k_cpu.py, q6k_cpu.py, gguf_blocks.py's Q8_0Gemv,
// gguf_table.py, mxfp4.py) and the decoder stack's "*_dequantized" projections.
#pragma once

#include <functional>

#include "torch_headers.h"

// Where a dequantization writes its bf16 weight [rows, cols].
using WeightBuffer = torch::Tensor (*)(int64_t rows, int64_t cols);

// A new tensor: what q4k_dequantize and the others hand back to their callers.
torch::Tensor fresh_weight(int64_t rows, int64_t cols);

// A view of this thread's scratch, grown to the largest weight asked for and kept: each call reuses the pages the
// last one touched, where a fresh tensor of tens of MB often comes as new pages whose first touch (page faults,
// zeroing) cost two to three times the dequantization (docs/performance.md, "GGUF K-quant prefill: no fresh pages
// per call"). Valid until the thread's next call: dequantized_linear alone takes it, and nothing it returns aliases it.
torch::Tensor scratch_weight(int64_t rows, int64_t cols);

// Where one tile's bf16 weights go: its 16 rows of W (`out` its first row, rows K apart), or its panel in
// pack_bf16_weight's layout [K/2, 16, 2] (`packed`); or, with `rows` above zero, nowhere: each input pair's weights
// go straight into the fp32 sums `sums` (16 a row, one per tile row) of that many rows of bf16 `x` (K apart), in the
// bf16 GEMM's order (one vdpbf16ps a pair, the pairs in order of k), so that a few rows skip the panel's round trip.
struct TileSink {
  c10::BFloat16* out;
  int64_t K;
  bool packed;
  const c10::BFloat16* x = nullptr;
  int64_t rows = 0;
  float* sums = nullptr;
};

// A block-quantized weight W [N, K] as tiles of 16 rows that dequantize one at a time: write(tile, sink) writes
// tile `tile`'s weights, rounded once to bf16, into sink. With gate_up the tiles alternate gate and up rows (tile
// 2u: gate rows 16u..; 2u + 1: up rows 16u..) and W is [gate; up]. The tensors it reads are kept alive by write.
struct TiledWeight {
  int64_t N = 0, K = 0;
  bool gate_up = false;
  std::function<void(int64_t tile, const TileSink& sink)> write;
};

// W [N, K] in bf16, written to buffer(N, K).
torch::Tensor dequantize_tiles(const TiledWeight& weight, WeightBuffer buffer);

// Whether bf16 x takes bf16_dequantizing_linear: built with AVX512-BF16, on a CPU without AMX.
bool dequantizing_gemm_available();

// x @ W.T (+ bias) for bf16 x on the native bf16 GEMM, W dequantized group by group in cache (see above); the
// result in bf16, the bias added in fp32 before the one rounding.
torch::Tensor bf16_dequantizing_linear(const torch::Tensor& x, const TiledWeight& weight,
                                       const c10::optional<torch::Tensor>& bias);

// x @ W.T (+ bias): bf16_dequantizing_linear where dequantizing_gemm_available() and x is bf16, else torch's
// linear on W dequantized into this thread's scratch (in x's dtype).
torch::Tensor dequantized_linear(const torch::Tensor& x, const TiledWeight& weight,
                                 const c10::optional<torch::Tensor>& bias);

// Q8_0 is no K-quant but its large steps run the same way.
enum class KQuant { kQ4K, kQ5K, kQ6K, kQ8_0 };

// A GGUF layer's codes and scales as tiles (gate_up: Q4_K's tiles alternating gate and up rows). Built with
// AVX512-BF16.
TiledWeight kquant_tiles(KQuant type, const torch::Tensor& codes, const torch::Tensor& scales, bool gate_up);

// dequantized_linear on a GGUF layer's codes and scales.
torch::Tensor kquant_dequantized_linear(KQuant type, const torch::Tensor& x, const torch::Tensor& codes,
                                        const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                                        bool gate_up);

// The KQuant of a kind's name: "q4k", "q5k", "q6k" or "q8_0".
KQuant kquant_of(const std::string& name);
