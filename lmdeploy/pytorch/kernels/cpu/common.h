// Shared by the native CPU kernels: headers and the element conversions to fp32.
#pragma once

#include "dequantized_linear.h"
#include "torch_headers.h"
#include <ATen/Parallel.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// t as a contiguous tensor of `dtype`; no dispatcher call when it already is one (most calls).
inline torch::Tensor contiguous_as(const torch::Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype && t.is_contiguous() ? t : t.to(dtype).contiguous();
}

// A [gate; up] weight with its gate and up panels of `panel` rows alternating, as the fused gate/up GEMMs
// (bf16 and int8) read it.
inline torch::Tensor interleave_gate_up(const torch::Tensor& weight, int64_t panel) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) % (2 * panel) == 0, "expected gate and up of a multiple of ",
              panel, " rows each");
  const int64_t N = weight.size(0), K = weight.size(1);
  return weight.reshape({2, N / 2 / panel, panel, K}).transpose(0, 1).reshape({N, K});
}

// Hands out a GEMM's tiles one at a time (in the engine the main thread's share of a static split kept
// finishing last): groups of `width` panels times blocks of `row_block` of the M rows. Runs
// tile(std::integral_constant<int, C>, first row, rows, first panel), C the group's panels (1-4). Call it
// inside an OpenMP parallel region.
template <typename Tile>
void for_each_tile(int64_t M, int64_t panels, int64_t width, int64_t row_block, const Tile& tile) {
  const int64_t groups = (panels + width - 1) / width, row_blocks = (M + row_block - 1) / row_block;
#pragma omp for collapse(2) schedule(dynamic, 1)
  for (int64_t group = 0; group < groups; ++group)
    for (int64_t block = 0; block < row_blocks; ++block) {
      const int64_t panel = group * width, first = block * row_block;
      const int64_t count = std::min<int64_t>(row_block, M - first);
      switch (std::min<int64_t>(width, panels - panel)) {
        case 1: tile(std::integral_constant<int, 1>{}, first, count, panel); break;
        case 2: tile(std::integral_constant<int, 2>{}, first, count, panel); break;
        case 3: tile(std::integral_constant<int, 3>{}, first, count, panel); break;
        default: tile(std::integral_constant<int, 4>{}, first, count, panel); break;
      }
    }
}

// An uninitialized output of a linear kernel whose whole 2 MiB pages the kernel is asked to back with huge pages (a hint,
// taken where transparent huge pages are `madvise` or `always`). A large output comes from mmap, fresh pages at every
// call: Gemma 3's fp32 logits at 64 rows (64 MiB) took 27-35 ms of page faults on 4 KiB pages, 3 on 2 MiB ones
// (docs/performance.md, "One- and two-row prefill steps, and Q8_0's LM head at many rows").
inline torch::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  auto out = torch::empty(sizes, options);
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHugePage = uintptr_t{2} << 20;
  const uintptr_t start = reinterpret_cast<uintptr_t>(out.data_ptr());
  const uintptr_t first = (start + kHugePage - 1) & ~(kHugePage - 1), end = (start + out.nbytes()) & ~(kHugePage - 1);
  if (end > first) madvise(reinterpret_cast<void*>(first), end - first, MADV_HUGEPAGE);  // a hint: errors ignored
#endif
  return out;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bf16 is the top half of an fp32; a shift the compiler can vectorize.
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The sums of each run of `group` values of `x` (sums.size() runs), in fp32: a GEMV over grouped codes with minima
// takes each group's minimum times its inputs' sum.
inline void group_sums(const c10::BFloat16* x, std::vector<float>& sums, int64_t group) {
  for (size_t i = 0; i < sums.size(); ++i) {
    float total = 0.f;
    for (int64_t k = 0; k < group; ++k) total += to_float(x[i * group + k]);
    sums[i] = total;
  }
}

// fp32 to T with round-to-nearest-even, written so that loops over it vectorize (no NaN branch).
template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFF + ((bits >> 16) & 1);
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(bits >> 16);
  return out;
}

#if defined(__AVX512F__)
#include <immintrin.h>

