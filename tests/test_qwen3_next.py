"""Qwen3-Next (``Qwen3NextForCausalLM``), Qwen3.5 (``Qwen3_5ForCausalLM``) and Qwen3.5-MoE
(``Qwen3_5MoeForCausalLM``) against transformers on tiny random models: greedy tokens and first-step logits in
fp32, the delta rule against transformers', batching, chunked prefill and preemption equal to solo runs, the
recurrent-state slots given back (abort, an aborted stream, a failed step) and paid from the cache budget, prefix
caching turned off, the next-token-prediction weights skipped, the native decode kernels run by the engine, and bf16
on the CPU."""
from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_bf16_within_twice_transformers, assert_matches_transformers,
                           assert_prefix_caching_off_and_every_logit_matches, assert_slots_free, hf_causal_lm)
from helpers import assert_all_released, make_engine, random_prompts, run

from lmdeploy.archs import load_hf_config
from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.config import ModelConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.runner_builder import blocks_from_memory, cache_budget
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.gated_delta import DELTA_RULE_CHUNK, chunk_gated_delta_rule, gated_delta_decode
from lmdeploy.pytorch.models.qwen3_next import GatedDeltaNet
from lmdeploy.serve.async_engine import AsyncEngine

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run as arrivals  # noqa: E402

# three linear-attention layers, then a full-attention one (the checkpoints' pattern), twice; two key heads
# serve four value heads; a quarter of each full-attention head's features rotate
SHAPE = dict(hidden_size=48, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
             linear_conv_kernel_dim=4, vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=False,
             pad_token_id=None)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2)
