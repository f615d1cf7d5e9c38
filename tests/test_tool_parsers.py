"""Tool-call and reasoning parsers on text: every chunking of a reply gives the same message."""
from __future__ import annotations

import json

import pytest
from parser_checks import split

from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from lmdeploy.serve.openai.tool_parsers import (TOOL_PARSERS, NamedToolParser, RequiredToolParser, get_tool_parser,
                                                register_tool_parser)

HERMES = get_tool_parser('hermes')
LLAMA3 = get_tool_parser('llama3_json')
THINK = get_reasoning_parser('qwen3')


def hermes(max_calls=None):
    return lambda: ChoiceParser(None, HERMES(), max_calls)


def test_hermes_calls_among_text():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "note": "a \\"}\\" <b>"}}\n</tool_call>\n'
            '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>\n')
    assert split(hermes(), text) == {'reasoning': '', 'content': 'Let me look.', 'calls': [
        ('get_weather', '{"city": "Paris", "note": "a \\"}\\" <b>"}'), ('now', '{}')]}
    assert split(hermes(max_calls=1), text)['calls'] == [('get_weather', '{"city": "Paris", "note": "a \\"}\\" <b>"}')]


@pytest.mark.parametrize('text, content', [
    ('plain answer, no calls\n', 'plain answer, no calls\n'),
    ('a < b and <tool_ is not a tag', 'a < b and <tool_ is not a tag'),
    ('<tool_call>not json</tool_call> then text', '<tool_call>not json</tool_call> then text'),
    ('<tool_call>{"no_name": 1}</tool_call>', '<tool_call>{"no_name": 1}</tool_call>'),
    ('ends inside a tag <tool_ca', 'ends inside a tag <tool_ca'),
])
def test_hermes_text_stays_text(text, content):
    assert split(hermes(), text) == {'reasoning': '', 'content': content, 'calls': []}


def test_hermes_truncated_and_string_arguments():
    assert split(hermes(), '<tool_call>{"name": "f", "arguments": {"x": [1, 2')['calls'] == [('f', '{"x": [1, 2')]
    assert split(hermes(), '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')['calls'] == [
        ('f', '{"x": 1}')]
    assert split(hermes(), '<tool_call>{"name": "f"}</tool_call> done')['calls'] == [('f', '{}')]
    assert split(hermes(), '<tool_call>{"name": "f"}</tool_call> done')['content'] == 'done'
    assert split(hermes(), '<tool_call>{"name": "f", "arguments": null}</tool_call>')['calls'] == [('f', '{}')]
    unclosed = '<tool_call>{"name": "f", "arguments": {}} <tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert split(hermes(), unclosed) == {'reasoning': '', 'content': '', 'calls': [('f', '{}'), ('g', '{}')]}


def test_llama3_json():
    make = lambda: ChoiceParser(None, LLAMA3())  # noqa: E731
    text = '<|python_tag|>{"name": "search", "parameters": {"q": "fox"}}; {"name": "now", "parameters": {}}'
    assert split(make, text)['calls'] == [('search', '{"q": "fox"}'), ('now', '{}')]
    assert split(make, ' {"name": "now", "parameters": {}}')['calls'] == [('now', '{}')]
    assert split(make, 'The answer is {"a": 1}') == {'reasoning': '', 'content': 'The answer is {"a": 1}',
                                                      'calls': []}
    assert split(make, '{"answer": 42}') == {'reasoning': '', 'content': '{"answer": 42}', 'calls': []}


def test_forced_parsers():
    required = lambda: ChoiceParser(None, RequiredToolParser())  # noqa: E731
    text = '[{"name": "a", "parameters": {"x": [1, {"y": "]}"}]}}, {"name": "b", "parameters": {}}]'
    assert split(required, text)['calls'] == [('a', '{"x": [1, {"y": "]}"}]}'), ('b', '{}')]
    named = lambda: ChoiceParser(None, NamedToolParser('f'))  # noqa: E731
    assert split(named, ' {"x": "}"}\n') == {'reasoning': '', 'content': '', 'calls': [('f', '{"x": "}"}')]}
    assert split(named, '{}')['calls'] == [('f', '{}')]


