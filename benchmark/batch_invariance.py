"""Whether a prompt's output depends on what else shares its steps: per engine configuration, greedy tokens and
their logprobs of each prompt run with the others against the same prompt run alone on the same engine, printed
as a table of the prompts that differ (tokens, and logprobs bitwise).

    python benchmark/batch_invariance.py [--num-prompts 24] [--new-tokens 24] [--gemma] [--threads 1]

Prompts: random token ids (seed 1, ids below 40000), lengths 5 + 7 i. Two ways of sharing:

- ``batched``: every prompt queued at once (their prefills share steps, then their decodes: 24 rows a step);
- ``arrivals``: one prompt queued per step, so each prompt's prefill shares a step with the decode rows of the
  prompts before it.

Configurations: the default model (Q4_1 GGUF) in bf16 with ``decode_int4`` as the engine sets it (on for Q4_1:
what ``lmdeploy chat`` and ``serve`` run), in bf16 with ``decode_int4`` off, in fp32; ``--gemma`` adds the real
Gemma 3 270M Q4_K_M in bf16 (253 MB, fetched once).
"""
from __future__ import annotations

import argparse
import gc
import time

import torch

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import default_model_path, gemma3_270m_path
from lmdeploy.pytorch.engine.engine import Engine

# (token ids, logprobs) of each step of one prompt
Outputs = list[tuple[list[int], object]]


def random_prompts(num_prompts: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 40000, (5 + 7 * i, ), generator=g).tolist() for i in range(num_prompts)]


def run(engine: Engine, prompts: list[list[int]], gen: GenerationConfig, per_step: int) -> list[Outputs]:
    """Each prompt's outputs, ``per_step`` prompts queued before each step (all at once when 0)."""
    outs: list[Outputs] = [[] for _ in prompts]
    index: dict[int, int] = {}
    waiting = list(enumerate(prompts))
    while waiting or engine.has_unfinished():
        for i, prompt in waiting[:per_step or len(waiting)]:
            index[engine.add_request(prompt, gen)] = i
        waiting = waiting[per_step or len(waiting):]
        for out in engine.step():
            outs[index[out.seq_id]].append((list(out.token_ids), out.logprobs))
    return outs


def differing(shared: list[Outputs], alone: list[Outputs]) -> tuple[int, int]:
    """The prompts whose tokens differ, and those whose tokens or logprobs differ."""
    tokens = sum(1 for a, b in zip(shared, alone) if [t for t, _ in a] != [t for t, _ in b])
    return tokens, sum(1 for a, b in zip(shared, alone) if a != b)


def measure(path: str, config: PytorchEngineConfig, prompts: list[list[int]], gen: GenerationConfig) -> dict:
    engine = Engine(path, config, show_progress=False)
    try:
        alone = [run(engine, [prompt], gen, 0)[0] for prompt in prompts]
        return {name: differing(run(engine, prompts, gen, per_step), alone)
                for name, per_step in (('batched', 0), ('arrivals', 1))}
    finally:
        engine.close()
        gc.collect()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--num-prompts', type=int, default=24)
    parser.add_argument('--new-tokens', type=int, default=24)
    parser.add_argument('--gemma', action='store_true', help='also Gemma 3 270M Q4_K_M in bf16')
    parser.add_argument('--threads', type=int, default=None, help="torch's threads (default: its own)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = random_prompts(args.num_prompts)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, ignore_eos=True, logprobs=5)
    configs = [('default model, bf16, decode_int4 auto', default_model_path(), dict(dtype='bfloat16')),
               ('default model, bf16, decode_int4 off', default_model_path(),
                dict(dtype='bfloat16', decode_int4=False)),
               ('default model, fp32', default_model_path(), dict(dtype='float32'))]
    if args.gemma:
        configs.append(('Gemma 3 270M Q4_K_M, bf16', gemma3_270m_path(), dict(dtype='bfloat16')))
    print(f'{args.num_prompts} prompts, {args.new_tokens} greedy tokens each, logprobs=5; '
          'prompts that differ from the same prompt run alone: tokens / tokens or logprobs (bitwise)')
    print(f'| configuration | batched | arrivals | seconds |\n| --- | --- | --- | --- |')
    for name, path, options in configs:
        start = time.perf_counter()
        result = measure(path, PytorchEngineConfig(**options), prompts, gen)
        cells = ' | '.join(f'{tokens} / {any_diff}' for tokens, any_diff in result.values())
        print(f'| {name} | {cells} | {time.perf_counter() - start:.0f} |', flush=True)


if __name__ == '__main__':
    main()
