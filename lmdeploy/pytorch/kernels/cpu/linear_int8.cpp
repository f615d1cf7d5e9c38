// W8A8 GEMM y = (qx @ W.T) * sx * sw (+ b) for CPUs with AVX512-VNNI: int8 weights with one fp32 scale
// per output channel, and activations quantized per token (row) in the same call: sx = amax / 127,
// qx = round(x * 127 / amax), the torch twin's arithmetic (kernels/w8a8.py), so the int32 sums are the
// same. vpdpbusd multiplies unsigned by signed bytes, so the rows are stored as qx + 128 and
// 128 * sum_k W[n, k] (`compensation`, computed once at load) is taken off each column's sum.
// The weight is packed once into 16-column panels of K/4 groups of 4 bytes ([N/16, K/4, 16, 4]): one
// vpdpbusd adds four products to each of 16 columns' int32 accumulators. Tiles of 4 rows x 4 panels
// keep their accumulators in registers over all of K, and each thread takes whole column groups, as
// in linear_bf16.cpp (without its prefetching); the scales and the bias are applied in fp32 in the
// epilogue.
#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)

namespace {

constexpr int kPanel = 16, kPanels = 4, kRows = 4, kRowBlock = 64;

template <typename T>
struct Gemm {
  const uint8_t* x;      // [M, K]: qx + 128
  const float* x_scale;  // [M]
  const int8_t* w;       // packed
  const int32_t* comp;   // [N]
  const float* w_scale;  // [N]
  const float* bias;     // [N] or nullptr
  T* out;                // [M, N]
  int64_t M, K, N;
};

template <typename T>
inline __m512 load16(const T* p, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  }
}

template <typename T>
inline void store16(T* p, __m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(p, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
}

// A division and a product rounded once each, as the torch twin computes them: the build's -ffast-math
// lets the compiler rewrite 127 / amax as 127 * (1 / amax) or reassociate x * (127 / amax), which moves
// products that fall just short of a rounding tie onto it (5.09375 * (127 / 10.1875) is 63.499996 in
// fp32, 63.5 with 127 * (1 / amax)), so that a quantized row would differ from the twin's.
inline float divide(float a, float b) {
  __m128 r = _mm_set_ss(a);
  asm("vdivss %1, %0, %0" : "+v"(r) : "v"(_mm_set_ss(b)));
  return _mm_cvtss_f32(r);
}

inline __m512 multiply(__m512 a, __m512 b) {
  asm("vmulps %1, %0, %0" : "+v"(a) : "v"(b));
  return a;
}

// acc += four u8 x s8 products per lane. With the intrinsic GCC copied every accumulator through other
// registers and the stack on each k step: 0.8x the bf16 GEMM's speed at 64 rows, 1.5x written this way.
inline __m512i dpbusd(__m512i acc, __m512i u8, __m512i s8) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u8), "v"(s8));
  return acc;
}

inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1); }

// Row m of x as qx + 128 (bytes) and its scale sx.
template <typename T>
void quantize_row(const T* x, int64_t K, uint8_t* q, float* scale) {
  __m512 peak = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) peak = _mm512_max_ps(peak, _mm512_abs_ps(load16(x + k, tail_mask(K - k))));
  const float amax = _mm512_reduce_max_ps(peak);
  *scale = divide(amax, 127.f);
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? divide(127.f, amax) : 0.f);
  const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = tail_mask(K - k);
    __m512i v = _mm512_cvtps_epi32(multiply(load16(x + k, mask), inv));  // to nearest, ties to even
    v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, low), high), offset);
    _mm_mask_storeu_epi8(q + k, mask, _mm512_cvtepi32_epi8(v));
  }
}

