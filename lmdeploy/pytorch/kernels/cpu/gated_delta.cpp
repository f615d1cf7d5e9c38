// Gated DeltaNet's decode step on the CPU (Qwen3-Next, Qwen3.5 linear attention; Kimi-Linear's KDA, whose decay is
// per key feature): the one-token gated delta rule on the rows of the fp32 state pool, and the one-token causal
// convolution before it.
//
// gated_delta_decode (AVX-512) runs each (sequence, head) state [Dk, Dv] as one task, in tiles of 128 value
// columns: a first pass reads the tile from the pool row and forms kv = k^T (exp(g) S), a second pass (from L1/L2)
// writes S' = exp(g) S + k (x) (v - kv) beta back and forms o = q^T S', so the pool is read and written once,
// the floor. The torch twin passes over the gathered copy several times.
#include "gated_delta.h"

#include "common.h"

namespace {

// slots as int64, after checking that each names its own row of a pool of `rows`.
std::vector<int64_t> checked_slots(const torch::Tensor& slots, int64_t batch, int64_t rows) {
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == batch && at::isIntegralType(slots.scalar_type(), false),
              "slots: ", batch, " integer pool rows, one a sequence");
  const auto as_long = contiguous_as(slots, at::kLong);
  const int64_t* data = as_long.data_ptr<int64_t>();
  std::vector<int64_t> out(data, data + batch);
  std::vector<bool> seen(rows);
  for (const int64_t slot : out) {
    TORCH_CHECK(slot >= 0 && slot < rows, "slot ", slot, " is outside the pool of ", rows, " rows");
    TORCH_CHECK(!seen[slot], "slot ", slot, " is given to two sequences");
    seen[slot] = true;
  }
  return out;
}

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                                      t.scalar_type() == at::kHalf),
              name, ": a CPU fp32, bf16 or fp16 tensor");
}

}  // namespace

#if defined(__AVX512F__)

namespace {

constexpr int64_t kLanes = 16, kTileVectors = 8;
constexpr float kL2NormEps = 1e-6f;  // kernels/gated_delta.py: L2NORM_EPS

struct DecodeStep {
  const float *q, *k, *v, *g, *beta;  // contiguous
  float* states;
  float* out;
  const int64_t* slots;
  int64_t heads, key_heads, k_dim, v_dim, slot_stride, head_stride;
  bool per_feature;  // g [B, H, Dk] (KDA) rather than [B, H]
};

// q (scaled by Dk^-0.5) or k, L2-normed, into `normed`.
void l2_normed(const float* x, int64_t n, float scale, float* normed) {
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum + kL2NormEps);
  for (int64_t i = 0; i < n; ++i) normed[i] = x[i] * inv * scale;
}

__mmask16 lanes_mask(int64_t remaining) {
  return remaining >= kLanes ? static_cast<__mmask16>(0xFFFF)
                             : remaining <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << remaining) - 1);
}

