"""Falcon-H1 (``FalconH1ForCausalLM``, TII's 0.5B-34B): in every layer attention (rotary, over the paged KV cache)
and a Mamba-2 mixer (``models/mamba2.py``, a recurrent state per sequence) read the same normed input and the
residual adds the sum of their outputs; then a gated SiLU MLP. Its µP multipliers scale the embeddings and logits
at run time and are folded into the projections' float weights at load (:func:`fold_multipliers`); the key
multiplier scales the attention scores. Its GGUF files (``weights/gguf_hybrid.py``) hold every multiplier folded
into the tensors, their configs each multiplier as 1: nothing is folded again, and their projections may stay
quantized. Every layer holds both a KV cache and a recurrent state
(:class:`KVAndStates`); every step runs the layers' own forward (no native decoder stack)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.kernels.mamba2 import SSD_CHUNK
from lmdeploy.pytorch.models.llama import (KVCache, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM,
                                           LlamaMLP)
from lmdeploy.pytorch.models.mamba2 import GATE_ONLY, GATE_THEN_NORM, NORM_THEN_GATE, Mamba2Mixer, Mamba2Shape
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.paging.state_pool import KVAndStates
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource

# checkpoint name fragment -> the engine's
RENAMED = {'.feed_forward.': '.mlp.', '.pre_ff_layernorm.': '.post_attention_layernorm.',
           'model.final_layernorm.': 'model.norm.'}


def falcon_mamba_shape(hf: PretrainedConfig) -> Mamba2Shape:
    """The Mamba-2 mixers' shape: ``mamba_d_ssm = mamba_n_heads * mamba_d_head`` inner features, ``in_proj``'s bias
    per ``mamba_proj_bias`` and ``out_proj``'s per ``projectors_bias``, the gated norm per ``mamba_rms_norm`` and
    ``mamba_norm_before_gate``."""
    gate_norm = (NORM_THEN_GATE if hf.mamba_norm_before_gate else GATE_THEN_NORM) if hf.mamba_rms_norm else GATE_ONLY
    return Mamba2Shape(hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_n_groups, hf.mamba_d_state, hf.mamba_d_conv,
                       bool(hf.mamba_conv_bias), bool(hf.mamba_proj_bias), hf.rms_norm_eps, hf.time_step_limit,
                       out_proj_bias=bool(hf.projectors_bias), gate_norm=gate_norm)


def mup_vector(hf: PretrainedConfig) -> torch.Tensor:
    """The factor of each of ``in_proj``'s outputs: ``ssm_multipliers`` over its parts z, x, B, C and dt."""
    inner, groups = hf.mamba_n_heads * hf.mamba_d_head, hf.mamba_n_groups * hf.mamba_d_state
    sizes = [inner, inner, groups, groups, hf.mamba_n_heads]
    return torch.cat([torch.full((size,), float(m)) for size, m in zip(sizes, hf.ssm_multipliers)])


def scale_linear(linear: Linear, inputs: float = 1.0, outputs: torch.Tensor | float = 1.0) -> None:
    """Folds ``linear(x * inputs) * outputs`` (``outputs`` one factor, or one per output feature) into the layer's
    float weight and bias; factors of 1 (a GGUF file's, whose tensors hold them) leave it as it is."""
    factors = (torch.as_tensor(outputs, dtype=torch.float32) * inputs).reshape(-1, 1)
    if bool((factors == 1).all()) and bool((torch.as_tensor(outputs) == 1).all()):
        return
    weight = getattr(linear, 'weight', None)
    if weight is None or not weight.is_floating_point():
        raise ValueError('FalconH1ForCausalLM folds its µP multipliers into float weights; load a float (fp32, '
                         'bf16, fp16) checkpoint')
    weight.copy_(weight.float() * factors)
    if linear.bias is not None:
        linear.bias.copy_(linear.bias.float() * torch.as_tensor(outputs, dtype=torch.float32))


class FalconH1Layer(LlamaDecoderLayer):
    """``x + self_attn(norm(x)) + mamba(norm(x))``, then ``+ mlp(norm(x))``; its cache is the attention's KV tensors
    followed by the Mamba-2 states."""

    def __init__(self, cfg: ModelConfig):
        hf = cfg.hf_config
        super().__init__(cfg, LlamaMLP(cfg, activation=hf.hidden_act),
                         LlamaAttention(cfg, scale=cfg.head_dim**-0.5 * hf.key_multiplier))
        self.mamba = Mamba2Mixer(cfg, falcon_mamba_shape(hf))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cache: KVCache, ctx: StepContext):
        x, residual = self.norm_input(x, residual)
        x = self.mamba(x, cache[-2:], ctx) + self.self_attn(x, cache[:-2], ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class FalconH1ForCausalLM(LlamaForCausalLM):
    """Falcon-H1's decoder, LM head and multipliers (see the module's docstring)."""

    tensor_parallel_refusal = 'its Mamba-2 layers are not sharded for tensor parallelism'
    recurrent_chunk = SSD_CHUNK

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        hf = cfg.hf_config
        self.embedding_multiplier, self.lm_head_multiplier = hf.embedding_multiplier, hf.lm_head_multiplier

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> FalconH1Layer:
        return FalconH1Layer(cfg)

    def embed(self, input_ids: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.lm_head(hidden)
        return None if logits is None else logits * self.lm_head_multiplier

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Renames the checkpoint's MLP and norms (:data:`RENAMED`) to the engine's."""
        return super().split_fused((engine_name(name), tensor) for name, tensor in weights)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]]) -> None:
        """Loads the checkpoint, then folds the multipliers into the weights (:meth:`fold_multipliers`)."""
        super().load_weights(weights)
        self.fold_multipliers()

    @torch.no_grad()
    def fold_multipliers(self) -> None:
        """Each layer's µP multipliers into the weights they scale, as transformers applies them: the attention's
        input (``attention_in_multiplier``, into q/k/v, not their biases) and output (``attention_out_multiplier``),
        the mixer's input (``ssm_in_multiplier``), ``in_proj``'s outputs (``ssm_multipliers``, see
        :func:`mup_vector`) and its output (``ssm_out_multiplier``), and the MLP's gate before its SiLU and its
        output (``mlp_multipliers``)."""
        hf = self.cfg.hf_config
        gate_multiplier, down_multiplier = hf.mlp_multipliers
        for layer in self.layers:
            scale_linear(layer.self_attn.qkv_proj, inputs=hf.attention_in_multiplier)
            scale_linear(layer.self_attn.o_proj, outputs=hf.attention_out_multiplier)
            scale_linear(layer.mamba.in_proj, inputs=hf.ssm_in_multiplier, outputs=mup_vector(hf))
            scale_linear(layer.mamba.out_proj, outputs=hf.ssm_out_multiplier)
            gate_up = layer.mlp.gate_up_proj
            _, gate_rows, up_rows = gate_up.offsets
            scale_linear(gate_up, outputs=torch.cat([torch.full((gate_rows,), float(gate_multiplier)),
                                                     torch.ones(up_rows - gate_rows)]))
            scale_linear(layer.mlp.down_proj, outputs=down_multiplier)

    def recurrent_state_shapes(self) -> list[KVAndStates]:
        """Per layer, a KV cache and one sequence's Mamba-2 states."""
        return [KVAndStates(layer.mamba.state_shapes()) for layer in self.layers]


def engine_name(name: str) -> str:
    """The engine's name of a checkpoint tensor."""
    for old, new in RENAMED.items():
        if old in name:
            return name.replace(old, new)
    return name
