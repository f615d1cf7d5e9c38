"""Write a Qwen3-30B-A3B-shaped ``qwen3moe`` GGUF file of random Q4_K_M-like blocks, without a quantizer.

48 layers of 128 experts (8 active), hidden 2048, expert intermediate 768, 32 heads and 4 KV heads of 128,
vocabulary 151936: Q4_K everywhere, Q6_K for the output and, as llama.cpp's Q4_K_M picks them, for ``attn_v``
and ``ffn_down_exps`` of the first and last eighth of the layers and every third between; the routers and
norms F32. The blocks are random bytes whose fp16 ``d`` and ``dmin`` are set to small finite values (weights of
std ~0.02, checked with ``gguf.quants.dequantize``). The tokenizer is the default model's (SmolLM2's BPE, from
its GGUF metadata), its token list padded with unused tokens to the vocabulary size. Tensors are written one at
a time, so memory stays at one tensor (113 MB) while the file grows to ~17 GiB.

    python benchmark/make_big_moe_gguf.py --out /tmp/big_moe/qwen3-30b-a3b-random-q4km.gguf [--layers 48]
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from lmdeploy.model_source import default_model_path

# bytes per 256-weight block (Q8_0: per 32); the fp16 fields set to small values (offset, scale of weights
# ~N(0, 0.02)).
# Q4_K: w = d * sc * q - dmin * m (sc, m 6-bit, q 4-bit): dmin = 7.5 d centres it; Q5_K likewise with 5-bit codes
# (dmin = 15.5 d); Q6_K: w = d * sc * (u - 32); Q8_0: w = d * q.
BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210, Q.Q8_0: 34}
FP16_FIELDS = {Q.Q4_K: ((0, 7.6e-5), (2, 5.7e-4)), Q.Q5_K: ((0, 3.7e-5), (2, 5.7e-4)), Q.Q6_K: ((208, 1.5e-5),),
               Q.Q8_0: ((0, 2.7e-4),)}


def random_blocks(shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Random ``qtype`` blocks for a float tensor of ``shape`` (rows of 256-weight blocks, Q8_0's of 32), as
    GGUFWriter takes them: ``uint8 [..., row bytes]``."""
    rows, blocks = int(np.prod(shape[:-1])), shape[-1] // gguf.GGML_QUANT_SIZES[qtype][0]
    data = np.frombuffer(rng.bytes(rows * blocks * BLOCK_BYTES[qtype]), dtype=np.uint8).copy()
    data = data.reshape(rows, blocks, BLOCK_BYTES[qtype])
    for offset, value in FP16_FIELDS[qtype]:
        scale = rng.uniform(0.5 * value, 1.5 * value, (rows, blocks)).astype(np.float16)
        data[..., offset:offset + 2] = scale.view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(*shape[:-1], blocks * BLOCK_BYTES[qtype])


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose ``attn_v`` and ``ffn_down`` Q4_K_M makes Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensors(args: argparse.Namespace) -> Iterator[tuple[str, tuple[int, ...], Q]]:
    """Each tensor's name, shape (GGUF's order reversed: rows last but one) and type, in file order."""
    hidden, heads, kv_heads, head_dim = args.hidden, args.heads, args.kv_heads, args.head_dim
    yield 'token_embd.weight', (args.vocab, hidden), Q.Q4_K
    for i in range(args.layers):
        down = Q.Q6_K if more_bits(i, args.layers) else Q.Q4_K
        yield f'blk.{i}.attn_norm.weight', (hidden,), Q.F32
        yield f'blk.{i}.attn_q.weight', (heads * head_dim, hidden), Q.Q4_K
        yield f'blk.{i}.attn_k.weight', (kv_heads * head_dim, hidden), Q.Q4_K
        yield f'blk.{i}.attn_v.weight', (kv_heads * head_dim, hidden), down
        yield f'blk.{i}.attn_q_norm.weight', (head_dim,), Q.F32
        yield f'blk.{i}.attn_k_norm.weight', (head_dim,), Q.F32
        yield f'blk.{i}.attn_output.weight', (hidden, heads * head_dim), Q.Q4_K
        yield f'blk.{i}.ffn_norm.weight', (hidden,), Q.F32
        yield f'blk.{i}.ffn_gate_inp.weight', (args.experts, hidden), Q.F32
        yield f'blk.{i}.ffn_gate_exps.weight', (args.experts, args.inter, hidden), Q.Q4_K
        yield f'blk.{i}.ffn_up_exps.weight', (args.experts, args.inter, hidden), Q.Q4_K
        yield f'blk.{i}.ffn_down_exps.weight', (args.experts, hidden, args.inter), down
    yield 'output_norm.weight', (hidden,), Q.F32
    yield 'output.weight', (args.vocab, hidden), Q.Q6_K


