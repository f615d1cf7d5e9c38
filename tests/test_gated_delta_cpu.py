"""The native CPU decode step of Gated DeltaNet (kernels/cpu/gated_delta.cpp) against its torch twins: the gated
delta rule on the rows of the fp32 state pool, and the one-token causal convolution before it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lmdeploy.pytorch import kernels
from lmdeploy.pytorch.kernels import cpu, gated_delta

NUM_SLOTS = 7


def native_delta():
    module = cpu.gated_delta()
    if module is None:
        pytest.skip('the native gated delta rule needs AVX-512')
    return module


def decode_inputs(batch: int, key_heads: int, heads: int, k_dim: int, v_dim: int, dtype: torch.dtype = torch.float32,
                  per_feature: bool = False):
    g = torch.Generator().manual_seed(batch * 1000 + heads * 10 + v_dim)
    q, k = (torch.randn(batch, key_heads, k_dim, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(batch, heads, v_dim, generator=g).to(dtype)
    decay = -torch.rand(batch, heads, *([k_dim] if per_feature else []), generator=g) * 2
    beta = torch.rand(batch, heads, generator=g).to(dtype)
    states = torch.randn(NUM_SLOTS, heads, k_dim, v_dim, generator=g) * 0.1
    slots = torch.tensor([5, 0, 3, 6, 1, 4, 2][:batch])  # out of order, some rows left out
    return q, k, v, decay, beta, states, slots


# Two key heads serving two value heads each (Qwen3-Next's grouping), one serving three, Dv on several tiles with a
# partial last vector (160 = 128 + 32, 24 = 16 + 8), Dk not a multiple of 16.
SHAPES = [(2, 4, 16, 16), (1, 3, 24, 24), (2, 4, 40, 160)]


@pytest.mark.parametrize('per_feature', [False, True])
@pytest.mark.parametrize('batch', [1, 3, 7])
@pytest.mark.parametrize('key_heads, heads, k_dim, v_dim', SHAPES)
def test_native_decode_matches_torch(batch, key_heads, heads, k_dim, v_dim, per_feature):
    """Each sequence's output and its pool row updated in place equal the torch twin's to fp32 rounding (the order of
    the sums differs: at most 3e-8 seen on outputs of order 0.1, 2e-7 on state entries of order 1); the rows of no
    sequence stay bit for bit. ``per_feature``: a decay per key feature (``g [B, H, Dk]``, Kimi-Linear's KDA)."""
    q, k, v, decay, beta, states, slots = decode_inputs(batch, key_heads, heads, k_dim, v_dim,
                                                        per_feature=per_feature)
    expected_states = states.clone()
    expected = gated_delta.gated_delta_decode(q, k, v, decay, beta, expected_states, slots)
    out = native_delta().gated_delta_decode(q, k, v, decay, beta, states, slots)
    assert out.dtype == torch.float32 and out.shape == (batch, heads, v_dim)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(states, expected_states, atol=1e-6, rtol=1e-5)
    untouched = [row for row in range(NUM_SLOTS) if row not in slots.tolist()]
    assert torch.equal(states[untouched], expected_states[untouched])


def test_native_decode_takes_bf16_and_strided_inputs():
    """The engine hands over q, k and v as column slices of one projection (and bf16 in a bf16 model): each read
    as it is, widened to fp32 like the torch twin does."""
    q, k, v, decay, beta, states, slots = decode_inputs(3, 2, 4, 16, 24, torch.bfloat16)
    mixed = torch.cat((q.flatten(1), k.flatten(1), v.flatten(1)), dim=-1)
    q, k, v = (part.unflatten(-1, shape) for part, shape in zip(mixed.split([32, 32, 96], dim=-1),
                                                                ((2, 16), (2, 16), (4, 24))))
    assert not q.is_contiguous()
    expected_states = states.clone()
    expected = gated_delta.gated_delta_decode(q, k, v, decay, beta, expected_states, slots)
    out = native_delta().gated_delta_decode(q, k, v, decay, beta, states, slots)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, expected_states, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize('broken', ['no decay', 'no beta', 'state not read', 'key heads swapped'])
def test_a_dropped_term_is_caught(broken):
    """The comparison above can fail: the torch twin with the decay or beta left out, the old state not read, or
    the value heads served by the other key head, lands far from the native output."""
    q, k, v, decay, beta, states, slots = decode_inputs(3, 2, 4, 16, 24)
    native_states = states.clone()
    out = native_delta().gated_delta_decode(q, k, v, decay, beta, native_states, slots)
    if broken == 'no decay':
        decay = torch.zeros_like(decay)
    elif broken == 'no beta':
        beta = torch.ones_like(beta)
    elif broken == 'state not read':
        states.zero_()
    else:
        q, k = q.flip(1), k.flip(1)
    wrong = gated_delta.gated_delta_decode(q, k, v, decay, beta, states, slots)
    # a hundred times the tolerance of the comparison above (out is of order 0.05 here)
    assert (out - wrong).abs().max() > 1e-3
    assert (native_states[slots] - states[slots]).abs().max() > 1e-3


def test_engine_dispatch_runs_native_and_falls_back(monkeypatch):
    """``kernels.gated_delta_decode`` on CPU tensors takes the native kernel where it was built, the torch twin
    otherwise (no AVX-512, no compiler, ``LMDEPLOY_CPU_KERNELS=0``)."""
    native = native_delta()
    calls = []

    def spy(*args):
        calls.append(len(args))
        return native.gated_delta_decode(*args)

    monkeypatch.setattr(cpu, 'gated_delta', lambda: SimpleNamespace(gated_delta_decode=spy))
    inputs = decode_inputs(2, 2, 4, 16, 16)
    expected_states = inputs[5].clone()
    expected = gated_delta.gated_delta_decode(*inputs[:5], expected_states, inputs[6])
    torch.testing.assert_close(kernels.gated_delta_decode(*inputs), expected, atol=1e-5, rtol=1e-5)
    assert calls == [7]
    monkeypatch.setattr(cpu, 'gated_delta', lambda: None)
    assert torch.equal(kernels.gated_delta_decode(*inputs[:5], expected_states.clone(), inputs[6]),
                       gated_delta.gated_delta_decode(*inputs[:5], expected_states.clone(), inputs[6]))
    assert calls == [7]


@pytest.mark.parametrize('bad, message', [
    (dict(slots=torch.tensor([7, 0, 1])), 'outside the pool'),
    (dict(slots=torch.tensor([2, 0, 2])), 'two sequences'),
    (dict(slots=torch.tensor([0.0, 1.0, 2.0])), 'integer'),
    (dict(states=torch.zeros(NUM_SLOTS, 4, 16, 24, dtype=torch.bfloat16)), 'fp32'),
    (dict(states=torch.zeros(NUM_SLOTS, 4, 24, 16).transpose(-1, -2)), 'contiguous'),
    (dict(g=torch.zeros(3, 3)), r'g: \[B, H\] or \[B, H, Dk\]'),
    (dict(g=torch.zeros(3, 4, 15)), r'g: \[B, H\] or \[B, H, Dk\]'),
    (dict(k=torch.zeros(3, 2, 8)), 'q and k'),
])
def test_native_decode_refuses_bad_input(bad, message):
    """A slot outside the pool or given twice (two tasks would race on one row), a state pool of another dtype or
    layout, mismatched shapes: a clear error, and no row changed."""
    names = ['q', 'k', 'v', 'g', 'beta', 'states', 'slots']
    inputs = dict(zip(names, decode_inputs(3, 2, 4, 16, 24)))
    inputs.update(bad)
    before = inputs['states'].clone()
    with pytest.raises(RuntimeError, match=message):
        native_delta().gated_delta_decode(*inputs.values())
    assert torch.equal(inputs['states'], before)


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('taps', [4, 2])
def test_native_conv1d_decode_matches_torch(dtype, taps):
    """One input per sequence through the depthwise causal convolution and SiLU, shifted into the sequence's row of
    the state pool in place: the output to fp32 rounding (bf16: one rounding of the fp32 sum), the pool rows exactly."""
    module = cpu.native()
    if module is None:
        pytest.skip('the native CPU kernels are not built')
    g = torch.Generator().manual_seed(taps)
    batch, channels = 3, 40
    x = torch.randn(batch, channels, generator=g).to(dtype)
    weight = (torch.randn(channels, taps, generator=g) * 0.5).to(dtype)
    states = torch.randn(NUM_SLOTS, channels, taps - 1, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 6])
    expected_states = states.clone()
    expected = gated_delta.causal_conv1d_decode(x, expected_states, slots, weight)
    out = module.causal_conv1d_decode(x, states, slots, weight)
    assert out.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(states, expected_states)
    assert torch.equal(states[slots, :, -1], x)
