"""Q4_K's exact dequantization to bf16 by table lookup against the kernel's loop (``kquant::weight_pairs``, which
``q4k_tiled`` runs for prefill rows): each variant writes a tile's group (16 rows, 32 inputs) as the 16 vectors of
bf16 pairs the panels and the few-row sums read (dword r: row r's input pair), and must give the kernel's bits. A
row's 16 possible weights of a group are computed once with the same fp32 formula and rounding (``q * d * sc -
dmin * m``, rounded to bf16) and each weight is looked up:

- ``lookup words``: a table of 4 rows x 16 weights in two registers, the 16 rows' lanes looked up by four masked
  ``vpermi2w`` a vector (AVX512-BW);
- ``lookup bytes``: the weights' low and high bytes as tables of 8 rows x 16 in two registers each, two masked
  ``vpermi2b`` per byte and 64 weights, then interleaved (AVX512-VBMI).

Random codes and scales, the groups in L1/L2 (``--groups``), one thread, each variant's best of ``--repeats`` passes,
alternating; ``--sink`` adds a one-row step's sum (the group's 16 ``vdpbf16ps`` into one chain, as the few-row sink).
Compiled on first use with the kernels' flags (``-O3 -march=native``)::

    python benchmark/kquant_lookup_cpu.py
    python benchmark/kquant_lookup_cpu.py --sink
"""
from __future__ import annotations

import argparse
import os

from torch.utils.cpp_extension import get_default_build_root, load

KERNELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'lmdeploy', 'pytorch', 'kernels',
                       'cpu')
BINDING = r'''
#include <torch/extension.h>
std::vector<double> run(int64_t groups, int64_t repeats, bool sink);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run); }
'''

