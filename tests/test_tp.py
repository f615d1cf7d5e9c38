"""Tensor parallelism over gloo on the CPU: tp=2 gives tp=1's greedy tokens in fp32, a worker that dies
or hangs fails the engine fast, and no worker outlives its engine."""
from __future__ import annotations

import operator
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import httpx
import psutil
import pytest
import torch
from conftest import save_tiny_model
from helpers import assert_gone, make_engine, random_prompts, run
from server_helpers import free_port, wait_healthy
from vl_models import random_image, save_tiny_vl_model

from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy.pytorch.distributed.cpu_affinity import bind_rank, rank_cpus
from lmdeploy.pytorch.distributed.parallel_state import WorkerError
from lmdeploy.pytorch.engine.engine import Engine

PROMPTS = random_prompts([5, 17, 40, 9], seed=3)
GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)


def tp1_reference(path: str) -> tuple[list[list[int]], torch.Tensor]:
    engine = make_engine(path)
    try:
        return run(engine, PROMPTS, GREEDY), engine.get_logits(PROMPTS[2])
    finally:
        engine.close()


@pytest.mark.parametrize('kind, start_method', [('llama_vocab321', 'spawn'), ('qwen3', 'forkserver'),
                                               ('qwen2_moe', 'forkserver')])
def test_tp2_matches_tp1(kind, start_method, tmp_path, monkeypatch):
    """Dense with GQA (2 KV heads split) and a padded vocabulary share; one KV head replicated on both
    ranks (Qwen3, q/k norms); MoE with a shared expert, dense layers and tied embeddings. The worker is
    this process's child (spawn) or the forkserver's."""
    monkeypatch.setenv('LMDEPLOY_TP_START_METHOD', start_method)
    # 321 vocabulary rows: the second rank's share of the vocabulary is padded.
    path = (save_tiny_model('llama', str(tmp_path), vocab_size=321) if kind == 'llama_vocab321'
            else save_tiny_model(kind, str(tmp_path)))
    expected_tokens, expected_logits = tp1_reference(path)
    engine = make_engine(path, tp=2)
    try:
        pids = engine.executor.pids
        assert (psutil.Process(pids[0]).ppid() == os.getpid()) == (start_method == 'spawn')
        assert run(engine, PROMPTS, GREEDY) == expected_tokens
        logits = engine.get_logits(PROMPTS[2])
        assert logits.shape == expected_logits.shape
        torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)
        assert engine.runner.kv_caches[0][0].shape[1] == 1  # this rank's KV heads
    finally:
        engine.close()
    assert_gone(pids)
    assert [process.exitcode for process in engine.executor.processes] == [0]  # stopped, not killed


@pytest.mark.parametrize('kind', ['qwen2_vl', 'qwen3_vl_moe', 'internvl', 'mistral3', 'gemma3'])
def test_vl_pipeline_tp2_matches_tp1_and_close_leaves_no_process(tmp_path, kind):
    """The vision tower runs replicated on both ranks; the images reach rank 1 with the step's inputs.
    Qwen3-VL-MoE: deepstack features, and each rank's share of the stacked experts; Mistral 3: rows of image
    tokens broken by tokens that keep their embeddings; Gemma 3: the step's key limits (its image tokens attend
    to each other) reach rank 1 too."""
    path = save_tiny_vl_model(kind, str(tmp_path))
    prompts = [('describe', random_image(1)), ('describe', [random_image(2, (60, 60)), random_image(3)]), 'text']
    config = dict(dtype='float32', num_gpu_blocks=64, block_size=16)
    with pipeline(path, PytorchEngineConfig(**config), show_progress=False) as pipe:
        expected = [r.token_ids for r in pipe(prompts, gen_config=GREEDY)]
    pipe = pipeline(path, PytorchEngineConfig(tp=2, **config), show_progress=False)
    pids = pipe.async_engine.engine.executor.pids
    try:
        assert [r.token_ids for r in pipe(prompts, gen_config=GREEDY)] == expected
    finally:
        pipe.close()
    assert_gone(pids)


