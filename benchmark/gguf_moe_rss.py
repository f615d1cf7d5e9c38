"""Conversion time and peak memory (RSS) of a MoE GGUF file, and of serving it in bf16 on the CPU with batch-1
decode tokens/s, each in a fresh process: a ``qwen3moe`` file of random Q4_K_M-like blocks at Qwen3-30B-A3B's
shape (``benchmark/make_big_moe_gguf.py``; fewer layers by default), or the file given with ``--gguf``. The
experts stay as their blocks, so both peaks should stay near the file's size plus one layer, far under the
experts' size in bf16. The KV cache is capped at ``--cache-blocks`` blocks of 16 tokens.

    python benchmark/gguf_moe_rss.py [--layers 4] [--dir /tmp/x] [--decode-tokens 32] [--threads 2]
    python benchmark/gguf_moe_rss.py --gguf /tmp/big_moe/qwen3-30b-a3b-random-q4km.gguf --dir /tmp/big_moe
    python benchmark/gguf_moe_rss.py --dir /tmp/x --served --account   # serve an already converted folder

``--account`` splits the served process's anonymous memory: the runtime (imports), the model's tensors, the KV
cache, and what glibc malloc holds beyond them, before and after ``malloc_trim(0)`` (``memory_accounting.py``).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).parent))
import memory_accounting  # noqa: E402
from make_big_moe_gguf import add_shape_arguments, write_file  # noqa: E402

from lmdeploy.pytorch.weights.safetensors_loader import release_free_heap  # noqa: E402

if TYPE_CHECKING:
    from lmdeploy.pytorch.engine.engine import Engine

PROMPT = 'The printing press changed how books were made in Europe because'


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def rss_gib(field: str = 'VmRSS') -> float:
    """The resident set now (``VmRSS``), or its anonymous part (``RssAnon``) or the mapped files' pages (``RssFile``,
    reclaimable)."""
    status = Path('/proc/self/status').read_text()
    return int(next(line for line in status.splitlines() if line.startswith(f'{field}:')).split()[1]) / 2**20


def child(mode: str, gguf_path: str, folder: str, args: argparse.Namespace) -> None:
    """Converts the file into ``folder`` (``convert``), or serves that folder (``serve``: loads it in bf16 and
    decodes ``--decode-tokens`` tokens at batch 1 after a warm-up), printing times, rates and peak RSS."""
    start, cpu_start = time.perf_counter(), time.process_time()
    if mode == 'convert':
        from lmdeploy.pytorch.weights.gguf import convert_gguf
        convert_gguf(gguf_path, folder)
        print(f'converted in {time.perf_counter() - start:.0f} s (CPU {time.process_time() - cpu_start:.0f} s); '
              f'peak RSS {peak_rss_gib():.2f} GiB', flush=True)
        return
    from llamacpp_b1 import engine_decode_rate

    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    runtime_gib = memory_accounting.anonymous_gib()
    config = PytorchEngineConfig(dtype='bfloat16', num_gpu_blocks=args.cache_blocks, block_size=16,
                                 num_threads=args.threads, enable_prefix_caching=False)
    engine = Engine(folder, config, show_progress=False)
    print(f'loaded in {time.perf_counter() - start:.0f} s (CPU {time.process_time() - cpu_start:.0f} s); '
          f'peak RSS {peak_rss_gib():.2f} GiB, '
          f'RSS now {rss_gib():.2f} GiB (anonymous {rss_gib("RssAnon"):.2f}, files {rss_gib("RssFile"):.2f})',
          flush=True)
    if args.account:
        account(engine, runtime_gib, 'after load')
    try:
        prompt = engine.tokenizer.encode(PROMPT)
        engine_decode_rate(engine, prompt, 4)  # warm-up
        for _ in range(args.rounds):
            rate, tokens = engine_decode_rate(engine, prompt, args.decode_tokens)
            print(f'decode {args.decode_tokens} tokens at batch 1, {args.threads} threads: {rate:.2f} tok/s',
                  flush=True)
        print(f'greedy tokens: {tokens}', flush=True)
        if args.account:
            account(engine, runtime_gib, 'after decode')
        print(f'serving peak RSS {peak_rss_gib():.2f} GiB; now {rss_gib():.2f} GiB '
              f'(anonymous {rss_gib("RssAnon"):.2f}, files {rss_gib("RssFile"):.2f})', flush=True)
    finally:
        engine.close()


def account(engine: Engine, runtime_gib: float, when: str) -> None:
    """Prints the served process's anonymous memory split into the runtime, the model's tensors, the KV cache and
    the rest, with malloc's counts, then the same after ``malloc_trim(0)``."""
    model = memory_accounting.storages([engine.runner.model])
    cache = memory_accounting.storages([engine.runner.kv_caches])
    every = memory_accounting.all_tensor_storages()
    others = {ptr: size for ptr, size in every.items() if ptr not in model and ptr not in cache}
    model_gib, cache_gib = memory_accounting.gib(model), memory_accounting.gib(cache)
    for label in ('', ' after malloc_trim(0)'):
        if label:
            release_free_heap()
        anonymous = memory_accounting.anonymous_gib()
        rest = anonymous - runtime_gib - model_gib - cache_gib
        heap = ', '.join(f'{k} {v:.3f}' for k, v in memory_accounting.malloc_gib().items())
        print(f'{when}{label}: anonymous {anonymous:.3f} GiB = runtime {runtime_gib:.3f} + model tensors '
              f'{model_gib:.3f} ({len(model)} storages) + KV cache {cache_gib:.3f} + rest {rest:.3f} '
              f'(other tensors {memory_accounting.gib(others):.3f}); malloc GiB: {heap}', flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, layers=4)
    parser.add_argument('--gguf', default=None, help='an existing MoE GGUF file (default: write one)')
    parser.add_argument('--dir', default=None)
    parser.add_argument('--decode-tokens', type=int, default=32)
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--cache-blocks', type=int, default=16)
    parser.add_argument('--served', action='store_true', help='serve the converted folder DIR/served as it is')
    parser.add_argument('--account', action='store_true', help='split the served memory (see above)')
    parser.add_argument('--child', nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child, args)
    folder = Path(args.dir or tempfile.mkdtemp(prefix='gguf_moe_rss'))
    folder.mkdir(parents=True, exist_ok=True)
    gguf_path = Path(args.gguf) if args.gguf else folder / 'model.gguf'
    if not args.gguf and not args.served:
        write_file(gguf_path, args)
    served = folder / 'served'
    if not args.served:
        print(f'file {gguf_path.stat().st_size / 2**30:.2f} GiB', flush=True)
    forwarded = [f'--{name}={value}' for name, value in
                 (('decode-tokens', args.decode_tokens), ('rounds', args.rounds), ('threads', args.threads),
                  ('cache-blocks', args.cache_blocks))] + (['--account'] if args.account else [])
    for mode in ('serve',) if args.served else ('convert', 'serve'):
        out = subprocess.run([sys.executable, __file__, *forwarded, '--child', mode, str(gguf_path), str(served)],
                             check=True, stdout=subprocess.PIPE, text=True, env=os.environ)
        print(out.stdout.strip())


if __name__ == '__main__':
    main()
