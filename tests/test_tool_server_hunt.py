"""Tool calls through a real server for every tool parser (the hunt of 2026-12-07): one tiny random model
behind one server per parser, made by a regex to write that parser's markup; the message a client gathers
from the stream is the non-streamed one, field by field, and every KV block is free after each request."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from helpers import assert_all_released
from server_helpers import ServerThread, serve_per_parser, tiny_engine
from tool_models import save_tool_model


WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'parameters': {
    'type': 'object', 'required': ['city'], 'properties': {'city': {'type': 'string'}}}}}
NOW = {'type': 'function', 'function': {'name': 'now', 'parameters': {'type': 'object', 'properties': {}}}}
TOOLS = [WEATHER, NOW]
ASK = [{'role': 'user', 'content': 'Weather in Paris?'}]
CALL = '{"city": "Paris"}'
# Per parser: text, then a call of get_weather and one of now, in the parser's markup
REPLIES = {
    'hermes': f'Hi.\n<tool_call>\n{{"name": "get_weather", "arguments": {CALL}}}\n</tool_call>\n'
              '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
    'llama3_json': f'{{"name": "get_weather", "parameters": {CALL}}}; {{"name": "now", "parameters": {{}}}}',
    'pythonic': 'Hi.\n[get_weather(city="Paris"), now()]',
    'mistral': f'Hi.[TOOL_CALLS]get_weather[ARGS]{CALL}[TOOL_CALLS]now[ARGS]{{}}',
    'deepseek_v3': f'Hi.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{CALL}<｜tool▁call▁end｜>'
                   '<｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    'glm45': 'Hi.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n'
             '<tool_call>now\n</tool_call>',
    'qwen3_coder': 'Hi.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n'
                   '</tool_call>\n<tool_call>\n<function=now>\n</function>\n</tool_call>',
    'minimax_m2': 'Hi.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
                  '</invoke>\n<invoke name="now">\n</invoke>\n</minimax:tool_call>',
    'seed_oss': 'Hi.\n<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n'
                '</seed:tool_call>\n<seed:tool_call>\n<function=now>\n</function>\n</seed:tool_call>',
    'granite': f'Hi.<|tool_call|>[{{"name": "get_weather", "arguments": {CALL}}}, {{"name": "now", "arguments": {{}}}}]',
}


def regex(text: str) -> str:
    """A regex matching ``text`` alone."""
    return ''.join('\\' + c if c in '.^$*+?()[]{}|\\' else c for c in text)


@pytest.fixture(scope='module')
def servers(tmp_path_factory):
    """A server for a tool parser's name, all on one engine."""
    engine = tiny_engine(save_tool_model(str(tmp_path_factory.mktemp('tool_hunt_model'))))
    yield from serve_per_parser(engine)


def streamed(url: str, body: dict) -> dict[int, dict]:
    """Each choice's message as a client gathers it from the stream's deltas (calls by ``index``; each call's
    ``id`` must come once, in its first piece)."""
    out: dict[int, dict] = {}
    with httpx.stream('POST', f'{url}/v1/chat/completions', json={**body, 'stream': True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith('data: ') or line == 'data: [DONE]':
                continue
            for choice in json.loads(line[6:])['choices']:
                m = out.setdefault(choice['index'], {'content': '', 'calls': {}, 'finish_reason': None})
                m['content'] += choice['delta'].get('content') or ''
                m['finish_reason'] = choice['finish_reason'] or m['finish_reason']
                for piece in choice['delta'].get('tool_calls') or []:
                    call = m['calls'].setdefault(piece['index'], {'ids': 0, 'name': None, 'arguments': ''})
                    if 'id' in piece:
                        call.update(ids=call['ids'] + 1, name=piece['function']['name'])
                    call['arguments'] += piece['function']['arguments']
    for m in out.values():
        assert all(call['ids'] == 1 for call in m['calls'].values())
        m['calls'] = [(call['name'], call['arguments']) for _, call in sorted(m['calls'].items())]
    return out


def assert_released(engine) -> None:
    """Nothing of any request is held, within a second: a stream's run is closed just after its last event."""
    deadline = time.monotonic() + 1
    while True:
        try:
            return assert_all_released(engine)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.02)


def ask(server: ServerThread, body: dict) -> dict:
    """The non-streamed message of choice 0 (content, calls, finish_reason), checked to be what the stream
    gathers to; every KV block is free after each."""
    body = {'model': 'm', 'messages': ASK, 'tools': TOOLS, 'temperature': 0, 'max_tokens': 300, **body}
    r = httpx.post(f'{server.url}/v1/chat/completions', json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()['choices'][0]
    calls = choice['message'].get('tool_calls') or []
    assert all(c['id'].startswith('call_') and c['type'] == 'function' for c in calls)
    whole = {'content': choice['message']['content'] or '', 'finish_reason': choice['finish_reason'],
             'calls': [(c['function']['name'], c['function']['arguments']) for c in calls]}
    assert_all_released(server.engine)
    assert streamed(server.url, body)[0] == whole
    assert_released(server.engine)
    return whole


@pytest.mark.parametrize('parser', sorted(REPLIES))
def test_every_parser_streams_what_it_answers(servers, parser):
    message = ask(servers(parser), {'structured_outputs': {'regex': regex(REPLIES[parser])}})
    assert message['calls'] == [('get_weather', CALL), ('now', '{}')] and message['finish_reason'] == 'tool_calls'
    assert message['content'] == ('' if parser == 'llama3_json' else 'Hi.')


@pytest.mark.parametrize('parser, reply, content', [
    ('hermes', 'Hi.\n<tool_call>not a call</tool_call>', 'Hi.\n<tool_call>not a call</tool_call>'),
    ('glm45', 'Hi.\n<tool_call>not a call</tool_call>', 'Hi.\n<tool_call>not a call</tool_call>')])  # plain tags
def test_a_block_without_a_call_stays_text_as_written(servers, parser, reply, content):
    """Was: the whitespace before the block was dropped (``Hi.<tool_call>...``), as next to a call; a reply cut
    by ``max_tokens`` before a call's name was complete came back so too."""
    message = ask(servers(parser), {'structured_outputs': {'regex': regex(reply)}})
    assert message == {'content': content, 'calls': [], 'finish_reason': 'stop'}


@pytest.mark.parametrize('parser, cut, arguments', [
    ('hermes', 'Hi.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa'),
    ('qwen3_coder', 'Hi.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPa', '{"city": "Pa"}'),
    ('pythonic', 'Hi.\n[get_weather(city="Paris"', '{"city": "Paris"}')])
def test_a_call_cut_off_is_not_finish_reason_tool_calls(servers, parser, cut, arguments):
    """A reply that ends inside a call (as a stop string cuts it; here the regex ends there) keeps what arrived,
    but its finish_reason is ``stop``. Was ``tool_calls``, with arguments that are not JSON or that the parser
    closed itself (XML and pythonic calls)."""
    assert REPLIES[parser].startswith(cut)
    message = ask(servers(parser), {'structured_outputs': {'regex': regex(cut)}})
    assert message == {'content': 'Hi.', 'calls': [('get_weather', arguments)], 'finish_reason': 'stop'}
