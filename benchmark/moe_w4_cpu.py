"""Time of one mixture-of-experts layer's experts on the CPU by step size (tokens), bf16 activations: 4-bit
GPTQ experts, each routed expert's projections on the native int4 GEMV (what the engine runs,
``nn/quant/w4a16.py``) or on torch's int4 kernel, against the same experts in bf16 (the torch fused-MoE
loop). Random routing, random weights; Qwen3-30B-A3B's shape by default. With ``--gguf``, a GGUF file's
experts as their blocks instead (``nn/quant/gguf.py``, ``GgufExpertsFormat``): all Q4_K, and Q4_K with a Q6_K
down projection (the layers of a Q4_K_M file that llama.cpp gives more bits), against bf16 experts. With
``--mxfp4``, gpt-oss-20b's experts (32, top-4, 2880 -> 2880, biased, clamped SwiGLU) kept as MXFP4
(``nn/quant/mxfp4.py``) against the same experts in bf16, timed in the thread's CPU time (rounds alternating
between the two), one MXFP4 gate-and-up projection by rows (the GEMV against dequantizing for ``F.linear``) and the
resident weight bytes of a gpt-oss-20b-shaped model either way.

    python benchmark/moe_w4_cpu.py [--experts 128] [--top-k 8] [--hidden 2048] [--inter 768] [--group 128]
                                   [--gguf [--decode] | --mxfp4] [--threads 1] [--tokens 1,4,16]
                                   [--no-amx] [--gemv-max-rows q4k=32,q6k=16]

With ``--threads 1`` the ``--gguf`` and default tables time the thread's CPU time (best of 3 after a warm-up), else
the wall time. ``--no-amx`` and ``--gemv-max-rows`` set the GGUF experts' GEMV bounds as ``kquant_rows_cpu.py``'s
``set_bounds`` does. ``--gguf --decode`` times the GGUF experts' steps both ways, alternating in one process: as
decode rows in an engine step (every expert's share on its GEMV) and as a step outside the engine (each share by
its size against the bound: the GEMV, or dequantized above, as the experts chose in every step before they chose
by the kind of rows).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import time

import torch
import torch.nn.functional as F
from w4_cpu import best_ms

from lmdeploy.pytorch.kernels import cpu
from lmdeploy.pytorch.kernels.activation import ClampedSwiGLU
from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant import LinearOptions, use_weight_format, weight_format_for
from lmdeploy.pytorch.nn.quant.gguf import GgufExpertsFormat, GgufFormat
from lmdeploy.pytorch.nn.quant.int4_cpu import TorchInt4Kernel
from lmdeploy.pytorch.nn.quant.mxfp4 import Mxfp4Kernel
from lmdeploy.pytorch.nn.quant.w4a16 import PerExpertKernel
from lmdeploy.pytorch.step_context import step_rows

STEPS = [1, 4, 16, 64, 256]
GGUF_STEPS = [1, 4, 16]
# the fp16 d (and dmin) of each block type: byte offsets
SCALE_BYTES = {'Q4_K': slice(0, 4), 'Q6_K': slice(208, 210)}


def experts(config: dict | None, args: argparse.Namespace, torch_int4: bool = False) -> FusedExperts:
    """Experts of ``config``'s format (None: bf16) with random parameters, laid out for their kernel (with
    ``torch_int4``, for torch's int4 kernel)."""
    with use_weight_format(weight_format_for(config)):
        layer = FusedExperts(args.hidden, args.inter, args.experts)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if param.dtype == torch.int32:
                param.copy_(torch.randint(-2**31, 2**31 - 1, param.shape, generator=g, dtype=torch.int64))
            elif name.endswith('scales'):
                param.data = (torch.rand(param.shape, generator=g) * 0.002 + 0.001).bfloat16()
            else:
                param.data = (torch.randn(param.shape, generator=g) * 0.02).bfloat16()
    if torch_int4:
        kernels = {proj: [TorchInt4Kernel.of_grid(layer.weight_format.unpack(layer.projection(proj, e)),
                                                  torch.bfloat16) for e in range(args.experts)]
                   for proj in ('gate_up', 'down')}
        layer.kernel = PerExpertKernel(args.experts, lambda proj, expert: kernels[proj][expert])
    else:
        layer.finalize(LinearOptions(pack_cpu=True, dtype=torch.bfloat16))
    return layer


