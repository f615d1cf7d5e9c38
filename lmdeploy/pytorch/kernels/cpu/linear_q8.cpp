// fp32 y = x @ W.T for steps of a few rows on 8-bit weights, for CPUs with AVX512-BF16: groups of 32 inputs with an
// fp16 scale each, w = q * scale with q in -128..127 (GGUF's Q8_0). The LM head of decode steps (it reads half the
// bytes of an fp16 copy) and a Q8_0 layer's small steps.
//
// Packed weight [N/16, K/32, 32, 16] int8: a tile of 16 rows, one group, input-major, so that one 16-byte load
// widened to fp32 gives one input's weights of 16 rows; scales [N/16, K/32, 16] fp16.
//
// Every product x q is exact in fp32 (bf16 x: 8 by 8 significant bits); a group's products are added in one order,
// an input pair p at a time (its odd input's product, then its even one's) into sum p % 4, and the group's sum
// ((s0 + s1) + (s2 + s3)) times its scale to the output. That order is vdpbf16ps's, so bf16 rows run it there: a
// group's codes become bf16 pairs (exact) once for every row, and one instruction adds a row's pair where fp32 FMAs
// take two. One row alone, bound by reading the codes, runs it in fp32 FMAs instead (the pairs' making costs more
// than it saves there), after x's magnitudes below 2^-100 go to zero: every sum is then a multiple of 2^-107,
// never a denormal, so vdpbf16ps's flushing of denormals changes nothing and both give the same bits. fp32 and fp16
// rows run the FMAs whatever their number. So a row's logits do not depend on the rows beside it (a prompt's output
// on its batch). The codes are asked for ahead of their reading, as the K-quant GEMVs' are. q8_tiled writes the same
// weights in bf16, tile by tile, for larger steps.
#include "gemv_tiles.h"
#include "kquant_gemv.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kTile = 16, kGroup = 32, kPairs = kGroup / 2;

// The 16 rows' codes of one input (16 bytes at w) in fp32.
inline __m512 input_codes(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

// The 16 rows' codes of inputs 2p and 2p + 1 (w: input 2p's 16 bytes, then 2p + 1's) as bf16 pairs, dword r holding
// row r's (even, odd): an integer below 256 in magnitude has 8 significant bits, so its fp32's low half is zero.
inline __m512i code_pairs(const int8_t* w) {
  const __m512i even = _mm512_castps_si512(input_codes(w)), odd = _mm512_castps_si512(input_codes(w + kTile));
  return _mm512_or_si512(_mm512_srli_epi32(even, 16), odd);
}

// A group's sum for one row in fp32 FMAs, in the order above: x the group's 32 inputs, code(k) input k's 16 codes.
template <typename Codes>
inline __m512 group_sum(const float* x, const Codes& code) {
  __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
  for (int p = 0; p < kPairs; ++p) {
    s[p & 3] = _mm512_fmadd_ps(code(2 * p + 1), _mm512_set1_ps(x[2 * p + 1]), s[p & 3]);
    s[p & 3] = _mm512_fmadd_ps(code(2 * p), _mm512_set1_ps(x[2 * p]), s[p & 3]);
  }
  return _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
}

// One tile's 16 fp32 outputs for the M rows of fp32 x [M, K] into out [M, N]: a group's codes are widened once for
// all the rows.
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
      float* y = ot + m * N;
      const __m512 sum = group_sum(x + m * K + group * kGroup, [&](int k) { return codes[k]; });
      _mm512_storeu_ps(y, _mm512_fmadd_ps(scale, sum, _mm512_loadu_ps(y)));
    }
  }
}

// q8_tile for one row, its accumulator kept in a register: batch-1 decode's LM head, which is bound by reading the
// codes, ran 8-12% slower on a shared loop.
void q8_tile_one_row(const float* x, const int8_t* w, const uint16_t* scales, float* out, int64_t tile, int64_t K) {
  const int64_t groups = K / kGroup;
  const int8_t* wt = w + tile * groups * kGroup * kTile;
  const uint16_t* st = scales + tile * groups * kTile;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t group = 0; group < groups; ++group, wt += kGroup * kTile, st += kTile, x += kGroup) {
    kquant::prefetch_ahead(wt, kquant::kCodePrefetchBytes, kGroup * kTile);
    const __m512 sum = group_sum(x, [&](int k) { return input_codes(wt + k * kTile); });
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(st)));
    acc = _mm512_fmadd_ps(scale, sum, acc);
  }
  _mm512_storeu_ps(out + tile * kTile, acc);
}

