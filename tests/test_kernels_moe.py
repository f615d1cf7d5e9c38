"""Triton fused MoE and routing against the torch twins (interpreter on CPU)."""
from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, DTYPES

from lmdeploy.pytorch.kernels import moe
from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
from lmdeploy.pytorch.kernels import cuda as triton_kernels
from lmdeploy.pytorch.kernels.cuda.fused_moe import MOE_CONFIGS, align_by_expert, fused_moe_with, moe_config

pytestmark = pytest.mark.triton
TOL = {torch.float32: 2e-3 if DEVICE == 'cuda' else 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def rand(*shape, dtype, seed=0, std=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std).to(DEVICE, dtype)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('top_k,renormalize', [(1, False), (2, True), (3, False)])
def test_moe_routing(dtype, top_k, renormalize):
    logits = rand(9, 6, dtype=dtype)
    weights, ids = triton_kernels.moe_routing(logits, top_k, renormalize)
    ref_weights, ref_ids = moe.moe_routing(logits.float(), top_k, renormalize)
    assert weights.dtype == torch.float32 and weights.shape == (9, top_k)
    assert torch.equal(ids.long(), ref_ids.long())
    torch.testing.assert_close(weights, ref_weights, atol=1e-5, rtol=1e-5)


def test_align_by_expert_groups_and_pads():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)
    slots, block_expert = align_by_expert(ids, num_experts=4, block_m=4)
    assert block_expert.tolist() == [0, 1, 2, 4, 4]  # capacity: 6 slots + 4 experts * 3 padding, rounded up
    groups = slots.view(5, 4).tolist()  # within an expert the order is free (atomics on CUDA)
    assert [sorted(g) for g in groups[:3]] == [[1, 4, 6, 6], [3, 6, 6, 6], [0, 2, 5, 6]] and groups[3:] == [[6] * 4] * 2


def expert_weights(num_experts: int, hidden_size: int, inter: int, dtype: torch.dtype):
    gate_up = rand(num_experts, 2 * inter, hidden_size, dtype=dtype, seed=2, std=0.1)
    return gate_up, rand(num_experts, hidden_size, inter, dtype=dtype, seed=3, std=0.1)


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('num_tokens,top_k', [(1, 2), (150, 4)])
def test_fused_moe(dtype, num_tokens, top_k):
    num_experts, hidden_size, inter = 8, 64, 48
    hidden = rand(num_tokens, hidden_size, dtype=dtype, seed=1)
    gate_up, down = expert_weights(num_experts, hidden_size, inter, dtype)
    weights, ids = moe.moe_routing(rand(num_tokens, num_experts, dtype=torch.float32, seed=4), top_k, True)
    out = triton_kernels.fused_moe(hidden, gate_up, down, weights, ids)
    ref = moe.fused_moe(hidden.float(), gate_up.float(), down.float(), weights, ids)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES[-1:])  # tile shapes; the dtypes go through test_fused_moe
@pytest.mark.parametrize('row', range(len(MOE_CONFIGS)))
def test_fused_moe_config_classes(dtype, row):
    """Every row of the tile table, forced on a small shape; K = 80 is no multiple of 64 (masked K)."""
    limit, config = MOE_CONFIGS[row]
    num_experts = 8
    assert moe_config(int(min(limit, 1000) * num_experts), num_experts) == config
    hidden = rand(45, 80, dtype=dtype, seed=1)
    gate_up, down = expert_weights(num_experts, 80, 40, dtype)
    weights, ids = moe.moe_routing(rand(45, num_experts, dtype=torch.float32, seed=5), 3, True)
    out = fused_moe_with(hidden, gate_up, down, weights, ids, config)
    ref = moe.fused_moe(hidden.float(), gate_up.float(), down.float(), weights, ids)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('num_tokens', [1, 70])
def test_fused_moe_biases_and_clamped_swiglu(dtype, num_tokens):
    """gpt-oss experts: both GEMMs biased, the clamped SwiGLU (its clamps bite at this scale); the smallest
    tile row and the default."""
    num_experts, hidden_size, inter = 4, 64, 32
    hidden = rand(num_tokens, hidden_size, dtype=dtype, seed=1, std=4.0)
    gate_up, down = expert_weights(num_experts, hidden_size, inter, dtype)
    gate_up_bias = rand(num_experts, 2 * inter, dtype=dtype, seed=6)
    down_bias = rand(num_experts, hidden_size, dtype=dtype, seed=7)
    weights, ids = moe.moe_routing(rand(num_tokens, num_experts, dtype=torch.float32, seed=8), 2, True)
    act = ClampedSwiGLU(1.702, 7.0)
    ref = moe.fused_moe(hidden.float(), gate_up.float(), down.float(), weights, ids, gate_up_bias.float(),
                        down_bias.float(), act)
    for out in (triton_kernels.fused_moe(hidden, gate_up, down, weights, ids, gate_up_bias, down_bias, act),
                fused_moe_with(hidden, gate_up, down, weights, ids, MOE_CONFIGS[0][1], gate_up_bias, down_bias, act)):
        torch.testing.assert_close(out.float(), ref, atol=4 * TOL[dtype], rtol=TOL[dtype])
