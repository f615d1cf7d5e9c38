"""vLLM's CPU build against this engine on the same random-weight bf16 model, back to back, printing the ratio.

The model has the default model's exact shape (random weights give the same speed under ``ignore_eos``)
and is saved once into a temporary folder that both sides load. Each side runs as a subprocess with
its own interpreter, in alternating rounds (vLLM first in even rounds, this engine first in odd ones),
so that the VM's drift favours neither:

- vLLM: ``vllm_throughput.py`` with ``--vllm-python`` (its own environment, set up as that script's
  docstring says), threads bound to every core, tcmalloc and vLLM's Intel OpenMP preloaded where found;
- this engine: ``throughput.py --skip-hf --skip-int4 --dtype bfloat16`` with this interpreter (bf16,
  ``decode_int4`` off, prefix caching off as vLLM's).

Both use the offline workload of ``throughput.py`` and check their token counts.

    python benchmark/vllm_compare.py [--vllm-python /tmp/vllmenv/bin/python] [--rounds 2]
        [--num-prompts 64] [--decode-tokens 128]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from workload import save_default_shaped_model

HERE = Path(__file__).resolve().parent
TCMALLOC = '/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4'
ROW = re.compile(r'^[^:\n]+:\s+(?P<offline>[\d.]+) output tok/s\s+batch-1 decode\s+(?P<batch1>[\d.]+) tok/s',
                 re.MULTILINE)


def vllm_env(vllm_python: str) -> dict[str, str]:
    """vLLM's CPU settings: OpenMP threads bound to every core, 4 GiB of KV cache, tcmalloc and Intel OpenMP."""
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    cores = sorted(os.sched_getaffinity(0))
    contiguous = cores == list(range(cores[0], cores[-1] + 1))
    env['VLLM_CPU_OMP_THREADS_BIND'] = f'{cores[0]}-{cores[-1]}' if contiguous else ','.join(map(str, cores))
    env.setdefault('VLLM_CPU_KVCACHE_SPACE', '4')
    iomp = Path(vllm_python).parent.parent / 'lib' / 'libiomp5.so'  # the venv's, not the resolved interpreter's
    preload = [str(p) for p in (Path(TCMALLOC), iomp) if p.is_file()]
    if preload:
        env['LD_PRELOAD'] = ':'.join(preload)
    return env


def run_side(name: str, cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Runs one side and returns its (offline output tok/s, batch-1 decode tok/s) as it printed them."""
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    match = ROW.search(proc.stdout)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(f'{name} failed (exit {proc.returncode}): {" ".join(cmd)}\n'
                           f'{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}')
    print(f'  {match.group(0).strip()}', flush=True)
    return float(match['offline']), float(match['batch1'])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--vllm-python', default='/tmp/vllmenv/bin/python', help="vLLM's environment's python")
    parser.add_argument('--rounds', type=int, default=2)
    parser.add_argument('--num-prompts', type=int, default=64)
    parser.add_argument('--decode-tokens', type=int, default=128)
    args = parser.parse_args()
    common = ['--num-prompts', str(args.num_prompts), '--decode-tokens', str(args.decode_tokens)]
    ours_env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parent),
                                                                        os.environ.get('PYTHONPATH')])))
    theirs_env = vllm_env(args.vllm_python)
    print(f"vLLM: {args.vllm_python}, LD_PRELOAD={theirs_env.get('LD_PRELOAD', '')}, "
          f"VLLM_CPU_OMP_THREADS_BIND={theirs_env['VLLM_CPU_OMP_THREADS_BIND']}", flush=True)
    ratios: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as folder:
        save_default_shaped_model(folder)
        sides = {
            'vllm': ([args.vllm_python, str(HERE / 'vllm_throughput.py'), '--model', folder, *common], theirs_env),
            'lmdeploy': ([sys.executable, str(HERE / 'throughput.py'), '--model', folder, '--dtype', 'bfloat16',
                          '--skip-hf', '--skip-int4', *common], ours_env),
        }
        for r in range(args.rounds):
            order = ['vllm', 'lmdeploy'] if r % 2 == 0 else ['lmdeploy', 'vllm']
            print(f'round {r + 1} ({" then ".join(order)}):', flush=True)
            got = {name: run_side(name, *sides[name]) for name in order}
            ratio = (got['lmdeploy'][0] / got['vllm'][0], got['lmdeploy'][1] / got['vllm'][1])
            ratios.append(ratio)
            print(f'  ratio lmdeploy / vllm: {ratio[0]:.2f}x throughput   {ratio[1]:.2f}x batch-1 decode', flush=True)
    offline, batch1 = (statistics.median(r[i] for r in ratios) for i in range(2))
    print(f'median ratio lmdeploy / vllm over {len(ratios)} rounds: {offline:.2f}x throughput   '
          f'{batch1:.2f}x batch-1 decode')


if __name__ == '__main__':
    main()
