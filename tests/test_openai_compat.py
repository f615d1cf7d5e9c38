"""What the official ``openai`` client can send that OpenAI's API or vLLM answer, and this server once did not (each
test failed before its fix; see docs/reliability.md, "OpenAI API compatibility"): ``models.retrieve`` (also
through the proxy), ``null`` fields, ``best_of``, ``stream_options.continuous_usage_stats``, ``reasoning_effort``,
the ``developer`` role, fields it cannot honour, vLLM's ``guided_*``, ``continue_final_message`` and
``include_stop_str_in_output``. All on the session's tiny Llama server but the template tests."""
from __future__ import annotations

import json
import os
import shutil
import time
import uuid

import httpx
import openai
import pytest
from server_helpers import ServerThread, serve, tiny_engine
from vl_models import update_tokenizer_config

MESSAGES = [{'role': 'user', 'content': 'Hello world!'}]
GREEDY = {'temperature': 0, 'extra_body': {'ignore_eos': True}}


@pytest.fixture(scope='module')
def client(api_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{api_server.url}/v1', api_key='none', max_retries=0)


def test_models_retrieve(client):
    """Was a 404 for the served model too (no ``GET /v1/models/{model}``). The card is the same in every answer
    (its ``created`` was the time of each answer)."""
    card = client.models.retrieve('tiny')
    assert (card.id, card.object) == ('tiny', 'model')
    time.sleep(1.1)
    assert card == client.models.list().data[0] == client.models.retrieve('tiny')
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve('Org/other')
    assert error.value.body['code'] == 'model_not_found' and error.value.body['param'] == 'model'


def test_best_of(client):
    """``best_of`` was ignored: ``best_of=3, n=1`` gave one plain sample. ``best_of == n`` (what a client that
    sets both alike means) is served; more than ``n`` is refused, as is less (OpenAI's rule)."""
    r = client.completions.create(model='tiny', prompt='Hello', max_tokens=3, n=2, best_of=2, **GREEDY)
    assert len(r.choices) == 2
    for best_of, n, code in [(3, 1, 'unsupported_value'), (1, 2, 'bad_request')]:
        with pytest.raises(openai.BadRequestError) as error:
            client.completions.create(model='tiny', prompt='Hello', max_tokens=3, n=n, best_of=best_of)
        assert (error.value.body['param'], error.value.body['code']) == ('best_of', code)


def usages(chunks) -> list[tuple[int, int, int]]:
    return [(c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.total_tokens) for c in chunks]


@pytest.mark.parametrize('n', [1, 2])
def test_continuous_usage_stats_chat(client, n):
    """vLLM's ``continuous_usage_stats`` was ignored: only the last chunk had usage. Now every chunk carries its
    choice's usage so far (the role chunk none generated), and the usage chunk the total."""
    chunks = list(client.chat.completions.create(
        model='tiny', messages=MESSAGES, max_tokens=4, n=n, stream=True,
        stream_options={'include_usage': True, 'continuous_usage_stats': True}, **GREEDY))
    assert all(c.usage is not None for c in chunks)
    *body, last = chunks
    prompt = last.usage.prompt_tokens
    assert last.choices == [] and usages([last]) == [(prompt, 4 * n, prompt + 4 * n)]
    for index in range(n):
        counts = usages(c for c in body if c.choices[0].index == index)
        assert counts[0] == (prompt, 0, prompt) and counts[-1] == (prompt, 4, prompt + 4)
        assert [c[1] for c in counts] == sorted(c[1] for c in counts)
    plain = list(client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=4, stream=True,
                                                stream_options={'include_usage': True}, **GREEDY))
    assert [c.usage is None for c in plain] == [True] * (len(plain) - 1) + [False]


def test_continuous_usage_stats_completions(client):
    chunks = list(client.completions.create(
        model='tiny', prompt='Hello world', max_tokens=4, stream=True,
        stream_options={'include_usage': True, 'continuous_usage_stats': True}, **GREEDY))
    *body, last = chunks
    prompt = last.usage.prompt_tokens
    assert body and usages(body)[-1] == usages([last])[0] == (prompt, 4, prompt + 4)
    assert all(c.usage.prompt_tokens == prompt for c in body)


