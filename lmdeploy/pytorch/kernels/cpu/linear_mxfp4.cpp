// y = x @ W.T (fp32) on MXFP4 weights as gpt-oss checkpoints hold them, for CPUs with AVX-512: blocks
// [N, K/32, 16] uint8 whose byte j holds the FP4 e2m1 codes of inputs 2j (low nibble) and 2j + 1 (high nibble)
// of its block of 32, and scales [N, K/32] uint8 (e8m0): w = e2m1(code) * 2^(scale - 127). x in fp32 or bf16,
// used as it is (not quantized): 0.53 bytes a weight against 2 for a bf16 copy.
//
// Lanes run along the inputs: a block's 16 bytes widen to 16 int32 lanes, vpermps looks up the low and the
// high nibble in a table of the 16 e2m1 values (it reads only an index's low 4 bits), each times the block's
// scale (a power of two: exact), and those weights of the block's even and odd inputs meet x's, laid out so
// once per call. Every product is the one fp32 dequantize-then-matmul forms; only the order of the sums differs.
// Larger steps (mxfp4_dequantized_linear) dequantize tiles of 16 rows into the bf16 GEMM's panels
// (mxfp4_tiled, dequantized_linear.h).
#include <ATen/ops/linear.h>

#include "common.h"
#include "kquant_gemv.h"

#if defined(__AVX512F__)

namespace {

constexpr int64_t kBlock = 32, kBlockBytes = 16;
constexpr float kE2m1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// 2^(s - 127) for every e8m0 byte (s = 0: the subnormal 2^-127, s = 255: NaN as OCP defines it).
struct ScaleTable {
  float value[256];
  ScaleTable() {
    for (int s = 0; s < 255; ++s) value[s] = std::ldexp(1.f, s - 127);
    value[255] = std::numeric_limits<float>::quiet_NaN();
  }
};
const ScaleTable kScales;

struct Mxfp4Gemv {
  const float* x;  // [M, K / 32, 32]: each block's 16 even inputs, then its 16 odd ones
  const uint8_t* blocks;
  const uint8_t* scales;
  int64_t M, K, N;
};

// The block's weights of its even and odd inputs, in fp32.
inline void block_weights(const uint8_t* w, uint8_t scale, __m512 lut, __m512* even, __m512* odd) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m512 s = _mm512_set1_ps(kScales.value[scale]);
  *even = _mm512_mul_ps(_mm512_permutexvar_ps(bytes, lut), s);
  *odd = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), lut), s);
}

// Rows n and n + 1 (C = 2) or row n (C = 1) of W times the R rows of x from m, into out.
template <int R, int C>
inline void rows_dot(const Mxfp4Gemv& g, int64_t n, int64_t m, float* out) {
  const int64_t blocks = g.K / kBlock;
  const __m512 lut = _mm512_loadu_ps(kE2m1);
  __m512 acc[C][R][2];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r][0] = acc[c][r][1] = _mm512_setzero_ps();
  // Prefetching the rows after the next ones halved a cold expert's time (1.9 to 1.05 ms for gpt-oss-20b's
  // gate-and-up, one thread, the time it takes from the cache): the decoding keeps too few loads in flight.
  const uint8_t* ahead = g.blocks + (n + 2 * C) * blocks * kBlockBytes;
  const bool prefetch = n + 3 * C <= g.N;
  for (int64_t b = 0; b < blocks; ++b) {
    if (prefetch && b % 2 == 0)
      for (int c = 0; c < C; ++c)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + (c * blocks + b) * kBlockBytes), _MM_HINT_T0);
    for (int c = 0; c < C; ++c) {
      __m512 even, odd;
      block_weights(g.blocks + ((n + c) * blocks + b) * kBlockBytes, g.scales[(n + c) * blocks + b], lut, &even,
                    &odd);
      for (int r = 0; r < R; ++r) {
        const float* xr = g.x + (m + r) * g.K + b * kBlock;
        acc[c][r][0] = _mm512_fmadd_ps(even, _mm512_loadu_ps(xr), acc[c][r][0]);
        acc[c][r][1] = _mm512_fmadd_ps(odd, _mm512_loadu_ps(xr + 16), acc[c][r][1]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      out[(m + r) * g.N + n + c] = _mm512_reduce_add_ps(_mm512_add_ps(acc[c][r][0], acc[c][r][1]));
}

template <int C>
inline void rows_all(const Mxfp4Gemv& g, int64_t n, float* out) {
  constexpr int64_t kRows = 4;  // rows of x sharing each block's weights
  int64_t m = 0;
  for (; m + kRows <= g.M; m += kRows) rows_dot<kRows, C>(g, n, m, out);
  for (; m < g.M; ++m) rows_dot<1, C>(g, n, m, out);
}

template <typename T>
std::vector<float> deinterleave(const T* x, int64_t M, int64_t K) {
  std::vector<float> out(M * K);
  for (int64_t i = 0; i < M * K / kBlock; ++i)
    for (int64_t j = 0; j < kBlock / 2; ++j) {
      out[i * kBlock + j] = to_float(x[i * kBlock + 2 * j]);
      out[i * kBlock + kBlock / 2 + j] = to_float(x[i * kBlock + 2 * j + 1]);
    }
  return out;
}

void check_weights(const torch::Tensor& blocks, const torch::Tensor& scales) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.scalar_type() == at::kByte && blocks.size(2) == kBlockBytes &&
                  blocks.is_contiguous(),
              "blocks: uint8 [N, K/32, 16]");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                  scales.size(0) == blocks.size(0) && scales.size(1) == blocks.size(1),
              "scales: uint8 [N, K/32]");
}

}  // namespace

