"""Bad model files, as users hand them to lmdeploy: each builder writes one into a folder and returns the path
to give, and what a clear error says about it. Run as a script, it records what each entry point does with each
(``python tests/bad_model_files.py [--cli]``): the exception or exit code, the message or stderr's last line,
the time to fail, and the threads or processes left behind."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf

from lmdeploy.messages import ConfigError
from lmdeploy.model_source import ModelNotFoundError


@dataclass(frozen=True)
class BadFile:
    """A bad input: ``build(folder, good)`` writes it under ``folder`` from the good models in ``good``
    (``'hf'``: a sharded tiny Llama folder, ``'gguf'``: a tiny Llama .gguf) and returns the model path."""

    build: Callable[[Path, dict[str, Path]], Path]
    error: type[Exception]
    words: tuple[str, ...]  # each in the message, case-insensitive


def _copy(good: Path, folder: Path, name: str | None = None) -> Path:
    target = folder / (name or good.name)
    (shutil.copytree if good.is_dir() else shutil.copy)(good, target)
    return target


def _truncated(path: Path, keep: float) -> Path:
    with open(path, 'r+b') as f:
        f.truncate(int(os.path.getsize(path) * keep))
    return path


def _patched_gguf(folder: Path, good: dict[str, Path], **fields: int | str) -> Path:
    """A copy of the good .gguf with metadata ``fields`` (``llama.block_count``...) set in place: an int to
    another int, a key or string to another of the same length (``{'rename:tokenizer.ggml.tokens':
    'tokenizer.ggml.tokenz'}`` renames a key, so the file lacks it)."""
    path = _copy(good['gguf'], folder)
    reader = gguf.GGUFReader(str(path), 'r+')
    for key, value in fields.items():
        rename = key.startswith('rename:')
        field = reader.fields[key.removeprefix('rename:')]
        part = field.parts[1] if rename else field.parts[field.data[0]]
        part[:] = list(value.encode()) if isinstance(value, str) else value
    del reader
    return path


def _edited_config(folder: Path, good: dict[str, Path], **changes) -> Path:
    path = _copy(good['hf'], folder)
    config = json.loads((path / 'config.json').read_text())
    (path / 'config.json').write_text(json.dumps(config | changes))
    return path


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob('model-*.safetensors'))


def _without(path: Path, *names: str) -> Path:
    for name in names:
        target = path / name
        shutil.rmtree(target) if target.is_dir() else target.unlink()
    return path


def _adapter(folder: Path, good: dict[str, Path]) -> Path:
    path = folder / 'lora'
    path.mkdir()
    (path / 'adapter_config.json').write_text(json.dumps({'peft_type': 'LORA', 'r': 8,
                                                          'base_model_name_or_path': 'tiny-llama'}))
    shutil.copy(_shards(good['hf'])[0], path / 'adapter_model.safetensors')
    return path


def _unreadable(path: Path) -> Path:
    path.chmod(0)
    return path


def _config_dir(folder: Path, good: dict[str, Path]) -> Path:
    path = _without(_copy(good['hf'], folder), 'config.json')
    (path / 'config.json').mkdir()
    return path


def _gguf_dir(folder: Path, good: dict[str, Path]) -> Path:
    path = folder / 'model.gguf'
    path.mkdir()
    return path


def _config_not_json(folder: Path, good: dict[str, Path]) -> Path:
    path = _copy(good['hf'], folder)
    (path / 'config.json').write_text('{"architectures": ')
    return path


def _html_page(folder: Path, good: dict[str, Path]) -> Path:
    path = folder / 'x.gguf'
    path.write_text('<html>404 Not Found</html>')
    return path


def _empty_folder(folder: Path, good: dict[str, Path]) -> Path:
    path = folder / 'empty'
    path.mkdir()
    return path


def _mmproj_beside(folder: Path, good: dict[str, Path]) -> Path:
    path = _copy(good['gguf'], folder)
    shutil.copy(good['gguf'], folder / 'mmproj-tiny.gguf')
    _truncated(folder / 'mmproj-tiny.gguf', 0.3)
    return path


REREAD = ('re-download',)
SECOND_SHARD = 'model-00002-of-00003.safetensors'
BAD_FILES: dict[str, BadFile] = {
    'gguf_truncated': BadFile(lambda d, g: _truncated(_copy(g['gguf'], d), 0.5), ConfigError,
                              ('tiny.gguf', 'truncated', *REREAD)),
    'gguf_empty': BadFile(lambda d, g: _truncated(_copy(g['gguf'], d), 0), ConfigError,
                          ('tiny.gguf', 'truncated', *REREAD)),
    'gguf_not_gguf': BadFile(_html_page,
                             ConfigError, ('x.gguf', 'not a valid GGUF file')),
    'gguf_unknown_arch': BadFile(lambda d, g: _patched_gguf(d, g, **{'general.architecture': 'bloom',
                                                                    'rename:llama.block_count': 'bloom.block_count'}),
                                 ConfigError, ('tiny.gguf', "'bloom'", 'supported', 'qwen2')),
    'gguf_heads_not_dividing': BadFile(lambda d, g: _patched_gguf(d, g, **{'llama.attention.head_count': 3}),
                                       ConfigError, ('tiny.gguf', 'head_count', '3')),
    'gguf_heads_disagree_with_tensors': BadFile(lambda d, g: _patched_gguf(d, g, **{'llama.attention.head_count': 8}),
                                                ConfigError, ('tiny.gguf', 'blk.0.attn_q.weight', 'head_count (8)')),
    'gguf_kv_heads_not_dividing': BadFile(lambda d, g: _patched_gguf(d, g, **{'llama.attention.head_count_kv': 3}),
                                          ConfigError, ('tiny.gguf', 'head_count_kv', '3')),
    'gguf_more_blocks_than_tensors': BadFile(lambda d, g: _patched_gguf(d, g, **{'llama.block_count': 5}),
                                             ConfigError, ('tiny.gguf', 'block_count', '5', 'blk.2')),
    'gguf_no_tokenizer': BadFile(lambda d, g: _patched_gguf(d, g, **{'rename:tokenizer.ggml.tokens':
                                                                    'tokenizer.ggml.tokenz'}),
                                 ConfigError, ('tiny.gguf', 'tokenizer')),
    'gguf_truncated_mmproj': BadFile(_mmproj_beside, ConfigError, ('mmproj-tiny.gguf', 'truncated', *REREAD)),
    'gguf_is_a_directory': BadFile(_gguf_dir, ModelNotFoundError, ('model.gguf', 'is a folder')),
    'gguf_unreadable': BadFile(lambda d, g: _unreadable(_copy(g['gguf'], d)), ConfigError,
                               ('tiny.gguf', 'permission')),
    'hf_missing_shard': BadFile(lambda d, g: _without(_copy(g['hf'], d), _shards(g['hf'])[1].name), ConfigError,
                                (SECOND_SHARD, 'missing', *REREAD)),
    'hf_truncated_shard': BadFile(lambda d, g: _truncated(_shards(_copy(g['hf'], d))[1], 0.5).parent, ConfigError,
                                  (SECOND_SHARD, 'truncated', *REREAD)),
    'hf_config_not_json': BadFile(_config_not_json,
                                  ConfigError, ('config.json', 'not valid JSON')),
    'hf_config_is_a_directory': BadFile(_config_dir, ModelNotFoundError, ('config.json', 'not a file')),
    'hf_unknown_arch': BadFile(lambda d, g: _edited_config(d, g, architectures=['GPTNeoXForCausalLM'],
                                                           model_type='gpt_neox'),
                               ConfigError, ('GPTNeoXForCausalLM', 'supported', 'LlamaForCausalLM')),
    'hf_no_architecture': BadFile(lambda d, g: _edited_config(d, g, architectures=None),
                                  ConfigError, ('config.json', 'architectures')),
    'hf_unknown_quant_method': BadFile(lambda d, g: _edited_config(d, g, quantization_config={'quant_method': 'hqq'}),
                                       ConfigError, ("'hqq'", 'supported', 'awq')),
    'hf_unsupported_bits': BadFile(lambda d, g: _edited_config(d, g, quantization_config={
        'quant_method': 'awq', 'bits': 3, 'group_size': 128, 'version': 'gemm', 'zero_point': True}),
                                   ConfigError, ('awq', 'bits', '3')),
    'hf_missing_tokenizer': BadFile(lambda d, g: _without(_copy(g['hf'], d), 'tokenizer.json', 'tokenizer_config.json'),
                                    ConfigError, ('tokenizer',)),
    'hf_unreadable_shard': BadFile(lambda d, g: _unreadable(_shards(_copy(g['hf'], d))[0]).parent, ConfigError,
                                   ('model-00001-of-00003.safetensors', 'permission')),
    'adapter_folder': BadFile(_adapter, ModelNotFoundError, ('adapter', 'base model')),
    'empty_folder': BadFile(_empty_folder, ModelNotFoundError,
                            ('empty', 'config.json')),
}
# a file without read permission is readable by root: these cannot fail there
NEEDS_PERMISSIONS = ('gguf_unreadable', 'hf_unreadable_shard')


def save_good_models(folder: Path) -> dict[str, Path]:
    """The good tiny models the bad files are made from: a Llama folder in three shards and a Llama .gguf."""
    from conftest import TINY_CONFIGS, save_random_model
    from test_gguf import make_gguf
    hf = folder / 'hf'
    save_random_model(TINY_CONFIGS['llama'](), str(hf), max_shard_size='200KB')
    assert len(_shards(hf)) == 3, _shards(hf)
    make_gguf(folder / 'tiny.gguf')
    return {'hf': hf, 'gguf': folder / 'tiny.gguf'}


ENGINE_CONFIG = {'dtype': 'float32', 'num_gpu_blocks': 16, 'block_size': 16,
                 'device': os.environ.get('LMDEPLOY_TEST_DEVICE', 'cpu')}


def build_engine(path: str) -> None:
    from lmdeploy.messages import PytorchEngineConfig
    from lmdeploy.pytorch.engine.engine import Engine
    Engine(path, PytorchEngineConfig(**ENGINE_CONFIG), show_progress=False).close()


def build_pipeline(path: str) -> None:
    from lmdeploy import pipeline
    from lmdeploy.messages import PytorchEngineConfig
    pipeline(path, PytorchEngineConfig(**ENGINE_CONFIG), show_progress=False).close()


def record_python(entry: Callable[[str], None], path: Path) -> dict:
    """What ``entry(path)`` raises, in how long, and the threads it leaves."""
    threads = set(threading.enumerate())
    start = time.monotonic()
    try:
        entry(str(path))
        outcome = {'error': None, 'message': 'built'}
    except Exception as exc:  # recorded, whatever it is
        outcome = {'error': type(exc).__name__, 'message': str(exc)}
    left = [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
    return outcome | {'seconds': round(time.monotonic() - start, 2), 'threads_left': left}


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``lmdeploy ARGS`` in a subprocess (on this checkout's package)."""
    checkout = str(Path(__file__).parents[1])
    env = os.environ | {'PYTHONPATH': os.pathsep.join([checkout, os.environ.get('PYTHONPATH', '')])}
    return subprocess.run([sys.executable, '-m', 'lmdeploy.cli.main', *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def record_cli(command: list[str], path: Path) -> dict:
    start = time.monotonic()
    try:
        out = run_cli(*command, str(path), '--dtype', 'float32', '--log-level', 'WARNING', timeout=120)
    except subprocess.TimeoutExpired:
        return {'exit': 'timeout (hang)', 'seconds': 120}
    lines = out.stderr.strip().splitlines()
    return {'exit': out.returncode, 'stderr_lines': len(lines), 'traceback': 'Traceback' in out.stderr,
            'last_line': lines[-1] if lines else '', 'seconds': round(time.monotonic() - start, 2)}


def main() -> None:
    cli = '--cli' in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith('--')] or list(BAD_FILES)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ['LMDEPLOY_CACHE_DIR'] = str(root / 'cache')
        good = save_good_models(root / 'good')
        for name in names:
            folder = root / name
            folder.mkdir()
            path = BAD_FILES[name].build(folder, good)
            report = {'engine': record_python(build_engine, path), 'pipeline': record_python(build_pipeline, path)}
            if cli:
                report |= {'serve': record_cli(['serve', 'api_server', '--server-port', '0'], path),
                           'chat': record_cli(['chat'], path)}
            cache = root / 'cache' / 'gguf'
            report['cache_left'] = sorted(os.listdir(cache)) if cache.exists() else []
            print(json.dumps({name: report}, indent=1), flush=True)
            shutil.rmtree(root / 'cache', ignore_errors=True)


if __name__ == '__main__':
    main()
