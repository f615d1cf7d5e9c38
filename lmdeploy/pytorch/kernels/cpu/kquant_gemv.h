// What the GGUF K-quant GEMVs share (Q4_K in linear_int4.cpp, Q5_K in linear_q5k.cpp, Q6_K in linear_q6k.cpp), for
// CPUs with AVX512-BF16: tiles of 16 weight rows, the 6-bit scales and mins of Q4_K/Q5_K, the loop that runs
// a file's per-tile dot product over every tile and row of x, and the writing of a tile's weights in bf16 for
// larger steps (kquant_tiles, dequantized_linear.h).
#pragma once
#include "gemv_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <type_traits>

namespace kquant {

constexpr int64_t kTileRows = 16;

// How far ahead of the bytes it reads a GEMV's tile, or a tile written in bf16 for larger steps, asks for its codes
// (and scales): a batch-1 step reads each weight once, and with the hardware prefetcher alone the arithmetic and the
// memory's latency took turns (Q4_K and Q6_K GEMVs over weights not in cache ran at ~6 GB/s on a machine that reads
// 15 GB/s on one thread; without it the writers' steps of 3 to 16 rows took 1.08-1.25x as long).
constexpr int64_t kCodePrefetchBytes = 4096;

// Asks for the `bytes` (whole cache lines) that lie `distance` bytes past p, into L1; never faults.
inline void prefetch_ahead(const void* p, int64_t distance, int64_t bytes) {
  const char* ahead = static_cast<const char*>(p) + distance;
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
}

// Byte b of the 16 rows' packed 6-bit Q4_K/Q5_K scales and mins (after the rows' fp16 d and dmin), a row a lane.
inline __m512i scale_bytes(const uint8_t* s, int64_t b) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 4 * kTileRows + kTileRows * b)));
}

// The 16 rows' d * sc and dmin * m of group j of a Q4_K/Q5_K block (scale bytes s), as llama.cpp's
// get_scale_min_k4 reads sc and m; exact in fp32 (an fp16 times a 6-bit integer).
inline void scale_min(const uint8_t* s, int64_t j, __m512& scale, __m512& minimum) {
  const __m512i low6 = _mm512_set1_epi32(63), low4 = _mm512_set1_epi32(15), top2 = _mm512_set1_epi32(0xC0);
  __m512i sc, mn;
  if (j < 4) {
    sc = _mm512_and_si512(scale_bytes(s, j), low6);
    mn = _mm512_and_si512(scale_bytes(s, j + 4), low6);
  } else {
    const __m512i extra = scale_bytes(s, j + 4);
    sc = _mm512_or_si512(_mm512_and_si512(extra, low4),
                         _mm512_srli_epi32(_mm512_and_si512(scale_bytes(s, j - 4), top2), 2));
    mn = _mm512_or_si512(_mm512_srli_epi32(extra, 4), _mm512_srli_epi32(_mm512_and_si512(scale_bytes(s, j), top2), 2));
  }
  scale = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))),
                        _mm512_cvtepi32_ps(sc));
  minimum = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 2 * kTileRows))),
                          _mm512_cvtepi32_ps(mn));
}

// Two vectors of the 16 rows' weights (lane r: row r), of inputs 2p and 2p + 1, rounded to bf16 pairs, dword r
// holding row r's (even, odd): lanes 0-15 of cvtne2ps_pbh(odd, even) hold even's rows, 16-31 odd's, so lane 2r
// takes r and lane 2r + 1 takes 16 + r.
inline __m512i row_pairs(__m512 even, __m512 odd) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

// The bf16 weights u * scale - offset of a chunk's 32 16-bit codes u (dword r: row r's input pair, the even input's
// code in its low half), dword r holding row r's pair; scale and offset a row a lane. One rounding: the fused
// multiply-subtract is exact where u * scale and the offset are, then rounded to bf16. The codes stay in their
// dwords (no widening across lanes): one permutation of the rounded pairs puts each row's two weights together.
inline __m512i weight_pairs(__m512i codes, __m512 scale, __m512 offset) {
  const __m512 even = _mm512_cvtepi32_ps(_mm512_and_si512(codes, _mm512_set1_epi32(0xFFFF)));
  const __m512 odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 16));
  return row_pairs(_mm512_fmsub_ps(even, scale, offset), _mm512_fmsub_ps(odd, scale, offset));
}

