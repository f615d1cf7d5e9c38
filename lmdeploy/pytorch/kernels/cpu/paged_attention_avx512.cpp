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

// A task is one query row over `heads` consecutive KV heads and G query heads of each (q and out
// hold KV head k's heads from q + k * head_stride). Blocks are the outer loop, so a task reads each
// block's rows of its KV heads in order (a block holds head k's rows from k * block_size * D).
struct Task {
  const bf16* q;
  bf16* out;
  const int64_t* blocks;  // the row's block-table row
  int64_t length;         // cached tokens
  int64_t heads;          // KV heads in the task
  int64_t head_stride;    // elements of q and out between consecutive KV heads
  int64_t cache_offset;   // elements from a block's start to the task's first KV head
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

// A task's rows stream block by block, each KV head's K rows then its V rows, so that memory never
// idles between a scores pass and a values pass: flash-decoding's online softmax in one thread.
template <int G, int NV>
void run_task(const Task& task, const TaskFeatures& features, const bf16* k_cache, const bf16* v_cache,
              int64_t block_size, int64_t block_stride, float scale, std::vector<float>& scratch) {
  constexpr int D = 16 * NV;
  const int64_t rows = task.heads * G;
  scratch.resize(G * block_size + rows * (D + 2));
  float* scores = scratch.data();
  float* acc_store = scores + G * block_size;
  float* peak = acc_store + rows * D;
  float* total = peak + rows;
  std::fill(acc_store, acc_store + rows * D, 0.f);
  features.start(task.heads, G, peak, total);
  for (int64_t start = features.first - features.first % block_size; start < task.length; start += block_size) {
    const int64_t index = start / block_size, skip = std::max<int64_t>(0, features.first - start);
    const int64_t in_block = std::min(block_size, task.length - start) - skip;
    const int64_t offset = task.blocks[index] * block_stride + task.cache_offset + skip * D;
    const bool last = start + block_size >= task.length;
    const int64_t next_offset = last ? 0 : task.blocks[index + 1] * block_stride + task.cache_offset;
    for (int64_t k = 0; k < task.heads; ++k) {
      const bf16* keys = k_cache + offset + k * block_size * D;
      const bf16* values = v_cache + offset + k * block_size * D;
      block_scores<G, NV>(task.q + k * task.head_stride, keys, in_block, scale, values, scores, block_size);
      features.cap(scores, G, block_size, in_block);
      float rescale[G];
      for (int h = 0; h < G; ++h)
        online_softmax(scores + h * block_size, in_block, peak[k * G + h], total[k * G + h], rescale[h]);
      const bf16* pull = k + 1 < task.heads ? keys + block_size * D
                         : last                ? nullptr
                                               : k_cache + next_offset;
      accumulate_values<G, NV>(acc_store + k * G * D, rescale, scores, block_size, in_block,
                               [&](int64_t t, auto& value) {
                                 if (pull) prefetch_l2(pull + t * D, D * 2);
                                 for (int i = 0; i < NV; ++i) value[i] = load_bf16(values + t * D + 16 * i);
                               });
    }
  }
  store_normalized<G, NV>(acc_store, total, task.heads, task.out, task.head_stride);
}

using TaskFn = void (*)(const Task&, const TaskFeatures&, const bf16*, const bf16*, int64_t, int64_t, float,
                        std::vector<float>&);

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
                           double scale, const AttnFeatures& features, torch::Tensor& out) {
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
        fn(task, TaskFeatures(features, len_ptr[row], first_head * group + h, group), k_ptr, v_ptr, block_size,
           block_stride, static_cast<float>(scale), scratch);
      }
    }
  }
  return true;
}

#else

bool attention_rows_avx512(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                           const torch::Tensor&, const torch::Tensor&, double, const AttnFeatures&, torch::Tensor&) {
  return false;
}

#endif