// Sequence b's head h; qn, kn and decays: Dk floats of scratch each.
void head_step(const DecodeStep& a, int64_t b, int64_t h, float* qn, float* kn, float* decays) {
  const int64_t Dk = a.k_dim, Dv = a.v_dim, key_head = h / (a.heads / a.key_heads);
  l2_normed(a.q + (b * a.key_heads + key_head) * Dk, Dk, 1.f / std::sqrt(static_cast<float>(Dk)), qn);
  l2_normed(a.k + (b * a.key_heads + key_head) * Dk, Dk, 1.f, kn);
  const float* g = a.per_feature ? a.g + (b * a.heads + h) * Dk : a.g + b * a.heads + h;
  for (int64_t i = 0; i < Dk; ++i) decays[i] = std::exp(g[a.per_feature ? i : 0]);
  const __m512 beta = _mm512_set1_ps(a.beta[b * a.heads + h]);
  float* state = a.states + a.slots[b] * a.slot_stride + h * a.head_stride;
  const float* v = a.v + (b * a.heads + h) * Dv;
  float* out = a.out + (b * a.heads + h) * Dv;
  for (int64_t c0 = 0; c0 < Dv; c0 += kLanes * kTileVectors) {
    __mmask16 mask[kTileVectors];
    __m512 kv[kTileVectors], delta[kTileVectors], o[kTileVectors];
    for (int j = 0; j < kTileVectors; ++j) {
      mask[j] = lanes_mask(Dv - c0 - j * kLanes);
      kv[j] = o[j] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < Dk; ++i) {
      const float* row = state + i * Dv + c0;
      const __m512 ki = _mm512_set1_ps(kn[i]), decay = _mm512_set1_ps(decays[i]);
#pragma GCC unroll 8
      for (int j = 0; j < kTileVectors; ++j)
        kv[j] = _mm512_fmadd_ps(ki, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask[j], row + j * kLanes), decay), kv[j]);
    }
    for (int j = 0; j < kTileVectors; ++j)
      delta[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask[j], v + c0 + j * kLanes), kv[j]), beta);
    for (int64_t i = 0; i < Dk; ++i) {
      float* row = state + i * Dv + c0;
      const __m512 ki = _mm512_set1_ps(kn[i]), qi = _mm512_set1_ps(qn[i]), decay = _mm512_set1_ps(decays[i]);
#pragma GCC unroll 8
      for (int j = 0; j < kTileVectors; ++j) {
        const __m512 s = _mm512_fmadd_ps(
            ki, delta[j], _mm512_mul_ps(_mm512_maskz_loadu_ps(mask[j], row + j * kLanes), decay));
        _mm512_mask_storeu_ps(row + j * kLanes, mask[j], s);
        o[j] = _mm512_fmadd_ps(qi, s, o[j]);
      }
    }
    for (int j = 0; j < kTileVectors; ++j) _mm512_mask_storeu_ps(out + c0 + j * kLanes, mask[j], o[j]);
  }
}

}  // namespace

bool gated_delta_available() { return true; }

torch::Tensor gated_delta_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const torch::Tensor& g, const torch::Tensor& beta, const torch::Tensor& states,
                                 const torch::Tensor& slots) {
  check_float(q, "q");
  check_float(k, "k");
  check_float(v, "v");
  check_float(g, "g");
  check_float(beta, "beta");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes(), "q and k: [B, Hk, Dk] each");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == q.size(0), "v: [B, H, Dv]");
  const int64_t batch = v.size(0), heads = v.size(1), v_dim = v.size(2), key_heads = q.size(1), k_dim = q.size(2);
  TORCH_CHECK(key_heads > 0 && heads % key_heads == 0, "the ", heads, " value heads must be a multiple of the ",
              key_heads, " key heads");
  const bool per_feature = g.dim() == 3;
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == batch && beta.size(1) == heads &&
                  (g.sizes() == beta.sizes() || (per_feature && g.sizes().slice(0, 2) == beta.sizes() &&
                                                 g.size(2) == k_dim)),
              "g: [B, H] or [B, H, Dk]; beta: [B, H]");
  TORCH_CHECK(states.device().is_cpu() && states.scalar_type() == at::kFloat && states.dim() == 4 &&
                  states.size(1) == heads && states.size(2) == k_dim && states.size(3) == v_dim &&
                  states.stride(3) == 1 && states.stride(2) == v_dim,
              "states: fp32 [slots, ", heads, ", ", k_dim, ", ", v_dim, "], each head's [Dk, Dv] contiguous");
  const auto rows = checked_slots(slots, batch, states.size(0));
  const auto q32 = contiguous_as(q, at::kFloat), k32 = contiguous_as(k, at::kFloat), v32 = contiguous_as(v, at::kFloat);
  const auto g32 = contiguous_as(g, at::kFloat), beta32 = contiguous_as(beta, at::kFloat);
  auto out = torch::empty({batch, heads, v_dim}, v.options().dtype(at::kFloat));
  const DecodeStep step{q32.data_ptr<float>(), k32.data_ptr<float>(), v32.data_ptr<float>(), g32.data_ptr<float>(),
                        beta32.data_ptr<float>(), states.data_ptr<float>(), out.data_ptr<float>(), rows.data(),
                        heads, key_heads, k_dim, v_dim, states.stride(0), states.stride(1), per_feature};
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(3 * k_dim);
    for (int64_t task = begin; task < end; ++task)
      head_step(step, task / heads, task % heads, scratch.data(), scratch.data() + k_dim, scratch.data() + 2 * k_dim);
  });
  return out;
}

