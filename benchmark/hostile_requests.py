"""Hand-made hostile requests for benchmark/fuzz_server.py: what schemathesis' generated cases rarely reach
(values that are valid JSON and of the right type but pathological, and bodies that are not JSON at all)."""
from __future__ import annotations

import base64
from dataclasses import dataclass

from soak import MODEL_NAME


@dataclass(frozen=True)
class Case:
    """``body`` posted to ``path`` (bytes as they are, anything else as JSON); ``expect_ok``: it must be a 200."""

    label: str
    path: str
    body: object
    expect_ok: bool = False


USER = [{'role': 'user', 'content': 'hi'}]
CHAT = {'model': MODEL_NAME, 'messages': USER, 'max_tokens': 4}
COMPLETION = {'model': MODEL_NAME, 'prompt': 'hi', 'max_tokens': 4}


def chat(label: str, expect_ok: bool = False, **fields) -> Case:
    return Case(label, '/v1/chat/completions', {**CHAT, **fields}, expect_ok)


def completion(label: str, expect_ok: bool = False, **fields) -> Case:
    return Case(label, '/v1/completions', {**COMPLETION, **fields}, expect_ok)


def raw(label: str, path: str, text: str) -> Case:
    return Case(label, path, text.encode('utf-8', 'surrogatepass'))


def content(label: str, parts: object) -> Case:
    return chat(label, messages=[{'role': 'user', 'content': parts}])


def nested_schema(levels: int) -> dict:
    schema: dict = {'type': 'string'}
    for _ in range(levels):
        schema = {'type': 'object', 'properties': {'a': schema}, 'required': ['a']}
    return schema


def json_schema_format(schema: object) -> dict:
    return {'type': 'json_schema', 'json_schema': {'name': 'x', 'schema': schema}}


PNG_HEADER = base64.b64encode(b'\x89PNG\r\n\x1a\n' + b'\x00' * 40).decode()
GARBAGE_URLS = ['data:', 'data:image/png;base64,', 'data:image/png;base64,!!!!', 'data:;base64,AAAA',
                'data:image/png,rawtext', f'data:image/png;base64,{PNG_HEADER}',
                'data:image/png;base64,' + 'A' * 4_000_001, 'data:text/html;base64,PGh0bWw+',
                'data:image/png;base64,%00%00', 'javascript:alert(1)', '', 5, None]
TOOL = {'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object',
                                                                     'properties': {'a': {'type': 'string'}}}}}
FLOAT_FIELDS = ('temperature', 'top_p', 'min_p', 'presence_penalty', 'frequency_penalty', 'repetition_penalty')

