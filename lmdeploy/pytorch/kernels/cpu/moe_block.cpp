// The MoE block of the native decoder stack: the forward of SparseMoeBlock (lmdeploy/pytorch/models/moe.py; gpt-oss's
// with the experts' biases and the clamped SwiGLU), of DeepseekV3MoE (models/deepseek_v3.py, V3's and V2's
// routings), of Ernie4_5MoE (models/ernie.py) or of Llama4MoE (models/llama4.py) with the kernels their Python paths
// call (moe_routing, grouped_topk, group_limited_topk or biased_softmax_topk, or the top-k logits' sigmoid, and
// run_experts of kernels/moe.py, the experts' kernels), in the same order, so that its results are the same.
#include <ATen/ops/clamp.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/silu.h>

#include "decoder_stack.h"

namespace {

MoEBlock::Routing routing_named(const std::string& name) {
  if (name == "softmax") return MoEBlock::Routing::kSoftmax;
  if (name == "biased_softmax") return MoEBlock::Routing::kBiasedSoftmax;
  if (name == "sigmoid_scaled_input") return MoEBlock::Routing::kSigmoidScaledInput;
  if (name == "greedy") return MoEBlock::Routing::kGreedy;
  if (name == "group_limited_greedy") return MoEBlock::Routing::kGroupLimitedGreedy;
  TORCH_CHECK(name == "noaux_tc",
              "a MoE block's routing is 'softmax', 'biased_softmax', 'sigmoid_scaled_input', 'noaux_tc', 'greedy' or "
              "'group_limited_greedy', not '", name, "'");
  return MoEBlock::Routing::kNoauxTc;
}

MoEBlock::Activation activation_named(const std::string& name) {
  if (name == "clamped_swiglu") return MoEBlock::Activation::kClampedSwiGLU;
  TORCH_CHECK(name == "silu", "a MoE block's activation is 'silu' or 'clamped_swiglu', not '", name, "'");
  return MoEBlock::Activation::kSilu;
}

}  // namespace

