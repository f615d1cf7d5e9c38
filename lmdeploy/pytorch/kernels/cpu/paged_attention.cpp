// Paged attention for the CPU. Decode: one new query token per sequence over its cached K/V.
// Prefill: each row of a chunk is such a query over its own prefix (the chunk is in the cache).
// Each (query row, kv head) pair is one task; its K and V are each read once, in block order,
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

// Calls fn(t - from, row) for the cached tokens from <= t < length of one KV head (its rows from
// `head_slot` in each block of `slots_per_block` rows), each row read as fp32 by `rows`.
template <typename Rows, typename Fn>
void for_each_cached_row(const Rows& rows, const int64_t* blocks, int64_t from, int64_t length, int64_t block_size,
                         int64_t slots_per_block, int64_t head_slot, float* row, Fn fn) {
  for (int64_t start = from - from % block_size; start < length; start += block_size) {
    const int64_t first = blocks[start / block_size] * slots_per_block + head_slot;
    const int64_t count = std::min(block_size, length - start);
    for (int64_t t = std::max<int64_t>(0, from - start); t < count; ++t) {
      rows(first + t, row);
      fn(start + t - from, row);
    }
  }
}

template <typename T, typename Rows>
void decode_task(const T* q, const Rows& k_rows, const Rows& v_rows, const int64_t* blocks, int64_t from,
                 int64_t length, int64_t group, int64_t head_dim, int64_t block_size, int64_t slots_per_block,
                 int64_t head_slot, float scale, const AttnFeatures& features, const float* sinks, T* out,
                 std::vector<float>& scores, std::vector<float>& acc) {
  // q, out: the group's `group` query heads, each `head_dim` long; sinks: theirs, or null. Keys [from, length).
  length -= from;
  scores.assign(group * length, 0.f);
  acc.assign(group * head_dim, 0.f);
  std::vector<float> query(group * head_dim), buffer(head_dim);
  for (int64_t i = 0; i < group * head_dim; ++i) query[i] = to_float(q[i]) * scale;
  for_each_cached_row(k_rows, blocks, from, from + length, block_size, slots_per_block, head_slot, buffer.data(),
                      [&](int64_t t, const float* key) {
                        dots(query.data(), key, group, head_dim, scores.data() + t, length);
                      });
  if (const float cap = features.logit_softcap; cap > 0.f)
    for (int64_t i = 0; i < group * length; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
  for (int64_t h = 0; h < group; ++h) softmax(scores.data() + h * length, length, sinks ? sinks + h : nullptr);
  for_each_cached_row(v_rows, blocks, from, from + length, block_size, slots_per_block, head_slot, buffer.data(),
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

template <typename T, typename Rows>
void generic_rows(const T* q, const Rows& k_rows, const Rows& v_rows, const int64_t* table, int64_t width,
                  const int64_t* seqs, const int64_t* lengths, int64_t rows, int64_t q_stride, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                  const AttnFeatures& features, T* out) {
  const int64_t group = num_heads / num_kv_heads, slots_per_block = num_kv_heads * block_size;
  const float* sinks = features.sinks.defined() ? features.sinks.data_ptr<float>() : nullptr;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scores, acc;
#pragma omp for schedule(dynamic, 4)
    for (int64_t task = 0; task < rows * num_kv_heads; ++task) {
      const int64_t row = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t head_offset = kv_head * group * head_dim, out_offset = row * num_heads * head_dim + head_offset;
      const int64_t seq = seqs ? seqs[row] : row;
      decode_task<T>(q + row * q_stride + head_offset, k_rows, v_rows, table + seq * width,
                     features.first(lengths[row], row), lengths[row], group, head_dim, block_size, slots_per_block,
                     kv_head * block_size, scale, features,
                     sinks ? sinks + kv_head * group : nullptr, out + out_offset, scores, acc);
    }
  }
}

// Query row i attends over the first lengths[i] cached tokens of sequence seqs[i] (its row of
// `table`; sequence i when `seqs` is undefined); tasks are (row, KV head) pairs, handed out
// dynamically since their lengths differ. q may be a view with a row stride (q heads of a qkv output).
torch::Tensor attention_rows(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, const KVQuant& quant,
                             const torch::Tensor& table, const torch::Tensor& seqs, const torch::Tensor& lengths,
                             double scale, const AttnFeatures& features) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), "bad shapes");
  TORCH_CHECK(quant.bits ||
                  (q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type()),
              "q and the caches must share a dtype");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  k_cache = k_cache.contiguous();
  v_cache = v_cache.contiguous();
  const int64_t rows = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && (quant.bits || k_cache.size(3) == head_dim), "bad head layout");
  const int64_t width = table.size(1);
  auto out = torch::empty({rows, num_heads, head_dim}, q.options());
  if (quant.bits ? attention_rows_quant_avx512(q, k_cache, v_cache, quant, table, seqs, lengths, scale, features, out)
                 : attention_rows_avx512(q, k_cache, v_cache, table, seqs, lengths, scale, features, out))
    return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    const auto run = [&](const auto& k_rows, const auto& v_rows) {
      generic_rows<scalar_t>(q.data_ptr<scalar_t>(), k_rows, v_rows, table.data_ptr<int64_t>(), width,
                             seqs.defined() ? seqs.data_ptr<int64_t>() : nullptr, lengths.data_ptr<int64_t>(), rows,
                             q.stride(0), num_heads, num_kv_heads, head_dim, block_size, static_cast<float>(scale),
                             features, out.data_ptr<scalar_t>());
    };
    if (quant.bits == 8) {
      run(QuantRows<8>{k_cache.data_ptr<uint8_t>(), quant.k_scales_zeros.data_ptr<float>(), head_dim},
          QuantRows<8>{v_cache.data_ptr<uint8_t>(), quant.v_scales_zeros.data_ptr<float>(), head_dim});
    } else if (quant.bits == 4) {
      run(QuantRows<4>{k_cache.data_ptr<uint8_t>(), quant.k_scales_zeros.data_ptr<float>(), head_dim},
          QuantRows<4>{v_cache.data_ptr<uint8_t>(), quant.v_scales_zeros.data_ptr<float>(), head_dim});
    } else {
      run(DenseRows<scalar_t>{k_cache.data_ptr<scalar_t>(), head_dim},
          DenseRows<scalar_t>{v_cache.data_ptr<scalar_t>(), head_dim});
    }
  });
  return out;
}

}  // namespace

