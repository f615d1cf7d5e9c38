"""Sliding-window layers give back the KV blocks that fell out of their window: tiny Mistral (every layer
slides), Gemma 3 (five local layers per global one), gpt-oss (alternating) and Llama 4 (chunked-attention layers,
in the sliding pool with their chunk as the window, beside a NoPE full-attention one) against transformers at
contexts several times the window, with the sliding pool's blocks per sequence bounded while the full pool's grow;
every block back after finish and abort; prefix-cache hits; preemption; quantized caches; decode graphs;
and the block manager and the pools' sizes on their own."""
from __future__ import annotations

import logging

import pytest
import torch
from test_cuda_graph import RecordedGraph
from transformers import Gemma3TextConfig, GptOssConfig, Llama4TextConfig, MistralConfig

from conftest import VOCAB_SIZE, save_random_model
from family_checks import assert_tp2_equals_tp1, hf_causal_lm
from helpers import add_requests, assert_transformers_greedy, collect, make_engine, random_prompts, run

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.runner_builder import kv_pool_sizes, window_pool_target
from lmdeploy.pytorch.engine.sequence import Sequence
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.block_pool import BlockPool

BLOCK = 16
SHAPE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=VOCAB_SIZE, max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=None)
GEMMA3_LAYERS = ['sliding_attention'] * 5 + ['full_attention']


def llama4_config(chunk: int) -> Llama4TextConfig:
    """Three chunked-attention layers of ``chunk`` positions and a NoPE full-attention one; MoE every other layer."""
    config = Llama4TextConfig(**{**SHAPE, 'intermediate_size': 48}, intermediate_size_mlp=80, num_hidden_layers=4,
                              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                              no_rope_layers=[1, 1, 0, 1], attention_chunk_size=chunk, floor_scale=4, attn_scale=0.5)
    config.architectures = ['Llama4ForCausalLM']
    return config


FAMILIES = {  # kind -> (config, window)
    'mistral': (lambda: MistralConfig(**SHAPE, num_hidden_layers=2, sliding_window=24), 24),
    'gemma3': (lambda: Gemma3TextConfig(**SHAPE, num_hidden_layers=6, sliding_window=16, query_pre_attn_scalar=24,
                                        layer_types=GEMMA3_LAYERS,
                                        rope_parameters={'sliding_attention': {'rope_type': 'default',
                                                                               'rope_theta': 100.0},
                                                         'full_attention': {'rope_type': 'default',
                                                                            'rope_theta': 10000.0}}), 16),
    'gpt_oss': (lambda: GptOssConfig(**{**SHAPE, 'intermediate_size': 32}, num_hidden_layers=2, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=32), 32),
    'llama4': (lambda: llama4_config(16), 16),
}
LONG = GenerationConfig(max_new_tokens=48, ignore_eos=True)


@pytest.fixture(scope='module', params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, str]:
    config, _ = FAMILIES[request.param]
    return request.param, save_random_model(config(), str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def gemma3(tmp_path_factory) -> str:
    return save_random_model(FAMILIES['gemma3'][0](), str(tmp_path_factory.mktemp('gemma3')))


@pytest.fixture(scope='module')
def llama4(tmp_path_factory) -> str:
    return save_random_model(FAMILIES['llama4'][0](), str(tmp_path_factory.mktemp('llama4')))


def sliding_table(engine, seq: Sequence) -> list[int | None]:
    """The block table of ``seq`` in the engine's sliding pool."""
    return seq.window_block_ids if len(engine.block_manager.pools) == 2 else seq.block_ids


def held(table: list[int | None]) -> int:
    return sum(b is not None for b in table)


def all_free(engine) -> bool:
    bm = engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and all(p.num_free_blocks == p.num_blocks for p in bm.pools)


def run_watching_blocks(engine, prompts, gen_config=LONG) -> tuple[list[list[int]], int, int]:
    """The tokens of ``prompts``, the most blocks a sequence held in the sliding pool after any step, and the
    most it held in the full pool (0 without one)."""
    seq_ids = add_requests(engine, prompts, gen_config)
    outs = {seq_id: [] for seq_id in seq_ids}
    most_sliding = most_full = 0
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.seq_id].extend(out.token_ids)
        for seq in engine.scheduler.running:
            most_sliding = max(most_sliding, held(sliding_table(engine, seq)))
            if len(engine.block_manager.pools) == 2:
                most_full = max(most_full, held(seq.block_ids))
    return [outs[i] for i in seq_ids], most_sliding, most_full


