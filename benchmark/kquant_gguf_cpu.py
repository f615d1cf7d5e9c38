"""Memory and speed of a dense Llama GGUF file of K-quant blocks in bf16 on the CPU, one thread: RSS once loaded,
the thread CPU time of a ``--prefill-tokens`` prefill (one step) and its minor page faults (the process's), the
thread CPU time of batch-1 decode tokens, and peak RSS; each source tree of ``--trees`` in a fresh process, the
trees' order alternating from round to round, so that a change is measured against the tree it replaces (a ``git
archive`` of the commit before it, say).

The file: TinyLlama-1.1B's widths (hidden 2048, intermediate 5632, 32 heads, 4 KV heads of 64), ``--layers`` of
them, the default model's tokenizer (vocabulary 49152), random blocks (``make_big_moe_gguf.random_blocks``) laid
out as llama.cpp's ``--mix`` lays out a Llama: ``q4km`` Q4_K, ``q5km`` Q5_K, with Q6_K ``attn_v`` and ``ffn_down``
in the layers ``use_more_bits`` picks and a Q6_K output; the token embedding Q4_K (Q5_K in ``q5km``); ``q8_0``
every tensor Q8_0, as llama.cpp's Q8_0 files. Each line says whether the layers ran in the native decoder stack.

    python benchmark/kquant_gguf_cpu.py --mix q4km --trees /tmp/before,. --dir /tmp/q4km_bench

``--gguf FILE`` serves an existing file instead (the real Gemma 3 270M: ``model_source.gemma3_270m_path()``),
converted by each tree for itself into ``--dir`` (a change to the conversion is measured with it):

    python benchmark/kquant_gguf_cpu.py --gguf ~/.cache/lmdeploy/models/gemma-3-270m-q4_k_m.gguf \
        --trees /tmp/before,. --dir /tmp/gemma_bench --prefill-tokens 64

``--no-amx`` runs the children as on a CPU without AMX: oneDNN limited to AVX512-BF16 (``ONEDNN_MAX_CPU_ISA``) and
the engine told so (torch's ``_is_amx_tile_supported`` answers False). ``--gemv-max-rows`` runs each tree once more
with the K-quant GEMVs' bounds set to the given rows (``q4k=32,q6k=16``: ``GEMV_MAX_ROWS``, whatever the CPU), as a
"before" in the same tree.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).parent))
from gguf_moe_rss import peak_rss_gib, rss_gib  # noqa: E402
from make_big_moe_gguf import add_tokenizer, more_bits, random_blocks  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 5632, 32, 4, 64, 49152
MIXES = {'q4km': Q.Q4_K, 'q5km': Q.Q5_K, 'q8_0': Q.Q8_0}


def write_dense_gguf(path: Path, mix: str, layers: int, seed: int = 0) -> None:
    """The Llama file of the module docstring, written tensor by tensor."""
    base = MIXES[mix]
    writer = gguf.GGUFWriter(str(path), 'llama')
    for add, value in [(writer.add_block_count, layers), (writer.add_context_length, 2048),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FFN),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_rope_dimension_count, HEAD_DIM), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_layer_norm_rms_eps, 1e-5)]:
        add(value)
    add_tokenizer(writer, VOCAB)
    rng = np.random.default_rng(seed)
    writer.add_tensor('token_embd.weight', random_blocks((VOCAB, HIDDEN), base, rng), raw_dtype=base)
    for i in range(layers):
        more = Q.Q6_K if more_bits(i, layers) and base != Q.Q8_0 else base
        writer.add_tensor(f'blk.{i}.attn_norm.weight', np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f'blk.{i}.ffn_norm.weight', np.ones(HIDDEN, dtype=np.float32))
        for name, shape, qtype in [('attn_q', (HEADS * HEAD_DIM, HIDDEN), base),
                                   ('attn_k', (KV_HEADS * HEAD_DIM, HIDDEN), base),
                                   ('attn_v', (KV_HEADS * HEAD_DIM, HIDDEN), more),
                                   ('attn_output', (HIDDEN, HEADS * HEAD_DIM), base),
                                   ('ffn_gate', (FFN, HIDDEN), base), ('ffn_up', (FFN, HIDDEN), base),
                                   ('ffn_down', (HIDDEN, FFN), more)]:
            writer.add_tensor(f'blk.{i}.{name}.weight', random_blocks(shape, qtype, rng), raw_dtype=qtype)
    writer.add_tensor('output_norm.weight', np.ones(HIDDEN, dtype=np.float32))
    output = Q.Q8_0 if base == Q.Q8_0 else Q.Q6_K
    writer.add_tensor('output.weight', random_blocks((VOCAB, HIDDEN), output, rng), raw_dtype=output)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def child(folder: str, args: argparse.Namespace) -> None:
    """Loads ``folder`` in bf16 with one thread and prints RSS, then the prefill and decode times of each repeat
    (after a warm-up) and the peak RSS."""
    from llamacpp_b1 import CLOCK, engine_decode_rate, engine_prefill_rate

    import lmdeploy
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    from lmdeploy.pytorch.kernels import cpu
    CLOCK[0] = time.thread_time
    if args.no_amx or args.bounds:  # needs a tree with per-CPU bounds
        from kquant_rows_cpu import set_bounds
        set_bounds(args.no_amx, args.bounds)
    if args.native_bf16_gemm and cpu.native() is not None and cpu.native().bf16_gemm_available():
        cpu.bf16_gemm = cpu.native  # as stack_timing.stack_engine: on AMX CPUs bf16 weights prefer oneDNN
    tokens = args.prefill_tokens + args.decode_tokens + 16
    config = PytorchEngineConfig(dtype='bfloat16', num_threads=1, block_size=16, num_gpu_blocks=tokens // 16 + 4,
                                 enable_prefix_caching=False, max_prefill_token_num=args.prefill_tokens,
                                 decode_int4=True if args.decode_int4 else None)
    engine = Engine(folder, config, show_progress=False)
    tree = Path(lmdeploy.__file__).parents[1]
    stack = engine.runner.model.native_stack is not None
    bounds = f', GEMV bounds {args.bounds}' if args.bounds else ''
    print(f'{tree}: RSS loaded {rss_gib():.3f} GiB (peak while loading {peak_rss_gib():.3f}), '
          f'native stack {"on" if stack else "off"}, AMX '
          f'{cpu.onednn_amx()}{bounds}', flush=True)
    rng = np.random.default_rng(1)
    long_prompt = rng.integers(100, 40000, args.prefill_tokens).tolist()
    prompt = long_prompt[:16]
    try:
        engine_prefill_rate(engine, long_prompt)  # warm-up
        if args.decode_tokens:
            engine_decode_rate(engine, prompt, 4)
        prefill, decode, faults = [], [], []
        for _ in range(args.repeats):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            prefill.append(args.prefill_tokens / engine_prefill_rate(engine, long_prompt) * 1e3)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
            if args.decode_tokens:
                decode.append(1e3 / engine_decode_rate(engine, prompt, args.decode_tokens)[0])
        decoded = (f'decode: best {min(decode):.2f} ms/token, median {statistics.median(decode):.2f}'
                   if decode else 'no decode between')
        print(f'{tree}{bounds}: prefill {args.prefill_tokens}: best {min(prefill):.0f} ms, median '
              f'{statistics.median(prefill):.0f} ms, {statistics.median(faults):.0f} page faults (median); '
              f'{decoded}; peak RSS {peak_rss_gib():.3f} GiB', flush=True)
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--mix', choices=sorted(MIXES), default='q4km')
    parser.add_argument('--layers', type=int, default=8)
    parser.add_argument('--trees', default='.', help='lmdeploy source trees, comma-separated')
    parser.add_argument('--dir', default='/tmp/kquant_gguf_cpu',
                        help='where the file and its converted folder go (kept)')
    parser.add_argument('--prefill-tokens', type=int, default=512)
    parser.add_argument('--decode-tokens', type=int, default=16, help='0: prefills only, none between them')
    parser.add_argument('--repeats', type=int, default=3)
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--native-bf16-gemm', action='store_true',
                        help='bf16 weights (a Q6_K layer\'s copy before it was dropped) on the native bf16 GEMM, '
                        'not oneDNN (which AMX CPUs prefer, and on which the native stack does not run)')
    parser.add_argument('--no-amx', action='store_true', help='as on a CPU without AMX (see above)')
    parser.add_argument('--gemv-max-rows', default='', help='K-quant GEMV bounds of a second run of each tree, '
                        'as q4k=32,q5k=32,q6k=16,q8_0=16')
    parser.add_argument('--gguf', help='an existing file, converted by each tree (see above)')
    parser.add_argument('--decode-int4', action='store_true', help='small steps on 4-bit copies, the LM head\'s '
                        'one-row steps on its 8-bit or fp16 copy (PytorchEngineConfig.decode_int4)')
    parser.add_argument('--bounds', help=argparse.SUPPRESS)
    parser.add_argument('--child', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args)
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    trees = [str(Path(tree).resolve()) for tree in args.trees.split(',')]
    if args.gguf:
        path, served = Path(args.gguf), {tree: folder / f'served_{index}' for index, tree in enumerate(trees)}
        for tree, tree_folder in served.items():
            if not tree_folder.exists():
                convert = ('import sys; from lmdeploy.pytorch.weights.gguf import convert_gguf; '
                           'convert_gguf(*sys.argv[1:])')
                subprocess.run([sys.executable, '-c', convert, str(path), str(tree_folder)], check=True,
                               env=dict(os.environ, PYTHONPATH=tree), cwd=folder)  # not this tree from the cwd
        print(f'{path.name}: {path.stat().st_size / 2**20:.0f} MiB, converted by each tree', flush=True)
    else:
        path = folder / f'{args.mix}.gguf'
        served = dict.fromkeys(trees, folder / f'{args.mix}_served')
        if not served[trees[0]].exists():
            from lmdeploy.pytorch.weights.gguf import convert_gguf
            write_dense_gguf(path, args.mix, args.layers)
            convert_gguf(str(path), str(served[trees[0]]))
        print(f'{path.name}: {path.stat().st_size / 2**20:.0f} MiB, {args.layers} layers', flush=True)
    forwarded = [f'--prefill-tokens={args.prefill_tokens}', f'--decode-tokens={args.decode_tokens}',
                 f'--repeats={args.repeats}'] + (['--native-bf16-gemm'] if args.native_bf16_gemm else []) + (
                     ['--decode-int4'] if args.decode_int4 else [])
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA='AVX512_CORE_BF16') if args.no_amx else dict(os.environ)
    forwarded += ['--no-amx'] if args.no_amx else []
    bounds_runs = [''] + ([args.gemv_max_rows] if args.gemv_max_rows else [])
    runs = [(tree, bounds) for tree in trees for bounds in bounds_runs]
    for index in range(args.rounds):
        for tree, bounds in runs if index % 2 == 0 else runs[::-1]:
            subprocess.run([sys.executable, __file__, *forwarded, f'--bounds={bounds}', '--child', str(served[tree])],
                           check=True, env=dict(env, PYTHONPATH=tree))


if __name__ == '__main__':
    main()
