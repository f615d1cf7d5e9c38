// Prefill attention for bf16 caches (or int8/int4 ones, dequantized to bf16 as they are copied)
// and head_dim 64 or 128 with AVX512-BF16, as two small GEMMs per
// (sequence, KV head): the chunk's query vectors (token-major, then the KV head's query heads) against
// the sequence's keys, then the probabilities against its values, both on `vdpbf16ps` tiles like the
// linear layers' (linear_bf16.cpp). Each task first copies its keys and values out of the paged cache
// into those tiles' panel layouts; a tile of up to 6 query vectors then walks the keys 64 at a time
// up to its last token's position, with an online softmax (bf16 probabilities, as torch's CPU flash
// attention uses for bf16) and the causal mask applied per query vector. A sliding window or an
// attention chunk starts the walk at the tile's first key and masks per query vector; soft-capping
// applies to each score, and a query head's sink starts its softmax as its peak with weight 1. With key limits a query vector's keys end
// at its token's limit instead of its position, and the tile walks up to its last limit.
#include <limits>

#include "common.h"

#if defined(__AVX512BF16__)

namespace {

using bf16 = c10::BFloat16;
constexpr int kPanel = 16, kKeys = 64, kTileRows = 6;

// One (sequence, KV head) task. Query vector r is token r / group, query head r % group.
struct PrefillTask {
  const bf16* q;                 // the chunk's first token, at this KV head's first query head
  bf16* out;                     // likewise
  int64_t q_stride, out_stride;  // elements between tokens
  int64_t count;                 // query tokens
  int64_t first_pos;             // position of the first query token (its context is first_pos + 1 keys)
  int64_t group, head_dim;
  float scale;
  const AttnFeatures* bounds;  // the window or attention chunk, whose first_key starts each query's keys
  float softcap;       // 0: none
  const float* sinks;  // this KV head's query heads' sinks, or null
  const int64_t* key_limits;  // the chunk's first token's last key position, then the others'; null: causal
  // the last key position query token `token` attends to
  int64_t limit(int64_t token) const { return key_limits ? key_limits[token] : first_pos + token; }
};

// One bf16 row of a cache: in place, or dequantized into `buffer` (fp32 math, one rounding to bf16, as the
// torch twin dequantizes) from a quantized cache.
struct CacheRows {
  const void* data;
  const float* scales_zeros;  // null for a bf16 cache
  int64_t bits, dim;
  const bf16* row(int64_t slot, float* values, bf16* buffer) const {
    if (!scales_zeros) return static_cast<const bf16*>(data) + slot * dim;
    const uint8_t* codes = static_cast<const uint8_t*>(data);
    if (bits == 8)
      QuantRows<8>{codes, scales_zeros, dim}(slot, values);
    else
      QuantRows<4>{codes, scales_zeros, dim}(slot, values);
    for (int64_t d = 0; d < dim; ++d) buffer[d] = from_float<bf16>(values[d]);
    return buffer;
  }
};

// keys: [ceil(ctx / 16) panels][D / 2 pairs][16 keys] of int32 (bf16 pairs); values: [D / 16 panels]
// [ctx_pad / 2 key pairs][16 dims] of int32 (the pair's two keys); rows past ctx are zero, and so are those before
// `first`, the first key the chunk's first query attends (its window's or attention chunk's): no query attends them,
// and a sliding pool may have given their blocks back.
void pack_context(const CacheRows& cache_k, const CacheRows& cache_v, const int64_t* blocks, int64_t block_size,
                  int64_t slots_per_block, int64_t head_slot, int64_t first, int64_t ctx, int64_t ctx_pad, int64_t D,
                  std::vector<int32_t>& keys, std::vector<int32_t>& values) {
  keys.assign(ctx_pad * D / 2, 0);
  values.assign(ctx_pad * D / 2, 0);
  uint16_t* value_halves = reinterpret_cast<uint16_t*>(values.data());
  alignas(64) float scratch[128];
  alignas(64) bf16 key_row[128], value_row[128];
  for (int64_t t = first; t < ctx; ++t) {
    const int64_t slot = blocks[t / block_size] * slots_per_block + head_slot + t % block_size;
    const int32_t* key = reinterpret_cast<const int32_t*>(cache_k.row(slot, scratch, key_row));
    const uint16_t* value = reinterpret_cast<const uint16_t*>(cache_v.row(slot, scratch, value_row));
    for (int64_t j = 0; j < D / 2; ++j) keys[(t / kPanel * (D / 2) + j) * kPanel + t % kPanel] = key[j];
    for (int64_t d = 0; d < D; ++d)
      value_halves[((d / kPanel * (ctx_pad / 2) + t / 2) * kPanel + d % kPanel) * 2 + t % 2] = value[d];
  }
}

// acc[r][c] += sum over k < steps of the bf16 pairs a[r][k] times the 16 pairs at b + (c * stride + k) * 16.
template <int R, int C>
inline void accumulate(__m512 (&acc)[R][4], const int32_t* const (&a)[R], const int32_t* b, int64_t stride,
                       int64_t steps) {
  for (int64_t k = 0; k < steps; ++k) {
    __m512bh column[C];
    for (int c = 0; c < C; ++c) column[c] = (__m512bh)_mm512_loadu_si512(b + (c * stride + k) * kPanel);
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(a[r][k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pair, column[c]);
    }
  }
}

// Scores of R query vectors against keys [64 g, 64 g + 64): scale * q . k (soft-capped), or lowest() past
// a query's key limit or before its first key (window or chunk); only the first C panels of 16 keys hold
// any key up to the tile's last key limit.
template <int R, int C>
void tile_scores(const PrefillTask& task, int64_t row, int64_t g, const int32_t* keys, float* scores) {
  const int64_t D = task.head_dim, pairs = D / 2;
  const int32_t* q[R];
  int64_t pos[R], limit[R];
  for (int r = 0; r < R; ++r) {
    const int64_t token = (row + r) / task.group, head = (row + r) % task.group;
    q[r] = reinterpret_cast<const int32_t*>(task.q + token * task.q_stride + head * D);
    pos[r] = task.first_pos + token;
    limit[r] = task.limit(token);
  }
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  accumulate<R, C>(acc, q, keys + g * 4 * pairs * kPanel, pairs, pairs);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) {
      const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(g * kKeys + c * kPanel)));
      __mmask16 valid = _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int32_t>(limit[r])));
      if (task.bounds->bounded()) {
        const int32_t first = static_cast<int32_t>(task.bounds->first_key(pos[r]));
        valid &= _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(first));
      }
      __m512 s = _mm512_mul_ps(acc[r][c], _mm512_set1_ps(task.scale));
      if (task.softcap > 0.f) {  // cap * tanh(s / cap), tanh(x) = 1 - 2 / (e^2x + 1)
        const __m512 e = exp_ps(_mm512_mul_ps(s, _mm512_set1_ps(2.f / task.softcap)));
        const __m512 tanh = _mm512_sub_ps(_mm512_set1_ps(1.f),
                                          _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f))));
        s = _mm512_mul_ps(tanh, _mm512_set1_ps(task.softcap));
      }
      _mm512_storeu_ps(scores + r * kKeys + c * kPanel,
                       _mm512_mask_mov_ps(_mm512_set1_ps(std::numeric_limits<float>::lowest()), valid, s));
    }
}

