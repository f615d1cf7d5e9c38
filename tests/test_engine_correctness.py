"""The engine against transformers on tiny random models: exact in fp32, close in bf16."""
from __future__ import annotations

import os
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import GREEDY_32, assert_transformers_greedy, make_engine, random_prompts, run

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.nn.quant.dense import DenseKernel


@pytest.fixture(scope='module')
def hf_model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def test_greedy_matches_transformers(tiny_model, hf_model):
    prompts = random_prompts([3, 17, 40, 64, 90])
    outs = run(make_engine(tiny_model), prompts)
    assert_transformers_greedy(hf_model, prompts, outs)


def test_first_step_logits_match(tiny_model, hf_model):
    engine = make_engine(tiny_model)
    prompts = random_prompts([7, 31])
    for p in prompts:
        engine.add_request(p, GenerationConfig(max_new_tokens=1))
    plan = engine.scheduler.schedule()
    logits = engine.runner.forward(plan)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf_model(torch.tensor([prompt])).logits[0, -1]
        assert (logits[row].cpu() - ref).abs().max().item() < 1e-3


def test_last_only_logits_are_the_last_row(tiny_llama):
    """``get_logits(last_only=True)`` is the last row of every position's logits, after several prefill chunks
    too, and gives back its blocks."""
    engine = make_engine(tiny_llama, max_prefill_token_num=16)
    prompt = random_prompts([40], seed=3)[0]
    every, last = engine.get_logits(prompt), engine.get_logits(prompt, last_only=True)
    assert every.shape[0] == 40 and last.shape == (1, every.shape[1])
    torch.testing.assert_close(last, every[-1:], atol=1e-5, rtol=0)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_bf16_on_packed_weights_stays_close(tiny_model, hf_model):
    """On the CPU bf16 projections run on oneDNN-packed weights: last-position logits stay within bf16
    error of fp32 transformers, with the same top token."""
    engine = Engine(tiny_model, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=32, block_size=16),
                    show_progress=False)
    assert not isinstance(engine.runner.model.layers[0].self_attn.qkv_proj.kernel, DenseKernel)
    prompt = random_prompts([35], seed=5)[0]
    ours = engine.get_logits(prompt)[-1]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0, -1]
    assert ((ours - ref).norm() / ref.norm()).item() < 0.03
    assert ours.argmax() == ref.argmax()


def test_batch_does_not_change_outputs(tiny_llama):
    engine = make_engine(tiny_llama)
    prompts = random_prompts([5 + 9 * i for i in range(16)], seed=1)
    batched = run(engine, prompts)
    solo = [run(engine, [p])[0] for p in prompts]
    assert batched == solo


def test_preemption_keeps_outputs(tiny_llama):
    prompts = random_prompts([40, 50, 60, 70, 45, 55], seed=2)
    gen = GenerationConfig(max_new_tokens=48, ignore_eos=True)
    roomy = run(make_engine(tiny_llama), prompts, gen)
    tight = make_engine(tiny_llama, num_gpu_blocks=14, enable_prefix_caching=False)
    assert run(tight, prompts, gen) == roomy
    assert tight.scheduler.num_preemptions > 0
    assert tight.block_manager.num_free_blocks == 14


def test_chunked_prefill_and_prefix_cache_keep_outputs(tiny_llama):
    prompts = random_prompts([100, 130], seed=3)
    shared = prompts[0][:64]
    prompts += [shared + p for p in random_prompts([20, 30], seed=4)]
    plain = run(make_engine(tiny_llama, enable_prefix_caching=False), prompts)
    chunked = make_engine(tiny_llama, max_prefill_token_num=32)
    assert run(chunked, prompts) == plain
    cached = make_engine(tiny_llama)
    run(cached, prompts[:1])
    assert run(cached, prompts) == plain
    assert cached.block_manager.num_hits > 0


def test_cached_tokens_reported(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompts([70], seed=5)[0]
    run(engine, [prompt])
    engine.add_request(prompt + [5, 6, 7], GREEDY_32)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].num_cached_tokens == 64


def test_a_prompt_that_ends_in_its_prefill_step_leaves_its_blocks_cached(tiny_llama):
    """A request of one new token finishes in the step that prefills it; its full blocks were given back without
    being published, so the same prompt (a retry, a second turn's shared prefix) was computed again."""
    engine = make_engine(tiny_llama)
    prompt = random_prompts([70], seed=7)[0]
    first = run(engine, [prompt], GenerationConfig(max_new_tokens=1))
    engine.add_request(prompt + [5, 6, 7], GREEDY_32)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert outputs[-1].num_cached_tokens == 64
    assert run(engine, [prompt], GenerationConfig(max_new_tokens=1)) == first


def test_max_new_tokens_and_ignore_eos_exact(tiny_llama):
    engine = make_engine(tiny_llama)
    eos = next(iter(engine.tokenizer.eos_token_ids))
    prompts = random_prompts([10, 20, 30], seed=6)
    for n in (1, 7, 50):
        outs = run(engine, prompts, GenerationConfig(max_new_tokens=n, ignore_eos=True))
        assert [len(o) for o in outs] == [n] * 3
    engine.add_request(prompts[0], GenerationConfig(max_new_tokens=20, stop_token_ids=[eos], min_new_tokens=3,
                                                    logit_bias={eos: 100.0}))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert [o.token_ids[0] for o in outputs][-1] == eos and len(outputs) == 4
    assert outputs[-1].finish_reason == 'stop'


def test_stop_words_are_trimmed(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompts([12], seed=7)[0]
    full = engine.tokenizer.decode(run(engine, [prompt])[0])
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), 'the generated text must be printable for this test'
    engine.add_request(prompt, GenerationConfig(max_new_tokens=32, ignore_eos=True, stop_words=[stop]))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    text = ''.join(o.text for o in outputs)
    assert outputs[-1].finish_reason == 'stop'
    assert text == full[:full.index(stop)]


def _single_cpu_threads() -> dict[int, set[int]]:
    """This process's threads that are pinned to one CPU, and their CPU."""
    affinities = {int(tid): os.sched_getaffinity(int(tid)) for tid in os.listdir('/proc/self/task')}
    return {tid: cpus for tid, cpus in affinities.items() if len(cpus) == 1}


@pytest.mark.parametrize('bind', ['1', '0'])
def test_engine_pins_its_openmp_workers_not_its_own_thread(tiny_llama, monkeypatch, bind):
    """Each thread that runs CPU steps gets its OpenMP workers pinned to one CPU each; unless turned
    off, and the thread itself stays free (threads it starts later inherit its affinity)."""
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2 or torch.get_num_threads() < 2 or cpu.native() is None:
        pytest.skip('needs 2 CPUs, 2 torch threads and the native kernels')
    monkeypatch.setenv('LMDEPLOY_CPU_BIND', bind)
    engine = make_engine(tiny_llama, device='cpu')
    before = _single_cpu_threads()
    seen = {}

    def steps():
        run(engine, random_prompts([8]), GenerationConfig(max_new_tokens=2))
        seen['caller'] = os.sched_getaffinity(0)
        seen['pinned'] = {tid: cpus for tid, cpus in _single_cpu_threads().items() if tid not in before}

    thread = threading.Thread(target=steps)
    thread.start()
    thread.join()
    assert seen['caller'] == cpus
    if bind == '1':
        assert seen['pinned'] and all(pinned <= cpus for pinned in seen['pinned'].values())
    else:
        assert not seen['pinned']
