"""What bounds a one-row prefill step of a K-quant layer (``run_dequantizing_few``, ``kquant::put_groups``): the tile
writer's loop on a Q4_K weight with each of its two costs taken out, in one process, alternating. A prefill row must
get the packed bf16 GEMM's bits: one chain of ``vdpbf16ps`` a tile over the weights dequantized exactly to bf16, in
order of k (docs/batch_invariance.md). Variants: the kernel (``k_tiles``' writer into a one-row sink); its loop with
four chains a tile (other bits: a probe); the codes' bits taken as the weights (no dequantization) with one chain
and with four; and four tiles side by side, group by group through a buffer in L1 (the kernel's bits). Random
codes and scales, one row, one thread, thread CPU time, best of ``--repeats`` in each of ``--rounds``. Builds a
small extension beside the kernels' headers (``-march=native``: AVX512-BF16 needed)::

    python benchmark/kquant_one_row_cpu.py [--outputs 32256 --inputs 2048]
"""
from __future__ import annotations

import argparse
import os

import torch
from kquant_lookup_cpu import build_probe

BINDING = r'''
#include <torch/extension.h>
std::tuple<double, torch::Tensor> run(int64_t variant, torch::Tensor codes, torch::Tensor scales, torch::Tensor x,
                                      int64_t repeats);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
'''

SOURCE = r'''
#include <time.h>
#include <algorithm>
#include <tuple>
#include "kquant_gemv.h"

using namespace kquant;
namespace {
inline void q4k_codes(const uint8_t* w, __m512i* u) {
  const __m512i nibble = _mm512_set1_epi16(15);
  for (int c = 0; c < 8; ++c) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
    u[c] = _mm512_and_si512(bytes, nibble);
    u[8 + c] = _mm512_srli_epi16(bytes, 4);
  }
}
double now() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

// The kernel's loop with a cost taken out: V 1, four chains a tile (other bits); 2, the codes' bits as the weights
// (no dequantization), one chain; 3, no dequantization, four chains.
template <int V>
void costs_out(const uint8_t* cp, const uint8_t* sp, const int32_t* x, float* out, int64_t tiles, int64_t K) {
  const int64_t blocks = K / 256;
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const uint8_t* w = cp + tile * (K / 32) * 128;
    __m512 s[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t block = 0; block < blocks; ++block) {
      const uint8_t* sc = sp + (tile * blocks + block) * 256;
      prefetch_ahead(sc, kCodePrefetchBytes * 256 / (128 * 8), 256);
      for (int64_t j = 0; j < 8; ++j, w += 128) {
        prefetch_ahead(w, kCodePrefetchBytes, 128);
        __m512 scale, minimum;
        scale_min(sc, j, scale, minimum);
        __m512i pairs[16];
        q4k_codes(w, pairs);
        if constexpr (V == 1)
          for (int p = 0; p < 16; ++p) pairs[p] = weight_pairs(pairs[p], scale, minimum);
        const int32_t* xg = x + (block * 8 + j) * 16;
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p) {
          const int a = (V == 1 || V == 3) ? (p & 3) : 0;
          s[a] = _mm512_dpbf16_ps(s[a], (__m512bh)_mm512_set1_epi32(xg[p]), (__m512bh)pairs[p]);
        }
      }
    }
    _mm512_storeu_ps(out + tile * 16, _mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])));
  }
}

// T tiles side by side, group by group, through a buffer in L1: the kernel's bits
template <int T>
void interleave(const uint8_t* cp, const uint8_t* sp, const int32_t* x, float* out, int64_t tiles, int64_t K) {
  const int64_t blocks = K / 256;
  alignas(64) __m512i buf[T][16];
  for (int64_t first = 0; first < tiles; first += T) {
    __m512 s[T];
    for (int t = 0; t < T; ++t) s[t] = _mm512_setzero_ps();
    for (int64_t block = 0; block < blocks; ++block) {
      for (int64_t j = 0; j < 8; ++j) {
        for (int t = 0; t < T; ++t) {
          const int64_t tile = first + t;
          const uint8_t* sc = sp + (tile * blocks + block) * 256;
          const uint8_t* w = cp + (tile * (K / 32) + block * 8 + j) * 128;
          prefetch_ahead(w, kCodePrefetchBytes, 128);
          if (j == 0) prefetch_ahead(sc, kCodePrefetchBytes * 256 / (128 * 8), 256);
          __m512 scale, minimum;
          scale_min(sc, j, scale, minimum);
          q4k_codes(w, buf[t]);
          for (int p = 0; p < 16; ++p) buf[t][p] = weight_pairs(buf[t][p], scale, minimum);
        }
        const int32_t* xg = x + (block * 8 + j) * 16;
#pragma GCC unroll 16
        for (int p = 0; p < 16; ++p) {
          const __m512bh xb = (__m512bh)_mm512_set1_epi32(xg[p]);
          for (int t = 0; t < T; ++t) s[t] = _mm512_dpbf16_ps(s[t], xb, (__m512bh)buf[t][p]);
        }
      }
    }
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + (first + t) * 16, s[t]);
  }
}

}  // namespace

std::tuple<double, torch::Tensor> run(int64_t variant, torch::Tensor codes, torch::Tensor scales, torch::Tensor x,
                                      int64_t repeats) {
  const int64_t tiles = codes.size(0), K = codes.size(1) * 32;
  auto out = torch::zeros({tiles * 16}, at::kFloat);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  float* o = out.data_ptr<float>();
  TiledWeight weight = k_tiles<128>(codes, scales, false, q4k_codes);
  double best = 1e9;
  for (int64_t r = 0; r < repeats; ++r) {
    const double t0 = now();
    switch (variant) {
      case 0:
        for (int64_t tile = 0; tile < tiles; ++tile) {
          alignas(64) float sums[16] = {};
          weight.write(tile, TileSink{nullptr, K, false, x.data_ptr<at::BFloat16>(), 1, sums});
          _mm512_storeu_ps(o + tile * 16, _mm512_load_ps(sums));
        }
        break;
      case 1: costs_out<1>(cp, sp, xp, o, tiles, K); break;
      case 2: costs_out<2>(cp, sp, xp, o, tiles, K); break;
      case 3: costs_out<3>(cp, sp, xp, o, tiles, K); break;
      case 4: interleave<4>(cp, sp, xp, o, tiles, K); break;
    }
    best = std::min(best, now() - t0);
  }
  return {best * 1e3, out};
}

'''