MoEBlock::MoEBlock(Projection router, int64_t top_k, bool renormalize, const std::string& routing,
                   c10::optional<torch::Tensor> correction_bias, c10::optional<int64_t> num_groups,
                   c10::optional<int64_t> topk_groups, c10::optional<double> scaling, c10::optional<double> norm_min,
                   c10::optional<torch::Tensor> gate_up, c10::optional<torch::Tensor> down,
                   c10::optional<torch::Tensor> gate_up_bias, c10::optional<torch::Tensor> down_bias,
                   std::vector<Projection> expert_gate_up, std::vector<Projection> expert_down,
                   const std::string& activation, c10::optional<double> swiglu_alpha,
                   c10::optional<double> swiglu_limit, c10::optional<Projection> shared_gate_up,
                   c10::optional<Projection> shared_down, c10::optional<Projection> shared_gate)
    : router(std::move(router)), top_k(top_k), renormalize(renormalize), routing(routing_named(routing)),
      correction_bias(std::move(correction_bias)), gate_up(std::move(gate_up)), down(std::move(down)),
      gate_up_bias(std::move(gate_up_bias)), down_bias(std::move(down_bias)),
      expert_gate_up(std::move(expert_gate_up)), expert_down(std::move(expert_down)),
      activation(activation_named(activation)), shared_gate_up(std::move(shared_gate_up)),
      shared_down(std::move(shared_down)), shared_gate(std::move(shared_gate)) {
  const bool dense = this->gate_up.has_value() && this->down.has_value();
  TORCH_CHECK(this->gate_up.has_value() == this->down.has_value() &&
                  dense == this->expert_gate_up.empty() && this->expert_gate_up.size() == this->expert_down.size(),
              "a MoE block's experts are dense gate_up and down, or each expert's projections (as many of each)");
  if (dense)
    TORCH_CHECK(this->gate_up->dim() == 3 && this->down->dim() == 3 && this->gate_up->size(0) == this->down->size(0),
                "dense experts are gate_up [E, 2I, H] and down [E, H, I]");
  num_experts = dense ? this->gate_up->size(0) : static_cast<int64_t>(this->expert_gate_up.size());
  TORCH_CHECK(dense || (!this->gate_up_bias && !this->down_bias),
              "per-expert projections hold their own biases (gate_up_bias and down_bias are the dense experts')");
  if (this->gate_up_bias)
    TORCH_CHECK(this->gate_up_bias->dim() == 2 && this->gate_up_bias->size(0) == num_experts &&
                    this->gate_up_bias->size(1) == this->gate_up->size(1),
                "gate_up_bias is [E, 2I]");
  if (this->down_bias)
    TORCH_CHECK(this->down_bias->dim() == 2 && this->down_bias->size(0) == num_experts &&
                    this->down_bias->size(1) == this->down->size(1),
                "down_bias is [E, H]");
  TORCH_CHECK((this->activation == Activation::kClampedSwiGLU) == (swiglu_alpha && swiglu_limit) &&
                  swiglu_alpha.has_value() == swiglu_limit.has_value(),
              "activation 'clamped_swiglu' takes swiglu_alpha and swiglu_limit ('silu' neither)");
  if (swiglu_limit) {
    TORCH_CHECK(*swiglu_limit > 0, "swiglu_limit is positive");
    this->swiglu_alpha = *swiglu_alpha;
    this->swiglu_limit = *swiglu_limit;
  }
  TORCH_CHECK(top_k >= 1 && top_k <= num_experts, "a MoE block routes each token to 1 to num_experts experts");
  TORCH_CHECK(this->shared_gate_up.has_value() == this->shared_down.has_value() &&
                  (this->shared_gate_up.has_value() || !this->shared_gate.has_value()),
              "a shared expert has its gate_up and down projections (and a gate where it is gated)");
  const bool grouped = num_groups || topk_groups || scaling;
  if (this->routing == Routing::kSoftmax || this->routing == Routing::kSigmoidScaledInput) {
    TORCH_CHECK(!grouped && !this->correction_bias && !norm_min,
                "correction_bias, num_groups, topk_groups, scaling and norm_min belong to other routings");
    TORCH_CHECK(this->routing == Routing::kSoftmax || !renormalize,
                "routing 'sigmoid_scaled_input' does not renormalize");
    return;
  }
  if (this->routing == Routing::kGreedy || this->routing == Routing::kGroupLimitedGreedy) {
    const bool limited = this->routing == Routing::kGroupLimitedGreedy;
    TORCH_CHECK(scaling && !this->correction_bias && !norm_min && !renormalize &&
                    num_groups.has_value() == limited && topk_groups.has_value() == limited,
                "routings 'greedy' and 'group_limited_greedy' take scaling ('group_limited_greedy' num_groups and "
                "topk_groups too; not correction_bias nor norm_min) and do not renormalize");
    this->scaling = *scaling;
    if (!limited) return;
    this->num_groups = *num_groups;
    this->topk_groups = *topk_groups;
    TORCH_CHECK(this->num_groups >= 1 && num_experts % this->num_groups == 0,
                "the experts split into num_groups equal groups");
    TORCH_CHECK(this->topk_groups >= 1 && this->topk_groups <= this->num_groups &&
                    top_k <= this->topk_groups * (num_experts / this->num_groups),
                "topk_groups is 1 to num_groups, and their experts hold top_k");
    return;
  }
  if (this->correction_bias)
    TORCH_CHECK(this->correction_bias->dim() == 1 && this->correction_bias->size(0) == num_experts,
                "the correction bias holds one value per expert");
  if (this->routing == Routing::kBiasedSoftmax) {
    TORCH_CHECK(this->correction_bias && norm_min && !grouped && renormalize,
                "routing 'biased_softmax' takes correction_bias and norm_min (not num_groups, topk_groups nor "
                "scaling) and renormalizes");
    this->norm_min = *norm_min;
    return;
  }
  TORCH_CHECK(this->correction_bias && num_groups && topk_groups && scaling && !norm_min,
              "routing 'noaux_tc' takes correction_bias, num_groups, topk_groups and scaling (not norm_min)");
  this->num_groups = *num_groups;
  this->topk_groups = *topk_groups;
  this->scaling = *scaling;
  TORCH_CHECK(this->num_groups >= 1 && num_experts % this->num_groups == 0 && num_experts / this->num_groups >= 2,
              "the experts split into num_groups equal groups of two or more");
  TORCH_CHECK(this->topk_groups >= 1 && this->topk_groups <= this->num_groups &&
                  top_k <= this->topk_groups * (num_experts / this->num_groups),
              "topk_groups is 1 to num_groups, and their experts hold top_k");
}