VARIANTS = {
    'qwen3_5': lambda: Qwen3_5TextConfig(intermediate_size=64, **SHAPE),
    'qwen3_5_moe': lambda: Qwen3_5MoeTextConfig(**MOE, **SHAPE),
    'qwen3_next': lambda: Qwen3NextConfig(intermediate_size=64, mlp_only_layers=[1], **MOE, **SHAPE),
}
GREEDY_PROMPTS = [3, 17, 70, 150]  # past the delta rule's 64-token chunks


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def hybrid_model(request, tmp_path_factory) -> str:
    return save_random_model(VARIANTS[request.param](), str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def qwen3_5(tmp_path_factory) -> str:
    return save_random_model(VARIANTS['qwen3_5'](), str(tmp_path_factory.mktemp('qwen3_5_dense')))


def test_configs_are_hybrid():
    for make_config in VARIANTS.values():
        config = make_config()
        assert config.layer_types.count('linear_attention') == 6 and config.layer_types[3] == 'full_attention'
        assert config.linear_num_value_heads != config.linear_num_key_heads


def test_delta_rule_matches_transformers():
    """The chunked rule over two chunks (the state carried over), then the one-token steps on a state pool's row,
    give transformers' chunked rule over the whole sequence and its final state."""
    g = torch.Generator().manual_seed(0)
    length, split = 150, 70
    q, k = (torch.randn(1, length, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, length, 4, 12, generator=g)
    decay, beta = -torch.rand(1, length, 4, generator=g), torch.rand(1, length, 4, generator=g)
    expected, expected_state = torch_chunk_gated_delta_rule(q, k, v, decay, beta, output_final_state=True,
                                                            use_qk_l2norm_in_kernel=True)
    assert_chunks_then_decode_match(q, k, v, decay, beta, split, expected, expected_state)


def assert_chunks_then_decode_match(q, k, v, decay, beta, split: int, expected, expected_state) -> None:
    """The chunked rule over ``[0, 40)`` and ``[40, split)`` of the one sequence in ``q, k, v, decay, beta`` (the
    state carried over), then one-token steps on a state pool's row, give ``expected`` and ``expected_state`` (a
    reference's over the whole sequence), the pool's other rows untouched."""
    head, state = chunk_gated_delta_rule(q[0, :40], k[0, :40], v[0, :40], decay[0, :40], beta[0, :40], None)
    middle, state = chunk_gated_delta_rule(q[0, 40:split], k[0, 40:split], v[0, 40:split], decay[0, 40:split],
                                           beta[0, 40:split], state)
    pool, slot = torch.zeros(3, *state.shape), torch.tensor([1])
    pool[1] = state
    tail = [gated_delta_decode(q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], pool, slot)
            for t in range(split, q.shape[1])]
    torch.testing.assert_close(torch.cat([head, middle, *tail]), expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[1], expected_state[0], atol=1e-5, rtol=1e-5)
    assert not pool[0].any() and not pool[2].any()


def test_greedy_and_first_logits_match_transformers(hybrid_model):
    assert_matches_transformers(hybrid_model, hf_causal_lm(hybrid_model), random_prompts(GREEDY_PROMPTS),
                                random_prompts([5, 33, 100], seed=1))


def test_decode_runs_the_native_kernels(qwen3_5, monkeypatch):
    """On a CPU with the native AVX-512 build the engine's decode steps run the native delta rule and conv1d update
    (the greedy test above then checks their tokens); with the build switched off the torch twins give the same
    tokens."""
    native = cpu.gated_delta()
    if native is None:
        pytest.skip('the native gated delta kernel is built only with AVX-512')
    calls = Counter()

    class Counting:
        """The native module, counting the calls of the two kernels."""
        def __getattr__(self, name):
            kernel = getattr(native, name)
            if name not in ('gated_delta_decode', 'causal_conv1d_decode'):
                return kernel

            def call(*args):
                calls[name] += 1
                return kernel(*args)
            return call

    spy = Counting()
    prompts = random_prompts([9, 40], seed=5)
    monkeypatch.setattr(cpu, 'gated_delta', lambda: spy)
    monkeypatch.setattr(cpu, 'native', lambda: spy)
    with_native = run(make_engine(qwen3_5), prompts)
    assert calls['gated_delta_decode'] > 0 and calls['causal_conv1d_decode'] > 0
    monkeypatch.setattr(cpu, 'gated_delta', lambda: None)
    monkeypatch.setattr(cpu, 'native', lambda: None)
    assert run(make_engine(qwen3_5), prompts) == with_native


def test_batched_chunked_and_preempted_equal_solo(hybrid_model):
    """The state carries over between prefill chunks (of 16 tokens, and of 7: chunks that end inside the conv
    window) and a preempted sequence recomputes it from zero."""
    prompts = random_prompts([100, 130, 20, 45], seed=3)
    plain = run(make_engine(hybrid_model), prompts)
    assert [run(make_engine(hybrid_model), [p])[0] for p in prompts] == plain
    for chunk, block_size in ((16, 16), (7, 4)):
        engine = make_engine(hybrid_model, max_prefill_token_num=chunk, block_size=block_size, max_batch_size=4)
        assert run(engine, prompts) == plain
        assert_slots_free(engine)
    tight = make_engine(hybrid_model, num_gpu_blocks=14)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_prefill_chunks_end_on_the_delta_rules_chunks(qwen3_5):
    """A prefill chunk ends where the step's budget runs out, which the other sequences' rows decide, and the delta
    rule rounds by its own 64-token chunks: a chunk that does not end a prompt ends on a multiple of 64
    (``Scheduler.recurrent_grain``; before, prompts arriving one a step beside others' decode rows were cut at 99,
    58 and 156), where a split gives the bits of one call. Smaller budgets (beside a full batch's decode rows) cut
    at every multiple of a smaller grain (see ``test_state_pool``)."""
    engine = make_engine(qwen3_5, max_prefill_token_num=100, max_batch_size=4)
    assert engine.scheduler.recurrent_grain == DELTA_RULE_CHUNK == 64
    ends = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        ends.extend((item.seq.num_computed + item.num_tokens, item.seq.num_tokens) for item in plan.prefill)
        return plan

    engine.scheduler.schedule = recording_schedule
    prompts = random_prompts([9, 140, 200], seed=11)
    outs = arrivals(engine, prompts, GenerationConfig(max_new_tokens=6, ignore_eos=True), 1)
    assert [[t for tokens, _ in out for t in tokens] for out in outs] == [run(make_engine(qwen3_5), [p])[0][:6]
                                                                          for p in prompts]
    assert any(end < total for end, total in ends) and all(end == total or end % 64 == 0 for end, total in ends)
    assert make_engine(qwen3_5, max_prefill_token_num=66, max_batch_size=4).scheduler.recurrent_grain == 63

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(76, heads, dim, generator=g) for heads, dim in ((2, 8), (2, 8), (4, 12)))
    decay, beta = -torch.rand(76, 4, generator=g), torch.rand(76, 4, generator=g)
    state = torch.randn(4, 8, 12, generator=g)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    first, first_state = chunk_gated_delta_rule(q[:64], k[:64], v[:64], decay[:64], beta[:64], state)
    rest, rest_state = chunk_gated_delta_rule(q[64:], k[64:], v[64:], decay[64:], beta[64:], first_state)
    assert torch.equal(whole, torch.cat([first, rest])) and torch.equal(whole_state, rest_state)


