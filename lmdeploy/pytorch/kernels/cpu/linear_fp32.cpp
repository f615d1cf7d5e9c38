// fp32 y = x @ W.T + bias whose rows do not depend on how many there are: torch's fp32 GEMM picks its kernel, and so
// its order of summation, by the number of rows, so a row's last bits change with the rows beside it (a prompt's
// logprobs with its batch). Here every output y[m, n] is one dot product of x's row m and W's row n in one order:
// 16 lanes over the inputs (input k in lane k % 16, the lanes' partial sums in input order, a partial last chunk
// masked to zeros), then the lanes added in _mm512_reduce_add_ps's fixed tree. Blocks of 4 rows by 4 outputs keep
// 16 such sums in registers at once; a block's shape changes which sums run side by side, never a sum's order.
// Threads share out blocks of outputs, each output computed whole by one thread.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "common.h"

#if defined(__AVX512F__)

namespace {

constexpr int64_t kBlock = 4, kLanes = 16, kOutputsPerTask = 16;

// y[r, c] for the R rows at x (stride K) and the C weight rows at w (stride K), into out (stride N).
template <int R, int C>
void dot_block(const float* x, const float* w, int64_t K, float* out, int64_t N) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    const __mmask16 mask = K - k >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << (K - k)) - 1);
    __m512 xs[R], ws[C];
    for (int r = 0; r < R; ++r) xs[r] = _mm512_maskz_loadu_ps(mask, x + r * K + k);
    for (int c = 0; c < C; ++c) ws[c] = _mm512_maskz_loadu_ps(mask, w + c * K + k);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xs[r], ws[c], acc[r][c]);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * N + c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int R>
void dot_row_block(const float* x, const float* w, int64_t K, float* out, int64_t N, int64_t cols) {
  switch (cols) {
    case 4: return dot_block<R, 4>(x, w, K, out, N);
    case 3: return dot_block<R, 3>(x, w, K, out, N);
    case 2: return dot_block<R, 2>(x, w, K, out, N);
    default: return dot_block<R, 1>(x, w, K, out, N);
  }
}

void dot_any_block(const float* x, const float* w, int64_t K, float* out, int64_t N, int64_t rows, int64_t cols) {
  switch (rows) {
    case 4: return dot_row_block<4>(x, w, K, out, N, cols);
    case 3: return dot_row_block<3>(x, w, K, out, N, cols);
    case 2: return dot_row_block<2>(x, w, K, out, N, cols);
    default: return dot_row_block<1>(x, w, K, out, N, cols);
  }
}

}  // namespace

bool fp32_linear_available() { return true; }

torch::Tensor fp32_linear(const torch::Tensor& x, const torch::Tensor& weight,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 2 &&
                  x.size(-1) == weight.size(1),
              "fp32_linear takes fp32 x [..., K] and weight [N, K]");
  const auto xc = x.reshape({-1, x.size(-1)}).contiguous();
  const auto wc = weight.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = wc.size(0);
  auto out = torch::empty({M, N}, xc.options());
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (N + kOutputsPerTask - 1) / kOutputsPerTask, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin * kOutputsPerTask; n0 < std::min(N, end * kOutputsPerTask); n0 += kBlock)
      for (int64_t m0 = 0; m0 < M; m0 += kBlock)
        dot_any_block(xp + m0 * K, wp + n0 * K, K, op + m0 * N + n0, N, std::min(kBlock, M - m0),
                      std::min(kBlock, N - n0));
  });
  if (bias) out.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

#else

bool fp32_linear_available() { return false; }

torch::Tensor fp32_linear(const torch::Tensor&, const torch::Tensor&, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "fp32_linear needs AVX-512");
}

#endif
