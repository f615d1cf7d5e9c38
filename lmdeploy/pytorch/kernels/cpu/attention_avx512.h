// AVX-512 pieces shared by the paged attention paths of paged_attention_avx512.cpp (bf16 caches) and
// paged_attention_quant_avx512.cpp (int8 and int4 caches).
#pragma once

#include <limits>

#include "common.h"

#if defined(__AVX512F__)

namespace attention_avx512 {

using bf16 = c10::BFloat16;
constexpr int kChunk = 16;  // keys per transposing reduction

inline __m512 load_bf16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// Each fold adds two vectors' halves pairwise into one vector: 256-bit, then 128-bit halves, then
// interleaved 32-bit and 64-bit elements.
inline __m512 fold_256(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
}
inline __m512 fold_128(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
inline __m512 fold_32(__m512 a, __m512 b) { return _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
inline __m512 fold_64(__m512 a, __m512 b) {
  const __m512d x = _mm512_castps_pd(a), y = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// Pulls the given bytes into L2. Each pass over one KV head's rows of a block prefetches the rows
// the next pass reads (K's pass that V's, V's pass the next head's or the next block's K), which hides
// memory latency that the hardware prefetcher, stopping at every scattered block, leaves exposed.
// With K and V interleaved this way memory never idles while a softmax runs: in isolation, 30 layers
// of 64 rows went from 13.2 to 11.8 ms, close to what plainly reading the same scattered blocks takes.
inline void prefetch_l2(const void* p, int64_t bytes) {
  for (int64_t offset = 0; offset < bytes; offset += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + offset, _MM_HINT_T1);
}

// Lane j of sum16(v) is the sum of the lanes of v[slot(j)]: the folds transpose 4x4.
constexpr int slot(int key) { return (key % 4) * 4 + key / 4; }
inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) a[i] = fold_256(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 4; ++i) b[i] = fold_128(a[2 * i], a[2 * i + 1]);
  for (int i = 0; i < 2; ++i) c[i] = fold_32(b[2 * i], b[2 * i + 1]);
  return fold_64(c[0], c[1]);
}

// Online softmax over one block: turns scores into weights exp(s - peak) and gives the factor that
// rescales the blocks before (none before while total is 0; the kernels build with -ffast-math, so
// no infinities stand in for "no peak yet"). The inline exp_ps made decode attention 4% faster in
// the engine than libmvec's calls.
inline void online_softmax(float* scores, int64_t count, float& peak, float& total, float& rescale) {
  const auto lanes = [&](int64_t t) {
    return count - t >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (count - t)) - 1);
  };
  __m512 top = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  for (int64_t t = 0; t < count; t += 16)
    top = _mm512_mask_max_ps(top, lanes(t), top, _mm512_maskz_loadu_ps(lanes(t), scores + t));
  const float new_peak = std::max(peak, _mm512_reduce_max_ps(top));
  rescale = total == 0.f ? 0.f : std::exp(peak - new_peak);
  const __m512 shift = _mm512_set1_ps(new_peak);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < count; t += 16) {
    const __mmask16 mask = lanes(t);
    const __m512 shifted = _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, scores + t), shift);
    const __m512 weight = _mm512_maskz_mov_ps(mask, exp_ps(shifted));
    _mm512_mask_storeu_ps(scores + t, mask, weight);
    sum = _mm512_add_ps(sum, weight);
  }
  total = total * rescale + _mm512_reduce_add_ps(sum);
  peak = new_peak;
}

// One task's share of the attention features (AttnFeatures): the first cached token it attends to,
// soft-capping, and the sinks of its query heads (KV head k's G heads from sinks + k * sink_stride).
struct TaskFeatures {
  int64_t first = 0;
  float softcap = 0.f;
  const float* sinks = nullptr;
  int64_t sink_stride = 0;

  TaskFeatures(const AttnFeatures& features, int64_t length, int64_t first_query_head, int64_t group)
      : first(features.first(length)), softcap(features.logit_softcap),
        sinks(features.sinks.defined() ? features.sinks.data_ptr<float>() + first_query_head : nullptr),
        sink_stride(group) {}

  // The online softmax of `heads` KV heads' G query heads before any key: no peak and nothing summed,
  // or a head's sink as its peak with weight 1 (its exp(sink - peak) then rescales with the keys').
  void start(int64_t heads, int G, float* peak, float* total) const {
    for (int64_t k = 0; k < heads; ++k)
      for (int h = 0; h < G; ++h) {
        peak[k * G + h] = sinks ? sinks[k * sink_stride + h] : std::numeric_limits<float>::lowest();
        total[k * G + h] = sinks ? 1.f : 0.f;
      }
  }

  // softcap * tanh(score / softcap) for G heads' `count` scores (rows of `block_size`).
  void cap(float* scores, int G, int64_t block_size, int64_t count) const {
    if (softcap <= 0.f) return;
    for (int h = 0; h < G; ++h)
      for (int64_t t = 0; t < count; ++t) {
        float& score = scores[h * block_size + t];
        score = softcap * std::tanh(score / softcap);
      }
  }
};

// Adds one block's weighted values to the running sums of G query heads in `stored` ([G, D] fp32), after
// rescaling them as the online softmax says; `value_row(t, value)` loads token t's value row as fp32.
template <int G, int NV, class ValueRow>
inline void accumulate_values(float* stored, const float* rescale, const float* scores, int64_t block_size,
                              int64_t in_block, ValueRow value_row) {
  constexpr int D = 16 * NV;
  __m512 acc[G][NV];
  for (int h = 0; h < G; ++h) {
    const __m512 r = _mm512_set1_ps(rescale[h]);
    for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_mul_ps(_mm512_loadu_ps(stored + h * D + 16 * i), r);
  }
  for (int64_t t = 0; t < in_block; ++t) {
    __m512 value[NV];
    value_row(t, value);
    for (int h = 0; h < G; ++h) {
      const __m512 weight = _mm512_set1_ps(scores[h * block_size + t]);
      for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_fmadd_ps(weight, value[i], acc[h][i]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(stored + h * D + 16 * i, acc[h][i]);
}

// The heads' sums divided by their softmax totals, written as bf16 to out (head k's G rows at k * head_stride).
template <int G, int NV>
inline void store_normalized(const float* acc_store, const float* total, int64_t heads, bf16* out,
                             int64_t head_stride) {
  constexpr int D = 16 * NV;
  for (int64_t k = 0; k < heads; ++k)
    for (int h = 0; h < G; ++h) {
      const __m512 inv = _mm512_set1_ps(1.f / total[k * G + h]);
      for (int i = 0; i < NV; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k * head_stride + h * D + 16 * i),
                            to_bf16(_mm512_mul_ps(_mm512_loadu_ps(acc_store + (k * G + h) * D + 16 * i), inv)));
    }
}

}  // namespace attention_avx512

#endif
