// Fused row-wise kernels for the CPU: RMSNorm with the residual add, SiLU-and-mul, rotary embedding
// and the greedy argmax. Each row is read once and written once; the math is in fp32 with the
// roundings of the torch versions.
#include "common.h"

template <typename T>
void silu_and_mul_row(const T* gate_up, T* out, int64_t size) {
  const T* up = gate_up + size;
#pragma omp simd
  for (int64_t i = 0; i < size; ++i) {
    const float g = to_float(gate_up[i]);
    out[i] = from_float<T>(to_float(from_float<T>(g / (1.f + std::exp(-g)))) * to_float(up[i]));
  }
}
template void silu_and_mul_row(const float*, float*, int64_t);
template void silu_and_mul_row(const c10::BFloat16*, c10::BFloat16*, int64_t);
template void silu_and_mul_row(const c10::Half*, c10::Half*, int64_t);

namespace {

template <typename T>
void rms_norm_rows(const T* x, const T* residual, const T* weight, T* out, T* summed, int64_t rows,
                   int64_t size, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * size;
      T* sr = summed + r * size;  // the sum is only written when there is a residual
      T* outr = out + r * size;
      if (residual) {
        const T* rr = residual + r * size;
#pragma omp simd
        for (int64_t i = 0; i < size; ++i) sr[i] = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
      }
      const T* src = residual ? sr : xr;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < size; ++i) squares += to_float(src[i]) * to_float(src[i]);
      const float inv_rms = 1.f / std::sqrt(squares / size + eps);
#pragma omp simd
      for (int64_t i = 0; i < size; ++i)
        outr[i] = from_float<T>(to_float(from_float<T>(to_float(src[i]) * inv_rms)) * to_float(weight[i]));
    }
  });
}

template <typename T>
void silu_and_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t size) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_and_mul_row(gate_up + r * 2 * size, out + r * size, size);
  });
}

template <typename T>
void rotary_rows(const T* x, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads, int64_t dim,
                 int64_t token_stride) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads;
      const T* xr = x + t * token_stride + (row % heads) * dim;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      T* outr = out + row * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float lo = to_float(from_float<T>(to_float(xr[i]) * to_float(c[i])));
        outr[i] = from_float<T>(lo + to_float(from_float<T>(-to_float(xr[i + half]) * to_float(s[i]))));
        const float hi = to_float(from_float<T>(to_float(xr[i + half]) * to_float(c[i + half])));
        outr[i + half] = from_float<T>(hi + to_float(from_float<T>(to_float(xr[i]) * to_float(s[i + half]))));
      }
    }
  });
}

}  // namespace

// x [..., H] (plus residual of the same shape) -> (rms_norm(x + residual) * weight, x + residual).
std::tuple<torch::Tensor, torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                                  c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(weight.dim() == 1 && x.dim() >= 1 && weight.size(0) == x.size(-1), "rms_norm: bad shapes");
  x = x.contiguous();
  auto w = contiguous_as(weight, x.scalar_type());
  auto res = residual.has_value() ? residual->contiguous() : torch::Tensor();
  TORCH_CHECK(!res.defined() || (res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type()),
              "rms_norm: the residual must match x");
  auto out = torch::empty_like(x);
  auto summed = res.defined() ? torch::empty_like(x) : x;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), res.defined() ? res.data_ptr<scalar_t>() : nullptr,
                            w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), summed.data_ptr<scalar_t>(),
                            x.numel() / x.size(-1), x.size(-1), static_cast<float>(eps));
  });
  return {out, summed};
}

// gate_up [..., 2I] (gate then up) -> silu(gate) * up [..., I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_and_mul: bad shape");
  gate_up = gate_up.contiguous();
  const int64_t size = gate_up.size(-1) / 2;
  auto shape = gate_up.sizes().vec();
  shape.back() = size;
  auto out = torch::empty(shape, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.numel() / (2 * size),
                                size);
  });
  return out;
}

