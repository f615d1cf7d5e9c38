// bf16 GEMM y = x @ W.T (+ b) for CPUs with AVX512-BF16 but no AMX, where it runs at 80-85% of the
// vdpbf16ps peak from 8 rows up (oneDNN: 40-80%). The weight is packed once into 16-column panels of
// K/2 bf16 pairs ([N/16, K/2, 16, 2]): one vdpbf16ps multiplies a broadcast pair of x with a pair of
// each of 16 columns. A tile of 4 (or 6) rows x 4 (or 3) panels keeps its fp32 accumulators in
// registers over all of K; each thread takes whole column groups, so every weight byte is read from
// memory once a call. With few rows (decode steps) a lone row block would wait for its weights to
// stream from memory, so its tiles also prefetch a column group ahead, spread over their k steps.
// The gate and up projections of an MLP can apply SiLU-and-mul in the epilogue (bf16_gate_up_silu):
// tiles stage their fp32 results, and one pass per row block applies it, so the tiles' k loops never
// wait on the exp's long dependency chain. Larger steps of block-quantized weights run the same tiles on panels
// each thread dequantizes in cache (bf16_dequantizing_linear, dequantized_linear.h): bit for bit this GEMM on the
// packed dequantized weight. Steps of one or two rows skip the panels: each tile's weights go straight into the
// rows' sums in the same order (run_dequantizing_few).
#include <ATen/cpu/Utils.h>
#include <ATen/ops/constant_pad_nd.h>

#include "common.h"

#if defined(__AVX512BF16__)

namespace {

using bf16 = c10::BFloat16;
constexpr int kPanel = 16, kPanels = 4, kRowBlock = 64;
// How many column groups ahead a lone row block prefetches: two measured 4-7% faster than one at
// 8-24 rows (30 cold layers), the same at 64.
constexpr int kAhead = 2;

struct Gemm {
  const bf16* x;     // [M, K]
  const bf16* w;     // packed
  const bf16* bias;  // [outputs] or nullptr
  bf16* out;         // [M, outputs], or [M, N / 2] with silu
  int64_t M, K, N;
  bool gate_up;     // panels alternate gate and up (pack_bf16_gate_up): out is [gate; up] columns
  bool silu;        // with gate_up: out = silu(gate) * up
  // The columns written (and biased): the first `outputs` of the N, or with gate_up the first outputs / 2 of the
  // gate's N / 2 and of the up's (zero rows pad each half to whole panels).
  int64_t outputs;
};

constexpr __mmask16 kAllLanes = 0xFFFF;

// The lanes of panel p that hold one of the written columns.
inline __mmask16 live_lanes(const Gemm& g, int64_t p) {
  const int64_t live = g.gate_up ? g.outputs / 2 - p / 2 * kPanel : g.outputs - p * kPanel;
  return live >= kPanel ? kAllLanes : live <= 0 ? __mmask16(0) : __mmask16((1u << live) - 1);
}

// The first output column of panel p: panels alternating gate and up hold [gate; up]'s columns.
inline int64_t first_column(const Gemm& g, int64_t p) {
  return g.gate_up ? (p % 2) * (g.outputs / 2) + p / 2 * kPanel : p * kPanel;
}

inline __m512 round_to_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}

// silu(gate) * up with silu_and_mul's roundings, gate and up first rounded as a bf16 GEMM output.
inline __m256i silu_times(__m512 gate, __m512 up) {
  const __m512 g = round_to_bf16(gate);
  const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
  __m512 inv = _mm512_rcp14_ps(d);  // 1 / d to 2^-14, and to about 2^-28 after one Newton step
  inv = _mm512_fmadd_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(1.f)), inv);
  const __m512 silu = _mm512_mul_ps(g, inv);
  return to_bf16(_mm512_mul_ps(round_to_bf16(silu), round_to_bf16(up)));
}

// Panel p's bias in fp32 (zeros without one), its lanes' `lanes` loaded.
inline __m512 panel_bias(const Gemm& g, int64_t p, __mmask16 lanes) {
  const bf16* b = g.bias ? g.bias + first_column(g, p) : nullptr;
  const __m256i raw = !b                  ? _mm256_setzero_si256()
                      : lanes == kAllLanes ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))
                                           : _mm256_maskz_loadu_epi16(lanes, b);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Row `row`'s outputs of panel p, rounded to bf16, into out (its lanes `lanes` only).
inline void store_outputs(const Gemm& g, int64_t row, int64_t p, __mmask16 lanes, __m512 sums) {
  bf16* out = g.out + row * g.outputs + first_column(g, p);
  if (lanes == kAllLanes)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), to_bf16(sums));
  else
    _mm256_mask_storeu_epi16(out, lanes, to_bf16(sums));
}

