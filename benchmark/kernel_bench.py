"""Throughput of the Triton kernels: paged decode attention (GB/s vs HBM peak) and fused MoE
(TFLOP/s vs the unfused torch twin, which loops over experts).

    python benchmark/kernel_bench.py --device cuda      # real numbers (H200 peak 4.8 TB/s)
    python benchmark/kernel_bench.py --device cpu       # smoke test: tiny shapes, Triton interpreter
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

HBM_PEAK_GBS = 4800.0


def bench(fn: Callable[[], object], device: str, reps: int) -> float:
    """Mean seconds per call after one warm-up call."""
    fn()
    if device == 'cuda':
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == 'cuda':
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def decode_attention(device: str, dtype: torch.dtype, reps: int, shapes: list[tuple[int, int]]) -> None:
    from lmdeploy.pytorch.kernels import cuda as triton_kernels
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 64
    for batch, ctx in shapes:
        blocks = batch * ctx // block_size
        cache = [torch.randn(blocks, num_kv_heads, block_size, head_dim, device=device, dtype=dtype) for _ in range(2)]
        table = torch.randperm(blocks, device=device).view(batch, -1)
        lens = torch.full((batch,), ctx, device=device)
        q = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype)
        sec = bench(lambda: triton_kernels.decode_attention(q, *cache, table, lens, head_dim**-0.5), device, reps)
        gbs = 2 * cache[0].numel() * cache[0].element_size() / sec / 1e9
        print(f'decode attention  batch {batch:3d} ctx {ctx:6d}: {sec * 1e6:9.1f} us  {gbs:7.1f} GB/s  '
              f'({100 * gbs / HBM_PEAK_GBS:5.1f}% of {HBM_PEAK_GBS:.0f} GB/s)')


def fused_moe(device: str, dtype: torch.dtype, reps: int, dims: tuple[int, int, int, int],
              token_counts: list[int]) -> None:
    from lmdeploy.pytorch.kernels import cuda as triton_kernels
    from lmdeploy.pytorch.kernels import moe
    num_experts, top_k, hidden_size, inter = dims
    gate_up = torch.randn(num_experts, 2 * inter, hidden_size, device=device, dtype=dtype) * 0.02
    down = torch.randn(num_experts, hidden_size, inter, device=device, dtype=dtype) * 0.02
    for tokens in token_counts:
        hidden = torch.randn(tokens, hidden_size, device=device, dtype=dtype)
        weights, ids = triton_kernels.moe_routing(torch.randn(tokens, num_experts, device=device), top_k, True)
        flops = 6 * tokens * top_k * hidden_size * inter
        ours = bench(lambda: triton_kernels.fused_moe(hidden, gate_up, down, weights, ids), device, reps)
        ref = bench(lambda: moe.fused_moe(hidden, gate_up, down, weights, ids), device, reps)
        print(f'fused MoE  {tokens:5d} tokens: triton {ours * 1e6:9.1f} us {flops / ours / 1e12:6.2f} TFLOP/s   '
              f'torch {ref * 1e6:9.1f} us {flops / ref / 1e12:6.2f} TFLOP/s   speed-up {ref / ours:5.2f}x')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', choices=['cuda', 'cpu'], default='cuda')
    args = parser.parse_args()
    if args.device == 'cpu':
        os.environ.setdefault('TRITON_INTERPRET', '1')
        decode_attention('cpu', torch.float32, 1, [(2, 256)])
        fused_moe('cpu', torch.float32, 1, (4, 2, 64, 32), [1, 8])
        return
    decode_attention('cuda', torch.bfloat16, 20, [(1, 32768), (8, 8192), (16, 32768), (64, 4096), (128, 2048)])
    fused_moe('cuda', torch.bfloat16, 10, (128, 8, 2048, 768), [1, 64, 1024])


if __name__ == '__main__':
    main()
