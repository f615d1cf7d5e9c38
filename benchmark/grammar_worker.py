"""What compiling in worker processes costs: the first structured request's extra latency (a worker's start),
each worker's start-up CPU time and memory, a second engine's first compile on the same (shared) workers, and
the per-compile overhead of compiling in a worker first, against in-process compiles of the same formats.

    python benchmark/grammar_worker.py [--model PATH] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time


def schema(i: int) -> dict:
    """A small schema, different for each ``i`` (so that no cache answers it)."""
    return {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': {
        'type': 'object', 'required': ['name', 'age'], 'properties': {
            'name': {'type': 'string', 'maxLength': 20 + i}, 'age': {'type': 'integer', 'minimum': 0},
            'tags': {'type': 'array', 'items': {'enum': ['a', 'b', f'c{i}']}}}}}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--model', help='model folder (default: the default model)')
    parser.add_argument('--repeat', type=int, default=5)
    args = parser.parse_args()

    import psutil
    import xgrammar as xgr

    from lmdeploy import GenerationConfig
    from lmdeploy.model_source import resolve_model_path
    from lmdeploy.pytorch.engine.grammar_worker import GrammarProcessPool
    from lmdeploy.pytorch.engine.guided import GrammarCompiler, compile_format
    from lmdeploy.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model_path(args.model))
    compiler = GrammarCompiler(tokenizer, len(tokenizer.hf))
    start = time.perf_counter()
    info = compiler.tokenizer_info()
    print(f'vocab {len(tokenizer.hf)}: tokenizer info {time.perf_counter() - start:.3f} s, '
          f'{len(info.serialize_json()) / 2 ** 20:.1f} MiB as JSON')
    local = xgr.GrammarCompiler(info, cache_enabled=False)
    pool = GrammarProcessPool(compiler, 2)
    try:
        start = time.perf_counter()
        pool.start().result()
        print(f'start of 2 workers (what the first structured request waits for): {time.perf_counter() - start:.3f} s')
        for pid in pool.worker_pids():
            worker = psutil.Process(pid)
            cpu, memory = worker.cpu_times(), worker.memory_full_info()
            print(f'worker {pid} once started: {cpu.user + cpu.system:.2f} s CPU, {memory.rss / 2 ** 20:.0f} MiB '
                  f'resident, {memory.uss / 2 ** 20:.0f} MiB its own')
        start = time.perf_counter()
        pool.submit(GenerationConfig(response_format=schema(0))).future.result()  # out of the medians below
        print(f'first compile (its worker reads the vocabulary first): {time.perf_counter() - start:.3f} s')
        second = GrammarProcessPool(GrammarCompiler(tokenizer, len(tokenizer.hf)), 2)  # another engine's
        try:
            start = time.perf_counter()
            second.submit(GenerationConfig(response_format=schema(-1))).future.result()
            print(f'a second pool of this process, its first compile (its own vocabulary read here and in the worker): '
                  f'{time.perf_counter() - start:.3f} s, '
                  f'{len(set(second.worker_pids()) - set(pool.worker_pids()))} processes started for it')
        finally:
            second.close()
        times = {'worker': [], 'in-process': []}
        for i in range(1, args.repeat + 1):
            fmt = schema(i)
            start = time.perf_counter()
            pool.submit(GenerationConfig(response_format=fmt)).future.result()
            times['worker'].append(time.perf_counter() - start)
            start = time.perf_counter()
            compiled = compile_format(local, fmt)
            times['in-process'].append(time.perf_counter() - start)
        start = time.perf_counter()
        text = compiled.serialize_json()
        middle = time.perf_counter()
        xgr.CompiledGrammar.deserialize_json(text, info)
        print(f'serialized grammar {len(text) / 2 ** 10:.0f} KiB: serialize {(middle - start) * 1000:.1f} ms, '
              f'deserialize {(time.perf_counter() - middle) * 1000:.1f} ms')
        for name, values in times.items():
            print(f'{name}: median {statistics.median(values) * 1000:.1f} ms')
    finally:
        pool.close()


if __name__ == '__main__':
    main()
