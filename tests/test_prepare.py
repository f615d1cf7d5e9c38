"""``python -m lmdeploy.prepare``: the first start's one-time work (the native CPU kernels, the default model's fetch
and conversion) as a step of its own, each part timed; run again, it finds each done."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmdeploy import prepare
from lmdeploy.model_source import resolve_model_path
from lmdeploy.pytorch.kernels import cpu


def test_prepare_builds_the_kernels_and_converts_the_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert prepare.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    kernels = 'built' if cpu.native() is not None else 'unavailable, the torch versions run'
    assert re.fullmatch(rf'native CPU kernels: {kernels} \(\d+\.\d s\)', lines[0])
    folder = re.fullmatch(r'default model: (.+) \(\d+\.\d s\)', lines[1]).group(1)
    assert folder == resolve_model_path(None) and (Path(folder) / 'config.json').is_file()
    assert (Path(folder) / 'generation_config.json').is_file()  # the default sampling settings, as a start writes
