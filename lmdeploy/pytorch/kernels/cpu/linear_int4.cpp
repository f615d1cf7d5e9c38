// y = x @ W.T (+ b) for steps of a few rows (batch-1 decode) on 4-bit weights, for CPUs with AVX512-BF16:
// groups of 32 inputs with an fp16 scale and minimum each, w = q * scale + min with q in 0..15 (GGUF's
// Q4_1), bf16 activations used as they are (not quantized).
//
// A 4-bit code q becomes the bf16 number 128 + q by OR-ing it into 0x4300 (bf16 steps by 1 in [128, 256)),
// so one vdpbf16ps multiplies a broadcast pair of x with a pair of 16 rows' codes: the group's sum
// D = sum x (128 + q) is exact products summed in fp32, and the row's share of y is
// scale * (D - 128 X) + min * X with X = sum x over the group (once per row of x).
//
// Packed weight [N/16, K/32, 8, 32] bytes: a tile of 16 rows, one group, 8 chunks; byte j of chunk c
// holds (row j/2, input 2c + j%2) in its low nibble and (row j/2, input 16 + 2c + j%2) in its high one,
// so one 32-byte load widened to 16 bits gives the weights of input pairs c and c + 8. Scales and
// minimums [N/16, K/32, 2, 16] fp16: one cache line per tile and group. With gate_up, tiles alternate
// gate and up rows and the call returns silu(gate) * up.
//
// GGUF's Q4_K (q4k_linear) runs on the same codes: per block of 256 inputs an fp16 d and dmin and, per group of
// 32, 6-bit sc and m, w = q * d * sc - dmin * m. Its scales [N/16, K/256, 256] bytes per tile and block: the 16
// rows' d (fp16), their dmin, then the 12 bytes that pack sc and m (as the file holds them) byte by byte, 16 rows
// each: 0.0625 bytes a weight, as in the file (against 0.125 for an fp16 scale and minimum per group). A group
// takes d * sc and dmin * m (exact in fp32) for its scale and minus its minimum. q4k_tiled writes the same
// weights in bf16, tile by tile, for larger steps (dequantized_linear.h; no other copy is kept).

#include "gemv_tiles.h"
#include "kquant_gemv.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kTile = 16, kGroup = 32, kGroupBytes = kTile * kGroup / 2;

constexpr int64_t kBlock = 256, kBlockScaleBytes = 256;  // Q4_K

struct Gemv {
  const c10::BFloat16* x;  // [M, K]
  const float* xsum;       // [M, K / 32]
  const uint8_t* w;
  const uint16_t* scales;  // fp16 bits (Q4_K: its scale bytes)
  c10::BFloat16* out;      // [M, N] (gate_up: [M, N / 2])
  int64_t M, K, N;
};

// sum over the group's 32 inputs of x (128 + q), for the 16 rows of a tile, into d (four partial sums).
template <int R>
inline void group_dot(const uint8_t* w, const int32_t* const* pairs, int64_t group, __m512 (*d)[4]) {
  const __m512i nibble = _mm512_set1_epi16(0x000F), offset = _mm512_set1_epi16(0x4300);
  for (int r = 0; r < R; ++r) d[r][0] = d[r][1] = d[r][2] = d[r][3] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
    const __m512i low = _mm512_ternarylogic_epi32(bytes, nibble, offset, 0xEA);  // (bytes & 15) | 0x4300
    const __m512i high = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), offset);
    for (int r = 0; r < R; ++r) {
      const int32_t* p = pairs[r] + group * (kGroup / 2);
      d[r][c & 1] = _mm512_dpbf16_ps(d[r][c & 1], (__m512bh)low, (__m512bh)_mm512_set1_epi32(p[c]));
      d[r][2 + (c & 1)] = _mm512_dpbf16_ps(d[r][2 + (c & 1)], (__m512bh)high, (__m512bh)_mm512_set1_epi32(p[c + 8]));
    }
  }
}