AttnFeatures attn_features(const c10::optional<int64_t>& sliding_window, const c10::optional<double>& logit_softcap,
                           const c10::optional<torch::Tensor>& sinks, int64_t num_heads,
                           const c10::optional<int64_t>& attention_chunk) {
  AttnFeatures features;
  features.sliding_window = sliding_window.value_or(0);
  features.attention_chunk = attention_chunk.value_or(0);
  TORCH_CHECK(features.sliding_window >= 0 && features.attention_chunk >= 0, "a window or chunk is positive");
  TORCH_CHECK(!features.sliding_window || !features.attention_chunk,
              "attention takes a sliding window or an attention chunk, not both");
  features.logit_softcap = static_cast<float>(logit_softcap.value_or(0.));
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == num_heads, "sinks must hold one logit per query head");
    features.sinks = contiguous_as(*sinks, torch::kFloat32);
  }
  return features;
}

// q [B, H, D]; k_cache, v_cache [num_blocks, H_kv, block_size, D] (or quantized, see fill_kv_cache.cpp);
// block_table [B, W]; kv_lens [B].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_table, torch::Tensor kv_lens, double scale,
                                     c10::optional<torch::Tensor> k_scales_zeros,
                                     c10::optional<torch::Tensor> v_scales_zeros, int64_t quant_policy,
                                     c10::optional<int64_t> sliding_window, c10::optional<double> logit_softcap,
                                     c10::optional<torch::Tensor> sinks, c10::optional<int64_t> attention_chunk) {
  const KVQuant quant = kv_quant(k_cache, v_cache, q.size(2), k_scales_zeros, v_scales_zeros, quant_policy);
  return attention_rows(q, k_cache, v_cache, quant, contiguous_as(block_table, torch::kInt64), torch::Tensor(),
                        contiguous_as(kv_lens, torch::kInt64), scale,
                        attn_features(sliding_window, logit_softcap, sinks, q.size(1), attention_chunk));
}

