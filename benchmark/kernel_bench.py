"""Throughput of the Triton kernels on one GPU: paged decode attention (GB/s against HBM; also over int8
and int4 KV caches, against bf16), fused MoE
(TFLOP/s against bf16 dense peak, next to the unfused torch twin) and causal prefill attention; with ``--gguf``
the GEMMs on GGUF Q6_K and Q8_0 blocks against dequantizing them on each call, first a tied token table's LM head
(Gemma 3's) on its blocks against dequantizing a slice of rows at a time.

    python benchmark/kernel_bench.py --device cuda           # the figures
    python benchmark/kernel_bench.py --device cuda --sweep   # candidate launch configs, to pick the tables
    python benchmark/kernel_bench.py --device cuda --gguf    # only the GGUF GEMMs
    python benchmark/kernel_bench.py --device cpu            # smoke test: tiny shapes, Triton interpreter

On CUDA each kernel call is captured once in a CUDA graph and replayed, timed with CUDA events, so
host launch overhead is excluded. A graph holds calls on distinct inputs when one input would fit
in L2, so every call reads its bytes from HBM. Most of a run's time is Triton compiling (about 20
kernels); past ``--budget`` seconds the remaining measurements are skipped, not started. A line
marked ``*`` ran the config that the current table (decode: the split policy) picks for its shape.
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence
from functools import partial

import torch
from gpu_device import copy_tbs, device_spec, spec_source

# What the figures are held against, set by main(): a copy measured on the device (read + write) and its datasheet
ROOF = {'copy_gbs': 0.0, 'peak_gbs': 0.0, 'bf16_tflops': 0.0}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 64
QWEN3_30B_A3B = (128, 8, 2048, 768)  # experts, top-k, hidden, moe intermediate

DECODE_CASES = [(1, 32768, 0), (1, 8192, 0), (8, 8192, 0), (16, 32768, 0), (64, 1024, 0), (64, 8192, 0),
                (128, 2048, 0), (1, 8192, 512), (64, 1024, 512)]  # (batch, ctx, block-table width in pages; 0: just
# wide enough); the 512-page tables are a 32k-session CUDA graph's
KV_QUANT_CASES = [(64, 1024, 0), (64, 4096, 0)]  # int8/int4 caches against bf16
MOE_TOKENS = [1, 64, 1024, 2048, 4096, 8192]
TWIN_TOKENS = {1, 64, 1024}
PREFILL_TOKENS = [4096, 16384]
# Llama-3-8B's down_proj and v_proj (Q6_K in a Q4_K_M file) and a Q8_0 file's down_proj: (type, N, K)
GGUF_SHAPES = [('Q6_K', 4096, 14336), ('Q6_K', 1024, 4096), ('Q8_0', 4096, 14336)]
GGUF_ROWS = [1, 512]
# Gemma 3's tied token table, the LM head's weight: (type, rows, hidden); decode and a 256-token prefill
TIED_TABLES = [('Q8_0', 262144, 640)]
TIED_ROWS = [1, 256]
DEADLINE = [float('inf')]  # perf_counter() past which measurements are skipped


def out_of_time(label: str) -> bool:
    """Whether the run is past ``--budget``; says so for ``label``."""
    if time.perf_counter() < DEADLINE[0]:
        return False
    print(f'{label}: skipped, past --budget', flush=True)
    return True


def graph_seconds(calls: Sequence[Callable[[], object]], device: str, window_s: float = 0.02) -> float:
    """Seconds per call: CUDA-graph replays timed with events on CUDA, one wall-clock pass on CPU."""
    if device == 'cpu':
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) / len(calls)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compiles and warms up outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    reps = max(2, min(100, int(window_s * 1e3 / start.elapsed_time(end))))
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (reps * len(calls))


def wall_seconds(fn: Callable[[], object], device: str, reps: int = 3) -> float:
    """Mean wall-clock seconds per call after one warm-up call (for code that syncs with the host)."""
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == 'cuda':
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def copies_beyond_l2(nbytes: int, device: str) -> int:
    """How many distinct inputs of ``nbytes`` overflow L2 three times over."""
    if device == 'cpu':
        return 1
    return max(1, -(-3 * torch.cuda.get_device_properties(device).L2_cache_size // nbytes))


def split_traffic(batch: int, ctx: int, split_pages: int, kv_bytes: int) -> str:
    """A case's splits per sequence, working programs and partial bytes (written, then read by the reduce) as a
    share of the K/V bytes read."""
    from lmdeploy.pytorch.kernels.cuda.decode_attention import MAX_SPLITS
    pages = -(-ctx // BLOCK_SIZE)
    per_split = max(split_pages, -(-pages // MAX_SPLITS))
    splits = -(-pages // per_split)
    partial_bytes = 2 * batch * NUM_HEADS * splits * (HEAD_DIM * 4 + 4)
    return (f'{splits:3d} splits {batch * NUM_KV_HEADS * splits:6d} programs  partials '
            f'{100 * partial_bytes / kv_bytes:4.1f}% of KV')


def decode_attention(device: str, dtype: torch.dtype, cases: list[tuple[int, int, int]],
                     configs: list | None = None, quant_policy: int = 0) -> dict[tuple[int, int, int], float]:
    """GB/s of K and V read (codes, scales and zeros with ``quant_policy`` 8 or 4), per ``(batch, ctx, table
    width)`` case, for the default or the given configs; returns the default config's seconds per case."""
    from lmdeploy.pytorch.kernels.cuda.decode_attention import decode_attention_with, decode_config
    seconds = {}
    for batch, ctx, width in cases:
        pages = -(-ctx // BLOCK_SIZE)
        width = width or pages
        label = (f'decode attention  batch {batch:3d} ctx {ctx:6d}' + (f' in a {width}-page table' * (width > pages))
                 + (f' int{quant_policy}' if quant_policy else ''))
        row_bytes = HEAD_DIM * quant_policy // 8 + 8 if quant_policy else HEAD_DIM * torch.finfo(dtype).bits // 8
        nbytes = 2 * batch * ctx * NUM_KV_HEADS * row_bytes
        copies = copies_beyond_l2(nbytes, device)
        shape = (copies * batch * pages, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
        quant = ()
        if quant_policy:
            codes = (*shape[:3], HEAD_DIM * quant_policy // 8)
            k_cache, v_cache = (torch.randint(0, 256, codes, device=device, dtype=torch.uint8) for _ in range(2))
            quant = tuple(torch.rand(*shape[:3], 2, device=device) * 0.01 for _ in range(2)) + (quant_policy,)
        else:
            k_cache, v_cache = (torch.randn(shape, device=device, dtype=dtype) for _ in range(2))
        tables = torch.zeros(copies, batch, width, dtype=torch.int32, device=device)
        tables[:, :, :pages] = torch.randperm(shape[0], device=device, dtype=torch.int32).view(copies, batch, pages)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=dtype)
        default_config = decode_config(BLOCK_SIZE, HEAD_DIM)
        for config in configs or [default_config]:
            if out_of_time(label):
                continue
            calls = [partial(decode_attention_with, q, k_cache, v_cache, table, lens, HEAD_DIM**-0.5, config, *quant)
                     for table in tables]
            sec = graph_seconds(calls, device)
            if config == default_config:
                seconds[(batch, ctx, width)] = sec
            gbs = nbytes / sec / 1e9
            copy, peak = ROOF['copy_gbs'], ROOF['peak_gbs']
            print(f'{label}: {sec * 1e6:8.1f} us {gbs:7.1f} GB/s  {100 * gbs / copy:5.1f}% of {copy:.0f} '
                  f'(copy)  {100 * gbs / peak:5.1f}% of {peak:.0f} (peak)  '
                  f'{split_traffic(batch, ctx, config.split_pages, nbytes)}  '
                  f'{"*" * (config == default_config)}{config}', flush=True)
        del k_cache, v_cache
    return seconds


def decode_attention_quantized(device: str, dtype: torch.dtype, cases: list[tuple[int, int, int]]) -> None:
    """Decode attention over int8 and int4 caches against ``dtype`` at the same shapes: time ratios."""
    plain = decode_attention(device, dtype, cases)
    for policy in (8, 4):
        for case, sec in decode_attention(device, dtype, cases, quant_policy=policy).items():
            if case in plain:
                print(f'decode attention  batch {case[0]:3d} ctx {case[1]:6d}: int{policy} {plain[case] / sec:5.2f}x '
                      f'the speed of {str(dtype).removeprefix("torch.")}', flush=True)

def fused_moe(device: str, dtype: torch.dtype, dims: tuple[int, int, int, int], token_counts: list[int],
              twin_tokens: set[int], configs: list | None = None) -> None:
    """TFLOP/s (6 * T * k * H * I) per token count, next to the torch twin at ``twin_tokens``."""
    from lmdeploy.pytorch.kernels import moe
    from lmdeploy.pytorch.kernels.cuda.fused_moe import fused_moe_with, moe_config, moe_routing
    num_experts, top_k, hidden_size, inter = dims
    gate_up = torch.randn(num_experts, 2 * inter, hidden_size, device=device, dtype=dtype) * 0.02
    down = torch.randn(num_experts, hidden_size, inter, device=device, dtype=dtype) * 0.02
    variants = 1 if device == 'cpu' else 4  # distinct routings, so that few tokens' experts are not in L2
    for tokens in token_counts:
        label = f'fused MoE  {tokens:5d} tokens'
        inputs = [(torch.randn(tokens, hidden_size, device=device, dtype=dtype),
                   *moe_routing(torch.randn(tokens, num_experts, device=device), top_k, True))
                  for _ in range(variants)]
        flops = 6 * tokens * top_k * hidden_size * inter
        table_config = moe_config(tokens * top_k, num_experts)
        for config in configs or [table_config]:
            if out_of_time(label):
                continue
            sec = graph_seconds([partial(fused_moe_with, x, gate_up, down, w, ids, config) for x, w, ids in inputs],
                                device)
            tflops = flops / sec / 1e12
            line = (f'{label}: triton {sec * 1e6:8.1f} us {tflops:7.2f} TFLOP/s '
                    f'{100 * tflops / ROOF["bf16_tflops"]:5.1f}% of {ROOF["bf16_tflops"]:.0f}')
            if tokens in twin_tokens and not configs:
                ref = wall_seconds(partial(moe.fused_moe, *inputs[0][:1], gate_up, down, *inputs[0][1:]), device)
                line += f'   torch twin {ref * 1e6:9.1f} us {flops / ref / 1e12:6.2f} TFLOP/s  {ref / sec:6.1f}x'
            print(f'{line}  {"*" * (config == table_config)}{config}', flush=True)


def prefill_attention(device: str, dtype: torch.dtype, token_counts: list[int], heads: tuple[int, int, int]) -> None:
    """TFLOP/s of one causal sequence per token count (2 * 2 * H * D * T * (T + 1) / 2 FLOPs)."""
    from lmdeploy.pytorch.kernels import cuda as triton_kernels
    num_heads, num_kv_heads, head_dim = heads
    cache = torch.zeros(1, num_kv_heads, BLOCK_SIZE, head_dim, device=device, dtype=dtype)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    for tokens in token_counts:
        label = f'prefill attention  {tokens:5d} tokens (causal)'
        if out_of_time(label):
            continue
        q = torch.randn(tokens, num_heads, head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(tokens, num_kv_heads, head_dim, device=device, dtype=dtype) for _ in range(2))
        seq = [torch.tensor([x], dtype=torch.int32, device=device) for x in (0, tokens, tokens)]
        call = partial(triton_kernels.prefill_attention, q, k, v, cache, cache, table, *seq, tokens, head_dim**-0.5)
        sec = graph_seconds([call], device)
        tflops = 2 * 2 * num_heads * head_dim * tokens * (tokens + 1) / 2 / sec / 1e12
        print(f'{label}: {sec * 1e6:9.1f} us {tflops:7.2f} TFLOP/s {100 * tflops / ROOF["bf16_tflops"]:5.1f}% '
              f'of {ROOF["bf16_tflops"]:.0f}', flush=True)


def random_blocks(ggml_type: str, n: int, k: int, device: str) -> torch.Tensor:
    """``[N, K / B, bytes]`` blocks of random bytes, each fp16 ``d`` set to 0.01."""
    from lmdeploy.pytorch.nn.quant.gguf_blocks import BLOCKS
    block_inputs, block_bytes = BLOCKS[ggml_type]
    blocks = torch.randint(0, 256, (n, k // block_inputs, block_bytes), dtype=torch.uint8, device=device)
    d_at = 208 if ggml_type == 'Q6_K' else 0
    blocks[..., d_at:d_at + 2] = torch.full(blocks.shape[:2], 0.01, dtype=torch.float16, device=device)[
        ..., None].view(torch.uint8)
    return blocks


def gguf_linear(device: str, dtype: torch.dtype, shapes: list[tuple[str, int, int]], row_counts: list[int]) -> None:
    """A GGUF layer's ``x @ W.T`` on its blocks (the Triton GEMM, ``nn/quant/gguf_cuda.py``) against dequantizing
    them on each call for ``F.linear`` (``Q8Kernel``: what CUDA ran before) and ``F.linear`` on a copy dequantized
    once (2 bytes a weight); GB/s of the blocks' bytes."""
    from lmdeploy.pytorch.nn.quant.gguf_blocks import Q8Kernel, dequantize_blocks, int8_unpack
    from lmdeploy.pytorch.nn.quant.gguf_cuda import TRITON_KERNELS
    for ggml_type, n, k in shapes:
        blocks = random_blocks(ggml_type, n, k, device)
        copies = [blocks] + [random_blocks(ggml_type, n, k, device)
                             for _ in range(copies_beyond_l2(blocks.numel(), device) - 1)]
        on_blocks = [TRITON_KERNELS[ggml_type](b) for b in copies]
        per_call = [Q8Kernel(*int8_unpack(b, ggml_type)) for b in copies]
        dense = [dequantize_blocks(b, ggml_type).to(dtype) for b in copies]
        del copies
        for rows in row_counts:
            label = f'gguf {ggml_type} {n:5d} x {k:5d}  {rows:4d} rows'
            if out_of_time(label):
                continue
            x = torch.randn(rows, k, device=device, dtype=dtype)
            sec = graph_seconds([partial(kernel, x, None) for kernel in on_blocks], device)
            ref = graph_seconds([partial(kernel, x, None) for kernel in per_call], device)
            floor = graph_seconds([partial(torch.nn.functional.linear, x, w) for w in dense], device)
            print(f'{label}: triton {sec * 1e6:8.1f} us {blocks.numel() / sec / 1e9:7.1f} GB/s   dequantize + '
                  f'matmul {ref * 1e6:8.1f} us {ref / sec:6.1f}x   dense {str(dtype).removeprefix("torch.")} '
                  f'{floor * 1e6:8.1f} us {floor / sec:5.2f}x', flush=True)
        del on_blocks, per_call, dense


def tied_table(device: str, dtype: torch.dtype, shapes: list[tuple[str, int, int]], row_counts: list[int]) -> None:
    """A tied GGUF token table's logits on its blocks retiled for the Triton GEMM (``TritonBlocks``) against
    dequantizing a slice of rows at a time for ``F.linear`` (``FileBlocks``: what CUDA ran before); GB/s of the
    blocks' bytes. The table outgrows L2, so one copy serves."""
    from lmdeploy.pytorch.nn.quant.gguf_cuda import TritonBlocks
    from lmdeploy.pytorch.nn.quant.gguf_table import FileBlocks
    for ggml_type, n, k in shapes:
        blocks = random_blocks(ggml_type, n, k, device)
        on_blocks, slices = TritonBlocks(blocks, ggml_type), FileBlocks(blocks, ggml_type)
        for rows in row_counts:
            label = f'tied {ggml_type} table {n:6d} x {k:4d}  {rows:4d} rows'
            if out_of_time(label):
                continue
            x = torch.randn(rows, k, device=device, dtype=dtype)
            sec = graph_seconds([partial(on_blocks.logits, x)], device)
            ref = graph_seconds([partial(slices.logits, x)], device)
            print(f'{label}: triton {sec * 1e6:8.1f} us {blocks.numel() / sec / 1e9:7.1f} GB/s   slices dequantized '
                  f'+ matmul {ref * 1e6:8.1f} us {ref / sec:6.1f}x', flush=True)
        del blocks, on_blocks, slices


def sweep(device: str, dtype: torch.dtype) -> None:
    """Candidate launch configs at the shapes that set the tables: decode's pages per split (one for every batch:
    batch invariance) at batch 1 x 32k (few programs) and 64 x 1k and 8k (many partials); fused MoE at 1 and 64
    tokens (narrow tiles), 1,024 and 4,096 tokens."""
    from lmdeploy.pytorch.kernels.cuda.decode_attention import DecodeConfig as D
    from lmdeploy.pytorch.kernels.cuda.fused_moe import MoEConfig as M
    splits = [D(4, 1, 4, 3), D(2, 1, 4, 3), D(8, 1, 4, 3), D(16, 1, 4, 3), D(4, 1, 4, 2), D(4, 2, 4, 2),
              D(8, 2, 4, 2)]
    narrow = [M(16, 64, 128, 1, 4, 4), M(16, 64, 64, 1, 4, 5), M(16, 128, 128, 1, 4, 2)]
    wide = [M(128, 256, 64, 16, 8, 4), M(128, 256, 64, 1, 8, 4), M(128, 128, 64, 8, 8, 4), M(64, 128, 64, 1, 4, 3),
            M(64, 256, 64, 8, 8, 3)]
    if device == 'cpu':
        decode_attention(device, dtype, [(1, 512, 0)], splits[:2])
        fused_moe(device, dtype, (4, 2, 64, 32), [16], set(), wide[2:4])
        return
    decode_attention(device, dtype, [(1, 32768, 0), (64, 1024, 0), (64, 8192, 0)], splits)
    fused_moe(device, dtype, QWEN3_30B_A3B, [1, 64], set(), narrow)
    fused_moe(device, dtype, QWEN3_30B_A3B, [1024, 4096], set(), wide)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--device', choices=['cuda', 'cpu'], default='cuda')
    parser.add_argument('--sweep', action='store_true', help='time candidate launch configs instead')
    parser.add_argument('--gguf', action='store_true',
                        help='time only the GEMMs on GGUF Q6_K and Q8_0 blocks (a tied table\'s LM head first)')
    parser.add_argument('--budget', type=float, default=80.0, help='seconds after which measurements are skipped')
    args = parser.parse_args()
    start = time.perf_counter()
    DEADLINE[0] = start + args.budget
    if args.device == 'cpu':
        os.environ.setdefault('TRITON_INTERPRET', '1')
    dtype = torch.float32 if args.device == 'cpu' else torch.bfloat16
    name = torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu'
    spec = device_spec(name)[0]
    ROOF.update(copy_gbs=1e3 * copy_tbs(args.device, 2**30 if args.device == 'cuda' else 2**26),
                peak_gbs=1e3 * spec.hbm_tbs, bf16_tflops=spec.bf16_tflops)
    print(f'kernel bench on {name}: copy {ROOF["copy_gbs"]:.0f} GB/s measured now; peak {ROOF["peak_gbs"]:.0f} GB/s and '
          f'{spec.bf16_tflops:.0f} TFLOP/s dense bf16 ({spec_source(name)})', flush=True)
    if args.sweep:
        sweep(args.device, dtype)
    elif args.gguf:
        tied_table(args.device, dtype, TIED_TABLES if args.device == 'cuda' else [('Q8_0', 300, 64)],
                   TIED_ROWS if args.device == 'cuda' else [1, 20])
        shapes = GGUF_SHAPES if args.device == 'cuda' else [('Q6_K', 64, 512), ('Q8_0', 64, 256)]
        gguf_linear(args.device, dtype, shapes, GGUF_ROWS if args.device == 'cuda' else [1, 20])
    elif args.device == 'cpu':
        decode_attention('cpu', dtype, [(2, 256, 0), (1, 128, 16)])
        decode_attention_quantized('cpu', dtype, [(2, 256, 0)])
        fused_moe('cpu', dtype, (4, 2, 64, 32), [1, 8], {1})
        prefill_attention('cpu', dtype, [64], (4, 2, 32))
    else:
        decode_attention('cuda', dtype, DECODE_CASES)
        decode_attention_quantized('cuda', dtype, KV_QUANT_CASES)
        fused_moe('cuda', dtype, QWEN3_30B_A3B, MOE_TOKENS, TWIN_TOKENS)
        prefill_attention('cuda', dtype, PREFILL_TOKENS, (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM))
    print(f'kernel bench: {time.perf_counter() - start:.1f} s', flush=True)


if __name__ == '__main__':
    main()
