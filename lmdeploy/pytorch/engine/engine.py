"""The PyTorch engine: add requests, step the batch, collect outputs."""
from __future__ import annotations

import functools
import itertools
import logging
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmdeploy.archs import get_model_class, load_hf_config
from lmdeploy.messages import EngineOutput, GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import resolve_model_path
from lmdeploy.pytorch.distributed.cpu_affinity import bind_rank, rank_cpus
from lmdeploy.pytorch.distributed.executor import Executor, create_executor
from lmdeploy.pytorch.distributed.parallel_state import TPGroup, WorkerError
from lmdeploy.pytorch.engine.guided import Grammar, GrammarCompiler, GrammarState
from lmdeploy.pytorch.engine.model_runner import InflightTokens
from lmdeploy.pytorch.engine.output_processor import OutputProcessor
from lmdeploy.pytorch.engine.runner_builder import build_runner
from lmdeploy.pytorch.engine.sampler import PendingSample, depends_on_outputs, launch_sample, record_prompt_logprobs
from lmdeploy.pytorch.engine.sequence import Sequence
from lmdeploy.pytorch.kernels import cpu as cpu_kernels
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.pytorch.nn.rotary import long_rope_after
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from lmdeploy.pytorch.paging.state_pool import StatePool
from lmdeploy.tokenizer import Tokenizer

logger = logging.getLogger('lmdeploy')


@dataclass
class LaunchedStep:
    """A step queued on the device: its scheduled items, the sequences it samples (one row each) and
    their tokens on the way to the host."""

    items: list[ScheduledSeq]
    sampled: list[Sequence]
    sample: PendingSample


