"""Schemathesis fuzzing of the server's own OpenAPI schema against a real uvicorn server (issue 18).

Every operation of ``/openapi.json`` gets generated cases, valid (positive) and schema-violating (negative)
ones; each response is checked for: no 5xx and no connection failure, a JSON content type and a body that
matches the documented response schema; afterwards the server must be healthy and every KV block free.

CI runs a bounded, derandomized version (about 150 cases). The full run:

    FUZZ_CASES=500 python -m pytest -q tests/test_fuzz.py -s

prints the case count, the status codes seen and every finding. Generated values that would make a case
slow are clamped before the request is sent (``max_tokens`` etc. at most 8, ``n`` at most 4; a request
without a token limit gets ``max_tokens: 8``) and the engine has a short context (256 tokens).
``benchmark/fuzz_server.py`` runs the same against ``lmdeploy serve api_server``, with hand-made requests too.
"""
from __future__ import annotations

import collections
import copy
import json
import os
import time

import httpx
import pytest
import requests

schemathesis = pytest.importorskip('schemathesis')
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
# from_dict imports this lazily; importing it at collection keeps its compile out of a long session's state (in a
# CI run on Python 3.11.7 that lazy import failed with 'AST constructor recursion depth mismatch')
import schemathesis.specs.openapi.schemas  # noqa: E402,F401
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

FUZZ_CASES = int(os.environ.get('FUZZ_CASES', '150'))
MAX_TOKENS = 8
MAX_N = 4
GENERATING = {'/v1/chat/completions', '/v1/completions', '/generate'}


def patched_schema(spec: dict, model_name: str = 'tiny') -> dict:
    """The server's schema with the sampling fields steered to where the server does work: the served model
    name and short chat messages as one alternative each, token ids mostly inside the vocabulary."""
    spec = copy.deepcopy(spec)
    schemas = spec['components']['schemas']
    for name in ('ChatCompletionRequest', 'CompletionRequest'):
        model = schemas[name]['properties']['model']
        schemas[name]['properties']['model'] = {'anyOf': [{'type': 'string', 'enum': [model_name]}, model]}
    chat = schemas['ChatCompletionRequest']['properties']
    text_part = {'type': 'object', 'required': ['type', 'text'],
                 'properties': {'type': {'enum': ['text']}, 'text': {'type': 'string', 'maxLength': 40}}}
    message = {'type': 'object', 'required': ['role', 'content'],
               'properties': {'role': {'enum': ['system', 'user', 'assistant']},
                              'content': {'anyOf': [{'type': 'string', 'maxLength': 60},
                                                    {'type': 'array', 'items': text_part, 'maxItems': 3}]}}}
    chat['messages'] = {'anyOf': [{'type': 'array', 'items': message, 'minItems': 1, 'maxItems': 4},
                                  chat['messages']]}
    token = {'type': 'integer', 'minimum': 0, 'maximum': 400}    # the tiny vocabulary has 320 tokens
    schemas['GenerateRequest']['properties']['input_ids'] = {
        'anyOf': [{'type': 'array', 'items': token, 'maxItems': 64}, {'type': 'null'}]}
    schemas['CompletionRequest']['properties']['prompt'] = {'anyOf': [
        {'type': 'string', 'maxLength': 200}, {'type': 'array', 'items': {'type': 'string'}, 'maxItems': 3},
        {'type': 'array', 'items': token, 'minItems': 1, 'maxItems': 64},
        {'type': 'array', 'items': {'type': 'array', 'items': token, 'maxItems': 32}, 'maxItems': 3}]}
    return spec


def clamp(path: str, body):
    """Bounds the work one generated case can ask for (values of the wrong type are left alone)."""
    if path not in GENERATING or not isinstance(body, dict):
        return body
    for key in ('max_tokens', 'max_completion_tokens', 'min_tokens'):
        if type(body.get(key)) is int and body[key] > MAX_TOKENS:
            body[key] = MAX_TOKENS
    if type(body.get('n')) is int and body['n'] > MAX_N:
        body['n'] = MAX_N
    if body.get('max_tokens') is None and body.get('max_completion_tokens') is None:
        body['max_tokens'] = MAX_TOKENS
    return body


CHECKS = {'not_a_server_error': not_a_server_error, 'response_schema_conformance': response_schema_conformance,
          'content_type_conformance': content_type_conformance, 'status_code_conformance': status_code_conformance}


