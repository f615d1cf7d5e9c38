"""CPU time of one Mamba-2 layer's selective state space (``kernels/mamba2.py``) against transformers' torch
implementation of the same math (``mamba2_chunk_scan`` at the checkpoints' ``mamba_chunk_size`` of 256,
``mamba2_selective_state_update``), at a Granite 4.0-H-Tiny-sized shape (48 heads of 64, one B/C group, d_state
128): a prefill of each of ``--prefill`` tokens of one sequence (the chunked scan; also the one-token recurrence run
over every token, the quadratic-free reference a scan must beat), and one decode token of each of ``--batches``
sequences (``ssd_decode`` on its rows of a pool of twice as many slots, as the engine runs it). One thread; the time
is the calling thread's CPU time (``time.thread_time``), the best and the median over rounds in which the
implementations alternate.

    python benchmark/mamba2.py [--prefill 256,1024] [--batches 1,16] [--rounds 5]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (mamba2_chunk_scan,
                                                                           mamba2_selective_state_update)

from gated_delta import time_prefill_and_decode_cases

from lmdeploy.pytorch.kernels.mamba2 import ssd_chunk_scan, ssd_decode

HEADS, HEAD_DIM, GROUPS, STATE, HF_CHUNK = 48, 64, 1, 128, 256


def inputs(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, length, HEADS, HEAD_DIM, generator=g)
    dt = torch.randn(batch, length, HEADS, generator=g)
    A = -torch.rand(HEADS, generator=g) * 4
    B, C = (torch.randn(batch, length, GROUPS, STATE, generator=g) for _ in range(2))
    state = torch.randn(batch, HEADS, HEAD_DIM, STATE, generator=g) * 0.01
    return x, dt, A, B, C, state


def recurrence(x, dt, A, B, C, state) -> torch.Tensor:
    """The one-token recurrence over every token of one sequence."""
    pool, slot = state[None].clone(), torch.tensor([0])
    return torch.cat([ssd_decode(x[t:t + 1], dt[t:t + 1], A, B[t:t + 1], C[t:t + 1], pool, slot)
                      for t in range(x.shape[0])])


def cases(args: argparse.Namespace) -> dict[str, dict]:
    """name -> {implementation: a no-argument call}."""
    found = {}
    for length in args.prefill:
        x, dt, A, B, C, state = inputs(1, length)
        soft = F.softplus(dt)
        found[f'prefill {length}'] = {
            'lmdeploy scan': lambda t=(x[0], soft[0], A, B[0], C[0], state[0]): ssd_chunk_scan(*t),
            'transformers scan': lambda t=(x, dt, A, B, C, state): mamba2_chunk_scan(
                *t[:5], chunk_size=HF_CHUNK, dt_softplus=True, initial_states=t[5], return_final_states=True),
            'recurrence per token': lambda t=(x[0], soft[0], A, B[0], C[0], state[0]): recurrence(*t)}
    for batch in args.batches:
        x, dt, A, B, C, state = inputs(batch, 1)
        pool, slots = torch.cat((state, state)), torch.arange(0, 2 * batch, 2)
        step = (x[:, 0], F.softplus(dt[:, 0]), A, B[:, 0], C[:, 0], pool, slots)
        expanded = (dt[:, 0, :, None].expand(-1, -1, HEAD_DIM), A[:, None, None].expand(-1, HEAD_DIM, STATE))
        found[f'decode batch {batch}'] = {
            'lmdeploy': lambda step=step: ssd_decode(*step),
            'transformers': lambda t=(state, x[:, 0], *expanded, B[:, 0], C[:, 0]): mamba2_selective_state_update(
                t[0].clone(), *t[1:], dt_softplus=True)}
    return found


if __name__ == '__main__':
    time_prefill_and_decode_cases(__doc__, cases)
