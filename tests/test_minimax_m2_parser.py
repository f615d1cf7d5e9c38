"""MiniMax-M2's tool calls (``--tool-call-parser minimax_m2``): ``<invoke name="...">`` calls with
``<parameter name="...">`` values in ``<minimax:tool_call>`` blocks, typed by the tools' schemas, the same message
for every chunking of the reply; after ``<think>`` reasoning (``qwen3``), and picked for ``model_type`` minimax_m2."""
from __future__ import annotations

import pytest
from parser_checks import split
from test_tool_parsers import ARGUMENTS, TOOLS, VALUES

from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.reasoning_parsers import get_reasoning_parser
from lmdeploy.serve.openai.tool_parsers import get_tool_parser
from lmdeploy.serve.reasoning import MODEL_PARSERS

MINIMAX_M2 = get_tool_parser('minimax_m2')


def invoke(name: str, arguments: dict) -> str:
    """One call as MiniMax-M2 writes it: each value inline between its parameter's tags."""
    params = ''.join(f'<parameter name="{key}">{value}</parameter>\n' for key, value in arguments.items())
    return f'<invoke name="{name}">\n{params}</invoke>\n'


def block(*calls: str) -> str:
    return f'<minimax:tool_call>\n{"".join(calls)}</minimax:tool_call>'


def with_tools(reasoning=None, prompt=''):
    return lambda: ChoiceParser(reasoning(prompt) if reasoning else None, MINIMAX_M2(TOOLS))


def test_calls_typed_by_the_schema_in_one_block_or_several():
    weather = invoke('get_weather', {key: text for key, (text, _) in VALUES.items()})
    expected = {'reasoning': '', 'content': 'Let me check.Done.',
                'calls': [('get_weather', ARGUMENTS), ('now', '{}')]}
    assert split(with_tools(), f'Let me check.\n{block(weather, invoke("now", {}))}\nDone.') == expected
    assert split(with_tools(), f'Let me check.\n{block(weather)}\n{block(invoke("now", {}))}\nDone.') == expected


@pytest.mark.parametrize('text, content, calls', [
    ('plain, with <invoke name="f"> and <minimax:tool_call', 'plain, with <invoke name="f"> and <minimax:tool_call',
     []),
    ('<minimax:tool_call>junk</minimax:tool_call> after', '<minimax:tool_call>junk</minimax:tool_call> after', []),
    ('<minimax:tool_call><invoke name="two words"></invoke></minimax:tool_call>',
     '<minimax:tool_call><invoke name="two words"></invoke></minimax:tool_call>', []),
    ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="days">4', '',
     [('get_weather', '{"days": 4}')]),
    ('<minimax:tool_call><invoke name="get_weather"><parameter name="city">Par', '',
     [('get_weather', '{"city": "Par"}')]),
])
def test_edges(text, content, calls):
    """A block without a call stays text as written; a call the reply leaves open keeps what arrived."""
    assert split(with_tools(), text) == {'reasoning': '', 'content': content, 'calls': calls}


def test_reasoning_then_a_call_and_the_parsers_picked_for_the_model_type():
    think = get_reasoning_parser('qwen3')
    reply = f'The user wants weather.</think>\n\n{block(invoke("get_weather", {"days": "2"}))}'
    prompt = ']~b]ai\n<think>\n'  # a prompt that opens the block
    assert split(with_tools(think, prompt), reply) == {
        'reasoning': 'The user wants weather.', 'content': '', 'calls': [('get_weather', '{"days": 2}')]}
    assert MODEL_PARSERS['minimax_m2'] == ('minimax_m2', 'qwen3')
