// The AVX-512 path of paged attention over int8 and int4 caches (bf16 queries, head_dim 64 or 128); the
// codes are read as they are, half or a quarter of a bf16 cache's bytes, and never written back out
// dequantized. The tasks and their online softmax are attention_avx512.h's, as for bf16 caches; the
// arithmetic is integer (AVX512-VNNI's vpdpwssd, or vpmaddwd and an add without it).
// Scores: a key row is scale * codes + zero. Each task rounds its query heads once to int16 (q ~ step * q16,
// half a step = 1/65534 of the largest |q| at worst), and q . k = scale * (q . codes) + zero * sum(q) with
// q . codes ~ step * (q16 . (codes - middle)) + middle * sum(q) (middle 128 or 8): centred codes, so that the
// query's rounding error multiplies key values measured from the middle of their row's range, not from its
// minimum. q16 . codes is vpdpwssd on four keys at once (their rows' 16-byte blocks transposed into one vector,
// even and odd bytes as int16). int8 queries (vpdpbusd) were about 7% faster in one thread but put errors of
// up to 0.1 on the tests' outputs. Values: out = sum_t p_t * (scale_t * codes_t + zero_t) =
// sum_t (p_t * scale_t) * codes_t + sum_t p_t * zero_t; the weights p_t * scale_t are rounded to int16 per 64
// keys (1/65534 of their largest at worst) and summed with vpdpwssd over pairs of keys' codes, the zero term
// is one number per head.
#include "attention_avx512.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)

namespace {

using namespace attention_avx512;

// acc + the sums of each 32-bit lane's two products of int16s.
inline __m512i dot_i16(__m512i acc, __m512i a, __m512i b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// The 4x4 transpose of the 128-bit blocks of v[0..3]: block j of v[i] moves to block i of v[j].
inline void transpose_blocks(__m512i* v) {
  const __m512i t0 = _mm512_shuffle_i32x4(v[0], v[1], 0x44), t1 = _mm512_shuffle_i32x4(v[0], v[1], 0xEE);
  const __m512i t2 = _mm512_shuffle_i32x4(v[2], v[3], 0x44), t3 = _mm512_shuffle_i32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_i32x4(t0, t2, 0x88);
  v[1] = _mm512_shuffle_i32x4(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_i32x4(t1, t3, 0x88);
  v[3] = _mm512_shuffle_i32x4(t1, t3, 0xDD);
}

// Dimensions 64c to 64c + 63 of a row of D = 16 * NV codes as bytes, in order: int8 as stored, int4 (dimension
// j in byte j's low nibble and j + D / 2 in its high one) unpacked.
template <int NV, int BITS>
inline __m512i row_piece(const uint8_t* row, int c) {
  const __m512i nibble = _mm512_set1_epi8(15);
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(row + 64 * c);
  } else if constexpr (NV == 4) {
    const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
    return _mm512_and_si512(_mm512_mask_srli_epi16(x, 0xFFFF0000u, x, 4), nibble);
  } else {
    const __m512i x = _mm512_loadu_si512(row);
    return _mm512_and_si512(c == 0 ? x : _mm512_srli_epi16(x, 4), nibble);
  }
}

// The (scale, zero) pairs of up to 16 rows from sz, split into a vector of scales and one of zeros (0 past n).
inline void scales_zeros(const float* sz, int n, __m512& scales, __m512& zeros) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const auto mask = [](int lanes) { return static_cast<__mmask16>((1u << std::clamp(lanes, 0, 16)) - 1); };
  const __m512 low = _mm512_maskz_loadu_ps(mask(2 * n), sz), high = _mm512_maskz_loadu_ps(mask(2 * n - 16), sz + 16);
  scales = _mm512_permutex2var_ps(low, even, high);
  zeros = _mm512_permutex2var_ps(low, _mm512_add_epi32(even, _mm512_set1_epi32(1)), high);
}

// A query head of D = 16 * NV values as int16, q ~ step * q16.
template <int NV>
struct QuantQuery {
  __m512i even[NV], odd[NV];  // [j]: dimensions 16j, 16j + 2, ... (16j + 1, 16j + 3, ...) in each 128-bit block
  float step, sum;  // sum of the query's values
  int32_t code_sum;  // sum of q16
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
    __m512i codes = _mm512_setzero_si512();
    alignas(64) int16_t q16[16 * NV], split[2][8];
    for (int i = 0; i < NV; ++i) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(x[i], inv));
      codes = _mm512_add_epi32(codes, v);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q16 + 16 * i), _mm512_cvtepi32_epi16(v));
    }
    code_sum = _mm512_reduce_add_epi32(codes);
    for (int i = 0; i < NV; ++i) {
      for (int k = 0; k < 8; ++k) split[0][k] = q16[16 * i + 2 * k], split[1][k] = q16[16 * i + 2 * k + 1];
      even[i] = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(split[0])));
      odd[i] = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(split[1])));
    }
  }
};