// 16 fp32 lanes to bf16, rounding to nearest even.
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// e^x to about 3e-6 relative error, well below a bf16 step: 2^n * e^r with r = x - n ln 2 in
// [-ln 2 / 2, ln 2 / 2] and e^r = 1 + r + r^2 (1/2 + r/6 + r^2/24 + r^3/120).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.f / 120), _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

// x[0:n] = softmax(x[0:n]), in fp32; a `sink` logit, when given, joins the denominator.
inline void softmax(float* x, int64_t n, const float* sink = nullptr) {
  float peak = sink ? *sink : x[0];
  for (int64_t t = 0; t < n; ++t) peak = std::max(peak, x[t]);
  float total = sink ? std::exp(*sink - peak) : 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t t = 0; t < n; ++t) {
    x[t] = std::exp(x[t] - peak);
    total += x[t];
  }
  const float inv = 1.f / total;
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) x[t] *= inv;
}

// A cache row's values in fp32: the row at `slot` ((block * H_kv + kv head) * block_size + token) of a
// cache in the model dtype T, or of a quantized one (kv_quant.py: codes and (scale, zero) per row).
template <typename T>
struct DenseRows {
  const T* data;
  int64_t dim;
  void operator()(int64_t slot, float* out) const {
    const T* row = data + slot * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) out[d] = to_float(row[d]);
  }
};
template <int BITS>
struct QuantRows {
  const uint8_t* codes;
  const float* scales_zeros;
  int64_t dim;
  void operator()(int64_t slot, float* out) const {
    const float scale = scales_zeros[2 * slot], zero = scales_zeros[2 * slot + 1];
    if constexpr (BITS == 8) {
      const uint8_t* row = codes + slot * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(row[d]) * scale + zero;
    } else {  // byte j: dimension j in the low nibble, j + dim / 2 in the high one
      const int64_t half = dim / 2;
      const uint8_t* row = codes + slot * half;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        out[j] = static_cast<float>(row[j] & 15) * scale + zero;
        out[j + half] = static_cast<float>(row[j] >> 4) * scale + zero;
      }
    }
  }
};

// The KV cache's scales and zero points and its quant_policy (0: a cache in the model dtype, no scales).
struct KVQuant {
  torch::Tensor k_scales_zeros, v_scales_zeros;
  int64_t bits = 0;
};
// Checks a quantized cache's shapes and makes its scales contiguous fp32 (a no-op when already).
KVQuant kv_quant(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t head_dim,
                 const c10::optional<torch::Tensor>& k_scales_zeros, const c10::optional<torch::Tensor>& v_scales_zeros,
                 int64_t quant_policy);

// The optional attention features (kernels/attention.py): off when 0 / null. `sinks` holds one fp32
// logit per query head.
struct AttnFeatures {
  int64_t sliding_window = 0;
  int64_t attention_chunk = 0;  // a layer has a sliding window or an attention chunk, not both
  float logit_softcap = 0.f;
  torch::Tensor sinks;
  // Prefill rows whose keys reach past their own position (paged_prefill_attention's key_limit): each row's
  // position + 1, from which its window reaches back; null where each row's keys end at its own position.
  const int64_t* query_ends = nullptr;
  bool bounded() const { return sliding_window > 0 || attention_chunk > 0; }
  bool on() const { return bounded() || logit_softcap > 0.f || sinks.defined(); }
  // The first key position a query at `pos` attends to: the start of its window, of its chunk, or 0.
  int64_t first_key(int64_t pos) const {
    if (sliding_window > 0) return std::max<int64_t>(0, pos - sliding_window + 1);
    if (attention_chunk > 0) return pos / attention_chunk * attention_chunk;
    return 0;
  }
  // The first of `length` context tokens that query row `row` attends to (the last of them, without query_ends).
  int64_t first(int64_t length, int64_t row) const { return first_key((query_ends ? query_ends[row] : length) - 1); }
};
AttnFeatures attn_features(const c10::optional<int64_t>& sliding_window, const c10::optional<double>& logit_softcap,
                           const c10::optional<torch::Tensor>& sinks, int64_t num_heads,
                           const c10::optional<int64_t>& attention_chunk);