def run_fuzz(url: str, total: int, model_name: str = 'tiny', timeout: float = 60, seed: int | None = None) -> dict:
    """Runs about ``total`` generated cases against the server at ``url`` (serving ``model_name``), each with
    ``timeout`` seconds; returns counts and findings. The cases are the same on each run: those of ``seed``, or
    hypothesis' derandomized ones."""
    served = httpx.get(f'{url}/openapi.json').json()
    schema = schemathesis.openapi.from_dict(patched_schema(served, model_name))
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = [op for op in operations if op.method.upper() == 'POST']
    per_post = max(1, total // (2 * len(posts)))
    stats = {'cases': 0, 'status': collections.Counter(), 'findings': [], 'by_operation': collections.Counter(),
             'schema': served}
    session = requests.Session()

    def one(op, mode, case):
        case.body = clamp(op.path, case.body)
        label = f'{op.method.upper()} {op.path}'
        stats['cases'] += 1
        stats['by_operation'][f'{label} {mode.value}'] += 1
        try:
            response = case.call(base_url=url, session=session, timeout=timeout)
        except Exception as exc:  # a crash, a reset connection, a timeout
            stats['findings'].append({'operation': label, 'kind': 'transport', 'mode': mode.value,
                                      'body': case.body, 'response': repr(exc)})
            return
        stats['status'][response.status_code] += 1
        for name, check in CHECKS.items():
            try:
                case.validate_response(response, checks=[check])
            except (Exception, FailureGroup) as exc:  # a FailureGroup is a BaseExceptionGroup
                stats['findings'].append({'operation': label, 'kind': name, 'mode': mode.value, 'body': case.body,
                                          'status': response.status_code, 'response': response.text[:300],
                                          'message': str(exc).splitlines()[0][:200] if str(exc) else repr(exc)})

    for op in operations:
        modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if op in posts else [GenerationMode.POSITIVE]
        for mode in modes:
            examples = per_post if op in posts else 2

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, derandomize=seed is None, database=None, deadline=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
            def fuzz(case):
                one(current[0], current[1], case)
            current = (op, mode)
            (fuzz if seed is None else hypothesis_seed(seed)(fuzz))()
    return stats


def summary(stats: dict) -> str:
    lines = [f"{stats['cases']} cases; status codes {dict(sorted(stats['status'].items()))}"]
    lines += [f'  {name}: {count}' for name, count in sorted(stats['by_operation'].items())]
    kinds = collections.Counter((f['operation'], f['kind']) for f in stats['findings'])
    lines += [f'  finding {op} {kind}: {count}' for (op, kind), count in sorted(kinds.items())]
    seen = set()
    for f in stats['findings']:
        if (f['operation'], f['kind']) not in seen:
            seen.add((f['operation'], f['kind']))
            lines.append('  example: ' + json.dumps(f, default=str)[:800])
    return '\n'.join(lines)


@pytest.fixture(scope='module')
def fuzzed(tiny_llama):
    from server_helpers import ServerThread, tiny_engine

    from lmdeploy.serve.openai.api_server import create_app
    engine = tiny_engine(tiny_llama, session_len=256)
    server = ServerThread(create_app(engine, model_name='tiny'))
    try:
        start = time.monotonic()
        stats = run_fuzz(server.url, FUZZ_CASES)
        stats['elapsed'] = time.monotonic() - start
        print(f"\nfuzz: {summary(stats)}\n  {stats['elapsed']:.1f} s")
        health = httpx.get(f'{server.url}/health', timeout=10)
        deadline = time.monotonic() + 10      # aborted requests give their blocks back asynchronously
        bm = engine.engine.block_manager
        while bm.num_free_blocks != bm.num_blocks and time.monotonic() < deadline:
            time.sleep(0.1)
        stats['health'] = health.status_code
        stats['free_blocks'] = (bm.num_free_blocks, bm.num_blocks)
        stats['running'] = server.metrics().get('lmdeploy:num_requests_running')
        yield stats
    finally:
        server.stop()
        engine.close()


@pytest.mark.slow
def test_fuzz_no_server_errors(fuzzed):
    """No 5xx and no dropped connection; enough cases ran."""
    assert fuzzed['cases'] >= 0.8 * FUZZ_CASES, summary(fuzzed)
    bad = [f for f in fuzzed['findings'] if f['kind'] in ('not_a_server_error', 'transport')]
    assert not bad, summary(fuzzed)


@pytest.mark.slow
def test_fuzz_server_healthy_after(fuzzed):
    """The server is healthy afterwards, nothing runs and every KV block is free."""
    assert fuzzed['health'] == 200
    assert fuzzed['running'] == 0
    free, total = fuzzed['free_blocks']
    assert free == total, f'{total - free} KV blocks leaked'


@pytest.mark.slow
def test_fuzz_responses_match_schema(fuzzed):
    """Every response has a documented status, content type and body."""
    found = [f for f in fuzzed['findings'] if f['kind'] not in ('not_a_server_error', 'transport')]
    assert not found, summary(fuzzed)


@pytest.mark.slow
def test_schema_documents_error_bodies(fuzzed):
    """Errors are documented as the OpenAI error body, not as FastAPI's 422; /metrics is Prometheus text."""
    paths = fuzzed['schema']['paths']
    error_body = {'$ref': '#/components/schemas/ErrorResponse'}
    for path, operations in paths.items():
        for method, operation in operations.items():
            responses = operation['responses']
            assert '422' not in responses, f'{method} {path}'
            if method == 'post':
                for status in ('400', '413'):
                    assert responses[status]['content']['application/json']['schema'] == error_body, f'{path} {status}'
    for path in GENERATING:
        statuses = set(paths[path]['post']['responses'])
        assert {'200', '400', '404', '413', '429', '500', '503'} <= statuses, path
        assert 'text/event-stream' in paths[path]['post']['responses']['200']['content'], path
    assert 'Retry-After' in paths['/v1/chat/completions']['post']['responses']['429']['headers']
    assert list(paths['/metrics']['get']['responses']['200']['content']) == ['text/plain']
    assert 'HTTPValidationError' not in fuzzed['schema']['components']['schemas']
