"""benchmark/gpu_check.sh names tests by node id for its one run on a lent GPU: a renamed or merged test must
not turn that run's engine part into a collection error that no CPU run would notice; nor may a test module that
imports a package the GPU machine lacks (its image has none of ABSENT; fetch_gpu_wheels.sh carries some). Its test
parts run spread over processes (pytest-xdist) and, cut short, still print what ran."""
import ast
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NODE_ID = re.compile(r"tests/(\w+\.py)(?:::(\w+)(?:\[([^\]]+)\])?)?")
ABSENT = ('openai', 'jsonschema', 'xgrammar', 'pexpect', 'playwright', 'schemathesis', 'ray')
CARRIED = {name.lower().replace('-', '_') for name in
           re.findall(r'([\w.-]+)==', (ROOT / 'benchmark' / 'fetch_gpu_wheels.sh').read_text())}
BLOCKER = f"""import sys


class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] in {sorted(set(ABSENT) - CARRIED)!r}:
            raise ModuleNotFoundError(f'No module named {{name!r}} (not on the GPU machine)')


sys.meta_path.insert(0, Absent())
"""


def node_ids() -> list[tuple[str, str | None, str | None]]:
    return NODE_ID.findall((ROOT / 'benchmark' / 'gpu_check.sh').read_text())


def module_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}


def test_every_test_the_gpu_check_names_exists():
    ids = node_ids()
    assert len(ids) >= 15, ids
    for file_name, function, params in ids:
        path = ROOT / 'tests' / file_name
        assert path.is_file(), f'gpu_check.sh names {file_name}, which is gone'
        if not function:
            continue
        assert function in module_functions(path), f'gpu_check.sh names {file_name}::{function}, which is gone'
        source = path.read_text()
        for part in (params or '').split('-') if params else ():
            assert re.search(rf"\b{re.escape(part)}\b", source), \
                f'gpu_check.sh names {file_name}::{function}[{params}], and {part!r} is not in the file'


def python(args: list[str], site: Path | None = None, cwd: Path = ROOT) -> tuple[int, str]:
    """Runs ``python args`` with the packages of ABSENT that no wheel carries made unimportable where ``site`` (a
    folder for the sitecustomize doing so) is given, engines on CUDA; (exit status, output)."""
    path = [str(ROOT)]
    if site:
        (site / 'sitecustomize.py').write_text(BLOCKER)
        path.insert(0, str(site))
    env = {**os.environ, 'LMDEPLOY_TEST_DEVICE': 'cuda',
           'PYTHONPATH': os.pathsep.join(path + [os.environ.get('PYTHONPATH', '')])}
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def collect(args: list[str], site: Path | None = None) -> tuple[int, str]:
    """``pytest --collect-only`` of ``args`` as gpu_check.sh runs it (see :func:`python`)."""
    return python(['-m', 'pytest', '--collect-only', '-q', '-p', 'no:cacheprovider', *args], site)


def collected(output: str) -> int:
    return int(re.search(r'(\d+)(?:/\d+)? tests? collected', output).group(1))


