// Paged decode attention for the CPU: one new query token per sequence over its cached K/V.
// Each (sequence, kv head) pair is one task; its K and V are each read once, in block order,
// and scores, softmax and the weighted sum of V are accumulated in fp32.
#include "common.h"

namespace {

// Scores of one key row against `G` query heads, sharing each load of the key.
template <int G>
inline void group_dots(const float* query, const float* key, int64_t head_dim, float* out, int64_t stride) {
  float acc[G] = {};
#pragma omp simd reduction(+ : acc[:G])
  for (int64_t d = 0; d < head_dim; ++d)
    for (int h = 0; h < G; ++h) acc[h] += query[h * head_dim + d] * key[d];
  for (int h = 0; h < G; ++h) out[h * stride] = acc[h];
}

inline void dots(const float* query, const float* key, int64_t group, int64_t head_dim, float* out, int64_t stride) {
  switch (group) {
    case 1: return group_dots<1>(query, key, head_dim, out, stride);
    case 2: return group_dots<2>(query, key, head_dim, out, stride);
    case 3: return group_dots<3>(query, key, head_dim, out, stride);
    case 4: return group_dots<4>(query, key, head_dim, out, stride);
    default:
      for (int64_t h = 0; h < group; h += 4)
        dots(query + h * head_dim, key, std::min<int64_t>(4, group - h), head_dim, out + h * stride, stride);
  }
}

// Calls fn(t, row) for the cached tokens t < length of one KV head, each row converted to fp32.
template <typename T, typename Fn>
void for_each_cached_row(const T* cache, const int64_t* blocks, int64_t length, int64_t head_dim, int64_t block_size,
                         int64_t block_stride, float* row, Fn fn) {
  for (int64_t start = 0; start < length; start += block_size) {
    const T* block = cache + blocks[start / block_size] * block_stride;
    const int64_t count = std::min(block_size, length - start);
    for (int64_t t = 0; t < count; ++t) {
      const T* cached = block + t * head_dim;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(cached[d]);
      fn(start + t, row);
    }
  }
}

template <typename T>
void decode_task(const T* q, const T* k_cache, const T* v_cache, const int64_t* blocks, int64_t length,
                 int64_t group, int64_t head_dim, int64_t block_size, int64_t block_stride, float scale,
                 T* out, std::vector<float>& scores, std::vector<float>& acc) {
  // q, out: the group's `group` query heads, each `head_dim` long; block_stride: elements between blocks.
  scores.assign(group * length, 0.f);
  acc.assign(group * head_dim, 0.f);
  std::vector<float> query(group * head_dim), buffer(head_dim);
  for (int64_t i = 0; i < group * head_dim; ++i) query[i] = to_float(q[i]) * scale;
  for_each_cached_row(k_cache, blocks, length, head_dim, block_size, block_stride, buffer.data(),
                      [&](int64_t t, const float* key) {
                        dots(query.data(), key, group, head_dim, scores.data() + t, length);
                      });
  for (int64_t h = 0; h < group; ++h) softmax(scores.data() + h * length, length);
  for_each_cached_row(v_cache, blocks, length, head_dim, block_size, block_stride, buffer.data(),
                      [&](int64_t t, const float* value) {
                        for (int64_t h = 0; h < group; ++h) {
                          const float p = scores[h * length + t];
                          float* head_acc = acc.data() + h * head_dim;
#pragma omp simd
                          for (int64_t d = 0; d < head_dim; ++d) head_acc[d] += p * value[d];
                        }
                      });
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = static_cast<T>(acc[i]);
}

}  // namespace

// q [B, H, D]; k_cache, v_cache [num_blocks, H_kv, block_size, D]; block_table [B, W]; kv_lens [B].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor kv_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "q and the caches must share a dtype");
  q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  auto table = block_table.to(torch::kInt64).contiguous();
  auto lens = kv_lens.to(torch::kInt64).contiguous();
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && k_cache.size(3) == head_dim, "bad head layout");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t width = table.size(1);
  const int64_t block_stride = num_kv_heads * block_size * head_dim;
  auto out = torch::empty_like(q);
  if (paged_decode_attention_avx512(q, k_cache, v_cache, table, lens, scale, out)) return out;
  const int64_t* table_ptr = table.data_ptr<int64_t>();
  const int64_t* lens_ptr = lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q_ptr = q.data_ptr<scalar_t>();
    const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / num_kv_heads, kv_head = task % num_kv_heads;
        const int64_t head_offset = (b * num_heads + kv_head * group) * head_dim;
        decode_task<scalar_t>(q_ptr + head_offset, k_ptr + kv_head * block_size * head_dim,
                              v_ptr + kv_head * block_size * head_dim, table_ptr + b * width, lens_ptr[b],
                              group, head_dim, block_size, block_stride, static_cast<float>(scale),
                              out_ptr + head_offset, scores, acc);
      }
    });
  });
  return out;
}