@pytest.mark.parametrize('prompt, text, reasoning, content', [
    ('<|im_start|>assistant\n', '<think>\nhmm, </thin k>\n</think>\n\nThe answer', '\nhmm, </thin k>\n', 'The answer'),
    ('<|im_start|>assistant\n', 'No thinking here', '', 'No thinking here'),
    ('<|im_start|>assistant\n', '<think>cut short', 'cut short', ''),
    ('<｜Assistant｜><think>\n', 'opened by the prompt</think>42', 'opened by the prompt', '42'),
    ('assistant\n<think>\n\n</think>\n\n', '<think>x</think>y', '', '<think>x</think>y'),
])
def test_think_reasoning(prompt, text, reasoning, content):
    make = lambda: ChoiceParser(THINK(prompt))  # noqa: E731
    assert split(make, text) == {'reasoning': reasoning, 'content': content, 'calls': []}


def test_reasoning_then_tool_call():
    make = lambda: ChoiceParser(THINK(''), HERMES())  # noqa: E731
    text = '<think>I should call it.</think>\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert split(make, text) == {'reasoning': 'I should call it.', 'content': '', 'calls': [('f', '{"a": 1}')]}
    message = make().message(text)
    assert message.content is None and json.loads(message.tool_calls[0].function.arguments) == {'a': 1}


def test_grammar_marker_follows_the_prompt():
    assert THINK('<|im_start|>assistant\n').grammar_after() == '</think>'
    assert THINK('<think>\n').grammar_after() == '</think>'
    assert THINK('<|im_start|>assistant\n<think>\n\n</think>\n\n').grammar_after() is None


def test_cli_flags_name_registered_parsers(monkeypatch, capsys):
    from lmdeploy.cli import main, serve
    seen = []
    monkeypatch.setattr(serve, 'run_api_server', seen.append)
    main.main(['serve', 'api_server', '--tool-call-parser', 'llama3_json', '--reasoning-parser', 'deepseek_r1'])
    assert (seen[0].tool_call_parser, seen[0].reasoning_parser) == ('llama3_json', 'deepseek_r1')
    with pytest.raises(SystemExit):
        main.main(['serve', 'api_server', '--tool-call-parser', 'nope'])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_registries():
    assert {'hermes', 'qwen', 'llama3_json'} <= set(TOOL_PARSERS) and {'qwen3', 'deepseek_r1'} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match='known: .*hermes'):
        get_tool_parser('nope')

    @register_tool_parser('test-upper')
    class Upper(HERMES):
        pass

    try:
        assert get_tool_parser('test-upper') is Upper
    finally:
        del TOOL_PARSERS['test-upper']


# The families whose calls write arguments as text (Qwen3-Coder, Qwen3.5, Seed-OSS), as Granite 3 writes them,
# and as Llama 4's pythonic template asks for.
QWEN3_CODER, SEED_OSS = get_tool_parser('qwen3_coder'), get_tool_parser('seed_oss')
GRANITE, PYTHONIC = get_tool_parser('granite'), get_tool_parser('pythonic')
TYPES = {'city': {'type': 'string'}, 'zip': {'type': 'string'}, 'days': {'type': 'integer'},
         'temp': {'type': 'number'}, 'flag': {'type': 'boolean'}, 'units': {'type': 'array'},
         'opts': {'type': 'object'}, 'maybe': {'anyOf': [{'type': 'integer'}, {'type': 'null'}]}}
TOOLS = [{'type': 'function',
          'function': {'name': 'get_weather', 'parameters': {'type': 'object', 'properties': TYPES}}},
         {'type': 'function', 'function': {'name': 'now'}}]
# (text written, value): strings as written (leading zeros, quotes, tags, lines), others typed by the schema
VALUES = {'city': ('Paris "x" <b>\nsecond line', 'Paris "x" <b>\nsecond line'), 'zip': ('02134', '02134'),
          'days': ('3', 3), 'temp': ('21.5', 21.5), 'flag': ('True', True), 'units': ('["c", "f"]', ['c', 'f']),
          'opts': ("{'deep': [1, None]}", {'deep': [1, None]}), 'maybe': ('null', None)}
ARGUMENTS = json.dumps({k: v for k, (_, v) in VALUES.items()}, ensure_ascii=False)