// Where the weights of a column group ahead are prefetched to: nowhere, L2, or L1 (measured best above
// 20 rows, when each k step needs less than one line).
enum class Pull { kNone, kL2, kL1 };

// That group's cache lines still to prefetch, `rate` of them per k step in 1/65536ths.
struct NextGroup {
  const char* line;
  uint32_t rate;
};

// Rows [row, row + R) by panels [panel, panel + C), whose packed weights start at w.
template <int R, int C, Pull P>
void tile(const Gemm& g, const bf16* w, int64_t row, int64_t panel, NextGroup& next, float* stage) {
  const int64_t pairs = g.K / 2, panel_stride = g.K * kPanel;
  const int32_t* x = reinterpret_cast<const int32_t*>(g.x + row * g.K);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  uint32_t due = 0;
  for (int64_t k = 0; k < pairs; ++k) {
    if constexpr (P != Pull::kNone)
      for (due += next.rate; due >= 65536; due -= 65536, next.line += 64)
        _mm_prefetch(next.line, P == Pull::kL1 ? _MM_HINT_T0 : _MM_HINT_T1);
    __m512bh cols[C];
    for (int c = 0; c < C; ++c) cols[c] = (__m512bh)_mm512_loadu_si512(w + c * panel_stride + k * 2 * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(x[r * pairs + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, cols[c]);
    }
  }
  __m512 bias[C];
  __mmask16 lanes[C];  // masked loads and stores only where padding rows fill part of the panel
  for (int c = 0; c < C; ++c) {
    lanes[c] = live_lanes(g, panel + c);
    bias[c] = panel_bias(g, panel + c, lanes[c]);
  }
  if (g.silu) {  // staged; row_block applies SiLU-and-mul once the row block is done
    for (int c = 0; c < C; ++c)
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(stage + (r * C + c) * kPanel, _mm512_add_ps(acc[r][c], bias[c]));
    return;
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) store_outputs(g, row + r, panel + c, lanes[c], _mm512_add_ps(acc[r][c], bias[c]));
}

// Tiles of 6 rows read the weights from L2 a third less often, which pays while the weights stream
// from memory (a lone row block); with many row blocks 4-row tiles measured faster.
template <int C, Pull P>
void row_block(const Gemm& g, const bf16* w, int64_t first, int64_t count, int64_t panel, int64_t width) {
  constexpr int R = P == Pull::kNone ? 4 : 6;
  NextGroup next{nullptr, 0};
  if constexpr (P != Pull::kNone) {
    next.line = reinterpret_cast<const char*>(g.w + (panel + kAhead * C) * g.K * kPanel);
    const int64_t next_panels = std::max<int64_t>(0, std::min<int64_t>(width, g.N / kPanel - panel - kAhead * C));
    const int64_t tiles = (count + R - 1) / R;
    next.rate = static_cast<uint32_t>((next_panels * g.K * kPanel * 2 / 64 << 16) / (tiles * (g.K / 2)));
  }
  alignas(64) float stage[kRowBlock * kPanels * kPanel];
  int64_t row = first;
  for (; row + R <= first + count; row += R) tile<R, C, P>(g, w, row, panel, next, stage + (row - first) * C * kPanel);
  float* rest = stage + (row - first) * C * kPanel;
  switch (first + count - row) {
    case 1: tile<1, C, P>(g, w, row, panel, next, rest); break;
    case 2: tile<2, C, P>(g, w, row, panel, next, rest); break;
    case 3: tile<3, C, P>(g, w, row, panel, next, rest); break;
    case 4: tile<4, C, P>(g, w, row, panel, next, rest); break;
    case 5: tile<5, C, P>(g, w, row, panel, next, rest); break;
    default: break;
  }
  if (!g.silu) return;
  for (int c = 0; c + 1 < C; c += 2) {
    const __mmask16 lanes = live_lanes(g, panel + c);
    for (int64_t r = 0; r < count; ++r) {
      bf16* out = g.out + (first + r) * (g.outputs / 2) + (panel + c) / 2 * kPanel;
      const __m256i product = silu_times(_mm512_loadu_ps(stage + (r * C + c) * kPanel),
                                         _mm512_loadu_ps(stage + (r * C + c + 1) * kPanel));
      if (lanes == kAllLanes)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), product);
      else
        _mm256_mask_storeu_epi16(out, lanes, product);
    }
  }
}

template <int C>
void row_block(const Gemm& g, int64_t first, int64_t count, int64_t panel, int64_t width, Pull pull) {
  const bf16* w = g.w + panel * g.K * kPanel;
  switch (pull) {
    case Pull::kNone: return row_block<C, Pull::kNone>(g, w, first, count, panel, width);
    case Pull::kL2: return row_block<C, Pull::kL2>(g, w, first, count, panel, width);
    case Pull::kL1: return row_block<C, Pull::kL1>(g, w, first, count, panel, width);
  }
}