// Causal attention of packed prefill chunks q [T, H, D]: sequence s owns rows q_start[s] to
// q_start[s] + q_len[s] and has ctx_len[s] tokens in the caches, this chunk's included, so each
// row is a decode-style query over its own prefix (the fresh k, v are not needed), unless the
// GEMM-shaped path of paged_prefill_avx512.cpp applies.
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor, torch::Tensor, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor q_start,
                                      torch::Tensor q_len, torch::Tensor ctx_len, int64_t, double scale,
                                      c10::optional<torch::Tensor> k_scales_zeros,
                                      c10::optional<torch::Tensor> v_scales_zeros, int64_t quant_policy,
                                      c10::optional<int64_t> sliding_window, c10::optional<double> logit_softcap,
                                      c10::optional<torch::Tensor> sinks, c10::optional<torch::Tensor> key_limit,
                                      c10::optional<int64_t> attention_chunk) {
  AttnFeatures features = attn_features(sliding_window, logit_softcap, sinks, q.size(1), attention_chunk);
  const KVQuant quant = kv_quant(k_cache, v_cache, q.size(2), k_scales_zeros, v_scales_zeros, quant_policy);
  auto starts = contiguous_as(q_start, torch::kInt64), counts = contiguous_as(q_len, torch::kInt64);
  auto contexts = contiguous_as(ctx_len, torch::kInt64), table = contiguous_as(block_table, torch::kInt64);
  const int64_t* start_ptr = starts.data_ptr<int64_t>();
  const int64_t* count_ptr = counts.data_ptr<int64_t>();
  const int64_t* context_ptr = contexts.data_ptr<int64_t>();
  for (int64_t s = 0; s < starts.size(0); ++s)
    TORCH_CHECK(start_ptr[s] >= 0 && start_ptr[s] + count_ptr[s] <= q.size(0) && count_ptr[s] <= context_ptr[s],
                "prefill rows out of range");
  torch::Tensor limits;
  const int64_t* limit_ptr = nullptr;
  if (key_limit.has_value()) {
    limits = contiguous_as(*key_limit, torch::kInt64);
    TORCH_CHECK(limits.numel() >= q.size(0), "key_limit needs one entry per prefill row");
    limit_ptr = limits.data_ptr<int64_t>();
    for (int64_t s = 0; s < starts.size(0); ++s)
      for (int64_t r = 0; r < count_ptr[s]; ++r) {
        const int64_t limit = limit_ptr[start_ptr[s] + r];
        TORCH_CHECK(limit >= context_ptr[s] - count_ptr[s] + r && limit < context_ptr[s],
                    "a key limit must lie between its row's position and its sequence's last token");
      }
  }
  if (q.stride(2) != 1 || q.stride(1) != q.size(2)) q = q.contiguous();
  if (k_cache.is_contiguous() && v_cache.is_contiguous() &&
      (quant.bits || k_cache.scalar_type() == q.scalar_type())) {
    auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
    if (prefill_attention_avx512(q, k_cache, v_cache, quant, table, starts, counts, contexts, scale, features,
                                 limit_ptr, out))
      return out;
  }
  auto seqs = torch::empty({q.size(0)}, torch::kInt64), lengths = torch::empty({q.size(0)}, torch::kInt64);
  auto ends = torch::empty({limit_ptr ? q.size(0) : 0}, torch::kInt64);
  int64_t* seq_ptr = seqs.data_ptr<int64_t>();
  int64_t* len_ptr = lengths.data_ptr<int64_t>();
  int64_t* end_ptr = ends.data_ptr<int64_t>();
  for (int64_t s = 0; s < starts.size(0); ++s)
    for (int64_t r = 0; r < count_ptr[s]; ++r) {
      const int64_t row = start_ptr[s] + r, end = context_ptr[s] - count_ptr[s] + r + 1;
      seq_ptr[row] = s;
      len_ptr[row] = limit_ptr ? limit_ptr[row] + 1 : end;
      if (limit_ptr) end_ptr[row] = end;
    }
  if (limit_ptr) features.query_ends = end_ptr;
  return attention_rows(q, k_cache, v_cache, quant, table, seqs, lengths, scale, features);
}