def xml_call(name: str, arguments: dict, parser) -> str:
    """A call as the family's chat template writes one: Qwen3-Coder a value on its own lines, Seed-OSS inline."""
    nl = '\n' if parser is QWEN3_CODER else ''
    params = ''.join(f'<parameter={k}>{nl}{v}{nl}</parameter>\n' for k, v in arguments.items())
    return f'{parser.open_tag}\n<function={name}>\n{params}</function>\n{parser.close_tag}'


def with_tools(parser, reasoning=None, prompt='', max_calls=None):
    return lambda: ChoiceParser(reasoning(prompt) if reasoning else None, parser(TOOLS), max_calls)


@pytest.mark.parametrize('parser', [QWEN3_CODER, SEED_OSS])
def test_xml_calls_typed_by_the_schema(parser):
    weather = xml_call('get_weather', {k: text for k, (text, _) in VALUES.items()}, parser)
    text = f'Let me check.\n{weather}\n{xml_call("now", {}, parser)}\nDone.'
    assert split(with_tools(parser), text) == {'reasoning': '', 'content': 'Let me check.Done.',
                                               'calls': [('get_weather', ARGUMENTS), ('now', '{}')]}
    assert split(with_tools(parser, max_calls=1), text)['calls'] == [('get_weather', ARGUMENTS)]
    off_schema = xml_call('get_weather', {'days': 'three', 'flag': 'maybe', 'extra': '[1]', 'other': 'x y'}, parser)
    assert split(with_tools(parser), off_schema)['calls'] == [
        ('get_weather', '{"days": "three", "flag": "maybe", "extra": [1], "other": "x y"}')]
    both = xml_call('get_weather', {'city': 'Rome'}, parser).replace('</function>', '</function>\n<function=now>\n'
                                                                      '</function>')
    assert split(with_tools(parser), both)['calls'] == [('get_weather', '{"city": "Rome"}'), ('now', '{}')]


@pytest.mark.parametrize('parser', [QWEN3_CODER, SEED_OSS])
@pytest.mark.parametrize('text, content, calls', [
    ('plain, with <function=f> and {open}', 'plain, with <function=f> and {open}', []),
    ('{open}junk{close} after', '{open}junk{close} after', []),
    ('a {open}\n<function=two words>\n</function>{close}', 'a {open}\n<function=two words>\n</function>{close}', []),
    ('cut in the head {open}\n<function=get_wea', 'cut in the head {open}\n<function=get_wea', []),
    ('ends inside a tag {op}', 'ends inside a tag {op}', []),
    ('{open}\n<function=get_weather>\n<parameter=city>\nPar', '', [('get_weather', '{"city": "Par"}')]),
    ('{open}\n<function=get_weather>\n<parameter=days>\n4', '', [('get_weather', '{"days": 4}')]),
    ('{open}<function=get_weather><parameter=days>4<parameter=city>X</function>{close}', '',
     [('get_weather', '{"days": 4, "city": "X"}')]),
    ('{open}<function=now>stray text</function>{close} ok', 'ok', [('now', '{}')]),
])
@pytest.mark.parametrize('special', [True, False], ids=['special tags', 'plain tags'])
def test_xml_edges(parser, text, content, calls, special):
    """Blocks without a call stay text as written, less the tags where they are special markers (Seed-OSS's
    tokenizer makes them special tokens, Qwen's plain text); a call left open (or missing closing tags) keeps what
    arrived."""
    tags = {'open': parser.open_tag, 'close': parser.close_tag, 'op': parser.open_tag[:4]}
    shown = {**tags, 'open': '', 'close': ''} if special else tags
    expected = {'reasoning': '', 'content': content.format(**shown), 'calls': calls}
    special_markers = parser.markers if special else ()
    assert split(lambda: ChoiceParser(None, parser(TOOLS, special_markers)), text.format(**tags)) == expected


def test_xml_string_values_stream_as_written():
    parser = QWEN3_CODER(TOOLS)
    arguments = lambda text: ''.join(c.arguments for c in parser.feed(text).tool_calls)  # noqa: E731
    assert arguments('<tool_call>\n<function=get_weather>\n<parameter=city>\nPar') == '{"city": "Par'
    assert arguments('is\n') == 'is'  # the newline may be the format's
    assert arguments('</parameter>\n<parameter=days>\n3') == '"'  # a typed value comes out whole
    assert arguments('\n</parameter>\n</function>') == ', "days": 3}'


