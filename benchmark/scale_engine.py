"""Drives an engine step by step for ``gpu_scale.py``: decode steps of injected sequences (their context counted
as computed, no prefill), and whole workloads on the engine or transformers ``generate``, stopped at a deadline."""
from __future__ import annotations

import time

import torch
from throughput import hf_generate
from transformers import PreTrainedModel
from workload import Workload

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.sequence import SequenceStatus


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def inject(engine: Engine, batch: int, ctx: int, max_new_tokens: int) -> None:
    """Adds ``batch`` running sequences of ``ctx`` prompt tokens whose first ``ctx - 1`` count as computed,
    so that the next step is a pure decode step over ``ctx`` tokens each."""
    g = torch.Generator().manual_seed(ctx * 1000 + batch)
    for _ in range(batch):
        prompt = torch.randint(0, engine.model_config.vocab_size, (ctx,), generator=g).tolist()
        seq_id = engine.add_request(prompt, GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True))
        seq = engine.sequences[seq_id]
        engine.scheduler.waiting.remove(seq)
        engine.block_manager.allocate(seq, ctx)
        seq.num_computed = ctx - 1
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)


def abort_all(engine: Engine) -> None:
    """Aborts every request and collects the step still in flight, leaving the engine idle."""
    for seq_id in list(engine.sequences):
        engine.abort(seq_id)
    while engine.has_unfinished():
        engine.step()


def decode_step_ms(engine: Engine, batch: int, ctx: int, warmup: int, steps: int) -> float | None:
    """Mean ms of a decode step of ``batch`` sequences at context ``ctx``; None when their KV does not fit."""
    bm = engine.block_manager
    if any(batch * -(-(ctx + warmup + steps) // bm.block_size) > pool.num_free_blocks for pool in bm.pools):
        return None
    inject(engine, batch, ctx, warmup + steps + 1)
    try:
        for _ in range(warmup):
            engine.step()
        synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize()
        return (time.perf_counter() - start) * 1e3 / steps
    finally:
        abort_all(engine)


def run_engine(engine: Engine, work: Workload, deadline: float) -> tuple[int, float, bool]:
    """(output tokens, seconds, finished) of the whole workload at once; stops (and aborts) at ``deadline``."""
    for prompt, n_out in work:
        engine.add_request(prompt, GenerationConfig(max_new_tokens=n_out, ignore_eos=True))
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        if time.monotonic() > deadline:
            elapsed = time.perf_counter() - start
            abort_all(engine)
            return tokens, elapsed, False
        tokens += sum(len(out.token_ids) for out in engine.step())
    return tokens, time.perf_counter() - start, True


def run_hf(model: PreTrainedModel, work: Workload, batch_size: int, deadline: float) -> tuple[int, float, bool]:
    """transformers in static batches of prompts sorted by output length (as a capable user would batch
    them), left-padded, each batch generating its longest output; credited with each prompt's own output
    length. Stops between batches at ``deadline``."""
    ordered = sorted(work, key=lambda item: item[1])
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(ordered), batch_size):
        if time.monotonic() > deadline:
            return tokens, time.perf_counter() - start, False
        batch = ordered[i:i + batch_size]
        hf_generate(model, [prompt for prompt, _ in batch], max(n for _, n in batch), pad_id=0)
        tokens += sum(n for _, n in batch)
    synchronize()
    return tokens, time.perf_counter() - start, True