EFFORT_TEMPLATE = ('{# roles: system, developer, user, assistant #}'
                   '{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}'
                   '{% if reasoning_effort == "high" %} think it over step by step{% endif %}\n{% endif %}'
                   '{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}'
                   '<|im_start|>assistant\n')


@pytest.fixture(scope='module')
def effort_server(tiny_llama, tmp_path_factory):
    """The tiny Llama with a chat template that reads ``reasoning_effort``, as gpt-oss's does."""
    path = str(tmp_path_factory.mktemp('effort') / 'model')
    shutil.copytree(tiny_llama, path)
    update_tokenizer_config(path, chat_template=EFFORT_TEMPLATE)
    for name in ('chat_template.jinja', 'chat_template.json'):
        if os.path.exists(os.path.join(path, name)):
            os.remove(os.path.join(path, name))
    yield from serve(tiny_engine(path), model_name='effort')


def test_reasoning_effort_reaches_the_chat_template(effort_server):
    """``reasoning_effort`` was ignored; it now goes to the chat template (``chat_template_kwargs`` may still
    set it, and wins); a value OpenAI does not define is a 400."""
    client = openai.OpenAI(base_url=f'{effort_server.url}/v1', api_key='none', max_retries=0)

    def prompt_tokens(**kwargs) -> int:
        return client.chat.completions.create(model='effort', messages=MESSAGES, max_tokens=1, temperature=0,
                                              **kwargs).usage.prompt_tokens

    plain, low, high = prompt_tokens(), prompt_tokens(reasoning_effort='low'), prompt_tokens(reasoning_effort='high')
    assert plain < low < high
    overridden = {'chat_template_kwargs': {'reasoning_effort': 'low'}}
    assert prompt_tokens(reasoning_effort='high', extra_body=overridden) == low
    with pytest.raises(openai.BadRequestError) as error:
        prompt_tokens(reasoning_effort='extreme')
    assert error.value.body['param'] == 'reasoning_effort'


def reply(client, messages) -> list[tuple[str, float]]:
    """The greedy reply's tokens with their logprobs: the same prompt gives the same, to the bit."""
    r = client.chat.completions.create(model='tiny', messages=messages, max_tokens=4, logprobs=True, **GREEDY)
    return [(t.token, t.logprob) for t in r.choices[0].logprobs.content]


def test_a_developer_message_is_a_system_message_for_a_template_without_that_role(client):
    """OpenAI's ``developer`` role (its newer name for instructions) went to the template as written, which
    rendered ``<|im_start|>developer``, a role the model never saw; a template that names the role (gpt-oss's)
    still gets it."""
    system = reply(client, [{'role': 'system', 'content': 'Be brief.'}, *MESSAGES])
    assert reply(client, [{'role': 'developer', 'content': 'Be brief.'}, *MESSAGES]) == system
    assert system != reply(client, MESSAGES)


def test_effort_template_keeps_developer(effort_server):
    """A template that holds ``developer`` gets the role as sent."""
    client = openai.OpenAI(base_url=f'{effort_server.url}/v1', api_key='none', max_retries=0)
    tokens = [client.chat.completions.create(model='effort', messages=[{'role': role, 'content': 'Hi'}], max_tokens=1,
                                             temperature=0).usage.prompt_tokens for role in ('system', 'developer')]
    assert tokens[0] != tokens[1]


@pytest.mark.parametrize('fields, param', [
    ({'functions': [{'name': 'f', 'parameters': {'type': 'object'}}]}, 'functions'),
    ({'function_call': {'name': 'f'}}, 'function_call'),
    ({'modalities': ['text', 'audio']}, 'modalities')])
def test_fields_the_server_cannot_honour_are_refused(client, fields, param):
    """Were ignored: legacy ``functions`` gave no call and no error, ``modalities: ["audio"]`` no audio."""
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=1, **fields)
    assert (error.value.body['param'], error.value.body['code']) == (param, 'unsupported_value')
    client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=1, modalities=['text'],
                                   function_call='none')


def test_null_fields_take_their_defaults(client):
    """The official client sends a parameter given as None as ``null``, which OpenAI reads as left out: was a
    400 for every field without a None default (``temperature: Input should be a valid number``)."""
    nulls = dict.fromkeys(['temperature', 'top_p', 'n', 'presence_penalty', 'frequency_penalty', 'stop', 'seed'])
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=2, logprobs=None, stream=None,
                                       parallel_tool_calls=None, **nulls)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    r = client.completions.create(model='tiny', prompt='Hello', max_tokens=None, echo=None, extra_body={
        'ignore_eos': True, 'top_k': None, 'min_p': None, 'repetition_penalty': None, 'min_tokens': None}, **nulls)
    assert r.usage.completion_tokens == 16 and r.choices[0].text  # OpenAI's default max_tokens


