// fp32 y = x @ W.T + bias whose rows do not depend on how many there are: torch's fp32 GEMM picks its kernel, and so
// its order of summation, by the number of rows, so a row's last bits change with the rows beside it (a prompt's
// logprobs with its batch).
//
// fp32_packed_linear, fp32 models' linear layers, LM head and latent attention's per-head products, and every
// model's fp32 routers: the weight packed once as [ceil(N/16), K, 16] (16
// outputs a tile, zero rows padding the last), each output y[m, n] one chain of FMAs over the inputs in input order
// (x[m, k] broadcast times a tile's 16 weights of input k), then the bias added. One kernel, a template over the
// vector instructions, runs on AVX-512 (a tile one 16-float vector) and on AVX2 with FMA (a tile two 8-float
// vectors): each output's chain is the same on both, so are its bits. Blocks of up to kRows rows by as many tiles
// as kSums register sums hold (at most kTiles) keep their sums in registers; a block's shape changes which sums run
// side by side, never a sum's order. (Inputs taken in chunks, so that a chunk's weights stay in L1 for every row
// block, measured slower.) Threads share out groups of kTiles tiles, each output computed whole by one thread.
#include <ATen/Parallel.h>
#include <ATen/ops/constant_pad_nd.h>
#include <immintrin.h>

#include <array>
#include <utility>

#include "common.h"

namespace {

constexpr int64_t kTile = 16;  // outputs a packed tile

#if defined(__AVX512F__)
// A tile one vector; blocks of 8 rows by 3 tiles (24 sums, 3 weights and x in the 32 registers).
struct Avx512 {
  using Vec = __m512;
  static constexpr int kLanes = 16, kRows = 8, kTiles = 3, kSums = 24;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec broadcast(float v) { return _mm512_set1_ps(v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  // The first `count` floats at p (zeros after), and their store; count may be 0 or past kLanes.
  static __mmask16 first(int count) {
    return count >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << std::max(count, 0)) - 1);
  }
  static Vec load_first(const float* p, int count) { return _mm512_maskz_loadu_ps(first(count), p); }
  static void store_first(float* p, Vec v, int count) { _mm512_mask_storeu_ps(p, first(count), v); }
};
#endif

#if defined(__AVX2__) && defined(__FMA__)
// A tile two vectors; blocks of 6 rows by 1 tile (12 sums, 2 weights and x in the 16 registers), of fewer rows by
// more tiles, up to 4 (one row by one tile is 2 chains of FMAs, each waiting on its last: decode measured slower).
struct Avx2 {
  using Vec = __m256;
  static constexpr int kLanes = 8, kRows = 6, kTiles = 4, kSums = 12;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec broadcast(float v) { return _mm256_set1_ps(v); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static __m256i first(int count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static Vec load_first(const float* p, int count) { return _mm256_maskload_ps(p, first(count)); }
  static void store_first(float* p, Vec v, int count) { _mm256_maskstore_ps(p, first(count), v); }
};
#endif

// Rows [0, R) of x (stride K) times the T tiles at w (stride K * 16 each), plus the bias (if any), into out
// (stride N); outputs[t]: how many of tile t's 16 outputs exist (the last tile may be partial).
template <class V, int R, int T>
void packed_block(const float* x, const float* w, int64_t K, float* out, int64_t N, const float* bias,
                  const int* outputs) {
  constexpr int kPerTile = kTile / V::kLanes, kVecs = T * kPerTile;  // vectors a tile, of the block's tiles
  typename V::Vec acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = V::zero();
  for (int64_t k = 0; k < K; ++k) {
    typename V::Vec ws[kVecs];
    for (int v = 0; v < kVecs; ++v) ws[v] = V::load(w + (v / kPerTile * K + k) * kTile + v % kPerTile * V::kLanes);
    for (int r = 0; r < R; ++r) {
      const auto xb = V::broadcast(x[r * K + k]);
      for (int v = 0; v < kVecs; ++v) acc[r][v] = V::fmadd(xb, ws[v], acc[r][v]);
    }
  }
  for (int v = 0; v < kVecs; ++v) {
    const int64_t offset = v * V::kLanes;
    const int count = outputs[offset / kTile] - offset % kTile;
    const auto b = bias != nullptr ? V::load_first(bias + offset, count) : V::zero();
    for (int r = 0; r < R; ++r) V::store_first(out + r * N + offset, V::add(acc[r][v], b), count);
  }
}

// packed_block of min(T, tiles) tiles.
template <class V, int R, int T>
void packed_tiles(const float* x, const float* w, int64_t K, float* out, int64_t N, const float* bias,
                  const int* outputs, int64_t tiles) {
  if constexpr (T > 1) {
    if (tiles < T) return packed_tiles<V, R, T - 1>(x, w, K, out, N, bias, outputs, tiles);
  }
  packed_block<V, R, T>(x, w, K, out, N, bias, outputs);
}

// R rows times a group of up to kTiles tiles, in blocks of as many tiles as V::kSums sums fill.
template <class V, int R>
void packed_group(const float* x, const float* w, int64_t K, float* out, int64_t N, const float* bias,
                  const int* outputs, int64_t tiles) {
  constexpr int kBlock = std::clamp<int>(V::kSums * V::kLanes / (R * kTile), 1, V::kTiles);
  for (int64_t t = 0; t < tiles; t += kBlock) {
    const float* b = bias != nullptr ? bias + t * kTile : nullptr;
    packed_tiles<V, R, kBlock>(x, w + t * K * kTile, K, out + t * kTile, N, b, outputs + t, tiles - t);
  }
}

using PackedRows = void (*)(const float*, const float*, int64_t, float*, int64_t, const float*, const int*, int64_t);

template <class V, int... Rs>
constexpr std::array<PackedRows, sizeof...(Rs)> packed_rows_table(std::integer_sequence<int, Rs...>) {
  return {&packed_group<V, Rs + 1>...};
}

// out [M, n] = x [M, K] times the packed tiles (+ bias), on V's instructions.
template <class V>
void packed_linear(const float* x, const float* packed, const float* bias, float* out, int64_t M, int64_t K,
                   int64_t n) {
  // rows[r - 1]: blocks of r rows, for r in 1..kRows.
  static constexpr auto rows = packed_rows_table<V>(std::make_integer_sequence<int, V::kRows>{});
  const int64_t tiles = (n + kTile - 1) / kTile;
  at::parallel_for(0, (tiles + V::kTiles - 1) / V::kTiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t t0 = g * V::kTiles, T = std::min<int64_t>(V::kTiles, tiles - t0);
      int outputs[V::kTiles];
      for (int64_t t = 0; t < T; ++t) outputs[t] = static_cast<int>(std::min(kTile, n - (t0 + t) * kTile));
      const float* w = packed + t0 * K * kTile;
      const float* b = bias != nullptr ? bias + t0 * kTile : nullptr;
      for (int64_t m0 = 0; m0 < M; m0 += V::kRows)
        rows[std::min<int64_t>(V::kRows, M - m0) - 1](x + m0 * K, w, K, out + m0 * n + t0 * kTile, n, b, outputs, T);
    }
  });
}

}  // namespace