// x [T, H, D] (any token stride), cos, sin [T, D] -> x rotated (rotate-half layout), contiguous.
torch::Tensor apply_rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) &&
                  cos.size(1) == x.size(2) && x.size(2) % 2 == 0,
              "apply_rotary: bad shapes");
  if (x.stride(2) != 1 || x.stride(1) != x.size(2)) x = x.contiguous();
  cos = contiguous_as(cos, x.scalar_type());
  sin = contiguous_as(sin, x.scalar_type());
  auto out = torch::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "apply_rotary", [&] {
    rotary_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                          out.data_ptr<scalar_t>(), x.size(0), x.size(1), x.size(2), x.stride(0));
  });
  return out;
}

namespace {

// The first index of each row's largest value (NaN never wins; an all-NaN row gives 0), like argmax
// on finite rows. With AVX-512 every lane keeps the first best of its own indices.
template <typename T>
int64_t argmax_row(const T* x, int64_t size) {
  int64_t i = 0;
  float best = -INFINITY;
  int64_t best_index = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>) {
    __m512 lane_best = _mm512_set1_ps(-INFINITY);
    __m512i lane_index = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                           12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    for (; i + 16 <= size; i += 16, index = _mm512_add_epi32(index, step)) {
      __m512 v;
      if constexpr (std::is_same_v<T, float>)
        v = _mm512_loadu_ps(x + i);
      else
        v = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i))), 16));
      const __mmask16 better = _mm512_cmp_ps_mask(v, lane_best, _CMP_GT_OQ);
      lane_best = _mm512_mask_mov_ps(lane_best, better, v);
      lane_index = _mm512_mask_mov_epi32(lane_index, better, index);
    }
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, lane_best);
    _mm512_store_si512(indices, lane_index);
    for (int lane = 0; lane < 16; ++lane)
      if (values[lane] > best || (values[lane] == best && indices[lane] < best_index)) {
        best = values[lane];
        best_index = indices[lane];
      }
  }
#endif
  for (; i < size; ++i)
    if (to_float(x[i]) > best) {
      best = to_float(x[i]);
      best_index = i;
    }
  return best_index;
}

}  // namespace

// x [..., V] -> the index of each row's largest value [...] (int64).
torch::Tensor argmax(torch::Tensor x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) < (int64_t{1} << 31),
              "argmax: needs a non-empty last dimension of under 2**31");
  x = x.contiguous();
  const int64_t size = x.size(-1), rows = x.numel() / size;
  auto shape = x.sizes().vec();
  shape.pop_back();
  auto out = torch::empty(shape, x.options().dtype(at::kLong));
  int64_t* out_ptr = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax", [&] {
    const scalar_t* data = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) out_ptr[r] = argmax_row(data + r * size, size);
    });
  });
  return out;
}

// Sets to -inf, in place, the logits of x [B, V] (contiguous) whose bit is 0 in their row of the int32
// bitmask [>= B, ceil(V / 32)] (xgrammar's layout: bit j of word w is token 32 * w + j), in the rows
// listed in `rows`. Grammar masks are mostly whole words of 0s or 1s: those take one fill or nothing.
void apply_token_bitmask(torch::Tensor x, torch::Tensor bitmask, std::vector<int64_t> rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt &&
                  bitmask.is_contiguous() && bitmask.size(1) * 32 >= x.size(1),
              "apply_token_bitmask: needs contiguous x [B, V] and an int32 bitmask [B, ceil(V / 32)]");
  const int64_t size = x.size(1), words = bitmask.size(1);
  for (int64_t r : rows)
    TORCH_CHECK(r >= 0 && r < x.size(0) && r < bitmask.size(0), "apply_token_bitmask: row out of range");
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "apply_token_bitmask", [&] {
    const scalar_t neg_inf = -std::numeric_limits<scalar_t>::infinity();
    scalar_t* data = x.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(rows.size()), 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* row = data + rows[i] * size;
        const uint32_t* mask = masks + rows[i] * words;
        for (int64_t w = 0; w * 32 < size; ++w) {
          const uint32_t bits = mask[w];
          if (bits == 0xFFFFFFFFu) continue;
          const int64_t start = w * 32, count = std::min<int64_t>(32, size - start);
          if (bits == 0) {
            std::fill(row + start, row + start + count, neg_inf);
            continue;
          }
          for (int64_t j = 0; j < count; ++j)
            if (!((bits >> j) & 1u)) row[start + j] = neg_inf;
        }
      }
    });
  });
}