class Engine:
    """Continuous-batching inference over a paged KV cache.

    Not thread-safe: one caller drives ``add_request``/``abort``/``step``, on the thread that built it.
    With ``config.tp > 1`` that thread is tensor-parallel rank 0 (the scheduler and the sampler live
    there) and an :class:`Executor` runs the other ranks; a failed rank makes every later call raise
    :class:`WorkerError`. :meth:`close` stops them (so does dropping the engine).
    """

    def __init__(self, model_path: str | None = None, config: PytorchEngineConfig | None = None,
                 show_progress: bool = True):
        self.config = config = config or PytorchEngineConfig()
        if config.device.split(':')[0] not in ('cpu', 'cuda'):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {config.device!r}")
        self.device = torch.device(config.device)
        if self.device.type == 'cuda' and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
        if config.num_threads and config.tp == 1:
            torch.set_num_threads(config.num_threads)
        if self.device.type == 'cpu':
            cpu_kernels.native()  # built once, before workers load it
        self.model_dir = resolve_model_path(model_path)
        architecture = load_hf_config(self.model_dir).architectures[0]  # a bad config.json is named first
        refusal = get_model_class(architecture).tensor_parallel_refusal
        if config.tp > 1 and refusal:
            raise ValueError(f'{architecture} runs on one rank only: {refusal}; use tp=1')
        self.tokenizer = Tokenizer(self.model_dir)
        self.executor: Executor | None = create_executor(model_path, config) if config.tp > 1 else None
        self._unbind_cpus: Callable[[], None] | None = None
        weakref.finalize(self, _shutdown, self.executor)
        try:
            _, self.model_config, self.runner = build_runner(self.model_dir, config, self.device, self._start_ranks(),
                                                             show_progress)
        except BaseException as exc:
            self.close()
            if isinstance(exc, WorkerError):
                raise self.executor.explain(exc) from exc
            raise
        runner = self.runner
        # each image's tokens attend to each other both ways (Gemma 3): see Sequence.bidirectional_spans
        self.bidirectional_images = getattr(runner.model, 'bidirectional_image_attention', False)
        num_blocks = runner.scratch_block
        cfg = self.model_config
        state_pool = StatePool(runner.num_state_slots) if runner.num_state_slots else None
        prefix_caching = config.enable_prefix_caching and state_pool is None
        if state_pool is not None:
            logger.info('%s: %d recurrent-state slots for its linear-attention or Mamba layers; prefix caching is '
                        'off (cached KV blocks cannot restore a recurrent state) and decode steps run eagerly',
                        cfg.architecture, state_pool.num_slots)
        self.block_manager = BlockManager(num_blocks, config.block_size, prefix_caching, runner.window,
                                          runner.num_window_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_batch_size, config.max_prefill_token_num,
                                   long_rope_after(cfg.hf_config), state_pool,
                                   runner.model.recurrent_chunk if state_pool is not None else 0)
        use_graphs = (self.device.type == 'cuda' and not config.eager_mode and config.tp == 1
                      and state_pool is None and runner.model.decode_graphs)
        capacity = self.block_manager.token_capacity(config.max_prefill_token_num)
        self._log_cache(num_blocks * config.block_size)
        self.session_len = min(config.session_len or cfg.max_position_embeddings, capacity or sys.maxsize)
        if use_graphs:
            self.runner.capture_graphs(config.max_batch_size, -(-self.session_len // config.block_size))
        self.outputs = OutputProcessor(self.tokenizer)
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, config.grammar_cache_mb << 20)
        self.sequences: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self.overlap = self.device.type == 'cuda' if config.overlap_schedule is None else config.overlap_schedule
        self._launched: LaunchedStep | None = None
        # Fault injection, for tests only (None, and one attribute check per step, unless a test sets it):
        # called on the engine's thread as fault_hook('forward', seqs) before a batch's forward pass, and as
        # fault_hook('output', seqs) once a step's sampled tokens became outputs (finished sequences are
        # already released then); what it raises is what step() raises.
        self.fault_hook: Callable[[str, list[Sequence]], None] | None = None

    def _log_cache(self, tokens: int) -> None:
        """Logs the KV cache's size: the ``tokens`` its first pool holds, and the sliding-window pool (of the
        sliding-window or chunked-attention layers); or that the model keeps none."""
        config, cfg, runner = self.config, self.model_config, self.runner
        if not runner.cfg.kv_bytes_per_token():
            logger.info('KV cache: none (no layer of %s attends; its recurrent states are all it keeps), %d blocks of '
                        '%d count the tokens', cfg.architecture, tokens // config.block_size, config.block_size)
            return
        kv_kind = {0: str(cfg.dtype).removeprefix('torch.'), 8: 'int8', 4: 'int4'}[config.quant_policy]
        if cfg.kv_latent_dim:
            kv_kind += ' rows (compressed attention)' if cfg.hf_config.model_type == 'deepseek_v4' else ' latent (MLA)'
        indexer = 'DSA' if cfg.kv_latent_dim else 'QSA'
        kv_kind += f' + {cfg.dtype} indexer keys ({indexer})'.replace('torch.', '') if cfg.index_key_dim else ''
        cache_bytes = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
        pools = f'{tokens // config.block_size} blocks of {config.block_size}'
        if runner.num_window_blocks is not None:
            pools += (f' for the full-attention layers, and {runner.num_window_blocks} blocks for the '
                      f'{runner.window_layer_kind} layers (window {runner.window}), which give back the blocks out '
                      'of their window')
        elif runner.window is not None:
            pools += f', sliding window {runner.window}: blocks out of the window are given back'
        logger.info('KV cache: %d tokens (%s), %s (quant_policy %d), %d bytes per token of every layer, %.1f MiB '
                    'per rank', tokens, pools, kv_kind, config.quant_policy, runner.cfg.kv_bytes_per_token(),
                    cache_bytes / 2**20)
        if cfg.num_kv_shared_layers:
            logger.info('KV sharing: %d of the %d layers attend over an earlier layer\'s KV cache and hold none, '
                        'saving %d bytes per token', cfg.num_kv_shared_layers, cfg.num_layers,
                        runner.cfg.shared_kv_bytes_per_token())

    def _start_ranks(self) -> TPGroup:
        """This thread's group: rank 0 of ``tp`` ranks, bound to its share of the CPUs, once the
        executor's workers have connected."""
        if self.executor is None:
            return TPGroup()
        group = self.executor.start()
        if self.device.type == 'cpu':
            self._unbind_cpus = bind_rank(rank_cpus(0, self.executor.local_world_size), self.config.num_threads)
        return group

    def close(self) -> None:
        """Stops the tensor-parallel workers and gives this thread its CPUs back; idempotent. The engine
        cannot step afterwards."""
        if self.executor is not None:
            self.executor.shutdown()
        if self._unbind_cpus is not None:
            self._unbind_cpus, unbind = None, self._unbind_cpus
            unbind()

    def check_alive(self) -> None:
        """Raises :class:`WorkerError` once a tensor-parallel worker has failed."""
        if self.executor is not None:
            self.executor.check()

    def _on_all_ranks(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``forward()``, which every tensor-parallel rank takes part in; a failed rank raises
        :class:`WorkerError` saying which and why."""
        self.check_alive()
        try:
            return forward()
        except WorkerError as exc:
            raise self.executor.explain(exc) from exc

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError('the prompt is empty; give at least one token')
        if len(prompt_ids) >= self.session_len:
            raise ValueError(f'the prompt has {len(prompt_ids)} tokens, but session_len is {self.session_len}; '
                             'shorten the prompt or raise session_len')
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f'prompt token ids must be in [0, {vocab})')

    def _check_multimodal(self, prompt_ids: list[int], multimodal: list[MultiModalInput]) -> None:
        if not hasattr(self.runner.model, 'encode_images'):
            raise ValueError('this model does not accept images')
        image_token_id = self.model_config.mm_config.image_token_id
        end = 0
        for image in multimodal:
            if image.offset < end or image.end > len(prompt_ids) or image.length < 1 or any(
                    (token == image_token_id) != is_placeholder for token, is_placeholder in
                    zip(prompt_ids[image.offset:image.end], self.runner.model.placeholder_mask(image))):
                raise ValueError('each image must cover its own span of image placeholder tokens of the prompt')
            end = image.end
            if self.bidirectional_images and image.length > self.config.max_prefill_token_num:
                raise ValueError(f'an image of {image.length} tokens does not fit one prefill step of '
                                 f'max_prefill_token_num={self.config.max_prefill_token_num} tokens; this model '
                                 "computes each image's tokens in one step (they attend to each other): raise it")

    def add_request(self, prompt_ids: list[int], gen_config: GenerationConfig | None = None,
                    multimodal: list[MultiModalInput] | None = None, grammar: Grammar | None = None) -> int:
        """Queues a request and returns its id; raises ``ValueError`` for input it cannot serve.

        ``multimodal`` lists the prompt's images (see :class:`MultiModalInput`), in prompt order.
        ``grammar`` is ``gen_config.response_format`` compiled by ``self.grammars`` (from any thread);
        without it the format is compiled here, on the engine's thread.
        """
        gen_config = gen_config or GenerationConfig()
        self._check_prompt(prompt_ids)
        grammar = grammar or self.grammars.compile(gen_config)
        seq = Sequence(next(self._ids), list(prompt_ids), gen_config, self.tokenizer.eos_token_ids)
        if grammar is not None:
            seq.grammar = GrammarState(grammar)
        if multimodal:
            self._check_multimodal(prompt_ids, multimodal)
            seq.multimodal = list(multimodal)
            if self.bidirectional_images:
                seq.bidirectional_spans = [(image.offset, image.end) for image in multimodal]
            seq.rope_positions, seq.rope_delta = self.runner.model.prompt_positions(len(prompt_ids), multimodal)
        self.sequences[seq.seq_id] = seq
        self.outputs.add(seq)
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, seq_id: int) -> EngineOutput | None:
        """Stops a request and frees its blocks; unknown or finished ids are a no-op."""
        seq = self.sequences.pop(seq_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = 'abort'
        return self.outputs.finish(seq)

    @torch.inference_mode()
    def get_logits(self, prompt_ids: list[int], last_only: bool = False) -> torch.Tensor:
        """fp32 logits ``[len(prompt_ids), vocab]`` of every position (``last_only``: ``[1, vocab]``, the last
        position's, the LM head run on one row of each chunk), from a fresh prefill of the prompt in chunks of
        ``max_prefill_token_num`` tokens, in borrowed free blocks (no prefix-cache reuse; sliding-window layers
        give back their blocks between chunks); runs between steps, on the engine's thread."""
        self._check_prompt(prompt_ids)
        bm, state_pool = self.block_manager, self.scheduler.state_pool
        seq = Sequence(-1, list(prompt_ids), GenerationConfig(max_new_tokens=1))
        logits = []
        try:
            if state_pool is not None:
                if not state_pool.num_free:
                    raise ValueError('no free recurrent-state slot for this prompt right now; retry when the engine '
                                     'is idle')
                state_pool.take(seq)
            while seq.num_computed < len(prompt_ids):
                num_tokens = min(self.config.max_prefill_token_num, len(prompt_ids) - seq.num_computed)
                bm.release_out_of_window(seq)
                if not bm.can_allocate(bm.blocks_needed(seq, seq.num_computed + num_tokens)):
                    raise ValueError('not enough free KV-cache blocks for this prompt right now; retry when the '
                                     'engine is idle')
                bm.allocate(seq, seq.num_computed + num_tokens)
                input_ids, ctx, _ = self.runner.build_inputs(SchedulerOutput(prefill=[ScheduledSeq(seq, num_tokens)]))
                rows = [num_tokens - 1] if last_only else list(range(num_tokens))
                forward = functools.partial(self.runner.execute, input_ids, ctx, rows)
                logits.append(self._on_all_ranks(forward).float().cpu())
                seq.num_computed += num_tokens
            return logits[-1] if last_only else torch.cat(logits)
        finally:
            bm.free_blocks(seq)
            if state_pool is not None:
                state_pool.give_back(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._launched is not None

    def step(self) -> list[EngineOutput]:
        """Runs one batched forward pass and returns the new output of every sequence that got one.

        Overlapped (``overlap_schedule``), the step is queued on the device first and the outputs are
        those of the step before, whose tokens arrived meanwhile: the next step is scheduled and its
        inputs are built while the device still runs the last one.
        """
        previous, self._launched = self._launched, None
        outputs: list[EngineOutput] = []
        if previous is not None and any(depends_on_outputs(seq) for seq in self.scheduler.running):
            outputs, previous = self._collect(previous), None
        plan = self.scheduler.schedule()
        if not plan.is_empty:
            self._launched = self._launch(plan, previous)
        if previous is not None:
            outputs = self._collect(previous)
        if self._launched is not None and not self.overlap:
            launched, self._launched = self._launched, None
            outputs = self._collect(launched)
        return outputs

    def _launch(self, plan: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Queues the forward pass and the sampling of ``plan``; the sampled tokens are in flight."""
        inflight = None
        if previous is not None:
            inflight = InflightTokens(previous.sample.token_ids,
                                      {seq.seq_id: row for row, seq in enumerate(previous.sampled)})
        if self.fault_hook is not None:
            self.fault_hook('forward', [item.seq for item in plan.prefill + plan.decode])
        logits = self._on_all_ranks(lambda: self.runner.forward(plan, inflight))
        items = plan.prefill + plan.decode
        sampled = [item.seq for item in items if item.samples]
        if len(logits) > len(sampled):
            record_prompt_logprobs(logits[len(sampled):], plan.prefill)
            logits = logits[:len(sampled)]
        for item in items:
            item.seq.num_computed += item.num_tokens
        pending = launch_sample(logits, sampled)
        for seq in sampled:
            seq.num_inflight += 1
            seq.awaiting_final_token = (seq.num_generated >= seq.gen_config.max_new_tokens
                                        or seq.num_tokens >= self.session_len)
        return LaunchedStep(items, sampled, pending)

    def _collect(self, step: LaunchedStep) -> list[EngineOutput]:
        """Waits for a launched step's tokens and turns them into outputs; sequences that ended while it
        was in flight (stopped by the step before, or aborted) drop theirs."""
        result = step.sample.result()
        for item in step.items:  # before finished sequences give their blocks back: a one-step prompt's too
            if not item.seq.is_finished:
                self.block_manager.register_full_blocks(item.seq)
        outputs = []
        for row, seq in enumerate(step.sampled):
            seq.num_inflight -= 1
            if seq.is_finished:
                continue
            logprobs = result.logprobs[row] if result.logprobs else None
            output = self.outputs.append_token(seq, result.token_ids[row], logprobs, self.session_len)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq)
                del self.sequences[seq.seq_id]
            outputs.append(output)
        if self.fault_hook is not None:
            self.fault_hook('output', step.sampled)
        return outputs


def _shutdown(executor: Executor | None) -> None:
    if executor is not None:
        executor.shutdown()