def test_seed_oss_and_qwen3_5_reasoning_then_calls():
    seed = get_reasoning_parser('seed_oss')
    call = xml_call('get_weather', {'days': '2'}, SEED_OSS)
    text = f'<seed:think>Budget fine.<seed:cot_budget_reflect>ok</seed:cot_budget_reflect></seed:think>\n{call}'
    expected = {'reasoning': 'Budget fine.<seed:cot_budget_reflect>ok</seed:cot_budget_reflect>', 'content': '',
                'calls': [('get_weather', '{"days": 2}')]}
    assert split(with_tools(SEED_OSS, seed, '<seed:bos>assistant\n'), text) == expected
    budget_0 = '<seed:bos>assistant\n<seed:think><seed:cot_budget_reflect>'  # the prompt opens the block
    reply = 'Budget is 0.</seed:cot_budget_reflect>\n</seed:think>\nHi'
    assert split(lambda: ChoiceParser(seed(budget_0)), reply) == {
        'reasoning': 'Budget is 0.</seed:cot_budget_reflect>\n', 'content': 'Hi', 'calls': []}
    assert seed.markers == ('<seed:think>', '</seed:think>') and SEED_OSS.markers[0] == '<seed:tool_call>'
    qwen35 = '<|im_start|>assistant\n<think>\n'  # Qwen3.5's template opens the block in the prompt
    reply = f'Call it.\n</think>\n\n{xml_call("now", {}, QWEN3_CODER)}'
    qwen35_reasoning = get_reasoning_parser('qwen3_5')
    assert split(with_tools(QWEN3_CODER, qwen35_reasoning, qwen35), reply) == {
        'reasoning': 'Call it.\n', 'content': '', 'calls': [('now', '{}')]}
    unclosed = f'Call it.\n\n{xml_call("now", {}, QWEN3_CODER)}'  # Qwen3.5 may call without closing the block
    assert split(with_tools(QWEN3_CODER, qwen35_reasoning, qwen35), unclosed) == {
        'reasoning': 'Call it.\n\n', 'content': '', 'calls': [('now', '{}')]}
    assert split(with_tools(QWEN3_CODER, THINK, qwen35), unclosed)['calls'] == []  # qwen3's blocks end at </think>


@pytest.mark.parametrize('text, content, calls', [
    ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
     '{"name": "now", "arguments": {}}]',
     '', [('get_weather', '{"city": "Paris", "days": 3}'), ('now', '{}')]),
    ('Sure.\n<tool_call>[{"arguments": {"a": [1]}, "name": "f"}]\n', 'Sure.\n', [('f', '{"a": [1]}')]),
    ('<|tool_call|>[{"name": "f", "arguments": {"x": [1, 2', '', [('f', '{"x": [1, 2')]),
    ('no calls [{"name": "f"}] <|tool_', 'no calls [{"name": "f"}] <|tool_', []),
    ('<|tool_call|> not a list', ' not a list', []),  # less the marker, a special token
    ('<|tool_call|>[{"x": 1}, {"name": "f"}]', '[{"x": 1}, {"name": "f"}]', []),
    ('<|tool_call|>[{"name": "f"}, {"x": 1}]', '{"x": 1}]', [('f', '{}')]),
])
def test_granite(text, content, calls):
    """As served with Granite 3.0's tokenizer, which makes ``<|tool_call|>`` a special token."""
    expected = {'reasoning': '', 'content': content, 'calls': calls}
    assert split(lambda: ChoiceParser(None, GRANITE((), ['<|tool_call|>'])), text) == expected


