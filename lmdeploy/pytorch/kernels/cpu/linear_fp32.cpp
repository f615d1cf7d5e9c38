// fp32 y = x @ W.T + bias whose rows do not depend on how many there are: torch's fp32 GEMM picks its kernel, and so
// its order of summation, by the number of rows, so a row's last bits change with the rows beside it (a prompt's
// logprobs with its batch).
//
// fp32_packed_linear, fp32 models' linear layers, LM head and latent attention's per-head products, and every
// model's fp32 routers: the weight packed once as [ceil(N/16), K, 16] (16
// outputs a tile, zero rows padding the last), each output y[m, n] one chain of FMAs over the inputs in input order
// (x[m, k] broadcast times a tile's 16 weights of input k), then the bias added. Blocks of up to kRows rows by
// kTiles tiles keep their sums in registers; a block's shape changes which sums run side by side, never a sum's
// order. (Inputs taken in chunks, so that a chunk's weights stay in L1 for every row block, measured slower.)
// Threads share out groups of tiles, each output computed whole by one thread.
#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <immintrin.h>

#include <array>
#include <utility>

#include "common.h"

#if defined(__AVX512F__)

namespace {

// the packed kernel's outputs per tile and tiles per block (with kRows rows: 24 sums, 3 weights and x in registers)
constexpr int64_t kTile = 16, kTiles = 3;
constexpr int kRows = 8;

// The packed kernel: rows [0, R) of x (stride K) times the T tiles at w (stride K * 16 each), plus the bias (if
// any), into out (stride N); masks[t]: tile t's outputs that exist (the last tile may be partial).
template <int R, int T>
void packed_block(const float* x, const float* w, int64_t K, float* out, int64_t N, const float* bias,
                  const __mmask16* masks) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 ws[T];
    for (int t = 0; t < T; ++t) ws[t] = _mm512_loadu_ps(w + (t * K + k) * kTile);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_fmadd_ps(xb, ws[t], acc[r][t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(masks[t], bias + t * kTile) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + r * N + t * kTile, masks[t], _mm512_add_ps(acc[r][t], b));
  }
}

template <int R>
void packed_tiles(const float* x, const float* w, int64_t K, float* out, int64_t N, const float* bias,
                  const __mmask16* masks, int64_t tiles) {
  switch (tiles) {
    case 3: return packed_block<R, 3>(x, w, K, out, N, bias, masks);
    case 2: return packed_block<R, 2>(x, w, K, out, N, bias, masks);
    default: return packed_block<R, 1>(x, w, K, out, N, bias, masks);
  }
}

using PackedRows = void (*)(const float*, const float*, int64_t, float*, int64_t, const float*, const __mmask16*,
                            int64_t);

template <int... Rs>
constexpr std::array<PackedRows, sizeof...(Rs)> packed_rows_table(std::integer_sequence<int, Rs...>) {
  return {&packed_tiles<Rs + 1>...};
}

// packed_rows[r - 1]: blocks of r rows, for r in 1..kRows.
constexpr auto packed_rows = packed_rows_table(std::make_integer_sequence<int, kRows>{});

}  // namespace

torch::Tensor pack_fp32_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "pack_fp32_weight takes an fp32 weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), tiles = (N + kTile - 1) / kTile;
  const auto padded = at::constant_pad_nd(weight, {0, 0, 0, tiles * kTile - N});
  return padded.view({tiles, kTile, K}).transpose(1, 2).contiguous();
}

torch::Tensor fp32_packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == kTile &&
                  packed.is_contiguous() && n > (packed.size(0) - 1) * kTile && n <= packed.size(0) * kTile,
              "fp32_packed_linear takes pack_fp32_weight's tiles of an [n, K] weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == packed.size(1),
              "fp32_packed_linear takes fp32 x [..., K]");
  const auto bc = bias ? c10::optional<torch::Tensor>(bias->to(at::kFloat).contiguous()) : c10::nullopt;
  TORCH_CHECK(!bc || bc->numel() == n, "fp32_packed_linear's bias has one value an output");
  const auto xc = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), tiles = packed.size(0);
  auto out = torch::empty({M, n}, xc.options());
  const float *xp = xc.data_ptr<float>(), *wp = packed.data_ptr<float>(), *bp = bc ? bc->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (tiles + kTiles - 1) / kTiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t0 = g * kTiles, T = std::min(kTiles, tiles - t0);
      __mmask16 masks[kTiles];
      for (int64_t t = 0; t < T; ++t) {
        const int64_t left = n - (t0 + t) * kTile;
        masks[t] = left >= kTile ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
      }
      const float* w = wp + t0 * K * kTile;
      const float* b = bp != nullptr ? bp + t0 * kTile : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += kRows)
        packed_rows[std::min<int64_t>(kRows, M - m0) - 1](xp + m0 * K, w, K, op + m0 * n + t0 * kTile, n, b, masks, T);
    }
  });
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}

bool fp32_packed_linear_available() { return true; }

#else

bool fp32_packed_linear_available() { return false; }

torch::Tensor pack_fp32_weight(const torch::Tensor&) { TORCH_CHECK(false, "pack_fp32_weight needs AVX-512"); }

torch::Tensor fp32_packed_linear(const torch::Tensor&, const torch::Tensor&, int64_t,
                                 const c10::optional<torch::Tensor>&) {
  TORCH_CHECK(false, "fp32_packed_linear needs AVX-512");
}

#endif
