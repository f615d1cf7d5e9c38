"""Tensor parallelism on one machine: the engine's step time with tp=2 (two ranks over gloo, each on its
share of the cores) against tp=1 (one rank on all of them), in the same run.

    python benchmark/tp.py [--model PATH] [--dtype bfloat16] [--batches 1,16,64] [--prompt-len 512]
                           [--steps 20] [--repeats 2] [--backend mp]

For each tp: the prefill step of a ``--prompt-len``-token prompt (the median of three), then decode
steps at each batch size (the median of ``--steps`` steps once every sequence decodes). The engines are built one after the other
and measured in turns, ``--repeats`` times; prompts are random token ids. Also a part of
``benchmark/scale.py`` (``--parts tp``).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.engine import Engine


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def _timed_step(engine: Engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def measure(engine: Engine, batches: list[int], prompt_len: int, steps: int, seed: int) -> dict[str, float]:
    """Seconds of the median prefill step (of three) and of the median decode step at each batch size."""
    vocab = engine.model_config.vocab_size
    prefills = []
    for prompt in _prompts(3, prompt_len, vocab, seed):
        engine.add_request(prompt, GenerationConfig(max_new_tokens=1, ignore_eos=True))
        prefills.append(_timed_step(engine))
        while engine.has_unfinished():
            engine.step()
    result = {'prefill': statistics.median(prefills)}
    for batch in batches:
        config = GenerationConfig(max_new_tokens=steps + 2, ignore_eos=True)
        for prompt in _prompts(batch, 16, vocab, seed + batch):
            engine.add_request(prompt, config)
        engine.step()  # the prefill of every prompt, and each one's first token
        times = [_timed_step(engine) for _ in range(steps)]
        while engine.has_unfinished():
            engine.step()
        result[f'decode@{batch}'] = statistics.median(times)
    return result


def run(model: str | None, dtype: str, batches: list[int], prompt_len: int, steps: int, repeats: int,
        backend: str = 'mp') -> dict[int, dict[str, list[float]]]:
    """Every measurement of tp=1 and tp=2, by tp and part."""
    results: dict[int, dict[str, list[float]]] = {1: {}, 2: {}}
    for repeat in range(repeats):
        for tp in (1, 2):
            config = PytorchEngineConfig(dtype=dtype, tp=tp, distributed_executor_backend=backend,
                                         max_batch_size=max(batches), num_gpu_blocks=max(batches) * 2 + 16)
            engine = Engine(model, config, show_progress=False)
            try:
                measure(engine, batches[:1], 32, 2, seed=0)  # warm-up
                for part, seconds in measure(engine, batches, prompt_len, steps, seed=repeat + 1).items():
                    results[tp].setdefault(part, []).append(seconds)
            finally:
                engine.close()
    return results


def report(results: dict[int, dict[str, list[float]]]) -> None:
    print('| step | tp=1 ms | tp=2 ms | tp=2 / tp=1 |')
    print('| --- | ---: | ---: | ---: |')
    for part in results[1]:
        one, two = (statistics.median(results[tp][part]) * 1000 for tp in (1, 2))
        print(f'| {part} | {one:.1f} | {two:.1f} | {two / one:.2f}x |')


def tp_part(opts: argparse.Namespace) -> None:
    """``benchmark/scale.py --parts tp``: the defaults of this script, with scale.py's model and dtype."""
    report(run(opts.model, opts.dtype, [1, 16, 64], 512, 20, opts.repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None, help='model path (default: the bundled default model)')
    parser.add_argument('--dtype', default='bfloat16')
    parser.add_argument('--batches', default='1,16,64')
    parser.add_argument('--prompt-len', type=int, default=512)
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--repeats', type=int, default=2)
    parser.add_argument('--backend', default='mp', choices=['mp', 'ray'])
    opts = parser.parse_args()
    report(run(opts.model, opts.dtype, [int(b) for b in opts.batches.split(',')], opts.prompt_len, opts.steps,
               opts.repeats, opts.backend))


if __name__ == '__main__':
    main()
