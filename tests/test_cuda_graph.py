"""The decode graph runner on the CPU: graph capture is replaced by a recorder whose replay re-runs the
captured function into the captured output, so bucketing, padding and buffer reuse run for real."""
from __future__ import annotations

import pytest
import torch
from helpers import collect, dequantized_weight, make_engine, random_prompts, run
from vl_models import random_image, save_tiny_vl_model

from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
from lmdeploy.pytorch.engine.cuda_graph import graph_batch_sizes
from lmdeploy.pytorch.engine.engine import Engine

MAX_BATCH = 8


class RecordedGraph:
    """Stands in for a CUDA graph: ``replay`` runs the captured function again, on the same buffers."""

    def __init__(self):
        self.replays = 0

    def capture(self, fn):
        self.fn = fn
        self.output = fn()
        return self.output

    def replay(self) -> None:
        self.replays += 1
        self.output.copy_(self.fn())


def with_recorded_graphs(engine: Engine) -> Engine:
    engine.runner.capture_graphs(MAX_BATCH, -(-engine.session_len // engine.config.block_size), RecordedGraph)
    return engine


def generate(engine: Engine, requests: list[tuple[list[int], GenerationConfig]]) -> list[list[int]]:
    return collect(engine, [engine.add_request(prompt, gen) for prompt, gen in requests])


def ragged_requests(seed: int = 0) -> list[tuple[list[int], GenerationConfig]]:
    """Seven prompts that finish one after another, so decode batches shrink through every graph size."""
    prompts = random_prompts([5, 17, 3, 40, 9, 23, 12], seed=seed)
    return [(p, GenerationConfig(max_new_tokens=3 + 4 * i, ignore_eos=True)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize('max_batch_size, sizes', [(1, [1]), (5, [1, 2, 4, 5]), (64, [1, 2, 4, 8, 16, 24, 32, 48, 64]),
                                                   (100, [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100])])
def test_graph_batch_sizes(max_batch_size, sizes):
    assert graph_batch_sizes(max_batch_size) == sizes


def test_replayed_decode_steps_give_the_eager_tokens(tiny_model):
    requests = ragged_requests()
    eager = generate(make_engine(tiny_model, max_batch_size=MAX_BATCH), requests)
    engine = with_recorded_graphs(make_engine(tiny_model, max_batch_size=MAX_BATCH))
    assert generate(engine, requests) == eager
    replays = {size: graph.replays for size, graph in engine.runner.graphs.graphs.items()}
    assert all(replays[size] > 0 for size in (1, 2, 4, 8)), replays


def test_sampled_and_penalized_requests_through_graphs(tiny_llama):
    gen = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.9, top_p=0.8, top_k=20, random_seed=7,
                           repetition_penalty=1.3, logprobs=2)
    requests = [(p, gen) for p in random_prompts([6, 11, 4], seed=3)]
    eager = generate(make_engine(tiny_llama, max_batch_size=MAX_BATCH), requests)
    assert generate(with_recorded_graphs(make_engine(tiny_llama, max_batch_size=MAX_BATCH)), requests) == eager


def test_padding_rows_touch_only_the_scratch_block(tiny_llama):
    engine = with_recorded_graphs(make_engine(tiny_llama, max_batch_size=MAX_BATCH, num_gpu_blocks=64))
    generate(engine, ragged_requests()[:3])  # 3 sequences: padded to 4
    k_cache = engine.runner.kv_caches[0][0]
    assert engine.runner.scratch_block == 64 and k_cache.shape[0] == 65
    assert k_cache[64].abs().sum() > 0, 'padding rows write their K/V to the scratch block'
    assert k_cache[63].abs().sum() == 0, 'a block no sequence was given stays untouched'


def test_static_buffers_are_reused(tiny_llama):
    engine = with_recorded_graphs(make_engine(tiny_llama, max_batch_size=MAX_BATCH))
    graphs = engine.runner.graphs
    inputs_ptr = graphs.inputs.data_ptr()
    logits = []
    original_run = graphs.run

    def recording_run(decode, inflight=None):
        out = original_run(decode, inflight)
        logits.append((len(decode), out.data_ptr()))
        return out

    graphs.run = recording_run
    generate(engine, ragged_requests()[:3])
    assert graphs.inputs.data_ptr() == inputs_ptr
    assert logits and all(ptr == graphs.outputs[4 if n > 2 else n].data_ptr() for n, ptr in logits)


def test_steps_outside_the_graphs_run_eagerly(tiny_llama):
    """Batches above the largest graph and sequences longer than its block table take the eager path."""
    requests = ragged_requests()
    eager = generate(make_engine(tiny_llama, max_batch_size=MAX_BATCH), requests)
    engine = make_engine(tiny_llama, max_batch_size=MAX_BATCH)
    engine.runner.capture_graphs(4, 2, RecordedGraph)  # at most 4 sequences of at most 2 blocks (32 tokens)
    assert generate(engine, requests) == eager


def test_vision_language_positions_through_graphs(tmp_path):
    path = save_tiny_vl_model('qwen2_vl', str(tmp_path / 'qwen2_vl'))
    with pipeline(path, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16),
                  show_progress=False) as pipe:
        processed = [pipe.async_engine.processor.process(p) for p in (('describe', random_image(1)), 'plain text')]
    gen = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    eager = run(make_engine(path, max_batch_size=MAX_BATCH, num_gpu_blocks=64), processed, gen)
    graphs = with_recorded_graphs(make_engine(path, max_batch_size=MAX_BATCH, num_gpu_blocks=64))
    assert run(graphs, processed, gen) == eager


def test_eager_mode_and_load_format_flags():
    from lmdeploy.cli.args import add_engine_args, engine_config
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config(parser.parse_args(['--device', 'cuda', '--eager-mode', '--load-format', 'dummy']))
    assert (config.device, config.eager_mode, config.load_format) == ('cuda', True, 'dummy')
    with pytest.raises(ValueError, match='load_format'):
        PytorchEngineConfig(load_format='npz')


def test_dummy_weights_build_a_working_model(tiny_llama):
    engine = make_engine(tiny_llama, load_format='dummy')
    params = dict(engine.runner.model.named_parameters())
    assert torch.equal(params['norm.weight'], torch.ones_like(params['norm.weight']))
    qkv = engine.runner.model.layers[0].self_attn.qkv_proj
    weight = qkv.weight if qkv.weight is not None else dequantized_weight(qkv.kernel)
    assert weight.dtype == torch.float32 and 0.015 < weight.std().item() < 0.025
    outs = generate(engine, ragged_requests()[:2])
    assert [len(o) for o in outs] == [3, 7]