// x @ W.T of one tile's 16 rows for the R rows of x from m, in fp32: each 32-byte chunk of codes is widened
// once for all R rows (prefill steps), and every row's sums run in the same order whatever R is. With kQ4K
// each group's scale and minimum (negated) come from its Q4_K block's scale bytes.
template <int R, bool kQ4K>
inline void tile_dot(const Gemv& g, int64_t tile, int64_t m, __m512* y) {
  const int64_t groups = g.K / kGroup;
  const uint8_t* w = g.w + tile * groups * kGroupBytes;
  const uint16_t* sm = g.scales + tile * groups * 2 * kTile;
  const uint8_t* s = reinterpret_cast<const uint8_t*>(g.scales) + tile * (g.K / kBlock) * kBlockScaleBytes;
  const int32_t* pairs[R];
  const float* xsum[R];
  for (int r = 0; r < R; ++r) {
    pairs[r] = reinterpret_cast<const int32_t*>(g.x + (m + r) * g.K);
    xsum[r] = g.xsum + (m + r) * groups;
  }
  const __m512 minus128 = _mm512_set1_ps(-128.f);
  __m512 acc[R], acc_min[R];
  alignas(64) float block_scales[8][2][kTile];  // Q4_K: the block's eight groups' scales and minimums
  for (int r = 0; r < R; ++r) acc[r] = acc_min[r] = _mm512_setzero_ps();
  for (int64_t group = 0; group < groups; ++group, w += kGroupBytes, sm += 2 * kTile) {
    kquant::prefetch_ahead(w, kquant::kCodePrefetchBytes, kGroupBytes);
    if constexpr (kQ4K) {
      if (group % 8 == 0) {  // decoded once per block, outside the loop over codes: 25% faster at one row
        kquant::prefetch_ahead(s + group / 8 * kBlockScaleBytes, kquant::kCodePrefetchBytes / 8, kBlockScaleBytes);
        for (int64_t j = 0; j < 8; ++j) {
          __m512 scale, minimum;
          kquant::scale_min(s + group / 8 * kBlockScaleBytes, j, scale, minimum);
          _mm512_store_ps(block_scales[j][0], scale);
          _mm512_store_ps(block_scales[j][1], minimum);
        }
      }
    }
    __m512 d[R][4];
    group_dot<R>(w, pairs, group, d);
    __m512 scale, minimum;
    if constexpr (kQ4K) {
      scale = _mm512_load_ps(block_scales[group % 8][0]);
      minimum = _mm512_load_ps(block_scales[group % 8][1]);
    } else {
      kquant::prefetch_ahead(sm, kquant::kCodePrefetchBytes / 4, 2 * kTile * sizeof(uint16_t));
      scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm)));
      minimum = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm + kTile)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(d[r][0], d[r][1]), _mm512_add_ps(d[r][2], d[r][3]));
      const __m512 x_group = _mm512_set1_ps(xsum[r][group]);
      acc[r] = _mm512_fmadd_ps(scale, _mm512_fmadd_ps(minus128, x_group, sum), acc[r]);
      acc_min[r] = _mm512_fmadd_ps(minimum, x_group, acc_min[r]);
    }
  }
  for (int r = 0; r < R; ++r) y[r] = kQ4K ? _mm512_sub_ps(acc[r], acc_min[r]) : _mm512_add_ps(acc[r], acc_min[r]);
}

inline __m512 silu_mul(__m512 gate, __m512 up) {
  const __m512 sigmoid = _mm512_rcp14_ps(_mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(),
                                                                                               gate))));
  return _mm512_mul_ps(_mm512_mul_ps(gate, sigmoid), up);
}

// The rows of x from m, R of them, through one unit (a tile; gate_up: a gate tile and its up tile).
template <int R, bool kQ4K>
void unit_rows(const Gemv& g, const float* bias, bool gate_up, int64_t unit, int64_t m, int64_t width) {
  __m512 y[R];
  if (gate_up) {
    __m512 up[R];
    tile_dot<R, kQ4K>(g, 2 * unit, m, y);
    tile_dot<R, kQ4K>(g, 2 * unit + 1, m, up);
    for (int r = 0; r < R; ++r) y[r] = silu_mul(y[r], up[r]);
  } else {
    tile_dot<R, kQ4K>(g, unit, m, y);
    if (bias)
      for (int r = 0; r < R; ++r) y[r] = _mm512_add_ps(y[r], _mm512_loadu_ps(bias + unit * kTile));
  }
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(g.out + (m + r) * width + unit * kTile), to_bf16(y[r]));
}

