"""A short soak of benchmark/soak.py (issue 18): mixed traffic against a real server process for
``SOAK_SECONDS`` (100 s; the full run is ``python benchmark/soak.py``, 10 minutes), then zero 5xx, every
valid request answered or dropped by its own client, KV usage 0 after the drain and RSS growth after the
warm-up under 5%."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', 'benchmark'))
import soak  # noqa: E402

SOAK_SECONDS = float(os.environ.get('SOAK_SECONDS', '100'))


@pytest.mark.slow
def test_soak(tiny_llama, capsys):
    rc = soak.main(['--model', tiny_llama, '--duration', str(SOAK_SECONDS), '--warmup', str(SOAK_SECONDS * 0.3)])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, out
