"""The first start's one-time work, done ahead as a step of its own: ``python -m lmdeploy.prepare`` builds the
native CPU kernels for this CPU (:mod:`lmdeploy.pytorch.kernels.cpu`) and fetches and converts the default
model into the cache; ``--gemma3`` also Gemma 3 270M, the test suite's second real checkpoint. Each step prints
how long it took; a step done before only loads its result (seconds)."""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable


def _timed(what: str, step: Callable[[], str]) -> None:
    start = time.monotonic()
    result = step()
    print(f'{what}: {result} ({time.monotonic() - start:.1f} s)', flush=True)


def _kernels() -> str:
    from lmdeploy.pytorch.kernels import cpu
    return 'unavailable, the torch versions run' if cpu.native() is None else 'built'


def _default_model() -> str:
    from lmdeploy.model_source import resolve_model_path
    return resolve_model_path(None)


def _gemma3() -> str:
    from lmdeploy.model_source import gemma3_270m_path, resolve_model_path
    return resolve_model_path(gemma3_270m_path())


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m lmdeploy.prepare``."""
    parser = argparse.ArgumentParser(prog='python -m lmdeploy.prepare', description=__doc__)
    parser.add_argument('--gemma3', action='store_true', help='also fetch and convert Gemma 3 270M (for the tests)')
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the steps; 0 when each is done (kernels that cannot be built are not an error: torch runs instead)."""
    args = build_parser().parse_args(argv)
    _timed('native CPU kernels', _kernels)
    _timed('default model', _default_model)
    if args.gemma3:
        _timed('Gemma 3 270M', _gemma3)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
