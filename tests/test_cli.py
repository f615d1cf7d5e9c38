"""The ``lmdeploy`` command line a newcomer meets: help, version, argument parsing and one-line errors."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmdeploy import __version__
from lmdeploy.cli.main import build_parser
from lmdeploy.model_source import DEFAULT_MODEL, ModelNotFoundError, check_model_path, model_name


def lmdeploy(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, '-m', 'lmdeploy.cli.main', *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_bare_commands_print_help_and_version():
    bare = lmdeploy()
    assert bare.returncode == 0 and 'usage: lmdeploy' in bare.stdout and 'chat' in bare.stdout, bare
    serve = lmdeploy('serve')
    assert serve.returncode == 0 and 'api_server' in serve.stdout and 'proxy' in serve.stdout, serve
    version = lmdeploy('--version')
    assert version.returncode == 0 and version.stdout.strip() == f'lmdeploy {__version__}'


def test_help_shows_defaults():
    help_text = build_parser()._subparsers._group_actions[0].choices['chat'].format_help()
    flat = ' '.join(help_text.split())
    assert '--max-new-tokens MAX_NEW_TOKENS (default: 512)' in flat
    assert '--dtype {auto,float32,bfloat16,float16} (default: auto)' in flat
    assert '--disable-prefix-caching (default' not in flat  # a flag without a value shows no default
    serve = lmdeploy('serve', 'api_server', '--help')
    flat = ' '.join(serve.stdout.split())
    assert serve.returncode == 0 and '--server-port SERVER_PORT (default: 23333)' in flat
    assert '--log-level {DEBUG,INFO,WARNING,ERROR} (default: INFO)' in flat


ENTRY = """
import atexit, sys, threading, time
from lmdeploy.cli import main as cli
command = cli.main
def main():  # the command, and a thread of it still running when it returns
    try:
        command()
    finally:
        threading.Thread(target=lambda: time.sleep(0.3) or print('thread done')).start()
