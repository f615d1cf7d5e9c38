"""A preempted sequence's outputs keep their bits: evicted for lack of KV blocks, it computes its prompt again in
prefill chunks and the tokens it generated one a step as decode rows, each token's row on the kernels it ran first.
Before, the generated tokens were recomputed as prefill rows, whose kernels part from the decode rows' on gpt-oss's
MXFP4 experts in bf16 (the GEMV against the dequantized GEMM) and on Qwen3.5's linear attention (the delta rule's
recurrent step against its chunked form). Tiny random models: greedy tokens and logprobs, bitwise, of prompts run in
a cache too small for all of them against each alone in a roomy one."""
from __future__ import annotations

import os
import sys

import pytest
from conftest import save_random_model
from helpers import random_prompts
from test_gpt_oss import save_gpt_oss, save_mxfp4
from test_qwen3_next import VARIANTS

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.sequence import Sequence
from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.scheduler import Scheduler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
from batch_invariance import run  # noqa: E402

GEN = GenerationConfig(max_new_tokens=24, ignore_eos=True, logprobs=3)


def assert_preemption_invariant(path: str, dtype: str, prompts: list[list[int]], num_blocks: int) -> Engine:
    """Each prompt alone in a roomy cache, then all together in ``num_blocks`` blocks of 8 (preempting some):
    equal tokens and logprobs; returns the tight engine."""
    config = dict(dtype=dtype, block_size=8, enable_prefix_caching=False)
    roomy = Engine(path, PytorchEngineConfig(num_gpu_blocks=256, **config), show_progress=False)
    alone = [run(roomy, [prompt], GEN, 0)[0] for prompt in prompts]
    tight = Engine(path, PytorchEngineConfig(num_gpu_blocks=num_blocks, **config), show_progress=False)
    assert run(tight, prompts, GEN, 0) == alone
    assert tight.scheduler.num_preemptions > 0
    return tight


@pytest.fixture(scope='module')
def gpt_oss_mxfp4(tmp_path_factory) -> str:
    dense = save_gpt_oss(str(tmp_path_factory.mktemp('gpt_oss_dense')))
    return save_mxfp4(dense, str(tmp_path_factory.mktemp('gpt_oss_mxfp4') / 'model'))


def test_preempted_mxfp4_experts_keep_their_bits(gpt_oss_mxfp4):
    """gpt-oss with MXFP4 experts in bf16: decode rows on the MXFP4 GEMV, prefill rows on the dequantized weight
    (2 of 9 prompts' tokens parted from their runs alone, at their 21st token, when recomputed as prefill rows)."""
    if cpu.mxfp4_gemv() is None:
        pytest.skip('the native MXFP4 GEMV is not built')
    assert_preemption_invariant(gpt_oss_mxfp4, 'bfloat16', random_prompts([5 + 4 * i for i in range(9)], seed=3), 20)


@pytest.fixture(scope='module')
def qwen3_5(tmp_path_factory) -> str:
    return save_random_model(VARIANTS['qwen3_5'](), str(tmp_path_factory.mktemp('qwen3_5')))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_preempted_linear_attention_keeps_its_bits(qwen3_5, dtype):
    """Qwen3.5: the recurrent state of a preempted sequence computed again, its prompt by the chunked delta rule
    and its generated tokens by the recurrent step, as they first were; prompts past the delta rule's 64-token
    chunk."""
    assert_preemption_invariant(qwen3_5, dtype, random_prompts([20, 45, 70, 100, 130], seed=3), 30)


def test_a_prompts_last_token_alone_is_a_prefill_row():
    """A chunk that leaves a prompt's last token alone in a step feeds it as a prefill row, as the prompt's other
    tokens and its run alone (it was a decode row: on the GEMVs where the run alone took the prefill kernels); a
    preempted sequence's generated tokens come back one a step as decode rows, sampled at the last only."""
    scheduler = Scheduler(BlockManager(16, 4), max_batch_size=4, max_prefill_token_num=8)
    seq = Sequence(0, list(range(9)), GenerationConfig(max_new_tokens=4))
    scheduler.add(seq)
    assert [item.num_tokens for item in scheduler.schedule().prefill] == [8]
    seq.num_computed = 8
    plan = scheduler.schedule()
    assert [(item.seq, item.num_tokens) for item in plan.prefill] == [(seq, 1)] and not plan.decode
    seq.num_computed, seq.output_ids = 9, [100, 101, 102]
    scheduler._preempt(scheduler.running.pop())
    steps = []
    for _ in range(5):
        plan = scheduler.schedule()
        steps.append(([item.num_tokens for item in plan.prefill],
                      [(item.num_tokens, item.samples) for item in plan.decode]))
        for item in plan.prefill + plan.decode:
            item.seq.num_computed += item.num_tokens
    assert steps == [([8], []), ([1], []), ([], [(1, False)]), ([], [(1, False)]), ([], [(1, True)])]
