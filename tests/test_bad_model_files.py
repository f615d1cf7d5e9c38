"""Every bad model file (tests/bad_model_files.py) gets a clear error from ``Engine``, ``pipeline()`` and the
command line: the project's error type, a message naming the file and what to do, no thread left behind and
nothing in the GGUF cache that a later run would trust."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from bad_model_files import BAD_FILES, NEEDS_PERMISSIONS, build_engine, build_pipeline, run_cli, save_good_models


@pytest.fixture(scope='module')
def good(tmp_path_factory) -> dict[str, Path]:
    return save_good_models(tmp_path_factory.mktemp('good'))


pytestmark = pytest.mark.usefixtures('tmp_gguf_cache')


@pytest.mark.parametrize('kind', ['hf', 'gguf'])
def test_the_good_models_load(good, kind):
    build_pipeline(str(good[kind]))


@pytest.mark.parametrize('entry', [build_engine, build_pipeline], ids=['engine', 'pipeline'])
@pytest.mark.parametrize('name', sorted(BAD_FILES))
def test_a_bad_model_file_gets_a_clear_error(good, name, entry, tmp_path, tmp_gguf_cache):
    if name in NEEDS_PERMISSIONS and os.geteuid() == 0:
        pytest.skip('root reads files without read permission')
    bad = BAD_FILES[name]
    folder = tmp_path / 'model'
    folder.mkdir()
    path = bad.build(folder, good)
    threads = set(threading.enumerate())
    with pytest.raises(bad.error) as caught:
        entry(str(path))
    assert type(caught.value) is bad.error, caught.value
    message = str(caught.value).lower()
    missing = [word for word in bad.words if word.lower() not in message]
    assert not missing, f'{missing} not in: {caught.value}'
    assert '\n' not in message  # the command line prints it as one line
    assert not [t for t in set(threading.enumerate()) - threads if t.is_alive()]
    assert not (tmp_gguf_cache / 'gguf').exists() or not os.listdir(tmp_gguf_cache / 'gguf')


@pytest.mark.parametrize('command, name', [(['serve', 'api_server', '--server-port', '0'], 'gguf_truncated'),
                                           (['chat'], 'hf_missing_shard')])
def test_the_command_line_prints_one_line(good, command, name, tmp_path):
    folder = tmp_path / 'model'
    folder.mkdir()
    path = BAD_FILES[name].build(folder, good)
    out = run_cli(*command, str(path), '--dtype', 'float32', '--log-level', 'WARNING', timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith('lmdeploy: error: '), out.stderr
    assert all(word in lines[0] for word in BAD_FILES[name].words), lines[0]