std::tuple<torch::Tensor, torch::Tensor> MoEBlock::route(const torch::Tensor& x) const {
  if (routing == Routing::kSigmoidScaledInput) {  // Llama4MoE.forward: the scores in x's dtype
    const auto [top_logits, ids] = router(x).topk(top_k, -1);
    return {top_logits.to(at::kFloat).sigmoid().to(x.scalar_type()), ids};
  }
  const auto logits = router(x).to(at::kFloat);
  if (routing == Routing::kSoftmax) {
    auto [weights, ids] = logits.softmax(-1).topk(top_k, -1);
    if (renormalize) weights = weights.div(weights.sum(-1, true));
    return {weights, ids};
  }
  if (routing == Routing::kGreedy) {  // DeepseekV3MoE.route: moe_routing without renormalization
    const auto [weights, ids] = logits.softmax(-1).topk(top_k, -1);
    return {weights.mul(scaling), ids};
  }
  if (routing == Routing::kGroupLimitedGreedy) {  // group_limited_topk
    const auto scores = logits.softmax(-1);
    const auto grouped = scores.view({scores.size(0), num_groups, -1});
    const auto best_groups =
        std::get<1>(std::get<0>(grouped.max(-1)).topk(topk_groups, -1, /*largest=*/true, /*sorted=*/false));
    const auto keep = at::zeros_like(grouped.select(-1, 0), at::kBool).scatter_(1, best_groups, true);
    const auto [weights, ids] = scores.masked_fill(keep.logical_not().repeat_interleave(grouped.size(-1), 1), 0.0)
                                    .topk(top_k, -1, /*largest=*/true, /*sorted=*/false);
    return {weights.mul(scaling), ids};
  }
  if (routing == Routing::kBiasedSoftmax) {  // biased_softmax_topk
    const auto scores = logits.softmax(-1);
    const auto ids = std::get<1>(scores.add(correction_bias->to(at::kFloat)).topk(top_k, -1));
    const auto weights = scores.gather(1, ids);
    return {weights.div(weights.sum(-1, true).clamp_min(norm_min)), ids};
  }
  // in fp64, as grouped_topk: fp32's vectorized and scalar (last elements) exps differ in the last bit
  const auto scores = logits.to(at::kDouble).sigmoid().to(at::kFloat);
  auto biased = scores.add(correction_bias->to(at::kFloat));
  const auto grouped = biased.view({scores.size(0), num_groups, -1});
  const auto group_scores = std::get<0>(grouped.topk(2, -1)).sum(-1);
  const auto best_groups = std::get<1>(group_scores.topk(topk_groups, -1, /*largest=*/true, /*sorted=*/false));
  const auto keep = at::zeros_like(grouped.select(-1, 0), at::kBool).scatter_(1, best_groups, true);
  biased = biased.masked_fill(keep.logical_not().repeat_interleave(grouped.size(-1), 1),
                              -std::numeric_limits<double>::infinity());
  const auto ids = std::get<1>(biased.topk(top_k, -1, /*largest=*/true, /*sorted=*/false));
  auto weights = scores.gather(1, ids);
  if (renormalize) weights = weights.div(weights.sum(-1, true).add(1e-20));
  return {weights.mul(scaling), ids};
}

torch::Tensor MoEBlock::activate(const torch::Tensor& gate_up) const {
  const auto halves = gate_up.chunk(2, -1);
  if (activation == Activation::kSilu) return at::silu(halves[0]).mul(halves[1]);  // fused_moe's, in torch
  const auto gate = at::clamp(halves[0], c10::nullopt, swiglu_limit);
  const auto up = halves[1].clamp(-swiglu_limit, swiglu_limit);
  return up.add(1).mul(gate.mul(gate.mul(swiglu_alpha).sigmoid()));
}

torch::Tensor MoEBlock::expert(int64_t e, const torch::Tensor& rows) const {
  if (!gate_up) {
    if (activation == Activation::kSilu) return expert_down[e](expert_gate_up[e].gate_up_silu(rows));
    return expert_down[e](activate(expert_gate_up[e](rows)));
  }
  const auto bias = [](const c10::optional<torch::Tensor>& biases, int64_t e) {
    return biases ? c10::optional<torch::Tensor>(biases->select(0, e)) : c10::nullopt;
  };
  const auto hidden = activate(at::linear(rows, gate_up->select(0, e), bias(gate_up_bias, e)));
  return at::linear(hidden, down->select(0, e), bias(down_bias, e));
}

torch::Tensor MoEBlock::run_experts(const torch::Tensor& x, const torch::Tensor& topk_weights,
                                    const torch::Tensor& topk_ids) const {
  if (auto out = run_experts_in_one_region(x, topk_weights, topk_ids)) return *out;
  const auto flat_ids = topk_ids.flatten();
  const auto order = flat_ids.argsort(/*stable=*/true);
  const auto counts = flat_ids.bincount({}, num_experts);
  const auto* count = counts.data_ptr<int64_t>();
  const auto tokens = order.floor_divide(topk_ids.size(1));
  const auto weights = topk_weights.flatten().index_select(0, order).to(x.scalar_type());
  auto out = torch::zeros_like(x);
  for (int64_t e = 0, start = 0; e < num_experts; start += count[e], ++e) {
    if (count[e] == 0) continue;
    const auto rows = tokens.narrow(0, start, count[e]);
    out.index_add_(0, rows, expert(e, x.index_select(0, rows)).mul(weights.narrow(0, start, count[e]).unsqueeze(1)));
  }
  return out;
}

torch::Tensor MoEBlock::operator()(const torch::Tensor& x) const {
  const auto [topk_weights, topk_ids] = route(x);
  torch::Tensor out;
  if (routing == Routing::kSigmoidScaledInput) {  // each token's k copies scaled by their scores, weights of one
    const auto copies = x.unsqueeze(1).mul(topk_weights.unsqueeze(-1)).flatten(0, 1);
    const auto ones = at::ones({copies.size(0), 1}, x.options().dtype(at::kFloat));
    out = run_experts(copies, ones, topk_ids.reshape({-1, 1})).view({x.size(0), top_k, -1}).sum(1);
  } else {
    out = run_experts(x, topk_weights, topk_ids);
  }
  if (!shared_gate_up) return out;
  const auto shared = (*shared_down)(shared_gate_up->gate_up_silu(x));
  return out.add(shared_gate ? (*shared_gate)(x).sigmoid().mul(shared) : shared);
}