// Fills `out` and returns true where the AVX-512 path applies (bf16, head_dim 64 or 128); the
// arguments are those of attention_rows in paged_attention.cpp: int64 and contiguous, but for q's
// row stride and `seqs`, which may be undefined.
bool attention_rows_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& table, const torch::Tensor& seqs, const torch::Tensor& lengths,
                           double scale, const AttnFeatures& features, torch::Tensor& out);
// The same for int8 and int4 caches (paged_attention_quant_avx512.cpp).
bool attention_rows_quant_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const KVQuant& quant, const torch::Tensor& table, const torch::Tensor& seqs,
                                 const torch::Tensor& lengths, double scale, const AttnFeatures& features,
                                 torch::Tensor& out);
// Fills `out` and returns true where the AVX512-BF16 prefill path applies (bf16, head_dim 64 or 128);
// the arguments are paged_prefill_attention's, int64 and contiguous but for q's token stride.
bool prefill_attention_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const KVQuant& quant, const torch::Tensor& table, const torch::Tensor& starts,
                              const torch::Tensor& counts, const torch::Tensor& contexts, double scale,
                              const AttnFeatures& features, const int64_t* key_limits, torch::Tensor& out);
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor kv_lens, double scale,
                                     c10::optional<torch::Tensor> k_scales_zeros,
                                     c10::optional<torch::Tensor> v_scales_zeros, int64_t quant_policy,
                                     c10::optional<int64_t> sliding_window = c10::nullopt,
                                     c10::optional<double> logit_softcap = c10::nullopt,
                                     c10::optional<torch::Tensor> sinks = c10::nullopt,
                                     c10::optional<int64_t> attention_chunk = c10::nullopt);
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor q_start,
                                      torch::Tensor q_len, torch::Tensor ctx_len, int64_t max_q_len, double scale,
                                      c10::optional<torch::Tensor> k_scales_zeros,
                                      c10::optional<torch::Tensor> v_scales_zeros, int64_t quant_policy,
                                      c10::optional<int64_t> sliding_window = c10::nullopt,
                                      c10::optional<double> logit_softcap = c10::nullopt,
                                      c10::optional<torch::Tensor> sinks = c10::nullopt,
                                      c10::optional<torch::Tensor> key_limit = c10::nullopt,
                                      c10::optional<int64_t> attention_chunk = c10::nullopt);
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  c10::optional<torch::Tensor> residual);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
// silu(gate) * up of one row of gate_up [2 size] (gate, then up) into out [size]: silu_and_mul's row, kept out of
// line so that every caller runs the same code (and gets the same roundings).
template <typename T>
__attribute__((noinline)) void silu_and_mul_row(const T* gate_up, T* out, int64_t size);
torch::Tensor argmax(torch::Tensor x);
void apply_token_bitmask(torch::Tensor x, torch::Tensor bitmask, std::vector<int64_t> rows);
torch::Tensor apply_rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
void fill_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor blocks, torch::Tensor offsets, c10::optional<torch::Tensor> k_scales_zeros,
                   c10::optional<torch::Tensor> v_scales_zeros, int64_t quant_policy);
void bind_worker_threads(const std::vector<int64_t>& cpus);
bool bf16_gemm_available();
torch::Tensor pack_bf16_weight(const torch::Tensor& weight);
// x @ W.T (+ bias) on W's panels (pack_bf16_weight); `outputs`: W's first rows that the output holds (a weight
// padded with zero rows to whole panels), all of them by default. x may have one feature fewer than W: a weight of
// an odd K is packed with a zero column.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& packed, c10::optional<torch::Tensor> bias,
                          c10::optional<int64_t> outputs = c10::nullopt);
torch::Tensor pack_bf16_gate_up(const torch::Tensor& weight);
// silu(gate) * up on pack_bf16_gate_up's panels; `outputs`: 2 I, gate's and up's first I rows each (each half
// padded with zero rows to whole panels), all of them by default. x as bf16_linear's.
torch::Tensor bf16_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, c10::optional<torch::Tensor> bias,
                                c10::optional<int64_t> outputs = c10::nullopt);
bool int8_gemm_available();
torch::Tensor pack_int8_weight(const torch::Tensor& weight);
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& compensation,
                          const torch::Tensor& scale, c10::optional<torch::Tensor> bias);
