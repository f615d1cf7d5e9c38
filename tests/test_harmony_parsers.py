"""gpt-oss's harmony replies through the harmony reasoning and tool parsers, on text (every chunking, so
markers split across deltas too) and on tokens (the detokenizer keeps just the markers they read)."""
from __future__ import annotations

import json

import pytest
from conftest import build_tokenizer
from parser_checks import split

from lmdeploy.messages import GenerationConfig
from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.harmony import SPECIAL_TOKENS, Header, open_header
from lmdeploy.serve.openai.reasoning_parsers import get_reasoning_parser
from lmdeploy.serve.openai.tool_parsers import get_tool_parser
from lmdeploy.tokenizer import IncrementalDetokenizer, Tokenizer

PROMPT = '<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant'
REASONING = get_reasoning_parser('harmony')
TOOLS = get_tool_parser('harmony')
ANALYSIS = '<|channel|>analysis<|message|>Need the weather: call get_weather.<|end|>'
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
ARGS = '{"city": "Paris", "note": "<b> \\"x\\""}'


def harmony(prompt: str = PROMPT, tools: bool = True, max_calls: int | None = None):
    return lambda: ChoiceParser(REASONING(prompt), TOOLS() if tools else None, max_calls)


@pytest.mark.parametrize('text, reasoning, content', [
    (ANALYSIS + '<|start|>assistant<|channel|>final<|message|>It is sunny.', 'Need the weather: call get_weather.',
     'It is sunny.'),
    ('<|channel|>final<|message|>No thinking, a < b <|x|> too.<|return|>ignored', '', 'No thinking, a < b <|x|> too.'),
    ('<|channel|>analysis<|message|>cut short', 'cut short', ''),
    ('<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>commentary<|message|>Let me check. '
     '<|end|><|start|>assistant<|channel|>analysis<|message|> two<|end|><|start|>assistant<|channel|>final'
     '<|message|>Done', 'one two', 'Let me check. Done'),
    ('<|channel|>analysis<|message|>no end<|start|>assistant<|channel|>final<|message|>ok', 'no end', 'ok'),
    ('<|channel|>analysis<|start|>assistant<|channel|>final<|message|>header without body', '',
     'header without body'),
])
def test_channels(text, reasoning, content):
    assert split(harmony(), text) == {'reasoning': reasoning, 'content': content, 'calls': []}
    assert split(harmony(tools=False), text)['content'] == content


@pytest.mark.parametrize('call', [
    CALL,
    '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>',  # the template's form
])
def test_tool_call_after_analysis(call):
    text = ANALYSIS + call + ARGS
    assert split(harmony(), text) == {'reasoning': 'Need the weather: call get_weather.', 'content': '',
                                      'calls': [('get_weather', ARGS)]}
    message = harmony()().message(text + '<|call|>')
    assert message.content is None and json.loads(message.tool_calls[0].function.arguments)['city'] == 'Paris'
    parser = harmony()()
    parser.feed(text, final=True)
    assert parser.finish_reason('stop') == 'tool_calls' and parser.finish_reason('length') == 'length'


def test_first_message_is_a_call():
    """The prompt's ``<|start|>assistant`` opens the call's header, written either way."""
    for text in ('<|channel|>commentary to=functions.now <|constrain|>json<|message|>{}',
                 ' to=functions.now<|channel|>commentary json<|message|>{}<|call|>'):
        assert split(harmony(), text) == {'reasoning': '', 'content': '', 'calls': [('now', '{}')]}


def test_call_arguments_stream():
    parser = harmony()()
    pieces = [parser.feed(p) for p in (CALL[:30], CALL[30:] + '{"city": ', '"Pa', 'ris"}')]
    assert [c.name for p in pieces for c in p.tool_calls if c.name] == ['get_weather']
    assert [c.arguments for c in pieces[2].tool_calls + pieces[3].tool_calls] == ['"Pa', 'ris"}']


def test_without_the_tool_parser_a_call_stays_harmony():
    text = ANALYSIS + CALL + '{}'
    assert split(harmony(tools=False), text)['content'] == CALL + '{}<|end|>'


def test_other_recipients_are_not_calls():
    text = ('<|channel|>analysis to=browser.search <|constrain|>json<|message|>{"q": "x"}<|end|>'
            '<|start|>assistant<|channel|>final<|message|>answer')
    assert split(harmony(), text) == {'reasoning': '{"q": "x"}', 'content': 'answer', 'calls': []}


def test_prompt_opens_the_header():
    assert open_header(PROMPT) == 'assistant'
    assert open_header(PROMPT + '<|channel|>final<|message|>') is None
    assert open_header('no markers') is None
    message = ChoiceParser(REASONING('plain prompt'), TOOLS()).message('text' + CALL + '{}')
    assert message.content == 'text' and message.tool_calls[0].function.name == 'get_weather'


def test_header():
    assert Header.parse('assistant<|channel|>commentary to=functions.f <|constrain|>json') == Header(
        'assistant<|channel|>commentary to=functions.f <|constrain|>json', 'commentary', 'functions.f')
    header = Header.parse('assistant to=functions.a.b<|channel|>commentary json')
    assert (header.channel, header.function) == ('commentary', 'a.b')
    assert Header.parse('assistant<|channel|>final').function is None


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = str(tmp_path_factory.mktemp('harmony_tokenizer'))
    hf = build_tokenizer()
    hf.add_special_tokens({'additional_special_tokens': list(SPECIAL_TOKENS)})
    hf.save_pretrained(path)
    return Tokenizer(path)


def test_detokenizer_keeps_only_the_markers_asked_for(tokenizer):
    ids = tokenizer.encode(ANALYSIS + CALL + '{"a": "héllo 世界"}<|im_end|>', add_special_tokens=False)
    special = tokenizer.special_token_ids
    assert sum(i in special for i in ids) == 8
    full = tokenizer.decode(ids, skip_special_tokens=False)
    for keep, expected in [(None, tokenizer.decode(ids)), (list(SPECIAL_TOKENS), full.replace('<|im_end|>', '')),
                           (['<|call|>'], tokenizer.decode(ids))]:
        detok = IncrementalDetokenizer(tokenizer, [], True, keep)
        deltas = [detok.step([i]) for i in ids] + [detok.finish()]
        assert ''.join(deltas) == expected
    detok = IncrementalDetokenizer(tokenizer, [], False, ['<|call|>'])
    assert ''.join([detok.step([i]) for i in ids] + [detok.finish()]) == full
    with pytest.raises(ValueError, match='keep_special_tokens'):
        GenerationConfig(keep_special_tokens=[''])


def test_grammar_marker_is_the_special_tokens(tokenizer):
    """A grammar after the final channel's marker waits for the marker's special tokens."""
    marker = tokenizer.encode(REASONING(PROMPT).grammar_after(), add_special_tokens=False)
    assert [marker[0], marker[-1]] == tokenizer.hf.convert_tokens_to_ids(['<|channel|>', '<|message|>'])


def test_token_stream_through_the_parsers(tokenizer):
    """The engine's token-by-token text deltas, markers kept, give the message of the whole reply."""
    ids = tokenizer.encode(ANALYSIS + CALL + ARGS, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], True, list(REASONING.markers))
    parser = harmony()()
    reasoning, calls = '', []
    for i in ids:
        delta = parser.feed(detok.step([i]))
        reasoning += delta.reasoning
        calls += delta.tool_calls
    delta = parser.feed(detok.finish(), final=True)
    calls += delta.tool_calls
    assert reasoning == 'Need the weather: call get_weather.'
    assert calls[0].name == 'get_weather' and ''.join(c.arguments for c in calls) == ARGS