// Rows [0, count) of one KV head's K block against G query heads into scores[h * block_size + t], 16 keys at
// a time, prefetching `pull` (the V rows of the pass) meanwhile. Four keys go in one vector, key
// i + 4L in block L of dots[h][i], so that the final reduction leaves key t's score in lane t.
template <int G, int NV, int BITS>
void block_scores(const QuantQuery<NV>* query, const uint8_t* rows, const float* sz, int64_t count, float scale,
                  const uint8_t* pull, float* scores, int64_t block_size) {
  constexpr int64_t row_bytes = 16 * NV * BITS / 8;
  constexpr int P = NV / 4;  // 64-code pieces of a row
  constexpr int kMiddle = 1 << (BITS - 1);  // of the codes' range
  for (int64_t first = 0; first < count; first += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, count - first));
    if (pull) prefetch_l2(pull + first * row_bytes, std::min<int64_t>(kChunk, block_size - first) * row_bytes);
    __m512i dots[G][4];
    for (int i = 0; i < 4; ++i) {
      const uint8_t* key[4];  // keys past n read row n - 1 again: their scores are not stored
      for (int L = 0; L < 4; ++L) key[L] = rows + (first + std::min(i + 4 * L, n - 1)) * row_bytes;
      for (int h = 0; h < G; ++h) dots[h][i] = _mm512_setzero_si512();
      for (int c = 0; c < P; ++c) {
        __m512i blocks[4];
        for (int L = 0; L < 4; ++L) blocks[L] = row_piece<NV, BITS>(key[L], c);
        transpose_blocks(blocks);
        for (int j = 0; j < 4; ++j) {
          const __m512i even = _mm512_and_si512(blocks[j], _mm512_set1_epi16(0xFF));
          const __m512i odd = _mm512_srli_epi16(blocks[j], 8);
          for (int h = 0; h < G; ++h)
            dots[h][i] = dot_i16(dot_i16(dots[h][i], even, query[h].even[4 * c + j]), odd, query[h].odd[4 * c + j]);
        }
      }
    }
    __m512 scales, zeros;
    scales_zeros(sz + 2 * first, n, scales, zeros);
    for (int h = 0; h < G; ++h) {
      const __m512i* d = dots[h];
      const __m512i pairs = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
      const __m512i pairs2 = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
      const __m512i sums = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs, pairs2), _mm512_unpackhi_epi64(pairs, pairs2));
      const QuantQuery<NV>& q = query[h];
      const __m512 centred = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums, _mm512_set1_epi32(kMiddle * q.code_sum)));
      const __m512 q_codes = _mm512_fmadd_ps(centred, _mm512_set1_ps(q.step), _mm512_set1_ps(kMiddle * q.sum));
      const __m512 raw = _mm512_fmadd_ps(q_codes, scales, _mm512_mul_ps(zeros, _mm512_set1_ps(q.sum)));
      _mm512_mask_storeu_ps(scores + h * block_size + first, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(raw, _mm512_set1_ps(scale)));
    }
  }
}

constexpr int kValueChunk = 64;  // keys per integer sum: 64 * 255 * 32767 < 2^31