@pytest.fixture(scope='module')
def two_model_proxy(api_server):
    """A proxy in front of two servers of different model names (on one engine)."""
    from lmdeploy.serve.openai.api_server import create_app
    from lmdeploy.serve.proxy.app import create_proxy_app
    nodes = [ServerThread(create_app(api_server.engine, model_name=name)) for name in ('a', 'Org/b')]
    proxy = ServerThread(create_proxy_app([node.url for node in nodes], health_interval=0.5))
    try:
        deadline = time.monotonic() + 30
        while len([m for m in httpx.get(f'{proxy.url}/v1/models').json()['data']]) < 2:
            assert time.monotonic() < deadline, 'the proxy did not see both nodes'
            time.sleep(0.1)
        yield proxy
    finally:
        for server in (proxy, *nodes):
            server.stop()


def test_the_proxy_sends_models_retrieve_to_a_node_that_serves_the_model(two_model_proxy):
    """Was: any node (the request has no body to read a model from), a 404 from the other one."""
    client = openai.OpenAI(base_url=f'{two_model_proxy.url}/v1', api_key='none', max_retries=0)
    assert [client.models.retrieve(name).id for name in ('a', 'a', 'Org/b', 'Org/b')] == ['a', 'a', 'Org/b', 'Org/b']


@pytest.mark.parametrize('guided, check', [
    ({'guided_choice': ['yes', 'no']}, lambda text: text in ('yes', 'no')),
    ({'guided_regex': '[a-c]{3}'}, lambda text: len(text) == 3 and set(text) <= set('abc')),
    ({'guided_json': {'type': 'integer', 'minimum': 10, 'maximum': 99}}, lambda text: 10 <= json.loads(text) <= 99),
    ({'guided_grammar': 'root ::= "a" "b"+'}, lambda text: text.startswith('ab') and set(text[1:]) == {'b'})])
def test_vllm_guided_fields_constrain_the_reply(client, guided, check):
    """vLLM's older ``guided_*`` fields were ignored: the reply came back unconstrained."""
    r = client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=20, temperature=0,
                                       extra_body=guided)
    assert r.choices[0].finish_reason == 'stop' and check(r.choices[0].message.content)
    r = client.completions.create(model='tiny', prompt='Hello', max_tokens=20, temperature=0, extra_body=guided)
    assert check(r.choices[0].text)


def test_guided_fields_and_structured_outputs_are_one_or_the_other(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=2, extra_body={
            'guided_regex': 'a', 'structured_outputs': {'regex': 'b'}})
    assert error.value.body['param'] == 'structured_outputs'
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=2, extra_body={
            'guided_regex': 'a', 'guided_choice': ['b']})


def test_continue_final_message_prefills_the_reply(api_server, client):
    """vLLM's ``continue_final_message`` (with ``add_generation_prompt: false``) was ignored: the template closed
    the assistant's message and opened a new one. Now the reply continues it, as a completion of the same
    prompt does; both at once are a 400."""
    messages = [*MESSAGES, {'role': 'assistant', 'content': 'The answer is'}]
    r = client.chat.completions.create(model='tiny', messages=messages, max_tokens=6, temperature=0, extra_body={
        'ignore_eos': True, 'continue_final_message': True, 'add_generation_prompt': False})
    ids = api_server.engine.tokenizer.hf.apply_chat_template(messages, continue_final_message=True, tokenize=True)
    ids = ids if isinstance(ids, list) else ids['input_ids']
    completion = client.completions.create(model='tiny', prompt=ids, max_tokens=6, **GREEDY)
    assert r.usage.prompt_tokens == len(ids) and r.choices[0].message.content == completion.choices[0].text
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model='tiny', messages=messages, max_tokens=1,
                                       extra_body={'continue_final_message': True})
    assert error.value.body['param'] == 'continue_final_message'


