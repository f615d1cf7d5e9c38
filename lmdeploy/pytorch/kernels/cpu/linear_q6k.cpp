// y = x @ W.T (fp32) on GGUF Q6_K weights as the file holds them, for CPUs with AVX512-BF16: 6-bit codes
// u (0..63), an int8 scale sc per 16 inputs and an fp16 d per 256, w = d * sc * (u - 32); bf16 activations
// used as they are (not quantized). The Q6_K layers and output layer of a Q4_K_M file: 0.82 bytes a weight,
// as in the file, against 2 for a bf16 copy.
//
// As in linear_int4.cpp, a code u becomes the bf16 number 128 + u (exact: bf16 steps by 1 in [128, 256)) by
// OR-ing it into 0x4300, so one vdpbf16ps multiplies a broadcast pair of x with a pair of 16 rows' codes, the
// sums D = sum x (128 + u) are exact products summed in fp32, and a group of 16 inputs adds
// d * sc * (D - 160 X) with X = sum x over the group; d * sc is exact in fp32 (11 by 8 significant bits).
//
// Codes [N/16, K/16, 192] bytes, a tile of 16 rows and a group of 16 inputs (8 input pairs p): chunks
// c = 0..3 (32 bytes each) hold in byte j the low 4 bits of (row j/2, input 2c + j%2) in the low nibble and
// of (row j/2, input 8 + 2c + j%2) in the high one; chunks 4 and 5 hold in byte j, bits 2k and 2k + 1, the
// top 2 bits of (row j/2, pair 4h + k, input j%2), h = chunk - 4. Scales [N/16, K/256, 288] bytes: per tile
// and block of 256 inputs, the int8 sc of its 16 groups (16 rows each, group-major), then 16 fp16 d.
//
// q6k_tiled writes the same weights in bf16, tile by tile, for larger steps (no bf16 copy is kept).
#include "kquant_gemv.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kTile = 16, kGroup = 16, kBlock = 256, kCodeBytes = 192, kScaleBytes = 288;

// The top 2 bits of pair 4h + k (bits 2k of `hi`, 16-bit lanes) at bits 4-5, ORed into `low` (0x4300 | low 4).
inline __m512i with_top(__m512i low, __m512i hi, int k) {
  const __m512i top = k < 2 ? _mm512_slli_epi16(hi, 4 - 2 * k) : _mm512_srli_epi16(hi, 2 * k - 4);
  return _mm512_ternarylogic_epi32(low, top, _mm512_set1_epi16(0x0030), 0xF8);  // low | (top & 0x30)
}

// x @ W.T of one tile's 16 rows for the R rows of x from m, in fp32; every row's sums run in the same order
// whatever R is.
template <int R>
inline void tile_dot(const kquant::Gemv& g, int64_t tile, int64_t m, __m512* y) {
  const int64_t groups = g.K / kGroup, blocks = g.K / kBlock;
  const uint8_t* w = g.codes + tile * groups * kCodeBytes;
  const uint8_t* s = g.scales + tile * blocks * kScaleBytes;
  const __m512i nibble = _mm512_set1_epi16(0x000F), offset = _mm512_set1_epi16(0x4300);
  const __m512 minus160 = _mm512_set1_ps(-160.f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t block = 0; block < blocks; ++block, s += kScaleBytes) {
    kquant::prefetch_ahead(s, kquant::kCodePrefetchBytes * kScaleBytes / (kCodeBytes * kBlock / kGroup), kScaleBytes);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kBlock)));
    for (int64_t i = 0; i < kBlock / kGroup; ++i, w += kCodeBytes) {
      kquant::prefetch_ahead(w, kquant::kCodePrefetchBytes, kCodeBytes);
      const int64_t group = block * (kBlock / kGroup) + i;
      const __m512i hi0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128)));
      const __m512i hi1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 160)));
      __m512 dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
        const __m512i low = with_top(_mm512_ternarylogic_epi32(bytes, nibble, offset, 0xEA), hi0, c);
        const __m512i high = with_top(_mm512_or_si512(_mm512_srli_epi16(bytes, 4), offset), hi1, c);
        for (int r = 0; r < R; ++r) {
          const int32_t* pairs = reinterpret_cast<const int32_t*>(g.x + (m + r) * g.K + group * kGroup);
          dot[r][0] = _mm512_dpbf16_ps(dot[r][0], (__m512bh)low, (__m512bh)_mm512_set1_epi32(pairs[c]));
          dot[r][1] = _mm512_dpbf16_ps(dot[r][1], (__m512bh)high, (__m512bh)_mm512_set1_epi32(pairs[c + 4]));
        }
      }
      const __m512 sc = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i * kTile))));
      const __m512 scale = _mm512_mul_ps(d, sc);
      for (int r = 0; r < R; ++r) {
        const __m512 x_group = _mm512_set1_ps(g.xsum[(m + r) * groups + group]);
        acc[r] = _mm512_fmadd_ps(scale, _mm512_fmadd_ps(minus160, x_group, _mm512_add_ps(dot[r][0], dot[r][1])),
                                 acc[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r] = acc[r];
}

}  // namespace

