// The AVX-512 path of paged attention over int8 and int4 caches (bf16 queries, head_dim 64 or 128); the
// codes are read as they are, half or a quarter of a bf16 cache's bytes, and never written back out
// dequantized. The tasks and their online softmax are attention_avx512.h's, as for bf16 caches.
// Scores: a key row is scale * codes + zero, so q . k = scale * (q . codes) + zero * sum(q). Each task
// rounds its query heads once to int16 (q ~ step * q16, 1/65534 of the largest |q| at worst) and q16 .
// codes is an exact integer dot product (vpdpwssd, 32 codes a step, the same count as the bf16 path's
// vdpbf16ps), each key's codes widened to int16 once for all query heads of its KV head. Values: each
// row is dequantized in registers (codes to fp32, one fma) and accumulated.
#include "attention_avx512.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)

namespace {

using namespace attention_avx512;

inline __m512i dot_i16(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// A query head of D = 16 * NV values as int16 (q ~ step * q16) and the sum of its values.
template <int NV>
struct QuantQuery {
  __m512i q16[NV / 2];
  float step, sum;
  explicit QuantQuery(const bf16* query) {
    __m512 x[NV], peak = _mm512_setzero_ps(), total = _mm512_setzero_ps();
    for (int i = 0; i < NV; ++i) {
      x[i] = load_bf16(query + 16 * i);
      peak = _mm512_max_ps(peak, _mm512_abs_ps(x[i]));
      total = _mm512_add_ps(total, x[i]);
    }
    const float top = _mm512_reduce_max_ps(peak);
    step = top > 0.f ? top / 32767.f : 1.f;
    sum = _mm512_reduce_add_ps(total);
    const __m512 inv = _mm512_set1_ps(1.f / step);
    for (int i = 0; i < NV / 2; ++i) {
      const __m256i low = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[2 * i], inv)));
      const __m256i high = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(x[2 * i + 1], inv)));
      q16[i] = _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
    }
  }
  // Partial integer dot products (one vector) with a key row's codes from `codes` below.
  __m512i dot(const __m512i (&key)[NV / 2]) const {
    __m512i acc = dot_i16(_mm512_setzero_si512(), q16[0], key[0]);
    for (int c = 1; c < NV / 2; ++c) acc = dot_i16(acc, q16[c], key[c]);
    return acc;
  }
};

// A key row's codes as int16, 32 dimensions a vector: int8, or int4 with dimension j in byte j's low
// nibble and j + D / 2 in its high one.
template <int NV, int BITS>
inline void codes(const uint8_t* row, __m512i (&out)[NV / 2]) {
  const auto widen = [&](int c) {
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
  };
  if constexpr (BITS == 8) {
    for (int c = 0; c < NV / 2; ++c) out[c] = widen(c);
  } else {
    for (int c = 0; c < NV / 4; ++c) {
      const __m512i bytes = widen(c);
      out[c] = _mm512_and_si512(bytes, _mm512_set1_epi16(15));
      out[c + NV / 4] = _mm512_srli_epi16(bytes, 4);
    }
  }
}

// sum16 (attention_avx512.h) on int32 lanes, exact.
inline __m512i sum16_epi32(const __m512i* v) {
  __m512i a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0x44),
                            _mm512_shuffle_i32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(b[2 * i], b[2 * i + 1]),
                            _mm512_unpackhi_epi32(b[2 * i], b[2 * i + 1]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(c[0], c[1]), _mm512_unpackhi_epi64(c[0], c[1]));
}

// Row t's codes as NV vectors of fp32 values (scale * code + zero).
template <int NV, int BITS>
inline void dequantize(const uint8_t* row, __m512 scale, __m512 zero, __m512 (&out)[NV]) {
  if constexpr (BITS == 8) {
    for (int i = 0; i < NV; ++i) {
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * i)));
      out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), scale, zero);
    }
  } else {
    const __m512i nibble = _mm512_set1_epi32(15);
    for (int i = 0; i < NV / 2; ++i) {
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * i)));
      out[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, nibble)), scale, zero);
      out[i + NV / 2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), scale, zero);
    }
  }
}

struct Cache {
  const uint8_t *k, *v;
  const float *k_sz, *v_sz;  // (scale, zero) per row
  int64_t num_kv_heads, block_size;
  float scale;
};