def gguf_experts(types: dict[str, str], args: argparse.Namespace) -> FusedExperts:
    """Experts of a GGUF file, ``types`` per projection (``gate_up``, ``down``), with random blocks (small fp16
    scales), laid out for their bf16 CPU kernels."""
    with use_weight_format(GgufExpertsFormat({proj: GgufFormat(t) for proj, t in types.items()})):
        layer = FusedExperts(args.hidden, args.inter, args.experts)
    g = torch.Generator().manual_seed(0)
    for proj, ggml_type in types.items():
        blocks = getattr(layer, f'{proj}_qweight')
        blocks.copy_(torch.randint(0, 256, blocks.shape, generator=g, dtype=torch.uint8))
        scales = blocks[..., SCALE_BYTES[ggml_type]]
        values = (torch.rand(*scales.shape[:-1], scales.shape[-1] // 2, generator=g) * 1e-3 + 1e-4).half()
        scales.copy_(values.view(torch.uint8))
    layer.finalize(LinearOptions(pack_cpu=True, dtype=torch.bfloat16))
    return layer


# gpt-oss-20b: its experts (the defaults of --mxfp4) and the rest of the model (in bf16)
GPT_OSS_20B = dict(experts=32, top_k=4, hidden=2880, inter=2880, layers=24, vocab=201088, heads=64, kv_heads=8,
                   head_dim=64)


def gpt_oss_experts(mxfp4: bool, shape: dict) -> FusedExperts:
    """gpt-oss-20b-shaped experts (biased, clamped SwiGLU) with random MXFP4 blocks (scales near 2^-7) or random
    bf16 weights, laid out for their CPU kernels."""
    with use_weight_format(weight_format_for({'quant_method': 'mxfp4'} if mxfp4 else None)):
        layer = FusedExperts(shape['hidden'], shape['inter'], shape['experts'], bias=True,
                             activation=ClampedSwiGLU(1.702, 7.0))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith('blocks'):
                param.copy_(torch.randint(0, 256, param.shape, generator=g, dtype=torch.uint8))
            elif name.endswith('scales'):
                param.copy_(torch.randint(118, 122, param.shape, generator=g, dtype=torch.uint8))
            else:
                param.data = (torch.randn(param.shape, generator=g) * 0.02).bfloat16()
    layer.finalize(LinearOptions(pack_cpu=True, dtype=torch.bfloat16))
    return layer


def cpu_ms(fn, rounds: int) -> float:
    """The thread's CPU time of one call of ``fn`` (one thread: the neighbours' load does not count), in ms."""
    start = time.thread_time()
    for _ in range(rounds):
        fn()
    return (time.thread_time() - start) / rounds * 1e3


def projection_rows(layer: FusedExperts) -> None:
    """One MXFP4 gate-and-up projection by rows: the GEMV against dequantizing for ``F.linear`` (what
    ``MXFP4_NATIVE_MAX_ROWS`` chooses between), each expert in turn (weights not in the cache)."""
    kernels = [Mxfp4Kernel(layer.gate_up_blocks[e], layer.gate_up_scales[e]) for e in range(layer.num_experts)]
    native = cpu.mxfp4_gemv()
    print('one gate-and-up projection, CPU ms: rows, GEMV, dequantize + F.linear')
    experts = itertools.cycle(kernels)

    def gemv() -> None:
        kernel = next(experts)
        native.mxfp4_linear(x, kernel.blocks, kernel.scales)

    def dequantized() -> None:
        F.linear(x, next(experts).dequantize(torch.bfloat16))

    for rows in (1, 4, 16, 32, 64):
        x = torch.randn(rows, layer.hidden_size).bfloat16()
        print(f'{rows:>6}{cpu_ms(gemv, 8):>10.2f}{cpu_ms(dequantized, 8):>10.2f}')


def mxfp4_main(args: argparse.Namespace) -> None:
    shape = GPT_OSS_20B
    layers = {'MXFP4': gpt_oss_experts(True, shape), 'bf16': gpt_oss_experts(False, shape)}
    print(f'gpt-oss-20b experts ({shape["experts"]}, top-{shape["top_k"]}, {shape["hidden"]} -> {shape["inter"]}), '
          f'{args.threads} thread(s); CPU ms per step, best of 5 alternating rounds')
    print('tokens' + ''.join(f'{name:>10}' for name in layers) + '  bf16 / MXFP4')
    g = torch.Generator().manual_seed(1)
    for tokens in GGUF_STEPS:
        x = torch.randn(tokens, shape['hidden'], generator=g).bfloat16()
        ids = torch.stack([torch.randperm(shape['experts'], generator=g)[:shape['top_k']] for _ in range(tokens)])
        weights = torch.full((tokens, shape['top_k']), 1 / shape['top_k'])
        best = dict.fromkeys(layers, float('inf'))
        for _ in range(5):
            for name, layer in layers.items():
                layer(x, weights, ids)
                best[name] = min(best[name], cpu_ms(lambda layer=layer: layer(x, weights, ids), 3))
        print(f'{tokens:>6}' + ''.join(f'{t:>10.2f}' for t in best.values()) + f'{best["bf16"] / best["MXFP4"]:>14.2f}')
    projection_rows(layers['MXFP4'])
    experts_bytes = {name: sum(p.numel() * p.element_size() for n, p in layer.named_parameters() if 'bias' not in n)
                     for name, layer in layers.items()}
    attention = shape['hidden'] * (2 * shape['heads'] + 2 * shape['kv_heads']) * shape['head_dim']
    dense = 2 * shape['vocab'] * shape['hidden'] + shape['layers'] * (attention + shape['hidden'] * shape['experts'])
    print(f'gpt-oss-20b weights: {shape["layers"]} layers of experts and {dense / 1e9:.2f} B other parameters in bf16')
    for name, size in experts_bytes.items():
        total = shape['layers'] * size + 2 * dense
        print(f'  experts in {name}: {shape["layers"] * size / 2**30:.2f} GiB of experts, '
              f'{total / 2**30:.2f} GiB in all')


def best_cpu_ms(fn, repeats: int = 3) -> float:
    """The fastest of ``repeats`` calls of ``fn`` after a warm-up, by the thread's CPU time, in ms (one thread)."""
    fn()
    return min(cpu_ms(fn, 1) for _ in range(repeats))


def decode_main(args: argparse.Namespace) -> None:
    """GGUF experts' steps by share size and as decode rows (see the module's docstring), CPU ms, best of 3 rounds
    of alternating calls after a warm-up."""
    layers = {'Q4_K': gguf_experts({'gate_up': 'Q4_K', 'down': 'Q4_K'}, args),
              'Q4_K+Q6_K down': gguf_experts({'gate_up': 'Q4_K', 'down': 'Q6_K'}, args)}
    ways = {'by share': contextlib.nullcontext, 'decode rows': lambda: step_rows(decode=True)}
    print(f'{args.experts} experts, top-{args.top_k}, {args.hidden} -> {args.inter}, one thread; CPU ms a step')
    g = torch.Generator().manual_seed(1)
    for tokens in [int(tokens) for tokens in (args.tokens or '24,64').split(',')]:
        x = torch.randn(tokens, args.hidden, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(args.experts, generator=g)[:args.top_k] for _ in range(tokens)])
        weights = torch.full((tokens, args.top_k), 1 / args.top_k)
        largest = int(torch.bincount(ids.flatten(), minlength=args.experts).max())
        for name, layer in layers.items():
            best = dict.fromkeys(ways, float('inf'))
            for way in ways.values():  # warm-up
                with way():
                    layer(x, weights, ids)
            for _ in range(3):
                for label, way in ways.items():
                    with way():
                        best[label] = min(best[label], cpu_ms(lambda: layer(x, weights, ids), 1))
            print(f'{tokens:>6} tokens (largest share {largest:>4}) {name:>15}: by share {best["by share"]:9.2f}, '
                  f'decode rows {best["decode rows"]:9.2f} ({best["decode rows"] / best["by share"]:.3f}x)',
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--experts', type=int, default=128)
    parser.add_argument('--top-k', type=int, default=8)
    parser.add_argument('--hidden', type=int, default=2048)
    parser.add_argument('--inter', type=int, default=768)
    parser.add_argument('--group', type=int, default=128)
    parser.add_argument('--gguf', action='store_true', help='Q4_K (and Q4_K with a Q6_K down) experts vs bf16')
    parser.add_argument('--mxfp4', action='store_true', help="gpt-oss-20b's experts in MXFP4 vs bf16")
    parser.add_argument('--threads', type=int, default=1)
    parser.add_argument('--tokens', help='step sizes, comma-separated (default: 1,4,16 with --gguf)')
    parser.add_argument('--no-amx', action='store_true', help='with --gguf: as on a CPU without AMX (run it with '
                        'ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16; see kquant_rows_cpu.py)')
    parser.add_argument('--gemv-max-rows', default='', help='with --gguf: the K-quant GEMVs\' bounds, as q4k=32,q6k=16')
    parser.add_argument('--decode', action='store_true', help='with --gguf: steps as decode rows against by share '
                        'size (one thread)')
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.no_amx or args.gemv_max_rows:
        from kquant_rows_cpu import set_bounds
        set_bounds(args.no_amx, args.gemv_max_rows)
    if args.gguf and args.decode:
        torch.set_num_threads(1)
        decode_main(args)
        return
    if args.mxfp4:
        mxfp4_main(args)
        return
    if args.gguf:
        layers = {'Q4_K': gguf_experts({'gate_up': 'Q4_K', 'down': 'Q4_K'}, args),
                  'Q4_K+Q6_K down': gguf_experts({'gate_up': 'Q4_K', 'down': 'Q6_K'}, args),
                  'bf16': experts(None, args)}
        steps = GGUF_STEPS
    else:
        gptq = {'quant_method': 'gptq', 'bits': 4, 'group_size': args.group, 'desc_act': False}
        layers = {'int4 native': experts(gptq, args), 'int4 torch': experts(gptq, args, torch_int4=True),
                  'bf16': experts(None, args)}
        steps = STEPS
    if args.tokens:
        steps = [int(tokens) for tokens in args.tokens.split(',')]
    clock = 'CPU' if args.threads == 1 else 'wall'
    print(f'{args.experts} experts, top-{args.top_k}, {args.hidden} -> {args.inter}, {args.threads} thread(s); '
          f'{clock} ms per step (best of repeats)')
    print('tokens ' + ''.join(f'{name:>16}' for name in layers) + f'  {next(iter(layers))} / bf16')
    g = torch.Generator().manual_seed(1)
    for tokens in steps:
        x = torch.randn(tokens, args.hidden, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(args.experts, generator=g)[:args.top_k] for _ in range(tokens)])
        weights = torch.full((tokens, args.top_k), 1 / args.top_k)
        best = best_cpu_ms if args.threads == 1 else best_ms
        times = [best(lambda layer=layer: layer(x, weights, ids)) for layer in layers.values()]
        print(f'{tokens:>6} ' + ''.join(f'{t:>16.2f}' for t in times) + f'{times[0] / times[2]:>15.2f}')


if __name__ == '__main__':
    main()
