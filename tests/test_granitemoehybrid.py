"""Granite 4.0-H (``GraniteMoeHybridForCausalLM``: Mamba-2 layers between attention layers) against transformers on
tiny random models: the SSD scan and its recurrence against transformers' torch implementation, greedy tokens and
first-step logits in fp32 (experts with a shared MLP and rotary attention; a dense shared MLP without rotary),
every position's logits over chunked prefill, batching, chunked prefill and preemption equal to solo runs with the
recurrent-state slots given back, prefix caching turned off, tensor parallelism refused, the hub's
``mamba``/``attention`` layer names, and bf16 on the CPU."""
from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (mamba2_chunk_scan,
                                                                           mamba2_selective_state_update)

from conftest import VOCAB_SIZE, save_random_model
from family_checks import (assert_bf16_within_twice_transformers, assert_matches_transformers,
                           assert_prefix_caching_off_and_every_logit_matches, assert_slots_free, hf_causal_lm)
from helpers import make_engine, random_prompts, run

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.mamba2 import SSD_CHUNK, ssd_chunk_scan, ssd_decode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run as arrivals  # noqa: E402

SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, mamba_d_state=16, mamba_d_conv=4,
             mamba_expand=2, vocab_size=VOCAB_SIZE, max_position_embeddings=1024, embedding_multiplier=12.0,
             logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.0156, rms_norm_eps=1e-6,
             pad_token_id=None, architectures=['GraniteMoeHybridForCausalLM'])
VARIANTS = {
    # routed experts plus the shared MLP, rotary attention, two B/C groups over eight heads
    'moe': lambda: GraniteMoeHybridConfig(num_hidden_layers=4, layer_types=['mamba', 'attention', 'mamba', 'mamba'],
                                          intermediate_size=32, shared_intermediate_size=48, num_local_experts=4,
                                          num_experts_per_tok=2, mamba_n_heads=8, mamba_n_groups=2, mamba_d_head=16,
                                          position_embedding_type='rope', tie_word_embeddings=False, **SHAPE),
    # the shared MLP alone, attention without rotary positions (NoPE), one group, the LM head tied to the embeddings
    'dense': lambda: GraniteMoeHybridConfig(num_hidden_layers=3, layer_types=['mamba', 'mamba', 'attention'],
                                            shared_intermediate_size=80, num_local_experts=0, mamba_n_heads=4,
                                            mamba_n_groups=1, position_embedding_type='nope',
                                            tie_word_embeddings=True, **SHAPE),
}


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def granite_hybrid(request, tmp_path_factory) -> str:
    return save_random_model(VARIANTS[request.param](), str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope='module')
def granite_moe(tmp_path_factory) -> str:
    return save_random_model(VARIANTS['moe'](), str(tmp_path_factory.mktemp('granite_moe')))


def test_ssd_matches_transformers():
    """The chunked scan over two calls split at a chunk boundary (the state carried over; the bits of one call),
    then the one-token recurrence on a state pool's row, give transformers' scan over the whole sequence and its
    final state; transformers' own recurrence agrees as closely."""
    g = torch.Generator().manual_seed(0)
    length, split, heads, head_dim, groups, state_size = 150, 100, 4, 8, 2, 6
    x = torch.randn(1, length, heads, head_dim, generator=g)
    dt_raw, dt_bias = torch.randn(1, length, heads, generator=g), torch.randn(heads, generator=g)
    A = -3 * torch.rand(heads, generator=g)
    B, C = (torch.randn(1, length, groups, state_size, generator=g) for _ in range(2))
    initial = torch.randn(1, heads, head_dim, state_size, generator=g)
    expected, expected_state = mamba2_chunk_scan(x, dt_raw, A, B, C, chunk_size=32, dt_bias=dt_bias,
                                                 dt_softplus=True, initial_states=initial, return_final_states=True)
    dt = F.softplus(dt_raw + dt_bias)[0]
    x, B, C = x[0], B[0], C[0]
    whole, whole_state = ssd_chunk_scan(x, dt, A, B, C, initial[0])
    first, state = ssd_chunk_scan(x[:SSD_CHUNK], dt[:SSD_CHUNK], A, B[:SSD_CHUNK], C[:SSD_CHUNK], initial[0])
    rest, rest_state = ssd_chunk_scan(x[SSD_CHUNK:], dt[SSD_CHUNK:], A, B[SSD_CHUNK:], C[SSD_CHUNK:], state)
    assert torch.equal(whole, torch.cat([first, rest])) and torch.equal(whole_state, rest_state)
    head, state = ssd_chunk_scan(x[:split], dt[:split], A, B[:split], C[:split], initial[0])
    pool, slot = torch.zeros(3, heads, head_dim, state_size), torch.tensor([1])
    pool[1] = state
    tail = [ssd_decode(x[None, t], dt[None, t], A, B[None, t], C[None, t], pool, slot) for t in range(split, length)]
    torch.testing.assert_close(torch.cat([head, *tail]), expected[0], atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(pool[1], expected_state[0], atol=1e-5, rtol=1e-5)
    assert not pool[0].any() and not pool[2].any()
    state = initial.clone()
    steps = [mamba2_selective_state_update(state, x[None, t], dt_raw[:, t, :, None].expand(-1, -1, head_dim),
                                           A[:, None, None].expand(-1, head_dim, state_size), B[None, t], C[None, t],
                                           dt_bias=dt_bias[:, None].expand(-1, head_dim), dt_softplus=True)
             for t in range(length)]
    torch.testing.assert_close(torch.cat(steps), whole, atol=2e-4, rtol=1e-5)


def test_greedy_and_first_logits_match_transformers(granite_hybrid):
    assert_matches_transformers(granite_hybrid, hf_causal_lm(granite_hybrid), random_prompts([3, 17, 70, 150]),
                                random_prompts([5, 33, 100], seed=1))


@pytest.mark.slow
def test_batched_chunked_and_preempted_equal_solo(granite_moe):
    """The states carry over between prefill chunks (of 16 tokens, and of 7: chunks that end inside the
    convolution's window) and a preempted sequence recomputes them from zero (on the MoE variant: the dense one
    has the same Mamba layers)."""
    prompts = random_prompts([70, 100, 20, 45], seed=3)
    plain = run(make_engine(granite_moe), prompts)
    assert [run(make_engine(granite_moe), [p])[0] for p in prompts] == plain
    for chunk, block_size in ((16, 16), (7, 4)):
        engine = make_engine(granite_moe, max_prefill_token_num=chunk, block_size=block_size, max_batch_size=4)
        assert run(engine, prompts) == plain
        assert_slots_free(engine)
    tight = make_engine(granite_moe, num_gpu_blocks=14)
    assert run(tight, prompts) == plain
    assert tight.scheduler.num_preemptions > 0
    assert_slots_free(tight)


def test_fp32_is_batch_invariant(granite_moe, native):
    """fp32 tokens and logprobs bitwise: prompts of up to 200 tokens in prefill chunks of at most 100 (cut on the
    scan's chunks), alone and arriving one a step beside the others' decode rows. The Mamba layers' element-wise ops
    over the step's rows (dt's softplus, the gated norm's SiLU, the convolution's SiLU and the decay of decode rows)
    run ``placeless``."""
    if cpu.fp32_gemm() is None:
        pytest.skip('the native fp32 GEMM needs AVX-512')
    engine = Engine(granite_moe, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16,
                                                     max_batch_size=4, max_prefill_token_num=100), show_progress=False)
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True, logprobs=3)
    prompts = random_prompts([2, 9, 40, 140, 200], seed=11)
    alone = [arrivals(engine, [prompt], config, 0)[0] for prompt in prompts]
    assert arrivals(engine, prompts, config, 0) == alone  # prefills together, then decode steps of all rows
    assert arrivals(engine, prompts, config, 1) == alone


