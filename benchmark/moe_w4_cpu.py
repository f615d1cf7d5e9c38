"""Time of one mixture-of-experts layer's experts on the CPU by step size (tokens), bf16 activations: 4-bit
GPTQ experts, each routed expert's projections on the native int4 GEMV (what the engine runs,
``nn/quant/w4a16.py``) or on torch's int4 kernel, against the same experts in bf16 (the torch fused-MoE
loop). Random routing, random weights; Qwen3-30B-A3B's shape by default. With ``--gguf``, a GGUF file's
experts as their blocks instead (``nn/quant/gguf.py``, ``GgufExpertsFormat``): all Q4_K, and Q4_K with a Q6_K
down projection (the layers of a Q4_K_M file that llama.cpp gives more bits), against bf16 experts.

    python benchmark/moe_w4_cpu.py [--experts 128] [--top-k 8] [--hidden 2048] [--inter 768] [--group 128]
                                   [--gguf] [--threads 1]
"""
from __future__ import annotations

import argparse

import torch
from w4_cpu import best_ms

from lmdeploy.pytorch.nn.moe import FusedExperts
from lmdeploy.pytorch.nn.quant import LinearOptions, use_weight_format, weight_format_for
from lmdeploy.pytorch.nn.quant.gguf import GgufExpertsFormat, GgufFormat
from lmdeploy.pytorch.nn.quant.int4_cpu import SmallStepInt4Kernel
from lmdeploy.pytorch.nn.quant.w4a16 import PerExpertKernel

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
        kernels = {proj: [SmallStepInt4Kernel.of_grid(layer.weight_format.unpack(layer.projection(proj, e)),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--experts', type=int, default=128)
    parser.add_argument('--top-k', type=int, default=8)
    parser.add_argument('--hidden', type=int, default=2048)
    parser.add_argument('--inter', type=int, default=768)
    parser.add_argument('--group', type=int, default=128)
    parser.add_argument('--gguf', action='store_true', help='Q4_K (and Q4_K with a Q6_K down) experts vs bf16')
    parser.add_argument('--threads', type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
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
    print(f'{args.experts} experts, top-{args.top_k}, {args.hidden} -> {args.inter}, {args.threads} thread(s); '
          f'ms per step (best of repeats)')
    print('tokens ' + ''.join(f'{name:>16}' for name in layers) + f'  {next(iter(layers))} / bf16')
    g = torch.Generator().manual_seed(1)
    for tokens in steps:
        x = torch.randn(tokens, args.hidden, generator=g).bfloat16()
        ids = torch.stack([torch.randperm(args.experts, generator=g)[:args.top_k] for _ in range(tokens)])
        weights = torch.full((tokens, args.top_k), 1 / args.top_k)
        times = [best_ms(lambda layer=layer: layer(x, weights, ids)) for layer in layers.values()]
        print(f'{tokens:>6} ' + ''.join(f'{t:>16.2f}' for t in times) + f'{times[0] / times[2]:>15.2f}')


if __name__ == '__main__':
    main()
