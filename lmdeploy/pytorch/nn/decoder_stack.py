"""Llama-style decoder layers in one native call per step on the CPU (``kernels/cpu/decoder_stack.cpp``).

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
from lmdeploy.pytorch.step_context import StepContext

# A layer's tensors in the stack's order, the biases None where a projection has none: input_norm,
# post_norm, qkv, qkv_bias, o, o_bias, gate_up, gate_up_bias, down, down_bias (packed GEMM panels).
LayerWeights = list[torch.Tensor | None]


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
        """The stack of ``layers`` (each from a layer's ``native_weights``, which holds native GEMM
        panels, so the native kernels are loaded), or None when a layer cannot run in it or the layers
        are tensor-parallel (the stack has no collectives). ``quant_policy`` is the KV cache's."""
        if current_group().world_size > 1 or any(weights is None for weights in layers):
            return None
        native = cpu.native()
        return cls(native, native.DecoderStack(layers, num_heads, num_kv_heads, head_dim, eps, scale, quant_policy),
                   small_step_rows)

    def runs(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens runs in the stack."""
        return num_tokens > self.small_step_rows

    def __call__(self, x: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                 ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings ``x`` through every layer: ``(hidden states, residual)``; each layer's cache as
        :class:`~lmdeploy.pytorch.nn.attention.PagedAttention` takes it."""
        step = self.native.StepTensors(ctx.cos, ctx.sin, ctx.kv_blocks, ctx.kv_offsets, ctx.num_prefill_tokens,
                                       ctx.prefill_block_table, ctx.prefill_q_start, ctx.prefill_q_len,
                                       ctx.prefill_ctx_len, ctx.prefill_max_q_len, ctx.decode_blocks,
                                       ctx.decode_kv_lens)
        return self.stack.forward(x, kv_caches, step)
