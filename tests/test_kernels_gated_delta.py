"""The Triton decode step of the gated delta rule against its torch twin (interpreter on CPU): each sequence's
output, its row of the state pool updated in place, the other rows untouched; with a decay per head (Gated DeltaNet)
and per key feature (Kimi-Linear's KDA)."""
from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, DTYPES

from lmdeploy.pytorch.kernels import cuda as triton_kernels
from lmdeploy.pytorch.kernels import gated_delta

pytestmark = pytest.mark.triton


@pytest.mark.parametrize('per_feature', [False, True])
@pytest.mark.parametrize('dtype', DTYPES)
@pytest.mark.parametrize('key_heads, heads, k_dim, v_dim', [(2, 4, 8, 12), (1, 3, 24, 40)])
def test_gated_delta_decode(dtype, key_heads, heads, k_dim, v_dim, per_feature):
    """Two key heads serving four value heads (and one serving three), feature counts that are not powers of two,
    and a value dimension split over two programs."""
    g = torch.Generator().manual_seed(k_dim)
    batch, num_slots = 3, 5
    q, k = (torch.randn(batch, key_heads, k_dim, generator=g).to(DEVICE, dtype) for _ in range(2))
    v = torch.randn(batch, heads, v_dim, generator=g).to(DEVICE, dtype)
    decay = -torch.rand(batch, heads, *([k_dim] if per_feature else []), generator=g).to(DEVICE)
    beta = torch.rand(batch, heads, generator=g).to(DEVICE, dtype)
    states = torch.randn(num_slots, heads, k_dim, v_dim, generator=g).to(DEVICE) * 0.1
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    expected_states = states.clone()
    expected = gated_delta.gated_delta_decode(q, k, v, decay, beta, expected_states, slots)
    out = triton_kernels.gated_delta_decode(q, k, v, decay, beta, states, slots)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(states, expected_states, atol=1e-4, rtol=1e-4)
    untouched = torch.tensor([1, 3], device=DEVICE)
    assert torch.equal(states[untouched], expected_states[untouched])