// q8_tile's sums for the M rows of bf16 x (x [M, K] as dwords of input pairs) on vdpbf16ps: a group's codes become
// pairs once for all the rows. The tile's rows of outputs are summed in this thread's buffer (kept) and written to
// out once at the end, their lines asked for at the start: out's rows lie N floats apart (1 MiB on Gemma 3's table of
// 262,144), so that a tile's rows fall in one set of each cache, and each group's read-modify-write of 64 rows went
// to memory (64 rows on that table: 1.16x the time; docs/performance.md, "One- and two-row prefill steps, and Q8_0's
// LM head at many rows").
void q8_tile_pairs(const int32_t* x, int64_t M, const int8_t* w, const uint16_t* scales, float* out, int64_t tile,
                   int64_t K, int64_t N) {
  const int64_t groups = K / kGroup;
  const int8_t* wt = w + tile * groups * kGroup * kTile;
  const uint16_t* st = scales + tile * groups * kTile;
  float* ot = out + tile * kTile;
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < M * kTile) buffer.resize(M * kTile);
  float* sums = buffer.data();
  for (int64_t m = 0; m < M; ++m) {
    _mm512_storeu_ps(sums + m * kTile, _mm512_setzero_ps());
    __builtin_prefetch(ot + m * N, 1, 3);  // for writing
  }
  for (int64_t group = 0; group < groups; ++group, wt += kGroup * kTile, st += kTile) {
    kquant::prefetch_ahead(wt, kquant::kCodePrefetchBytes, kGroup * kTile);
    __m512i codes[kPairs];
#pragma GCC unroll 16
    for (int p = 0; p < kPairs; ++p) codes[p] = code_pairs(wt + 2 * p * kTile);
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(st)));
    for (int64_t m = 0; m < M; ++m) {
      const int32_t* xg = x + m * (K / 2) + group * kPairs;
      __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
#pragma GCC unroll 16
      for (int p = 0; p < kPairs; ++p)
        s[p & 3] = _mm512_dpbf16_ps(s[p & 3], (__m512bh)codes[p], (__m512bh)_mm512_set1_epi32(xg[p]));
      float* y = sums + m * kTile;
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3]));
      _mm512_storeu_ps(y, _mm512_fmadd_ps(scale, sum, _mm512_loadu_ps(y)));
    }
  }
  for (int64_t m = 0; m < M; ++m) _mm512_storeu_ps(ot + m * N, _mm512_loadu_ps(sums + m * kTile));
}

// bf16 x with magnitudes below 2^-100 (denormals too) set to zero, for q8_tile_pairs and q8_tile_one_row to agree.
inline c10::BFloat16 without_tiny(c10::BFloat16 x) {
  constexpr uint16_t kSmallest = (127 - 100) << 7;  // the bits of 2^-100
  return (x.x & 0x7FFF) < kSmallest ? c10::BFloat16(0.f) : x;
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
  const int8_t* w = packed.data_ptr<int8_t>();
  const auto* s = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  float* o = out.data_ptr<float>();
  const int64_t n = N, k = K;  // clang before 16 captures no structured bindings
  if (x.scalar_type() == at::kBFloat16 && M > 1) {
    auto xb = std::make_shared<std::vector<c10::BFloat16>>(M * K);
    tiles.prepare = [x, xb] {
      const c10::BFloat16* xs = x.data_ptr<c10::BFloat16>();
      for (size_t i = 0; i < xb->size(); ++i) (*xb)[i] = without_tiny(xs[i]);
    };
    tiles.run = [xb, M, w, s, o, k, n](int64_t tile) {
      q8_tile_pairs(reinterpret_cast<const int32_t*>(xb->data()), M, w, s, o, tile, k, n);
    };
    return tiles;
  }
  auto xf = std::make_shared<std::vector<float>>(M * K);
  tiles.prepare = [x, xf] {
    if (x.scalar_type() == at::kBFloat16) {
      const c10::BFloat16* xs = x.data_ptr<c10::BFloat16>();
      for (size_t i = 0; i < xf->size(); ++i) (*xf)[i] = to_float(without_tiny(xs[i]));
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND(at::kHalf, x.scalar_type(), "q8_linear", [&] {
      const scalar_t* xs = x.data_ptr<scalar_t>();
      for (size_t i = 0; i < xf->size(); ++i) (*xf)[i] = to_float(xs[i]);
    });
  };
  if (M == 1) tiles.run = [xf, w, s, o, k](int64_t tile) { q8_tile_one_row(xf->data(), w, s, o, tile, k); };
  else tiles.run = [xf, M, w, s, o, k, n](int64_t tile) { q8_tile(xf->data(), M, w, s, o, tile, k, n); };
  return tiles;
}

torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales) {
  TORCH_CHECK(packed.dim() == 4, "packed: int8 [N/16, K/32, 32, 16]");
  const int64_t N = packed.size(0) * kTile;
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  auto out = empty_output({rows.size(0), N}, x.options().dtype(at::kFloat));
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
    kquant::put_groups(sink, groups, [&](int64_t group, __m512i* pairs) __attribute__((always_inline)) {
      const int8_t* codes = w + (tile * groups + group) * kGroup * kTile;
      const uint16_t* s = sp + (tile * groups + group) * kTile;
      kquant::prefetch_ahead(codes, kquant::kCodePrefetchBytes, kGroup * kTile);
      kquant::prefetch_ahead(s, kquant::kCodePrefetchBytes / kGroup * sizeof(uint16_t), kTile * sizeof(uint16_t));
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
      for (int p = 0; p < kPairs; ++p)  // exact fp32 products, rounded once to bf16
        pairs[p] = kquant::row_pairs(_mm512_mul_ps(input_codes(codes + 2 * p * kTile), scale),
                                     _mm512_mul_ps(input_codes(codes + (2 * p + 1) * kTile), scale));
    });
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
