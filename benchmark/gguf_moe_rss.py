"""Peak memory (RSS) of converting a MoE GGUF file and of loading it in bf16 on the CPU, each in a fresh process:
a ``qwen3moe`` file of random Q4_K blocks (layer 0's ``ffn_down_exps`` Q6_K, as Q4_K_M gives some layers) at
Qwen3-30B-A3B's expert shape, fewer layers. The experts stay as their blocks, so both peaks should stay near the
file's size plus one layer, far under the experts' size in bf16.

    python benchmark/gguf_moe_rss.py [--layers 4] [--experts 128] [--hidden 2048] [--inter 768] [--dir /tmp/x]
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).parents[1] / 'tests'))
from test_gguf import _add_tokenizer, finish  # noqa: E402

# bytes per block, and where its fp16 scales lie
BLOCK = {Q.Q4_K: (144, slice(0, 4)), Q.Q6_K: (210, slice(208, 210))}


def random_blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random ``qtype`` blocks for a float tensor of ``shape`` (rows of 256-input blocks), small fp16 scales."""
    block_bytes, scales = BLOCK[qtype]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // 256, block_bytes), dtype=np.uint8)
    values = rng.uniform(1e-4, 1e-3, blocks.shape[:-1] + ((scales.stop - scales.start) // 2,)).astype(np.float16)
    blocks[..., scales] = values.view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def write_file(path: Path, args: argparse.Namespace) -> None:
    writer = gguf.GGUFWriter(str(path), 'qwen3moe')
    vocab = _add_tokenizer(writer)
    heads, head_dim, hidden = 32, 128, args.hidden
    for add, value in [(writer.add_block_count, args.layers), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, 6144),
                       (writer.add_head_count, heads), (writer.add_head_count_kv, 4), (writer.add_key_length, head_dim),
                       (writer.add_rope_freq_base, 1e6), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_expert_count, args.experts), (writer.add_expert_used_count, 8),
                       (writer.add_expert_feed_forward_length, args.inter)]:
        add(value)
    rng = np.random.default_rng(0)
    ones = lambda n: np.ones(n, dtype=np.float32)  # noqa: E731
    writer.add_tensor('token_embd.weight', random_blocks((vocab, hidden), Q.Q4_K, rng), raw_dtype=Q.Q4_K)
    for i in range(args.layers):
        matrices = {'attn_q': (heads * head_dim, hidden), 'attn_k': (4 * head_dim, hidden),
                    'attn_v': (4 * head_dim, hidden), 'attn_output': (hidden, heads * head_dim),
                    'ffn_gate_exps': (args.experts, args.inter, hidden),
                    'ffn_up_exps': (args.experts, args.inter, hidden),
                    'ffn_down_exps': (args.experts, hidden, args.inter)}
        for name, shape in matrices.items():
            qtype = Q.Q6_K if (i, name) == (0, 'ffn_down_exps') else Q.Q4_K
            writer.add_tensor(f'blk.{i}.{name}.weight', random_blocks(shape, qtype, rng), raw_dtype=qtype)
        writer.add_tensor(f'blk.{i}.ffn_gate_inp.weight', rng.standard_normal((args.experts, hidden), np.float32) * .02)
        for name, size in (('attn_norm', hidden), ('ffn_norm', hidden), ('attn_q_norm', head_dim),
                           ('attn_k_norm', head_dim)):
            writer.add_tensor(f'blk.{i}.{name}.weight', ones(size))
    writer.add_tensor('output_norm.weight', ones(hidden))
    finish(writer)


def child(mode: str, path: str) -> None:
    """Converts (``convert``) or loads in bf16 (``load``), then prints the peak RSS in GiB."""
    if mode == 'convert':
        from lmdeploy.pytorch.weights.gguf import convert_gguf
        convert_gguf(path + '.gguf', path)
    else:
        from lmdeploy.messages import PytorchEngineConfig
        from lmdeploy.pytorch.engine.engine import Engine
        Engine(path, PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=16, block_size=16),
               show_progress=False).close()
    print(f'{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f}')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--layers', type=int, default=4)
    parser.add_argument('--experts', type=int, default=128)
    parser.add_argument('--hidden', type=int, default=2048)
    parser.add_argument('--inter', type=int, default=768)
    parser.add_argument('--dir', default=None)
    parser.add_argument('--child', nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    folder = Path(args.dir or tempfile.mkdtemp(prefix='gguf_moe_rss'))
    path = folder / 'model'
    write_file(path.with_suffix('.gguf'), args)
    size = path.with_suffix('.gguf').stat().st_size / 2**30
    bf16 = 3 * args.layers * args.experts * args.hidden * args.inter * 2 / 2**30
    print(f'file {size:.2f} GiB; its experts in bf16 would take {bf16:.2f} GiB; '
          f'one layer\'s experts {size / args.layers:.2f} GiB as blocks')
    for mode in ('convert', 'load'):
        out = subprocess.run([sys.executable, __file__, '--child', mode, str(path)], check=True, capture_output=True,
                             text=True, env=os.environ)
        print(f'peak RSS of {mode}: {out.stdout.split()[-1]} GiB')


if __name__ == '__main__':
    main()
