"""Decode attention on the CPU over int8 and int4 KV caches against bf16 (the native kernels).

    python benchmark/kv_quant_bench.py                     # 64 sequences x 1k context, SmolLM2's heads
    python benchmark/kv_quant_bench.py --heads 32 8 128    # another head layout

Each round times one decode-attention call per layer over ``--layers`` layers' caches (so K/V stream
from DRAM, as in an engine step), for each cache kind in turn; the best round of each is printed with
the bytes it read per second and its speed against bf16, and the best CPU time of the process (all
threads) per layer: on a machine shared with other work, wall time includes the time the OS gave others,
CPU time does not (with one thread it is the kernel's own time).
"""
from __future__ import annotations

import argparse
import time

import torch

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.kv_quant import quantize_kv


def caches(layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, policy: int):
    """Per layer: (k, v) in bf16, or (k codes, v codes, k scales and zeros, v scales and zeros)."""
    out = []
    for _ in range(layers):
        k, v = (torch.randn(num_blocks, num_kv_heads, block_size, head_dim) for _ in range(2))
        if policy:
            (k, k_sz), (v, v_sz) = quantize_kv(k, policy), quantize_kv(v, policy)
            out.append((k, v, k_sz, v_sz))
        else:
            out.append((k.bfloat16(), v.bfloat16()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--batch', type=int, default=64)
    parser.add_argument('--context', type=int, default=1024)
    parser.add_argument('--heads', type=int, nargs=3, default=[9, 3, 64], metavar=('Q', 'KV', 'DIM'))
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--block-size', type=int, default=64)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--threads', type=int, default=None, help="torch's CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    native = cpu.native()
    assert native is not None, 'the native CPU kernels did not build'
    cpu.bind_worker_threads()
    num_heads, num_kv_heads, head_dim = args.heads
    pages = -(-args.context // args.block_size)
    num_blocks = args.batch * pages
    table = torch.randperm(num_blocks).view(args.batch, pages)  # scattered blocks, as in a long-running engine
    kv_lens = torch.full((args.batch,), args.context)
    q = torch.randn(args.batch, num_heads, head_dim).bfloat16()
    kinds = {0: 'bf16', 8: 'int8', 4: 'int4'}
    layers = {policy: caches(args.layers, num_blocks, num_kv_heads, args.block_size, head_dim, policy)
              for policy in kinds}
    best = {policy: float('inf') for policy in kinds}
    best_cpu = dict(best)
    for _ in range(args.rounds):
        for policy, per_layer in layers.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for cache in per_layer:
                quant = (*cache[2:], policy) if policy else ()
                native.paged_decode_attention(q, cache[0], cache[1], table, kv_lens, head_dim**-0.5, *quant)
            best[policy] = min(best[policy], (time.perf_counter() - start) / args.layers)
            best_cpu[policy] = min(best_cpu[policy], (time.process_time() - start_cpu) / args.layers)
    print(f'decode attention, {args.batch} sequences x {args.context} tokens, {num_heads}/{num_kv_heads} heads, '
          f'head_dim {head_dim}, block {args.block_size}, {torch.get_num_threads()} threads, best of {args.rounds}')
    for policy, kind in kinds.items():
        nbytes = sum(t.numel() * t.element_size() for t in layers[policy][0])
        print(f'{kind:>5}: {best[policy] * 1e3:7.3f} ms per layer  {nbytes / best[policy] / 1e9:6.1f} GB/s of cache  '
              f'{best[0] / best[policy]:5.2f}x bf16   CPU {best_cpu[policy] * 1e3:7.3f} ms  '
              f'{best_cpu[0] / best_cpu[policy]:5.2f}x bf16', flush=True)


if __name__ == '__main__':
    main()
