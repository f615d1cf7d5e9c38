"""Grammar-constrained decoding in the engine: a random model's output still parses, validates or matches,
per request in a batch, under preemption, chunked prefill, prefix-cache hits and overlapped scheduling."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import jsonschema
import pytest
import torch
from helpers import make_engine, random_prompts

from lmdeploy import GenerationConfig, PytorchEngineConfig
from lmdeploy.pytorch.engine.guided import Grammar, GrammarCompiler, GrammarState
from lmdeploy.pytorch.engine.sampler import sample
from lmdeploy.pytorch.engine.sequence import Sequence
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.exceptions import SafeRunException

PERSON = {'type': 'object', 'additionalProperties': False, 'required': ['name', 'age', 'tags', 'ok'],
          'properties': {'name': {'type': 'string', 'maxLength': 6},
                         'age': {'type': 'integer', 'minimum': 0, 'maximum': 120},
                         'tags': {'type': 'array', 'items': {'enum': ['a', 'b']}, 'maxItems': 3},
                         'ok': {'type': 'boolean'}}}
REGEX = r'[a-c]{2,4}-\d{3}'
CHOICES = ['yes', 'no', 'maybe']
FORMATS = {
    'json_schema': {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON, 'strict': True}},
    'json_object': {'type': 'json_object'},
    'regex': {'type': 'regex', 'regex': REGEX},
    'choice': {'type': 'choice', 'choice': CHOICES},
    'grammar': {'type': 'grammar', 'grammar': 'root ::= "<" ("x" | "y"){1,5} ">"'},
}


def conforms(kind: str, text: str) -> bool:
    if kind == 'json_schema':
        jsonschema.validate(json.loads(text), PERSON)
        return True
    if kind == 'json_object':
        return isinstance(json.loads(text), dict)
    if kind == 'regex':
        return re.fullmatch(REGEX, text) is not None
    if kind == 'choice':
        return text in CHOICES
    return re.fullmatch(r'<[xy]{1,5}>', text) is not None


def generate(engine, requests) -> list[tuple[str, list[int], str]]:
    """(text, token ids, finish reason) of each (prompt, gen_config) request, run together."""
    index = {engine.add_request(p, g): i for i, (p, g) in enumerate(requests)}
    texts, tokens, finish = [''] * len(requests), [[] for _ in requests], [None] * len(requests)
    while engine.has_unfinished():
        for out in engine.step():
            i = index[out.seq_id]
            texts[i] += out.text
            tokens[i] += out.token_ids
            finish[i] = out.finish_reason or finish[i]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks and not engine.sequences
    return list(zip(texts, tokens, finish))


def constrained(kind: str, sampled: bool = False, seed: int = 0, **kwargs) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=kwargs.pop('max_new_tokens', 500), response_format=FORMATS[kind],
                            do_sample=sampled, temperature=1.0, random_seed=seed, **kwargs)


@pytest.fixture(scope='module')
def engine(tiny_llama):
    return make_engine(tiny_llama)


def test_entry_points_import_no_xgrammar():
    """xgrammar (0.2 s of CPU after torch and transformers, at every start) is imported where a grammar is first
    used, not by the chat, pipeline or server entry points."""
    code = ('import sys\nimport lmdeploy.api, lmdeploy.cli.chat, lmdeploy.serve.openai.api_server\n'
            'import lmdeploy.pytorch.engine.engine, lmdeploy.pytorch.engine.grammar_worker\n'
            "print('xgrammar' in sys.modules)")
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == 'False', out


def test_every_format_conforms_greedy_and_sampled(engine):
    prompts = random_prompts([9, 14, 6, 11, 8], seed=1)
    requests = [(p, constrained(kind, sampled, seed)) for p, kind in zip(prompts, FORMATS)
                for sampled, seed in ((False, 0), (True, 1), (True, 2))]
    finished = set()
    for (p, g), (text, _, finish) in zip(requests, generate(engine, requests)):
        kind = g.response_format['type']
        if kind == 'json_object' and finish == 'length':  # any object: a random model may ramble on
            continue
        assert finish == 'stop' and conforms(kind, text), (kind, text)
        finished.add(kind)
    assert finished == set(FORMATS)


def test_masks_are_per_request(engine):
    """A constrained request changes nothing for the others in its batch, and gets what it gets alone."""
    prompts = random_prompts([10, 12, 7], seed=3)
    free = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    requests = [(prompts[0], free), (prompts[1], constrained('json_schema')), (prompts[2], free)]
    batched = generate(engine, requests)
    assert batched == [generate(engine, [r])[0] for r in requests]
    assert not conforms('choice', batched[0][0])


def test_preemption_chunked_prefill_and_prefix_cache(tiny_llama, engine):
    prompts = random_prompts([40, 50, 60, 45, 30], seed=2)
    requests = [(p, constrained(kind)) for p, kind in zip(prompts, ['json_schema'] * 4 + ['regex'])]
    roomy = generate(engine, requests)
    tight = make_engine(tiny_llama, num_gpu_blocks=24, enable_prefix_caching=False)
    assert generate(tight, requests) == roomy
    assert tight.scheduler.num_preemptions > 0
    chunked = make_engine(tiny_llama, max_prefill_token_num=16)
    assert generate(chunked, requests) == roomy
    assert chunked.block_manager.num_hits == 0
    assert generate(chunked, requests) == roomy
    assert chunked.block_manager.num_hits > 0


def test_overlapped_schedule_waits_for_grammar_rows(tiny_llama, engine):
    requests = [(p, constrained(kind)) for p, kind in zip(random_prompts([8, 9, 10], seed=5), FORMATS)]
    requests.append((random_prompts([7], seed=6)[0], GenerationConfig(max_new_tokens=12, ignore_eos=True)))
    assert generate(make_engine(tiny_llama, overlap_schedule=True), requests) == generate(engine, requests)


def test_length_stop_words_and_min_tokens(engine):
    """A reply cut by max_new_tokens is 'length'; stop words and min_new_tokens yield to the grammar."""
    prompt = random_prompts([9], seed=7)[0]
    text, tokens, finish = generate(engine, [(prompt, constrained('json_schema', max_new_tokens=3))])[0]
    assert finish == 'length' and len(tokens) == 3 and text.startswith('{')
    text, _, finish = generate(engine, [(prompt, constrained('json_schema', stop_words=['"', 'a']))])[0]
    assert finish == 'stop' and conforms('json_schema', text), 'stop words do not cut what a grammar constrains'
    marker = engine.tokenizer.encode('<|im_start|>', add_special_tokens=False)[0]
    before = constrained('choice', response_format_after='<|im_start|>', stop_words=['<|im_start|>'],
                         logit_bias={marker: 100.0}, skip_special_tokens=False)
    assert generate(engine, [(prompt, before)])[0][0] == '', 'they do apply before the grammar starts'
    text, _, finish = generate(engine, [(prompt, constrained('choice', min_new_tokens=50))])[0]
    assert finish == 'stop' and text in CHOICES


def test_grammar_starts_after_the_marker(engine):
    """Until the marker is sampled the model is free; after it, the grammar holds."""
    marker = engine.tokenizer.encode('<|im_start|>', add_special_tokens=False)
    assert len(marker) == 1
    gen = constrained('choice', response_format_after='<|im_start|>', logit_bias={marker[0]: 100.0},
                      skip_special_tokens=True)
    text, tokens, finish = generate(engine, [(random_prompts([6], seed=8)[0], gen)])[0]
    assert tokens[0] == marker[0] and finish == 'stop' and text in CHOICES


def test_state_waits_for_a_multi_token_marker(engine):
    grammar = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size).compile(
        GenerationConfig(response_format=FORMATS['choice'], response_format_after='ab'))
    state = GrammarState(grammar)
    first, second = grammar.after_ids if len(grammar.after_ids) == 2 else pytest.skip('marker is one token')
    assert not state.accept(second, []) and not state.active
    assert not state.accept(first, [second]) and not state.active
    assert not state.accept(second, [second, first]) and state.active


def _waiting_sequence(engine, **markers) -> tuple[Sequence, Grammar]:
    config = GenerationConfig(response_format=FORMATS['choice'], **markers)
    grammar = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size).compile(config)
    seq = Sequence(0, [1], config, engine.tokenizer.eos_token_ids)
    seq.grammar = GrammarState(grammar)
    return seq, grammar


def test_reply_cannot_stop_before_its_grammar_applies(engine):
    """Waiting for its marker, a reply with a grammar cannot end: it would end without its format (the end
    of sequence, the likeliest token here, was sampled unless something else edited the logits)."""
    seq, _ = _waiting_sequence(engine, response_format_after='<|im_start|>')
    logits = torch.zeros(2, engine.model_config.vocab_size)
    eos = sorted(engine.tokenizer.eos_token_ids)[0]
    logits[:, eos] = 10
    plain = Sequence(1, [1], GenerationConfig(), engine.tokenizer.eos_token_ids)
    assert sample(logits, [seq, plain]).token_ids == [int(logits[0, :eos].argmax()), eos]


def test_opener_decides_where_the_grammar_applies(engine):
    """With an opener, the first token is the grammar's or the opener's: the opener takes the grammar out
    until the marker, any other token starts it."""
    opener = engine.tokenizer.encode('<|im_start|>', add_special_tokens=False)
    assert len(opener) == 1
    vocab = engine.model_config.vocab_size
    seq, grammar = _waiting_sequence(engine, response_format_after='<|im_end|>', response_format_opener='<|im_start|>')
    logits = torch.zeros(1, vocab)
    logits[0, opener[0]] = 10
    assert sample(logits, [seq]).token_ids == opener
    assert not seq.grammar.accept(opener[0], []) and not seq.grammar.active and not seq.grammar.opening
    other = 5  # no choice starts with it: the grammar's tokens are taken instead
    seq.grammar = GrammarState(grammar)
    logits = torch.zeros(1, vocab)
    logits[0, other], logits[0, opener[0]] = 10, -10
    first = sample(logits, [seq]).token_ids[0]
    assert first not in (other, opener[0])
    assert not seq.grammar.accept(first, []) and seq.grammar.active and not seq.grammar.opening


def test_opener_and_grammar_share_a_prefix(engine):
    """'<think>' and the grammar's '<x>' both start with '<': after it, either may go on, and the grammar
    that went on is matched from the reply's start (before, '<' forced the rest of the opener); once the
    opener is under way the grammar's tokens are not allowed, and it applies from its start after the marker."""
    tok = engine.tokenizer
    lt, x, close = (tok.encode(s, add_special_tokens=False)[0] for s in ('<', 'x', '>'))
    config = GenerationConfig(response_format=FORMATS['grammar'], response_format_after='</think>',
                              response_format_opener='<think>')
    grammar = GrammarCompiler(tok, engine.model_config.vocab_size).compile(config)

    def sampled(seq, token: int) -> int:
        logits = torch.zeros(1, engine.model_config.vocab_size)
        logits[0, token] = 10
        return sample(logits, [seq]).token_ids[0]

    seq = Sequence(0, [1], config, tok.eos_token_ids)
    seq.grammar = GrammarState(grammar)
    output = []
    for token in (lt, x, close):
        assert sampled(seq, token) == token
        assert not seq.grammar.accept(token, output)
        output.append(token)
    assert seq.grammar.active and not seq.grammar.opening
    assert sampled(seq, x) in tok.eos_token_ids
    seq.grammar = GrammarState(grammar)
    output = list(grammar.opener_ids)
    for i, token in enumerate(output):
        assert sampled(seq, x if i == 2 else token) == token
        assert not seq.grammar.accept(token, output[:i])
    assert not seq.grammar.active and not seq.grammar.opening
    for token in tok.encode('</think>', add_special_tokens=False):
        assert not seq.grammar.accept(token, output)
        output.append(token)
    assert seq.grammar.active and seq.grammar.matcher.accept_token(lt)