def test_fewer_slots_than_requests_queue(qwen3_5):
    """With two slots (``max_batch_size=2``) five requests wait their turn and get their solo tokens, also with
    overlapped steps (a decode step built while the one before, which updates the same states, is in flight)."""
    prompts = random_prompts([9, 40, 3, 27, 60], seed=5)
    solo = [run(make_engine(qwen3_5), [p])[0] for p in prompts]
    for overlap in (False, True):
        engine = make_engine(qwen3_5, max_batch_size=2, overlap_schedule=overlap)
        assert engine.scheduler.state_pool.num_slots == 2
        assert run(engine, prompts) == solo
        assert_slots_free(engine)


def test_abort_gives_back_the_slot(qwen3_5):
    engine = make_engine(qwen3_5)
    ids = [engine.add_request(p, GenerationConfig(max_new_tokens=20)) for p in random_prompts([8, 30], seed=6)]
    engine.step()
    engine.step()
    assert engine.scheduler.state_pool.num_free == engine.scheduler.state_pool.num_slots - 2
    engine.abort(ids[0])
    engine.abort(ids[0])
    assert engine.scheduler.state_pool.num_free == engine.scheduler.state_pool.num_slots - 1
    while engine.has_unfinished():
        engine.step()
    assert_slots_free(engine)


@pytest.fixture(scope='module')
def async_engine(qwen3_5):
    engine = AsyncEngine(qwen3_5, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16,
                                                      max_batch_size=4, session_len=256), show_progress=False)
    yield engine
    engine.close()


def assert_async_released(engine: AsyncEngine) -> None:
    assert_all_released(engine)
    assert engine.engine_loop.call(lambda e: e.scheduler.state_pool.num_free).result(10) == 4


async def generate(engine: AsyncEngine, prompt: list[int], max_new_tokens: int = 8) -> list:
    config = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [chunk async for chunk in engine.generate(input_ids=prompt, gen_config=config)]


def test_aborted_stream_leaks_nothing(async_engine):
    async def main():
        agen = async_engine.generate('Hello world', gen_config=GenerationConfig(max_new_tokens=200, ignore_eos=True))
        async for _ in agen:
            break
        await agen.aclose()
    asyncio.run(main())
    assert_async_released(async_engine)


def test_failed_step_gives_back_the_slots(async_engine):
    """The first forward pass holding both requests fails: both end as 'error', their slots come back, a later
    request is served with the tokens it gets alone."""
    prompts = random_prompts([12, 30, 9], seed=8)
    expected = asyncio.run(generate(async_engine, prompts[2]))
    failed = []

    def fail_with_both(stage, seqs):
        if stage == 'forward' and len(seqs) == 2 and not failed:
            failed.append(True)
            raise RuntimeError('injected forward failure')

    async_engine.engine_loop.call(lambda e: setattr(e, 'fault_hook', fail_with_both)).result(10)
    try:
        async def main():
            return await asyncio.gather(generate(async_engine, prompts[0]), generate(async_engine, prompts[1]))
        for chunks in asyncio.run(main()):
            assert chunks[-1].finish_reason == 'error' and 'injected forward failure' in chunks[-1].error
    finally:
        async_engine.engine_loop.call(lambda e: setattr(e, 'fault_hook', None)).result(10)
    assert failed
    assert_async_released(async_engine)
    later = asyncio.run(generate(async_engine, prompts[2]))
    assert [c.token_ids for c in later] == [c.token_ids for c in expected]
    assert_async_released(async_engine)


def test_get_logits_and_prefix_caching_off(qwen3_5, caplog):
    """Every position's logits equal transformers' (computed in chunks of 16, the state carried over); prefix caching,
    asked for, is off and says why."""
    assert_prefix_caching_off_and_every_logit_matches(qwen3_5, caplog)


