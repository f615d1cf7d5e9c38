"""Turns a scheduled step into one batched forward pass and returns logits for the sampled rows."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.paging.scheduler import ScheduledSeq, SchedulerOutput
from lmdeploy.pytorch.step_context import PrefillSpan, StepContext


class ModelRunner:
    """Owns the model and its KV cache; ``forward`` runs one step of the scheduler's plan."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int):
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        # Zeroed so that the padding read by batched decode never holds NaNs.
        self.kv_caches = [(torch.zeros(shape, dtype=cfg.dtype), torch.zeros(shape, dtype=cfg.dtype))
                          for _ in range(cfg.num_layers)]

    def _decode_layout(self, items: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor | None]:
        lengths = [item.seq.num_tokens for item in items]
        num_blocks = -(-max(lengths) // self.block_size)
        table = torch.tensor([item.seq.block_ids[:num_blocks] + [0] * (num_blocks - len(item.seq.block_ids))
                              for item in items])
        if all(n == num_blocks * self.block_size for n in lengths):
            return table, None
        padding = torch.arange(num_blocks * self.block_size).unsqueeze(0) >= torch.tensor(lengths).unsqueeze(1)
        return table, torch.zeros(padding.shape).masked_fill_(padding, float('-inf'))

    def build_inputs(self, plan: SchedulerOutput) -> tuple[torch.Tensor, StepContext, list[int]]:
        """Packs the step's tokens; also returns the row of each sampled sequence's last token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        kv_blocks: list[int] = []
        spans: list[PrefillSpan] = []
        sample_rows: list[int] = []
        for item in plan.prefill:
            seq, start = item.seq, item.seq.num_computed
            end = start + item.num_tokens
            input_ids.extend(seq.token_ids[start:end])
            chunk_positions = range(start, end)
            positions.extend(chunk_positions)
            kv_blocks.extend(seq.block_ids[p // bs] for p in chunk_positions)
            context = None if start == 0 else torch.tensor(seq.block_ids[:-(-end // bs)])
            spans.append(PrefillSpan(len(input_ids) - item.num_tokens, item.num_tokens, context, end))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        num_prefill = len(input_ids)
        decode_blocks = decode_bias = None
        if plan.decode:
            for item in plan.decode:
                seq = item.seq
                input_ids.append(seq.token_ids[-1])
                positions.append(seq.num_tokens - 1)
                kv_blocks.append(seq.block_ids[(seq.num_tokens - 1) // bs])
            decode_blocks, decode_bias = self._decode_layout(plan.decode)
            sample_rows.extend(range(num_prefill, len(input_ids)))
        position_tensor = torch.tensor(positions)
        ctx = StepContext(positions=position_tensor, kv_blocks=torch.tensor(kv_blocks),
                          kv_offsets=position_tensor % bs, prefill_spans=spans, num_prefill_tokens=num_prefill,
                          decode_blocks=decode_blocks, decode_bias=decode_bias)
        return torch.tensor(input_ids), ctx, sample_rows

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """Runs the step; returns fp32 logits ``[num_sampled, vocab]`` in plan order (prefill, decode)."""
        input_ids, ctx, sample_rows = self.build_inputs(plan)
        hidden = self.model(input_ids, self.kv_caches, ctx)
        return self.model.logits(hidden[sample_rows])
