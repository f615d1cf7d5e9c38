"""Overlapped scheduling: step N+1 is queued before step N's tokens reach the host; the outputs must be
exactly those of the plain loop, whatever ends a request (length, stop token, stop word, abort)."""
from __future__ import annotations

import pytest
from helpers import make_engine, random_prompts
from test_cuda_graph import generate, ragged_requests, with_recorded_graphs

from lmdeploy import GenerationConfig


def both(path, requests, **kwargs):
    plain = generate(make_engine(path, overlap_schedule=False, **kwargs), requests)
    engine = make_engine(path, overlap_schedule=True, **kwargs)
    return plain, generate(engine, requests), engine


def assert_nothing_held(engine) -> None:
    assert not engine.has_unfinished() and not engine.sequences
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_overlapped_greedy_steps_match(tiny_model):
    plain, overlapped, engine = both(tiny_model, ragged_requests(), max_batch_size=8)
    assert overlapped == plain
    assert_nothing_held(engine)


def test_overlapped_with_graphs_and_sampling(tiny_llama):
    sampled = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=0.8, top_p=0.9, random_seed=3,
                               logprobs=3, min_new_tokens=4)
    requests = ragged_requests() + [(p, sampled) for p in random_prompts([8, 13], seed=5)]
    plain = generate(make_engine(tiny_llama, overlap_schedule=False), requests)
    engine = with_recorded_graphs(make_engine(tiny_llama, overlap_schedule=True, max_batch_size=8))
    assert generate(engine, requests) == plain
    assert_nothing_held(engine)


def test_stop_tokens_penalties_and_preemption(tiny_llama):
    """Early stops leave a wasted step in flight; penalties make the engine wait for its tokens; too few
    blocks preempt sequences, never one with a token in flight."""
    greedy = generate(make_engine(tiny_llama), [(p, GenerationConfig(max_new_tokens=12, ignore_eos=True))
                                                for p in random_prompts([10, 12, 9, 11], seed=2)])
    stop_at = [out[9] if i % 2 else out[4] for i, out in enumerate(greedy)]
    requests = [(p, GenerationConfig(max_new_tokens=12, stop_token_ids=[t])) for p, t in
                zip(random_prompts([10, 12, 9, 11], seed=2), stop_at)]
    requests.append((random_prompts([7], seed=9)[0], GenerationConfig(max_new_tokens=9, repetition_penalty=1.4,
                                                                       ignore_eos=True)))
    plain, overlapped, engine = both(tiny_llama, requests, num_gpu_blocks=6, block_size=4)
    assert overlapped == plain
    assert [len(o) for o in overlapped[:4]] != [12] * 4, 'some requests stop early'
    assert engine.scheduler.num_preemptions > 0
    assert_nothing_held(engine)


@pytest.mark.parametrize('when', [1, 3])
def test_abort_while_a_step_is_in_flight(tiny_llama, when):
    engine = make_engine(tiny_llama, overlap_schedule=True)
    ids = [engine.add_request(p, GenerationConfig(max_new_tokens=20, ignore_eos=True))
           for p in random_prompts([5, 8], seed=4)]
    for _ in range(when):
        engine.step()
    assert engine._launched is not None
    engine.abort(ids[0])
    engine.abort(ids[0])
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert all(o.seq_id == ids[1] for o in outputs)
    assert outputs[-1].finish_reason == 'length' and outputs[-1].num_output_tokens == 20
    assert_nothing_held(engine)