def gpu_check_commands(tmp_path: Path) -> list[list[str]]:
    """The arguments of each python command that ``bash benchmark/gpu_check.sh`` runs, in order, as it runs them: a
    stand-in python records them and passes (so CUDA is there, and so is pytest-xdist)."""
    log, recorder, stub = tmp_path / 'commands.jsonl', tmp_path / 'record.py', tmp_path / 'python'
    recorder.write_text(f'import json, sys\nwith open({str(log)!r}, "a") as f:\n'
                        f'    f.write(json.dumps(sys.argv[1:]) + "\\n")\n')
    stub.write_text(f'#!/bin/sh\nexec {sys.executable} {recorder} "$@"\n')
    stub.chmod(0o755)
    proc = subprocess.run(['bash', str(ROOT / 'benchmark' / 'gpu_check.sh')], env={**os.environ, 'PYTHON': str(stub)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def kernel_part(commands: list[list[str]]) -> list[str]:
    return next(args for args in commands if args[:2] == ['-m', 'pytest'] and 'triton' in args)


def test_the_test_parts_plugins_travel_to_the_gpu_machine():
    assert {'pytest_xdist', 'execnet', 'pytest_timeout'} <= CARRIED


@pytest.mark.slow
def test_the_gpu_parts_collect_without_the_packages_the_gpu_machine_lacks(tmp_path):
    script = (ROOT / 'benchmark' / 'gpu_check.sh').read_text()
    kernel_args = kernel_part(gpu_check_commands(tmp_path))
    kernel_files = [f'tests/{path.name}' for path in sorted((ROOT / 'tests').glob('test_*.py'))
                    if 'mark.triton' in path.read_text()]
    assert set(kernel_files) <= set(kernel_args)
    status, output = collect([arg for arg in kernel_args[2:] if arg != '-q'], tmp_path)  # -qq: no count
    assert status == 0, output[-3000:]
    every_status, every = collect(['-m', 'triton', 'tests'])
    assert every_status == 0 and collected(output) == collected(every)  # the files hold every Triton test
    engine_part = script[script.index('tests/test_engine_correctness.py'):script.index('part "kernel throughput"')]
    status, output = collect([arg.strip("'") for arg in re.findall(r"'?tests/[^\s']+'?", engine_part)], tmp_path)
    assert status == 0, output[-3000:]


@pytest.mark.slow
def test_the_kernel_part_runs_spread_over_processes_without_the_packages_the_gpu_machine_lacks(tmp_path):
    """Each worker collects every file of the part (xdist stops the run where their collections differ) and runs
    its share of the tests: here the RMS norm's, in Triton's interpreter."""
    args = kernel_part(gpu_check_commands(tmp_path))
    assert '-n' in args and args[args.index('--dist') + 1] == 'load', args
    args[args.index('-n') + 1] = '2'
    status, output = python([*args, '-k', 'test_rms_norm'], tmp_path)
    assert status == 0 and re.search(r'\b4 passed', output), output[-3000:]


@pytest.mark.slow
def test_a_test_part_cut_short_prints_what_ran(tmp_path):
    """gpu_check.sh's ``part`` interrupts a test part (two xdist workers) before its limit: pytest prints the
    counts of the tests that ran, the part is reported failed, and it ends by its limit; so too where the script
    runs as a shell's background job, with SIGINT ignored (``timeout`` restores the signal it sends)."""
    script = (ROOT / 'benchmark' / 'gpu_check.sh').read_text()
    part = re.search(r'^part\(\) \{\n.*?^\}\n', script, re.S | re.M).group(0)
    stop = re.search(r'^(.*)part "kernel tests', script, re.M).group(1)
    (tmp_path / 'test_cut.py').write_text('import time\n\n\ndef test_quick():\n    pass\n\n\n'
                                          'def test_hangs():\n    time.sleep(600)\n')
    shell = (f'BUDGET=1000\nPY={sys.executable}\nfailed=()\n{part}{stop}part cut 30 0 "$PY" -m pytest -q '
             f'-p xdist.plugin -p no:cacheprovider -n 2 test_cut.py\nprintf "failed: %s\\n" "${{failed[@]}}"\n')
    env = {**os.environ, 'PYTEST_DISABLE_PLUGIN_AUTOLOAD': '1'}
    proc = subprocess.run(['bash', '-c', shell], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    output = proc.stdout + proc.stderr
    assert re.search(r'^1 passed', output, re.M) and 'failed: cut' in output, output[-3000:]
    assert int(re.search(r'=== cut: (\d+) s', output).group(1)) <= 31, output[-3000:]


@pytest.mark.slow
def test_the_gpu_check_scripts_and_the_server_import_on_the_gpu_machine(tmp_path):
    modules = 'gpu_scale, kernel_bench, scale_server, throughput, triton_aot, lmdeploy.serve.openai.api_server'
    status, output = python(['-c', f'import {modules}'], tmp_path, cwd=ROOT / 'benchmark')
    assert status == 0, output[-3000:]
