"""The torch mixture-of-experts path: routing and fused expert compute against a dense reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels.moe import fused_moe, moe_routing


def dense_reference(hidden, gate_up, down, weights, ids):
    """Every expert on every token, masked by the routing: slow but obviously right."""
    out = torch.zeros_like(hidden)
    for expert in range(gate_up.shape[0]):
        gate, up = F.linear(hidden, gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        w = (weights * (ids == expert)).sum(-1, keepdim=True).to(hidden.dtype)
        out += w * y
    return out


@pytest.mark.parametrize('top_k', [1, 2, 3])
@pytest.mark.parametrize('renormalize', [False, True])
def test_fused_moe_matches_dense(top_k, renormalize):
    g = torch.Generator().manual_seed(top_k)
    tokens, hidden_size, inter, experts = 37, 32, 24, 6
    hidden = torch.randn(tokens, hidden_size, generator=g)
    gate_up = torch.randn(experts, 2 * inter, hidden_size, generator=g) * 0.2
    down = torch.randn(experts, hidden_size, inter, generator=g) * 0.2
    weights, ids = moe_routing(torch.randn(tokens, experts, generator=g), top_k, renormalize)
    assert weights.dtype == torch.float32 and ids.shape == (tokens, top_k)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))
    torch.testing.assert_close(fused_moe(hidden, gate_up, down, weights, ids),
                               dense_reference(hidden, gate_up, down, weights, ids), rtol=1e-5, atol=1e-5)


def test_experts_without_tokens_never_run():
    hidden = torch.randn(5, 8)
    gate_up = torch.randn(3, 8, 8)
    down = torch.randn(3, 8, 4)
    gate_up[2] = float('nan')
    ids = torch.tensor([[0, 1]] * 5)
    weights = torch.full((5, 2), 0.5)
    assert torch.isfinite(fused_moe(hidden, gate_up, down, weights, ids)).all()
