"""Tensor-parallel workers as Ray actors on a local Ray cluster (loopback only): tp=1's tokens, and a
killed actor fails the engine fast; neither the actors nor the cluster outlive the engine."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
from helpers import assert_gone, make_engine, random_prompts, run

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.distributed.parallel_state import WorkerError

PROMPTS = random_prompts([5, 17, 40, 9], seed=3)
GREEDY = GenerationConfig(max_new_tokens=24, ignore_eos=True)


def test_ray_tp2_matches_tp1_and_a_killed_actor_fails_fast(tiny_llama, monkeypatch):
    monkeypatch.delenv('RAY_ADDRESS', raising=False)
    engine = make_engine(tiny_llama)
    try:
        expected = run(engine, PROMPTS, GREEDY)
    finally:
        engine.close()
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    engine = make_engine(tiny_llama, tp=2, distributed_executor_backend='ray')
    try:
        import ray
        assert engine.executor.started_cluster and ray.util.get_node_ip_address() == '127.0.0.1'
        cluster = [child.pid for child in psutil.Process().children(recursive=True) if child.pid not in before]
        assert run(engine, PROMPTS, GREEDY) == expected
        (pid,) = engine.executor.pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r'rank 1 \(Ray actor\) died'):
            run(engine, PROMPTS, GREEDY)
        assert time.monotonic() - start < 5
    finally:
        engine.close()
    assert not ray.is_initialized()
    assert_gone(cluster + [pid], timeout=30)