// Unit `unit` (a tile; gate_up: a gate tile and its up tile) for every row of x.
template <bool kQ4K>
void unit_all_rows(const Gemv& g, const float* bias, bool gate_up, int64_t unit) {
  constexpr int64_t kRows = 4;  // rows of x sharing each widened chunk of codes
  const int64_t width = gate_up ? g.N / 2 : g.N;
  int64_t m = 0;
  for (; m + kRows <= g.M; m += kRows) unit_rows<kRows, kQ4K>(g, bias, gate_up, unit, m, width);
  for (; m < g.M; ++m) unit_rows<1, kQ4K>(g, bias, gate_up, unit, m, width);
}

torch::Tensor int4_call(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                        c10::optional<torch::Tensor> bias, bool gate_up, bool q4k) {
  TORCH_CHECK(packed.dim() == 4, "packed: uint8 [N/16, K/32, 8, 32] from pack_int4_weight");
  const int64_t N = packed.size(0) * kTile, width = gate_up ? N / 2 : N;
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  auto out = torch::empty({rows.size(0), width}, x.options());
  run_tiles(int4_tiles(rows, packed, scales, bias, gate_up, q4k, out));
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = width;
  return out.view(shape);
}

}  // namespace

bool int4_gemv_available() { return true; }

GemvTiles int4_tiles(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                     const c10::optional<torch::Tensor>& bias, bool gate_up, bool q4k, const torch::Tensor& out) {
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kByte && packed.size(2) == 8 && packed.size(3) == 32,
              "packed: uint8 [N/16, K/32, 8, 32] from pack_int4_weight");
  const int64_t N = packed.size(0) * kTile, K = packed.size(1) * kGroup, groups = K / kGroup;
  if (q4k) {
    TORCH_CHECK(K % kBlock == 0 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                    scales.numel() == N / kTile * (K / kBlock) * kBlockScaleBytes,
                "scales: uint8 [N/16, K/256, 256]");
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() &&
                    scales.numel() == N / kTile * groups * 32,
                "scales: fp16 [N/16, K/32, 2, 16]");
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(1) == K, "x: bf16 [..., ", K, "]");
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  TORCH_CHECK(!gate_up || (N % (2 * kTile) == 0 && !bias.has_value()), "gate_up: pairs of tiles, no bias");
  const int64_t M = x.size(0), width = gate_up ? N / 2 : N;
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.is_contiguous() && out.numel() == M * width,
              "out: bf16 [M, ", width, "]");
  torch::Tensor b;
  if (bias.has_value()) {
    b = contiguous_as(*bias, at::kFloat);
    TORCH_CHECK(b.numel() == N, "bias must have ", N, " elements");
  }
  auto xsum = std::make_shared<std::vector<float>>(M * groups);
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const Gemv g{xp, xsum->data(), packed.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr()),
               out.data_ptr<c10::BFloat16>(), M, K, N};
  GemvTiles tiles;
  tiles.units = gate_up ? N / kTile / 2 : N / kTile;
  tiles.prepare = [xp, xsum] { group_sums(xp, *xsum, kGroup); };
  tiles.run = [g, b, gate_up, q4k](int64_t unit) {
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    if (q4k) unit_all_rows<true>(g, bp, gate_up, unit);
    else unit_all_rows<false>(g, bp, gate_up, unit);
  };
  return tiles;
}

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          c10::optional<torch::Tensor> bias) {
  return int4_call(x, packed, scales, bias, false, false);
}

torch::Tensor int4_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  return int4_call(x, packed, scales, c10::nullopt, true, false);
}

torch::Tensor q4k_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                         c10::optional<torch::Tensor> bias) {
  return int4_call(x, packed, scales, bias, false, true);
}

torch::Tensor q4k_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  return int4_call(x, packed, scales, c10::nullopt, true, true);
}

TiledWeight q4k_tiled(const torch::Tensor& packed, const torch::Tensor& scales, bool gate_up) {
  return kquant::k_tiles<kGroupBytes>(packed, scales, gate_up, [](const uint8_t* w, __m512i* u) {
    const __m512i nibble = _mm512_set1_epi16(15);
    for (int c = 0; c < 8; ++c) {
      const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
      u[c] = _mm512_and_si512(bytes, nibble);
      u[8 + c] = _mm512_srli_epi16(bytes, 4);
    }
  });
}

#else

bool int4_gemv_available() { return false; }

GemvTiles int4_tiles(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                     const c10::optional<torch::Tensor>&, bool, bool, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor int4_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor int4_gate_up_silu(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor q4k_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                         c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor q4k_gate_up_silu(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

TiledWeight q4k_tiled(const torch::Tensor&, const torch::Tensor&, bool) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

#endif
