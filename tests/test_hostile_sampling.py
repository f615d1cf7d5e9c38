"""Hostile input through the Python API: extreme but accepted sampling values (the sampler never makes a NaN
weight or an out-of-range token, which would fail the whole engine step and so every request batched with the
hostile one), out-of-range seeds and text that is not valid Unicode."""
from __future__ import annotations

import itertools
import json

import pytest
import torch

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.engine import sampler
from lmdeploy.pytorch.engine.sampler import sample
from lmdeploy.pytorch.engine.sequence import Sequence

VOCAB = 300
_ids = itertools.count()


def _seq(**cfg) -> Sequence:
    seq = Sequence(next(_ids), [1, 2, 3, 4], GenerationConfig(**cfg), frozenset())
    seq.output_ids = [5, 6]
    return seq


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


HOSTILE = [dict(temperature=5e-324), dict(temperature=1e-38), dict(temperature=2e-5),
           dict(temperature=2e-5, top_p=0.5), dict(temperature=2e-5, top_k=5), dict(temperature=1e-38, min_p=0.5),
           dict(repetition_penalty=1e-300), dict(repetition_penalty=1e-300, temperature=2e-5, top_p=0.9),
           dict(repetition_penalty=1e-300, top_k=3), dict(repetition_penalty=100.0, temperature=2.0)]


@pytest.mark.parametrize('one_pass', [False, True])
def test_extreme_values_give_valid_tokens(monkeypatch, one_pass):
    """Each hostile row gets a token in the vocabulary; the CPU path and the GPU's one-pass path alike."""
    monkeypatch.setattr(sampler, '_one_pass', lambda x: one_pass)
    seqs = [_seq(do_sample=True, random_seed=i, **cfg) for i, cfg in enumerate(HOSTILE)]
    for _ in range(3):
        tokens = sample(_logits(len(seqs)), seqs).token_ids
        assert all(0 <= t < VOCAB for t in tokens), tokens


def test_temperatures_below_the_threshold_are_greedy():
    logits = _logits(3)
    seqs = [_seq(do_sample=True, temperature=t, random_seed=1) for t in (5e-324, 1e-38, 9e-6)]
    assert all(s.gen_config.is_greedy for s in seqs)
    assert sample(logits, seqs).token_ids == logits.argmax(-1).tolist()
    assert not GenerationConfig(do_sample=True, temperature=1e-5).is_greedy


@pytest.mark.parametrize('one_pass', [False, True])
def test_top_k_beyond_the_vocabulary_is_the_whole_vocabulary(monkeypatch, one_pass):
    monkeypatch.setattr(sampler, '_one_pass', lambda x: one_pass)
    logits = _logits(2)
    huge = [_seq(do_sample=True, top_k=k, random_seed=7) for k in (10 ** 30, VOCAB + 1)]
    whole = [_seq(do_sample=True, top_k=VOCAB, random_seed=7) for _ in range(2)]
    assert sample(logits, huge).token_ids == sample(logits, whole).token_ids


def test_random_seed_range():
    for seed in (-2 ** 63, 2 ** 64 - 1):
        _seq(do_sample=True, random_seed=seed)
    for seed in (-2 ** 63 - 1, 2 ** 64, 10 ** 100):
        with pytest.raises(ValueError, match='random_seed'):
            GenerationConfig(random_seed=seed)


def test_a_bad_prompt_fails_only_itself(tiny_llama):
    """A prompt the tokenizer (a TypeError) or the chat template (a RecursionError) could not take raised out of
    ``pipe([...])`` before, losing the other answers; now it gets its own error response."""
    from test_pipeline import make_pipe
    deep = [{'role': 'user', 'content': 'hi', 'x': json.loads('[' * 900 + ']' * 900)}]
    with make_pipe(tiny_llama) as pipe:
        config = GenerationConfig(max_new_tokens=3, ignore_eos=True)
        surrogate, nested, good = pipe(['a \ud800 b', deep, 'hello'], config)
        assert surrogate.finish_reason == 'error' and 'lone UTF-16 surrogate' in surrogate.error
        assert nested.finish_reason == 'error' and 'nest too deeply' in nested.error
        assert good.finish_reason == 'length' and good.generate_token_len == 3


def test_schema_text_nested_past_what_json_reads_is_a_value_error():
    """A JSON schema given as text and nested deeper than ``json.loads`` reads raised its RecursionError out of
    ``GenerationConfig``, not the ValueError of every other malformed format."""
    nested = '[' * 1100 + ']' * 1100
    with pytest.raises(ValueError, match='json_schema.schema is not valid JSON'):
        GenerationConfig(response_format={'type': 'json_schema', 'json_schema': {'schema': nested}})
