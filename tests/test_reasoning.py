"""Reasoning output through the server (``--reasoning-parser qwen3``) with the ``openai`` client, on a
tiny random model: the reply splits into ``reasoning_content`` and ``content``, streamed or not; a
grammar applies to the content after ``</think>`` (or from the start when the template closed the think
block); ``chat_template_kwargs`` reach the template."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from server_helpers import serve, tiny_engine
from tool_models import save_tool_model

ASK = [{'role': 'user', 'content': 'Hello world!'}]
ANSWER = {'type': 'object', 'additionalProperties': False, 'required': ['answer', 'sure'],
          'properties': {'answer': {'type': 'integer', 'minimum': 0, 'maximum': 99}, 'sure': {'type': 'boolean'}}}
FORMAT = {'type': 'json_schema', 'json_schema': {'name': 'answer', 'schema': ANSWER, 'strict': True}}
OPEN_THINK = {'chat_template_kwargs': {'open_think': True}}  # the prompt opens the block, as DeepSeek-R1's does
NO_THINKING = {'chat_template_kwargs': {'enable_thinking': False}}  # the prompt closes it, as Qwen3's does


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    path = save_tool_model(str(tmp_path_factory.mktemp('reasoning_model')))
    yield from serve(tiny_engine(path), model_name='tiny-think', reasoning_parser='qwen3', tool_call_parser='hermes')


@pytest.fixture(scope='module')
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{server.url}/v1', api_key='none', max_retries=0)


@pytest.fixture(scope='module')
def bias(server):
    """``logit_bias`` that makes a token the model's only choice (unless a grammar forbids it)."""
    tokenizer = server.engine.tokenizer

    def of(token: str) -> dict:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1
        return {'logit_bias': {str(ids[0]): 100}}
    return of


