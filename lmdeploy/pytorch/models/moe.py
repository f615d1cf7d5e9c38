"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with a shared expert) and Qwen3-MoE; the MoE block of
gpt-oss; the split of stacked expert tensors (Qwen3-VL-MoE, Llama 4)."""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels import cpu, moe_routing
from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU, placeless
from lmdeploy.pytorch.models.llama import LlamaForCausalLM, LlamaMLP, WeightTarget
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant import use_weight_format, weight_format_for
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource, read_shard

# HF expert projection name -> FusedExperts part
EXPERT_PARTS = {'w1': 'gate', 'w3': 'up', 'w2': 'down', 'gate_proj': 'gate', 'up_proj': 'up', 'down_proj': 'down'}
EXPERT_NAME = re.compile(r'(layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.(\w+)')
STACKED_EXPERTS = re.compile(r'(.*layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)')


def split_stacked_experts(weights: Iterable[tuple[str, WeightSource]], hidden_size: int,
                          hub_layout_only: bool = False) -> Iterator[tuple[str, WeightSource]]:
    """``weights`` with each layer's stacked experts split into per-expert weights. The hub's checkpoints stack
    them as ``gate_up_proj [E, H, 2I]`` (gate columns, then up) and ``down_proj [E, I, H]``, transformers 5 saves
    some families' (Qwen3-VL-MoE) as ``[E, 2I, H]`` and ``[E, H, I]``; like transformers, a tensor whose shape
    already fits the second layout is taken as it is, unless ``hub_layout_only`` (Llama 4, whose files have one
    layout: a square ``gate_up_proj`` fits both). Each rank reads the whole stack and keeps its share."""
    for name, tensor in weights:
        match = STACKED_EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, kind = match.groups()
        stacked = read_shard(tensor, None)
        if kind == 'gate_up_proj':
            in_hub_layout = hub_layout_only or stacked.shape[2] != hidden_size
            stacked = stacked.transpose(1, 2) if in_hub_layout else stacked
            for expert, (gate, up) in enumerate(zip(*stacked.chunk(2, dim=1))):
                yield f'{prefix}.{expert}.gate_proj.weight', gate
                yield f'{prefix}.{expert}.up_proj.weight', up
        else:
            in_hub_layout = hub_layout_only or stacked.shape[1] != hidden_size
            stacked = stacked.transpose(1, 2) if in_hub_layout else stacked
            for expert, down in enumerate(stacked):
                yield f'{prefix}.{expert}.down_proj.weight', down


class SparseMoeBlock(nn.Module):
    """Routes each token to its top-k experts; Qwen2-MoE adds a sigmoid-gated shared expert. ``bias`` gives
    the router and the experts biases and ``activation`` replaces the experts' SiLU-and-mul (gpt-oss);
    ``renormalize`` (None: the config's ``norm_topk_prob``, by default on) rescales the top-k weights to sum to 1."""

    def __init__(self, cfg: ModelConfig, bias: bool = False, activation: ClampedSwiGLU | None = None,
                 renormalize: bool | None = None):
        super().__init__()
        hf = cfg.hf_config
        num_experts = getattr(hf, 'num_local_experts', None) or hf.num_experts
        intermediate = getattr(hf, 'moe_intermediate_size', None) or hf.intermediate_size
        self.top_k = hf.num_experts_per_tok
        self.renormalize = getattr(hf, 'norm_topk_prob', True) if renormalize is None else renormalize
        shared = getattr(hf, 'shared_expert_intermediate_size', None)
        with use_weight_format(weight_format_for(None)):  # quantized checkpoints keep the routers dense
            self.gate = Linear(cfg.hidden_size, num_experts, bias=bias)
            self.shared_expert_gate = Linear(cfg.hidden_size, 1) if shared else None
        self.experts = FusedExperts(cfg.hidden_size, intermediate, num_experts, bias, activation)
        self.shared_expert = LlamaMLP(cfg, shared) if shared else None

    def native_moe(self, small_step: bool = False) -> object | None:
        """This block as a ``MoEBlock`` of :class:`~lmdeploy.pytorch.nn.decoder_stack.NativeDecoderStack`
        (``small_step``: for the stack of small steps, see ``LinearKernel.expert_projection``); None where a part
        runs on no native kernel."""
        native = self.experts.native_experts(small_step)
        router = self.gate.kernel.router_projection(self.gate.bias)
        if native is None or router is None:
            return None
        if self.shared_expert is not None:
            shared = shared_expert_projections(self.shared_expert, small_step)
            gate = self.shared_expert_gate
            shared_gate = gate.kernel.router_projection(gate.bias)
            if shared is None or shared_gate is None:
                return None
            native.update(shared, shared_gate=shared_gate)
        return cpu.native().MoEBlock(router=router, top_k=self.top_k, renormalize=self.renormalize,
                                     routing='softmax', **native)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = moe_routing(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            out = out + placeless(torch.sigmoid, self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def shared_expert_projections(mlp: LlamaMLP, small_step: bool) -> dict[str, object] | None:
    """A MoE block's shared expert as the ``MoEBlock`` takes it (``shared_gate_up``, ``shared_down``), each its
    kernel's native projection (``small_step``: for steps of at most ``small_step_rows`` tokens); None where one
    runs on no native kernel."""
    shared = {f'shared_{name}': (proj.kernel.small_step_projection if small_step else
                                 proj.kernel.native_projection)(proj.bias)
              for name, proj in (('gate_up', mlp.gate_up_proj), ('down', mlp.down_proj))}
    return None if any(projection is None for projection in shared.values()) else shared


def native_experts_with_shared(experts: FusedExperts, shared_experts: LlamaMLP | None,
                                small_step: bool) -> dict[str, object] | None:
    """The routed experts' native weights plus, where the block has them, its ungated shared experts'
    projections (:func:`shared_expert_projections`); None where a part runs on no native kernel."""
    native = experts.native_experts(small_step)
    if native is None or shared_experts is None:
        return native
    shared = shared_expert_projections(shared_experts, small_step)
    return None if shared is None else native | shared


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-style decoder whose sparse layers are :class:`SparseMoeBlock`s."""

    def make_mlp(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        hf = cfg.hf_config
        sparse_step = getattr(hf, 'decoder_sparse_step', None) or 1
        dense = layer_index in (getattr(hf, 'mlp_only_layers', None) or []) or (layer_index + 1) % sparse_step
        return LlamaMLP(cfg) if dense else SparseMoeBlock(cfg)

    def weight_target(self, name: str) -> WeightTarget | None:
        name = name.replace('.block_sparse_moe.', '.mlp.')
        match = EXPERT_NAME.fullmatch(name)
        if match is None:
            return super().weight_target(name)
        experts_name, expert, proj, kind = match.groups()
        experts = self.get_submodule(experts_name)
        target = experts.expert_weight(int(expert), EXPERT_PARTS[proj], kind)
        if target is None:  # a tensor its weight format does not use
            return None
        weight, param, label, shard = target
        return weight, (f'{experts_name}.{param}', label), shard
