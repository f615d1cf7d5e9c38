// fp32 logits y = x @ W.T for steps of a few rows on 8-bit weights, for CPUs with AVX-512: groups of 32
// inputs with an fp16 scale each, w = q * scale with q in -127..127 (GGUF's Q8_0), activations used in
// fp32 (not quantized). The LM head of batch-1 decode: it reads half the bytes of an fp16 copy.
//
// Packed weight [N/16, K/32, 32, 16] int8: a tile of 16 rows, one group, input-major, so that one 16-byte
// load widened to fp32 gives one input's weights of 16 rows; scales [N/16, K/32, 16] fp16.
#include "gemv_tiles.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kTile = 16, kGroup = 32;

// One tile's 16 fp32 outputs for each of the M rows of xf (x in fp32).
void q8_tile(const float* xf, const int8_t* w, const uint16_t* scales, float* out, int64_t tile, int64_t M, int64_t K,
             int64_t N) {
  const int64_t groups = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* wt = w + tile * groups * kGroup * kTile;
    const uint16_t* st = scales + tile * groups * kTile;
    const float* xr = xf + m * K;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t group = 0; group < groups; ++group, wt += kGroup * kTile, st += kTile, xr += kGroup) {
      __m512 d[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 32
      for (int k = 0; k < kGroup; ++k) {
        const __m512 codes = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wt + k * kTile))));
        d[k & 3] = _mm512_fmadd_ps(codes, _mm512_set1_ps(xr[k]), d[k & 3]);
      }
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(st)));
      acc = _mm512_fmadd_ps(scale, _mm512_add_ps(_mm512_add_ps(d[0], d[1]), _mm512_add_ps(d[2], d[3])), acc);
    }
    _mm512_storeu_ps(out + m * N + tile * kTile, acc);
  }
}

}  // namespace

bool q8_gemv_available() { return true; }

GemvTiles q8_tiles(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                   const torch::Tensor& out) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(2) == kGroup &&
                  packed.size(3) == kTile && packed.is_contiguous(),
              "packed: int8 [N/16, K/32, 32, 16]");
  const int64_t N = packed.size(0) * kTile, K = packed.size(1) * kGroup;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * (K / kGroup),
              "scales: fp16 [N/16, K/32, 16]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must have ", K, " features");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "q8_linear takes fp32, bf16 or fp16 activations");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == M * N, "out: fp32 [M, N]");
  auto xf = std::make_shared<std::vector<float>>(M * K);
  GemvTiles tiles;
  tiles.units = N / kTile;
  tiles.fp32_out = true;
  tiles.prepare = [x, xf] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "q8_linear", [&] {
      const scalar_t* xp = x.data_ptr<scalar_t>();
      for (size_t i = 0; i < xf->size(); ++i) (*xf)[i] = to_float(xp[i]);
    });
  };
  const auto* w = packed.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* o = out.data_ptr<float>();
  tiles.run = [xf, w, s, o, M, K, N](int64_t tile) { q8_tile(xf->data(), w, s, o, tile, M, K, N); };
  return tiles;
}

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(packed.dim() == 4, "packed: int8 [N/16, K/32, 32, 16]");
  const int64_t N = packed.size(0) * kTile;
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  auto out = torch::empty({rows.size(0), N}, x.options().dtype(at::kFloat));
  run_tiles(q8_tiles(rows, packed, scales, out));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

#else

bool q8_gemv_available() { return false; }

GemvTiles q8_tiles(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX-512");
}

torch::Tensor q8_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX-512");
}

#endif