def test_bf16_tp2_runs_the_packed_native_layers_per_rank(tiny_llama):
    """In bf16 each rank runs its layers on the native GEMM's packed weights (the one-call decoder stack,
    which has no collectives, stays off); the logits differ from tp=1's only by bf16 rounding."""
    config = dict(dtype='bfloat16', num_gpu_blocks=32, block_size=16)
    logits = {}
    for tp in (1, 2):
        engine = Engine(tiny_llama, PytorchEngineConfig(tp=tp, **config), show_progress=False)
        try:
            assert tp == 1 or engine.runner.model.native_stack is None
            logits[tp] = engine.get_logits(PROMPTS[1])
        finally:
            engine.close()
    torch.testing.assert_close(logits[2], logits[1], rtol=0, atol=0.05)


@pytest.mark.slow
def test_default_model_tp2_matches_tp1(default_model_gguf):
    prompts, config = PROMPTS[:2], GenerationConfig(max_new_tokens=16, ignore_eos=True)
    engine = make_engine(default_model_gguf, num_gpu_blocks=32)
    try:
        expected = run(engine, prompts, config)
    finally:
        engine.close()
    engine = make_engine(default_model_gguf, num_gpu_blocks=32, tp=2)
    try:
        assert run(engine, prompts, config) == expected
    finally:
        engine.close()


def test_forked_workers_start_with_the_engines_environment_and_cpus(tiny_llama, monkeypatch):
    """A forkserver's child starts with the server's environment and CPUs; the worker takes the engine's as
    they are when it starts: ``LMDEPLOY_CPU_BIND=0`` leaves it all the CPUs it starts with (else it binds to its
    share), and a thread limited to one CPU starts a worker limited to it."""
    monkeypatch.setenv('LMDEPLOY_TP_START_METHOD', 'forkserver')
    make_engine(tiny_llama, tp=2).close()  # the forkserver runs, with this process's environment and CPUs
    monkeypatch.setenv('LMDEPLOY_CPU_BIND', '0')
    allowed = os.sched_getaffinity(0)
    one = {min(allowed)}
    for cpus in (allowed, one):
        os.sched_setaffinity(0, cpus)
        try:
            engine = make_engine(tiny_llama, tp=2)
        finally:
            os.sched_setaffinity(0, allowed)
        pids = engine.executor.pids
        try:
            assert set(psutil.Process(pids[0]).cpu_affinity()) == cpus
            assert psutil.Process(pids[0]).ppid() != os.getpid()
        finally:
            engine.close()
        assert_gone(pids)


def test_engines_on_one_thread_give_back_its_cpus_whatever_the_close_order(monkeypatch):
    """Two engines bound on one thread: the second's rank 0 takes its share of all the thread's CPUs (before:
    of the first's share), the thread stays bound while either is open, and closed in the order they started
    the thread gets its CPUs and torch threads back (before: left on the first's share)."""
    allowed = os.sched_getaffinity(0)
    if len(allowed) < 2:
        pytest.skip('needs 2 CPUs')
    monkeypatch.delenv('LMDEPLOY_CPU_BIND', raising=False)
    threads = torch.get_num_threads()
    first = bind_rank(rank_cpus(0, 2))
    assert set(rank_cpus(1, 2)).isdisjoint(os.sched_getaffinity(0))
    second = bind_rank(rank_cpus(0, 2))
    first()
    assert os.sched_getaffinity(0) == set(rank_cpus(0, 2)) != allowed
    second()
    assert os.sched_getaffinity(0) == allowed and torch.get_num_threads() == threads


