"""CPU time of one Mamba-1 layer's selective scan, native (``kernels/cpu/mamba1.cpp``, what the engine runs on an
AVX-512 CPU) and its torch twin (``kernels/mamba1.py``), against transformers' torch implementation of the same math (``mamba_selective_scan``'s sequential loop, ``mamba_selective_state_update``; Jamba's
module, which Mamba's and Falcon Mamba's equal), at a Jamba-Mini-sized shape (8192 inner channels, d_state 16): a
prefill of each of ``--prefill`` tokens of one sequence, and one decode token of each of ``--batches`` sequences
(on their rows of a pool of twice as many slots, as the engine runs it). One thread; the time is
the calling thread's CPU time (``time.thread_time``), the best and the median over rounds in which the implementations
alternate.

    python benchmark/mamba1.py [--prefill 256,1024] [--batches 1,16] [--rounds 5]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers.models.jamba.modeling_jamba import mamba_selective_scan, mamba_selective_state_update

from gated_delta import time_prefill_and_decode_cases

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.mamba1 import selective_decode, selective_scan

INNER, STATE = 8192, 16


def inputs(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    """``x, dt [batch, INNER, length]``, ``A [INNER, STATE]``, ``B, C [batch, STATE, length]`` (transformers'
    layout) and a state ``[batch, INNER, STATE]``."""
    g = torch.Generator().manual_seed(0)
    x, dt = (torch.randn(batch, INNER, length, generator=g) for _ in range(2))
    A = -torch.rand(INNER, STATE, generator=g) * 4
    B, C = (torch.randn(batch, STATE, length, generator=g) for _ in range(2))
    state = torch.randn(batch, INNER, STATE, generator=g) * 0.01
    return x, dt, A, B, C, state


def cases(args: argparse.Namespace) -> dict[str, dict]:
    """name -> {implementation: a no-argument call}."""
    native = cpu.mamba1_scan()
    if native is None:
        raise SystemExit('the native Mamba-1 scan needs AVX-512 (and the native kernels built)')
    found = {}
    for length in args.prefill:
        x, dt, A, B, C, _ = inputs(1, length)
        ours = (x[0].T.contiguous(), F.softplus(dt[0]).T.contiguous(), A, B[0].T.contiguous(), C[0].T.contiguous())
        found[f'prefill {length}'] = {
            'lmdeploy native': lambda t=ours, n=length: native.mamba1_scan(
                *t, torch.zeros(1, INNER, STATE), torch.tensor([0]), torch.tensor([n])),
            'lmdeploy torch': lambda t=ours: selective_scan(*t, None),
            'transformers': lambda t=(x, dt, A, B, C): mamba_selective_scan(
                *t, delta_softplus=True, return_last_state=True, use_associative_scan=False)}
    for batch in args.batches:
        x, dt, A, B, C, state = inputs(batch, 1)
        pool, slots = torch.cat((state, state)), torch.arange(0, 2 * batch, 2)
        step = (x[..., 0], F.softplus(dt[..., 0]), A, B[..., 0], C[..., 0], pool, slots)
        ours = [t.contiguous() for t in step[:5]]
        found[f'decode batch {batch}'] = {
            'lmdeploy native': lambda t=(*ours, pool, slots, torch.ones_like(slots)): native.mamba1_scan(*t),
            'lmdeploy torch': lambda step=step: selective_decode(*step),
            'transformers': lambda t=(state, x[..., 0], dt[..., 0], A, B[..., 0], C[..., 0]):
                mamba_selective_state_update(t[0].clone(), *t[1:], dt_softplus=True)}
    return found


if __name__ == '__main__':
    time_prefill_and_decode_cases(__doc__, cases)
