"""Turns a scheduled step into one batched forward pass and returns logits for the sampled rows."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.device import lazily_zeroed, to_device
from lmdeploy.pytorch.distributed import channel as step_channel
from lmdeploy.pytorch.distributed.channel import StepChannel
from lmdeploy.pytorch.engine.cuda_graph import DecodeGraphRunner
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.multimodal import MultiModalBatch, MultiModalInput
from lmdeploy.pytorch.nn.attention import PagedAttention
from lmdeploy.pytorch.nn.embedding import LMHead
from lmdeploy.pytorch.nn.quant.base import ExpertKernel, LinearKernel
from lmdeploy.pytorch.paging.block_manager import given_back_as_zero
from lmdeploy.pytorch.paging.scheduler import ScheduledSeq, SchedulerOutput
from lmdeploy.pytorch.paging.state_pool import KVAndStates, allocate_states, recurrent_state_shapes
from lmdeploy.pytorch.step_context import StepContext, step_rows


def layer_windows(model: nn.Module, num_layers: int) -> list[int | None]:
    """Each decoder layer's window of keys (``PagedAttention.kv_window``: its sliding window or attention chunk),
    None for full attention (every layer of a model whose layers are not all :class:`PagedAttention`, as
    multi-head latent attention)."""
    windows = [m.kv_window for m in model.modules() if isinstance(m, PagedAttention)]
    return windows if len(windows) == num_layers else [None] * num_layers


def has_small_step_kernels(model: nn.Module) -> bool:
    """Whether a layer of ``model`` runs small steps on a kernel of their own (a 4-bit copy, a GEMV, the LM head's
    one-row copy; see :func:`~lmdeploy.pytorch.step_context.small_step`)."""
    for module in model.modules():
        if isinstance(module, LMHead) and module.has_small_step_kernel:
            return True
        if any(isinstance(value, (LinearKernel, ExpertKernel)) and value.small_step_rows
               for value in vars(module).values()):
            return True
    return False


@dataclass
class InflightTokens:
    """The previous step's sampled tokens, still on the device; ``row_of[seq_id]`` is a sequence's row."""

    token_ids: torch.Tensor
    row_of: dict[int, int]

    def copy_into(self, target: torch.Tensor, decode: list[ScheduledSeq], first_row: int) -> None:
        """Writes each decode row's token in flight into ``target[first_row + i]``, on the device."""
        pairs = [(first_row + i, self.row_of[item.seq.seq_id])
                 for i, item in enumerate(decode) if item.seq.num_inflight]
        if pairs:
            dst, src = zip(*pairs)
            device = self.token_ids.device
            target[to_device(torch.tensor(dst), device)] = self.token_ids[to_device(torch.tensor(src), device)]