HOSTILE: list[Case] = [
    # token counts and fan-out
    chat('max_tokens 10**9', max_tokens=10 ** 9),
    chat('max_tokens 2**31 ignore_eos', max_tokens=2 ** 31, ignore_eos=True),
    chat('max_tokens past the context, ignore_eos', expect_ok=True, max_tokens=1000, ignore_eos=True),
    completion('max_tokens 250 on a 250-token prompt', prompt=[5] * 250, max_tokens=250, ignore_eos=True),
    completion('255-token prompt', prompt=[5] * 255, max_tokens=8),
    completion('256-token prompt', prompt=[5] * 256, max_tokens=8),
    chat('min_tokens over max_tokens', min_tokens=100),
    chat('min_tokens 10**9 without max_tokens', max_tokens=None, min_tokens=10 ** 9),
    chat('n 128', n=128, max_tokens=2),
    chat('n 128 streamed', n=128, max_tokens=2, stream=True),
    completion('n 64 x 3 prompts', prompt=['a', 'b', 'c'], n=64, max_tokens=2),
    completion('n 2 x 64 token prompts', prompt=[[5, 6]] * 64, n=2, max_tokens=2),
    completion('n 8 x 240-token prompt: 8 contexts on 24 blocks', expect_ok=True, prompt=[7] * 240, n=8,
               max_tokens=15, ignore_eos=True),
    completion('4 x 240-token prompts, streamed', expect_ok=True, prompt=[[i] * 240 for i in range(4)],
               max_tokens=15, ignore_eos=True, stream=True),
    completion('echo logprobs on a long prompt, twice (cached)', expect_ok=True, prompt=[9] * 200, echo=True,
               logprobs=2, max_tokens=2),
    completion('echo logprobs on a long prompt, twice (cached) ', expect_ok=True, prompt=[9] * 200, echo=True,
               logprobs=2, max_tokens=2),
    chat('min_tokens past a finished grammar', structured_outputs={'choice': ['a']}, min_tokens=8, max_tokens=16),
    chat('logit_bias against every allowed token', structured_outputs={'regex': '[0-9]'},
         logit_bias={str(i): -100 for i in range(320)}),
    chat('top_p 5e-324', top_p=5e-324, temperature=1.0),
    chat('min_p 1', min_p=1.0, temperature=2.0, top_k=-1, expect_ok=True),
    chat('top_k 10**30', top_k=10 ** 30),
    chat('top_k 2**63', top_k=2 ** 63),
    chat('seed -2**63 n 4', seed=-2 ** 63, n=4, temperature=1.0),
    chat('seed 2**64-1 n 4', seed=2 ** 64 - 1, n=4, temperature=1.0),
    chat('session_id 2**63', session_id=2 ** 63),
    chat('session_id 2**64', session_id=2 ** 64),
    chat('top_logprobs 20 n 4', logprobs=True, top_logprobs=20, n=4, stream=True),
    completion('echo logprobs on token ids', prompt=[1, 2, 3], echo=True, logprobs=20),
    completion('echo logprobs on a one-token prompt', prompt=[1], echo=True, logprobs=5, stream=True),
    completion('suffix', suffix='x' * 1000),
    completion('empty token prompt in a batch', prompt=[[1, 2], []]),
    completion('empty text prompt in a batch', prompt=['a', '']),
    completion('empty prompt list', prompt=[]),
    # non-finite and out-of-range floats, as JSON allows them only unquoted
    *[raw(f'{field} {value}', '/v1/chat/completions',
          f'{{"model":"{MODEL_NAME}","messages":[{{"role":"user","content":"hi"}}],"max_tokens":4,"{field}":{value}}}')
      for field in FLOAT_FIELDS for value in ('NaN', 'Infinity', '-Infinity', '1e999', '-1e-999')],
    raw('logit_bias NaN value', '/v1/chat/completions',
        f'{{"model":"{MODEL_NAME}","messages":[{{"role":"user","content":"hi"}}],"logit_bias":{{"5":NaN}}}}'),
    raw('max_tokens 4.5', '/v1/completions', f'{{"model":"{MODEL_NAME}","prompt":"hi","max_tokens":4.5}}'),
    raw('max_tokens 1e400', '/v1/completions', f'{{"model":"{MODEL_NAME}","prompt":"hi","max_tokens":1e400}}'),
    # logit_bias keys and values
    *[chat(f'logit_bias {bias}', logit_bias=bias) for bias in (
        {'abc': 1}, {'-1': 1}, {'1e3': 1}, {'9' * 40: 1}, {'': 1}, {'5': None}, {'5': [1]}, {'5': '1'},
        {'5': True}, {'05': 100}, {'5': -100, '6': 100}, {str(i): 1 for i in range(320)})],
    # stop lists
    chat('32 empty stop strings', stop=[''] * 32),
    chat('empty stop string', expect_ok=True, stop=''),
    chat('33 stop strings', stop=['a'] * 33),
    chat('stop of nulls', stop=[None]),
    chat('stop nested', stop=[['a']]),
    chat('stop NUL', stop=['\x00', '\uffff'], expect_ok=True),
    chat('stop of 10,000 strings', stop=[str(i) for i in range(10_000)]),
    chat('stop_token_ids out of the vocabulary', stop_token_ids=[10 ** 12]),
    chat('stop_token_ids nested', stop_token_ids=[[1]]),
    # content parts
    *[content(f'content {parts!r:.60}', parts) for parts in (
        5, True, {}, {'type': 'text', 'text': 'a'}, [5], [None], ['text'], [[{'type': 'text', 'text': 'a'}]],
        [{'type': 'text'}], [{'type': 'text', 'text': 5}], [{'type': 'text', 'text': None}],
        [{'type': 'text', 'text': ['a']}], [{'type': 5}], [{}], [{'type': 'image_url'}],
        [{'type': 'image_url', 'image_url': {}}], [{'type': 'image_url', 'image_url': ['x']}],
        [{'type': 'input_audio', 'input_audio': {'data': 'AAAA', 'format': 'wav'}}],
        [{'type': 'video_url', 'video_url': {'url': 'data:video/mp4;base64,AAAA'}}],
        [{'type': 'text', 'text': 'a', 'extra': {'deep': [1, 2, {'x': None}]}}] * 50)],
    *[content(f'image_url {str(url)[:40]!r}', [{'type': 'image_url', 'image_url': {'url': url}}])
      for url in GARBAGE_URLS],
    *[content(f'image_url as string {str(url)[:40]!r}', [{'type': 'image_url', 'image_url': url}])
      for url in GARBAGE_URLS[:6]],
    # messages
    *[chat(f'messages {messages!r:.60}', messages=messages) for messages in (
        [], [{}], [{'role': 'user'}], [{'content': 'hi'}], [{'role': None, 'content': 'hi'}],
        [{'role': 5, 'content': 'hi'}], [{'role': 'tool', 'content': 'x'}], [{'role': 'assistant', 'content': 'x'}],
        [{'role': 'system', 'content': 'x'}], [{'role': 'user', 'content': None}],
        [{'role': 'user', 'content': 'hi', 'name': 5}], [{'role': 'developer', 'content': 'hi'}],
        [{'role': 'assistant', 'content': None, 'tool_calls': [{'function': {'name': 'f', 'arguments': {'a': 1}}}]}],
        [{'role': 'assistant', 'tool_calls': [{'id': 1, 'type': 'function', 'function': {'name': 5}}]}],
        [{'role': 'assistant', 'tool_calls': 'f()'}], [{'role': 'assistant', 'tool_calls': [None]}],
        [{'role': 'assistant', 'tool_calls': [{'function': {'name': 'f', 'arguments': '[' * 1100 + ']' * 1100}}]}],
        [{'role': 'tool', 'tool_call_id': 5, 'content': [{'type': 'text', 'text': 'r'}]}],
        USER * 3000, [{'role': 'user', 'content': 'word ' * 400}])],
    # tools and tool_choice
    *[chat(f'tools {tools!r:.60}', tools=tools) for tools in (
        'f', [{}], [{'type': 'function'}], [{'function': {'name': ''}}], [{'function': {'name': 'f' * 300}}],
        [{'function': {'name': 'f', 'parameters': 'x'}}], [{'function': {'name': 'f', 'parameters': {'type': 5}}}],
        [{'function': {'name': 'f', 'parameters': nested_schema(30)}}], [{'type': 'retrieval', 'function': {}}],
        [TOOL, TOOL], [TOOL] * 1000)],
    *[chat(f'tool_choice {choice!r:.60}', tools=[TOOL], tool_choice=choice) for choice in (
        5, 'any', '', {}, {'type': 'function'}, {'type': 'function', 'function': {}},
        {'type': 'function', 'function': {'name': 5}}, {'type': 'function', 'function': {'name': 'g'}},
        {'function': {'name': 'f'}}, ['f'])],
    chat('tool_choice required', tools=[TOOL], tool_choice='required', max_tokens=64),
    chat('tool_choice named, streamed', tools=[TOOL], tool_choice={'type': 'function', 'function': {'name': 'f'}},
         max_tokens=64, stream=True),
    chat('tool_choice required without tools', tool_choice='required'),
    chat('tool_choice required with response_format', tools=[TOOL], tool_choice='required',
         response_format={'type': 'json_object'}),
    chat('tool_choice required, pathological pattern', tool_choice='required', tools=[{'type': 'function', 'function': {
        'name': 'f', 'parameters': {'type': 'object',
                                    'properties': {'a': {'type': 'string', 'pattern': '(a|b)*c{999}'}}}}}]),
    # response_format and structured_outputs
    *[chat(f'response_format {fmt!r:.60}', response_format=fmt, max_tokens=16) for fmt in (
        'json', {}, {'type': 'xml'}, {'type': 'json_schema'}, {'type': 'json_schema', 'json_schema': {}},
        {'type': 'json_schema', 'json_schema': None}, {'type': 'json_schema', 'json_schema': 'x'},
        json_schema_format(True), json_schema_format(False), json_schema_format(5), json_schema_format('x'),
        json_schema_format({'type': 'object', 'required': ['x']}), json_schema_format({'$ref': '#'}),
        json_schema_format({'$ref': '#/$defs/missing'}), json_schema_format({'anyOf': []}),
        json_schema_format({'allOf': [{'type': 'string'}, {'type': 'integer'}]}),
        json_schema_format({'type': 'array', 'minItems': 5, 'maxItems': 2}),
        json_schema_format({'type': 'string', 'pattern': '['}), json_schema_format({'type': 'string', 'format': 'x'}),
        json_schema_format({'type': 'integer', 'minimum': 10 ** 30}), json_schema_format({'type': 'unknown'}),
        json_schema_format({'not': {}}), json_schema_format(nested_schema(30)), json_schema_format(nested_schema(60)),
        json_schema_format({'enum': list(range(5000))}), json_schema_format({'type': 'string', 'minLength': 10 ** 9}),
        json_schema_format({'type': 'object', 'properties': {f'p{i}': {'type': 'string'} for i in range(500)},
                            'required': [f'p{i}' for i in range(500)]}),
        {'type': 'json_object'}, {'type': 'text', 'json_schema': 5})],
    *[chat(f'structured_outputs {fmt!r:.60}', structured_outputs=fmt, max_tokens=16) for fmt in (
        {}, {'json': '{not json'}, {'json': '"x"'}, {'json': '[]'}, {'json': 5}, {'regex': '('}, {'regex': ''},
        {'regex': 'a{100000}'}, {'regex': '(a?){30}'}, {'choice': []}, {'choice': ['']}, {'choice': [5]},
        {'grammar': ''}, {'grammar': 'root ::= '}, {'grammar': 'root ::= root'}, {'grammar': 'x ::= "a"'},
        {'json_object': False}, {'json_object': True, 'regex': 'a'}, {'regex': 'a', 'choice': ['a']})],
    completion('structured_outputs on completions', structured_outputs={'choice': ['yes', 'no']}, expect_ok=True),
    # chat_template_kwargs
    *[chat(f'chat_template_kwargs {kwargs!r:.60}', chat_template_kwargs=kwargs) for kwargs in (
        'x', {'tools': 5}, {'messages': []}, {'add_generation_prompt': 'x'}, {'bos_token': 5},
        {'eos_token': {'a': 1}}, {'raise_exception': 1}, {'enable_thinking': None}, {'x' * 1000: 1})],
    # fields of the wrong type
    chat('stream "yes"', stream='yes'),
    chat('stream_options wrong', stream=True, stream_options={'include_usage': 'x'}),
    chat('stream_options without stream', stream_options={'include_usage': True}),
    chat('stream_options with n 3 and usage', expect_ok=True, stream=True, n=3, stream_options={'include_usage': True}),
    chat('user 5', user=5), chat('model 5', model=5), chat('model missing', model=None),
    chat('model unknown', model='gpt-4'), chat('parallel_tool_calls x', parallel_tool_calls='x'),
    # /generate, /v1/encode, /abort_request
    *[Case(f'generate {body!r:.60}', '/generate', body) for body in (
        {}, {'prompt': None, 'input_ids': None}, {'prompt': 'a', 'input_ids': [1]}, {'prompt': []},
        {'prompt': [{'role': 'user'}]}, {'prompt': [{'role': 'user', 'content': 'a'}], 'do_preprocess': False},
        {'prompt': [5]}, {'input_ids': []}, {'input_ids': [-1]}, {'input_ids': [2 ** 63]}, {'input_ids': [1] * 300},
        {'prompt': 'a', 'max_tokens': 10 ** 6, 'ignore_eos': True}, {'prompt': 'a', 'logprobs': 20, 'stream': True},
        {'prompt': 'a', 'session_id': 5, 'n': 2}, {'prompt': 'a', 'model': 'gpt-4'})],
    *[Case(f'encode {body!r:.60}', '/v1/encode', body) for body in (
        {}, {'input': []}, {'input': ['']}, {'input': 5}, {'input': [5]}, {'input': [['a']]},
        {'input': 'a', 'do_preprocess': True}, {'input': ['a'] * 10_000}, {'input': 'x' * 2_000_000})],
    *[Case(f'abort {body!r:.60}', '/abort_request', body) for body in (
        {}, {'session_id': -1}, {'session_id': 2 ** 64}, {'session_id': 'x'}, {'abort_all': 'x'},
        {'session_id': 123456789})],
    # bodies that are not a JSON object
    *[raw(f'body {text[:30]!r}', path, text) for path in ('/v1/chat/completions', '/v1/completions', '/generate')
      for text in ('', 'null', '[]', '"x"', '{', '{"model": ', '\ufeff{}', '{"a":1,"a":2}', '\ud800', '\x00' * 10,
                   '{"messages": [' + '[' * 5000 + ']' * 5000 + ']}')],
]