def test_an_unknown_start_method_is_refused_before_any_worker_starts(tiny_llama, monkeypatch):
    monkeypatch.setenv('LMDEPLOY_TP_START_METHOD', 'fork')
    with pytest.raises(ValueError, match="LMDEPLOY_TP_START_METHOD is 'spawn' or 'forkserver', got 'fork'"):
        make_engine(tiny_llama, tp=2)


def test_killed_worker_fails_the_engine_fast(tiny_llama):
    engine = make_engine(tiny_llama, tp=2)
    try:
        pid = engine.executor.pids[0]
        engine.add_request(PROMPTS[0], GenerationConfig(max_new_tokens=500, ignore_eos=True))
        engine.step()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r'rank 1 \(pid \d+\) was killed by SIGKILL'):
            while True:
                engine.step()
        assert time.monotonic() - start < 5
        with pytest.raises(WorkerError):
            engine.check_alive()
    finally:
        engine.close()
    assert_gone([pid])


def test_ranks_bind_their_own_cpus_and_a_killed_worker_ends_every_request_with_error(tiny_llama):
    """Rank 0 (the pipeline's engine thread) and rank 1 each compute on their own half of the CPUs. A worker
    killed mid-run ends the running request and the queued one with ``finish_reason: 'error'``, and a
    request sent afterwards too; ``close()`` leaves no process."""
    allowed = os.sched_getaffinity(0)
    config = PytorchEngineConfig(tp=2, dtype='float32', num_gpu_blocks=64, block_size=16, max_batch_size=1)
    pipe = pipeline(tiny_llama, config, show_progress=False)
    pids = pipe.async_engine.engine.executor.pids
    try:
        worker_cpus = set(psutil.Process(pids[0]).cpu_affinity())
        rank0_cpus = pipe.async_engine.engine_loop.call(lambda _: os.sched_getaffinity(0)).result(10)
        assert rank0_cpus | worker_cpus == allowed
        if len(allowed) >= 2:
            assert rank0_cpus.isdisjoint(worker_cpus) and len(rank0_cpus) == len(worker_cpus)
        final = {}
        long_run = GenerationConfig(max_new_tokens=900, ignore_eos=True)
        for chunk in pipe.stream_infer(['a long story', 'another one'], gen_config=long_run):
            if chunk.index == 0 and chunk.generate_token_len and psutil.pid_exists(pids[0]):
                os.kill(pids[0], signal.SIGKILL)
            if chunk.finish_reason is not None:
                final[chunk.index] = chunk
        assert sorted(final) == [0, 1]
        for chunk in [*final.values(), pipe('later', gen_config=GREEDY)]:
            assert chunk.finish_reason == 'error' and 'was killed by SIGKILL' in chunk.error
    finally:
        pipe.close()
    assert_gone(pids)


class RaisesWhereUnpickled:
    """A step message that raises ``ZeroDivisionError`` in the worker that unpickles it."""

    def __reduce__(self):
        return operator.truediv, (1, 0)


def test_worker_that_raises_fails_the_engine_fast_with_its_error(tiny_llama):
    engine = make_engine(tiny_llama, tp=2)
    try:
        pid = engine.executor.pids[0]
        engine.runner.channel.send(RaisesWhereUnpickled())
        engine.add_request(PROMPTS[0], GREEDY)
        start = time.monotonic()
        with pytest.raises(WorkerError, match='rank 1.*ZeroDivisionError: division by zero'):
            while True:
                engine.step()
        assert time.monotonic() - start < 5
    finally:
        engine.close()
    assert_gone([pid])


def test_hung_worker_fails_the_step_after_the_timeout(tiny_llama, monkeypatch):
    """``$LMDEPLOY_TP_TIMEOUT`` bounds the collectives; once the first step is done, 1 s (set on the group) is
    enough to wait for a stopped worker, and the engine gives up as soon as it passes."""
    monkeypatch.setenv('LMDEPLOY_TP_TIMEOUT', '4')
    engine = make_engine(tiny_llama, tp=2)
    try:
        pid = engine.executor.pids[0]
        assert engine.executor.group.timeout == timedelta(seconds=4)
        engine.add_request(PROMPTS[0], GenerationConfig(max_new_tokens=500, ignore_eos=True))
        engine.step()
        engine.executor.group.timeout = timedelta(seconds=1)
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(WorkerError, match='Timed out'):
            while True:
                engine.step()
        assert time.monotonic() - start < 6
    finally:
        engine.close()
    assert_gone([pid])


