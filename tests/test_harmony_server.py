"""gpt-oss's harmony replies through a real server and the ``openai`` client, on a tiny random gpt-oss: the
server picks the harmony parsers itself (no flags), the engine's text keeps the channel markers, and the
analysis channel comes back as ``reasoning_content``, a ``functions.*`` message as a tool call, the final
channel as content, streamed or not.

A grammar forces the random model's reply (its markers as special tokens, which ``logit_bias`` prefers
to their spelling in plain characters); for the grammar to cover the whole reply, not only the final
channel's body, the harmony reasoning parser's ``grammar_after`` is patched to None here."""
from __future__ import annotations

import json

import openai
import pytest
from harmony_models import save_harmony_model
from server_helpers import serve, tiny_engine

from lmdeploy.serve.openai.harmony import CALL, RETURN, SPECIAL_TOKENS
from lmdeploy.serve.openai.reasoning_parsers import get_reasoning_parser
from lmdeploy.serve.openai.tool_parsers import get_tool_parser

WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'parameters': {
    'type': 'object', 'properties': {'city': {'type': 'string'}}, 'required': ['city']}}}
ASK = [{'role': 'user', 'content': 'Weather in Paris?'}]
ANALYSIS = r'<\|channel\|>analysis<\|message\|>[a-z ]{3,12}<\|end\|><\|start\|>assistant'
CALL_REPLY = (ANALYSIS + r'<\|channel\|>commentary to=functions\.get_weather <\|constrain\|>json<\|message\|>'
              r'\{"city": "(Paris|Rome)"\}')
FINAL_REPLY = ANALYSIS + r'<\|channel\|>final<\|message\|>[a-z ]{3,12}'


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    path = save_harmony_model(str(tmp_path_factory.mktemp('harmony_model')))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(get_reasoning_parser('harmony'), 'grammar_after', lambda self: None)
        yield from serve(tiny_engine(path), model_name='tiny-oss')


@pytest.fixture(scope='module')
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{server.url}/v1', api_key='none', max_retries=0)


def forced(server, regex: str, stop: str) -> dict:
    """Request fields that force ``regex``, written with harmony's special tokens, ending at ``stop``."""
    tokenizer = server.engine.tokenizer.hf
    other = RETURN if stop == CALL else CALL
    bias = {str(tokenizer.convert_tokens_to_ids(m)): 100 for m in SPECIAL_TOKENS if m != other}
    return dict(temperature=0, max_tokens=200, extra_body={'structured_outputs': {'regex': regex}},
                logit_bias=bias)


def test_server_picks_the_harmony_parsers(server):
    state = server.app.state.server
    assert state.tool_parser is get_tool_parser('harmony') and state.reasoning_parser is get_reasoning_parser('harmony')


def test_parser_flags(server):
    """Named parsers replace the model type's; the harmony tool parser brings its reasoning parser along."""
    from lmdeploy.serve.openai.api_server import create_app
    harmony = create_app(server.engine, tool_call_parser='harmony').state.server
    assert harmony.reasoning_parser is get_reasoning_parser('harmony')
    think = create_app(server.engine, reasoning_parser='qwen3').state.server
    assert think.tool_parser is None and think.reasoning_parser is get_reasoning_parser('qwen3')
    with pytest.raises(ValueError, match="reads the content of the reasoning parser 'harmony', not of 'qwen3'"):
        create_app(server.engine, tool_call_parser='harmony', reasoning_parser='qwen3')


def gathered(client, **kwargs) -> dict:
    """What a client gathers from a stream: reasoning, content, the calls and the finish reason."""
    out = {'reasoning': '', 'content': '', 'calls': {}, 'finish': None}
    for chunk in client.chat.completions.create(model='tiny-oss', messages=ASK, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        out['reasoning'] += (delta.model_extra or {}).get('reasoning_content') or ''
        out['content'] += delta.content or ''
        for piece in delta.tool_calls or []:
            call = out['calls'].setdefault(piece.index, {'name': '', 'arguments': ''})
            call['name'] += piece.function.name or ''
            call['arguments'] += piece.function.arguments or ''
        out['finish'] = chunk.choices[0].finish_reason or out['finish']
    return out


def test_tool_call_after_analysis(server, client):
    kwargs = dict(tools=[WEATHER], logprobs=True, **forced(server, CALL_REPLY, CALL))
    r = client.chat.completions.create(model='tiny-oss', messages=ASK, **kwargs)
    choice = r.choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    assert tokens[0] == '<|channel|>' and '<|constrain|>' in tokens and tokens[-1] == '<|call|>'
    reasoning = choice.message.model_extra['reasoning_content']
    assert 3 <= len(reasoning) <= 12 and set(reasoning) <= set('abcdefghijklmnopqrstuvwxyz ')
    call, = choice.message.tool_calls
    assert call.function.name == 'get_weather' and json.loads(call.function.arguments)['city'] in ('Paris', 'Rome')
    assert choice.message.content is None and choice.finish_reason == 'tool_calls'
    kwargs.pop('logprobs')
    assert gathered(client, **kwargs) == {'reasoning': reasoning, 'content': '', 'finish': 'tool_calls', 'calls': {
        0: {'name': 'get_weather', 'arguments': call.function.arguments}}}


def test_final_answer(server, client):
    kwargs = forced(server, FINAL_REPLY, RETURN)
    r = client.chat.completions.create(model='tiny-oss', messages=ASK, **kwargs)
    message = r.choices[0].message
    assert message.model_extra['reasoning_content'] and message.content and not message.tool_calls
    assert '<|' not in message.content and r.choices[0].finish_reason == 'stop'
    assert gathered(client, **kwargs) == {'reasoning': message.model_extra['reasoning_content'],
                                          'content': message.content, 'calls': {}, 'finish': 'stop'}
    raw = client.chat.completions.create(model='tiny-oss', messages=ASK, **{
        **kwargs, 'extra_body': {**kwargs['extra_body'], 'skip_special_tokens': False}})
    assert raw.choices[0].message.content == message.content


def test_a_call_goes_back_into_the_conversation(server, client):
    r = client.chat.completions.create(model='tiny-oss', messages=ASK, tools=[WEATHER],
                                       **forced(server, CALL_REPLY, CALL))
    call = r.choices[0].message.tool_calls[0]
    messages = ASK + [{'role': 'assistant', 'tool_calls': [call.model_dump()]},
                      {'role': 'tool', 'tool_call_id': call.id, 'content': 'sunny'}]
    again = client.chat.completions.create(model='tiny-oss', messages=messages, tools=[WEATHER],
                                           **forced(server, FINAL_REPLY, RETURN))
    assert again.choices[0].message.content and again.choices[0].finish_reason == 'stop'


def test_usage_counts_the_analysis_tokens(server, client):
    """``completion_tokens_details.reasoning_tokens`` (was absent): the tokens of the analysis channel's body,
    non-streamed and in the streamed usage chunk."""
    kwargs = forced(server, FINAL_REPLY, RETURN)
    r = client.chat.completions.create(model='tiny-oss', messages=ASK, logprobs=True, **kwargs)
    tokens = [t.token for t in r.choices[0].logprobs.content]
    body = tokens.index('<|end|>') - tokens.index('<|message|>') - 1
    assert 0 < body < r.usage.completion_tokens - 6
    assert r.usage.completion_tokens_details.reasoning_tokens == body
    *_, last = client.chat.completions.create(model='tiny-oss', messages=ASK, stream=True,
                                              stream_options={'include_usage': True}, **kwargs)
    assert last.usage.completion_tokens_details.reasoning_tokens == body
