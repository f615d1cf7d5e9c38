"""The soak's traffic (benchmark/soak.py): random valid and invalid requests, and the check of each answer.

The base mix is chat and completions, streaming and not, ``n`` > 1, stop words, logprobs and shared prefixes.
The agent kinds, each off unless asked for (a model must be able to serve it):

- ``tools``: ``tools`` with ``tool_choice`` auto, required, a named function or none (the server needs a tool
  call parser; the tiny tool model of tests/tool_models.py with ``hermes``);
- ``structured``: ``response_format`` json_schema and json_object, ``structured_outputs`` regex and choice;
- ``reasoning``: ``chat_template_kwargs`` that open or close the think block (the server needs a reasoning
  parser; the tool model with ``qwen3``);
- ``images``: one or two random images per chat (a vision model: the tiny Qwen2-VL).

Schemas, tool sets, regexes and choice lists are drawn from ``formats`` distinct ones (each built from its
index), so the server's grammar cache sees as many formats as it may keep, and many more with a large
``formats``.
"""
from __future__ import annotations

import base64
import io
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

MODEL_NAME = 'soak'
KINDS = ('tools', 'structured', 'reasoning', 'images')
WORDS = ('hello world quick brown fox jumps over the lazy dog paged attention stores keys and values in blocks '
         'café naïve 世界 0123456789').split()
SHARED_PREFIX = ('You are a careful assistant. Paged attention stores keys and values in blocks; the quick brown '
                 'fox jumps over the lazy dog. ') * 3
FINISH_REASONS = ('stop', 'length', 'tool_calls')
JSON_TYPES = {'string': str, 'integer': int, 'boolean': bool}

# What a finished answer must satisfy: given its choices ({'finish_reason', 'message' or 'text'}), the
# problem ('' when none).
Check = Callable[[list[dict]], str]


@dataclass
class Request:
    path: str
    body: dict
    kind: str = 'base'
    check: Check | None = None


def text(rng: random.Random, lo: int, hi: int) -> str:
    return ' '.join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def base_request(rng: random.Random, max_tokens: int) -> Request:
    """A random request of the base mix."""
    chat = rng.random() < 0.6
    body: dict = {'model': MODEL_NAME, 'max_tokens': rng.randint(1, max_tokens), 'stream': rng.random() < 0.5,
                  'temperature': rng.choice([0.0, 0.7, 1.0])}
    prompt = (SHARED_PREFIX if rng.random() < 0.5 else '') + text(rng, 3, 30)
    if rng.random() < 0.2:
        body['n'] = rng.randint(2, 3)
    if rng.random() < 0.25:
        body['stop'] = rng.sample(WORDS, rng.randint(1, 3))
    if rng.random() < 0.2:
        body['ignore_eos'] = True
    if body['stream'] and rng.random() < 0.5:
        body['stream_options'] = {'include_usage': True}
    if chat:
        body['messages'] = [{'role': 'user', 'content': prompt}]
        if rng.random() < 0.25:
            body['logprobs'] = True
            body['top_logprobs'] = rng.randint(0, 3)
        return Request('/v1/chat/completions', body)
    body['prompt'] = prompt
    if rng.random() < 0.25:
        body['logprobs'] = rng.randint(0, 3)
        body['echo'] = rng.random() < 0.5
    return Request('/v1/completions', body)


def valid_request(rng: random.Random, max_tokens: int, kinds: tuple[str, ...] = (), formats: int = 1000,
                  agent_share: float = 0.6) -> Request:
    """A random valid request: of the base mix, or (``agent_share`` of them when ``kinds``) a chat of one of
    ``kinds``."""
    if not kinds or rng.random() >= agent_share:
        return base_request(rng, max_tokens)
    kind = rng.choice(kinds)
    body: dict = {'model': MODEL_NAME, 'max_tokens': rng.randint(1, max_tokens * 2), 'stream': rng.random() < 0.5,
                  'temperature': rng.choice([0.0, 0.7, 1.0]),
                  'messages': [{'role': 'user', 'content': text(rng, 3, 20)}]}
    if rng.random() < 0.15:
        body['n'] = 2
    check = KIND_MAKERS[kind](rng, body, rng.randrange(formats))
    return Request('/v1/chat/completions', body, kind, check)


