// The AVX-512 path of paged attention (decode rows, and prefill rows as decode-style queries) for
// bf16 caches and head_dim 64 or 128; paged_attention.cpp states the contract. Scores are computed
// 16 keys at a time: each key gives a vector of partial dot products (with AVX512-BF16: bf16 pairs
// accumulated in fp32), and one transposing reduction turns 16 such vectors into the 16 scores.
// The weighted sum of V keeps its accumulators in registers.
#include "common.h"

#if defined(__AVX512F__)

namespace {

using bf16 = c10::BFloat16;
constexpr int kChunk = 16;

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

// Pulls the given bytes into L2. Each pass prefetches the next block's rows as it works through the
// current block's (after K's last block, V's first: the values pass comes next), which hides memory
// latency that the hardware prefetcher, stopping at every scattered block, leaves exposed.
inline void prefetch_l2(const c10::BFloat16* p, int64_t bytes) {
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

// A task is one query row over `heads` consecutive KV heads and G query heads of each (q and out
// hold KV head k's heads from q + k * head_stride). Blocks are the outer loop, so a task reads each
// block's rows of its KV heads as one contiguous run (a block holds head k's rows from
// k * block_size * D).
struct Task {
  const bf16* q;
  bf16* out;
  const int64_t* blocks;  // the row's block-table row
  int64_t length;         // cached tokens
  int64_t heads;          // KV heads in the task
  int64_t head_stride;    // elements of q and out between consecutive KV heads
  int64_t cache_offset;   // elements from a block's start to the task's first KV head
};

// scores[(k * G + h) * length + t] = scale * q_{k,h} . k_{k,t} for KV head k and query head h of it.
template <int G, int NV>
void task_scores(const Task& task, const bf16* k_cache, const bf16* v_cache, int64_t block_size,
                 int64_t block_stride, float scale, float* scores) {
  constexpr int D = 16 * NV;
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 partial[kChunk];
  for (int64_t start = 0; start < task.length; start += block_size) {
    const bf16* block = k_cache + task.blocks[start / block_size] * block_stride + task.cache_offset;
    const bf16* next = start + block_size < task.length
                           ? k_cache + task.blocks[start / block_size + 1] * block_stride + task.cache_offset
                           : v_cache + task.blocks[0] * block_stride + task.cache_offset;
    const int64_t in_block = std::min(block_size, task.length - start);
    for (int64_t k = 0; k < task.heads; ++k) {
      const bf16* rows = block + k * block_size * D;
      for (int64_t first = 0; first < in_block; first += kChunk) {
        const int count = static_cast<int>(std::min<int64_t>(kChunk, in_block - first));
        prefetch_l2(next + (k * block_size + first) * D, std::min<int64_t>(kChunk, block_size - first) * D * 2);
        for (int h = 0; h < G; ++h) {
          const QueryHead<NV> query(task.q + k * task.head_stride + h * D);
          for (int t = 0; t < kChunk; ++t)
            partial[slot(t)] = t < count ? query.dot(rows + (first + t) * D) : _mm512_setzero_ps();
          const __m512 chunk = _mm512_mul_ps(sum16(partial), scale_v);
          _mm512_mask_storeu_ps(scores + (k * G + h) * task.length + start + first,
                                static_cast<__mmask16>((1u << count) - 1), chunk);
        }
      }
    }
  }
}

// out_{k,h} = sum_t p[k][h][t] * v_{k,t}; accumulators live in registers within a block.
template <int G, int NV>
void task_values(const Task& task, const float* probs, const bf16* v_cache, int64_t block_size,
                 int64_t block_stride, float* acc_store) {
  constexpr int D = 16 * NV;
  std::fill(acc_store, acc_store + task.heads * G * D, 0.f);
  for (int64_t start = 0; start < task.length; start += block_size) {
    const bf16* block = v_cache + task.blocks[start / block_size] * block_stride + task.cache_offset;
    const bf16* next = start + block_size < task.length
                           ? v_cache + task.blocks[start / block_size + 1] * block_stride + task.cache_offset
                           : nullptr;
    const int64_t in_block = std::min(block_size, task.length - start);
    for (int64_t k = 0; k < task.heads; ++k) {
      const bf16* rows = block + k * block_size * D;
      const float* p = probs + k * G * task.length + start;
      float* stored = acc_store + k * G * D;
      __m512 acc[G][NV];
      for (int h = 0; h < G; ++h)
        for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_loadu_ps(stored + h * D + 16 * i);
      for (int64_t t = 0; t < in_block; ++t) {
        if (next) prefetch_l2(next + (k * block_size + t) * D, D * 2);
        __m512 value[NV];
        for (int i = 0; i < NV; ++i) value[i] = load_bf16(rows + t * D + 16 * i);
        for (int h = 0; h < G; ++h) {
          const __m512 weight = _mm512_set1_ps(p[h * task.length + t]);
          for (int i = 0; i < NV; ++i) acc[h][i] = _mm512_fmadd_ps(weight, value[i], acc[h][i]);
        }
      }
      for (int h = 0; h < G; ++h)
        for (int i = 0; i < NV; ++i) _mm512_storeu_ps(stored + h * D + 16 * i, acc[h][i]);
    }
  }
  for (int64_t k = 0; k < task.heads; ++k)
    for (int h = 0; h < G; ++h)
      for (int i = 0; i < NV; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(task.out + k * task.head_stride + h * D + 16 * i),
                            to_bf16(_mm512_loadu_ps(acc_store + (k * G + h) * D + 16 * i)));
}

template <int G, int NV>
void run_task(const Task& task, const bf16* k_cache, const bf16* v_cache, int64_t block_size, int64_t block_stride,
              float scale, std::vector<float>& scratch) {
  constexpr int D = 16 * NV;
  const int64_t rows = task.heads * G;
  scratch.resize(rows * (task.length + D));
  float* scores = scratch.data();
  task_scores<G, NV>(task, k_cache, v_cache, block_size, block_stride, scale, scores);
  for (int64_t r = 0; r < rows; ++r) softmax(scores + r * task.length, task.length);
  task_values<G, NV>(task, scores, v_cache, block_size, block_stride, scores + rows * task.length);
}

using TaskFn = void (*)(const Task&, const bf16*, const bf16*, int64_t, int64_t, float, std::vector<float>&);

template <int NV>
TaskFn task_for(int64_t heads) {
  switch (heads) {
    case 1: return &run_task<1, NV>;
    case 2: return &run_task<2, NV>;
    case 3: return &run_task<3, NV>;
    default: return &run_task<4, NV>;
  }
}

}  // namespace

bool attention_rows_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& table, const torch::Tensor& seqs, const torch::Tensor& lengths,
                           double scale, torch::Tensor& out) {
  const int64_t head_dim = q.size(2);
  if (q.scalar_type() != at::kBFloat16 || (head_dim != 64 && head_dim != 128)) return false;
  const int64_t rows = q.size(0), num_heads = q.size(1), num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads, block_size = k_cache.size(2), width = table.size(1);
  const int64_t block_stride = num_kv_heads * block_size * head_dim, threads = at::get_num_threads();
  // Whole rows read the longest contiguous runs; rows are split by KV head only when too few to share out.
  const int64_t splits = rows >= 4 * threads ? 1 : num_kv_heads, heads_per_task = num_kv_heads / splits;
  const bf16* q_ptr = q.data_ptr<bf16>();
  const bf16* k_ptr = k_cache.data_ptr<bf16>();
  const bf16* v_ptr = v_cache.data_ptr<bf16>();
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t* seq_ptr = seqs.defined() ? seqs.data_ptr<int64_t>() : nullptr;
  const int64_t q_stride = q.stride(0);
  const int64_t* len_ptr = lengths.data_ptr<int64_t>();
  bf16* out_ptr = out.data_ptr<bf16>();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < rows * splits; ++index) {
      const int64_t row = index / splits, first_head = (index % splits) * heads_per_task;
      const int64_t* blocks = table_ptr + (seq_ptr ? seq_ptr[row] : row) * width;
      for (int64_t h = 0; h < group; h += 4) {  // at most 4 query heads of each KV head per pass
        const int64_t offset = (first_head * group + h) * head_dim;
        const Task task{q_ptr + row * q_stride + offset, out_ptr + row * num_heads * head_dim + offset,
                        blocks, len_ptr[row], heads_per_task, group * head_dim,
                        first_head * block_size * head_dim};
        const int64_t heads = std::min<int64_t>(4, group - h);
        const TaskFn fn = head_dim == 64 ? task_for<4>(heads) : task_for<8>(heads);
        fn(task, k_ptr, v_ptr, block_size, block_stride, static_cast<float>(scale), scratch);
      }
    }
  }
  return true;
}

#else

bool attention_rows_avx512(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                           const torch::Tensor&, const torch::Tensor&, double, torch::Tensor&) {
  return false;
}

#endif
