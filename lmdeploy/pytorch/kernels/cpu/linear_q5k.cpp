// y = x @ W.T (fp32) on GGUF Q5_K weights as the file holds them, for CPUs with AVX512-BF16: per block of 256
// inputs an fp16 d and dmin and, per group of 32, 6-bit sc and m (as Q4_K), 5-bit codes u (0..31),
// w = u * d * sc - dmin * m; bf16 activations used as they are (not quantized). Q5_K_M files and the attn_qkv
// of Qwen3.5's Q4_K_M: 0.69 bytes a weight, as in the file, against 2 for a bf16 copy.
//
// As in linear_int4.cpp, a code u becomes the bf16 number 128 + u (exact: bf16 steps by 1 in [128, 256)) by
// OR-ing it into 0x4300, so one vdpbf16ps multiplies a broadcast pair of x with a pair of 16 rows' codes; a
// group of 32 inputs adds d * sc * (D - 128 X) - dmin * m * X with D = sum x (128 + u), X = sum x over the
// group (d * sc and dmin * m are exact in fp32).
//
// Codes [N/16, K/32, 320] bytes, a tile of 16 rows and a group of 32 inputs: 8 chunks of 32 bytes as the int4
// GEMV's (byte j of chunk c: the low 4 bits of (row j/2, input 2c + j%2) in its low nibble, of (row j/2,
// input 16 + 2c + j%2) in its high one), then 32 uint16 whose lane j holds in bit c the fifth bit of the low
// nibble's weight of chunk c and in bit 8 + c the high one's. Scales [N/16, K/256, 256] bytes as q4k_linear's:
// per tile and block the 16 rows' d (fp16), their dmin, then the file's 12 bytes of sc and m, 16 rows a byte.
//
// q5k_tiled writes the same weights in bf16, tile by tile, for larger steps (no bf16 copy is kept).
#include "kquant_gemv.h"
#include "linear_q5k.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kTile = 16, kGroup = 32, kBlock = 256, kCodeBytes = 320, kScaleBytes = 256;

// `low` (0x4300 | low 4 bits) with bit `bit` of `top` moved to bit 4.
inline __m512i with_fifth(__m512i low, __m512i top, int bit) {
  const __m512i moved = bit <= 4 ? _mm512_slli_epi16(top, 4 - bit) : _mm512_srli_epi16(top, bit - 4);
  return _mm512_ternarylogic_epi32(low, moved, _mm512_set1_epi16(0x0010), 0xF8);  // low | (moved & 0x10)
}

// x @ W.T of one tile's 16 rows for the R rows of x from m, in fp32; every row's sums run in the same order
// whatever R is.
template <int R>
inline void tile_dot(const kquant::Gemv& g, int64_t tile, int64_t m, __m512* y) {
  const int64_t groups = g.K / kGroup, blocks = g.K / kBlock;
  const uint8_t* w = g.codes + tile * groups * kCodeBytes;
  const uint8_t* s = g.scales + tile * blocks * kScaleBytes;
  const __m512i nibble = _mm512_set1_epi16(0x000F), offset = _mm512_set1_epi16(0x4300);
  const __m512 minus128 = _mm512_set1_ps(-128.f);
  __m512 acc[R], acc_min[R];
  for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = _mm512_setzero_ps();
  for (int64_t block = 0; block < blocks; ++block, s += kScaleBytes) {
    kquant::prefetch_ahead(s, kquant::kCodePrefetchBytes * kScaleBytes / (kCodeBytes * kBlock / kGroup), kScaleBytes);
    alignas(64) float scales[8][2][kTile];  // decoded once per block, outside the loop over codes
    for (int64_t j = 0; j < 8; ++j) {
      __m512 scale, minimum;
      kquant::scale_min(s, j, scale, minimum);
      _mm512_store_ps(scales[j][0], scale);
      _mm512_store_ps(scales[j][1], minimum);
    }
    for (int64_t j = 0; j < kBlock / kGroup; ++j, w += kCodeBytes) {
      kquant::prefetch_ahead(w, kquant::kCodePrefetchBytes, kCodeBytes);
      const int64_t group = block * (kBlock / kGroup) + j;
      const __m512i top = _mm512_loadu_si512(w + 8 * 32);
      __m512 dot[R][2];
      for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c) {
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
        const __m512i low = with_fifth(_mm512_ternarylogic_epi32(bytes, nibble, offset, 0xEA), top, c);
        const __m512i high = with_fifth(_mm512_or_si512(_mm512_srli_epi16(bytes, 4), offset), top, 8 + c);
        for (int r = 0; r < R; ++r) {
          const int32_t* pairs = reinterpret_cast<const int32_t*>(g.x + (m + r) * g.K + group * kGroup);
          dot[r][0] = _mm512_dpbf16_ps(dot[r][0], (__m512bh)low, (__m512bh)_mm512_set1_epi32(pairs[c]));
          dot[r][1] = _mm512_dpbf16_ps(dot[r][1], (__m512bh)high, (__m512bh)_mm512_set1_epi32(pairs[c + 8]));
        }
      }
      const __m512 scale = _mm512_load_ps(scales[j][0]), minimum = _mm512_load_ps(scales[j][1]);
      for (int r = 0; r < R; ++r) {
        const __m512 x_group = _mm512_set1_ps(g.xsum[(m + r) * groups + group]);
        acc[r] = _mm512_fmadd_ps(scale, _mm512_fmadd_ps(minus128, x_group, _mm512_add_ps(dot[r][0], dot[r][1])),
                                 acc[r]);
        acc_min[r] = _mm512_fmadd_ps(minimum, x_group, acc_min[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_sub_ps(acc[r], acc_min[r]);
}

}  // namespace

bool q5k_gemv_available() { return true; }

GemvTiles q5k_tiles(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                    const torch::Tensor& out) {
  return kquant::gemv_tiles(x, codes, scales, {kGroup, kCodeBytes, kScaleBytes},
                            [](const kquant::Gemv& g, int64_t tile, int64_t m, auto rows, __m512* y) {
                              tile_dot<decltype(rows)::value>(g, tile, m, y);
                            },
                            out);
}

torch::Tensor q5k_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales) {
  return kquant::tiled_gemv(x, codes, [&](const torch::Tensor& rows, const torch::Tensor& out) {
    return q5k_tiles(rows, codes, scales, out);
  });
}

TiledWeight q5k_tiled(const torch::Tensor& codes, const torch::Tensor& scales) {
  return kquant::k_tiles<kCodeBytes>(codes, scales, false, [](const uint8_t* w, __m512i* u) {
    const __m512i top = _mm512_loadu_si512(w + 8 * 32), nibble = _mm512_set1_epi16(15);
    for (int c = 0; c < 8; ++c) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
      u[c] = with_fifth(_mm512_and_si512(bytes, nibble), top, c);
      u[8 + c] = with_fifth(_mm512_srli_epi16(bytes, 4), top, 8 + c);
    }
  });
}

#else

bool q5k_gemv_available() { return false; }

GemvTiles q5k_tiles(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

TiledWeight q5k_tiled(const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor q5k_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

#endif
