// fp32 y = x @ W.T for steps of a few rows on 8-bit weights, for CPUs with AVX-512: w = q * scale, groups
// of 32 inputs with an fp16 scale each and q in -127..127 (GGUF's Q8_0), or groups of 16 with an fp32
// scale each (GGUF's Q6_K: q in -32..31, scale = d * sc exactly); activations used in fp32 (not quantized).
// The LM head of batch-1 decode: it reads half the bytes of an fp16 copy.
//
// Packed weight [N/16, K/G, G, 16] int8: a tile of 16 rows, one group, input-major, so that one 16-byte
// load widened to fp32 gives one input's weights of 16 rows; scales [N/16, K/G, 16], fp16 (G = 32) or
// fp32 (G = 16).
#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kTile = 16;

inline __m512 load_scales(const uint16_t* s) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}
inline __m512 load_scales(const float* s) { return _mm512_loadu_ps(s); }

template <int64_t kGroup, typename S, typename T>
void q8_rows(const T* x, const int8_t* w, const S* scales, float* out, int64_t M, int64_t K, int64_t N) {
  const int64_t tiles = N / kTile, groups = K / kGroup;
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = to_float(x[i]);
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t tile = 0; tile < tiles; ++tile) {
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* wt = w + tile * groups * kGroup * kTile;
      const S* st = scales + tile * groups * kTile;
      const float* xr = xf.data() + m * K;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t group = 0; group < groups; ++group, wt += kGroup * kTile, st += kTile, xr += kGroup) {
        __m512 d[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 32
        for (int k = 0; k < static_cast<int>(kGroup); ++k) {
          const __m512 codes = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wt + k * kTile))));
          d[k & 3] = _mm512_fmadd_ps(codes, _mm512_set1_ps(xr[k]), d[k & 3]);
        }
        const __m512 scale = load_scales(st);
        acc = _mm512_fmadd_ps(scale, _mm512_add_ps(_mm512_add_ps(d[0], d[1]), _mm512_add_ps(d[2], d[3])), acc);
      }
      _mm512_storeu_ps(out + m * N + tile * kTile, acc);
    }
  }
}

}  // namespace

bool q8_gemv_available() { return true; }

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(3) == kTile &&
                  packed.is_contiguous(),
              "packed: int8 [N/16, K/G, G, 16]");
  const int64_t group = packed.size(2), N = packed.size(0) * kTile, K = packed.size(1) * group;
  const bool q6 = group == 16;
  TORCH_CHECK((group == 32 && scales.scalar_type() == at::kHalf) || (q6 && scales.scalar_type() == at::kFloat),
              "groups of 32 inputs with fp16 scales or of 16 with fp32 scales");
  TORCH_CHECK(scales.is_contiguous() && scales.numel() == N * (K / group), "scales: [N/16, K/G, 16]");
  TORCH_CHECK(x.size(-1) == K, "x must have ", K, " features");
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const auto* w = packed.data_ptr<int8_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "q8_linear", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "q8_linear takes fp32, bf16 or fp16 activations");
    } else {
      if (q6)
        q8_rows<16>(rows.data_ptr<scalar_t>(), w, scales.data_ptr<float>(), out.data_ptr<float>(), M, K, N);
      else
        q8_rows<32>(rows.data_ptr<scalar_t>(), w, reinterpret_cast<const uint16_t*>(scales.data_ptr()),
                    out.data_ptr<float>(), M, K, N);
    }
  });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

#else

bool q8_gemv_available() { return false; }

torch::Tensor q8_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX-512");
}

#endif
