"""benchmark/gpu_check.sh names tests by node id for its one run on a lent GPU: a renamed or merged test must
not turn that run's engine part into a collection error that no CPU run would notice."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE_ID = re.compile(r"tests/(\w+\.py)(?:::(\w+)(?:\[([^\]]+)\])?)?")


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
