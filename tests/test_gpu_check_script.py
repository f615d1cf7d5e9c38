"""benchmark/gpu_check.sh names tests by node id for its one run on a lent GPU: a renamed or merged test must
not turn that run's engine part into a collection error that no CPU run would notice; nor may a test module that
imports a package the GPU machine lacks (its image has none of ABSENT; fetch_gpu_wheels.sh carries some)."""
import ast
import os
import re
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


@pytest.mark.slow
def test_the_gpu_parts_collect_without_the_packages_the_gpu_machine_lacks(tmp_path):
    script = (ROOT / 'benchmark' / 'gpu_check.sh').read_text()
    assert "-m triton -p no:cacheprovider \\\n    $(grep -l 'mark\\.triton' tests/test_*.py)" in script
    kernel_files = [f'tests/{path.name}' for path in sorted((ROOT / 'tests').glob('test_*.py'))
                    if 'mark.triton' in path.read_text()]
    status, output = collect(['-m', 'triton', *kernel_files], tmp_path)
    assert status == 0, output[-3000:]
    every_status, every = collect(['-m', 'triton', 'tests'])
    assert every_status == 0 and collected(output) == collected(every)  # the files hold every Triton test
    engine_part = script[script.index('tests/test_engine_correctness.py'):script.index('part "kernel throughput"')]
    status, output = collect([arg.strip("'") for arg in re.findall(r"'?tests/[^\s']+'?", engine_part)], tmp_path)
    assert status == 0, output[-3000:]


@pytest.mark.slow
def test_the_gpu_check_scripts_and_the_server_import_on_the_gpu_machine(tmp_path):
    modules = 'gpu_scale, kernel_bench, scale_server, throughput, triton_aot, lmdeploy.serve.openai.api_server'
    status, output = python(['-c', f'import {modules}'], tmp_path, cwd=ROOT / 'benchmark')
    assert status == 0, output[-3000:]
