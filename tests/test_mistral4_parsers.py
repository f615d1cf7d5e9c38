"""Mistral Small 4's replies (Magistral's too) on text through the ``mistral`` reasoning parser (``[THINK]...[/THINK]``)
and the ``mistral`` tool parser (``[TOOL_CALLS]NAME[ARGS]{...}``, tokenizer v11 on): every chunking gives the same
message, a tool call after the reasoning included."""
from __future__ import annotations

import json

from parser_checks import split

from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.reasoning_parsers import get_reasoning_parser
from lmdeploy.serve.openai.tool_parsers import get_tool_parser
from lmdeploy.serve.reasoning import MODEL_PARSERS, pick_reasoning_parser

ARGS = json.dumps({'city': 'Paris', 'days': 3})


def mistral(prompt: str = '[SYSTEM_PROMPT]Think first.[/SYSTEM_PROMPT][INST]Weather?[/INST]'):
    return lambda: ChoiceParser(get_reasoning_parser('mistral')(prompt), get_tool_parser('mistral')(), None)


def test_reasoning_then_calls():
    text = f'[THINK]The user wants the weather.[/THINK]\n[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]now[ARGS]{{}}'
    assert split(mistral(), text) == {'reasoning': 'The user wants the weather.', 'content': '',
                                      'calls': [('get_weather', ARGS), ('now', '{}')]}


def test_reasoning_then_answer():
    assert split(mistral(), '[THINK]Easy.[/THINK]\n\nSunny, 21 C.') == {'reasoning': 'Easy.',
                                                                        'content': 'Sunny, 21 C.', 'calls': []}


def test_reply_without_reasoning_is_content():
    """``reasoning_effort`` "none": the reply starts with the answer (or a call)."""
    text = f'Checking.[TOOL_CALLS]get_weather[ARGS]{ARGS}'
    assert split(mistral(), text) == {'reasoning': '', 'content': 'Checking.', 'calls': [('get_weather', ARGS)]}


def test_mistral4_model_type_gets_the_mistral_parsers():
    """Mistral Small 4's language model (``mistral4``, also under Mistral 3's vision part) gets both by default."""
    assert MODEL_PARSERS['mistral4'] == ('mistral', 'mistral')
    assert pick_reasoning_parser('auto', 'mistral4') is get_reasoning_parser('mistral')