def _schema(index: int) -> dict:
    """The ``index``-th object schema: one to three required properties of the :data:`JSON_TYPES`."""
    rng = random.Random(index)
    names = rng.sample(WORDS[:20], rng.randint(1, 3))
    return {'type': 'object', 'required': [f'{n}_{index}' for n in names],
            'properties': {f'{n}_{index}': {'type': rng.choice(list(JSON_TYPES))} for n in names},
            'additionalProperties': False}


def _check_object(value: str, schema: dict | None) -> str:
    try:
        data = json.loads(value)
    except ValueError:
        return f'not JSON: {value!r}'
    if not isinstance(data, dict):
        return f'not an object: {value!r}'
    for name, prop in (schema or {}).get('properties', {}).items():
        kind = JSON_TYPES[prop['type']]
        if not isinstance(data.get(name), kind) or (kind is int and isinstance(data[name], bool)):
            return f'{name} is not {prop["type"]}: {value!r}'
    return ''


def _structured(rng: random.Random, body: dict, index: int) -> Check:
    way = rng.randrange(4)
    if way == 0:
        schema = _schema(index)
        body['response_format'] = {'type': 'json_schema', 'json_schema': {'name': f's{index}', 'schema': schema}}
        return _on_stop(lambda content: _check_object(content, schema))
    if way == 1:
        body['response_format'] = {'type': 'json_object'}
        return _on_stop(lambda content: _check_object(content, None))
    if way == 2:
        pattern = f'[a-f]{{1,{2 + index % 7}}}-{index}'
        body['structured_outputs'] = {'regex': pattern}
        return _on_stop(lambda content: '' if re.fullmatch(pattern, content) else f'{content!r} !~ {pattern}')
    choices = [f'{w}{index}' for w in random.Random(index).sample(WORDS[:20], 3)]
    body['structured_outputs'] = {'choice': choices}
    return _on_stop(lambda content: '' if content in choices else f'{content!r} not in {choices}')


def _on_stop(check: Callable[[str], str]) -> Check:
    """Checks the content of each choice that stopped by itself (a cut one is a prefix of a valid answer)."""
    def run(choices: list[dict]) -> str:
        for choice in choices:
            if choice['finish_reason'] == 'stop':
                problem = check(choice['message'].get('content') or '')
                if problem:
                    return problem
        return ''
    return run


def _tool(index: int, number: int) -> dict:
    return {'type': 'function', 'function': {'name': f'tool_{index}_{number}', 'description': f'tool {number}',
                                             'parameters': _schema(index * 4 + number)}}


def _tools(rng: random.Random, body: dict, index: int) -> Check:
    tools = [_tool(index, k) for k in range(1 + index % 2)]
    body['tools'] = tools
    names = {t['function']['name']: t['function']['parameters'] for t in tools}
    choice = rng.choice(['auto', 'auto', 'required', 'named', 'none'])
    if choice == 'named':
        name = rng.choice(list(names))
        body['tool_choice'] = {'type': 'function', 'function': {'name': name}}
        names = {name: names[name]}
    else:
        body['tool_choice'] = choice
    forced = choice in ('required', 'named')

    def run(choices: list[dict]) -> str:
        for c in choices:
            calls = c['message'].get('tool_calls') or []
            if choice == 'none' and calls:
                return f'tool_choice none, yet calls: {calls}'
            if forced and c['finish_reason'] == 'stop':
                return f'tool_choice {choice} stopped without a call: {c}'
            if c['finish_reason'] != 'tool_calls':
                continue
            if not calls:
                return f'finish_reason tool_calls without calls: {c}'
            for call in calls:
                fn = call.get('function') or {}
                if fn.get('name') not in names:
                    return f'a call of {fn.get("name")!r}, not of {sorted(names)}'
                problem = _check_object(fn.get('arguments') or '', names[fn['name']] if forced else None)
                if problem:
                    return f'arguments of {fn["name"]}: {problem}'
        return ''
    return run


def _reasoning(rng: random.Random, body: dict, index: int) -> Check:
    body['chat_template_kwargs'] = rng.choice([{'enable_thinking': False}, {'open_think': True}, {}])

    def run(choices: list[dict]) -> str:
        for c in choices:
            if '</think>' in (c['message'].get('reasoning_content') or ''):
                return f'the reasoning holds the end of its block: {c}'
        return ''
    return run


def png_data_url(rng: random.Random) -> str:
    from PIL import Image
    size = rng.randint(16, 120), rng.randint(16, 120)
    image = Image.frombytes('RGB', size, rng.randbytes(size[0] * size[1] * 3))
    buffer = io.BytesIO()
    image.save(buffer, format='PNG')
    return 'data:image/png;base64,' + base64.b64encode(buffer.getvalue()).decode()


