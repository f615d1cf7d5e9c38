// The AVX-512 path of paged attention (decode rows, and prefill rows as decode-style queries) for
// bf16 caches and head_dim 64 or 128; paged_attention.cpp states the contract. Scores are computed
// 16 keys at a time: each key gives a vector of partial dot products (with AVX512-BF16: bf16 pairs
// accumulated in fp32), and one transposing reduction turns 16 such vectors into the 16 scores.
// Softmax is online (flash-decoding's rescaling, in one thread): each block's K rows of a KV head
// are followed by its V rows, whose weighted sum keeps its accumulators in registers.
#include "attention_avx512.h"

#if defined(__AVX512F__)

namespace {

using namespace attention_avx512;

// Partial dot products (one vector) of a query head with a key row of 16 * NV bf16 values.
template <int NV>
struct QueryHead {
#if defined(__AVX512BF16__)
  __m512bh q[NV / 2];
  explicit QueryHead(const bf16* query) {
    for (int i = 0; i < NV / 2; ++i) q[i] = (__m512bh)_mm512_loadu_si512(query + 32 * i);
  }
  __m512 dot(const bf16* key) const {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < NV / 2; ++i) acc = _mm512_dpbf16_ps(acc, q[i], (__m512bh)_mm512_loadu_si512(key + 32 * i));
    return acc;
  }
#else
  __m512 q[NV];
  explicit QueryHead(const bf16* query) {
    for (int i = 0; i < NV; ++i) q[i] = load_bf16(query + 16 * i);
  }
  __m512 dot(const bf16* key) const {
    __m512 acc = _mm512_mul_ps(q[0], load_bf16(key));
    for (int i = 1; i < NV; ++i) acc = _mm512_fmadd_ps(q[i], load_bf16(key + 16 * i), acc);
    return acc;
  }
#endif
};

// Rows [first, first + count) of one KV head's K block against G query heads: scale * q . k into
// scores[h * block_size + t], prefetching `pull` (the bytes the next pass reads) meanwhile.
template <int G, int NV>
void block_scores(const bf16* q, const bf16* rows, int64_t count, float scale, const bf16* pull, float* scores,
                  int64_t block_size) {
  constexpr int D = 16 * NV;
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 partial[kChunk];
  for (int64_t first = 0; first < count; first += kChunk) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, count - first));
    if (pull) prefetch_l2(pull + first * D, std::min<int64_t>(kChunk, block_size - first) * D * 2);
    for (int h = 0; h < G; ++h) {
      const QueryHead<NV> query(q + h * D);
      for (int t = 0; t < kChunk; ++t)
        partial[slot(t)] = t < n ? query.dot(rows + (first + t) * D) : _mm512_setzero_ps();
      _mm512_mask_storeu_ps(scores + h * block_size + first, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(sum16(partial), scale_v));
    }
  }
}

// KV head k's rows of a block in a bf16 cache, which holds cache row r from r * D.
template <int G, int NV>
struct Head {
  static constexpr int D = 16 * NV;
  const bf16 *q, *keys, *values;
  const bf16* pull;  // the K rows of the next pass, read into L2 while the values are
  int64_t count, block_size;
  float scale;

  void scores(float* scores) const { block_scores<G, NV>(q, keys, count, scale, values, scores, block_size); }
  void accumulate(float* stored, const float* rescale, const float* weights, int64_t in_block) const {
    accumulate_values<G, NV>(stored, rescale, weights, block_size, in_block, [&](int64_t t, __m512(&value)[NV]) {
      if (pull) prefetch_l2(pull + t * D, D * 2);
      for (int i = 0; i < NV; ++i) value[i] = load_bf16(values + t * D + 16 * i);
    });
  }
};

struct Cache {
  const bf16 *k, *v;
  int64_t num_kv_heads, block_size;
  float scale;
};

template <int G, int NV>
void run_task(const Task& task, const TaskFeatures& features, const Cache& cache, std::vector<float>& scratch) {
  constexpr int D = 16 * NV;
  attend<G, NV>(task, features, cache.num_kv_heads, cache.block_size, scratch, [&](const HeadRows& rows, int64_t k) {
    return Head<G, NV>{task.q + k * task.head_stride, cache.k + rows.slot * D, cache.v + rows.slot * D,
                       rows.next < 0 ? nullptr : cache.k + rows.next * D, rows.count, cache.block_size, cache.scale};
  });
}

}  // namespace

bool attention_rows_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& table, const torch::Tensor& seqs, const torch::Tensor& lengths,
                           double scale, const AttnFeatures& features, torch::Tensor& out) {
  if (!takes_queries(q)) return false;
  const Cache cache{k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), k_cache.size(1), k_cache.size(2),
                    static_cast<float>(scale)};
  for_each_task(q, cache.num_kv_heads, table, seqs, lengths, features, out,
                [&](auto G, auto NV, const Task& task, const TaskFeatures& task_features, std::vector<float>& scratch) {
                  run_task<decltype(G)::value, decltype(NV)::value>(task, task_features, cache, scratch);
                });
  return true;
}

#else

bool attention_rows_avx512(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                           const torch::Tensor&, const torch::Tensor&, double, const AttnFeatures&, torch::Tensor&) {
  return false;
}

#endif
