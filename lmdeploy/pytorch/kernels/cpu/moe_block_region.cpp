// A MoE block's routed experts for a step of a few tokens in one OpenMP parallel region (run_experts calls it
// first): every routed expert's gate_up tiles shared out among the threads, then their activations, then every
// down tile, then the weighted sum on the calling thread. Each GEMV being its own region, a batch-1 layer of 8
// experts opened 16 regions (and torch's small ops between them), each ending when both threads had finished:
// on a loaded machine a descheduled thread held every one of them up. The kernels, their roundings and the order
// of the sum are run_experts' (the layers' forward), so the results are the same bit for bit.
#include "decoder_stack.h"
#include "gemv_tiles.h"
#include "linear_q5k.h"

namespace {

// Steps of at most this many tokens (rows of x) run their experts in one region.
constexpr int64_t kOneRegionMaxTokens = 8;

// Whether p runs on a GEMV with tiles (as gate_up_silu where `gate_up`); biases only where the kernel adds them.
bool tiled(const Projection& p, bool gate_up) {
  switch (p.kind) {
    case Projection::Kind::kInt4:
    case Projection::Kind::kQ4K: return int4_gemv_available() && !(gate_up && p.bias);
    case Projection::Kind::kQ5K: return q5k_gemv_available() && !p.bias;
    case Projection::Kind::kQ6K: return q6k_gemv_available() && !p.bias;
    case Projection::Kind::kQ8: return q8_gemv_available() && !p.bias;
    default: return false;
  }
}

// p's tiles (a tiled() kind) on x [M, K] into out: bf16 [M, N] (int4 and Q4_K; with gate_up_silu [M, N / 2]) or
// fp32 [M, N].
GemvTiles tiles_of(const Projection& p, const torch::Tensor& x, bool gate_up_silu, const torch::Tensor& out) {
  switch (p.kind) {
    case Projection::Kind::kInt4:
    case Projection::Kind::kQ4K:
      return int4_tiles(x, p.weight, *p.scale, p.bias, gate_up_silu, p.kind == Projection::Kind::kQ4K, out);
    case Projection::Kind::kQ5K: return q5k_tiles(x, p.weight, *p.scale, out);
    case Projection::Kind::kQ6K: return q6k_tiles(x, p.weight, *p.scale, out);
    default: return q8_tiles(x, p.weight, *p.scale, out);
  }
}

// One GEMV of the region: its tiles, its fp32 outputs where the kernel gives those, and its bf16 result.
struct Job {
  GemvTiles tiles;
  torch::Tensor fp32, result;
};

// Runs unit `unit` of `job`, rounding its fp32 outputs (16 columns, every row) to bf16 as Projection's .to() does.
void run_unit(const Job& job, int64_t unit) {
  job.tiles.run(unit);
  if (!job.tiles.fp32_out) return;
  const int64_t N = job.fp32.size(1);
  const float* from = job.fp32.data_ptr<float>() + unit * 16;
  c10::BFloat16* to = job.result.data_ptr<c10::BFloat16>() + unit * 16;
  for (int64_t m = 0; m < job.fp32.size(0); ++m)
#pragma omp simd
    for (int64_t j = 0; j < 16; ++j) to[m * N + j] = from_float<c10::BFloat16>(from[m * N + j]);
}

// Every unit of `jobs` in the enclosing region, shared out among its threads (the end waits for all).
void run_jobs(const std::vector<Job>& jobs, const std::vector<int64_t>& first_unit) {
#pragma omp for schedule(dynamic, 4)
  for (int64_t unit = 0; unit < first_unit.back(); ++unit) {
    const size_t j = std::upper_bound(first_unit.begin(), first_unit.end(), unit) - first_unit.begin() - 1;
    run_unit(jobs[j], unit - first_unit[j]);
  }
}

// Whether a step of `tokens` tokens of `block` may run its experts in one region: few tokens, per-expert
// projections, SiLU (the projections' kinds are checked per expert).
bool one_region_step(const MoEBlock& block, int64_t tokens) {
  return tokens <= kOneRegionMaxTokens && !block.gate_up && block.activation == MoEBlock::Activation::kSilu;
}

std::vector<int64_t> first_units(const std::vector<Job>& jobs) {
  std::vector<int64_t> first{0};
  for (const auto& job : jobs) first.push_back(first.back() + job.tiles.units);
  return first;
}

}  // namespace

bool MoEBlock::experts_in_one_region(int64_t tokens) const {
  if (!one_region_step(*this, tokens)) return false;
  for (int64_t e = 0; e < num_experts; ++e)
    if (!tiled(expert_gate_up[e], true) || !tiled(expert_down[e], false)) return false;
  return true;
}

