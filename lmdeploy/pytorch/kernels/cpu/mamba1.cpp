// Mamba-1's selective scan on the CPU: each task steps a block of channels of one segment through its tokens, the
// channel's state [N] in AVX-512 vectors (N a multiple of 16 or masked), decay exp(dt A) by a Cephes-style fp32 exp
// (about 1 ulp; the torch twin's is fp64 rounded to fp32) that every lane and every place computes alike.
#include "mamba1.h"

#include "common.h"

#if defined(__AVX512F__)

namespace {

constexpr int64_t kLanes = 16, kChannelBlock = 64;

// e^x for x in fp32 lanes, Cephes' expf: 2^n e^r, r = x - n ln 2 in two parts, a degree-6 polynomial.
inline __m512 exp_fp32(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

struct Scan {
  const float *x, *dt, *A, *B, *C;
  float *states, *out;
  int64_t channels, state_size;
};

// Channels [begin, end) of the rows [first, first + length) from their state row `state`.
void scan_channels(const Scan& s, float* state, int64_t first, int64_t length, int64_t begin, int64_t end) {
  const int64_t N = s.state_size, vectors = (N + kLanes - 1) / kLanes;
  for (int64_t d = begin; d < end; ++d) {
    float* S = state + d * N;
    const float* A = s.A + d * N;
    for (int64_t t = first; t < first + length; ++t) {
      const float dt = s.dt[t * s.channels + d];
      const __m512 dt_v = _mm512_set1_ps(dt), dtx = _mm512_set1_ps(dt * s.x[t * s.channels + d]);
      __m512 y = _mm512_setzero_ps();
      for (int64_t v = 0; v < vectors; ++v) {
        const __mmask16 m = v * kLanes + kLanes <= N ? __mmask16(0xFFFF) : __mmask16((1u << (N - v * kLanes)) - 1);
        const int64_t i = v * kLanes;
        const __m512 decay = exp_fp32(_mm512_mul_ps(dt_v, _mm512_maskz_loadu_ps(m, A + i)));
        const __m512 input = _mm512_mul_ps(dtx, _mm512_maskz_loadu_ps(m, s.B + t * N + i));
        const __m512 next = _mm512_fmadd_ps(decay, _mm512_maskz_loadu_ps(m, S + i), input);
        _mm512_mask_storeu_ps(S + i, m, next);
        y = _mm512_fmadd_ps(next, _mm512_maskz_loadu_ps(m, s.C + t * N + i), y);
      }
      s.out[t * s.channels + d] = _mm512_reduce_add_ps(y);
    }
  }
}

}  // namespace

bool mamba1_scan_available() { return true; }

torch::Tensor mamba1_scan(const torch::Tensor& x, const torch::Tensor& dt, const torch::Tensor& A,
                          const torch::Tensor& B, const torch::Tensor& C, const torch::Tensor& states,
                          const torch::Tensor& slots, const torch::Tensor& lengths) {
  TORCH_CHECK(x.dim() == 2 && A.dim() == 2 && states.dim() == 3, "x [T, D], A [D, N], states [slots, D, N]");
  const int64_t T = x.size(0), D = x.size(1), N = A.size(1);
  for (const auto* t : {&x, &dt, &A, &B, &C, &states})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "mamba1_scan takes contiguous fp32 CPU tensors");
  TORCH_CHECK(dt.sizes() == x.sizes() && A.size(0) == D && B.dim() == 2 && B.size(0) == T && B.size(1) == N &&
                  C.sizes() == B.sizes() && states.size(1) == D && states.size(2) == N,
              "dt [T, D], B and C [T, N], states [slots, D, N]");
  const auto slot_list = contiguous_as(slots, at::kLong), length_list = contiguous_as(lengths, at::kLong);
  const int64_t segments = slot_list.numel();
  TORCH_CHECK(length_list.numel() == segments, "one length per slot");
  const int64_t *slot = slot_list.data_ptr<int64_t>(), *length = length_list.data_ptr<int64_t>();
  std::vector<int64_t> first(segments + 1, 0);
  std::vector<bool> seen(states.size(0));
  for (int64_t i = 0; i < segments; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < states.size(0) && !seen[slot[i]], "slot ", slot[i],
                " is outside the pool or given twice");
    TORCH_CHECK(length[i] >= 0, "a segment's length is not negative");
    seen[slot[i]] = true;
    first[i + 1] = first[i] + length[i];
  }
  TORCH_CHECK(first[segments] == T, "the segments' lengths add up to x's rows");
  auto out = torch::empty({T, D}, x.options());
  const Scan scan{x.data_ptr<float>(), dt.data_ptr<float>(), A.data_ptr<float>(), B.data_ptr<float>(),
                  C.data_ptr<float>(), states.data_ptr<float>(), out.data_ptr<float>(), D, N};
  const int64_t blocks = (D + kChannelBlock - 1) / kChannelBlock;
  at::parallel_for(0, segments * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / blocks, block = task % blocks;
      scan_channels(scan, scan.states + slot[i] * D * N, first[i], length[i], block * kChannelBlock,
                    std::min(D, (block + 1) * kChannelBlock));
    }
  });
  return out;
}

#else

bool mamba1_scan_available() { return false; }

torch::Tensor mamba1_scan(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                          const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "mamba1_scan needs AVX-512");
}

#endif