def tensor_data(name: str, shape: tuple[int, ...], qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype != Q.F32:
        return random_blocks(shape, qtype, rng)
    if name.endswith('ffn_gate_inp.weight'):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    return np.ones(shape, dtype=np.float32)


def add_tokenizer(writer: gguf.GGUFWriter, vocab: int) -> None:
    """The default model's ``tokenizer.*`` metadata, its tokens padded with unused ones to ``vocab``."""
    reader = GGUFReader(default_model_path())
    for key, field in reader.fields.items():
        if not key.startswith('tokenizer.'):
            continue
        value = field.contents()
        if key == 'tokenizer.ggml.tokens':
            value = value + [f'<|unused_{i}|>' for i in range(vocab - len(value))]
        elif key == 'tokenizer.ggml.token_type':
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab - len(value))
        writer.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)


def check_finite(name: str, data: np.ndarray, qtype: Q) -> float:
    """The std of the first rows' weights as ``gguf.quants.dequantize`` reads them; raises if not finite."""
    rows = gguf.quants.dequantize(data.reshape(-1, data.shape[-1])[:8], qtype)
    if not np.isfinite(rows).all():
        raise ValueError(f'{name}: non-finite weights')
    return float(rows.std())


def write_header(writer: gguf.GGUFWriter, layout: list[tuple[str, tuple[int, ...], Q]],
                 block_bytes: dict[Q, int]) -> None:
    """The file's metadata and tensor infos (``layout``: name, shape, type; 256-weight blocks of ``block_bytes``),
    written before the tensors are streamed one by one."""
    for name, shape, qtype in layout:
        if qtype == Q.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            row_bytes = shape[-1] // 256 * block_bytes[qtype]
            writer.add_tensor_info(name, (*shape[:-1], row_bytes), np.dtype(np.uint8),
                                   int(np.prod(shape[:-1])) * row_bytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()


def write_file(path: Path, args: argparse.Namespace) -> None:
    writer = gguf.GGUFWriter(str(path), 'qwen3moe')
    for add, value in [(writer.add_block_count, args.layers), (writer.add_context_length, 40960),
                       (writer.add_embedding_length, args.hidden), (writer.add_feed_forward_length, 6144),
                       (writer.add_head_count, args.heads), (writer.add_head_count_kv, args.kv_heads),
                       (writer.add_key_length, args.head_dim), (writer.add_value_length, args.head_dim),
                       (writer.add_rope_freq_base, 1e6), (writer.add_layer_norm_rms_eps, 1e-6),
                       (writer.add_expert_count, args.experts), (writer.add_expert_used_count, 8),
                       (writer.add_expert_feed_forward_length, args.inter), (writer.add_file_type, 15)]:  # Q4_K_M
        add(value)
    add_tokenizer(writer, args.vocab)
    layout = list(tensors(args))
    write_header(writer, layout, BLOCK_BYTES)
    rng = np.random.default_rng(args.seed)
    checked: set[tuple[str, Q]] = set()
    for name, shape, qtype in layout:
        data = tensor_data(name, shape, qtype, rng)
        kind = (name.split('.')[-2], qtype)
        if qtype != Q.F32 and kind not in checked:
            checked.add(kind)
            print(f'{name} {qtype.name}: weights finite, std {check_finite(name, data, qtype):.4f}')
        writer.write_tensor_data(data)
    writer.close()


def add_shape_arguments(parser: argparse.ArgumentParser, layers: int = 48) -> None:
    """The model's shape, Qwen3-30B-A3B's by default (``layers`` of them), as :func:`write_file` takes it."""
    parser.add_argument('--layers', type=int, default=layers)
    parser.add_argument('--experts', type=int, default=128)
    parser.add_argument('--hidden', type=int, default=2048)
    parser.add_argument('--inter', type=int, default=768)
    parser.add_argument('--vocab', type=int, default=151936)
    parser.add_argument('--heads', type=int, default=32)
    parser.add_argument('--kv-heads', type=int, default=4)
    parser.add_argument('--head-dim', type=int, default=128)
    parser.add_argument('--seed', type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--out', required=True)
    add_shape_arguments(parser)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    write_file(out, args)
    print(f'wrote {out} ({out.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - start:.0f} s')


if __name__ == '__main__':
    main()