def test_bad_formats_are_rejected(tiny_llama, engine):
    with pytest.raises(ValueError, match='response_format'):
        GenerationConfig(response_format={'type': 'xml'})
    with pytest.raises(ValueError, match='could not be compiled: Regex parsing error'):
        engine.add_request([1, 2, 3], GenerationConfig(response_format={'type': 'regex', 'regex': '(a'}))
    assert not engine.sequences

    async def main():
        async_engine = AsyncEngine(tiny_llama, PytorchEngineConfig(num_gpu_blocks=64))  # not the default 4 GiB cache
        try:
            bad = GenerationConfig(response_format={'type': 'json_schema', 'json_schema': {'schema': {'type': 'x'}}})
            with pytest.raises(SafeRunException, match='Unsupported type'):
                async for _ in async_engine.generate(input_ids=[1, 2, 3], gen_config=bad):
                    pass
            good = constrained('regex', sampled=True, seed=4)
            outs = await asyncio.gather(*(async_engine.collect(async_engine.generate(input_ids=[1, 2, 3 + i],
                                                                                     gen_config=good))
                                          for i in range(4)))
            assert all(r.finish_reason == 'stop' and conforms('regex', r.text) for r in outs)
        finally:
            async_engine.close()
    asyncio.run(main())


def test_logprobs_are_those_of_the_raw_logits(engine):
    prompt = random_prompts([8], seed=11)[0]

    def first_logprobs(gen: GenerationConfig) -> dict[int, float]:
        engine.add_request(prompt, gen)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        return outs[0].logprobs[0]

    raw = first_logprobs(GenerationConfig(max_new_tokens=1, logprobs=2))
    masked = first_logprobs(constrained('choice', logprobs=2))
    assert {t: masked[t] for t in raw} == pytest.approx(raw)


def test_abort_frees_a_constrained_request(engine):
    seq_id = engine.add_request(random_prompts([9], seed=12)[0], constrained('json_schema'))
    for _ in range(3):
        engine.step()
    assert engine.abort(seq_id).finish_reason == 'abort'
    assert engine.abort(seq_id) is None and not engine.sequences and not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