bool int4_gemv_available();
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          c10::optional<torch::Tensor> bias);
torch::Tensor int4_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales);
// GGUF Q4_K on int4_linear's codes with the file's scales (linear_int4.cpp); built where int4_linear is.
torch::Tensor q4k_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                         c10::optional<torch::Tensor> bias);
torch::Tensor q4k_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales);
// The weights of q4k_linear's codes and scales as tiles (rounded to bf16 from the exact fp32); with gate_up
// (tiles alternating gate and up) W is [gate; up].
TiledWeight q4k_tiled(const torch::Tensor& packed, const torch::Tensor& scales, bool gate_up);
// fp32 x @ W.T (+ bias) on W [n, K] packed by pack_fp32_weight ([ceil(n/16), K, 16], zero-padded), each output
// summed in input order whatever the number of rows (linear_fp32.cpp); built with AVX-512 and with AVX2 + FMA
// (fp32_packed_linear_isas, widest first), the same bits on both; `isa` empty runs the widest.
std::vector<std::string> fp32_packed_linear_isas();
bool fp32_packed_linear_available();
torch::Tensor pack_fp32_weight(const torch::Tensor& weight);
torch::Tensor fp32_packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                 const c10::optional<torch::Tensor>& bias, const std::string& isa = "");
// GGUF Q8_0 in pack_q8's layout (linear_q8.cpp); built with AVX512-BF16.
bool q8_gemv_available();
torch::Tensor q8_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales);
// The weights of q8_linear's codes and scales as tiles (rounded to bf16 from the exact fp32).
TiledWeight q8_tiled(const torch::Tensor& packed, const torch::Tensor& scales);
bool q6k_gemv_available();
torch::Tensor q6k_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales);
// The weights of q6k_linear's codes and scales as tiles (rounded to bf16 from the exact fp32).
TiledWeight q6k_tiled(const torch::Tensor& codes, const torch::Tensor& scales);
// MXFP4 (gpt-oss's experts) as the checkpoint holds it (linear_mxfp4.cpp); x in fp32 or bf16.
bool mxfp4_gemv_available();
torch::Tensor mxfp4_linear(const torch::Tensor& x, const torch::Tensor& blocks, const torch::Tensor& scales);
torch::Tensor mxfp4_dequantize(const torch::Tensor& blocks, const torch::Tensor& scales, at::ScalarType dtype);
// The same weights as tiles of 16 rows (N a multiple of 16); built with AVX512-BF16.
TiledWeight mxfp4_tiled(const torch::Tensor& blocks, const torch::Tensor& scales);
// x @ W.T (+ bias) for the large steps: dequantized_linear on mxfp4_tiled where dequantizing_gemm_available(),
// x is bf16 and N a multiple of 16, else torch's linear on mxfp4_dequantize's weight in x's dtype.
torch::Tensor mxfp4_dequantized_linear(const torch::Tensor& x, const torch::Tensor& blocks,
                                       const torch::Tensor& scales, const c10::optional<torch::Tensor>& bias);
torch::Tensor pack_int8_gate_up(const torch::Tensor& weight);
torch::Tensor int8_gate_up_silu(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& compensation,
                                const torch::Tensor& scale, c10::optional<torch::Tensor> bias);

// Multi-head latent attention over the paged latent cache [num_blocks, block_size, D] (mla.cpp): absorbed
// queries [rows, H, D] -> [rows, H, v_dim], the score-weighted sums of the cached latents [:v_dim]. With
// quant_policy 8 or 4 the cache holds codes and scales_zeros [num_blocks, block_size, 2, 2] (kernels/mla.py).
torch::Tensor mla_decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_table,
                                   torch::Tensor kv_lens, double scale, int64_t v_dim,
                                   const c10::optional<torch::Tensor>& scales_zeros, int64_t quant_policy);
torch::Tensor mla_prefill_attention(torch::Tensor q, const torch::Tensor& latent, torch::Tensor cache,
                                    torch::Tensor block_table, torch::Tensor q_start, torch::Tensor q_len,
                                    torch::Tensor ctx_len, int64_t max_q_len, double scale, int64_t v_dim,
                                    const c10::optional<torch::Tensor>& scales_zeros, int64_t quant_policy);