// out[r] = out[r] * rescale[r] + probs[r] . values for dims [16 p, 16 p + 64) over the first `pairs`
// key pairs from key 64 g.
template <int R>
void tile_values(int64_t g, int64_t p, int64_t pairs, const int32_t* probs, const float* rescale,
                 const int32_t* values, int64_t ctx_pairs, int64_t D, float* out) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(out + r * D + (p + c) * kPanel), _mm512_set1_ps(rescale[r]));
  const int32_t* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = probs + r * kKeys / 2;
  accumulate<R, 4>(acc, rows, values + (p * ctx_pairs + g * kKeys / 2) * kPanel, ctx_pairs, pairs);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(out + r * D + (p + c) * kPanel, acc[r][c]);
}

// Query vectors [row, row + R) over their whole causal context.
template <int R>
void tile_rows(const PrefillTask& task, int64_t row, const int32_t* keys, const int32_t* values, int64_t ctx_pairs) {
  const int64_t D = task.head_dim;
  alignas(64) float scores[R * kKeys], out[R * 128] = {}, rescale[R], peak[R], total[R];
  alignas(64) int32_t probs[R * kKeys / 2];
  for (int r = 0; r < R; ++r) {
    peak[r] = task.sinks ? task.sinks[(row + r) % task.group] : std::numeric_limits<float>::lowest();
    total[r] = task.sinks ? 1.f : 0.f;
  }
  int64_t last = 0;
  for (int r = 0; r < R; ++r) last = std::max(last, task.limit((row + r) / task.group));
  const int64_t first = task.bounds->first_key(task.first_pos + row / task.group);
  for (int64_t g = first / kKeys; g * kKeys <= last; ++g) {
    const int64_t panels = std::min<int64_t>(4, (last - g * kKeys) / kPanel + 1);
    switch (panels) {
      case 1: tile_scores<R, 1>(task, row, g, keys, scores); break;
      case 2: tile_scores<R, 2>(task, row, g, keys, scores); break;
      case 3: tile_scores<R, 3>(task, row, g, keys, scores); break;
      default: tile_scores<R, 4>(task, row, g, keys, scores); break;
    }
    for (int r = 0; r < R; ++r) {
      __m512 s[4];
      for (int c = 0; c < 4; ++c) s[c] = _mm512_loadu_ps(scores + r * kKeys + c * kPanel);
      const __m512 peaks = _mm512_max_ps(_mm512_max_ps(s[0], s[1]), _mm512_max_ps(s[2], s[3]));
      const float block_peak = _mm512_reduce_max_ps(peaks);
      const float new_peak = std::max(peak[r], block_peak);
      rescale[r] = total[r] == 0.f ? 0.f : std::exp(peak[r] - new_peak);
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        // Masked scores are lowest(): exp_ps clamps them to e^-88, and the mask zeroes them.
        const __mmask16 valid = _mm512_cmplt_ps_mask(_mm512_set1_ps(std::numeric_limits<float>::lowest()), s[c]);
        const __m512 e = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(s[c], _mm512_set1_ps(new_peak))));
        sum = _mm512_add_ps(sum, e);
        uint16_t* halves = reinterpret_cast<uint16_t*>(probs + r * kKeys / 2);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(halves + c * kPanel), to_bf16(e));
      }
      total[r] = total[r] * rescale[r] + _mm512_reduce_add_ps(sum);
      peak[r] = new_peak;
    }
    for (int64_t p = 0; p < D / kPanel; p += 4)
      tile_values<R>(g, p, panels * kPanel / 2, probs, rescale, values, ctx_pairs, D, out);
  }
  for (int r = 0; r < R; ++r) {
    const int64_t token = (row + r) / task.group, head = (row + r) % task.group;
    bf16* dst = task.out + token * task.out_stride + head * D;
    const __m512 inv = _mm512_set1_ps(1.f / total[r]);
    for (int64_t d = 0; d < D; d += kPanel)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          to_bf16(_mm512_mul_ps(_mm512_loadu_ps(out + r * D + d), inv)));
  }
}

