// Writes a step's new K/V rows into the paged caches: a copy per (token, kv head) row, or with a
// quantized cache the row's codes and its scale and zero point (kv_quant.py states the scheme).
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)

inline __m512 load_values(const float* p, __mmask16 lanes) { return _mm512_maskz_loadu_ps(lanes, p); }
inline __m512 load_values(const double* p, __mmask16 lanes) {
  const __m256 low = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(static_cast<__mmask8>(lanes), p));
  const __m256 high = _mm512_cvtpd_ps(_mm512_maskz_loadu_pd(static_cast<__mmask8>(lanes >> 8), p + 8));
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(low)), _mm256_castps_pd(high), 1));
}
inline __m512 load_values(const c10::BFloat16* p, __mmask16 lanes) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes, p)), 16));
}
inline __m512 load_values(const c10::Half* p, __mmask16 lanes) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, p));
}

// A row of `dim` values as codes 0..top into q, with its scale and minimum (kv_quant.py's quantize_kv), 16
// values a step.
template <typename T>
void quantize_row(const T* values, int64_t dim, float top, uint8_t* q, float& scale, float& low) {
  const auto lanes = [&](int64_t d) {
    return dim - d >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << (dim - d)) - 1);
  };
  __m512 least = _mm512_set1_ps(std::numeric_limits<float>::max());
  __m512 most = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 mask = lanes(d);
    const __m512 x = load_values(values + d, mask);
    least = _mm512_mask_min_ps(least, mask, least, x);
    most = _mm512_mask_max_ps(most, mask, most, x);
  }
  low = _mm512_reduce_min_ps(least);
  scale = std::max((_mm512_reduce_max_ps(most) - low) / top, 1e-8f);
  const __m512 inv = _mm512_set1_ps(1.f / scale), shift = _mm512_set1_ps(low), half = _mm512_set1_ps(.5f);
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 mask = lanes(d);
    const __m512 x = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(load_values(values + d, mask), shift), inv), half);
    const __m512 code = _mm512_min_ps(_mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC),
                                      _mm512_set1_ps(top));
    _mm_mask_storeu_epi8(q + d, mask, _mm512_cvtepi32_epi8(_mm512_cvttps_epi32(code)));
  }
}

#else

template <typename T>
void quantize_row(const T* values, int64_t dim, float top, uint8_t* q, float& scale, float& low) {
  low = to_float(values[0]);
  float high = low;
  for (int64_t d = 0; d < dim; ++d) {
    low = std::min(low, to_float(values[d]));
    high = std::max(high, to_float(values[d]));
  }
  scale = std::max((high - low) / top, 1e-8f);
  const float inv = 1.f / scale;
  for (int64_t d = 0; d < dim; ++d)
    q[d] = static_cast<uint8_t>(std::min(std::floor((to_float(values[d]) - low) * inv + .5f), top));
}

#endif

template <typename T>
void quantize_rows(const torch::Tensor& src, torch::Tensor& codes, torch::Tensor& scales_zeros, int64_t bits,
                   const int64_t* blocks, const int64_t* offsets) {
  const int64_t tokens = src.size(0), heads = src.size(1), dim = src.size(2), block_size = codes.size(2);
  const int64_t row_bytes = dim * bits / 8, src_stride = src.stride(0);
  const float top = static_cast<float>((1 << bits) - 1);
  const T* from = src.data_ptr<T>();
  uint8_t* to = codes.data_ptr<uint8_t>();
  float* scales = scales_zeros.data_ptr<float>();
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> q(bits == 8 ? 0 : dim);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads, h = row % heads;
      const int64_t slot = (blocks[t] * heads + h) * block_size + offsets[t];
      uint8_t* out = to + slot * row_bytes;
      quantize_row(from + t * src_stride + h * dim, dim, top, bits == 8 ? out : q.data(), scales[2 * slot],
                   scales[2 * slot + 1]);
      if (bits == 4)
        for (int64_t j = 0; j < dim / 2; ++j) out[j] = static_cast<uint8_t>(q[j] | (q[j + dim / 2] << 4));
    }
  });
}

}  // namespace

