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
        shape = (cfg.num_kv_heads, num_blocks * block_size, cfg.head_dim)
        # Zeroed so that padded slots read by batched decode never hold NaNs.
        self.kv_caches = [(torch.zeros(shape, dtype=cfg.dtype), torch.zeros(shape, dtype=cfg.dtype))
                          for _ in range(cfg.num_layers)]
        self.block_offsets = torch.arange(block_size)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        table = torch.tensor(block_ids[start // self.block_size:-(-end // self.block_size)])
        first = start - start % self.block_size
        slots = (table.unsqueeze(1) * self.block_size + self.block_offsets).flatten()
        return slots[start - first:end - first]

    def _decode_layout(self, items: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor | None]:
        lengths = torch.tensor([item.seq.num_tokens for item in items])
        max_len = int(lengths.max())
        num_blocks = -(-max_len // self.block_size)
        table = torch.zeros(len(items), num_blocks, dtype=torch.long)
        for row, item in enumerate(items):
            ids = item.seq.block_ids[:num_blocks]
            table[row, :len(ids)] = torch.tensor(ids)
        slots = (table.unsqueeze(2) * self.block_size + self.block_offsets).flatten(1)[:, :max_len]
        if bool((lengths == max_len).all()):
            return slots, None
        mask = torch.arange(max_len).unsqueeze(0) < lengths.unsqueeze(1)
        return slots, mask[:, None, None, :]

    def build_inputs(self, plan: SchedulerOutput) -> tuple[torch.Tensor, StepContext, list[int]]:
        """Packs the step's tokens; also returns the row of each sampled sequence's last token."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        spans: list[PrefillSpan] = []
        sample_rows: list[int] = []
        for item in plan.prefill:
            seq, start = item.seq, item.seq.num_computed
            end = start + item.num_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            chunk_slots = self._slots(seq.block_ids, start, end)
            slots.append(chunk_slots)
            context = None if start == 0 else torch.cat((self._slots(seq.block_ids, 0, start), chunk_slots))
            spans.append(PrefillSpan(len(input_ids) - item.num_tokens, item.num_tokens, context))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        num_prefill = len(input_ids)
        decode_slots = decode_mask = None
        if plan.decode:
            decode_positions = [item.seq.num_tokens - 1 for item in plan.decode]
            input_ids.extend(item.seq.token_ids[-1] for item in plan.decode)
            positions.append(torch.tensor(decode_positions))
            decode_slots, decode_mask = self._decode_layout(plan.decode)
            slots.append(decode_slots[torch.arange(len(plan.decode)), torch.tensor(decode_positions)])
            sample_rows.extend(range(num_prefill, len(input_ids)))
        ctx = StepContext(positions=torch.cat(positions), slot_mapping=torch.cat(slots), prefill_spans=spans,
                          num_prefill_tokens=num_prefill, decode_slots=decode_slots, decode_mask=decode_mask)
        return torch.tensor(input_ids), ctx, sample_rows

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """Runs the step; returns fp32 logits ``[num_sampled, vocab]`` in plan order (prefill, decode)."""
        input_ids, ctx, sample_rows = self.build_inputs(plan)
        hidden = self.model(input_ids, self.kv_caches, ctx)
        return self.model.logits(hidden[sample_rows])