// Adds the weights[h * block_size + t]-weighted V rows [0, count) of a block to G heads' sums in stored
// ([G, D] fp32, first multiplied by rescale[h]), prefetching `pull` (the next pass's K rows) meanwhile. Keys
// go in pairs: their codes interleaved as int16 (key t's in each 32-bit lane's low half) against their two
// int16 weights; for the row's piece c, 32-bit lane e of block L of acc[h][m] then sums dimension
// 64c + 16L + 4m + e.
template <int G, int NV, int BITS>
void block_values(const uint8_t* rows, const float* sz, float* stored, const float* rescale, const float* weights,
                  int64_t block_size, int64_t count, const uint8_t* pull) {
  constexpr int D = 16 * NV, P = NV / 4;
  constexpr int64_t row_bytes = D * BITS / 8;
  for (int h = 0; h < G; ++h)
    for (int i = 0; i < NV; ++i)
      _mm512_storeu_ps(stored + h * D + 16 * i,
                       _mm512_mul_ps(_mm512_loadu_ps(stored + h * D + 16 * i), _mm512_set1_ps(rescale[h])));
  for (int64_t first = 0; first < count; first += kValueChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kValueChunk, count - first));
    alignas(64) int16_t w16[G][kValueChunk];  // 0 past n
    float step[G], zero_sum[G];
    __m512 scales[kValueChunk / 16], zeros[kValueChunk / 16];
    for (int m = 0; m < kValueChunk / 16; ++m) scales_zeros(sz + 2 * (first + 16 * m), n - 16 * m, scales[m], zeros[m]);
    for (int h = 0; h < G; ++h) {
      __m512 w[kValueChunk / 16], top = _mm512_setzero_ps(), zero_acc = _mm512_setzero_ps();
      for (int m = 0; m < kValueChunk / 16; ++m) {
        const __mmask16 lanes = static_cast<__mmask16>((1u << std::clamp(n - 16 * m, 0, 16)) - 1);
        const __m512 p = _mm512_maskz_loadu_ps(lanes, weights + h * block_size + first + 16 * m);
        w[m] = _mm512_mul_ps(p, scales[m]);
        top = _mm512_max_ps(top, w[m]);
        zero_acc = _mm512_fmadd_ps(p, zeros[m], zero_acc);
      }
      const float peak = _mm512_reduce_max_ps(top);
      step[h] = peak > 0.f ? peak / 32767.f : 1.f;
      zero_sum[h] = _mm512_reduce_add_ps(zero_acc);
      const __m512 inv = _mm512_set1_ps(1.f / step[h]);
      for (int m = 0; m < kValueChunk / 16; ++m)
        _mm256_store_si256(reinterpret_cast<__m256i*>(w16[h] + 16 * m),
                           _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w[m], inv))));
    }
    for (int c = 0; c < P; ++c) {  // a piece at a time: G * 4 accumulators stay in registers
      __m512i acc[G][4];
      for (int h = 0; h < G; ++h)
        for (int m = 0; m < 4; ++m) acc[h][m] = _mm512_setzero_si512();
      for (int t = 0; t < n; t += 2) {
        if (pull && c == 0) prefetch_l2(pull + (first + t) * row_bytes, 2 * row_bytes);
        // an odd count's last key pairs with itself at weight 0
        const __m512i r0 = row_piece<NV, BITS>(rows + (first + t) * row_bytes, c);
        const __m512i r1 = row_piece<NV, BITS>(rows + (first + std::min(t + 1, n - 1)) * row_bytes, c);
        const __m512i low = _mm512_unpacklo_epi8(r0, r1), high = _mm512_unpackhi_epi8(r0, r1);
        const __m512i zero = _mm512_setzero_si512();
        const __m512i x[4] = {_mm512_unpacklo_epi8(low, zero), _mm512_unpackhi_epi8(low, zero),
                              _mm512_unpacklo_epi8(high, zero), _mm512_unpackhi_epi8(high, zero)};
        for (int h = 0; h < G; ++h) {
          int32_t pair;
          std::memcpy(&pair, w16[h] + t, sizeof(pair));
          const __m512i w = _mm512_set1_epi32(pair);
          for (int m = 0; m < 4; ++m) acc[h][m] = dot_i16(acc[h][m], x[m], w);
        }
      }
      for (int h = 0; h < G; ++h) {
        const __m512 w = _mm512_set1_ps(step[h]), z = _mm512_set1_ps(zero_sum[h]);
        transpose_blocks(acc[h]);
        for (int m = 0; m < 4; ++m) {
          float* sum = stored + h * D + 64 * c + 16 * m;
          const __m512 before = _mm512_add_ps(_mm512_loadu_ps(sum), z);
          _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[h][m]), w, before));
        }
      }
    }
  }
}

struct Cache {
  const uint8_t *k, *v;
  const float *k_sz, *v_sz;  // (scale, zero) per row
  int64_t num_kv_heads, block_size;
  float scale;
};

// KV head k's rows of a block in a quantized cache, which holds cache row r's codes from r * row_bytes and its
// (scale, zero) at 2 * r. As in the bf16 kernel, scoring prefetches the pass's V rows and summing values the
// next pass's K rows (prefetching each kind's own next rows instead was 4-7% faster at SmolLM2's heads in one
// thread, but 35% slower at Llama-8B's).
template <int G, int NV, int BITS>
struct Head {
  static constexpr int64_t row_bytes = 16 * NV * BITS / 8;
  const QuantQuery<NV>* queries;  // the KV head's G query heads
  const Cache& cache;
  HeadRows rows;

  void scores(float* scores) const {
    prefetch_l2(cache.v_sz + 2 * rows.slot, rows.count * 8);
    block_scores<G, NV, BITS>(queries, cache.k + rows.slot * row_bytes, cache.k_sz + 2 * rows.slot, rows.count,
                              cache.scale, cache.v + rows.slot * row_bytes, scores, cache.block_size);
    if (rows.next >= 0) prefetch_l2(cache.k_sz + 2 * rows.next, cache.block_size * 8);
  }
  void accumulate(float* stored, const float* rescale, const float* weights, int64_t count) const {
    block_values<G, NV, BITS>(cache.v + rows.slot * row_bytes, cache.v_sz + 2 * rows.slot, stored, rescale, weights,
                              cache.block_size, count, rows.next < 0 ? nullptr : cache.k + rows.next * row_bytes);
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