def test_next_token_prediction_weights_are_not_loaded(tmp_path):
    """The checkpoints' ``mtp.*`` tensors (a next-token-prediction layer) are skipped: the tokens are those without."""
    path = save_random_model(VARIANTS['qwen3_5'](), str(tmp_path / 'mtp'))
    prompts = random_prompts([5, 40], seed=4)
    expected = run(make_engine(path), prompts)
    file = os.path.join(path, 'model.safetensors')
    tensors = load_file(file)
    mtp = {name.replace('model.layers.3.', 'mtp.layers.0.'): tensor.clone() for name, tensor in tensors.items()
           if name.startswith('model.layers.3.')}
    mtp.update({'mtp.fc.weight': torch.randn(48, 96), 'mtp.norm.weight': torch.ones(48)})
    save_file({**tensors, **mtp}, file, metadata={'format': 'pt'})
    assert run(make_engine(path), prompts) == expected


def test_states_are_paid_from_the_cache_budget(qwen3_5, caplog):
    """The slots come out of ``max_cache_bytes`` first. Where a full batch's slots would take more than half of the
    budget, there are as many as half of it holds, with a warning; a budget that one slot and one block overfill
    is refused, naming what to change."""
    config = dict(dtype='float32', block_size=16, max_batch_size=64)
    engine = Engine(qwen3_5, PytorchEngineConfig(max_cache_bytes=2**21, **config), show_progress=False)
    runner = engine.runner
    sizes = [(layer.is_linear, sum(t.numel() * t.element_size() for t in cache))
             for layer, cache in zip(runner.model.layers, runner.kv_caches)]
    state_bytes = sum(size for is_linear, size in sizes if is_linear)
    kv_bytes = sum(size for is_linear, size in sizes if not is_linear)
    assert state_bytes > 0 and runner.cfg.num_state_layers == 6 and runner.num_state_slots == 64
    assert state_bytes + kv_bytes <= 2**21 + runner.cfg.kv_bytes_per_token() * 16  # the scratch block is extra
    slot_bytes = state_bytes // 64
    with caplog.at_level('WARNING', logger='lmdeploy'):
        engine = Engine(qwen3_5, PytorchEngineConfig(max_cache_bytes=state_bytes, **config), show_progress=False)
    assert engine.runner.num_state_slots == engine.scheduler.state_pool.num_slots == 32
    assert 'at most 32 sequences run at once' in caplog.text
    with pytest.raises(MemoryError, match='leaving no room for a KV-cache block; lower max_batch_size'):
        Engine(qwen3_5, PytorchEngineConfig(max_cache_bytes=slot_bytes, **config), show_progress=False)


def test_states_are_paid_from_gpu_memory_too(qwen3_5, monkeypatch):
    """On CUDA the slots come out of ``cache_max_entry_count`` of the free memory first (no GPU needed: the free
    memory is given)."""
    cfg = ModelConfig.from_hf(load_hf_config(qwen3_5), torch.float32)
    monkeypatch.setattr(torch.cuda, 'mem_get_info', lambda device: (2**22, 2**30))
    config = PytorchEngineConfig(cache_max_entry_count=0.5, block_size=16)
    budget = cache_budget(cfg, config, torch.device('cuda'), None, 1)
    blocks = blocks_from_memory(cfg, config, budget, state_bytes=2**20)
    assert blocks == (2**21 - 2**20) // (cfg.kv_bytes_per_token() * 16)
    assert cfg.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 4  # two full-attention layers: K and V of 2 heads of 16


def test_value_heads_must_group_by_key_head():
    config = VARIANTS['qwen3_5']()
    config.linear_num_value_heads, config.architectures = 3, ['Qwen3_5ForCausalLM']
    with pytest.raises(ValueError, match='must be a multiple of linear_num_key_heads'):
        GatedDeltaNet(ModelConfig.from_hf(config, torch.float32))


def test_tensor_parallelism_is_refused(qwen3_5):
    with pytest.raises(ValueError, match='linear-attention layers are not sharded'):
        make_engine(qwen3_5, tp=2)


def test_bf16_close_to_transformers(hybrid_model):
    """bf16 on the CPU (packed GEMM weights; prefill steps run the layers' own forward, decode steps may run the
    native decoder stack, see test_decoder_stack_qwen3_next.py): the last logits differ from transformers' in fp32 by
    at most twice what transformers' own bf16 model does."""
    assert_bf16_within_twice_transformers(hybrid_model)
