// Writes a step's new K/V rows into the paged caches: a copy per (token, kv head) row.
#include "common.h"

namespace {

void copy_rows(const torch::Tensor& src, torch::Tensor& cache, const int64_t* blocks, const int64_t* offsets) {
  const int64_t tokens = src.size(0), heads = src.size(1), row_bytes = src.size(2) * src.element_size();
  const int64_t block_size = cache.size(2);
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(cache.data_ptr());
  const int64_t src_stride = src.stride(0) * src.element_size();
  at::parallel_for(0, tokens * heads, 256, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads, h = row % heads;
      const int64_t slot = (blocks[t] * heads + h) * block_size + offsets[t];
      std::memcpy(to + slot * row_bytes, from + t * src_stride + h * row_bytes, row_bytes);
    }
  });
}

}  // namespace

// k, v [T, H_kv, D] (any token stride); caches [num_blocks, H_kv, block_size, D]; token i goes to
// block blocks[i] at offsets[i].
void fill_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor blocks, torch::Tensor offsets) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(3) && blocks.numel() == k.size(0) &&
                  offsets.numel() == k.size(0),
              "fill_kv_cache: bad shapes");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "fill_kv_cache: K/V and the caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "fill_kv_cache: the caches must be contiguous");
  if (k.stride(2) != 1 || k.stride(1) != k.size(2)) k = k.contiguous();
  if (v.stride(2) != 1 || v.stride(1) != v.size(2)) v = v.contiguous();
  auto block_ids = contiguous_as(blocks, torch::kInt64);
  auto slots = contiguous_as(offsets, torch::kInt64);
  copy_rows(k, k_cache, block_ids.data_ptr<int64_t>(), slots.data_ptr<int64_t>());
  copy_rows(v, v_cache, block_ids.data_ptr<int64_t>(), slots.data_ptr<int64_t>());
}