def a_stop_string(client) -> tuple[str, str]:
    """The greedy completion of 'The quick' and a stop string of two printable characters inside it."""
    full = client.completions.create(model='tiny', prompt='The quick', max_tokens=20, **GREEDY).choices[0].text
    start = next(i for i in range(2, len(full) - 1) if full[i:i + 2].isprintable() and '\ufffd' not in full[i:i + 2])
    return full, full[start:start + 2]


def test_include_stop_str_in_output(client):
    """vLLM's ``include_stop_str_in_output`` was ignored: the stop word was cut from the text all the same."""
    full, stop = a_stop_string(client)
    expected = full[:full.find(stop)] + stop
    body = {'ignore_eos': True, 'include_stop_str_in_output': True}
    r = client.completions.create(model='tiny', prompt='The quick', max_tokens=20, temperature=0, stop=[stop],
                                  extra_body=body)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, 'stop')
    chunks = client.completions.create(model='tiny', prompt='The quick', max_tokens=20, temperature=0, stop=stop,
                                       stream=True, extra_body=body)
    assert ''.join(c.choices[0].text for c in chunks) == expected


def test_tokens_a_stop_string_cut_still_count(client):
    """Kept as vLLM does (docs/api_server.md, usage): the tokens whose text makes up a cut stop string count in
    ``completion_tokens`` and stay in ``logprobs``, at or past the text's end; none after the stop string."""
    full, stop = a_stop_string(client)
    r = client.completions.create(model='tiny', prompt='The quick', max_tokens=20, temperature=0, stop=stop,
                                  logprobs=0, extra_body={'ignore_eos': True})
    text, logprobs = r.choices[0].text, r.choices[0].logprobs
    generated = ''.join(logprobs.tokens)
    assert text == full[:full.find(stop)] and r.usage.completion_tokens == len(logprobs.tokens)
    before_last = generated[:len(generated) - len(logprobs.tokens[-1])]
    assert generated.startswith(text + stop) and not before_last.startswith(text + stop)
    assert logprobs.text_offset[-1] >= len(text)


@pytest.mark.parametrize('field', [{'use_beam_search': True}, {'allowed_token_ids': [1, 2]}, {'bad_words': ['x']},
                                   {'prompt_logprobs': 0}, {'truncate_prompt_tokens': 8},
                                   {'logits_processors': ['my.Processor']}])
def test_vllm_fields_this_server_does_not_implement_are_refused(client, field):
    """Were ignored: a reply with the banned words, without the beam search or the prompt's logprobs asked for."""
    (name, _), = field.items()
    for create in (lambda: client.chat.completions.create(model='tiny', messages=MESSAGES, max_tokens=1,
                                                          extra_body=field),
                   lambda: client.completions.create(model='tiny', prompt='Hi', max_tokens=1, extra_body=field)):
        with pytest.raises(openai.BadRequestError) as error:
            create()
        assert (error.value.body['param'], error.value.body['code']) == (name, 'unsupported_value')
    client.completions.create(model='tiny', prompt='Hi', max_tokens=1, extra_body={
        'use_beam_search': False, 'bad_words': [], 'allowed_token_ids': None})


def test_usage_reports_the_prompt_tokens_the_prefix_cache_served(api_server, client):
    """``usage.prompt_tokens_details.cached_tokens``: 0 for a prompt the cache has not seen, then, for the same
    prompt again, whole KV blocks (at least the last prompt token is always computed); chat and completions,
    non-streamed and in the streamed usage chunk. Without a reasoning parser there is no
    ``completion_tokens_details``."""
    block = api_server.engine.backend_config.block_size
    text = f'{uuid.uuid4().hex} ' + ' '.join(f'word{i}' for i in range(40))
    options = {'stream': True, 'stream_options': {'include_usage': True}}

    def cached(create, **kwargs) -> tuple[int, int]:
        reply = create(model='tiny', max_tokens=2, **GREEDY, **kwargs)
        usage = list(reply)[-1].usage if kwargs.get('stream') else reply.usage
        assert usage.completion_tokens_details is None
        return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    for create, prompt in ((client.completions.create, {'prompt': text}),
                           (client.chat.completions.create, {'messages': [{'role': 'user', 'content': text}]})):
        first, prompt_tokens = cached(create, **prompt)
        assert first == 0 and prompt_tokens > 2 * block
        for again in (cached(create, **prompt)[0], cached(create, **prompt, **options)[0]):
            assert 0 < again < prompt_tokens and again % block == 0 and again >= prompt_tokens - block