#else

bool gated_delta_available() { return false; }

torch::Tensor gated_delta_decode(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                 const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                                 const torch::Tensor&) {
  TORCH_CHECK(false, "built without AVX-512");
}

#endif

namespace {

// causal_conv1d_decode on fp32 inputs, weights and output; pool rows of state type T. Carried: int64_t, or a
// std::integral_constant for the checkpoints' 4 taps (the loops over them unrolled: 30% less time).
template <typename T, typename Carried>
void conv1d_step(const float* x, T* pool, const int64_t* rows, const float* w, float* out, int64_t batch,
                 int64_t channels, Carried carried, int64_t slot_stride) {
  constexpr int64_t kBlock = 256;  // channels a task
  const int64_t blocks = (channels + kBlock - 1) / kBlock, taps = carried + 1;
  at::parallel_for(0, batch * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / blocks, c0 = task % blocks * kBlock, c1 = std::min(c0 + kBlock, channels);
      T* state = pool + rows[b] * slot_stride;
      const float* input = x + b * channels;
      float* ob = out + b * channels;
      for (int64_t c = c0; c < c1; ++c) {
        const float* wc = w + c * taps;
        T* sc = state + c * carried;
        float acc = wc[carried] * input[c];
        for (int64_t j = 0; j < carried; ++j) acc += wc[j] * static_cast<float>(sc[j]);
        for (int64_t j = 0; j + 1 < carried; ++j) sc[j] = sc[j + 1];
        if (carried > 0) sc[carried - 1] = static_cast<T>(input[c]);
        ob[c] = acc;
      }
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) ob[c] = ob[c] / (1.f + std::exp(-ob[c]));
    }
  });
}

}  // namespace

torch::Tensor causal_conv1d_decode(const torch::Tensor& x, const torch::Tensor& conv_states,
                                   const torch::Tensor& slots, const torch::Tensor& weight) {
  check_float(x, "x");
  check_float(weight, "weight");
  check_float(conv_states, "conv_states");
  TORCH_CHECK(x.dim() == 2, "x: [B, C]");
  const int64_t batch = x.size(0), channels = x.size(1);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == channels && weight.size(1) >= 1, "weight: [", channels, ", K]");
  const int64_t taps = weight.size(1), carried = taps - 1;
  TORCH_CHECK(conv_states.dim() == 3 && conv_states.size(1) == channels && conv_states.size(2) == carried &&
                  conv_states.stride(2) == 1 && conv_states.stride(1) == carried,
              "conv_states: [slots, ", channels, ", ", carried, "], each row contiguous");
  const auto rows = checked_slots(slots, batch, conv_states.size(0));
  const auto x32 = contiguous_as(x, at::kFloat), w32 = contiguous_as(weight, at::kFloat);
  auto out = torch::empty({batch, channels}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, conv_states.scalar_type(), "causal_conv1d_decode", [&] {
    const auto step = [&](auto carried) {
      conv1d_step(x32.data_ptr<float>(), conv_states.data_ptr<scalar_t>(), rows.data(), w32.data_ptr<float>(),
                  out.data_ptr<float>(), batch, channels, carried, conv_states.stride(0));
    };
    if (carried == 3)
      step(std::integral_constant<int64_t, 3>{});
    else
      step(carried);
  });
  return out.scalar_type() == x.scalar_type() ? out : out.to(x.scalar_type());
}
