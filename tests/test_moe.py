"""The torch mixture-of-experts path: routing and fused expert compute against a dense reference."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
from lmdeploy.pytorch.kernels.moe import fused_moe, moe_routing


def dense_reference(hidden, gate_up, down, weights, ids, gate_up_bias=None, down_bias=None, swiglu=None):
    """Every expert on every token, masked by the routing: slow but obviously right. ``swiglu``: the
    clamped SwiGLU's ``(alpha, limit)`` instead of SiLU-and-mul."""
    out = torch.zeros_like(hidden)
    for expert in range(gate_up.shape[0]):
        bias = None if gate_up_bias is None else gate_up_bias[expert]
        gate, up = F.linear(hidden, gate_up[expert], bias).chunk(2, dim=-1)
        if swiglu is None:
            act = F.silu(gate) * up
        else:
            alpha, limit = swiglu
            gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            act = (up + 1) * gate * torch.sigmoid(alpha * gate)
        y = F.linear(act, down[expert], None if down_bias is None else down_bias[expert])
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


def test_fused_moe_with_biases_and_clamped_swiglu():
    """gpt-oss experts: biases on both GEMMs (the down bias weighted with its route) and the clamped SwiGLU,
    with activations large enough that both clamps bite."""
    g = torch.Generator().manual_seed(7)
    tokens, hidden_size, inter, experts = 29, 32, 24, 5
    hidden = torch.randn(tokens, hidden_size, generator=g) * 3
    gate_up = torch.randn(experts, 2 * inter, hidden_size, generator=g)
    down = torch.randn(experts, hidden_size, inter, generator=g) * 0.2
    gate_up_bias = torch.randn(experts, 2 * inter, generator=g)
    down_bias = torch.randn(experts, hidden_size, generator=g)
    weights, ids = moe_routing(torch.randn(tokens, experts, generator=g), 2, True)
    act = ClampedSwiGLU(alpha=1.702, limit=7.0)
    pre = torch.einsum('th,eih->tei', hidden, gate_up) + gate_up_bias
    assert (pre[..., :inter] > 7).any() and (pre[..., inter:].abs() > 7).any()
    out = fused_moe(hidden, gate_up, down, weights, ids, gate_up_bias, down_bias, act)
    ref = dense_reference(hidden, gate_up, down, weights, ids, gate_up_bias, down_bias, (1.702, 7.0))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