std::vector<std::string> fp32_packed_linear_isas() {
  std::vector<std::string> isas;
#if defined(__AVX512F__)
  isas.push_back("avx512");
#endif
#if defined(__AVX2__) && defined(__FMA__)
  isas.push_back("avx2");
#endif
  return isas;
}

bool fp32_packed_linear_available() { return !fp32_packed_linear_isas().empty(); }

torch::Tensor pack_fp32_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.dim() == 2, "pack_fp32_weight takes an fp32 weight [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), tiles = (N + kTile - 1) / kTile;
  const auto padded = at::constant_pad_nd(weight, {0, 0, 0, tiles * kTile - N});
  return padded.view({tiles, kTile, K}).transpose(1, 2).contiguous();
}

torch::Tensor fp32_packed_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                                 const c10::optional<torch::Tensor>& bias, const std::string& isa) {
  const auto isas = fp32_packed_linear_isas();
  TORCH_CHECK(!isas.empty(), "fp32_packed_linear needs AVX-512, or AVX2 with FMA");
  const std::string& run = isa.empty() ? isas.front() : isa;
  TORCH_CHECK(std::find(isas.begin(), isas.end(), run) != isas.end(), "fp32_packed_linear was not built for ", run);
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 && packed.size(2) == kTile &&
                  packed.is_contiguous() && n > (packed.size(0) - 1) * kTile && n <= packed.size(0) * kTile,
              "fp32_packed_linear takes pack_fp32_weight's tiles of an [n, K] weight");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == packed.size(1),
              "fp32_packed_linear takes fp32 x [..., K]");
  const auto bc = bias ? c10::optional<torch::Tensor>(bias->to(at::kFloat).contiguous()) : c10::nullopt;
  TORCH_CHECK(!bc || bc->numel() == n, "fp32_packed_linear's bias has one value an output");
  const auto xc = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto out = empty_output({M, n}, xc.options());
  const float *xp = xc.data_ptr<float>(), *wp = packed.data_ptr<float>(), *bp = bc ? bc->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
#if defined(__AVX512F__)
  if (run == "avx512") packed_linear<Avx512>(xp, wp, bp, op, M, K, n);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (run == "avx2") packed_linear<Avx2>(xp, wp, bp, op, M, K, n);
#endif
  auto shape = x.sizes().vec();
  shape.back() = n;
  return out.view(shape);
}