SOURCE = r'''
#include <chrono>
#include <cstring>
#include <random>
#include "kquant_gemv.h"

namespace {

// The codes of a Q4_K tile's group (its 256 code bytes) as q4k_tiled reads them, u[8 h + c]: 16-bit lanes.
inline void group_codes(const uint8_t* w, __m512i* u) {
  const __m512i nibble = _mm512_set1_epi16(15);
  for (int c = 0; c < 8; ++c) {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * c)));
    u[c] = _mm512_and_si512(bytes, nibble);
    u[8 + c] = _mm512_srli_epi16(bytes, 4);
  }
}

__attribute__((noinline)) void kernel_loop(const uint8_t* w, __m512 scale, __m512 minimum, __m512i* pairs) {
  group_codes(w, pairs);
  for (int p = 0; p < 16; ++p) pairs[p] = kquant::weight_pairs(pairs[p], scale, minimum);
}

// Row r's 16 weights q * scale[r] - minimum[r] (q = 0..15) in fp32, two rows rounded to bf16 a register.
inline void row_tables(__m512 scale, __m512 minimum, __m512i* tables) {
  alignas(64) float sc[16], mn[16];
  _mm512_store_ps(sc, scale);
  _mm512_store_ps(mn, minimum);
  const __m512 q = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int t = 0; t < 8; ++t) {
    const __m512 even = _mm512_fmsub_ps(q, _mm512_set1_ps(sc[2 * t]), _mm512_set1_ps(mn[2 * t]));
    const __m512 odd = _mm512_fmsub_ps(q, _mm512_set1_ps(sc[2 * t + 1]), _mm512_set1_ps(mn[2 * t + 1]));
    tables[t] = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
  }
}

__attribute__((noinline)) void lookup_words(const uint8_t* w, __m512 scale, __m512 minimum, __m512i* pairs) {
  __m512i tables[8];
  row_tables(scale, minimum, tables);
  group_codes(w, pairs);
  const __m512i row_in_four = _mm512_set_epi16(48, 48, 32, 32, 16, 16, 0, 0, 48, 48, 32, 32, 16, 16, 0, 0, 48, 48, 32,
                                               32, 16, 16, 0, 0, 48, 48, 32, 32, 16, 16, 0, 0);
  for (int p = 0; p < 16; ++p) {
    __m512i v = _mm512_or_si512(pairs[p], row_in_four);
    for (int a = 0; a < 4; ++a)  // rows 4a..4a + 3: lanes 8a..8a + 7
      v = _mm512_mask2_permutex2var_epi16(tables[2 * a], v, 0xFFu << (8 * a), tables[2 * a + 1]);
    pairs[p] = v;
  }
}

#ifdef __AVX512VBMI__
struct ByteLookup {
  uint8_t low[64], high[64], order[64], row_in_eight[64];
  uint64_t first_eight = 0;  // lanes of rows 0-7
  ByteLookup() {
    for (int i = 0; i < 64; ++i) low[i] = 2 * i, high[i] = 2 * i + 1;
    // unpack{lo,hi}_epi8 take bytes 0-7 and 8-15 of each 128-bit lane: order the codes so that they give 0-31, 32-63
    for (int l = 0; l < 4; ++l)
      for (int i = 0; i < 8; ++i) order[16 * l + i] = 8 * l + i, order[16 * l + 8 + i] = 32 + 8 * l + i;
    for (int p = 0; p < 64; ++p) {
      const int row = order[p] % 32 / 2;
      row_in_eight[p] = (row % 8) << 4;
      if (row < 8) first_eight |= 1ull << p;
    }
  }
};

__attribute__((noinline)) void lookup_bytes(const uint8_t* w, __m512 scale, __m512 minimum, __m512i* pairs) {
  static const ByteLookup k;
  __m512i tables[8], low[4], high[4];  // [rows 0-7: 0, 1; rows 8-15: 2, 3]
  row_tables(scale, minimum, tables);
  for (int h = 0; h < 4; ++h) {
    low[h] = _mm512_permutex2var_epi8(tables[2 * h], _mm512_loadu_si512(k.low), tables[2 * h + 1]);
    high[h] = _mm512_permutex2var_epi8(tables[2 * h], _mm512_loadu_si512(k.high), tables[2 * h + 1]);
  }
  const __m512i order = _mm512_loadu_si512(k.order), rows = _mm512_loadu_si512(k.row_in_eight);
  const __m512i nibble = _mm512_set1_epi8(15);
  for (int c = 0; c < 8; c += 2) {
    const __m512i bytes = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(w + 32 * c));
    const __m512i index[2] = {_mm512_ternarylogic_epi32(bytes, nibble, rows, 0xEA),
                              _mm512_ternarylogic_epi32(_mm512_srli_epi16(bytes, 4), nibble, rows, 0xEA)};
    for (int n = 0; n < 2; ++n) {
      __m512i lo = _mm512_mask2_permutex2var_epi8(low[0], index[n], k.first_eight, low[1]);
      lo = _mm512_mask2_permutex2var_epi8(low[2], lo, ~k.first_eight, low[3]);
      __m512i hi = _mm512_mask2_permutex2var_epi8(high[0], index[n], k.first_eight, high[1]);
      hi = _mm512_mask2_permutex2var_epi8(high[2], hi, ~k.first_eight, high[3]);
      pairs[8 * n + c] = _mm512_unpacklo_epi8(lo, hi);
      pairs[8 * n + c + 1] = _mm512_unpackhi_epi8(lo, hi);
    }
  }
}
#endif

using Variant = void (*)(const uint8_t*, __m512, __m512, __m512i*);

}  // namespace

// Per variant (the kernel's loop first): the best ns per group over `repeats` passes of `groups` groups; checks
// that every variant gives the kernel's bits on every group.
std::vector<double> run(int64_t groups, int64_t repeats, bool sink) {
  std::vector<Variant> variants{kernel_loop, lookup_words};
#ifdef __AVX512VBMI__
  variants.push_back(lookup_bytes);
#endif
  std::mt19937 rng(0);
  std::vector<uint8_t> codes(groups * 256);
  for (auto& b : codes) b = rng();
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::vector<float> scales(groups * 32);  // per group 16 scales, then 16 minimums (either sign)
  for (auto& s : scales) s = c10::Half(uniform(rng) * 1e-2f) * float(rng() % 64);
  std::vector<int32_t> x(1024);
  for (auto& v : x) v = rng() & 0x3F7F3F7F;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i expected[16], got[16];
    const __m512 s = _mm512_loadu_ps(&scales[32 * g]), m = _mm512_loadu_ps(&scales[32 * g + 16]);
    kernel_loop(&codes[256 * g], s, m, expected);
    for (auto variant : variants) {
      variant(&codes[256 * g], s, m, got);
      TORCH_CHECK(std::memcmp(expected, got, sizeof got) == 0, "a variant's bits differ at group ", g);
    }
  }
  std::vector<double> best(variants.size(), 1e30);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t rep = 0; rep < repeats; ++rep)
    for (size_t v = 0; v < variants.size(); ++v) {
      const auto start = std::chrono::steady_clock::now();
      for (int64_t g = 0; g < groups; ++g) {
        __m512i pairs[16];
        variants[v](&codes[256 * g], _mm512_loadu_ps(&scales[32 * g]), _mm512_loadu_ps(&scales[32 * g + 16]), pairs);
        if (sink)
          for (int p = 0; p < 16; ++p)
            sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_set1_epi32(x[(16 * g + p) % 1024]), (__m512bh)pairs[p]);
        else
          sum = _mm512_add_ps(sum, (__m512)pairs[g % 16]);
      }
      const std::chrono::duration<double, std::nano> took = std::chrono::steady_clock::now() - start;
      best[v] = std::min(best[v], took.count() / groups);
    }
  static volatile float kept;  // the sums, so that no pass is optimized away
  kept = _mm512_reduce_add_ps(sum);
  return best;
}
'''


def build_probe(name: str, source: str, binding: str):
    """Compiles a probe's C++ source and its pybind11 binding, with the native kernels' headers, and loads it."""
    build_dir = os.path.join(get_default_build_root(), name)
    os.makedirs(build_dir, exist_ok=True)
    sources = []
    for file_name, text in (('variants.cpp', source), ('binding.cpp', binding)):
        sources.append(os.path.join(build_dir, file_name))
        with open(sources[-1], 'w') as f:
            f.write(text)
    return load(name, sources, extra_include_paths=[KERNELS], extra_cflags=['-O3', '-march=native'],
                build_directory=build_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--groups', type=int, default=256, help='groups a pass (256 bytes of codes each)')
    parser.add_argument('--repeats', type=int, default=400)
    parser.add_argument('--sink', action='store_true', help="add a one-row step's sum of each group")
    args = parser.parse_args()
    module = build_probe('kquant_lookup_bench', SOURCE, BINDING)
    names = ['kernel (weight_pairs)', 'lookup words', 'lookup bytes']
    best = module.run(args.groups, args.repeats, args.sink)
    print(f'load {os.getloadavg()[0]:.1f}; ns per group of 512 weights (best of {args.repeats}), the bits equal:')
    for name, ns in zip(names, best):
        print(f'{name:22s} {ns:7.1f}  {ns / best[0]:.2f}x')


if __name__ == '__main__':
    main()