// Panels per column group: 4, or 3 where a lone row block's groups of 4 would leave one thread a
// group more than the other (576 columns: 9 groups of 4, but 12 of 3).
int64_t group_width(const Gemm& g, int64_t row_blocks, int64_t threads) {
  const int64_t panels = g.N / kPanel;
  const auto uneven = [&](int64_t width) { return (panels + width - 1) / width % threads != 0; };
  return row_blocks == 1 && !g.silu && uneven(kPanels) && !uneven(3) ? 3 : kPanels;
}

void run(const Gemm& g) {
  const int64_t threads = at::get_num_threads(), row_blocks = (g.M + kRowBlock - 1) / kRowBlock;
  const int64_t panels = g.N / kPanel, width = group_width(g, row_blocks, threads);
  const Pull pull = row_blocks > 1 ? Pull::kNone : g.M > 20 ? Pull::kL1 : Pull::kL2;
#pragma omp parallel num_threads(threads)
  for_each_tile(g.M, panels, width, kRowBlock, [&](auto panels_in_group, int64_t first, int64_t count,
                                                   int64_t panel) {
    row_block<decltype(panels_in_group)::value>(g, first, count, panel, width, pull);
  });
}

// Up to this many rows of x a tile's weights go straight into the rows' sums (TileSink's rows), a tile a task:
// no panel written and read back, and a narrow weight's tiles shared by every thread. A tile's sums are one chain
// of vdpbf16ps a row (the GEMM's order), where the panels' tiles run four: 3 and 4 rows measured mixed, 6 and 8
// slower than the panels (docs/batch_invariance.md, "A few rows straight into their sums").
constexpr int64_t kFewRows = 2;

// The rows of x through a weight whose tiles each thread dequantizes into the rows' sums, in the GEMM's order.
void run_dequantizing_few(const Gemm& g, const TiledWeight& weight) {
  const int64_t threads = at::get_num_threads(), panels = g.N / kPanel;
#pragma omp parallel for schedule(dynamic, 1) num_threads(std::min(threads, panels))
  for (int64_t panel = 0; panel < panels; ++panel) {
    alignas(64) float sums[kFewRows * kPanel];
    std::fill(sums, sums + g.M * kPanel, 0.f);
    weight.write(panel, TileSink{nullptr, g.K, false, g.x, g.M, sums});
    const __m512 bias = panel_bias(g, panel, kAllLanes);
    for (int64_t r = 0; r < g.M; ++r)
      store_outputs(g, r, panel, kAllLanes, _mm512_add_ps(_mm512_load_ps(sums + r * kPanel), bias));
  }
}

// The rows of x through a weight that each thread dequantizes a column group at a time into its panels (the
// rows' tiles need the whole group): groups of kPanels panels, K * 128 bytes (256 KB at K = 2048) that stay in L2
// while every row block reads them.
void run_dequantizing(const Gemm& g, const TiledWeight& weight) {
  if (g.M <= kFewRows) return run_dequantizing_few(g, weight);
  const int64_t threads = at::get_num_threads(), panels = g.N / kPanel;
  const int64_t groups = (panels + kPanels - 1) / kPanels, panel_size = g.K * kPanel;
#pragma omp parallel num_threads(threads)
  {
    thread_local std::vector<bf16> buffer;  // kept: fresh pages each call would cost their first touch
    if (static_cast<int64_t>(buffer.size()) < kPanels * panel_size) buffer.resize(kPanels * panel_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t group = 0; group < groups; ++group) {
      const int64_t panel = group * kPanels, width = std::min<int64_t>(kPanels, panels - panel);
      for (int64_t c = 0; c < width; ++c) weight.write(panel + c, TileSink{buffer.data() + c * panel_size, g.K, true});
      for (int64_t first = 0; first < g.M; first += kRowBlock) {
        const int64_t count = std::min<int64_t>(kRowBlock, g.M - first);
        switch (width) {
          case 1: row_block<1, Pull::kNone>(g, buffer.data(), first, count, panel, width); break;
          case 2: row_block<2, Pull::kNone>(g, buffer.data(), first, count, panel, width); break;
          case 3: row_block<3, Pull::kNone>(g, buffer.data(), first, count, panel, width); break;
          default: row_block<4, Pull::kNone>(g, buffer.data(), first, count, panel, width); break;
        }
      }
    }
  }
}

}  // namespace

bool bf16_gemm_available() { return true; }

