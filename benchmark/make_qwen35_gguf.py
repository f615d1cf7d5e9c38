"""Write a dense Qwen3.5 (``qwen35``) GGUF file of random Q4_K_M-like blocks, without a quantizer, for
``benchmark/gguf_moe_rss.py --gguf`` (conversion and serving peak RSS).

Qwen3.5-9B's layer shape by default: hidden 4096, MLP 12288, three Gated DeltaNet layers (16 key heads of 128
serving 32 value heads of 128) to one gated full-attention layer (16 query heads, 4 KV heads of 256). Q4_K
everywhere, as llama.cpp's Q4_K_M picks them: Q6_K for the output and for ``attn_v`` and ``ffn_down`` of the first
and last eighth of the layers and every third between, Q5_K for the linear attention's ``attn_qkv``; norms, the
convolution, ``ssm_a``, ``ssm_dt`` and the one-row-per-head ``ssm_alpha``/``ssm_beta`` F32. The tokenizer is the
default model's, padded to ``--vocab``.

    python benchmark/make_qwen35_gguf.py --out /tmp/q35/model.gguf [--layers 8] [--vocab 65536]
"""
from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from make_big_moe_gguf import BLOCK_BYTES, FP16_FIELDS, add_tokenizer, more_bits, write_header

# Q5_K: fp16 d and dmin first, as Q4_K's (w = d * sc * q - dmin * m, q 5-bit): dmin = 15.5 d centres it
K_BLOCK_BYTES = BLOCK_BYTES | {Q.Q5_K: 176}
K_FP16_FIELDS = FP16_FIELDS | {Q.Q5_K: ((0, 3.8e-5), (2, 5.9e-4))}
INTERVAL = 4  # every fourth layer full attention


def blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random ``qtype`` blocks of a ``shape`` tensor, their fp16 scales small (weights of std ~0.02)."""
    rows, count = int(np.prod(shape[:-1])), shape[-1] // 256
    data = rng.integers(0, 256, (rows, count, K_BLOCK_BYTES[qtype]), dtype=np.uint8)
    for offset, value in K_FP16_FIELDS[qtype]:
        scale = rng.uniform(0.5 * value, 1.5 * value, (rows, count)).astype(np.float16)
        data[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, count, 2)
    return data.reshape(*shape[:-1], count * K_BLOCK_BYTES[qtype])


def tensors(args: argparse.Namespace) -> Iterator[tuple[str, tuple[int, ...], Q]]:
    """Each tensor's name, shape (rows last but one) and type, in file order."""
    hidden, conv = args.hidden, 2 * args.k_heads * args.k_dim + args.v_heads * args.v_dim
    yield 'token_embd.weight', (args.vocab, hidden), Q.Q4_K
    for i in range(args.layers):
        more = Q.Q6_K if more_bits(i, args.layers) else Q.Q4_K
        yield f'blk.{i}.attn_norm.weight', (hidden,), Q.F32
        if (i + 1) % INTERVAL:
            yield f'blk.{i}.attn_qkv.weight', (conv, hidden), Q.Q5_K
            yield f'blk.{i}.attn_gate.weight', (args.v_heads * args.v_dim, hidden), Q.Q4_K
            yield f'blk.{i}.ssm_alpha.weight', (args.v_heads, hidden), Q.F32
            yield f'blk.{i}.ssm_beta.weight', (args.v_heads, hidden), Q.F32
            yield f'blk.{i}.ssm_a', (args.v_heads,), Q.F32
            yield f'blk.{i}.ssm_dt.bias', (args.v_heads,), Q.F32
            yield f'blk.{i}.ssm_conv1d.weight', (conv, 4), Q.F32
            yield f'blk.{i}.ssm_norm.weight', (args.v_dim,), Q.F32
            yield f'blk.{i}.ssm_out.weight', (hidden, args.v_heads * args.v_dim), Q.Q4_K
        else:
            yield f'blk.{i}.attn_q.weight', (2 * args.heads * args.head_dim, hidden), Q.Q4_K
            yield f'blk.{i}.attn_k.weight', (args.kv_heads * args.head_dim, hidden), Q.Q4_K
            yield f'blk.{i}.attn_v.weight', (args.kv_heads * args.head_dim, hidden), more
            yield f'blk.{i}.attn_q_norm.weight', (args.head_dim,), Q.F32
            yield f'blk.{i}.attn_k_norm.weight', (args.head_dim,), Q.F32
            yield f'blk.{i}.attn_output.weight', (hidden, args.heads * args.head_dim), Q.Q4_K
        yield f'blk.{i}.post_attention_norm.weight', (hidden,), Q.F32
        yield f'blk.{i}.ffn_gate.weight', (args.inter, hidden), Q.Q4_K
        yield f'blk.{i}.ffn_up.weight', (args.inter, hidden), Q.Q4_K
        yield f'blk.{i}.ffn_down.weight', (hidden, args.inter), more
    yield 'output_norm.weight', (hidden,), Q.F32
    yield 'output.weight', (args.vocab, hidden), Q.Q6_K


def f32_data(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norms ``1 + 0`` (the converter's ``1 + weight``; ``ssm_norm`` as it is), ``ssm_a = -exp(0)``, the rest small
    random values."""
    if name.endswith('norm.weight') or name.endswith('ssm_a'):
        return np.full(shape, -1.0 if name.endswith('ssm_a') else 1.0, dtype=np.float32)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)


def write_file(path: Path, args: argparse.Namespace) -> None:
    writer = gguf.GGUFWriter(str(path), 'qwen35')
    for add, value in [(writer.add_block_count, args.layers), (writer.add_context_length, 32768),
                       (writer.add_embedding_length, args.hidden), (writer.add_feed_forward_length, args.inter),
                       (writer.add_head_count, args.heads), (writer.add_head_count_kv, args.kv_heads),
                       (writer.add_key_length, args.head_dim), (writer.add_value_length, args.head_dim),
                       (writer.add_rope_freq_base, 1e7), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_rope_dimension_count, args.head_dim // 4),
                       (writer.add_rope_dimension_sections, [11, 11, 10, 0]),
                       (writer.add_ssm_conv_kernel, 4), (writer.add_ssm_state_size, args.k_dim),
                       (writer.add_ssm_group_count, args.k_heads), (writer.add_ssm_time_step_rank, args.v_heads),
                       (writer.add_ssm_inner_size, args.v_heads * args.v_dim),
                       (writer.add_full_attention_interval, INTERVAL), (writer.add_file_type, 15)]:  # Q4_K_M
        add(value)
    add_tokenizer(writer, args.vocab)
    layout = list(tensors(args))
    write_header(writer, layout, K_BLOCK_BYTES)
    rng = np.random.default_rng(args.seed)
    for name, shape, qtype in layout:
        writer.write_tensor_data(f32_data(name, shape, rng) if qtype == Q.F32 else blocks(shape, qtype, rng))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', required=True)
    for name, default in (('layers', 8), ('hidden', 4096), ('inter', 12288), ('vocab', 65536), ('heads', 16),
                          ('kv-heads', 4), ('head-dim', 256), ('k-heads', 16), ('v-heads', 32), ('k-dim', 128),
                          ('v-dim', 128), ('seed', 0)):
        parser.add_argument(f'--{name}', type=int, default=default)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_file(out, args)
    print(f'wrote {out} ({out.stat().st_size / 2**30:.2f} GiB)')


if __name__ == '__main__':
    main()
