// W8A8 GEMM y = (qx @ W.T) * sx * sw (+ b) for CPUs with AVX512-VNNI: int8 weights with one fp32 scale
// per output channel, and activations quantized per token (row) in the same call: sx = amax / 127,
// qx = round(x * 127 / amax), the torch twin's arithmetic (kernels/w8a8.py), so the int32 sums are the
// same. vpdpbusd multiplies unsigned by signed bytes, so the rows are stored as qx + 128 and
// 128 * sum_k W[n, k] (`compensation`, computed once at load) is taken off each column's sum.
// The weight is packed once into 16-column panels of K/4 groups of 4 bytes ([N/16, K/4, 16, 4]): one
// vpdpbusd adds four products to each of 16 columns' int32 accumulators. Tiles of 4 (or 6) rows x 4 (or
// 3) panels keep their accumulators in registers over all of K, and each thread takes whole column
// groups; a lone row block (decode steps) takes 6-row tiles and, from 8 rows on, prefetches a column
// group ahead, as in linear_bf16.cpp. The scales and the bias are applied in fp32 in the epilogue. The gate and up
// projections of an MLP can apply SiLU-and-mul there too (int8_gate_up_silu, panels alternating gate
// and up), with silu_and_mul's roundings of the GEMM's output.
#include "common.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)

