"""What a start costs, phase by phase, from ``import lmdeploy`` to the first token, each start in a fresh process:
the default model as ``lmdeploy chat`` starts it (``pipeline()``: bf16, ``decode_int4`` on its Q4_1 weights, the KV
cache sized from memory), Gemma 3 270M Q4_K_M the same way, and a tiny random Llama as the tests start it (fp32,
128 blocks of 16). With ``--base TREE`` each round starts the same model from ``TREE`` (another checkout, e.g. a
worktree of main) and from this one, alternately, and the table gives the median of each side and their ratio;
``--base-env VAR=VALUE`` starts the base side with that variable set (without ``--base``, this tree is the base:
``--base-env LMDEPLOY_DERIVED_CACHE_BYTES=0`` compares a start without the derived-weight cache).

    python benchmark/startup.py                                    # this tree, 3 rounds
    python benchmark/startup.py --base /work/wt/startup_base --rounds 5 --models default tiny

Phases (wall seconds; ``cpu`` is the process's CPU seconds over all its threads): ``import`` (the modules the
entry point needs), ``native kernels`` (loading the compiled CPU kernels, built once per source), ``model source``
(a GGUF file's converted folder: found in the cache, or converted), ``tokenizer``, ``weights load`` (read and
cast), ``finalize`` (kernel packing, 4-bit grid fit, small-step copies), ``KV cache`` (allocating it, and the
runner), ``engine rest`` (the rest of ``Engine()``: scheduler, grammar compiler), ``pipeline rest`` (the rest of
``pipeline()``), ``first token`` (a one-token reply to a short prompt). Every side runs once unmeasured first, so
that both read warm files and caches (a first start also converts a GGUF file and fits the 4-bit grids, once).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = ('default', 'gemma3', 'tiny')
PHASES = ('import', 'native kernels', 'model source', 'tokenizer', 'weights load', 'finalize', 'KV cache',
          'engine rest', 'pipeline rest', 'first token', 'total')
PROMPT = 'Hi, who are you?'


class Clock:
    """Wall and CPU seconds spent in named phases."""

    def __init__(self):
        self.spent: dict[str, list[float]] = {}

    def add(self, name: str, wall: float, cpu: float) -> None:
        total = self.spent.setdefault(name, [0.0, 0.0])
        total[0] += wall
        total[1] += cpu

    def timed(self, name: str, fn):
        def wrapper(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(name, time.perf_counter() - wall, time.process_time() - cpu)
        return wrapper


def child(model: str, model_path: str | None) -> dict[str, list[float]]:
    """Starts ``model`` in this process and returns its phases (run in a fresh process by the parent)."""
    clock = Clock()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    clock.timed('import', _import_entry_points)(model)
    from lmdeploy.pytorch.engine import engine as engine_module
    from lmdeploy.pytorch.engine import runner_builder
    from lmdeploy.pytorch.engine.model_runner import ModelRunner
    from lmdeploy.pytorch.kernels import cpu
    from lmdeploy.tokenizer import Tokenizer
    clock.timed('native kernels', cpu.native)()
    engine_module.resolve_model_path = clock.timed('model source', engine_module.resolve_model_path)
    Tokenizer.__init__ = clock.timed('tokenizer', Tokenizer.__init__)
    ModelRunner.__init__ = clock.timed('KV cache', ModelRunner.__init__)
    build_model = runner_builder.build_model

    def timed_build_model(*args, **kwargs):
        model = clock.timed('weights load', build_model)(*args, **kwargs)
        model.finalize_weights = clock.timed('finalize', model.finalize_weights)
        return model

    runner_builder.build_model = timed_build_model
    engine_init = engine_module.Engine.__init__
    engine_module.Engine.__init__ = clock.timed('engine', engine_init)
    if model == 'tiny':
        from lmdeploy import GenerationConfig, PytorchEngineConfig
        engine = engine_module.Engine(model_path, PytorchEngineConfig(dtype='float32', num_gpu_blocks=128,
                                                                      block_size=16), show_progress=False)
        prompt = engine.tokenizer.encode(PROMPT)
        first = clock.timed('first token', _first_token)
        first(engine, prompt, GenerationConfig(max_new_tokens=1))
        engine.close()
    else:
        from lmdeploy import GenerationConfig, pipeline
        pipe = clock.timed('pipeline', pipeline)(model_path, show_progress=False)
        clock.timed('first token', pipe)(PROMPT, gen_config=GenerationConfig(max_new_tokens=1))
        pipe.close()
    clock.add('total', time.perf_counter() - wall0, time.process_time() - cpu0)
    spent = clock.spent
    inner = ('model source', 'tokenizer', 'weights load', 'finalize', 'KV cache')
    spent['engine rest'] = [spent['engine'][i] - sum(spent[p][i] for p in inner if p in spent) for i in (0, 1)]
    if 'pipeline' in spent:
        pipeline_spent = spent.pop('pipeline')
        spent['pipeline rest'] = [pipeline_spent[i] - spent['engine'][i] for i in (0, 1)]
    del spent['engine']
    return spent


def _import_entry_points(model: str) -> None:
    if model == 'tiny':
        import lmdeploy.pytorch.engine.engine  # noqa: F401
    else:
        import lmdeploy.api  # noqa: F401


def _first_token(engine, prompt: list[int], gen_config) -> None:
    engine.add_request(prompt, gen_config)
    while engine.has_unfinished():
        engine.step()


def model_paths(models: list[str], tmp: str) -> dict[str, str | None]:
    """The path each model starts from (None: the default model, as ``lmdeploy chat`` with no model)."""
    paths: dict[str, str | None] = {}
    for model in models:
        if model == 'default':
            paths[model] = None
        elif model == 'gemma3':
            from lmdeploy.model_source import gemma3_270m_path
            paths[model] = gemma3_270m_path()
        else:
            sys.path.insert(0, str(HERE.parent / 'tests'))
            from conftest import save_tiny_model  # the tests' own tiny model
            paths[model] = save_tiny_model('llama', os.path.join(tmp, 'tiny_llama'))
    return paths


def run_child(tree: str, model: str, path: str | None, extra_env: dict[str, str]) -> dict[str, list[float]]:
    env = {**os.environ, 'PYTHONPATH': tree, **extra_env}
    cmd = [sys.executable, str(Path(__file__).resolve()), '--child', model, '--path', path or '']
    proc = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f'{model} from {tree} failed:\n{proc.stderr[-3000:]}')
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--models', nargs='+', choices=MODELS, default=list(MODELS))
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--base', help='another checkout to start alternately with this one')
    parser.add_argument('--base-env', nargs='+', default=[], metavar='VAR=VALUE',
                        help='environment of the base side (without --base, the base is this tree)')
    parser.add_argument('--child', choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument('--path', help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.path or None)))
        return
    base = str(Path(args.base).resolve()) if args.base else str(HERE.parent) if args.base_env else None
    trees = {'this': str(HERE.parent)} | ({'base': base} if base else {})
    envs = {'this': {}, 'base': dict(item.split('=', 1) for item in args.base_env)}
    with tempfile.TemporaryDirectory() as tmp:
        paths = model_paths(args.models, tmp)
        for model in args.models:
            runs: dict[str, list[dict]] = {side: [] for side in trees}
            for side, tree in reversed(trees.items()):
                run_child(tree, model, paths[model], envs[side])  # unmeasured: warm files and caches
            for _ in range(args.rounds):
                for side, tree in reversed(trees.items()):
                    runs[side].append(run_child(tree, model, paths[model], envs[side]))
            print_table(model, runs)


def print_table(model: str, runs: dict[str, list[dict]]) -> None:
    with open('/proc/loadavg') as f:
        load = ' '.join(f.read().split()[:3])
    sides = list(runs)
    rounds = len(runs[sides[0]])
    print(f'\n{model}: median of {rounds} fresh processes per side, seconds (load average after: {load})')
    header = f'{"phase":<16}' + ''.join(f'{side + " wall":>12}{side + " cpu":>11}' for side in reversed(sides))
    print(header + ('   wall ratio base/this' if 'base' in runs else ''))
    for phase in PHASES:
        medians = {side: [statistics.median(run.get(phase, [0.0, 0.0])[i] for run in runs[side]) for i in (0, 1)]
                   for side in sides}
        if all(value[0] == 0.0 for value in medians.values()):
            continue
        line = f'{phase:<16}' + ''.join(f'{medians[side][0]:>12.2f}{medians[side][1]:>11.2f}'
                                        for side in reversed(sides))
        if 'base' in runs and medians['this'][0] > 0.005:
            line += f'{medians["base"][0] / medians["this"][0]:>12.2f}x'
        print(line)


if __name__ == '__main__':
    main()
