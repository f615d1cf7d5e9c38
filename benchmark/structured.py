"""Structured output's cost: engine throughput with and without a JSON schema on the same batch, in one run.

Workload: N chat prompts asking for a JSON record, all in the engine at once (64: 64 concurrent
requests), greedy. The schema run goes first; the plain run then generates exactly as many tokens per
request as the schema run did (``ignore_eos``), so both runs do the same forward passes and only the
grammar work differs. The prefix cache is off (a second run of the same prompts would skip their
prefill); rounds alternate which run goes first; medians are printed. Every schema output is validated with
``jsonschema``. ``--hf`` adds transformers ``generate`` with xgrammar's logits processor on the same
prompts (batches of 16, sorted by length), as a peer.

    python benchmark/structured.py [--model PATH] [--num-prompts 64] [--rounds 3] [--hf]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import torch

from lmdeploy.messages import GenerationConfig, PytorchEngineConfig
from lmdeploy.model_source import resolve_model_path
from lmdeploy.pytorch.engine.engine import Engine

SCHEMA = {
    'type': 'object', 'additionalProperties': False, 'required': ['name', 'age', 'city', 'skills', 'active'],
    'properties': {'name': {'type': 'string', 'maxLength': 40}, 'age': {'type': 'integer', 'minimum': 0},
                   'city': {'type': 'string', 'maxLength': 40},
                   'skills': {'type': 'array', 'items': {'type': 'string', 'maxLength': 30}, 'maxItems': 4},
                   'active': {'type': 'boolean'}}}
CITIES = ['Paris', 'Lagos', 'Osaka', 'Lima', 'Oslo', 'Pune', 'Quito', 'Perth']
JOBS = ['a baker', 'a pilot', 'a nurse', 'a chemist', 'a carpenter', 'a teacher', 'a sailor', 'an architect']


def prompts(engine: Engine, n: int) -> list[list[int]]:
    hf = engine.tokenizer.hf
    return [hf.apply_chat_template([{'role': 'user', 'content': (
        f'Invent a person who is {JOBS[i % 8]} in {CITIES[i // 8 % 8]} (person number {i}). Reply with a JSON '
        'object with the keys name, age, city, skills (a list of strings) and active (a boolean).')}],
        add_generation_prompt=True, tokenize=True, return_dict=False) for i in range(n)]


def run(engine: Engine, requests: list[tuple[list[int], GenerationConfig]]) -> tuple[float, list[list[int]], str]:
    """Seconds, output tokens per request, and the finish reasons, of one batch."""
    index = {engine.add_request(p, g): i for i, (p, g) in enumerate(requests)}
    tokens: list[list[int]] = [[] for _ in requests]
    finish = [''] * len(requests)
    start = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[index[out.seq_id]] += out.token_ids
            finish[index[out.seq_id]] = out.finish_reason or ''
    return time.perf_counter() - start, tokens, ','.join(sorted(set(finish)))


def schema_round(engine: Engine, batch: list[list[int]], max_new: int) -> tuple[float, list[list[int]]]:
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': SCHEMA}}
    seconds, tokens, finish = run(engine, [(p, GenerationConfig(max_new_tokens=max_new, response_format=fmt))
                                           for p in batch])
    for out in tokens:
        text = engine.tokenizer.decode([t for t in out if t not in engine.tokenizer.eos_token_ids])
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except ValueError:
            raise SystemExit(f'an output cut at --max-new-tokens {max_new} (finish: {finish}); raise it') from None
    return seconds, tokens


def plain_round(engine: Engine, batch: list[list[int]], lengths: list[int]) -> float:
    return run(engine, [(p, GenerationConfig(max_new_tokens=n, ignore_eos=True)) for p, n in zip(batch, lengths)])[0]


def hf_rate(model_dir: str, engine: Engine, batch: list[list[int]], dtype: torch.dtype) -> float:
    """transformers ``generate`` with xgrammar's logits processor: output tokens per second."""
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM
    from xgrammar.contrib.hf import LogitsProcessor
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer.hf, vocab_size=model.config.vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=True,
                                                             max_whitespace_cnt=16)
    pad = engine.tokenizer.hf.pad_token_id or 0
    total, start = 0, time.perf_counter()
    ordered = sorted(batch, key=len)
    for i in range(0, len(ordered), 16):
        chunk = ordered[i:i + 16]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=256, do_sample=False, top_k=None,
                                 top_p=None, temperature=None, pad_token_id=pad,
                                 logits_processor=[LogitsProcessor([compiled] * len(chunk))])
        new = out[:, width:]
        total += int((~torch.isin(new, torch.tensor([pad, *engine.tokenizer.eos_token_ids]))).sum())
    return total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default=None, help='HF folder or .gguf (default: the bundled model)')
    parser.add_argument('--num-prompts', type=int, default=64)
    parser.add_argument('--rounds', type=int, default=4)
    parser.add_argument('--max-new-tokens', type=int, default=256)
    parser.add_argument('--dtype', default='auto')
    parser.add_argument('--hf', action='store_true', help='also run transformers generate with xgrammar')
    args = parser.parse_args()
    model_dir = resolve_model_path(args.model)
    # No prefix cache: the second run of the same prompts would skip their prefill.
    engine = Engine(model_dir, PytorchEngineConfig(dtype=args.dtype, max_batch_size=max(args.num_prompts, 1),
                                                   enable_prefix_caching=False), show_progress=False)
    batch = prompts(engine, args.num_prompts)
    _, tokens = schema_round(engine, batch, args.max_new_tokens)  # warm-up; fixes each request's length
    lengths, count = [len(t) for t in tokens], sum(map(len, tokens))
    ratios, with_schema, without = [], [], []
    for i in range(args.rounds):  # alternate which run goes first
        plain_first = i % 2 == 1
        plain = plain_round(engine, batch, lengths) if plain_first else None
        seconds, tokens = schema_round(engine, batch, args.max_new_tokens)
        assert [len(t) for t in tokens] == lengths, 'greedy outputs changed between rounds'
        plain = plain if plain_first else plain_round(engine, batch, lengths)
        with_schema.append(count / seconds)
        without.append(count / plain)
        ratios.append(with_schema[-1] / without[-1])
        print(f'round {i + 1}: {count} tokens   schema {with_schema[-1]:7.1f} tok/s   plain {without[-1]:7.1f} tok/s'
              f'   ratio {ratios[-1]:.3f}')
    ours, plain = statistics.median(with_schema), statistics.median(without)
    ratio = statistics.median(ratios)
    print(f'lmdeploy with a JSON schema : {ours:8.1f} output tok/s ({args.num_prompts} concurrent requests)')
    print(f'lmdeploy without            : {plain:8.1f} output tok/s (same tokens per request)')
    print(f'schema / plain (median)     : {ratio:8.3f}  ({100 * (1 - ratio):.1f}% slower; target: at most 10%)')
    if args.hf:
        theirs = hf_rate(model_dir, engine, batch, engine.model_config.dtype)
        print(f'transformers + xgrammar     : {theirs:8.1f} output tok/s   (lmdeploy {ours / theirs:.2f}x)')


if __name__ == '__main__':
    main()
