"""What batch invariance costs: the default model (bf16, ``decode_int4`` on as for its Q4_1 file), or with
``--gemma`` Gemma 3 270M Q4_K_M in bf16 (its K-quant layers' GEMVs), in two source trees, before and after, each round
a fresh process per tree, the trees alternating, one thread, the calling thread's CPU time (the engine computes in it
with one thread: on a machine that other jobs load, what each tree computes rather than what the scheduler gives it;
cache sharing still counts).

    python benchmark/batch_invariance_cost.py --before /path/to/tree --after . [--rounds 3] [--gemma]

Per tree: ``b1 decode`` ms a step (one sequence, the median of its 64 decode steps), ``24-row decode``, ``64-row
decode`` and ``128-row decode`` ms a step (as many sequences decoding together, median of 24 steps), ``arrivals`` ms
in all for 16 prompts of 64-184 tokens queued one a step, 32 new tokens each (prefills share steps with decode rows:
mixed steps), and ``batched`` ms in all for the same prompts queued at once. Prints each round, then the best of each
and the ratios after / before.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, statistics, sys, time, torch
torch.set_num_threads(1)
from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import default_model_path, gemma3_270m_path
from lmdeploy.pytorch.engine.engine import Engine

path = gemma3_270m_path() if sys.argv[1] == 'gemma' else default_model_path()
engine = Engine(path, PytorchEngineConfig(dtype='bfloat16', enable_prefix_caching=False, max_batch_size=128),
                show_progress=False)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(3, 40000, (64 + 8 * i,), generator=g).tolist() for i in range(16)]


def steps(gen, queue, per_step=0):
    """Thread CPU ms of each step, ``per_step`` prompts queued before each (0: all at once)."""
    times, waiting = [], list(queue)
    while waiting or engine.has_unfinished():
        for prompt in waiting[:per_step or len(waiting)]:
            engine.add_request(prompt, gen)
        waiting = waiting[per_step or len(waiting):]
        start = time.thread_time()
        engine.step()
        times.append(1e3 * (time.thread_time() - start))
    return times


steps(GenerationConfig(max_new_tokens=8, ignore_eos=True), prompts[:4])  # warm-up
b1 = steps(GenerationConfig(max_new_tokens=66, ignore_eos=True), prompts[:1])
decode = GenerationConfig(max_new_tokens=26, ignore_eos=True)
rows24 = steps(decode, [p[:8] for p in prompts + prompts[:8]])
rows64 = steps(decode, [p[:8] for p in prompts * 4])
rows128 = steps(decode, [p[:8] for p in prompts * 8])
gen = GenerationConfig(max_new_tokens=32, ignore_eos=True)
print(json.dumps({'b1 decode': statistics.median(b1[2:]), '24-row decode': statistics.median(rows24[2:]),
                  '64-row decode': statistics.median(rows64[2:]), '128-row decode': statistics.median(rows128[2:]),
                  'arrivals': sum(steps(gen, prompts, 1)),
                  'batched': sum(steps(gen, prompts))}))
'''


def measure(tree: str, model: str) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), OMP_NUM_THREADS='1')
    out = subprocess.run([sys.executable, '-c', CHILD, model], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.abspath(tree))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--before', required=True, help='the source tree before')
    parser.add_argument('--after', default='.', help='the source tree after')
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--gemma', action='store_true', help='Gemma 3 270M Q4_K_M instead of the default model')
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {'before': [], 'after': []}
    for round_ in range(args.rounds):
        order = ('before', 'after') if round_ % 2 == 0 else ('after', 'before')
        for name in order:
            results[name].append(measure(getattr(args, name), 'gemma' if args.gemma else 'default'))
            print(name, round_, {k: round(v, 2) for k, v in results[name][-1].items()}, flush=True)
    print('| ms (thread CPU, best of rounds) | before | after | after / before |\n| --- | --- | --- | --- |')
    for key in results['before'][0]:
        before, after = (min(r[key] for r in results[name]) for name in ('before', 'after'))
        print(f'| {key} | {before:.2f} | {after:.2f} | {after / before:.3f} |')


if __name__ == '__main__':
    main()