void run_task(const PrefillTask& task, const int32_t* keys, const int32_t* values, int64_t ctx_pairs) {
  const int64_t rows = task.count * task.group;
  int64_t row = 0;
  for (; row + kTileRows <= rows; row += kTileRows) tile_rows<kTileRows>(task, row, keys, values, ctx_pairs);
  switch (rows - row) {
    case 1: return tile_rows<1>(task, row, keys, values, ctx_pairs);
    case 2: return tile_rows<2>(task, row, keys, values, ctx_pairs);
    case 3: return tile_rows<3>(task, row, keys, values, ctx_pairs);
    case 4: return tile_rows<4>(task, row, keys, values, ctx_pairs);
    case 5: return tile_rows<5>(task, row, keys, values, ctx_pairs);
    default: return;
  }
}

}  // namespace

bool prefill_attention_avx512(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const KVQuant& quant, const torch::Tensor& table, const torch::Tensor& starts,
                              const torch::Tensor& counts, const torch::Tensor& contexts, double scale,
                              const AttnFeatures& features, const int64_t* key_limits, torch::Tensor& out) {
  const int64_t D = q.size(2);
  if (q.scalar_type() != at::kBFloat16 || (D != 64 && D != 128)) return false;
  const int64_t num_heads = q.size(1), num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  const int64_t block_size = k_cache.size(2), slots_per_block = num_kv_heads * block_size;
  const CacheRows cache_k{k_cache.data_ptr(), quant.bits ? quant.k_scales_zeros.data_ptr<float>() : nullptr,
                          quant.bits, D};
  const CacheRows cache_v{v_cache.data_ptr(), quant.bits ? quant.v_scales_zeros.data_ptr<float>() : nullptr,
                          quant.bits, D};
  const int64_t sequences = starts.size(0), width = table.size(1), q_stride = q.stride(0);
  const int64_t* start_ptr = starts.data_ptr<int64_t>();
  const int64_t* count_ptr = counts.data_ptr<int64_t>();
  const int64_t* context_ptr = contexts.data_ptr<int64_t>();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<int32_t> keys, values;
#pragma omp for schedule(dynamic, 1)
    for (int64_t index = 0; index < sequences * num_kv_heads; ++index) {
      const int64_t s = index / num_kv_heads, kv_head = index % num_kv_heads;
      const int64_t ctx = context_ptr[s], ctx_pad = (ctx + kKeys - 1) / kKeys * kKeys;
      pack_context(cache_k, cache_v, table.data_ptr<int64_t>() + s * width, block_size, slots_per_block,
                   kv_head * block_size, features.first_key(ctx - count_ptr[s]), ctx, ctx_pad, D, keys, values);
      const int64_t head = kv_head * group * D;
      const PrefillTask task{q.data_ptr<bf16>() + start_ptr[s] * q_stride + head,
                             out.data_ptr<bf16>() + start_ptr[s] * num_heads * D + head, q_stride, num_heads * D,
                             count_ptr[s], ctx - count_ptr[s], group, D, static_cast<float>(scale),
                             &features, features.logit_softcap,
                             features.sinks.defined() ? features.sinks.data_ptr<float>() + kv_head * group : nullptr,
                             key_limits ? key_limits + start_ptr[s] : nullptr};
      run_task(task, keys.data(), values.data(), ctx_pad / 2);
    }
  }
  return true;
}

#else

bool prefill_attention_avx512(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const KVQuant&,
                              const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                              double, const AttnFeatures&, const int64_t*, torch::Tensor&) {
  return false;
}

#endif
