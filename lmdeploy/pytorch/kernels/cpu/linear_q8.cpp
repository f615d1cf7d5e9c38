// fp32 y = x @ W.T for steps of a few rows on 8-bit weights, for CPUs with AVX512-BF16: groups of 32 inputs with an
// fp16 scale each, w = q * scale with q in -128..127 (GGUF's Q8_0). The LM head of batch-1 decode (it reads half
// the bytes of an fp16 copy) and a Q8_0 layer's small steps.
//
// Packed weight [N/16, K/32, 32, 16] int8: a tile of 16 rows, one group, input-major, so that one 16-byte load
// widened to fp32 gives one input's weights of 16 rows; scales [N/16, K/32, 16] fp16.
//
// A tile's group is widened once for all the rows of x: its codes become fp32 (exact), and each input's 16 rows of
// codes are multiplied by the row's x (in fp32) in one FMA; the group's sum times its scale is added to the row's
// outputs. Every row's sums run in the same order whatever the number of rows, so a row's logits do not depend on
// the rows beside it (a prompt's output on its batch). The codes are asked for ahead of their reading, as the
// K-quant GEMVs' are. q8_tiled writes the same weights in bf16, tile by tile, for larger steps.
#include "gemv_tiles.h"
#include "kquant_gemv.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kTile = 16, kGroup = 32, kPairs = kGroup / 2;

// The 16 rows' codes of one input (16 bytes at w) in fp32.
inline __m512 input_codes(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// The 16 rows' weights of two inputs as bf16 pairs: dword r holds row r's (even, odd).
inline __m512i row_pairs(__m512 even, __m512 odd) {
  // lanes 0-15 of cvtne2ps_pbh(odd, even) hold even's rows, 16-31 odd's: lane 2r takes r, lane 2r + 1 takes 16 + r
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// One tile's 16 fp32 outputs for the M rows of x (fp32 [M, K]) into out [M, N].
void q8_tile(const float* x, int64_t M, const int8_t* w, const uint16_t* scales, float* out, int64_t tile, int64_t K,
             int64_t N) {
  const int64_t groups = K / kGroup;
  const int8_t* wt = w + tile * groups * kGroup * kTile;
  const uint16_t* st = scales + tile * groups * kTile;
  float* ot = out + tile * kTile;
  for (int64_t m = 0; m < M; ++m) _mm512_storeu_ps(ot + m * N, _mm512_setzero_ps());
  for (int64_t group = 0; group < groups; ++group, wt += kGroup * kTile, st += kTile) {
    kquant::prefetch_ahead(wt, kquant::kCodePrefetchBytes, kGroup * kTile);
    __m512 codes[kGroup];
#pragma GCC unroll 32
    for (int k = 0; k < kGroup; ++k) codes[k] = input_codes(wt + k * kTile);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(st)));
    for (int64_t m = 0; m < M; ++m) {
      const float* xg = x + m * K + group * kGroup;
      __m512 d[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 32
      for (int k = 0; k < kGroup; ++k) d[k & 3] = _mm512_fmadd_ps(codes[k], _mm512_set1_ps(xg[k]), d[k & 3]);
      float* y = ot + m * N;
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(d[0], d[1]), _mm512_add_ps(d[2], d[3]));
      _mm512_storeu_ps(y, _mm512_fmadd_ps(scale, sum, _mm512_loadu_ps(y)));
    }
  }
}

// q8_tile's sums for one row (the same, in the same order), with its accumulator kept in a register: batch-1
// decode's LM head, which is bound by reading the codes, ran 8-12% slower on a shared loop.
void q8_tile_one_row(const float* x, const int8_t* w, const uint16_t* scales, float* out, int64_t tile, int64_t K) {
  const int64_t groups = K / kGroup;
  const int8_t* wt = w + tile * groups * kGroup * kTile;
  const uint16_t* st = scales + tile * groups * kTile;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t group = 0; group < groups; ++group, wt += kGroup * kTile, st += kTile, x += kGroup) {
    __m512 d[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 32
    for (int k = 0; k < kGroup; ++k)
      d[k & 3] = _mm512_fmadd_ps(input_codes(wt + k * kTile), _mm512_set1_ps(x[k]), d[k & 3]);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(st)));
    acc = _mm512_fmadd_ps(scale, _mm512_add_ps(_mm512_add_ps(d[0], d[1]), _mm512_add_ps(d[2], d[3])), acc);
  }
  _mm512_storeu_ps(out + tile * kTile, acc);
}

// N and K of packed codes and their scales, checked.
std::pair<int64_t, int64_t> q8_shape(const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.size(2) == kGroup &&
                  packed.size(3) == kTile && packed.is_contiguous(),
              "packed: int8 [N/16, K/32, 32, 16]");
  const int64_t N = packed.size(0) * kTile, K = packed.size(1) * kGroup;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * (K / kGroup),
              "scales: fp16 [N/16, K/32, 16]");
  return {N, K};
}

}  // namespace

bool q8_gemv_available() { return true; }

GemvTiles q8_tiles(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                   const torch::Tensor& out) {
  const auto [N, K] = q8_shape(packed, scales);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must have ", K, " features");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "q8_linear takes fp32, bf16 or fp16 activations");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == M * N, "out: fp32 [M, N]");
  GemvTiles tiles;
  tiles.units = N / kTile;
  tiles.fp32_out = true;
  auto xf = std::make_shared<std::vector<float>>(M * K);
  tiles.prepare = [x, xf] {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "q8_linear", [&] {
      const scalar_t* xs = x.data_ptr<scalar_t>();
      for (size_t i = 0; i < xf->size(); ++i) (*xf)[i] = to_float(xs[i]);
    });
  };
  const int8_t* w = packed.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* o = out.data_ptr<float>();
  const int64_t n = N, k = K;  // clang before 16 captures no structured bindings
  if (M == 1) tiles.run = [xf, w, s, o, k](int64_t tile) { q8_tile_one_row(xf->data(), w, s, o, tile, k); };
  else tiles.run = [xf, M, w, s, o, k, n](int64_t tile) { q8_tile(xf->data(), M, w, s, o, tile, k, n); };
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

TiledWeight q8_tiled(const torch::Tensor& packed, const torch::Tensor& scales) {
  const int64_t N = q8_shape(packed, scales).first, K = q8_shape(packed, scales).second;
  TiledWeight weight{N, K, false, nullptr};
  const int8_t* w = packed.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  weight.write = [packed, scales, w, sp, K](int64_t tile, const TileSink& sink) {  // the tensors kept alive
    const int64_t groups = K / kGroup;
    for (int64_t group = 0; group < groups; ++group) {
      const int8_t* codes = w + (tile * groups + group) * kGroup * kTile;
      const uint16_t* s = sp + (tile * groups + group) * kTile;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      __m512i pairs[kPairs];  // exact fp32 products, rounded once to bf16
      for (int p = 0; p < kPairs; ++p)
        pairs[p] = row_pairs(_mm512_mul_ps(input_codes(codes + 2 * p * kTile), scale),
                             _mm512_mul_ps(input_codes(codes + (2 * p + 1) * kTile), scale));
      kquant::put_pairs(sink, pairs, group * kGroup);
    }
  };
  return weight;
}

#else

bool q8_gemv_available() { return false; }

GemvTiles q8_tiles(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor q8_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

TiledWeight q8_tiled(const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

#endif
