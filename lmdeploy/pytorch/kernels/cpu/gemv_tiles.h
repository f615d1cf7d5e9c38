// A GEMV of a few rows split into units of output tiles that the threads of a parallel region share out: the
// kernels' own calls (q4k_linear, q6k_linear, ...) open a region over one GEMV's units; moe_block_region.cpp runs
// every routed expert's units in one region. Each kernel has one implementation of its inner loop, behind `run`.
#pragma once

#include <functional>

#include "common.h"

struct GemvTiles {
  int64_t units = 0;
  // Once, before any unit, on one thread: what every unit reads of x (its groups' sums, or x in fp32). Reads x
  // when it is called, so x may be written after the tiles are made.
  std::function<void()> prepare;
  // The outputs of unit `unit` for every row of x; units write disjoint outputs, in any order, on any thread.
  std::function<void(int64_t unit)> run;
  // Whether a unit's outputs are 16 fp32 columns (q5k, q6k, q8) rather than finished bf16 ones (int4, q4k).
  bool fp32_out = false;
};

// `tiles` on the calling thread's team: its own parallel region, each thread a static share of the units.
inline void run_tiles(const GemvTiles& tiles) {
  tiles.prepare();
#pragma omp parallel for schedule(static) num_threads(at::get_num_threads())
  for (int64_t unit = 0; unit < tiles.units; ++unit) tiles.run(unit);
}

// The tiles of each GEMV kernel, checked here (so that no unit throws). x: bf16 [M, K] contiguous; `out`
// contiguous [M, N] (gate_up: [M, N / 2]) in bf16, or fp32 where `fp32_out`. A unit is a tile of 16 outputs (the
// int4 and Q4_K gate_up: a gate tile and its up tile, 16 outputs of silu(gate) * up). Built with AVX512-BF16, as the
// kernels' *_gemv_available() say.
GemvTiles int4_tiles(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                     const c10::optional<torch::Tensor>& bias, bool gate_up, bool q4k, const torch::Tensor& out);
GemvTiles q5k_tiles(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                    const torch::Tensor& out);
GemvTiles q6k_tiles(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                    const torch::Tensor& out);
GemvTiles q8_tiles(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                   const torch::Tensor& out);