namespace {

constexpr int kPanel = 16, kPanels = 4, kRowBlock = 64;
// How many column groups ahead a lone row block prefetches (linear_bf16.cpp's choice).
constexpr int kAhead = 2;
// Steps of fewer rows do not prefetch: 1-2 rows measured about 10% slower with it.
constexpr int kPrefetchRows = 8;

template <typename T>
struct Gemm {
  const uint8_t* x;      // [M, K]: qx + 128
  const float* x_scale;  // [M]
  const int8_t* w;       // packed
  const int32_t* comp;   // [N]
  const float* w_scale;  // [N]
  const float* bias;     // [N] or nullptr
  T* out;                // [M, N], or [M, N / 2] with silu
  int64_t M, K, N;
  bool silu;  // panels alternate gate and up (pack_int8_gate_up): out = silu(gate) * up
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

// x rounded to T and back, as a GEMM output written in T is.
template <typename T>
inline __m512 round_to(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
  } else {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
}

// silu(gate) * up with silu_and_mul's roundings, gate and up first rounded as GEMM outputs in T.
template <typename T>
inline __m512 silu_times(__m512 gate, __m512 up) {
  const __m512 g = round_to<T>(gate);
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_mul_ps(round_to<T>(silu), round_to<T>(up));
}

// Where the weights of a column group ahead are prefetched to: nowhere, L2, or L1.
enum class Pull { kNone, kL2, kL1 };

// That group's cache lines still to prefetch, `rate` of them per k step in 1/65536ths.
struct NextGroup {
  const char* line;
  uint32_t rate;
};

// Rows [row, row + R) by panels [panel, panel + C); with silu the fp32 results go to `stage`.
template <int R, int C, Pull P, typename T>
void tile(const Gemm<T>& g, int64_t row, int64_t panel, NextGroup& next, float* stage) {
  const int64_t quads = g.K / 4, panel_stride = g.K * kPanel;
  const int32_t* x = reinterpret_cast<const int32_t*>(g.x + row * g.K);
  const int8_t* w = g.w + panel * panel_stride;
  __m512i acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
  uint32_t due = 0;
  for (int64_t k = 0; k < quads; ++k) {
    if constexpr (P != Pull::kNone)
      for (due += next.rate; due >= 65536; due -= 65536, next.line += 64)
        _mm_prefetch(next.line, P == Pull::kL1 ? _MM_HINT_T0 : _MM_HINT_T1);
    __m512i cols[C];
    for (int c = 0; c < C; ++c) cols[c] = _mm512_loadu_si512(w + c * panel_stride + k * 4 * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512i quad = _mm512_set1_epi32(x[r * quads + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = dpbusd(acc[r][c], quad, cols[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    // With silu the panels alternate gate and up, while compensation, scales and bias keep gate then up.
    const int64_t p = panel + c, col = g.silu ? (p % 2) * (g.N / 2) + p / 2 * kPanel : p * kPanel;
    const __m512i comp = _mm512_loadu_si512(g.comp + col);
    const __m512 w_scale = _mm512_loadu_ps(g.w_scale + col);
    const __m512 bias = g.bias ? _mm512_loadu_ps(g.bias + col) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], comp));
      const __m512 scaled = _mm512_mul_ps(_mm512_mul_ps(sum, _mm512_set1_ps(g.x_scale[row + r])), w_scale);
      const __m512 y = _mm512_add_ps(scaled, bias);
      if (g.silu)
        _mm512_storeu_ps(stage + (r * C + c) * kPanel, y);
      else
        store16(g.out + (row + r) * g.N + col, y);
    }
  }
}

template <int C, Pull P, typename T>
void row_block(const Gemm<T>& g, int64_t first, int64_t count, int64_t panel, int64_t width) {
  constexpr int R = P == Pull::kNone ? 4 : 6;
  NextGroup next{reinterpret_cast<const char*>(g.w + (panel + kAhead * C) * g.K * kPanel), 0};
  if constexpr (P != Pull::kNone) {
    const int64_t next_panels = std::max<int64_t>(0, std::min<int64_t>(width, g.N / kPanel - panel - kAhead * C));
    const int64_t tiles = (count + R - 1) / R;
    next.rate = static_cast<uint32_t>((next_panels * g.K * kPanel / 64 << 16) / (tiles * (g.K / 4)));
  }
  alignas(64) float stage[kRowBlock * kPanels * kPanel];
  int64_t row = first;
  for (; row + R <= first + count; row += R) tile<R, C, P>(g, row, panel, next, stage + (row - first) * C * kPanel);
  float* rest = stage + (row - first) * C * kPanel;
  switch (first + count - row) {
    case 1: tile<1, C, P>(g, row, panel, next, rest); break;
    case 2: tile<2, C, P>(g, row, panel, next, rest); break;
    case 3: tile<3, C, P>(g, row, panel, next, rest); break;
    case 4: tile<4, C, P>(g, row, panel, next, rest); break;
    case 5: tile<5, C, P>(g, row, panel, next, rest); break;
    default: break;
  }
  if (!g.silu) return;
  for (int64_t r = 0; r < count; ++r)
    for (int c = 0; c + 1 < C; c += 2)
      store16(g.out + (first + r) * (g.N / 2) + (panel + c) / 2 * kPanel,
              silu_times<T>(_mm512_loadu_ps(stage + (r * C + c) * kPanel),
                            _mm512_loadu_ps(stage + (r * C + c + 1) * kPanel)));
}

template <int C, typename T>
void row_block(const Gemm<T>& g, int64_t first, int64_t count, int64_t panel, int64_t width, Pull pull) {
  switch (pull) {
    case Pull::kNone: return row_block<C, Pull::kNone>(g, first, count, panel, width);
    case Pull::kL2: return row_block<C, Pull::kL2>(g, first, count, panel, width);
    case Pull::kL1: return row_block<C, Pull::kL1>(g, first, count, panel, width);
  }
}

// Panels per column group: 4, or 3 where a lone row block's groups of 4 would leave one thread a group
// more than the others (as in linear_bf16.cpp); with silu an even number, so that gate and up pair up.
int64_t group_width(int64_t panels, int64_t row_blocks, int64_t threads, bool silu) {
  const auto uneven = [&](int64_t width) { return (panels + width - 1) / width % threads != 0; };
  return row_blocks == 1 && !silu && uneven(kPanels) && !uneven(3) ? 3 : kPanels;
}

template <typename T>
void run(const Gemm<T>& g, const T* x, uint8_t* q, float* x_scale) {
  const int64_t threads = at::get_num_threads(), row_blocks = (g.M + kRowBlock - 1) / kRowBlock;
  const int64_t panels = g.N / kPanel, width = group_width(panels, row_blocks, threads, g.silu);
  const Pull pull = row_blocks > 1 || g.M < kPrefetchRows ? Pull::kNone : g.M > 20 ? Pull::kL1 : Pull::kL2;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < g.M; ++m) quantize_row(x + m * g.K, g.K, q + m * g.K, x_scale + m);
    for_each_tile(g.M, panels, width, kRowBlock, [&](auto panels_in_group, int64_t first, int64_t count,
                                                     int64_t panel) {
      row_block<decltype(panels_in_group)::value>(g, first, count, panel, width, pull);
    });
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

torch::Tensor pack_int8_gate_up(const torch::Tensor& weight) {
  return pack_int8_weight(interleave_gate_up(weight, kPanel));
}

namespace {

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& compensation,
                     const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias, bool silu) {
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
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = silu ? N / 2 : N;
  auto out = torch::empty({M, shape.back()}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "int8_linear takes fp32, bf16 or fp16 activations");
    } else {
      const Gemm<scalar_t> g{q, x_scale, packed.data_ptr<int8_t>(),
                             compensation.data_ptr<int32_t>(), w_scale.data_ptr<float>(),
                             b.defined() ? b.data_ptr<float>() : nullptr, out.data_ptr<scalar_t>(), M, K, N, silu};
      run(g, rows.data_ptr<scalar_t>(), q, x_scale);
    }
  });
  return out.view(shape);
}

}  // namespace

torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& compensation,
                          const torch::Tensor& scale, c10::optional<torch::Tensor> bias) {
  return linear(x, packed, compensation, scale, bias, false);
}

torch::Tensor int8_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& compensation,
                                const torch::Tensor& scale, c10::optional<torch::Tensor> bias) {
  return linear(x, packed, compensation, scale, bias, true);
}

#else

bool int8_gemm_available() { return false; }

torch::Tensor pack_int8_weight(const torch::Tensor&) { TORCH_CHECK(false, "built without AVX512-VNNI"); }

torch::Tensor pack_int8_gate_up(const torch::Tensor&) { TORCH_CHECK(false, "built without AVX512-VNNI"); }

torch::Tensor int8_linear(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX512-VNNI");
}

torch::Tensor int8_gate_up_silu(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                const torch::Tensor&, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "built without AVX512-VNNI");
}

#endif
