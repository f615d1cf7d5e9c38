"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache: each token caches its
compressed latent and its rotary key, not per-head K/V; queries are absorbed into that space.

Under tensor parallelism each rank computes its own heads (:class:`HeadsLinear`) over the whole latent
cache, which every rank holds (the latent is shared by all heads).
"""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.distributed.parallel_state import Shard, current_group, split_range
from lmdeploy.pytorch.kernels import fill_latent_cache, mla, mla_decode_attention, mla_prefill_attention
from lmdeploy.pytorch.kernels.dsa import TokenSelection
from lmdeploy.pytorch.nn.linear import Linear
from lmdeploy.pytorch.nn.quant import layout_of
from lmdeploy.pytorch.nn.quant.cpu_fp32 import NativeFp32Kernel, native_fp32_kernel
from lmdeploy.pytorch.step_context import StepContext


class HeadsLinear(Linear):
    """A projection to ``num_heads`` heads of ``head_dim`` features, column-parallel by heads: each rank holds
    the output rows of its heads ``heads`` (a ``[start, stop)`` range); ``num_heads`` is this rank's."""

    def __init__(self, in_features: int, num_heads: int, head_dim: int):
        self.tp = current_group()
        self.heads = split_range(num_heads, self.tp.rank, self.tp.world_size)
        self.num_heads = self.heads[1] - self.heads[0]
        super().__init__(in_features, self.num_heads * head_dim)
        self.head_dim = head_dim

    def checkpoint_part(self, kind: str, part: int | None = None) -> tuple[torch.Tensor, Shard | None]:
        param = getattr(self, kind)
        layout = layout_of(param)
        if layout.output_dim is None or self.tp.world_size == 1:
            return param, None
        start, stop = (head * self.head_dim // layout.outputs_per_index for head in self.heads)
        return param, Shard(layout.output_dim, start, stop)


class LatentAttention(nn.Module):
    """Stores this step's latents in the cache, then attends each of this rank's ``num_heads`` heads of each
    token over its context.

    A layer's cache is ``(latent_cache,)``, ``[num_blocks, block_size, kv_lora_rank + rope_dim]``, or with
    ``quant_policy`` 8 or 4 ``(codes, scales_zeros)`` (``kernels/mla.py``). ``kv_b_weight`` is the
    up-projection ``[H * (nope_dim + v_head_dim), kv_lora_rank]`` (``kv_b_proj``'s weight), from which each
    head's key (``W_UK``) and value (``W_UV``) rows are read. An fp32 model on the CPU multiplies by them on each
    head's packed copies (:meth:`pack_heads`): the fixed-order fp32 GEMM, whose rows do not depend on their number
    as ``torch.einsum``'s do.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, nope_dim: int, v_head_dim: int, scale: float,
                 quant_policy: int = 0):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope_dim, self.v_head_dim = nope_dim, v_head_dim
        self.scale = scale
        self.quant_policy = quant_policy
        self.absorb_kernels: list[NativeFp32Kernel] | None = None  # W_UK[h].T, one a head (pack_heads)
        self.value_kernels: list[NativeFp32Kernel] | None = None  # W_UV[h], one a head

    def pack_heads(self, kv_b_weight: torch.Tensor) -> None:
        """Each head's ``W_UK.T [kv_lora_rank, nope_dim]`` and ``W_UV [v_head_dim, kv_lora_rank]`` of
        ``kv_b_weight`` packed for the native fp32 GEMM, where it runs on an fp32 weight; else nothing changes."""
        w_kv = kv_b_weight.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        absorb = [native_fp32_kernel(w[:self.nope_dim].t().contiguous()) for w in w_kv]
        value = [native_fp32_kernel(w[self.nope_dim:]) for w in w_kv]
        if all(kernel is not None for kernel in absorb + value):
            self.absorb_kernels, self.value_kernels = absorb, value

    def per_head(self, kernels: list[NativeFp32Kernel], x: torch.Tensor) -> torch.Tensor:
        """``x [T, H, in]`` times each head's packed weight, ``[T, H, out]``."""
        return torch.stack([kernel(x[:, h], None) for h, kernel in enumerate(kernels)], dim=1)

    def forward(self, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, kv_b_weight: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], ctx: StepContext,
                selection: TokenSelection | None = None) -> torch.Tensor:
        """``q_nope [T, H, nope_dim]``, ``q_rope [T, H, rope_dim]`` (turned), ``latent [T, kv_lora_rank +
        rope_dim]`` (normed latent, then turned rotary key) -> ``[T, H * v_head_dim]``. With ``selection``
        (DeepSeek Sparse Attention) each query attends only the keys it keeps, in torch (``kernels/mla.py``)."""
        cache = kv_cache[0]
        quant = (kv_cache[1], self.quant_policy) if self.quant_policy else ()
        fill_latent_cache(latent, cache, ctx.kv_blocks, ctx.kv_offsets, *quant, v_dim=self.kv_lora_rank)
        w_kv = kv_b_weight.view(self.num_heads, self.nope_dim + self.v_head_dim, self.kv_lora_rank)
        if self.absorb_kernels is None:
            q_latent = torch.einsum('thn,hnl->thl', q_nope, w_kv[:, :self.nope_dim])
        else:
            q_latent = self.per_head(self.absorb_kernels, q_nope)
        q = torch.cat((q_latent, q_rope), dim=-1)
        num_prefill = ctx.num_prefill_tokens
        prefill, decode = mla_prefill_attention, mla_decode_attention
        prefill_keep, decode_keep = {}, {}
        if selection is not None:
            prefill, decode = mla.mla_prefill_attention, mla.mla_decode_attention
            prefill_keep, decode_keep = {'keep': selection.prefill}, {'keep': selection.decode}
        parts = []
        if ctx.prefill_q_len is not None:
            parts.append(prefill(q[:num_prefill], latent[:num_prefill], cache, ctx.prefill_block_table,
                                 ctx.prefill_q_start, ctx.prefill_q_len, ctx.prefill_ctx_len, ctx.prefill_max_q_len,
                                 self.scale, self.kv_lora_rank, *quant, **prefill_keep))
        if ctx.decode_blocks is not None:
            parts.append(decode(q[num_prefill:], cache, ctx.decode_blocks, ctx.decode_kv_lens, self.scale,
                                self.kv_lora_rank, *quant, **decode_keep))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.value_kernels is None:
            return torch.einsum('thl,hvl->thv', out, w_kv[:, self.nope_dim:]).flatten(1)
        return self.per_head(self.value_kernels, out).flatten(1)