// Rows [first, first + count) of one KV head's K block against G query heads into
// scores[h * block_size + t], prefetching `pull` (the V rows the next pass reads) meanwhile.
template <int G, int NV, int BITS>
void block_scores(const QuantQuery<NV>* query, const uint8_t* rows, const float* sz, int64_t count, float scale,
                  const uint8_t* pull, float* scores, int64_t block_size) {
  constexpr int64_t row_bytes = 16 * NV * BITS / 8;
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512i partial[G][kChunk];
  for (int64_t first = 0; first < count; first += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, count - first));
    if (pull) prefetch_l2(pull + first * row_bytes, std::min<int64_t>(kChunk, block_size - first) * row_bytes);
    for (int t = 0; t < kChunk; ++t) {  // each key's codes widened once for all G query heads
      if (t < n) {
        __m512i key[NV / 2];
        codes<NV, BITS>(rows + (first + t) * row_bytes, key);
        for (int h = 0; h < G; ++h) partial[h][slot(t)] = query[h].dot(key);
      } else {
        for (int h = 0; h < G; ++h) partial[h][slot(t)] = _mm512_setzero_si512();
      }
    }
    const __mmask16 keys = static_cast<__mmask16>((1u << n) - 1);
    // (scale, zero) pairs of the chunk's keys, split into a vector of scales and one of zeros
    const auto mask = [](int lanes) { return static_cast<__mmask16>((1u << std::clamp(lanes, 0, 16)) - 1); };
    const __m512 pairs_low = _mm512_maskz_loadu_ps(mask(2 * n), sz + 2 * first);
    const __m512 pairs_high = _mm512_maskz_loadu_ps(mask(2 * n - 16), sz + 2 * first + 16);
    const __m512 scales = _mm512_permutex2var_ps(pairs_low, even, pairs_high);
    const __m512 zeros = _mm512_permutex2var_ps(pairs_low, odd, pairs_high);
    for (int h = 0; h < G; ++h) {
      const __m512 dots = _mm512_cvtepi32_ps(sum16_epi32(partial[h]));
      const __m512 raw = _mm512_fmadd_ps(_mm512_mul_ps(dots, _mm512_set1_ps(query[h].step)), scales,
                                         _mm512_mul_ps(zeros, _mm512_set1_ps(query[h].sum)));
      _mm512_mask_storeu_ps(scores + h * block_size + first, keys, _mm512_mul_ps(raw, _mm512_set1_ps(scale)));
    }
  }
}

// KV head k's rows of a block in a quantized cache, which holds cache row r's codes from r * row_bytes and its
// (scale, zero) at 2 * r.
template <int G, int NV, int BITS>
struct Head {
  static constexpr int64_t row_bytes = 16 * NV * BITS / 8;
  const QuantQuery<NV>* queries;  // the KV head's G query heads
  const Cache& cache;
  HeadRows rows;
  const uint8_t* values = cache.v + rows.slot * row_bytes;
  const float* v_sz = cache.v_sz + 2 * rows.slot;
  const uint8_t* pull = rows.next < 0 ? nullptr : cache.k + rows.next * row_bytes;  // read while the values are

  void scores(float* scores) const {
    prefetch_l2(v_sz, rows.count * 8);
    block_scores<G, NV, BITS>(queries, cache.k + rows.slot * row_bytes, cache.k_sz + 2 * rows.slot, rows.count,
                              cache.scale, values, scores, cache.block_size);
    if (pull) prefetch_l2(cache.k_sz + 2 * rows.next, cache.block_size * 8);
  }
  void value(int64_t t, __m512 (&value)[NV]) const {
    if (pull) prefetch_l2(pull + t * row_bytes, row_bytes);
    dequantize<NV, BITS>(values + t * row_bytes, _mm512_set1_ps(v_sz[2 * t]), _mm512_set1_ps(v_sz[2 * t + 1]), value);
  }
};

template <int G, int NV, int BITS>
void run_task(const Task& task, const TaskFeatures& features, const Cache& cache, std::vector<float>& scratch) {
  constexpr int D = 16 * NV;
  std::vector<QuantQuery<NV>> queries;
  for (int64_t k = 0; k < task.heads; ++k)
    for (int h = 0; h < G; ++h) queries.emplace_back(task.q + k * task.head_stride + h * D);
  attend<G, NV>(task, features, cache.num_kv_heads, cache.block_size, scratch, [&](const HeadRows& rows, int64_t k) {
    return Head<G, NV, BITS>{queries.data() + k * G, cache, rows};
  });
}

}  // namespace

bool attention_rows_quant_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                 const KVQuant& quant, const torch::Tensor& table, const torch::Tensor& seqs,
                                 const torch::Tensor& lengths, double scale, const AttnFeatures& features,
                                 torch::Tensor& out) {
  if (!takes_queries(q)) return false;
  const Cache cache{k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), quant.k_scales_zeros.data_ptr<float>(),
                    quant.v_scales_zeros.data_ptr<float>(), k_cache.size(1), k_cache.size(2),
                    static_cast<float>(scale)};
  for_each_task(q, cache.num_kv_heads, table, seqs, lengths, features, out,
                [&](auto G, auto NV, const Task& task, const TaskFeatures& task_features, std::vector<float>& scratch) {
                  if (quant.bits == 8)
                    run_task<decltype(G)::value, decltype(NV)::value, 8>(task, task_features, cache, scratch);
                  else
                    run_task<decltype(G)::value, decltype(NV)::value, 4>(task, task_features, cache, scratch);
                });
  return true;
}

#else

bool attention_rows_quant_avx512(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const KVQuant&,
                                 const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, double,
                                 const AttnFeatures&, torch::Tensor&) {
  return false;
}

#endif