// The 16 x 16 dwords of v transposed in place: v[i] lane j becomes v[j] lane i.
inline void transpose16(__m512i* v) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {
    v[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
    v[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
    v[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
    v[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
  }
  for (int k = 0; k < 2; ++k) {
    for (int i = 0; i < 4; ++i) {
      t[8 * k + i] = _mm512_shuffle_i32x4(v[8 * k + i], v[8 * k + 4 + i], 0x88);
      t[8 * k + 4 + i] = _mm512_shuffle_i32x4(v[8 * k + i], v[8 * k + 4 + i], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0x88);
    v[8 + i] = _mm512_shuffle_i32x4(t[i], t[8 + i], 0xdd);
  }
}

// A tile's 32 inputs from k0 into a packed panel, or transposed into rows of W, from pairs[p] (dword r: row r's
// input pair p).
inline void put_pairs(const TileSink& sink, __m512i* pairs, int64_t k0) {
  if (sink.packed) {
    for (int p = 0; p < 16; ++p) _mm512_storeu_si512(sink.out + (k0 + 2 * p) * kTileRows, pairs[p]);
    return;
  }
  transpose16(pairs);
  for (int64_t row = 0; row < kTileRows; ++row) _mm512_storeu_si512(sink.out + row * sink.K + k0, pairs[row]);
}

// The R rows' sums of a tile (sink.rows == R) over its `groups` groups of 32 inputs, kept in registers over the whole
// tile: one vdpbf16ps a pair, in order of k, as a packed panel's tile adds them. Handed group by group through
// sink.sums, each group's chain waited on the last one's store and load and the pairs went through the stack (one
// and two rows now 0.89-0.99x the time: docs/performance.md, "One- and two-row prefill steps").
template <int R, typename Group>
__attribute__((always_inline)) inline void sum_groups(const TileSink& sink, int64_t groups, const Group& group) {
  const int32_t* x = reinterpret_cast<const int32_t*>(sink.x);
  const int64_t pairs_a_row = sink.K / 2;
  __m512 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm512_loadu_ps(sink.sums + r * kTileRows);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i pairs[16];
    group(g, pairs);
    for (int r = 0; r < R; ++r) {
      const int32_t* xg = x + r * pairs_a_row + g * 16;
#pragma GCC unroll 16  // pairs stay in registers: indexed by a variable they would go through the stack
      for (int p = 0; p < 16; ++p)
        sum[r] = _mm512_dpbf16_ps(sum[r], (__m512bh)_mm512_set1_epi32(xg[p]), (__m512bh)pairs[p]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(sink.sums + r * kTileRows, sum[r]);
}

// A tile's weights into its sink, `groups` groups of 32 inputs: group(g, pairs) writes group g's 16 vectors of bf16
// pairs (dword r: row r's input pair 16 g + p at [p]). Into the sums of one or two rows of x (sink.rows, at most
// two), as they are into a packed panel, or into the panel, or transposed into rows of W.
template <typename Group>
inline void put_groups(const TileSink& sink, int64_t groups, const Group& group) {
  if (sink.rows == 1) return sum_groups<1>(sink, groups, group);
  if (sink.rows == 2) return sum_groups<2>(sink, groups, group);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i pairs[16];
    group(g, pairs);
    put_pairs(sink, pairs, g * 32);
  }
}

// W [N, K] of Q4_K/Q5_K-style tiles: codes [N/16, K/32, code_bytes] and scales [N/16, K/256, 256] (per tile and
// block the 16 rows' d, dmin, then the 12 bytes of sc and m, 16 rows a byte). group_codes(w, u) writes the 16-bit
// codes of a tile's group (its code bytes w) into u[8 h + c]: lane j the code of (row j / 2, input 16 h + 2 c +
// j % 2).
template <int64_t code_bytes, typename GroupCodes>
TiledWeight k_tiles(const torch::Tensor& codes, const torch::Tensor& scales, bool gate_up,
                    const GroupCodes& group_codes) {
  constexpr int64_t kGroup = 32, kBlock = 256, kScaleBytes = 256;
  TORCH_CHECK(codes.dim() >= 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == codes.size(0) * codes.size(1) * code_bytes,
              "codes: uint8 [N/16, K/32, ", code_bytes, " bytes]");
  const int64_t tiles = codes.size(0), K = codes.size(1) * kGroup, blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                  scales.numel() == tiles * blocks * kScaleBytes,
              "scales: uint8 [N/16, K/256, 256]");
  TORCH_CHECK(!gate_up || tiles % 2 == 0, "gate_up: pairs of tiles");
  TiledWeight weight{tiles * kTileRows, K, gate_up, nullptr};
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  weight.write = [codes, scales, cp, sp, K, blocks, group_codes](int64_t tile, const TileSink& sink) {
    const uint8_t* w = cp + tile * (K / kGroup) * code_bytes;  // (codes and scales: kept alive)
    const uint8_t* s = sp + tile * blocks * kScaleBytes;
    put_groups(sink, K / kGroup, [&](int64_t g, __m512i* pairs) __attribute__((always_inline)) {
      const int64_t block = g / (kBlock / kGroup), j = g % (kBlock / kGroup);
      const uint8_t* bs = s + block * kScaleBytes;
      if (j == 0) prefetch_ahead(bs, kCodePrefetchBytes * kScaleBytes / (code_bytes * kBlock / kGroup), kScaleBytes);
      prefetch_ahead(w + g * code_bytes, kCodePrefetchBytes, code_bytes);
      __m512 scale, minimum;
      scale_min(bs, j, scale, minimum);
      // codes, then dword r the bf16 weights of (row r, inputs 16 h + 2 c, + 1) at [8 h + c]
      group_codes(w + g * code_bytes, pairs);
#pragma GCC unroll 16
      for (int p = 0; p < 16; ++p) pairs[p] = weight_pairs(pairs[p], scale, minimum);
    });
  };
  return weight;
}

struct Gemv {
  const c10::BFloat16* x;  // [M, K]
  const float* xsum;       // [M, K / group]
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t M, K, N;
};

// How a file's codes and scales are tiled: codes [N/16, K/group, code_bytes], scales [N/16, K/256, scale_bytes].
struct Tiling {
  int64_t group, code_bytes, scale_bytes;
};

// The tiles of x @ W.T in fp32 (out [M, N]) for bf16 x [M, K]: tile_dot(g, tile, m, rows, y) writes into y[0..R)
// the 16 outputs of tile `tile` for the R = rows::value rows of x from m; four rows share each widened chunk of
// codes while they last, then one at a time.
template <typename TileDot>
GemvTiles gemv_tiles(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                     const Tiling& tiling, const TileDot& tile_dot, const torch::Tensor& out) {
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == tiling.code_bytes &&
                  codes.is_contiguous(),
              "codes: uint8 [N/16, K/", tiling.group, ", ", tiling.code_bytes, "]");
  const int64_t N = codes.size(0) * kTileRows, K = codes.size(1) * tiling.group;
  TORCH_CHECK(K % 256 == 0 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                  scales.numel() == N / kTileRows * (K / 256) * tiling.scale_bytes,
              "scales: uint8 [N/16, K/256, ", tiling.scale_bytes, "]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K, "x: bf16 [..., ", K, "]");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  const int64_t M = x.size(0);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == M * N, "out: fp32 [M, N]");
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  auto xsum = std::make_shared<std::vector<float>>(M * (K / tiling.group));
  const Gemv g{xp, xsum->data(), codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), M, K, N};
  float* o = out.data_ptr<float>();
  GemvTiles tiles;
  tiles.units = N / kTileRows;
  tiles.fp32_out = true;
  tiles.prepare = [xp, xsum, group = tiling.group] { group_sums(xp, *xsum, group); };
  tiles.run = [g, o, tile_dot, xsum](int64_t tile) {
    const auto tile_rows = [&](int64_t m, auto count) {
      constexpr int R = decltype(count)::value;
      __m512 y[R];
      tile_dot(g, tile, m, count, y);
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(o + (m + r) * g.N + tile * kTileRows, y[r]);
    };
    constexpr int kRows = 4;
    int64_t m = 0;
    for (; m + kRows <= g.M; m += kRows) tile_rows(m, std::integral_constant<int, kRows>{});
    for (; m < g.M; ++m) tile_rows(m, std::integral_constant<int, 1>{});
  };
  return tiles;
}

// x @ W.T in fp32 ([..., N]) for bf16 x [..., K] on its own parallel region: make_tiles(x [M, K], out [M, N]) gives
// the kernel's tiles.
template <typename MakeTiles>
torch::Tensor tiled_gemv(const torch::Tensor& x, const torch::Tensor& codes, const MakeTiles& make_tiles) {
  TORCH_CHECK(codes.dim() == 3, "codes: uint8 [N/16, K/group, code bytes]");
  const int64_t N = codes.size(0) * kTileRows;
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  auto out = empty_output({rows.size(0), N}, x.options().dtype(at::kFloat));
  run_tiles(make_tiles(rows, out));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

}  // namespace kquant

#endif
