// The MoE block of the native decoder stack: SparseMoeBlock's forward (lmdeploy/pytorch/models/moe.py) with
// the kernels its Python path calls (moe_routing and run_experts of kernels/moe.py, the experts' kernels), in
// the same order, so that its results are the same.
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>

#include "common.h"

MoEBlock::MoEBlock(Projection router, int64_t top_k, bool renormalize, c10::optional<torch::Tensor> gate_up,
                   c10::optional<torch::Tensor> down, std::vector<Projection> expert_gate_up,
                   std::vector<Projection> expert_down, c10::optional<Projection> shared_gate_up,
                   c10::optional<Projection> shared_down, c10::optional<Projection> shared_gate)
    : router(std::move(router)), top_k(top_k), renormalize(renormalize), gate_up(std::move(gate_up)),
      down(std::move(down)), expert_gate_up(std::move(expert_gate_up)), expert_down(std::move(expert_down)),
      shared_gate_up(std::move(shared_gate_up)), shared_down(std::move(shared_down)),
      shared_gate(std::move(shared_gate)) {
  const bool dense = this->gate_up.has_value() && this->down.has_value();
  TORCH_CHECK(this->gate_up.has_value() == this->down.has_value() &&
                  dense == this->expert_gate_up.empty() && this->expert_gate_up.size() == this->expert_down.size(),
              "a MoE block's experts are dense gate_up and down, or each expert's projections (as many of each)");
  if (dense)
    TORCH_CHECK(this->gate_up->dim() == 3 && this->down->dim() == 3 && this->gate_up->size(0) == this->down->size(0),
                "dense experts are gate_up [E, 2I, H] and down [E, H, I]");
  num_experts = dense ? this->gate_up->size(0) : static_cast<int64_t>(this->expert_gate_up.size());
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "a MoE block routes each token to 1 to num_experts experts");
  TORCH_CHECK(this->shared_gate_up.has_value() == this->shared_down.has_value() &&
                  this->shared_gate_up.has_value() == this->shared_gate.has_value(),
              "a shared expert has its gate_up, down and gate projections");
}

torch::Tensor MoEBlock::expert(int64_t e, const torch::Tensor& rows) const {
  if (!gate_up) return expert_down[e](expert_gate_up[e].gate_up_silu(rows));
  const auto halves = at::linear(rows, gate_up->select(0, e)).chunk(2, -1);  // fused_moe's silu_and_mul in torch
  return at::linear(at::silu(halves[0]).mul(halves[1]), down->select(0, e));
}

torch::Tensor MoEBlock::operator()(const torch::Tensor& x) const {
  auto [topk_weights, topk_ids] = router(x).to(at::kFloat).softmax(-1).topk(top_k, -1);
  if (renormalize) topk_weights = topk_weights.div(topk_weights.sum(-1, true));
  const auto flat_ids = topk_ids.flatten();
  const auto order = flat_ids.argsort(/*stable=*/true);
  const auto counts = flat_ids.bincount({}, num_experts);
  const auto* count = counts.data_ptr<int64_t>();
  const auto tokens = order.floor_divide(top_k);
  const auto weights = topk_weights.flatten().index_select(0, order).to(x.scalar_type());
  auto out = torch::zeros_like(x);
  for (int64_t e = 0, start = 0; e < num_experts; start += count[e], ++e) {
    if (count[e] == 0) continue;
    const auto rows = tokens.narrow(0, start, count[e]);
    out.index_add_(0, rows, expert(e, x.index_select(0, rows)).mul(weights.narrow(0, start, count[e]).unsqueeze(1)));
  }
  if (shared_gate_up)
    out = out.add((*shared_gate)(x).sigmoid().mul((*shared_down)(shared_gate_up->gate_up_silu(x))));
  return out;
}
