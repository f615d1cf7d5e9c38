"""Turns a scheduled step into one batched forward pass and returns logits for the sampled rows."""
from __future__ import annotations

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.engine.sequence import Sequence
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.multimodal import MultiModalBatch, MultiModalInput
from lmdeploy.pytorch.paging.scheduler import ScheduledSeq, SchedulerOutput
from lmdeploy.pytorch.step_context import StepContext


class ModelRunner:
    """Owns the model and its KV cache on ``device``; ``forward`` runs one step of the scheduler's plan."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device | str = 'cpu'):
        self.model = model
        self.cfg = cfg
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        # Zeroed so that the padding read by batched decode never holds NaNs.
        self.kv_caches = [(torch.zeros(shape, dtype=cfg.dtype, device=self.device),
                           torch.zeros(shape, dtype=cfg.dtype, device=self.device)) for _ in range(cfg.num_layers)]

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, device=self.device)

    def _block_table(self, items: list[ScheduledSeq], lengths: list[int]) -> torch.Tensor:
        """``[len(items), max blocks]``: each sequence's blocks covering its first ``lengths`` tokens."""
        width = -(-max(lengths) // self.block_size)
        return self._tensor([item.seq.block_ids[:width] + [0] * (width - len(item.seq.block_ids[:width]))
                             for item in items])

    @staticmethod
    def _rope_positions(seq: Sequence, start: int, end: int) -> torch.Tensor:
        """``[3, end - start]`` 3-D rotary positions of tokens ``start:end`` of ``seq``."""
        if seq.rope_positions is None:
            return torch.arange(start, end).expand(3, -1)
        num_prompt = seq.rope_positions.shape[1]
        tail = torch.arange(min(max(start, num_prompt), end), end) + seq.rope_delta
        return torch.cat((seq.rope_positions[:, start:end], tail.expand(3, -1)), dim=1)

    def _multimodal_batch(self, plan: SchedulerOutput, q_start: list[int]) -> MultiModalBatch | None:
        """The images whose placeholder tokens the prefill chunks feed; a whole image is encoded even
        when a chunk holds only part of it."""
        inputs: list[MultiModalInput] = []
        token_rows: list[int] = []
        feature_rows: list[int] = []
        num_features = 0
        for item, row in zip(plan.prefill, q_start):
            start = item.seq.num_computed
            end = start + item.num_tokens
            for image in item.seq.multimodal:
                lo, hi = max(start, image.offset), min(end, image.end)
                if lo >= hi:
                    continue
                inputs.append(image)
                token_rows.extend(range(row + lo - start, row + hi - start))
                feature_rows.extend(range(num_features + lo - image.offset, num_features + hi - image.offset))
                num_features += image.length
        if not inputs:
            return None
        return MultiModalBatch(inputs, self._tensor(token_rows), self._tensor(feature_rows))

    def build_inputs(self, plan: SchedulerOutput) -> tuple[torch.Tensor, StepContext, list[int]]:
        """Packs the step's tokens; also returns the row of each sampled sequence's last token."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        kv_blocks: list[int] = []
        q_start: list[int] = []
        ctx_len: list[int] = []
        sample_rows: list[int] = []
        rope_positions: list[torch.Tensor] = []
        uses_mrope = getattr(self.model, 'uses_mrope', False)
        for item in plan.prefill:
            seq, start = item.seq, item.seq.num_computed
            end = start + item.num_tokens
            if uses_mrope:
                rope_positions.append(self._rope_positions(seq, start, end))
            q_start.append(len(input_ids))
            ctx_len.append(end)
            input_ids.extend(seq.token_ids[start:end])
            chunk_positions = range(start, end)
            positions.extend(chunk_positions)
            kv_blocks.extend(seq.block_ids[p // bs] for p in chunk_positions)
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        num_prefill = len(input_ids)
        prefill = dict(prefill_block_table=None, prefill_q_start=None, prefill_q_len=None, prefill_ctx_len=None,
                       prefill_max_q_len=0)
        if plan.prefill:
            q_len = [item.num_tokens for item in plan.prefill]
            prefill = dict(prefill_block_table=self._block_table(plan.prefill, ctx_len),
                           prefill_q_start=self._tensor(q_start), prefill_q_len=self._tensor(q_len),
                           prefill_ctx_len=self._tensor(ctx_len), prefill_max_q_len=max(q_len))
        decode_blocks = decode_kv_lens = None
        if plan.decode:
            for item in plan.decode:
                seq = item.seq
                input_ids.append(seq.token_ids[-1])
                positions.append(seq.num_tokens - 1)
                kv_blocks.append(seq.block_ids[(seq.num_tokens - 1) // bs])
                if uses_mrope:
                    rope_positions.append(self._rope_positions(seq, seq.num_tokens - 1, seq.num_tokens))
            lengths = [item.seq.num_tokens for item in plan.decode]
            decode_blocks, decode_kv_lens = self._block_table(plan.decode, lengths), self._tensor(lengths)
            sample_rows.extend(range(num_prefill, len(input_ids)))
        position_tensor = self._tensor(positions)
        ctx = StepContext(positions=position_tensor, kv_blocks=self._tensor(kv_blocks),
                          kv_offsets=position_tensor % bs, num_prefill_tokens=num_prefill,
                          decode_blocks=decode_blocks, decode_kv_lens=decode_kv_lens,
                          rope_positions=torch.cat(rope_positions, dim=1).to(self.device) if uses_mrope else None,
                          multimodal=self._multimodal_batch(plan, q_start), **prefill)
        return self._tensor(input_ids), ctx, sample_rows

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """Runs the step; returns logits ``[num_sampled, vocab]`` in plan order (prefill, decode), in the
        model's dtype (the sampler widens them where it needs to)."""
        if self.device.type == 'cpu':
            cpu.bind_worker_threads()
        input_ids, ctx, sample_rows = self.build_inputs(plan)
        hidden = self.model(input_ids, self.kv_caches, ctx)
        # Sampled rows are unique and ascending: as many as the rows means all of them (decode steps).
        return self.model.logits(hidden if len(sample_rows) == hidden.shape[0] else hidden[sample_rows])
