// The AVX-512 paged attention shared by paged_attention_avx512.cpp (bf16 caches) and
// paged_attention_quant_avx512.cpp (int8 and int4 caches): the tasks and their threads, the online softmax
// loop over a task's blocks, and its vector pieces. Each file supplies how a KV head's rows of a block are
// scored and how their values are summed.
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

  TaskFeatures(const AttnFeatures& features, int64_t row, int64_t length, int64_t first_query_head, int64_t group)
      : first(features.first(length, row)), softcap(features.logit_softcap),
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

// Whether the AVX-512 paths take these queries: bf16, head_dim 64 or 128.
inline bool takes_queries(const torch::Tensor& q) {
  return q.scalar_type() == at::kBFloat16 && (q.size(2) == 64 || q.size(2) == 128);
}

// A task is one query row over `heads` consecutive KV heads from `first_head` and `group` (1 to 4) query
// heads of each (q and out hold KV head k's from q + k * head_stride). Blocks are the outer loop, so a
// task reads each block's rows of its KV heads in order.
struct Task {
  const bf16* q;
  bf16* out;
  const int64_t* blocks;  // the row's block-table row
  int64_t length;         // cached tokens
  int64_t heads, first_head;
  int64_t head_stride;  // elements of q and out between consecutive KV heads
  int64_t group;
};

// What one pass of a task reads: a KV head's rows [slot, slot + count) of a block, cache rows counted as
// (block * H_kv + head) * block_size + token; `next` is the first row the next pass reads (-1: none).
struct HeadRows {
  int64_t slot, count, next;
};

// A task's flash-decoding in one thread: block by block, for each KV head its scores, soft-capping, online
// softmax and weighted values, so that memory never idles between a scores pass and a values pass.
// head_at(rows, k) reads KV head k's HeadRows: its scores(float* scores) writes scale * q . k of the G query
// heads to scores[h * block_size + t], its accumulate(stored, rescale, weights, count) adds the rows' values
// weighted by weights[h * block_size + t] to the heads' sums ([G, D] fp32) after rescaling them. Kept out
// of for_each_task's loop: inlined there, the bf16 path with G = 4 and head_dim 128 ran 12% slower.
template <int G, int NV, class HeadAt>
[[gnu::noinline]] void attend(const Task& task, const TaskFeatures& features, int64_t num_kv_heads,
                              int64_t block_size, std::vector<float>& scratch, HeadAt head_at) {
  constexpr int D = 16 * NV;
  const int64_t rows = task.heads * G;
  scratch.resize(G * block_size + rows * (D + 2));
  float* scores = scratch.data();
  float* acc_store = scores + G * block_size;
  float* peak = acc_store + rows * D;
  float* total = peak + rows;
  std::fill(acc_store, acc_store + rows * D, 0.f);
  features.start(task.heads, G, peak, total);
  const auto slot_of = [&](int64_t index, int64_t k) {
    return (task.blocks[index] * num_kv_heads + task.first_head + k) * block_size;
  };
  for (int64_t start = features.first - features.first % block_size; start < task.length; start += block_size) {
    const int64_t index = start / block_size, skip = std::max<int64_t>(0, features.first - start);
    const int64_t count = std::min(block_size, task.length - start) - skip;
    const bool last = start + block_size >= task.length;
    for (int64_t k = 0; k < task.heads; ++k) {
      const int64_t next = k + 1 < task.heads ? slot_of(index, k + 1) + skip : last ? -1 : slot_of(index + 1, 0);
      const auto head = head_at(HeadRows{slot_of(index, k) + skip, count, next}, k);
      head.scores(scores);
      features.cap(scores, G, block_size, count);
      float rescale[G];
      for (int h = 0; h < G; ++h)
        online_softmax(scores + h * block_size, count, peak[k * G + h], total[k * G + h], rescale[h]);
      head.accumulate(acc_store + k * G * D, rescale, scores, count);
    }
  }
  store_normalized<G, NV>(acc_store, total, task.heads, task.out, task.head_stride);
}

// Shares a batch's query rows out over the threads as Tasks (the arguments are attention_rows_avx512's)
// and calls run(std::integral_constant<int, G>, std::integral_constant<int, NV>, task, its TaskFeatures,
// the thread's scratch) for each, G its query heads per KV head and NV = head_dim / 16. Rows go whole,
// which reads the longest contiguous runs, but are split by KV head when too few to share out; a task takes
// at most 4 query heads of each KV head.
template <class Run>
void for_each_task(const torch::Tensor& q, int64_t num_kv_heads, const torch::Tensor& table,
                   const torch::Tensor& seqs, const torch::Tensor& lengths, const AttnFeatures& features,
                   torch::Tensor& out, Run run) {
  const int64_t rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t group = num_heads / num_kv_heads, width = table.size(1), threads = at::get_num_threads();
  const int64_t splits = rows >= 4 * threads ? 1 : num_kv_heads, heads_per_task = num_kv_heads / splits;
  const bf16* q_ptr = q.data_ptr<bf16>();
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t* seq_ptr = seqs.defined() ? seqs.data_ptr<int64_t>() : nullptr;
  const int64_t* len_ptr = lengths.data_ptr<int64_t>();
  const int64_t q_stride = q.stride(0);
  bf16* out_ptr = out.data_ptr<bf16>();
  const auto with_nv = [&](auto nv, const Task& task, const TaskFeatures& task_features, std::vector<float>& scratch) {
    switch (task.group) {
      case 1: return run(std::integral_constant<int, 1>{}, nv, task, task_features, scratch);
      case 2: return run(std::integral_constant<int, 2>{}, nv, task, task_features, scratch);
      case 3: return run(std::integral_constant<int, 3>{}, nv, task, task_features, scratch);
      default: return run(std::integral_constant<int, 4>{}, nv, task, task_features, scratch);
    }
  };
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < rows * splits; ++index) {
      const int64_t row = index / splits, first_head = (index % splits) * heads_per_task;
      const int64_t* blocks = table_ptr + (seq_ptr ? seq_ptr[row] : row) * width;
      for (int64_t h = 0; h < group; h += 4) {
        const int64_t offset = (first_head * group + h) * head_dim;
        const Task task{q_ptr + row * q_stride + offset, out_ptr + row * num_heads * head_dim + offset, blocks,
                        len_ptr[row], heads_per_task, first_head, group * head_dim, std::min<int64_t>(4, group - h)};
        const TaskFeatures task_features(features, row, len_ptr[row], first_head * group + h, group);
        if (head_dim == 64)
          with_nv(std::integral_constant<int, 4>{}, task, task_features, scratch);
        else
          with_nv(std::integral_constant<int, 8>{}, task, task_features, scratch);
      }
    }
  }
}

}  // namespace attention_avx512

#endif
