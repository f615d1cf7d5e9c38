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

torch::Tensor kquant_dequantized_linear(KQuant type, const torch::Tensor& x, const torch::Tensor& codes,
                                        const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias,
                                        bool gate_up) {
  TORCH_CHECK(!gate_up || type == KQuant::kQ4K, "only Q4_K's tiles alternate gate and up rows");
  torch::Tensor weight;
  switch (type) {
    case KQuant::kQ4K: weight = q4k_dequantize(codes, scales, gate_up, scratch_weight); break;
    case KQuant::kQ5K: weight = q5k_dequantize(codes, scales, scratch_weight); break;
    case KQuant::kQ6K: weight = q6k_dequantize(codes, scales, scratch_weight); break;
    case KQuant::kQ8_0: weight = q8_dequantize(codes, scales, scratch_weight); break;
  }
  return at::linear(x, weight.to(x.scalar_type()), bias);
}

KQuant kquant_of(const std::string& name) {
  if (name == "q4k") return KQuant::kQ4K;
  if (name == "q5k") return KQuant::kQ5K;
  if (name == "q6k") return KQuant::kQ6K;
  TORCH_CHECK(name == "q8_0", "a GGUF layer's kind is 'q4k', 'q5k', 'q6k' or 'q8_0', not '", name, "'");
  return KQuant::kQ8_0;
}