VARIANTS = {0: 'the kernel (one chain a tile)', 1: 'four chains a tile (other bits)', 2: 'no dequantization, one chain',
            3: 'no dequantization, four chains', 4: 'four tiles side by side (same bits)'}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--outputs', type=int, default=32256, help='rows of W: a multiple of 64')
    parser.add_argument('--inputs', type=int, default=2048, help='columns of W: a multiple of 256')
    parser.add_argument('--repeats', type=int, default=5)
    parser.add_argument('--rounds', type=int, default=3)
    args = parser.parse_args()
    module = build_probe('kquant_one_row_bench', SOURCE, BINDING)
    g = torch.Generator().manual_seed(0)
    tiles, inputs = args.outputs // 16, args.inputs
    codes = torch.randint(0, 256, (tiles, inputs // 32, 128), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (tiles, inputs // 256, 256), generator=g, dtype=torch.uint8)
    d = (torch.rand(tiles, inputs // 256, 32, generator=g) * 0.01 + 0.001).half()  # d and dmin of 16 rows
    scales[..., :64] = d.view(torch.uint8).view(tiles, inputs // 256, 64)
    x = torch.randn(inputs, generator=g).bfloat16()
    times = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            times[v].append(module.run(v, codes, scales, x, args.repeats)[0])
    reference = module.run(0, codes, scales, x, 1)[1]
    print(f'load {os.getloadavg()[0]:.1f}; one row, Q4_K {args.outputs} x {inputs}, ms (best of {args.repeats}, '
          'each round):')
    for v, name in VARIANTS.items():
        same = torch.equal(module.run(v, codes, scales, x, 1)[1], reference)
        print(f'{name:38s} {min(times[v]):7.2f}  ({", ".join(f"{t:.2f}" for t in times[v])}; the kernel\'s bits: {same})')


if __name__ == '__main__':
    main()
