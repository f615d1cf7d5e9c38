"""CPU time of one Gated DeltaNet layer's delta rule (``kernels/gated_delta.py``) against transformers' torch
implementation of the same math, at Qwen3-Next-80B-A3B's linear-attention shape (16 key heads and 32 value heads
of 128 features): a prefill of ``--prefill`` tokens of one sequence (the chunked rule), and one decode token of
each of ``--batches`` sequences (the recurrence as the engine runs it, ``gated_delta_decode`` on its rows of a
pool of twice as many slots: the native kernel of ``kernels/cpu/gated_delta.cpp`` where it was built, and the torch
twin), and the decode step's causal convolution (its 8192 channels, 4 taps; native and torch, bf16 as the
checkpoints). One thread; the time is the calling thread's CPU time (``time.thread_time``), the best and the median
over rounds in which the implementations alternate.

    python benchmark/gated_delta.py [--prefill 1024] [--batches 1,16] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (torch_chunk_gated_delta_rule,
                                                                torch_recurrent_gated_delta_rule)

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.gated_delta import causal_conv1d_decode, chunk_gated_delta_rule, gated_delta_decode

KEY_HEADS, VALUE_HEADS, DIM, TAPS = 16, 32, 128, 4
CONV_CHANNELS = (2 * KEY_HEADS + VALUE_HEADS) * DIM


def inputs(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(batch, length, KEY_HEADS, DIM, generator=g) for _ in range(2))
    v = torch.randn(batch, length, VALUE_HEADS, DIM, generator=g)
    decay = -torch.rand(batch, length, VALUE_HEADS, generator=g)
    beta = torch.rand(batch, length, VALUE_HEADS, generator=g)
    state = torch.randn(batch, VALUE_HEADS, DIM, DIM, generator=g) * 0.01
    return q, k, v, decay, beta, state


def cases(args: argparse.Namespace) -> dict[str, dict]:
    """name -> {implementation: a no-argument call}."""
    q, k, v, decay, beta, state = inputs(1, args.prefill)
    found = {f'prefill {args.prefill}': {
        'lmdeploy': lambda: chunk_gated_delta_rule(q[0], k[0], v[0], decay[0], beta[0], state[0]),
        'transformers': lambda: torch_chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=state,
                                                             output_final_state=True, use_qk_l2norm_in_kernel=True)}}
    native = cpu.gated_delta()
    for batch in args.batches:
        bq, bk, bv, bd, bb, bs = inputs(batch, 1)
        pool, slots = torch.cat((bs, bs)), torch.arange(0, 2 * batch, 2)
        step = (bq[:, 0], bk[:, 0], bv[:, 0], bd[:, 0], bb[:, 0], pool, slots)
        found[f'decode batch {batch}'] = {
            **({'lmdeploy native': lambda step=step: native.gated_delta_decode(*step)} if native else {}),
            'lmdeploy torch': lambda step=step: gated_delta_decode(*step),
            'transformers': lambda t=(bq, bk, bv, bd, bb, bs): torch_recurrent_gated_delta_rule(
                *t[:5], initial_state=t[5], output_final_state=True, use_qk_l2norm_in_kernel=True)}
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, CONV_CHANNELS, generator=g).bfloat16()
        weight = torch.randn(CONV_CHANNELS, TAPS, generator=g).bfloat16()
        conv_pool = torch.randn(2 * batch, CONV_CHANNELS, TAPS - 1, generator=g).bfloat16()
        conv = (x, conv_pool, slots, weight)
        found[f'conv1d decode batch {batch}'] = {
            **({'lmdeploy native': lambda conv=conv: cpu.native().causal_conv1d_decode(*conv)} if native else {}),
            'lmdeploy torch': lambda conv=conv: causal_conv1d_decode(*conv)}
    return found


def cpu_ms(call) -> float:
    start = time.thread_time()
    call()
    return (time.thread_time() - start) * 1e3


def time_cases(found: dict[str, dict[str, Callable[[], object]]], rounds: int) -> None:
    """Each case's implementations on one thread, warmed up, then ``rounds`` rounds in which they alternate; one
    JSON line a case with each one's best and median thread CPU time."""
    torch.set_num_threads(1)
    with torch.inference_mode():
        for name, calls in found.items():
            for call in calls.values():  # warm-up
                call()
            times: dict[str, list[float]] = {who: [] for who in calls}
            for _ in range(rounds):
                for who, call in calls.items():
                    times[who].append(cpu_ms(call))
            print(json.dumps({'case': name, **{who: {'best_ms': round(min(t), 2),
                                                     'median_ms': round(statistics.median(t), 2)}
                                               for who, t in times.items()}}))


def time_prefill_and_decode_cases(doc: str, cases_of: Callable[[argparse.Namespace], dict]) -> None:
    """The command line of the state-space scans' benchmarks (``mamba1.py``, ``mamba2.py``): prefill lengths,
    decode batches and rounds, then :func:`time_cases` over ``cases_of(args)``."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(b) for b in s.split(',')]  # noqa: E731
    parser.add_argument('--prefill', type=ints, default=[256, 1024])
    parser.add_argument('--batches', type=ints, default=[1, 16])
    parser.add_argument('--rounds', type=int, default=5)
    args = parser.parse_args()
    time_cases(cases_of(args), args.rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--prefill', type=int, default=1024)
    parser.add_argument('--batches', type=lambda s: [int(b) for b in s.split(',')], default=[1, 16])
    parser.add_argument('--rounds', type=int, default=5)
    args = parser.parse_args()
    time_cases(cases(args), args.rounds)


if __name__ == '__main__':
    main()
