"""The native CPU selective scan of Mamba-1 (kernels/cpu/mamba1.cpp) against its torch twin (kernels/mamba1.py):
a step's prefill and decode sequences on the rows of the fp32 state pool, the same bits wherever a prefill is split
and whether a token is prefilled or decoded, and its bad input refused."""
from __future__ import annotations

import pytest
import torch

from lmdeploy.pytorch import kernels
from lmdeploy.pytorch.kernels import cpu, mamba1

NUM_SLOTS = 8


def native_scan():
    module = cpu.mamba1_scan()
    if module is None:
        pytest.skip('the native Mamba-1 scan needs AVX-512')
    return module


def scan_inputs(tokens: int, channels: int, state_size: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``x, dt [T, D]`` (dt positive, as after its softplus), ``A [D, N]`` (negative), ``B, C [T, N]`` and a pool of
    states ``[NUM_SLOTS, D, N]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, channels, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(tokens, channels, generator=g))
    A = -torch.rand(channels, state_size, generator=g) * 4
    B, C = (torch.randn(tokens, state_size, generator=g) for _ in range(2))
    states = torch.randn(NUM_SLOTS, channels, state_size, generator=g) * 0.1
    return x, dt, A, B, C, states


# 16 state features (the hub's Mamba, Jamba and Falcon Mamba), 6 and 20 (partial vectors); channels across a
# partial block of 64
SHAPES = [(130, 16), (40, 6), (72, 20)]


@pytest.mark.parametrize('channels, state_size', SHAPES)
def test_step_matches_the_twin(channels, state_size):
    """Prefills of 70 and 5 tokens and three decode tokens, on rows out of order: outputs and states within fp32
    rounding of the twin's (whose exp is fp64's), the pool's other rows untouched."""
    native = native_scan()
    lengths, slots = torch.tensor([70, 5, 1, 1, 1]), torch.tensor([6, 0, 3, 7, 1])
    x, dt, A, B, C, states = scan_inputs(int(lengths.sum()), channels, state_size)
    expected_states = states.clone()
    expected = mamba1.mamba1_scan(x, dt, A, B, C, expected_states, slots, lengths)
    out = native.mamba1_scan(x, dt, A, B, C, states, slots, lengths)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states, rtol=1e-5, atol=1e-5)
    untouched = [2, 4, 5]
    assert torch.equal(states[untouched], scan_inputs(78, channels, state_size)[-1][untouched])
    assert kernels.mamba1_scan(x, dt, A, B, C, states.clone(), slots, lengths).equal(
        native.mamba1_scan(x, dt, A, B, C, states.clone(), slots, lengths))


def test_bits_do_not_depend_on_the_split_nor_on_decoding():
    """A sequence of 150 tokens in one segment, in two (cut at 67), and as 100 prefilled then 50 decoded beside
    another sequence: the same output bits and final state."""
    native = native_scan()
    x, dt, A, B, C, states = scan_inputs(150, 64, 16, seed=1)
    start = states[2].clone()

    def run(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pool = torch.zeros_like(states)
        pool[2] = start
        outs, row = [], 0
        for length in lengths:
            rows = slice(row, row + length)
            outs.append(native.mamba1_scan(x[rows], dt[rows], A, B[rows], C[rows], pool, torch.tensor([2]),
                                           torch.tensor([length])))
            row += length
        return torch.cat(outs), pool[2]

    whole, whole_state = run([150])
    for lengths in ([67, 83], [100] + [1] * 50):
        out, state = run(lengths)
        assert torch.equal(out, whole) and torch.equal(state, whole_state)
    other = scan_inputs(1, 64, 16, seed=2)
    pool = torch.zeros_like(states)
    pool[2] = start
    native.mamba1_scan(x[:100], dt[:100], A, B[:100], C[:100], pool, torch.tensor([2]), torch.tensor([100]))
    pool[5] = other[-1][5]
    beside = native.mamba1_scan(torch.cat([x[100:101], other[0]]), torch.cat([dt[100:101], other[1]]), A,
                                torch.cat([B[100:101], other[3]]), torch.cat([C[100:101], other[4]]), pool,
                                torch.tensor([2, 5]), torch.tensor([1, 1]))
    assert torch.equal(beside[0], whole[100])


def test_bad_input_is_refused():
    native = native_scan()
    x, dt, A, B, C, states = scan_inputs(4, 16, 16)
    for slots, lengths, match in [([1, 1], [2, 2], 'given twice'), ([1, 9], [2, 2], 'outside the pool'),
                                  ([1, 2], [2, 1], 'add up'), ([1], [2, 2], 'one length per slot')]:
        with pytest.raises(RuntimeError, match=match):
            native.mamba1_scan(x, dt, A, B, C, states, torch.tensor(slots), torch.tensor(lengths))
    with pytest.raises(RuntimeError, match='contiguous fp32'):
        native.mamba1_scan(x.bfloat16(), dt, A, B, C, states, torch.tensor([1]), torch.tensor([4]))
    with pytest.raises(ValueError, match='add up to 3'):
        mamba1.mamba1_scan(x, dt, A, B, C, states, torch.tensor([1, 2]), torch.tensor([2, 1]))