@pytest.mark.parametrize('text, content, calls', [
    ('[get_weather(city="Paris", days=3, units=[\'c\', "f"], flag=True, maybe=None), now()]', '',
     [('get_weather', '{"city": "Paris", "days": 3, "units": ["c", "f"], "flag": true, "maybe": null}'),
      ('now', '{}')]),
    ('<|python_start|>[f(note=\'\'\'a "b", c)\'\'\', x=true, y=null,)]<|python_end|>', '',
     [('f', '{"note": "a \\"b\\", c)", "x": true, "y": null}')]),
    ('Let me check.\n[f(a={"k": (1, 2)})]\nDone.', 'Let me check.Done.', [('f', '{"a": {"k": [1, 2]}}')]),
    ('[1, 2] and [Note] are text', '[1, 2] and [Note] are text', []),
    ('see [f(a=1)] mid-line; [f(x)] positional', 'see [f(a=1)] mid-line; [f(x)] positional', []),
    ('[f(a=1e999)]', '[f(a=1e999)]', []),
    ('[f(', '[f(', []),
    ('[f(a=1, b=os.system("x"))] breaks off', ' b=os.system("x"))] breaks off', [('f', '{"a": 1}')]),
    ('[f(a=1, b="cut', '', [('f', '{"a": 1}')]),
])
def test_pythonic(text, content, calls):
    """Python literals only (``ast``, never evaluated): a list whose first call does not hold is text; one that
    breaks off later keeps what came before."""
    assert split(lambda: ChoiceParser(None, PYTHONIC()), text) == {'reasoning': '', 'content': content, 'calls': calls}


SAMPLES = [xml_call('get_weather', {'city': 'Paris', 'days': '3'}, QWEN3_CODER),
           xml_call('now', {'x': '1'}, SEED_OSS), 'Hi <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
           '<|tool_call|>[{"name": "f", "arguments": {}}]', '[f(a=1), g()] tail', '{"name": "f", "parameters": {}}',
           '[TOOL_CALLS]f[ARGS]{"a": "]"}', '<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value></tool_call>',
           'plain < [ { text', '']


@pytest.mark.parametrize('name', sorted({cls.__name__: name for name, cls in TOOL_PARSERS.items()}.values()))
def test_every_parser_reads_every_format_the_same_under_any_chunking(name):
    for text in SAMPLES:
        split(lambda: ChoiceParser(None, get_tool_parser(name)(TOOLS)), text)


def test_auto_detected_parsers_are_registered():
    from lmdeploy.serve.reasoning import MODEL_PARSERS, pick_reasoning_parser
    for tool, reasoning in MODEL_PARSERS.values():
        assert get_tool_parser(tool) and (reasoning is None or get_reasoning_parser(reasoning))
    assert MODEL_PARSERS['seed_oss'] == ('seed_oss', 'seed_oss')
    assert MODEL_PARSERS['qwen3_5_moe_text'] == ('qwen3_coder', 'qwen3_5')
    assert pick_reasoning_parser('auto', 'seed_oss') is get_reasoning_parser('seed_oss')
    assert 'qwen3_moe' not in MODEL_PARSERS and 'granite' not in MODEL_PARSERS  # their formats vary by checkpoint


NESTED = '[' * 1100 + ']' * 1100  # deeper than Python's json module reads (its recursion limit)
NESTED_SAMPLES = [f'<tool_call>{{"name": "f", "arguments": {{"a": {NESTED}}}}}</tool_call>',
                  f'<tool_call>{{"name": "f", "arguments": {NESTED}}}</tool_call>',
                  f'<|tool_call|>[{{"name": "f", "arguments": {{"a": {NESTED}}}}}]', f'[f(a={NESTED})]',
                  f'{{"name": "f", "parameters": {{"a": {NESTED}}}}}', f'[TOOL_CALLS]f[ARGS]{{"a": {NESTED}}}',
                  xml_call('get_weather', {'city': NESTED, 'days': NESTED}, QWEN3_CODER),
                  xml_call('get_weather', {'days': NESTED}, SEED_OSS),
                  f'<tool_call>f<arg_key>a</arg_key><arg_value>{NESTED}</arg_value></tool_call>']


@pytest.mark.parametrize('name', sorted({cls.__name__: name for name, cls in TOOL_PARSERS.items()}.values()))
def test_every_parser_takes_json_nested_too_deep_to_read(name):
    """A reply nested deeper than ``json.loads`` reads (a model stuck writing ``[``) is text or a call whose
    arguments are what the model wrote: json's RecursionError once escaped, a 500 for the whole reply."""
    for text in NESTED_SAMPLES:
        for pieces in ([text], [text[:len(text) // 2], text[len(text) // 2:]]):
            parser = ChoiceParser(None, get_tool_parser(name)(TOOLS))
            for i, piece in enumerate(pieces + ['']):
                parser.feed(piece, final=i == len(pieces))
        ChoiceParser(None, get_tool_parser(name)(TOOLS)).message(text)
