"""End to end on the bundled default model (SmolLM2-135M-Instruct, Q4_1 GGUF)."""
from __future__ import annotations

import threading

import pytest
import torch
from helpers import reference_argmax

from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline

pytestmark = pytest.mark.slow

QUESTIONS = ['What is the capital of France?', 'Write a haiku about the sea.',
             'Explain paged attention in one sentence.', 'List three prime numbers.']


@pytest.fixture(scope='module')
def pipe():
    with pipeline(backend_config=PytorchEngineConfig(dtype='float32', max_batch_size=8, num_gpu_blocks=64)) as p:
        yield p


def test_greedy_matches_transformers_gguf(pipe, default_model_reference):
    ref = default_model_reference
    gen = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    responses = pipe(QUESTIONS, gen_config=gen)
    for question, response in zip(QUESTIONS, responses):
        prompt = pipe.encode(question)
        assert reference_argmax(ref, prompt, response.token_ids) == response.token_ids
        assert response.generate_token_len == 32 and response.finish_reason == 'length'


def test_answers_make_sense(pipe):
    response = pipe('What is the capital of France?', gen_config=GenerationConfig(max_new_tokens=32))
    assert 'Paris' in response.text
    assert response.finish_reason == 'stop'


def test_stream_matches_batch(pipe):
    gen = GenerationConfig(max_new_tokens=24)
    full = pipe(QUESTIONS[:2], gen_config=gen)
    texts = ['', '']
    for chunk in pipe.stream_infer(QUESTIONS[:2], gen_config=gen):
        texts[chunk.index] += chunk.text
    assert texts == [r.text for r in full]


def test_second_start_uses_the_converted_copy(monkeypatch):
    """A second start loads the cached conversion (about 3 s here) instead of converting the GGUF again."""
    from lmdeploy.pytorch.weights import gguf

    def no_conversion(*args):
        raise AssertionError('the default model was converted again')

    monkeypatch.setattr(gguf, 'convert_gguf', no_conversion)
    with pipeline(backend_config=PytorchEngineConfig(num_gpu_blocks=16), show_progress=False) as pipe:
        assert pipe('Hi', gen_config=GenerationConfig(max_new_tokens=2)).generate_token_len >= 1


def decode_step_logits(engine, prompt: list[int]) -> torch.Tensor:
    """fp32 logits of ``prompt``'s last token fed as a decode step (a small step) after a prefill of the others."""
    from lmdeploy.pytorch.engine.sequence import Sequence
    from lmdeploy.pytorch.paging.scheduler import ScheduledSeq, SchedulerOutput
    seq = Sequence(-1, prompt[:-1], GenerationConfig(max_new_tokens=2))
    engine.block_manager.allocate(seq, len(prompt))
    try:
        engine.runner.forward(SchedulerOutput(prefill=[ScheduledSeq(seq, len(prompt) - 1)]))
        seq.num_computed, seq.output_ids = len(prompt) - 1, prompt[-1:]
        return engine.runner.forward(SchedulerOutput(decode=[ScheduledSeq(seq, 1)]))[0].float()
    finally:
        engine.block_manager.free_blocks(seq)


def test_bf16_small_steps_run_the_q4_1_grid_in_int4():
    """By default (bf16) decode steps use the GGUF's own 4-bit grid (its scales and zero points rounded to bf16):
    their logits stay within a few percent of fp32's, with the same top token; a grid off by one step gives over
    100%."""
    from lmdeploy.pytorch.engine.engine import Engine
    from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
    prompts = [[1, 504], [1, 19556], [33, 30], [788, 260]]
    logits = {}
    for name, config in [('fp32', PytorchEngineConfig(dtype='float32', num_gpu_blocks=8)),
                         ('bf16', PytorchEngineConfig(num_gpu_blocks=8, decode_int4=False)),
                         ('int4', PytorchEngineConfig(num_gpu_blocks=8))]:
        engine = Engine(None, config, show_progress=False)
        model = engine.runner.model
        assert isinstance(model.layers[0].mlp.gate_up_proj.kernel, SmallStepInt4Kernel) == (name == 'int4')
        logits[name] = [decode_step_logits(engine, p) for p in prompts]
    for fp32, bf16, int4 in zip(logits['fp32'], logits['bf16'], logits['int4']):
        assert not torch.equal(int4, bf16)
        assert (int4 - fp32).norm() / fp32.norm() < 0.1
        assert int4.argmax() in (fp32.argmax(), bf16.argmax())



def test_bf16_steps_release_the_gil_in_the_native_decoder_stack(monkeypatch, native_gemms):
    """With the native GEMM (bf16) a step's decoder layers run with the GIL released, so other Python
    threads (an API server's event loop) keep running during the step: a thread that stamps the time
    every fraction of a millisecond leaves stamps well inside the call, which no thread can while a
    native call holds the GIL (a GIL-holding kernel of the same length leaves none)."""
    import sys
    import time

    from lmdeploy.pytorch.engine.engine import Engine
    engine = Engine(None, PytorchEngineConfig(num_gpu_blocks=8), show_progress=False)
    model = engine.runner.model
    assert model.native_stack is not None
    stamps, calls = [], []
    done = threading.Event()

    class TimedStack:
        def __init__(self, stack):
            self.stack = stack

        def forward(self, *args):
            start = time.perf_counter()
            out = self.stack.forward(*args)
            calls.append((start, time.perf_counter()))
            return out

    def stamp():
        while not done.is_set():
            stamps.append(time.perf_counter())
            time.sleep(0.0002)

    monkeypatch.setattr(model.native_stack, 'large', TimedStack(model.native_stack.large))
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)  # a GIL holder hands over within 0.5 ms of a call's edges
    thread = threading.Thread(target=stamp)
    thread.start()
    try:
        engine.get_logits(list(range(100, 400)))
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(switch_interval)
    (start, end), = calls
    assert end - start > 0.01
    assert any(start + 0.003 < when < end - 0.003 for when in stamps)
