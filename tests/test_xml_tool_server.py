"""The ``qwen3_coder`` tool parser through the server with the ``openai`` client: a tiny random model, made by a
regex to write Qwen3-Coder's XML calls after some text, gets them back as OpenAI tool calls whose arguments are
typed by the tools' schemas, streamed (string values as written) or not; a Qwen3-Coder-style template takes
the calls back the way the model wrote them."""
from __future__ import annotations

import json

import openai
import pytest
from server_helpers import serve, tiny_engine
from tool_models import save_tool_model

from lmdeploy.serve.openai.tool_choice import template_messages

# Qwen3-Coder's way of rendering tools, calls (strings as they are, other values in JSON) and results, cut down
XML_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
{% for tool in tools %}<function><name>{{ tool.function.name }}</name></function>
{% endfor %}Call a tool with <tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role == 'assistant' %}<|im_start|>assistant
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
{{- '\n<tool_call>\n<function=' ~ call.function.name ~ '>\n' }}
{%- for key, value in call.function.arguments | items %}
{{- '<parameter=' ~ key ~ '>\n' ~ (value if value is string else value | tojson) ~ '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
WEATHER = {'type': 'function', 'function': {'name': 'get_weather', 'parameters': {
    'type': 'object', 'required': ['city', 'days'],
    'properties': {'city': {'type': 'string'}, 'days': {'type': 'integer'}}}}}
NOW = {'type': 'function', 'function': {'name': 'now', 'parameters': {'type': 'object', 'properties': {}}}}
TOOLS = [WEATHER, NOW]
ASK = [{'role': 'user', 'content': 'Weather in Paris?'}]
# Text, then two calls in Qwen3-Coder's format: a random model writes them only when made to
CALLS = (r'Checking\.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome) "centre"\n</parameter>\n'
         r'<parameter=days>\n[1-7]\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=now>\n'
         r'</function>\n</tool_call>')


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    path = save_tool_model(str(tmp_path_factory.mktemp('xml_tool_model')), XML_TEMPLATE)
    yield from serve(tiny_engine(path), model_name='tiny-xml', tool_call_parser='qwen3_coder')


@pytest.fixture(scope='module')
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f'{server.url}/v1', api_key='none', max_retries=0)


def ask(client, **kwargs) -> dict:
    return dict(model='tiny-xml', messages=ASK, tools=TOOLS, temperature=0, max_tokens=500,
                extra_body={'structured_outputs': {'regex': CALLS}}, **kwargs)


def test_xml_calls_typed_and_streamed(client):
    whole = client.chat.completions.create(**ask(client))
    message, choice = whole.choices[0].message, whole.choices[0]
    assert choice.finish_reason == 'tool_calls' and message.content == 'Checking.'
    (weather, now) = message.tool_calls
    arguments = json.loads(weather.function.arguments)
    assert weather.function.name == 'get_weather' and arguments['city'] in ('Paris "centre"', 'Rome "centre"')
    assert type(arguments['days']) is int and 1 <= arguments['days'] <= 7  # typed by the schema
    assert (now.function.name, now.function.arguments) == ('now', '{}')
    with client.chat.completions.stream(**ask(client)) as stream:
        deltas = [e for e in stream if e.type == 'tool_calls.function.arguments.delta' and e.index == 0]
        final = stream.get_final_completion()
    streamed = final.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]
    assert streamed.content == 'Checking.' and final.choices[0].finish_reason == 'tool_calls'
    assert ''.join(d.arguments_delta for d in deltas) == weather.function.arguments
    assert len(deltas) > 3  # the city streams as written, before its closing tag


def test_one_call_without_parallel_calls(client):
    message = client.chat.completions.create(**ask(client, parallel_tool_calls=False)).choices[0].message
    assert [c.function.name for c in message.tool_calls] == ['get_weather']


def test_calls_go_back_into_the_conversation_as_written(server, client):
    message = client.chat.completions.create(**ask(client)).choices[0].message
    messages = ASK + [{'role': 'assistant', 'content': message.content,
                       'tool_calls': [c.model_dump() for c in message.tool_calls]},
                      {'role': 'tool', 'tool_call_id': message.tool_calls[0].id, 'content': 'sunny'}]
    text = server.engine.processor.render(template_messages(messages), tools=TOOLS)
    arguments = json.loads(message.tool_calls[0].function.arguments)
    reply = (f'Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n{arguments["city"]}\n</parameter>\n'
             f'<parameter=days>\n{arguments["days"]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
             '<function=now>\n</function>\n</tool_call>')
    assert f'<|im_start|>assistant\n{reply}<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n' in text
    again = client.chat.completions.create(model='tiny-xml', messages=messages, tools=TOOLS, tool_choice='none',
                                           max_tokens=4, extra_body={'ignore_eos': True})
    assert again.usage.prompt_tokens == len(server.engine.tokenizer.encode(text, add_special_tokens=False))
