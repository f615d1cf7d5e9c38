#include "dequantized_linear.h"

#include <ATen/ops/linear.h>

#include "common.h"
#include "linear_q5k.h"

torch::Tensor fresh_weight(int64_t rows, int64_t cols) {
  return torch::empty({rows, cols}, torch::dtype(at::kBFloat16));
}

torch::Tensor scratch_weight(int64_t rows, int64_t cols) {
  thread_local torch::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < rows * cols) {
    scratch = torch::Tensor();  // the old pages go back before the larger ones are taken
    scratch = torch::empty({rows * cols}, torch::dtype(at::kBFloat16));
  }
  return scratch.narrow(0, 0, rows * cols).view({rows, cols});
}

torch::Tensor dequantize_tiles(const TiledWeight& weight, WeightBuffer buffer) {
  constexpr int64_t kTileRows = 16;
  auto out = buffer(weight.N, weight.K);
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t half = weight.N / 2;
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t tile = 0; tile < weight.N / kTileRows; ++tile) {
    const int64_t first_row = weight.gate_up ? (tile % 2) * half + (tile / 2) * kTileRows : tile * kTileRows;
    weight.write(tile, TileSink{op + first_row * weight.K, weight.K, false});
  }
  return out;
}

torch::Tensor dequantized_linear(const torch::Tensor& x, const TiledWeight& weight,
                                 const c10::optional<torch::Tensor>& bias) {
  if (x.scalar_type() == at::kBFloat16 && dequantizing_gemm_available())
    return bf16_dequantizing_linear(x, weight, bias);
  return at::linear(x, dequantize_tiles(weight, scratch_weight).to(x.scalar_type()), bias);
}

TiledWeight kquant_tiles(KQuant type, const torch::Tensor& codes, const torch::Tensor& scales, bool gate_up) {
  TORCH_CHECK(!gate_up || type == KQuant::kQ4K, "only Q4_K's tiles alternate gate and up rows");
  switch (type) {
    case KQuant::kQ4K: return q4k_tiled(codes, scales, gate_up);
    case KQuant::kQ5K: return q5k_tiled(codes, scales);
    case KQuant::kQ6K: return q6k_tiled(codes, scales);
    case KQuant::kQ8_0: break;
  }
  return q8_tiled(codes, scales);
}

torch::Tensor kquant_dequantized_linear(KQuant type, const torch::Tensor& x, const torch::Tensor& codes,
                                        const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                                        bool gate_up) {
  return dequantized_linear(x, kquant_tiles(type, codes, scales, gate_up), bias);
}

KQuant kquant_of(const std::string& name) {
  if (name == "q4k") return KQuant::kQ4K;
  if (name == "q5k") return KQuant::kQ5K;
  if (name == "q6k") return KQuant::kQ6K;
  TORCH_CHECK(name == "q8_0", "a GGUF layer's kind is 'q4k', 'q5k', 'q6k' or 'q8_0', not '", name, "'");
  return KQuant::kQ8_0;
}