// Rows [row, row + R) by panels [panel, panel + C).
template <int R, int C, typename T>
void tile(const Gemm<T>& g, int64_t row, int64_t panel) {
  const int64_t quads = g.K / 4, panel_stride = g.K * kPanel;
  const int32_t* x = reinterpret_cast<const int32_t*>(g.x + row * g.K);
  const int8_t* w = g.w + panel * panel_stride;
  __m512i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  for (int64_t k = 0; k < quads; ++k) {
    __m512i cols[C];
    for (int c = 0; c < C; ++c) cols[c] = _mm512_loadu_si512(w + c * panel_stride + k * 4 * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512i quad = _mm512_set1_epi32(x[r * quads + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = dpbusd(acc[r][c], quad, cols[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    const int64_t col = (panel + c) * kPanel;
    const __m512i comp = _mm512_loadu_si512(g.comp + col);
    const __m512 w_scale = _mm512_loadu_ps(g.w_scale + col);
    const __m512 bias = g.bias ? _mm512_loadu_ps(g.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], comp));
      const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(sum, _mm512_set1_ps(g.x_scale[row + r])), w_scale);
      store16(g.out + (row + r) * g.N + col, _mm512_add_ps(scaled, bias));
    }
  }
}

template <int C, typename T>
void row_block(const Gemm<T>& g, int64_t first, int64_t count, int64_t panel) {
  int64_t row = first;
  for (; row + kRows <= first + count; row += kRows) tile<kRows, C>(g, row, panel);
  switch (first + count - row) {
    case 1: tile<1, C>(g, row, panel); break;
    case 2: tile<2, C>(g, row, panel); break;
    case 3: tile<3, C>(g, row, panel); break;
    default: break;
  }
}

// Panels per column group: 4, or 3 where a lone row block's groups of 4 would leave one thread a group
// more than the others (as in linear_bf16.cpp).
int64_t group_width(int64_t panels, int64_t row_blocks, int64_t threads) {
  const auto uneven = [&](int64_t width) { return (panels + width - 1) / width % threads != 0; };
  return row_blocks == 1 && uneven(kPanels) && !uneven(3) ? 3 : kPanels;
}

template <typename T>
void run(const Gemm<T>& g, const T* x, uint8_t* q, float* x_scale) {
  const int64_t threads = at::get_num_threads(), row_blocks = (g.M + kRowBlock - 1) / kRowBlock;
  const int64_t panels = g.N / kPanel, width = group_width(panels, row_blocks, threads);
  const int64_t groups = (panels + width - 1) / width;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < g.M; ++m) quantize_row(x + m * g.K, g.K, q + m * g.K, x_scale + m);
#pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t group = 0; group < groups; ++group)
      for (int64_t block = 0; block < row_blocks; ++block) {
        const int64_t panel = group * width, first = block * kRowBlock;
        const int64_t count = std::min<int64_t>(kRowBlock, g.M - first);
        switch (std::min<int64_t>(width, panels - panel)) {
          case 1: row_block<1>(g, first, count, panel); break;
          case 2: row_block<2>(g, first, count, panel); break;
          case 3: row_block<3>(g, first, count, panel); break;
          default: row_block<4>(g, first, count, panel); break;
        }
      }
  }
}

}  // namespace

bool int8_gemm_available() { return true; }

torch::Tensor pack_int8_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, "expected a 2-D int8 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kPanel == 0 && K % 4 == 0, "the weight needs a multiple of 16 rows and of 4 columns");
  return weight.reshape({N / kPanel, kPanel, K / 4, 4}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& compensation,
                          const torch::Tensor& scale, c10::optional<torch::Tensor> bias) {
  const int64_t K = packed.size(1) * 4, N = packed.size(0) * kPanel;
  TORCH_CHECK(x.size(-1) == K, "x must have ", K, " features");
  TORCH_CHECK(compensation.scalar_type() == at::kInt && compensation.numel() == N, "compensation: int32 [N]");
  const auto rows = x.reshape({-1, K}).contiguous();
  const auto w_scale = contiguous_as(scale, at::kFloat);
  TORCH_CHECK(w_scale.numel() == N, "scale must have ", N, " elements");
  torch::Tensor b;
  if (bias.has_value()) {
    b = contiguous_as(*bias, at::kFloat);
    TORCH_CHECK(b.numel() == N, "bias must have ", N, " elements");
  }
  const int64_t M = rows.size(0);
  // The quantized rows and their scales live in the calling thread's scratch: no allocation per call.
  static thread_local std::vector<float> scratch;
  const int64_t scales = (M + 15) / 16 * 16;
  scratch.resize(scales + (M * K + 3) / 4);
  float* x_scale = scratch.data();
  uint8_t* q = reinterpret_cast<uint8_t*>(scratch.data() + scales);
  auto out = torch::empty({M, N}, x.options());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "int8_linear takes fp32, bf16 or fp16 activations");
    } else {
      const Gemm<scalar_t> g{q, x_scale, packed.data_ptr<int8_t>(),
                             compensation.data_ptr<int32_t>(), w_scale.data_ptr<float>(),
                             b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<scalar_t>(), M, K, N};
      run(g, rows.data_ptr<scalar_t>(), q, x_scale);
    }
  });
  return out.view(shape);
}

#else

bool int8_gemm_available() { return false; }

torch::Tensor pack_int8_weight(const torch::Tensor&) { TORCH_CHECK(false, "built without AVX512-VNNI"); }

torch::Tensor int8_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX512-VNNI");
}

#endif