bool q6k_gemv_available() { return true; }

GemvTiles q6k_tiles(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                    const torch::Tensor& out) {
  return kquant::gemv_tiles(x, codes, scales, {kGroup, kCodeBytes, kScaleBytes},
                            [](const kquant::Gemv& g, int64_t tile, int64_t m, auto rows, __m512* y) {
                              tile_dot<decltype(rows)::value>(g, tile, m, y);
                            },
                            out);
}

torch::Tensor q6k_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales) {
  return kquant::tiled_gemv(x, codes, [&](const torch::Tensor& rows, const torch::Tensor& out) {
    return q6k_tiles(rows, codes, scales, out);
  });
}


TiledWeight q6k_tiled(const torch::Tensor& codes, const torch::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == kCodeBytes &&
                  codes.is_contiguous(),
              "codes: uint8 [N/16, K/16, 192]");
  const int64_t tiles = codes.size(0), K = codes.size(1) * kGroup, blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                  scales.numel() == tiles * blocks * kScaleBytes,
              "scales: uint8 [N/16, K/256, 288]");
  TiledWeight weight{tiles * kTile, K, false, nullptr};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  weight.write = [codes, scales, cp, sp, K, blocks](int64_t tile, const TileSink& sink) {  // the tensors kept alive
    const __m512i nibble = _mm512_set1_epi16(0x000F);
    const uint8_t* codes_of_tile = cp + tile * (K / kGroup) * kCodeBytes;
    const uint8_t* scales_of_tile = sp + tile * blocks * kScaleBytes;
    constexpr int64_t kPairGroups = kBlock / (2 * kGroup);  // a row's 32 weights: two groups of 16 inputs
    // [8 g + p]: dword r the bf16 weights of (row r, group i + g, inputs 2 p, + 1)
    const auto pair_group_weights = [&](int64_t pair_group, __m512i* pairs) __attribute__((always_inline)) {
      const int64_t block = pair_group / kPairGroups, i = pair_group % kPairGroups * 2;
      const uint8_t* s = scales_of_tile + block * kScaleBytes;
      constexpr int64_t kScaleAhead = kquant::kCodePrefetchBytes * kScaleBytes / (kCodeBytes * kBlock / kGroup);
      if (i == 0) kquant::prefetch_ahead(s, kScaleAhead, kScaleBytes);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + kBlock)));
      const uint8_t* w = codes_of_tile + 2 * pair_group * kCodeBytes;
      for (int g = 0; g < 2; ++g, w += kCodeBytes) {
        kquant::prefetch_ahead(w, kquant::kCodePrefetchBytes, kCodeBytes);
        const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + (i + g) * kTile));
        const __m512 scale = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
        const __m512 offset = _mm512_mul_ps(scale, _mm512_set1_ps(32.f));  // w = u * d * sc - 32 d * sc
        const __m512i hi0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 128)));
        const __m512i hi1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 160)));
        for (int c = 0; c < 4; ++c) {
          const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
          pairs[8 * g + c] = kquant::weight_pairs(with_top(_mm512_and_si512(bytes, nibble), hi0, c), scale, offset);
          pairs[8 * g + 4 + c] = kquant::weight_pairs(with_top(_mm512_srli_epi16(bytes, 4), hi1, c), scale, offset);
        }
      }
    };
    kquant::put_groups(sink, K / (2 * kGroup), pair_group_weights);
  };
  return weight;
}

#else

bool q6k_gemv_available() { return false; }

GemvTiles q6k_tiles(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor q6k_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

TiledWeight q6k_tiled(const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

#endif