class ModelRunner:
    """Owns the model and its KV cache on ``device``; ``forward`` runs one step of the scheduler's plan.

    The cache holds one block more than the block manager hands out: the scratch block that the
    padding rows of graph-replayed decode steps write to.

    With ``num_window_blocks`` the layers with a window of keys (a sliding window, or an attention chunk: see
    :func:`layer_windows`) keep their K/V in a pool of that many blocks (plus their scratch block,
    ``window_scratch_block``), read through ``Sequence.window_block_ids``; the other layers in the ``num_blocks``
    of ``Sequence.block_ids`` (see :class:`BlockManager`). ``window`` is the widest window of the model's layers,
    None without any; ``window_layer_kind`` names those layers (``sliding-window`` or ``chunked-attention``).

    A model with linear-attention layers keeps, in those layers' place in ``kv_caches``, their recurrent states
    of ``num_state_slots`` sequences (see ``paging/state_pool.py``), after the KV cache's tensors in a layer that
    has both (Falcon-H1); ``num_state_slots`` is 0 for other models.

    Under tensor parallelism every rank has a runner over its shard of the model (``cfg`` gives this
    rank's KV heads): rank 0 builds each step's inputs and sends them down ``channel`` before it runs
    them; the other ranks run what arrives (:meth:`serve`).

    A model with kernels of its own for small steps (:func:`has_small_step_kernels`) runs a step's prefill rows
    and its decode rows as two forwards, each on its kind's kernels (see ``step_context.small_step``), so that
    what shares a sequence's step does not change its arithmetic.
    """

    def __init__(self, model: nn.Module, cfg: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device | str = 'cpu', channel: StepChannel | None = None,
                 num_window_blocks: int | None = None, num_state_slots: int = 0):
        self.model = model
        self.cfg = cfg
        self.channel = channel
        self.block_size = block_size
        self.device = torch.device(device)
        self.scratch_block = num_blocks
        windows = layer_windows(model, cfg.num_layers)
        self.window = max((w for w in windows if w), default=None)
        chunked = any(isinstance(m, PagedAttention) and m.attention_chunk for m in model.modules())
        self.window_layer_kind = 'chunked-attention' if chunked else 'sliding-window'
        if num_window_blocks is not None and (self.window is None or all(windows)):
            raise ValueError('a sliding-window pool needs a model with both windowed (sliding or chunked) and '
                             'full layers')
        self.num_window_blocks = num_window_blocks
        self.window_scratch_block = num_window_blocks
        self.tables = ('block_ids',) if num_window_blocks is None else ('block_ids', 'window_block_ids')
        pool_sizes = [num_window_blocks if window and num_window_blocks is not None else num_blocks
                      for window in windows]
        layer_states = recurrent_state_shapes(model, cfg.num_layers)
        self.num_state_slots = num_state_slots if any(layer_states) else 0
        if any(layer_states) and num_state_slots < 1:
            raise ValueError('a model with linear-attention layers needs recurrent-state slots')
        # Zeroed so that the padding read by batched decode never holds NaNs (a masked position weighs 0, and 0 * NaN
        # is NaN); lazily, page by page as the blocks are first written or read.
        self.kv_caches = [self._layer_cache(layer, states, size)
                          for layer, (states, size) in enumerate(zip(layer_states, pool_sizes))]
        self.graphs: DecodeGraphRunner | None = None
        self.splits_mixed_steps = has_small_step_kernels(model)

    def _layer_cache(self, layer: int, states: list | None, num_blocks: int) -> tuple[torch.Tensor, ...]:
        """Layer ``layer``'s place in ``kv_caches``: its KV cache of ``num_blocks`` blocks (plus the scratch block),
        its recurrent states, or both (:class:`KVAndStates`: the KV tensors first)."""
        has_kv = states is None or isinstance(states, KVAndStates)
        shapes = self.cfg.kv_cache_shapes(num_blocks + 1, self.block_size, layer)
        kv = tuple(lazily_zeroed(shape, dtype, self.device) for shape, dtype in shapes) if has_kv else ()
        return kv + (allocate_states(states, self.num_state_slots, self.device) if states is not None else ())

    def capture_graphs(self, max_batch_size: int, max_blocks: int, make_graph=None) -> None:
        """Captures decode graphs for up to ``max_batch_size`` sequences of up to ``max_blocks`` blocks."""
        self.graphs = DecodeGraphRunner(self.model, self.kv_caches, max_batch_size, max_blocks, self.block_size,
                                        self.scratch_block, make_graph, self.window_scratch_block)
        self.graphs.capture()

    def _tensor(self, values: list) -> torch.Tensor:
        return to_device(torch.tensor(values), self.device)

    def _block_tables(self, items: list[ScheduledSeq], lengths: list[int]) -> list[torch.Tensor]:
        """Per pool ``[len(items), max blocks]``: each sequence's blocks covering its first ``lengths`` tokens,
        block 0 for those a sliding pool gave back and for the padding."""
        width = -(-max(lengths) // self.block_size)
        tables = []
        for name in self.tables:
            rows = [given_back_as_zero(getattr(item.seq, name)[:width]) for item in items]
            tables.append(self._tensor([row + [0] * (width - len(row)) for row in rows]))
        return tables

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
        """Packs the step's tokens; also returns the rows whose logits the step needs: each sampled
        sequence's last token, then the prompt positions whose logprobs prefill chunks record (see
        ``Sequence.prompt_logprob_positions``)."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        kv_blocks: list[list[int]] = [[] for _ in self.tables]  # per pool
        q_start: list[int] = []
        ctx_len: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []
        rope_positions: list[torch.Tensor] = []
        key_limits: list[int] = []
        uses_mrope = getattr(self.model, 'uses_mrope', False)
        for item in plan.prefill:
            seq, start = item.seq, item.seq.num_computed
            end = start + item.num_tokens
            if uses_mrope:
                rope_positions.append(seq.rope_positions_of(start, end))
            q_start.append(len(input_ids))
            prompt_rows.extend(len(input_ids) + p - start for p in seq.prompt_logprob_positions(start, end))
            ctx_len.append(end)
            input_ids.extend(seq.token_ids[start:end])
            key_limits.extend(seq.key_limits(start, end))
            chunk_positions = range(start, end)
            positions.extend(chunk_positions)
            for blocks, name in zip(kv_blocks, self.tables):
                table = getattr(seq, name)
                blocks.extend(table[p // bs] for p in chunk_positions)
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
        num_prefill = len(input_ids)
        prefill = dict(prefill_block_table=None, prefill_q_start=None, prefill_q_len=None, prefill_ctx_len=None,
                       prefill_max_q_len=0)
        window_tables = {}
        if plan.prefill:
            q_len = [item.num_tokens for item in plan.prefill]
            prefill_tables = self._block_tables(plan.prefill, ctx_len)
            if len(prefill_tables) > 1:
                window_tables['window_prefill_block_table'] = prefill_tables[1]
            prefill = dict(prefill_block_table=prefill_tables[0],
                           prefill_q_start=self._tensor(q_start), prefill_q_len=self._tensor(q_len),
                           prefill_ctx_len=self._tensor(ctx_len), prefill_max_q_len=max(q_len),
                           prefill_seq_len=self._tensor([item.seq.num_tokens for item in plan.prefill]))
            if key_limits != positions:
                prefill['prefill_key_limit'] = self._tensor(key_limits)
        decode_blocks = decode_kv_lens = None
        if plan.decode:
            for item in plan.decode:
                # the sequence's last token, or one it generated before a preemption, fed again (not sampled)
                seq, position = item.seq, item.seq.num_computed
                if item.samples:
                    sample_rows.append(len(input_ids))
                input_ids.append(seq.last_token if item.samples else seq.token_ids[position])
                positions.append(position)
                for blocks, name in zip(kv_blocks, self.tables):
                    blocks.append(getattr(seq, name)[position // bs])
                if uses_mrope:
                    rope_positions.append(seq.rope_positions_of(position, position + 1))
            lengths = [item.seq.num_computed + 1 for item in plan.decode]
            decode_tables = self._block_tables(plan.decode, lengths)
            decode_blocks, decode_kv_lens = decode_tables[0], self._tensor(lengths)
            if len(decode_tables) > 1:
                window_tables['window_decode_blocks'] = decode_tables[1]
        position_tensor = self._tensor(positions)
        states = {}
        if self.num_state_slots:
            states['state_prefill'] = [(item.seq.state_slot, row, item.num_tokens, item.seq.num_computed == 0)
                                       for item, row in zip(plan.prefill, q_start)]
            if plan.decode:
                states['state_decode_slots'] = self._tensor([item.seq.state_slot for item in plan.decode])
        if len(kv_blocks) > 1:
            window_tables['window_kv_blocks'] = self._tensor(kv_blocks[1])
        ctx = StepContext(positions=position_tensor, kv_blocks=self._tensor(kv_blocks[0]),
                          kv_offsets=position_tensor % bs, num_prefill_tokens=num_prefill,
                          decode_blocks=decode_blocks, decode_kv_lens=decode_kv_lens,
                          rope_positions=to_device(torch.cat(rope_positions, dim=1), self.device) if uses_mrope
                          else None,
                          multimodal=self._multimodal_batch(plan, q_start), **prefill, **window_tables,
                          **states)
        return self._tensor(input_ids), ctx, sample_rows + prompt_rows

    @torch.inference_mode()
    def forward(self, plan: SchedulerOutput, inflight: InflightTokens | None = None) -> torch.Tensor:
        """Runs the step; returns logits ``[num_sampled + num_prompt_rows, vocab]``: the sampled rows in plan
        order (prefill, decode), then the prompt rows (see :meth:`build_inputs`), in the model's dtype (the
        sampler widens them where it needs to). Decode rows of sequences with a token in flight take it
        from ``inflight``."""
        if (self.graphs is not None and not plan.prefill and all(item.samples for item in plan.decode)
                and self.graphs.runs(plan.decode)):
            return self.graphs.run(plan.decode, inflight)
        if self.splits_mixed_steps and plan.prefill and plan.decode:
            prefill = self.forward(replace(plan, decode=[]))
            decode = self.forward(replace(plan, prefill=[]), inflight)
            num_sampled = sum(1 for item in plan.prefill if item.samples)
            return torch.cat((prefill[:num_sampled], decode, prefill[num_sampled:]))
        input_ids, ctx, rows = self.build_inputs(plan)
        if inflight is not None:
            inflight.copy_into(input_ids, plan.decode, ctx.num_prefill_tokens)
        return self.execute(input_ids, ctx, rows)

    @torch.inference_mode()
    def execute(self, input_ids: torch.Tensor, ctx: StepContext, rows: list[int]) -> torch.Tensor:
        """Runs packed inputs (from :meth:`build_inputs`) on every rank; the logits of ``rows``."""
        if self.channel is not None:
            self.channel.send((input_ids, ctx, rows))
        return self._run(input_ids, ctx, rows)

    def _run(self, input_ids: torch.Tensor, ctx: StepContext, rows: list[int]) -> torch.Tensor | None:
        if self.device.type == 'cpu':
            cpu.bind_worker_threads()
        with step_rows(decode=ctx.num_prefill_tokens == 0):
            hidden = self.model(input_ids, self.kv_caches, ctx)
            if len(rows) < hidden.shape[0] or rows != list(range(len(rows))):  # decode steps need every row
                hidden = hidden[to_device(torch.tensor(rows, dtype=torch.long), self.device)]
            return self.model.logits(hidden)

    @torch.inference_mode()
    def serve(self) -> None:
        """The loop of a tensor-parallel rank other than 0: runs each step rank 0 sends, until it says stop."""
        while (step := self.channel.recv()) is not None:
            self._run(*step_channel.to_device(step, self.device))