cli.main = main
atexit.register(print, 'exit handler ran')
sys.argv = ['lmdeploy', *sys.argv[1:]]
cli.entry()
"""


@pytest.mark.parametrize('args, status, printed', [([], 0, 'usage: lmdeploy'), (['--version'], 0, __version__),
                                                    (['chat', 'm', '--tp', '0'], 2, '')])
def test_the_command_ends_as_python_would(args, status, printed):
    """The ``lmdeploy`` command skips the teardown of its modules at exit, nothing else: its exit status, its
    other threads joined first, its exit handlers run, its buffered output written."""
    out = subprocess.run([sys.executable, '-c', ENTRY, *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == status and printed in out.stdout, out
    assert out.stdout.endswith('thread done\nexit handler ran\n'), out


def test_parsing_imports_no_torch():
    """``--help`` stays fast: parsing every command loads neither torch nor the engine."""
    code = ('import sys\nfrom lmdeploy.cli.main import build_parser\n'
            "build_parser().parse_args(['serve', 'api_server', 'm.gguf', '--api-keys', 'k'])\n"
            "build_parser().parse_args(['chat', 'm.gguf'])\n"
            "build_parser().parse_args(['serve', 'proxy'])\n"
            "print(sorted(m for m in ('torch', 'transformers', 'lmdeploy.pytorch') if m in sys.modules))")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == '[]', out


def test_public_names_load_on_first_use():
    """``from lmdeploy import pipeline`` is the function, also after the submodule lmdeploy.pipeline loaded."""
    code = ('import sys, lmdeploy\nassert "torch" not in sys.modules\nimport lmdeploy.pipeline, lmdeploy.api\n'
            'from lmdeploy import Pipeline, pipeline\nassert pipeline is lmdeploy.api.pipeline is lmdeploy.pipeline\n'
            'assert Pipeline is sys.modules["lmdeploy.pipeline"].Pipeline')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out


@pytest.mark.parametrize('argv', [
    ['serve', 'api_server', '--api-keys', 'k1', '/tmp/m.gguf', '--api-keys', 'k2'],
    ['serve', 'api_server', '/tmp/m.gguf', '--api-keys', 'k1', '--api-keys', 'k2'],
])
def test_api_keys_never_swallow_the_model_path(argv):
    args = build_parser().parse_args(argv)
    assert args.model_path == '/tmp/m.gguf' and args.api_keys == ['k1', 'k2']


@pytest.mark.parametrize('argv', [['chat', '--stop', 'END', 'm.gguf'], ['chat', 'm.gguf', '--stop', 'END']])
def test_stop_never_swallows_the_model_path(argv):
    args = build_parser().parse_args(argv)
    assert args.model_path == 'm.gguf' and args.stop == ['END']


def test_keys_after_a_model_path_are_one_each(capsys):
    with pytest.raises(SystemExit):  # the old 'several keys after one flag' form is an error, not a model path
        build_parser().parse_args(['serve', 'api_server', 'm.gguf', '--api-keys', 'k1', 'k2'])
    assert 'unrecognized arguments: k2' in capsys.readouterr().err


@pytest.mark.parametrize('argv, message', [
    (['chat', '/tmp/no-such-model.gguf'], 'model path /tmp/no-such-model.gguf does not exist'),
    (['serve', 'api_server', '--api-keys', 'k1', '/tmp/no-such-model.gguf'], 'does not exist'),
    (['chat', 'Qwen/Qwen2-0.5B-Instruct'], 'looks like a Hugging Face hub name'),
])
def test_a_wrong_model_path_is_one_line(argv, message):
    out = lmdeploy(*argv)
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('lmdeploy: error: ') and message in lines[0], out.stderr


@pytest.mark.parametrize('command', [['chat'], ['serve', 'api_server']])
@pytest.mark.parametrize('flags, message', [
    (['--max-batch-size', '0'], 'max_batch_size must be positive'),
    (['--cache-max-entry-count', '3'], 'cache_max_entry_count'),
])
def test_an_engine_flag_out_of_range_is_one_line(command, flags, message, tmp_path: Path):
    """Refused before any work: torch, which cannot load here, is never imported."""
    (tmp_path / 'config.json').write_text('{}')
    (tmp_path / 'no_torch' / 'torch').mkdir(parents=True)
    (tmp_path / 'no_torch' / 'torch' / '__init__.py').write_text("raise ImportError('torch was imported')")
    path = os.pathsep.join([str(tmp_path / 'no_torch'), os.environ.get('PYTHONPATH', '')])
    out = lmdeploy(*command, str(tmp_path), *flags, env={**os.environ, 'PYTHONPATH': path})
    assert out.returncode == 2, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('lmdeploy: error: ') and message in lines[0], out.stderr


@pytest.mark.parametrize('flag', ['--tp', '--dp'])
def test_zero_ranks_or_replicas_are_refused_by_the_parser(flag):
    out = lmdeploy('serve', 'api_server', '/tmp/no-such-model.gguf', flag, '0')
    assert out.returncode == 2, out
    assert out.stderr.strip().splitlines()[-1].endswith(f'argument {flag}: must be at least 1, got 0'), out.stderr


def test_check_model_path(tmp_path: Path):
    check_model_path(None)
    (tmp_path / 'config.json').write_text('{}')
    check_model_path(str(tmp_path))
    with pytest.raises(ModelNotFoundError, match='hf download Qwen/Qwen2-0.5B-Instruct'):
        check_model_path('Qwen/Qwen2-0.5B-Instruct')
    with pytest.raises(ModelNotFoundError, match='no config.json'):
        check_model_path(str(tmp_path.parent))
    (tmp_path / 'weights.bin').write_bytes(b'')
    with pytest.raises(ModelNotFoundError, match='not a .gguf file'):
        check_model_path(str(tmp_path / 'weights.bin'))


def test_model_name_is_the_models_own(tmp_path: Path):
    assert model_name(None) == DEFAULT_MODEL
    assert model_name('/models/SmolLM2-135M-Instruct.Q4_1.gguf') == 'SmolLM2-135M-Instruct.Q4_1'
    assert model_name('/models/Qwen2-0.5B-Instruct/') == 'Qwen2-0.5B-Instruct'
    snapshot = tmp_path / 'hub' / 'models--Qwen--Qwen2-0.5B-Instruct' / 'snapshots' / 'abc123'
    assert model_name(str(snapshot)) == 'Qwen/Qwen2-0.5B-Instruct'


def _loaded_torch(pid: int) -> bool:
    try:
        return 'libtorch_cpu' in Path(f'/proc/{pid}/maps').read_text()
    except OSError:
        return False


def test_ctrl_c_during_start_up_is_one_line(tiny_llama):
    """SIGINT while the engine starts (torch imports, kernels build or load, the model loads): no traceback."""
    proc = subprocess.Popen([sys.executable, '-m', 'lmdeploy.cli.main', 'chat', tiny_llama, '--dtype', 'float32'],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, 'PYTHONUNBUFFERED': '1'})
    deadline = time.monotonic() + 120
    while not _loaded_torch(proc.pid):  # the command runs: parsing is over (it never loads torch)
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert 'Traceback' not in err and err.strip().splitlines()[-1] == 'lmdeploy: interrupted', err