torch::Tensor pack_bf16_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "expected a 2-D bf16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kPanel == 0 && K % 2 == 0, "the weight needs a multiple of 16 rows and an even width");
  return weight.reshape({N / kPanel, kPanel, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

torch::Tensor pack_bf16_gate_up(const torch::Tensor& weight) {
  return pack_bf16_weight(interleave_gate_up(weight, kPanel));
}

namespace {

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, c10::optional<torch::Tensor> bias,
                     bool silu, c10::optional<int64_t> outputs) {
  const int64_t K = packed.size(1) * 2, N = packed.size(0) * kPanel, n = outputs.value_or(N);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && (x.size(-1) == K || x.size(-1) == K - 1), "x must be bf16 with ",
              K, " features (or ", K - 1, ": a weight of an odd K is packed with a zero column)");
  if (silu) {
    TORCH_CHECK(n % 2 == 0 && n / 2 > N / 2 - kPanel && n / 2 <= N / 2, "the gate's and the up's ", N / 2 / kPanel,
                " panels each hold ", N / 2 - kPanel + 1, " to ", N / 2, " outputs, not ", n / 2);
  } else {
    TORCH_CHECK(n > N - kPanel && n <= N, "the weight's ", N / kPanel, " panels hold ", N - kPanel + 1, " to ", N,
                " outputs, not ", n);
  }
  auto rows = x.reshape({-1, x.size(-1)});
  if (rows.size(1) < K) rows = at::constant_pad_nd(rows, {0, 1});  // the zero column's input: exact
  rows = rows.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = silu ? n / 2 : n;
  auto out = empty_output({rows.size(0), shape.back()}, x.options());
  torch::Tensor b;
  if (bias.has_value()) {
    b = contiguous_as(*bias, at::kBFloat16);
    TORCH_CHECK(b.numel() == n, "bias must have ", n, " elements");
  }
  run(Gemm{rows.data_ptr<bf16>(), packed.data_ptr<bf16>(), b.defined() ? b.data_ptr<bf16>() : nullptr,
           out.data_ptr<bf16>(), rows.size(0), K, N, silu, silu, n});
  return out.view(shape);
}

}  // namespace

torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, c10::optional<torch::Tensor> bias,
                          c10::optional<int64_t> outputs) {
  return linear(x, packed, bias, false, outputs);
}

torch::Tensor bf16_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, c10::optional<torch::Tensor> bias,
                                c10::optional<int64_t> outputs) {
  return linear(x, packed, bias, true, outputs);
}

bool dequantizing_gemm_available() {
  static const bool without_amx = [] {
    const auto capabilities = at::cpu::get_cpu_capabilities();
    const auto amx = capabilities.find("amx_tile");
    return amx == capabilities.end() || !amx->second.toBool();
  }();
  return without_amx;
}

torch::Tensor bf16_dequantizing_linear(const torch::Tensor& x, const TiledWeight& weight,
                                       const c10::optional<torch::Tensor>& bias) {
  const int64_t K = weight.K, N = weight.N;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.size(-1) == K, "x must be bf16 with ", K, " features");
  TORCH_CHECK(N % kPanel == 0 && K % 2 == 0, "the weight needs a multiple of 16 rows and an even width");
  const auto rows = x.reshape({-1, K}).contiguous();
  auto out = empty_output({rows.size(0), N}, x.options());
  torch::Tensor b;
  if (bias.has_value()) {
    b = contiguous_as(*bias, at::kBFloat16);
    TORCH_CHECK(b.numel() == N, "bias must have ", N, " elements");
  }
  run_dequantizing(Gemm{rows.data_ptr<bf16>(), nullptr, b.defined() ? b.data_ptr<bf16>() : nullptr,
                        out.data_ptr<bf16>(), rows.size(0), K, N, weight.gate_up, false, N},
                   weight);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

#else

bool bf16_gemm_available() { return false; }

torch::Tensor pack_bf16_weight(const torch::Tensor&) { TORCH_CHECK(false, "built without AVX512-BF16"); }

torch::Tensor pack_bf16_gate_up(const torch::Tensor&) { TORCH_CHECK(false, "built without AVX512-BF16"); }

torch::Tensor bf16_linear(const torch::Tensor&, const torch::Tensor&, c10::optional<torch::Tensor>,
                          c10::optional<int64_t>) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

torch::Tensor bf16_gate_up_silu(const torch::Tensor&, const torch::Tensor&, c10::optional<torch::Tensor>,
                                c10::optional<int64_t>) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

bool dequantizing_gemm_available() { return false; }

torch::Tensor bf16_dequantizing_linear(const torch::Tensor&, const TiledWeight&, const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "built without AVX512-BF16");
}

#endif