KVQuant kv_quant(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t head_dim,
                 const c10::optional<torch::Tensor>& k_scales_zeros, const c10::optional<torch::Tensor>& v_scales_zeros,
                 int64_t quant_policy) {
  if (quant_policy == 0) return {};
  TORCH_CHECK((quant_policy == 8 || quant_policy == 4) && k_scales_zeros && v_scales_zeros,
              "quant_policy is 0, 4 or 8, and 4 and 8 need the caches' scales and zero points");
  TORCH_CHECK(k_cache.scalar_type() == at::kByte && v_cache.scalar_type() == at::kByte &&
                  k_cache.size(3) == head_dim * quant_policy / 8 && head_dim % 2 == 0,
              "a quantized cache holds uint8 codes, head_dim * quant_policy / 8 bytes per row");
  const std::vector<int64_t> shape{k_cache.size(0), k_cache.size(1), k_cache.size(2), 2};
  TORCH_CHECK(k_scales_zeros->sizes() == shape && v_scales_zeros->sizes() == shape,
              "scales and zeros are [num_blocks, H_kv, block_size, 2]");
  return {contiguous_as(*k_scales_zeros, torch::kFloat32), contiguous_as(*v_scales_zeros, torch::kFloat32),
          quant_policy};
}

// k, v [T, H_kv, D] (any token stride); caches [num_blocks, H_kv, block_size, D] (quantized: D * bits / 8
// bytes, with scales and zeros [num_blocks, H_kv, block_size, 2]); token i goes to block blocks[i] at offsets[i].
void fill_kv_cache(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
                   torch::Tensor blocks, torch::Tensor offsets, c10::optional<torch::Tensor> k_scales_zeros,
                   c10::optional<torch::Tensor> v_scales_zeros, int64_t quant_policy) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k.size(1) == k_cache.size(1) && blocks.numel() == k.size(0) && offsets.numel() == k.size(0),
              "fill_kv_cache: bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "fill_kv_cache: the caches must be contiguous");
  if (k.stride(2) != 1 || k.stride(1) != k.size(2)) k = k.contiguous();
  if (v.stride(2) != 1 || v.stride(1) != v.size(2)) v = v.contiguous();
  auto block_ids = contiguous_as(blocks, torch::kInt64);
  auto slots = contiguous_as(offsets, torch::kInt64);
  const int64_t* block_ptr = block_ids.data_ptr<int64_t>();
  const int64_t* slot_ptr = slots.data_ptr<int64_t>();
  if (quant_policy == 0) {
    TORCH_CHECK(k.size(2) == k_cache.size(3) && k.scalar_type() == k_cache.scalar_type() &&
                    v.scalar_type() == v_cache.scalar_type(),
                "fill_kv_cache: K/V and the caches must share a dtype and head_dim");
    copy_rows(k, k_cache, block_ptr, slot_ptr);
    copy_rows(v, v_cache, block_ptr, slot_ptr);
    return;
  }
  const KVQuant quant = kv_quant(k_cache, v_cache, k.size(2), k_scales_zeros, v_scales_zeros, quant_policy);
  TORCH_CHECK(k_scales_zeros->is_contiguous() && k_scales_zeros->scalar_type() == at::kFloat &&
                  v_scales_zeros->is_contiguous() && v_scales_zeros->scalar_type() == at::kFloat,
              "fill_kv_cache: scales and zeros must be contiguous fp32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k.scalar_type(), "fill_kv_cache", [&] {
    quantize_rows<scalar_t>(k, k_cache, *k_scales_zeros, quant.bits, block_ptr, slot_ptr);
    quantize_rows<scalar_t>(v, v_cache, *v_scales_zeros, quant.bits, block_ptr, slot_ptr);
  });
}