def test_tokens_match_transformers_beyond_the_window_with_bounded_sliding_blocks(family):
    """Prompts of 2-6 windows decode 48 tokens more, batched and in 32-token chunks: transformers' tokens;
    each sequence holds at most the window's blocks plus a chunk's in the sliding pool, while the full
    pool's grow with the context."""
    kind, path = family
    window = FAMILIES[kind][1]
    prompts = random_prompts([3 * window, 6 * window, 2 * window + 5], seed=1)
    engine = make_engine(path, max_prefill_token_num=32, max_batch_size=4)
    hybrid = kind != 'mistral'
    assert len(engine.block_manager.pools) == (2 if hybrid else 1) and engine.runner.window == window
    outs, most_sliding, most_full = run_watching_blocks(engine, prompts)
    hf = hf_causal_lm(path)
    assert_transformers_greedy(hf, prompts, outs, 48)
    assert most_sliding <= -(-(window - 1 + 32) // BLOCK) + 1
    if hybrid:
        assert most_full >= -(-(6 * window + 40) // BLOCK), 'the full pool keeps the whole context'
    assert all_free(engine) and not engine.sequences


def test_overlapped_steps_give_the_same_tokens(gemma3):
    """Overlapped, a sequence gives back blocks that the step still in flight reads: they are written only by
    later steps."""
    prompts = random_prompts([70, 40, 55], seed=11)
    plain = run(make_engine(gemma3, max_batch_size=4, max_prefill_token_num=32), prompts, LONG)
    engine = make_engine(gemma3, max_batch_size=4, max_prefill_token_num=32, overlap_schedule=True)
    assert run(engine, prompts, LONG) == plain and all_free(engine)


def abort_mid_decode_frees_both_pools(engine, prompts: list[list[int]], gen: GenerationConfig, steps: int) -> None:
    """Starts ``prompts`` and aborts them after ``steps`` steps, once the first has given sliding-pool blocks back;
    every block of both pools comes back."""
    seq_ids = add_requests(engine, prompts, gen)
    for _ in range(steps):
        engine.step()
    seq = engine.sequences[seq_ids[0]]
    assert seq.window_block_ids[0] is None and held(seq.window_block_ids) < held(seq.block_ids)
    for seq_id in seq_ids:
        engine.abort(seq_id)
    while engine.has_unfinished():
        engine.step()
    assert all_free(engine) and not engine.sequences


def test_abort_mid_decode_gives_back_both_pools(gemma3):
    abort_mid_decode_frees_both_pools(make_engine(gemma3, max_batch_size=4), random_prompts([70, 90], seed=2), LONG,
                                      steps=20)


def test_prefix_cache_hits_give_the_uncached_tokens(family):
    """A prompt cached by an earlier request (its window blocks given back to the free list, still cached)
    is revived: the same tokens as without prefix caching."""
    kind, path = family
    first = random_prompts([100], seed=3)[0]
    prompts = [first[:80] + tail for tail in random_prompts([7, 20], seed=4)] + [first]
    plain = run(make_engine(path, enable_prefix_caching=False), prompts, LONG)
    engine = make_engine(path)
    run(engine, [first], LONG)
    assert run(engine, prompts, LONG) == plain
    assert engine.block_manager.num_hits >= 3 * (80 // BLOCK)
    assert all_free(engine)


def test_a_tiny_cache_preempts_and_recomputes_the_same_tokens(family):
    kind, path = family
    prompts = random_prompts([60, 75, 90, 50], seed=5)
    solo = [run(make_engine(path, enable_prefix_caching=False), [p], LONG)[0] for p in prompts]
    # every layer of Mistral slides: its one pool holds 3 blocks per decoding sequence and up to 5 per chunk
    engine = make_engine(path, num_gpu_blocks=8 if kind == 'mistral' else 16, max_prefill_token_num=32,
                         max_batch_size=4)
    assert run(engine, prompts, LONG) == solo
    assert engine.scheduler.num_preemptions > 0 and all_free(engine)


@pytest.mark.parametrize('quant_policy', [8, 4])
def test_quantized_caches_give_the_tokens_of_a_cache_that_keeps_every_block(gemma3, quant_policy, monkeypatch):
    prompts = random_prompts([70, 45], seed=6)
    released = run(make_engine(gemma3, quant_policy=quant_policy, max_prefill_token_num=32), prompts, LONG)
    monkeypatch.setattr(BlockPool, 'first_kept_block', lambda self, start, block_size: 0)
    kept = make_engine(gemma3, quant_policy=quant_policy, max_prefill_token_num=32)
    assert run(kept, prompts, LONG) == released


@pytest.mark.parametrize('kind', ['gemma3', 'llama4'])
def test_decode_graphs_read_the_sliding_pool(kind, request):
    """Gemma 3's sliding layers and Llama 4's chunked layers (window 16 both) read the second pool's column and
    table of the graphs' input buffer."""
    path = request.getfixturevalue(kind)
    prompts = random_prompts([40, 70, 25], seed=7)
    eager = run(make_engine(path, max_batch_size=4), prompts, LONG)
    engine = make_engine(path, max_batch_size=4, num_gpu_blocks=64, max_prefill_token_num=32)
    assert engine.runner.num_window_blocks == 10
    engine.runner.capture_graphs(4, -(-engine.session_len // BLOCK), RecordedGraph)
    assert collect(engine, add_requests(engine, prompts, LONG)) == eager
    assert sum(graph.replays for graph in engine.runner.graphs.graphs.values()) > 0
    window_k = engine.runner.kv_caches[0][0]
    assert window_k.shape[0] == engine.runner.num_window_blocks + 1
    assert window_k[engine.runner.window_scratch_block].abs().sum() > 0, 'padding rows write the scratch block'
    assert all_free(engine)


def test_native_stack_and_layers_agree(gemma3, native_gemms):
    """bf16 on native GEMM weights: the native decoder stack reads the sliding pool as the layers do."""
    prompts = random_prompts([50, 33], seed=8)
    engine = Engine(gemma3, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=32, block_size=BLOCK,
                                                max_prefill_token_num=32, max_batch_size=4), show_progress=False)
    assert engine.runner.model.native_stack is not None
    assert [pool.num_blocks for pool in engine.block_manager.pools] == [32, 10], 'block ids of one pool miss the other'
    outs = run(engine, prompts, LONG)
    engine.runner.model.native_stack = None
    assert run(engine, prompts, LONG) == outs


def test_logits_of_a_prompt_longer_than_the_sliding_pool(gemma3):
    """``get_logits`` prefills in chunks that give back the sliding pool's blocks between them: a prompt of
    more tokens than that pool holds gets transformers' logits at every position."""
    prompt = random_prompts([200], seed=10)[0]
    engine = make_engine(gemma3, max_batch_size=4, max_prefill_token_num=32)
    assert engine.block_manager.pools[1].num_blocks * BLOCK < len(prompt)
    logits = engine.get_logits(prompt)
    with torch.no_grad():
        expected = hf_causal_lm(gemma3)(torch.tensor([prompt])).logits[0]
    assert logits.shape == expected.shape and (logits - expected).abs().max().item() < 1e-3
    assert all_free(engine)


def test_tp2_equals_tp1(gemma3):
    assert_tp2_equals_tp1(gemma3, random_prompts([50, 20], seed=9))


def test_start_up_log_and_pool_sizes(gemma3, caplog):
    with caplog.at_level(logging.INFO, logger='lmdeploy'):
        engine = make_engine(gemma3, num_gpu_blocks=24, max_batch_size=4, max_prefill_token_num=32)
    full, sliding = engine.block_manager.pools
    assert (full.num_blocks, full.window, sliding.window) == (24, None, 16)
    assert sliding.num_blocks == window_pool_target(16, engine.config) == 4 * 2 + 2
    assert ('KV cache: 384 tokens (24 blocks of 16 for the full-attention layers, and 10 blocks for the '
            'sliding-window layers (window 16)') in caplog.text
    assert engine.session_len == 384


def test_pool_sizes_split_the_memory_of_every_layer():
    config = PytorchEngineConfig(block_size=16, max_batch_size=8, max_prefill_token_num=64)
    target = window_pool_target(32, config)
    assert target == 8 * 3 + 4
    windows = [32, 32, 32, 32, 32, None]
    full, window = kv_pool_sizes(windows, 1000, config)
    assert window == target and full == (6 * 1000 - 5 * target)
    assert full + 5 * window <= 6 * 1000
    assert kv_pool_sizes(windows, 20, config) == (20, 20), 'a small cache: the sliding pool never needs more'
    assert kv_pool_sizes([32, 32], 1000, config) == (1000, None), 'every layer slides: one pool'
    assert kv_pool_sizes([None, None], 1000, config) == (1000, None)
    explicit = PytorchEngineConfig(block_size=16, max_batch_size=8, max_prefill_token_num=64, num_gpu_blocks=100)
    assert kv_pool_sizes(windows, 100, explicit) == (100, target)


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), GenerationConfig(max_new_tokens=4))


def compute(bm: BlockManager, seq: Sequence, chunk: int) -> None:
    """Computes every token of ``seq`` in chunks, as the scheduler and the engine would."""
    while seq.num_computed < seq.num_tokens:
        bm.release_out_of_window(seq)
        end = min(seq.num_tokens, seq.num_computed + chunk)
        bm.allocate(seq, end)
        seq.num_computed = end
        bm.register_full_blocks(seq)


def test_block_manager_releases_out_of_window_and_revives_a_window():
    """Window 6 over blocks of 4: computing token p needs positions p - 5.. p, so blocks wholly before
    p - 5 go back; a cached prefix needs the blocks of its last 5 tokens in the sliding pool."""
    bm = BlockManager(32, 4, window=6, num_window_blocks=12)
    seq = seq_of(0, list(range(40)))
    compute(bm, seq, 4)
    assert len(seq.block_ids) == 10 and None not in seq.block_ids
    # the last chunk computed positions 36..39 from 36: it kept positions 31.. (blocks 7..9)
    assert seq.window_block_ids[:7] == [None] * 7 and None not in seq.window_block_ids[7:]
    assert bm.pools[1].num_free_blocks == 12 - 3
    bm.free_blocks(seq)
    assert bm.num_free_blocks == bm.num_blocks == 44

    same_start = seq_of(1, list(range(30)) + [99] * 5)
    match = bm.match_prefix(same_start)
    # 7 full blocks of the cached prompt (28 tokens); from 28 the window needs positions 23.. (blocks 5, 6)
    assert match.num_blocks == 7 and match.tables[1][:5] == [None] * 5 and None not in match.tables[1][5:]
    assert bm.can_allocate(bm.blocks_needed(same_start, 35, match), match)
    bm.allocate(same_start, 35, match)
    assert held(same_start.window_block_ids) == 2 + 2 and len(same_start.window_block_ids) == 9
    bm.free_blocks(same_start)

    for block_id in (b for b in range(12) if bm.pools[1].blocks[b].key == (20, 21, 22, 23)):
        bm.pools[1].blocks[block_id].key = ('evicted',)  # the window block of positions 20..23 is gone
    assert bm.match_prefix(seq_of(2, list(range(30)) + [99] * 5)).num_blocks == 5, \
        'blocks 5 and 6 no longer revive: the prefix ending at 20 needs blocks 3 and 4 (positions 15..19)'


def test_every_layer_sliding_uses_one_pool_that_releases():
    bm = BlockManager(8, 4, window=5)
    seq = seq_of(0, list(range(64)))
    compute(bm, seq, 4)
    assert len(seq.block_ids) == 16 and held(seq.block_ids) <= 3
    assert bm.token_capacity(max_chunk_tokens=4) is None, 'one sequence never outgrows the pool'
    assert BlockManager(2, 4, window=5).token_capacity(max_chunk_tokens=4) == 8
    assert BlockManager(8, 4).token_capacity(max_chunk_tokens=4) == 32
    bm.free_blocks(seq)
    assert bm.num_free_blocks == 8
