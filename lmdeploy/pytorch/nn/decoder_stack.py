"""Llama-style decoder layers in one native call per step on the CPU (``kernels/cpu/decoder_stack.cpp``),
on projections in bf16 or W8A8 (each its own kernel's weight, see ``LinearKernel.native_projection``).

The call runs the kernels of the layers' own forward, in the same order, so its results are
identical; it only drops the Python between them, which in a 64-row decode step cost about 5 ms of
70 (the interpreter runs three times slower than on its own, on caches the kernels have just flushed).
"""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from lmdeploy.pytorch.distributed.parallel_state import current_group
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.step_context import StepContext

# A layer's weights, by name (``native.LayerWeights``, see :func:`layer_weights`).
LayerWeights = Any


def layer_weights(input_norm: torch.Tensor, post_norm: torch.Tensor, projections: dict[str, Linear],
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> LayerWeights | None:
    """A Llama-style layer's weights for the stack: its norms' weights (``q_norm`` and ``k_norm`` per head,
    where it has them) and its ``qkv``, ``o``, ``gate_up`` and ``down`` projections, each as its kernel's
    native projection; None when a projection runs on no native GEMM."""
    native = {name: proj.kernel.native_projection(proj.bias) for name, proj in projections.items()}
    if any(projection is None for projection in native.values()):
        return None
    return cpu.native().LayerWeights(input_norm=input_norm, post_norm=post_norm, q_norm=q_norm, k_norm=k_norm,
                                     **native)


class NativeDecoderStack:
    """Every decoder layer of a model in one native call; steps of at most ``small_step_rows`` tokens,
    which run on 4-bit weights, still take the layers' Python forward."""

    def __init__(self, native: ModuleType, stack: Any, small_step_rows: int):
        self.native = native
        self.stack = stack
        self.small_step_rows = small_step_rows

    @classmethod
    def build(cls, layers: list[LayerWeights | None], num_heads: int, num_kv_heads: int, head_dim: int,
              eps: float, scale: float, small_step_rows: int, quant_policy: int = 0) -> NativeDecoderStack | None:
        """The stack of ``layers`` (each from a layer's ``native_weights``: its projections are on native
        GEMM weights, so the native kernels are loaded), or None when a layer cannot run in it or the
        layers are tensor-parallel (the stack has no collectives). ``quant_policy`` is the KV cache's."""
        if current_group().world_size > 1 or any(weights is None for weights in layers):
            return None
        native = cpu.native()
        stack = native.DecoderStack(layers=layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                    eps=eps, scale=scale, quant_policy=quant_policy)
        return cls(native, stack, small_step_rows)

    def runs(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens runs in the stack."""
        return num_tokens > self.small_step_rows

    def __call__(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                 ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings ``x`` through every layer: ``(hidden states, residual)``; each layer's cache as
        :class:`~lmdeploy.pytorch.nn.attention.PagedAttention` takes it."""
        step = self.native.StepTensors(
            cos=ctx.cos, sin=ctx.sin, kv_blocks=ctx.kv_blocks, kv_offsets=ctx.kv_offsets,
            num_prefill_tokens=ctx.num_prefill_tokens, prefill_block_table=ctx.prefill_block_table,
            prefill_q_start=ctx.prefill_q_start, prefill_q_len=ctx.prefill_q_len, prefill_ctx_len=ctx.prefill_ctx_len,
            prefill_max_q_len=ctx.prefill_max_q_len, decode_blocks=ctx.decode_blocks,
            decode_kv_lens=ctx.decode_kv_lens)
        return self.stack.forward(x, kv_caches, step)