c10::optional<torch::Tensor> MoEBlock::run_experts_in_one_region(const torch::Tensor& x,
                                                                 const torch::Tensor& topk_weights,
                                                                 const torch::Tensor& topk_ids) const {
  if (x.dim() != 2 || x.scalar_type() != at::kBFloat16 || !one_region_step(*this, x.size(0))) return c10::nullopt;
  const int64_t T = x.size(0), k = topk_ids.size(1), H = x.size(1);
  // run_experts' order: the experts in order, each one's rows (token, weight) in token order.
  const auto ids = topk_ids.to(at::kLong).contiguous();
  const auto weights = topk_weights.to(at::kFloat).contiguous();
  std::vector<int64_t> order(T * k);
  for (int64_t i = 0; i < T * k; ++i) order[i] = i;
  const int64_t* id = ids.data_ptr<int64_t>();
  std::stable_sort(order.begin(), order.end(), [id](int64_t a, int64_t b) { return id[a] < id[b]; });
  struct Expert {
    int64_t id, start, rows;
  };
  std::vector<Expert> experts;
  for (int64_t i = 0; i < T * k; ++i) {
    if (i == 0 || id[order[i]] != id[order[i - 1]]) experts.push_back({id[order[i]], i, 0});
    ++experts.back().rows;
  }
  for (const auto& e : experts)
    if (!tiled(expert_gate_up[e.id], true) || !tiled(expert_down[e.id], false))
      return c10::nullopt;

  const auto xc = x.contiguous();
  const auto rows = torch::empty({T * k, H}, x.options());  // each expert's rows of x, one after another
  for (int64_t i = 0; i < T * k; ++i)
    std::memcpy(rows.data_ptr<c10::BFloat16>() + i * H, xc.data_ptr<c10::BFloat16>() + order[i] / k * H,
                H * sizeof(c10::BFloat16));
  std::vector<Job> ups, downs;
  std::vector<torch::Tensor> hidden;  // each expert's activations [rows, I]
  for (const auto& e : experts) {
    const Projection& up = expert_gate_up[e.id];
    const Projection& down = expert_down[e.id];
    const auto in = rows.narrow(0, e.start, e.rows);
    const bool fused = up.kind == Projection::Kind::kInt4 || up.kind == Projection::Kind::kQ4K;
    const int64_t N_up = up.weight.size(0) * 16, I = N_up / 2, N_down = down.weight.size(0) * 16;
    Job job;
    job.result = torch::empty({e.rows, fused ? I : N_up}, x.options());
    if (!fused) job.fp32 = torch::empty({e.rows, N_up}, x.options().dtype(at::kFloat));
    job.tiles = tiles_of(up, in, fused, fused ? job.result : job.fp32);
    hidden.push_back(fused ? job.result : torch::empty({e.rows, I}, x.options()));
    ups.push_back(std::move(job));
    Job out;
    const bool fp32_down = down.kind != Projection::Kind::kInt4 && down.kind != Projection::Kind::kQ4K;
    out.result = torch::empty({e.rows, N_down}, x.options());
    if (fp32_down) out.fp32 = torch::empty({e.rows, N_down}, x.options().dtype(at::kFloat));
    out.tiles = tiles_of(down, hidden.back(), false, fp32_down ? out.fp32 : out.result);
    TORCH_CHECK(N_down == H, "an expert's down projection gives the hidden size");
    downs.push_back(std::move(out));
  }
  for (const auto& job : ups) job.tiles.prepare();
  const auto first_up = first_units(ups), first_down = first_units(downs);
  const int64_t num = static_cast<int64_t>(experts.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
    run_jobs(ups, first_up);
#pragma omp for schedule(dynamic, 1)
    for (int64_t e = 0; e < num; ++e) {
      if (!hidden[e].is_same(ups[e].result)) {  // silu_and_mul of the gate_up projection's bf16 result
        const int64_t I = hidden[e].size(1);
        for (int64_t r = 0; r < experts[e].rows; ++r)
          silu_and_mul_row(ups[e].result.data_ptr<c10::BFloat16>() + r * 2 * I,
                           hidden[e].data_ptr<c10::BFloat16>() + r * I, I);
      }
      downs[e].tiles.prepare();
    }
    run_jobs(downs, first_down);
  }

  // out[t] += expert(x[t]) * w in bf16, the experts in order (run_experts' mul and index_add_).
  auto out = torch::zeros_like(xc);
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const float* w = weights.data_ptr<float>();
  for (int64_t e = 0; e < num; ++e) {
    const c10::BFloat16* y = downs[e].result.data_ptr<c10::BFloat16>();
    for (int64_t r = 0; r < experts[e].rows; ++r) {
      const int64_t pair = order[experts[e].start + r];
      const float weight = to_float(from_float<c10::BFloat16>(w[pair]));
      c10::BFloat16* row = o + pair / k * H;
      const c10::BFloat16* yr = y + r * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) {
        const float weighted = to_float(from_float<c10::BFloat16>(to_float(yr[h]) * weight));
        row[h] = from_float<c10::BFloat16>(to_float(row[h]) + weighted);
      }
    }
  }
  return out;
}