bool mxfp4_gemv_available() { return true; }

torch::Tensor mxfp4_linear(const torch::Tensor& x, const torch::Tensor& blocks, const torch::Tensor& scales) {
  check_weights(blocks, scales);
  const int64_t N = blocks.size(0), K = blocks.size(1) * kBlock;
  TORCH_CHECK(x.size(-1) == K && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: fp32 or bf16 [..., ", K, "]");
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0);
  const std::vector<float> xd = x.scalar_type() == at::kFloat ? deinterleave(rows.data_ptr<float>(), M, K)
                                                              : deinterleave(rows.data_ptr<c10::BFloat16>(), M, K);
  auto out = torch::empty({M, N}, x.options().dtype(at::kFloat));
  const Mxfp4Gemv g{xd.data(), blocks.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(), M, K, N};
  float* o = out.data_ptr<float>();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t pair = 0; pair < N / 2; ++pair) rows_all<2>(g, 2 * pair, o);
  if (N % 2) rows_all<1>(g, N - 1, o);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

torch::Tensor mxfp4_dequantize(const torch::Tensor& blocks, const torch::Tensor& scales, at::ScalarType dtype) {
  check_weights(blocks, scales);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantizes to fp32 or bf16");
  const int64_t N = blocks.size(0), count = N * blocks.size(1);
  auto out = torch::empty({N, blocks.size(1) * kBlock}, blocks.options().dtype(dtype));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const uint8_t* s = scales.data_ptr<uint8_t>();
  // output lanes 2j and 2j + 1 from even lane j and odd lane j (the odd ones indexed from 16)
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t i = 0; i < count; ++i) {
    __m512 even, odd;
    block_weights(w + i * kBlockBytes, s[i], _mm512_loadu_ps(kE2m1), &even, &odd);
    const __m512 low = _mm512_permutex2var_ps(even, first, odd), high = _mm512_permutex2var_ps(even, second, odd);
    if (dtype == at::kFloat) {
      float* o = out.data_ptr<float>() + i * kBlock;
      _mm512_storeu_ps(o, low);
      _mm512_storeu_ps(o + 16, high);
    } else {  // the values fit bf16 exactly: its top 16 bits
      uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()) + i * kBlock;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(low), 16)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(high), 16)));
    }
  }
  return out;
}

#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)

TiledWeight mxfp4_tiled(const torch::Tensor& blocks, const torch::Tensor& scales) {
  check_weights(blocks, scales);
  const int64_t N = blocks.size(0), K = blocks.size(1) * kBlock;
  TORCH_CHECK(N % kquant::kTileRows == 0, "tiles of 16 rows: N a multiple of 16, not ", N);
  TiledWeight weight{N, K, false, nullptr};
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  weight.write = [blocks, scales, bp, sp, K](int64_t tile, const TileSink& sink) {  // the tensors kept alive
    const int64_t count = K / kBlock;
    const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    const __m512 lut = _mm512_loadu_ps(kE2m1);
    // row r's 32 weights at [r], then dword r of [p] row r's input pair p
    kquant::put_groups(sink, count, [&](int64_t b, __m512i* pairs) __attribute__((always_inline)) {
      for (int64_t r = 0; r < kquant::kTileRows; ++r) {
        const int64_t i = (tile * kquant::kTileRows + r) * count + b;
        __m512 even, odd;
        block_weights(bp + i * kBlockBytes, sp[i], lut, &even, &odd);
        const auto top_half = [](__m512 v) {  // exact in bf16: its top 16 bits
          return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
        };
        pairs[r] = _mm512_inserti64x4(_mm512_castsi256_si512(top_half(_mm512_permutex2var_ps(even, first, odd))),
                                      top_half(_mm512_permutex2var_ps(even, second, odd)), 1);
      }
      kquant::transpose16(pairs);
    });
  };
  return weight;
}

#else

TiledWeight mxfp4_tiled(const torch::Tensor&, const torch::Tensor&) { TORCH_CHECK(false, "built without AVX512-BF16"); }

#endif

torch::Tensor mxfp4_dequantized_linear(const torch::Tensor& x, const torch::Tensor& blocks,
                                       const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias) {
  if (x.scalar_type() == at::kBFloat16 && dequantizing_gemm_available() && blocks.size(0) % 16 == 0)
    return bf16_dequantizing_linear(x, mxfp4_tiled(blocks, scales), bias);
  return at::linear(x, mxfp4_dequantize(blocks, scales, x.scalar_type()), bias);
}

#if !defined(__AVX512F__)

bool mxfp4_gemv_available() { return false; }

torch::Tensor mxfp4_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX-512");
}

torch::Tensor mxfp4_dequantize(const torch::Tensor&, const torch::Tensor&, at::ScalarType) {
  TORCH_CHECK(false, "built without AVX-512");
}

#endif
