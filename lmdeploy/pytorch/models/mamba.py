"""Mamba (``MambaForCausalLM``: state-spaces' Mamba) and Falcon Mamba (``FalconMambaForCausalLM``: TII's Falcon Mamba
7B, Falcon3-Mamba): decoders of Mamba-1 blocks only, ``x + mixer(norm(x))`` (``models/mamba1.py``; Falcon Mamba's
mixers norm dt, B and C without weights), with no attention and so no KV cache: each sequence holds recurrent-state
slots alone (see ``paging/state_pool.py``). Every step runs the layers' own forward (no native decoder stack)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.models.llama import KVCache, LlamaForCausalLM, WithoutNativeStack
from lmdeploy.pytorch.models.mamba1 import NO_NORMS, WEIGHTLESS_NORMS, Mamba1Mixer, Mamba1Shape
from lmdeploy.pytorch.models.nemotron_h import engine_name
from lmdeploy.pytorch.nn.norm import RMSNorm
from lmdeploy.pytorch.step_context import StepContext
from lmdeploy.pytorch.weights.safetensors_loader import WeightSource


def mamba_shape(hf: PretrainedConfig) -> Mamba1Shape:
    """The Mamba-1 blocks' shape from Mamba's (and Falcon Mamba's) config fields."""
    falcon = hf.model_type == 'falcon_mamba'
    return Mamba1Shape(hf.intermediate_size, hf.state_size, hf.conv_kernel, int(hf.time_step_rank),
                       bool(hf.use_conv_bias), bool(hf.use_bias), WEIGHTLESS_NORMS if falcon else NO_NORMS,
                       getattr(hf, 'mixer_rms_eps', 1e-6))


class MambaBlock(nn.Module):
    """``x + mixer(norm(x))``; like Llama's layers it hands the residual sum on."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.mixer = Mamba1Mixer(cfg, mamba_shape(cfg.hf_config))
        self.norm = RMSNorm(cfg.hidden_size, cfg.hf_config.layer_norm_epsilon)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, state: KVCache, ctx: StepContext):
        if residual is None:
            x, residual = self.norm(x), x
        else:
            x, residual = self.norm(x, residual)
        return self.mixer(x, state, ctx), residual


class MambaForCausalLM(WithoutNativeStack, LlamaForCausalLM):
    """Mamba's and Falcon Mamba's decoder and LM head (see the module's docstring)."""

    tensor_parallel_refusal = 'its Mamba-1 layers are not sharded for tensor parallelism'
    recurrent_chunk = 0  # the scan runs token by token: prefill chunks may end anywhere

    def make_layer(self, cfg: ModelConfig, layer_index: int) -> nn.Module:
        return MambaBlock(cfg)

    def make_norm(self, cfg: ModelConfig) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.hf_config.layer_norm_epsilon)

    def split_fused(self, weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
        """Renames the checkpoint's ``backbone.*`` tensors to the engine's."""
        return super().split_fused((engine_name(name), tensor) for name, tensor in weights)

    def recurrent_state_shapes(self) -> list[list[tuple[tuple[int, ...], torch.dtype]] | None]:
        """Every layer's recurrent state: no layer has a KV cache."""
        return [layer.mixer.state_shapes() for layer in self.layers]