def server_workers(proc: subprocess.Popen) -> list[psutil.Process]:
    """The server's tensor-parallel worker processes: spawned by it, or forked by its forkserver."""
    def started_by(process: psutil.Process, marker: str) -> bool:
        return process is not None and marker in ' '.join(process.cmdline())

    return [child for child in psutil.Process(proc.pid).children(recursive=True)
            if started_by(child, 'spawn_main') or started_by(child.parent(), 'forkserver')]


def test_server_tp2_streams_and_a_killed_worker_makes_health_503(tiny_llama):
    port = free_port()
    proc = subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.main', 'serve', 'api_server', tiny_llama, '--tp', '2',
                             '--dtype', 'float32', '--num-gpu-blocks', '64', '--block-size', '16',
                             '--server-port', str(port), '--model-name', 'tiny'],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f'http://127.0.0.1:{port}'
    children: list[psutil.Process] = []
    try:
        wait_healthy(url, proc)
        children = psutil.Process(proc.pid).children(recursive=True)
        body = {'model': 'tiny', 'prompt': 'Hello', 'max_tokens': 8, 'ignore_eos': True, 'stream': True,
                'temperature': 0}
        with httpx.stream('POST', f'{url}/v1/completions', json=body, timeout=30) as resp:
            events = [line for line in resp.iter_lines() if line.startswith('data: ')]
        assert events[-1] == 'data: [DONE]' and '"finish_reason":"length"' in events[-2].replace(' ', '')
        with httpx.stream('POST', f'{url}/v1/completions', json={**body, 'max_tokens': 900}, timeout=30) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith('data: '))
            (worker,) = server_workers(proc)
            worker.kill()
            events = [line for line in lines if line.startswith('data: ')]
        assert 'was killed by SIGKILL' in events[-2] and events[-1] == 'data: [DONE]'
        health = httpx.get(f'{url}/health', timeout=5)
        assert health.status_code == 503 and 'WorkerError' in health.json()['error']['message']
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        proc.wait()
    assert_gone([child.pid for child in children])


def test_each_rank_reads_only_its_slice_of_the_weight_files(tiny_llama, monkeypatch):
    """Rank 1 of 2 reads half of every sharded tensor from the files (q/k/v, o, gate/up, down, the embedding
    and LM head) and all of the replicated ones (norms), nothing more."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from lmdeploy.pytorch.config import ModelConfig
    from lmdeploy.pytorch.distributed.parallel_state import TPGroup, use_group
    from lmdeploy.pytorch.weights import safetensors_loader
    from lmdeploy.pytorch.weights.loader import build_model

    read: dict[str, int] = {}
    file_read = safetensors_loader.FileTensor.read

    def counted(self, index):
        tensor = file_read(self, index)
        read[self.name] = read.get(self.name, 0) + tensor.numel()
        return tensor

    monkeypatch.setattr(safetensors_loader.FileTensor, 'read', counted)
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(tiny_llama), torch.float32, 0)
    with use_group(TPGroup(rank=1, world_size=2)):
        build_model(cfg, tiny_llama, torch.device('cpu'), show_progress=False)
    with safe_open(f'{tiny_llama}/model.safetensors', framework='pt') as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    sharded = ('_proj.weight', 'embed_tokens.weight', 'lm_head.weight')
    assert set(read) == set(sizes)
    for name, shape in sizes.items():
        numel = int(torch.tensor(shape).prod())
        assert read[name] == (numel // 2 if name.endswith(sharded) else numel), name