def _images(rng: random.Random, body: dict, index: int) -> Check:
    parts = [{'type': 'text', 'text': text(rng, 1, 8)}]
    parts += [{'type': 'image_url', 'image_url': {'url': png_data_url(rng)}} for _ in range(rng.randint(1, 2))]
    body['messages'] = [{'role': 'user', 'content': parts}]
    return lambda choices: ''


KIND_MAKERS: dict[str, Callable[[random.Random, dict, int], Check]] = {
    'tools': _tools, 'structured': _structured, 'reasoning': _reasoning, 'images': _images}


def invalid_request(rng: random.Random, kinds: tuple[str, ...] = ()) -> Request:
    """A random invalid request (of the base mix or of one of ``kinds``): each must get a 4xx."""
    good = {'model': MODEL_NAME, 'messages': [{'role': 'user', 'content': 'hi'}], 'max_tokens': 4}
    agent = [k for k in kinds if k in INVALID_AGENT]
    if agent and rng.random() < 0.5:
        return Request('/v1/chat/completions', {**good, **INVALID_AGENT[rng.choice(agent)](rng)}, 'invalid')
    kind = rng.randrange(8)
    if kind == 0:   # malformed JSON
        return Request('/v1/chat/completions', b'{"model": "soak", "messages": [{"role": "user", ', 'invalid')
    if kind == 1:
        return Request('/v1/chat/completions', {**good, 'model': 'no-such-model'}, 'invalid')
    if kind == 2:
        return Request('/v1/chat/completions', {**good, 'temperature': -1}, 'invalid')
    if kind == 3:
        return Request('/v1/chat/completions', {**good, 'messages': []}, 'invalid')
    if kind == 4:
        return Request('/v1/completions', {'model': MODEL_NAME, 'prompt': 'hi', 'max_tokens': 0}, 'invalid')
    if kind == 5:  # too long
        return Request('/v1/completions', {'model': MODEL_NAME, 'prompt': 'word ' * 5000, 'max_tokens': 4}, 'invalid')
    if kind == 6:  # without stream
        return Request('/v1/chat/completions', {**good, 'stream_options': {'include_usage': True}}, 'invalid')
    return Request('/generate', {'input_ids': [10 ** 9], 'max_tokens': 4}, 'invalid')  # not a token


INVALID_AGENT: dict[str, Callable[[random.Random], dict]] = {
    'tools': lambda rng: rng.choice([
        {'tools': [_tool(0, 0)], 'tool_choice': {'type': 'function', 'function': {'name': 'no_such_tool'}}},
        {'tool_choice': 'required'},
        {'tools': [_tool(0, 0), _tool(0, 0)]},
        {'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'nonsense'}}}]}]),
    'structured': lambda rng: rng.choice([
        {'structured_outputs': {'regex': f'([a-z]{{{rng.randrange(100)}}}'}},
        {'structured_outputs': {'choice': ['a'], 'regex': 'a'}},
        {'response_format': {'type': 'json_schema', 'json_schema': {'name': 'x'}}}]),
    'images': lambda rng: {'messages': [{'role': 'user', 'content': [
        {'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,' + base64.b64encode(
            rng.randbytes(64)).decode()}}]}]},
}


def gather(choices: dict[int, dict], chunk: dict, chat: bool) -> None:
    """Adds a stream event's deltas to ``choices`` (index -> {'finish_reason', 'message'}: content,
    reasoning_content and tool_calls as a client gathers them)."""
    for c in chunk.get('choices', []):
        choice = choices.setdefault(c['index'], {'finish_reason': None, 'message': {'tool_calls': []}})
        if c.get('finish_reason'):
            choice['finish_reason'] = c['finish_reason']
        message = choice['message']
        delta = c.get('delta') or {} if chat else {'content': c.get('text')}
        for field in ('content', 'reasoning_content'):
            if delta.get(field):
                message[field] = (message.get(field) or '') + delta[field]
        for call in delta.get('tool_calls') or []:
            calls = message['tool_calls']
            while len(calls) <= call['index']:
                calls.append({'function': {'name': None, 'arguments': ''}})
            fn = call.get('function') or {}
            if fn.get('name'):
                calls[call['index']]['function']['name'] = fn['name']
            calls[call['index']]['function']['arguments'] += fn.get('arguments') or ''
