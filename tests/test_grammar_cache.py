"""The compiled-grammar cache's bound (``--grammar-cache-mb``, ``PytorchEngineConfig.grammar_cache_mb``): set from
the command line, kept by the server's cache on the default model's 49k vocabulary, where a small object schema
compiles to about 2 MiB, and 0 keeps nothing."""
from __future__ import annotations

import json

import openai
import pytest
import xgrammar as xgr
from server_helpers import serve, tiny_engine

from lmdeploy import GenerationConfig
from lmdeploy.cli.args import engine_config
from lmdeploy.cli.main import build_parser
from lmdeploy.messages import ConfigError, PytorchEngineConfig
from lmdeploy.pytorch.engine.grammar_worker import GrammarProcessPool
from lmdeploy.pytorch.engine.guided import GrammarCompiler
from lmdeploy.tokenizer import Tokenizer

BOUND_MB = 5


def digit_schema(i: int) -> dict:
    """A format of its own for each ``i``: an object whose one key ``k{i}`` is a digit (about 2 MiB compiled)."""
    return {'type': 'object', 'properties': {f'k{i}': {'type': 'integer', 'minimum': 0, 'maximum': 9}},
            'required': [f'k{i}'], 'additionalProperties': False}


def test_the_flag_reaches_the_engine_config():
    parse = build_parser().parse_args
    assert engine_config(parse(['serve', 'api_server', '--grammar-cache-mb', '7'])).grammar_cache_mb == 7
    assert engine_config(parse(['serve', 'api_server'])).grammar_cache_mb == 512
    assert engine_config(parse(['chat', '--grammar-cache-mb', '0'])).grammar_cache_mb == 0
    with pytest.raises(ConfigError, match='grammar_cache_mb must be >= 0'):
        PytorchEngineConfig(grammar_cache_mb=-1)


@pytest.fixture(scope='module')
def server(default_model_gguf):
    yield from serve(tiny_engine(default_model_gguf, grammar_cache_mb=BOUND_MB), model_name='default')


def counting_misses(pool: GrammarProcessPool, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The formats ``pool`` compiles from now on (a cache hit compiles nothing)."""
    compiled, run = [], pool._run

    def counted(job, gen_config):
        compiled.append(job.fmt)
        return run(job, gen_config)
    monkeypatch.setattr(pool, '_run', counted)
    return compiled


@pytest.mark.slow
def test_many_formats_stay_within_the_bound(server, monkeypatch):
    """Four distinct 2 MiB formats under a 5 MiB bound: the cache's bytes (on /metrics) never pass it, the two
    most recent stay, the latest is a hit when asked for again, and every answer keeps to its format."""
    misses = counting_misses(server.engine._grammar_pool, monkeypatch)
    client = openai.OpenAI(base_url=f'{server.url}/v1', api_key='none')

    def ask(i: int) -> dict:
        reply = client.chat.completions.create(
            model='default', messages=[{'role': 'user', 'content': f'Give k{i} a digit.'}], max_tokens=40,
            temperature=0, response_format={'type': 'json_schema',
                                            'json_schema': {'name': f'd{i}', 'schema': digit_schema(i)}})
        value = json.loads(reply.choices[0].message.content)
        assert list(value) == [f'k{i}'] and value[f'k{i}'] in range(10)
        gauges = {k: v for k, v in server.metrics().items() if k.startswith('lmdeploy:grammar_cache_')}
        assert 0 < gauges['lmdeploy:grammar_cache_bytes'] <= BOUND_MB << 20
        return gauges

    for i in range(4):
        gauges = ask(i)
    assert len(misses) == 4 and gauges['lmdeploy:grammar_cache_entries'] == 2
    assert ask(3) == gauges and len(misses) == 4  # the latest: a hit
    ask(0)  # dropped long ago: compiled again
    assert len(misses) == 5


def test_a_bound_of_zero_keeps_nothing(tiny_llama, monkeypatch):
    """``cache_bytes=0`` (``grammar_cache_mb=0``): every request compiles its format, and each compiles right."""
    tokenizer = Tokenizer(tiny_llama)
    pool = GrammarProcessPool(GrammarCompiler(tokenizer, len(tokenizer.hf), cache_bytes=0), 1)
    misses = counting_misses(pool, monkeypatch)
    try:
        config = GenerationConfig(response_format={'type': 'regex', 'regex': 'ab+'})
        for _ in range(2):
            compiled = pool.submit(config).future.result(60).compiled
            assert xgr.GrammarMatcher(compiled).accept_string('abb')
            assert not xgr.GrammarMatcher(compiled).accept_string('b')
        assert len(misses) == 2 and pool.cache_size() == (0, 0)
    finally:
        pool.close()