def streamed(client, **kwargs) -> tuple[str, str, str]:
    """(reasoning, content, finish_reason) that a client gathers from a stream."""
    reasoning = content = ''
    finish = None
    for chunk in client.chat.completions.create(model='tiny-think', messages=ASK, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get('reasoning_content') or ''
        content += delta.content or ''
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, finish


def reply(client, **kwargs) -> tuple[str | None, str | None, str]:
    r = client.chat.completions.create(model='tiny-think', messages=ASK, **kwargs)
    message = r.choices[0].message
    return (message.model_extra or {}).get('reasoning_content'), message.content, r.choices[0].finish_reason


def test_reply_inside_an_opened_block_is_reasoning(client):
    kwargs = dict(max_tokens=8, temperature=0, extra_body={'ignore_eos': True, **OPEN_THINK})
    reasoning, content, finish = reply(client, **kwargs)
    assert reasoning and content is None and finish == 'length'
    assert streamed(client, **kwargs) == (reasoning, '', 'length')


def test_reply_that_opens_the_block(client, bias):
    reasoning, content, _ = reply(client, max_tokens=4, temperature=0, extra_body=bias('<think>'))
    assert (reasoning, content) == ('<think>' * 3, None)


def test_grammar_applies_after_the_reasoning(client, bias):
    """``</think>`` is forced first: had the grammar applied from the start, it could not be written and
    the whole reply would be reasoning."""
    kwargs = dict(max_tokens=300, temperature=1.0, seed=4, response_format=FORMAT,
                  extra_body={**bias('</think>'), **OPEN_THINK})
    reasoning, content, finish = reply(client, **kwargs)
    assert finish == 'stop' and not reasoning and '</think>' not in content
    jsonschema.validate(json.loads(content), ANSWER)
    assert streamed(client, **kwargs) == ('', content, 'stop')


def test_reply_that_does_not_open_the_block_has_the_grammar_from_its_start(server, client):
    """The prompt neither opens nor closes the block (Qwen3's template): a reply that does not open it is all
    content, so the grammar applies from its start. (It used to wait for a ``</think>`` that never came: the
    end of sequence, made the likeliest token here, ended the reply at once, empty, with 'stop'.)"""
    think = server.engine.tokenizer.encode('<think>', add_special_tokens=False)[0]
    bias = {'logit_bias': {str(think): -100, **{str(i): 100 for i in server.engine.tokenizer.eos_token_ids}}}
    kwargs = dict(max_tokens=300, temperature=1.0, seed=4, response_format=FORMAT, extra_body=bias)
    reasoning, content, finish = reply(client, **kwargs)
    assert finish == 'stop' and reasoning is None
    jsonschema.validate(json.loads(content), ANSWER)
    assert streamed(client, **kwargs) == ('', content, 'stop')


def test_reply_that_opens_the_block_has_the_grammar_after_it(client, server):
    """Same prompt; a reply that opens the block with ``<think>`` (along with the grammar's first tokens, the
    only one allowed) is reasoning until ``</think>``, and the grammar applies after that."""
    tokenizer = server.engine.tokenizer
    bias = {'logit_bias': {str(tokenizer.encode(t, add_special_tokens=False)[0]): b
                           for t, b in (('<think>', 100), ('</think>', 99))}}
    kwargs = dict(max_tokens=300, temperature=1.0, seed=4, response_format=FORMAT, extra_body=bias)
    reasoning, content, finish = reply(client, **kwargs)
    assert finish == 'stop' and set(reasoning.split('<think>')) == {''}
    jsonschema.validate(json.loads(content), ANSWER)


def test_reply_with_a_format_does_not_stop_inside_the_reasoning(server, client):
    """The end of sequence, made the likeliest token, cannot end a reply with a format inside its reasoning
    (it used to: 'stop' with no content at all)."""
    eos = {'logit_bias': {str(i): 100 for i in server.engine.tokenizer.eos_token_ids}}
    kwargs = dict(max_tokens=12, temperature=1.0, seed=4, response_format=FORMAT, extra_body={**eos, **OPEN_THINK})
    reasoning, content, finish = reply(client, **kwargs)
    assert finish == 'length' and reasoning and content is None


def test_template_closed_block_means_grammar_from_the_start(server, client):
    kwargs = dict(max_tokens=300, temperature=1.0, seed=4, n=2, response_format=FORMAT, extra_body=NO_THINKING)
    r = client.chat.completions.create(model='tiny-think', messages=ASK, **kwargs)
    for choice in r.choices:
        assert choice.finish_reason == 'stop' and choice.message.model_extra.get('reasoning_content') is None
        jsonschema.validate(json.loads(choice.message.content), ANSWER)
    plain = client.chat.completions.create(model='tiny-think', messages=ASK, max_tokens=1)
    closed_block = server.engine.tokenizer.encode('<think>\n\n</think>\n\n', add_special_tokens=False)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens + len(closed_block)


def test_forced_tool_call_after_reasoning(client, bias):
    tool = {'type': 'function', 'function': {'name': 'answer', 'parameters': ANSWER}}
    kwargs = dict(max_tokens=300, temperature=0, tools=[tool],
                  tool_choice={'type': 'function', 'function': {'name': 'answer'}},
                  extra_body={**bias('</think>'), **OPEN_THINK})
    r = client.chat.completions.create(model='tiny-think', messages=ASK, **kwargs)
    call, = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == 'tool_calls' and call.function.name == 'answer'
    jsonschema.validate(json.loads(call.function.arguments), ANSWER)


def test_reserved_template_kwargs_are_400(client):
    with pytest.raises(openai.BadRequestError, match='may not set tokenize'):
        client.chat.completions.create(model='tiny-think', messages=ASK, max_tokens=1,
                                       extra_body={'chat_template_kwargs': {'tokenize': True}})


def reasoning_tokens(client, **kwargs) -> tuple[int | None, int | None, int]:
    """``usage.completion_tokens_details.reasoning_tokens`` non-streamed and in the streamed usage chunk, and
    ``completion_tokens``."""
    r = client.chat.completions.create(model='tiny-think', messages=ASK, **kwargs)
    *_, last = client.chat.completions.create(model='tiny-think', messages=ASK, stream=True,
                                              stream_options={'include_usage': True}, **kwargs)
    assert last.usage.completion_tokens == r.usage.completion_tokens
    return (r.usage.completion_tokens_details.reasoning_tokens, last.usage.completion_tokens_details.reasoning_tokens,
            r.usage.completion_tokens)


def test_usage_counts_the_reasoning_tokens(server, client):
    """``completion_tokens_details.reasoning_tokens`` (was absent): the tokens of the reasoning, not the
    ``<think>`` and ``</think>`` around it, summed over the choices; 0 when the template closed the block."""
    greedy = {'max_tokens': 8, 'temperature': 0}
    assert reasoning_tokens(client, **greedy, extra_body={'ignore_eos': True, **OPEN_THINK}) == (8, 8, 8)
    assert reasoning_tokens(client, **greedy, n=2, extra_body={'ignore_eos': True, **OPEN_THINK}) == (16, 16, 16)
    assert reasoning_tokens(client, **greedy, extra_body={'ignore_eos': True, **NO_THINKING}) == (0, 0, 8)
    tokenizer = server.engine.tokenizer
    bias = {'logit_bias': {str(tokenizer.encode(t, add_special_tokens=False)[0]): b
                           for t, b in (('<think>', 100), ('</think>', 99))}}
    kwargs = dict(max_tokens=300, temperature=1.0, seed=4, response_format=FORMAT, extra_body=bias)
    r = client.chat.completions.create(model='tiny-think', messages=ASK, logprobs=True, **kwargs)
    tokens = [t.token for t in r.choices[0].logprobs.content]
    between = tokens.index('</think>') - 1  # the reply opens the block with its first token
    assert tokens[0] == '<think>' and 0 < between < len(tokens) - 2
    assert reasoning_tokens(client, **kwargs) == (between, between, len(tokens))


def generate(url: str, body: dict) -> tuple[dict, list[dict]]:
    """``/generate``'s answer to ``body``, and its streamed events."""
    answer = httpx.post(f'{url}/generate', json=body, timeout=60).json()
    with httpx.stream('POST', f'{url}/generate', json={**body, 'stream': True}, timeout=60) as stream:
        events = [json.loads(line[len('data: '):]) for line in stream.iter_lines()
                  if line.startswith('data: ') and line != 'data: [DONE]']
    return answer, events


def test_generate_counts_the_reasoning_tokens(server, api_server):
    """``/generate`` gives ``reasoning_tokens`` (was absent) with a reasoning parser: the reply's tokens inside the
    reasoning, not the markers around it, in the answer and the last streamed event (null in the others); null
    without a parser. Its text stays the whole reply."""
    tokenizer = server.engine.tokenizer
    opened = '<|im_start|>user\nHello world!<|im_end|>\n<|im_start|>assistant\n<think>\n'
    greedy = {'max_tokens': 8, 'ignore_eos': True}
    answer, events = generate(server.url, {'prompt': opened, 'do_preprocess': False, **greedy})
    assert answer['reasoning_tokens'] == 8 and answer['generate_tokens'] == 8
    assert [e['reasoning_tokens'] for e in events] == [None] * (len(events) - 1) + [8]
    assert ''.join(e['text'] for e in events) == answer['text']
    think = tokenizer.encode('<think>', add_special_tokens=False)[0]
    opens = {'prompt': ASK, 'max_tokens': 4, 'logit_bias': {str(think): 100}}  # <think> and 3 of reasoning
    answer, events = generate(server.url, opens)
    assert answer['token_ids'] == [think] * 4 and answer['reasoning_tokens'] == events[-1]['reasoning_tokens'] == 3
    answer, events = generate(api_server.url, {'prompt': 'Hello', **greedy})
    assert answer['reasoning_tokens'] is None and all(e['reasoning_tokens'] is None for e in events)