def test_mamba_decode_rows_do_not_depend_on_their_place(granite_moe, native):
    """A Mamba layer's decode rows (fp32, packed native GEMMs) give the same bits among 3 or 5 rows as alone: the
    element-wise ops over the step's rows run ``placeless`` (torch's fp32 softplus and SiLU took a tensor's last
    elements on another path: rows of 8 heads differed)."""
    if cpu.fp32_gemm() is None:
        pytest.skip('the native fp32 GEMM needs AVX-512')
    engine = Engine(granite_moe, PytorchEngineConfig(dtype='float32', num_gpu_blocks=16, block_size=16,
                                                     max_batch_size=8), show_progress=False)
    mixer, pools = engine.runner.model.layers[0].mamba, engine.runner.kv_caches[0]
    g = torch.Generator().manual_seed(0)
    for pool in pools:
        pool.copy_(torch.randn(pool.shape, generator=g))
    hidden = torch.randn(5, 64, generator=g)

    def decode(rows: list[int]) -> tuple[torch.Tensor, ...]:
        states = tuple(pool.clone() for pool in pools)
        ctx = SimpleNamespace(state_prefill=[], num_prefill_tokens=0, state_decode_slots=torch.tensor(rows))
        return mixer(hidden[rows], states, ctx), *(state[rows] for state in states)

    for rows in ([0, 1, 2], [0, 1, 2, 3, 4]):
        together = decode(rows)
        for i, row in enumerate(rows):
            alone = decode([row])
            assert all(torch.equal(a[0], t[i]) for a, t in zip(alone, together))


def test_get_logits_and_prefix_caching_off(granite_moe, caplog):
    """Every position's logits equal transformers' (computed in chunks of 16, the states carried over); the Mamba
    layers take recurrent-state slots, not KV blocks; prefix caching, asked for, is off and says why."""
    engine = assert_prefix_caching_off_and_every_logit_matches(granite_moe, caplog)
    assert engine.runner.cfg.num_state_layers == 3 and engine.scheduler.recurrent_grain > 0


def test_tensor_parallelism_is_refused(granite_moe):
    with pytest.raises(ValueError, match='Mamba-2 layers are not sharded for tensor parallelism; use tp=1'):
        make_engine(granite_moe, tp=2)


def test_hub_layer_names(granite_moe, tmp_path):
    """The hub's configs name the layers ``mamba`` and ``attention`` (transformers 5 reads them as
    ``linear_attention`` and ``full_attention``): the same model, the same tokens."""
    hub = tmp_path / 'hub'
    hub.mkdir()
    for name in os.listdir(granite_moe):
        (hub / name).symlink_to(os.path.join(granite_moe, name))
    config = json.loads((hub / 'config.json').read_text())
    config['layer_types'] = ['mamba', 'attention', 'mamba', 'mamba']
    (hub / 'config.json').unlink()
    (hub / 'config.json').write_text(json.dumps(config))
    prompts = random_prompts([9, 70], seed=4)
    assert run(make_engine(str(hub)), prompts) == run(make_engine(granite_moe), prompts)


def test_bf16_close_to_transformers(granite_moe):
    """bf16 on the CPU (packed GEMM weights): the last logits differ from transformers' in fp32 by at most twice
    what transformers' own bf16 model does."""
    assert_bf16_within_twice_transformers(granite_moe)
