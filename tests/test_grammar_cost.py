"""What drives a response format's compile time is bounded before it compiles: its size, the character classes
and the optional items its regexes or grammar spell out are each a 400 at once, naming their flag, and a
schema nests no deeper than a request; real agents' tool sets and schemas pass; repeated pattern strings
compile once; a cached format is served while slow compiles hold both grammar workers."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import xgrammar as xgr
from agent_schemas import agent_tools, deployment, invoice
from server_helpers import serve, tiny_engine
from test_grammar_limits import assert_same_masks

from lmdeploy import GenerationConfig
from lmdeploy.pytorch.engine.grammar_cost import (format_cost, format_size, grammar_optionals, grammar_repetition,
                                                  json_depth, pattern_repetition, regex_optionals, regex_repetition,
                                                  share_regex_strings)
from lmdeploy.pytorch.engine.guided import Grammar, GrammarCompiler
from lmdeploy.serve.openai.limits import RequestLimits, check_grammar_cost
from lmdeploy.serve.openai.protocol import ChatTool
from lmdeploy.serve.openai.tool_choice import required_schema
from lmdeploy.tokenizer import Tokenizer

CHAT = {'model': 'tiny', 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 8}


def json_schema(schema) -> dict:
    return {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': schema}}


def nested_arrays(depth: int) -> dict:
    schema = {'type': 'string'}
    for _ in range(depth):
        schema = {'type': 'array', 'items': schema}
    return schema


def test_regex_repetition_counts_classes_and_bounds():
    assert regex_repetition(r'^[a-c]{2,4}-\d{3}$') == 7
    assert regex_repetition('^[a-z]{0,50000}$') == 50_000
    assert regex_repetition('(ab{0,10}){0,100}x{5,}') == 1005
    assert regex_repetition(r'[{0,99999}]\{0,99999\}\p{L}{2}') == 3  # a class of braces, literal braces, \p{L}
    assert regex_repetition('[a-z]' * 700 + '.' * 300 + 'literal') == 1000
    assert regex_repetition('[a-z]{0,100000}', expand=False) == 1  # a regex format keeps them lazy
    assert regex_repetition('.?' * 12 + '[a-z]' * 300) == 78 + 300 * 13  # each class after 12 optional items: 13
    schema = {'type': 'object', 'patternProperties': {'^k{3}$': {'type': 'string', 'pattern': '^a{0,10}$'}},
              'properties': {'pattern': {'type': 'string', 'pattern': 'b{20}'},
                             'mail': {'type': 'string', 'format': 'email'}}, 'default': {'pattern': 'c{999}'}}
    assert pattern_repetition(schema) == 33 + 20
    twice = {'type': 'object', 'properties': {k: {'type': 'string', 'pattern': '^[a-z]{0,300}$', 'description': k}
                                              for k in ('a', 'b', 'c')}}
    assert pattern_repetition(twice) == 300  # one definition, compiled once


def test_optional_items_and_grammars():
    assert regex_optionals('.?' * 30) == 30 and regex_optionals('(a|)(|b)c|') == 3
    assert regex_optionals(r'^\+?1?\d{9,15}$') == 2 and regex_optionals('(?:a|b)?c??d*?') == 2
    assert regex_optionals('(a?){0,50}') == 50 and regex_optionals('(a?){0,50}', expand=False) == 1
    grammar = 'root ::= a b # c? [x]\na ::= "x" | \nb ::= [0-9]+ ("." [0-9]{1,3})? ""\n'
    assert (grammar_repetition(grammar), grammar_optionals(grammar)) == (4, 3)  # [0-9] after the empty "x" | 
    assert grammar_repetition('root ::= [a-z]{0,100000} "[a-z]"') == 1


def test_sizes_and_depths():
    assert (json_depth(1), json_depth({}), json_depth({'a': [[], 2]})) == (0, 1, 3)
    assert json_depth(nested_arrays(100)) == 101
    assert format_size(json_schema({'enum': ['é']})) == len('{"enum":["é"]}'.encode())
    assert format_size({'type': 'choice', 'choice': ['a', 'b']}) == 9
    assert format_size({'type': 'grammar', 'grammar': 'root ::= "x"'}) == 12
    assert format_cost({'type': 'json_object'}) == format_cost({'type': 'choice', 'choice': ['a']})


def realistic_formats() -> dict[str, dict]:
    tools = [ChatTool.model_validate(t) for t in agent_tools()]
    return {'31 tools, tool_choice required': json_schema(required_schema(tools, True)),
            'deployment spec': json_schema(deployment()), 'pydantic invoice': json_schema(invoice()),
            'ISO 8601 regex': {'type': 'regex', 'regex': r'\d{4}-\d{2}-\d{2}(T\d{2}:\d{2}(:\d{2}(\.\d+)?)?'
                                                         r'(Z|[+-]\d{2}:\d{2})?)?'},
            'arithmetic grammar': {'type': 'grammar', 'grammar': 'root ::= expr\nexpr ::= term (("+" | "-") term)*\n'
                                   'term ::= factor (("*" | "/") factor)*\nfactor ::= "-"? (num | "(" expr ")")\n'
                                   'num ::= [0-9]+ ("." [0-9]+)? ([eE] [-+]? [0-9]+)?\n'}}


@pytest.mark.parametrize('name', list(realistic_formats()))
def test_real_agent_formats_pass_the_defaults(name):
    fmt = realistic_formats()[name]
    check_grammar_cost(RequestLimits(), fmt, 'response_format')
    cost = format_cost(fmt)
    print(f'{name}: {format_size(fmt)} bytes, {cost}')
    if name.startswith('31 tools'):
        assert format_size(fmt) > 25_000 and json_depth(fmt['json_schema']['schema']) > 10 and cost.repetition > 250


def test_a_tool_set_is_served_with_tool_choice_required(api_server):
    body = {**CHAT, 'max_tokens': 32, 'tools': agent_tools(), 'tool_choice': 'required'}
    response = httpx.post(f'{api_server.url}/v1/chat/completions', json=body, timeout=120)
    assert response.status_code == 200, response.text


def test_repeated_regex_strings_are_defined_once_with_the_same_masks(tiny_llama):
    shared = {'type': 'string', 'pattern': '^[a-c]{1,3}$'}
    schema = {'type': 'object', 'required': ['a', 'b', 'm'], 'properties': {
        'a': shared, 'b': {**shared, 'description': 'b'}, 'c': {'type': 'string', 'pattern': '^x+$'},
        'm': {'type': 'string', 'format': 'email'}, 'n': {'type': 'string', 'format': 'email'}}}
    rewritten = share_regex_strings(schema)
    assert rewritten['properties']['a'] == rewritten['properties']['b'] != rewritten['properties']['m']
    assert rewritten['properties']['m'] == rewritten['properties']['n']
    assert rewritten['properties']['a']['$ref'].removeprefix('#/$defs/') in rewritten['$defs']
    assert rewritten['properties']['c'] == schema['properties']['c'] and len(rewritten['$defs']) == 2
    assert share_regex_strings(invoice()) == invoice()  # nothing repeated: as it was
    tokenizer = Tokenizer(tiny_llama)
    vocab = len(tokenizer.hf)
    ours = GrammarCompiler(tokenizer, vocab).compile(GenerationConfig(response_format=json_schema(schema)))
    theirs = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer.hf, vocab_size=vocab,
                                                                    stop_token_ids=sorted(tokenizer.eos_token_ids)))
    compiled = theirs.compile_grammar(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True,
                                                                   max_whitespace_cnt=16))
    assert_same_masks(ours, Grammar(compiled), vocab)


GRAMMAR_OPTIONALS = 'root ::= ' + '[a-z]? ' * 40
BIG_ENUM = json_schema({'enum': [f'value {i}' for i in range(12_000)]})
OVER = [  # (limit, what a request sends, the value the error names)
    ('max_grammar_size', {'response_format': BIG_ENUM}, str(format_size(BIG_ENUM))),
    ('max_grammar_repetition', {'structured_outputs': {'regex': '[a-z]' * 1500}}, '1500'),
    ('max_grammar_repetition', {'structured_outputs': {'grammar': 'root ::= ' + '[0-9] ' * 1200}}, '1200'),
    ('max_grammar_repetition', {'structured_outputs': {'regex': '.?' * 12 + '[a-z]' * 300}}, '3978'),
    ('max_grammar_repetition', {'response_format': json_schema({'type': 'object', 'properties': {
        'r': {'type': 'string', 'pattern': '^[a-z]{0,990}$'}, 'since': {'type': 'string', 'format': 'date-time'},
        'until': {'type': 'string', 'format': 'date-time', 'description': 'the same: counted once'}}})}, '1010'),
    ('max_grammar_optionals', {'response_format': json_schema({'type': 'string', 'pattern': '^' + '.?' * 40})},
     '40'),
    ('max_grammar_optionals', {'structured_outputs': {'grammar': GRAMMAR_OPTIONALS}}, '40'),
]


@pytest.mark.parametrize('limit,fields,value', OVER, ids=[f'{o[0]}-{list(o[1])[0]}' for o in OVER])
def test_each_limit_is_400_at_once_naming_its_flag(api_server, limit, fields, value):
    start = time.monotonic()
    response = httpx.post(f'{api_server.url}/v1/chat/completions', json={**CHAT, **fields}, timeout=60)
    seconds = time.monotonic() - start
    assert response.status_code == 400, response.text
    error = response.json()['error']
    flag, default = '--' + limit.replace('_', '-'), getattr(RequestLimits(), limit)
    assert error['code'] == f'{limit}_exceeded' and error['param'] == list(fields)[0], error
    assert f'is {value}, over the limit of {default}' in error['message'] and f'{flag} is {default}' in error['message']
    assert seconds < 2, f'{seconds:.2f} s: not at once'


@pytest.mark.parametrize('how', ['a body', 'a schema sent as text'])
def test_a_schema_nests_no_deeper_than_a_request(api_server, how):
    """Depth costs faster than quadratically (arrays 400 deep: over 20 s); a request's JSON nests 64 levels at most,
    and so does a schema sent as text."""
    schema = nested_arrays(100)
    body = {**CHAT, 'structured_outputs': {'json': json.dumps(schema) if how.endswith('text') else schema}}
    start = time.monotonic()
    response = httpx.post(f'{api_server.url}/v1/chat/completions', json=body, timeout=60)
    assert response.status_code == 400 and time.monotonic() - start < 2, response.text
    assert 'deeper than 64 levels' in response.json()['error']['message']
    body['structured_outputs']['json'] = '[' * 100_000
    assert httpx.post(f'{api_server.url}/v1/chat/completions', json=body, timeout=60).status_code == 400


def test_completions_check_the_limits_too(api_server):
    body = {'model': 'tiny', 'prompt': 'hi', 'max_tokens': 4, 'structured_outputs': {'regex': '.?' * 30}}
    response = httpx.post(f'{api_server.url}/v1/completions', json=body, timeout=60)
    assert response.status_code == 400 and response.json()['error']['code'] == 'max_grammar_optionals_exceeded'
    body['structured_outputs'] = {'regex': '.?' * 20}
    assert httpx.post(f'{api_server.url}/v1/completions', json=body, timeout=60).status_code == 200


@pytest.fixture(scope='module')
def unbounded_server(tiny_llama):
    """A server whose formats are bounded by their compile time alone."""
    limits = RequestLimits(max_grammar_size=None, max_grammar_compile_seconds=4)
    yield from serve(tiny_engine(tiny_llama), model_name='tiny', limits=limits)


def test_a_cached_format_is_served_while_slow_compiles_hold_both_workers(unbounded_server):
    cached = {**CHAT, 'max_tokens': 4, 'response_format': json_schema({'type': 'integer'})}
    slow = [{**CHAT, 'response_format': json_schema({'enum': [f'{tag} value {i}' for i in range(60_000)]})}
            for tag in ('first', 'second')]
    pool = unbounded_server.engine._grammar_pool

    async def main():
        async with httpx.AsyncClient(base_url=unbounded_server.url, timeout=120) as http:
            assert (await http.post('/v1/chat/completions', json=cached)).status_code == 200
            compiling = [asyncio.create_task(http.post('/v1/chat/completions', json=body)) for body in slow]
            for _ in range(500):
                if not pool._workers.idle.qsize():  # both workers taken
                    break
                await asyncio.sleep(0.02)
            start = time.monotonic()
            served = await http.post('/v1/chat/completions', json=cached)
            seconds = time.monotonic() - start
            busy = not any(task.done() for task in compiling)
            return served, seconds, busy, await asyncio.gather(*compiling)

    served, seconds, busy, refused = asyncio.run(main())
    assert served.status_code == 200, served.text
    assert [r.json()['error']['code'] for r in refused] == ['max_grammar_compile_seconds_exceeded'] * 2
    assert busy, 'the slow compiles ended before the cached format was asked for: nothing was tested'
    assert seconds < 2, f'the cached format waited {seconds:.2f} s behind the compiles'


def test_a_client_that_leaves_while_its_format_compiles_frees_its_slot_and_session_at_once(unbounded_server):
    """A chat request held its admission slot and its session until its grammar compiled (or hit the limit, 4 s
    here), though its client had gone; they are given back as soon as the client goes, and it never runs."""
    state, engine = unbounded_server.app.state.server, unbounded_server.engine
    slow = {**CHAT, 'session_id': 77, 'response_format': json_schema({'enum': [f'gone {i}' for i in range(60_000)]})}

    async def main():
        async with httpx.AsyncClient(base_url=unbounded_server.url, timeout=60) as http:
            warm = await http.post('/v1/chat/completions', json={**CHAT, 'response_format': json_schema(
                {'type': 'integer'})})
            assert warm.status_code == 200, warm.text  # the grammar workers' start is not the compile's
            with pytest.raises(httpx.ReadTimeout):
                await http.post('/v1/chat/completions', json=slow, timeout=0.5)
            left = time.monotonic()
            while (state.admission.running or engine.session_manager.sessions) and time.monotonic() - left < 2:
                await asyncio.sleep(0.02)
            return time.monotonic() - left, (await http.post('/v1/chat/completions', json={**CHAT, 'session_id': 77}))

    finished = sum(v for k, v in unbounded_server.metrics().items() if k.startswith('lmdeploy:request_success_total'))
    seconds, again = asyncio.run(main())
    assert seconds < 1, f'the slot or the session was held {seconds:.2f} s after the client left'
    assert again.status_code == 200, again.text
    after = sum(v for k, v in unbounded_server.metrics().items() if k.startswith('lmdeploy:request_success_total'))
    assert after == finished + 2, 'the request whose client left ran'
