"""Follow-ups of the serving leftovers (docs/reliability.md, "Serving leftovers (2026-12-07)"): every tool parser
shows a marker that starts no call the same way, streamed and not, leaving out the markers that the served
tokenizer makes special tokens (through a real server on a tiny model whose tokenizer makes ``<tool_call>`` a
special token or a plain one)."""
from __future__ import annotations

import httpx
import pytest
from server_helpers import ServerThread, serve_per_parser, tiny_engine
from test_tool_server_hunt import ask, assert_released, regex
from tool_models import ADDED_TOKENS, save_tool_model

from lmdeploy.serve.openai.api_server import create_app
from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.reasoning_parsers import REASONING_PARSERS
from lmdeploy.serve.openai.tool_parsers import TOOL_PARSERS, ParsedDelta
from lmdeploy.serve.openai.tool_parsers.harmony import HarmonyToolParser

# parser, a marker of it that starts calls, where it starts calls ('anywhere', or only at the reply's start)
MARKERS = [
    ('mistral', '[TOOL_CALLS]', 'anywhere'),
    ('deepseek_v3', '<｜tool▁calls▁begin｜>', 'anywhere'),
    ('granite', '<|tool_call|>', 'anywhere'),  # Granite 3.0
    ('granite', '<tool_call>', 'anywhere'),  # Granite 3.1 on
    ('hermes', '<tool_call>', 'anywhere'),
    ('qwen3_coder', '<tool_call>', 'anywhere'),
    ('glm45', '<tool_call>', 'anywhere'),
    ('seed_oss', '<seed:tool_call>', 'anywhere'),
    ('minimax_m2', '<minimax:tool_call>', 'anywhere'),
    ('pythonic', '<|python_start|>', 'anywhere'),  # Llama 4
    ('lfm2', '<|tool_call_start|>', 'anywhere'),
    ('jamba', '<tool_calls>', 'anywhere'),
    ('hunyuan_a13b', '<tool_calls>', 'anywhere'),
    ('falcon_h1', '<tool_call>', 'anywhere'),
    ('cohere2', '<|START_ACTION|>', 'anywhere'),
    ('longcat', '<longcat_tool_call>', 'anywhere'),
    ('llama3_json', '<|python_tag|>', 'start'),
]
# what follows the marker: nothing, text, whitespace, a list that holds no call
AFTER = ['', 'not a call', ' ', '[1, 2] x']


def pieces(parser, text: str) -> ParsedDelta:
    """The reply fed one character at a time, as a stream may cut it."""
    out = ParsedDelta()
    for char in text:
        out.extend(parser.feed(char))
    return out.extend(parser.finish())


def test_every_parser_but_harmony_is_covered():
    """Harmony's markers frame messages (a header, then a body), not calls among text: it is left out."""
    covered = {TOOL_PARSERS.lookup(name) for name, *_ in MARKERS}
    assert covered | {HarmonyToolParser} == set(TOOL_PARSERS.values())


@pytest.mark.parametrize('special', [True, False], ids=['special', 'plain'])
@pytest.mark.parametrize('after', AFTER, ids=['at the end', 'text', 'whitespace', 'a list'])
@pytest.mark.parametrize('name, marker, where', MARKERS, ids=[f'{m[0]} {m[1]}' for m in MARKERS])
def test_a_marker_that_starts_no_call_leaves_the_text_as_written_less_a_special_marker(name, marker, where, after,
                                                                                       special):
    """Was: ``Hi. `` (mistral, deepseek_v3), ``Hi.`` (hermes), ``Hi. <|tool_call|>`` (granite) for a marker at the
    reply's end; glm45, seed_oss and pythonic kept their special markers. Now every parser gives the text as
    written, the whitespace before the marker included, less the marker where it is one of the parser's
    ``special_markers`` (as the reply shows without a parser, the detokenizer skipping special tokens), streamed
    and not."""
    before = 'Hi. ' if where == 'anywhere' else ''
    text = before + marker + after
    expected = before + ('' if special else marker) + after
    parser = TOOL_PARSERS.lookup(name)
    special_markers = [marker] if special else []
    assert parser(special_markers=special_markers).parse(text) == ParsedDelta(expected)
    assert pieces(parser(special_markers=special_markers), text) == ParsedDelta(expected)


STRAY = [(name, marker) for name in sorted({m[0] for m in MARKERS}) for marker in TOOL_PARSERS.lookup(name).markers
         if (name, marker) not in {m[:2] for m in MARKERS}]


@pytest.mark.parametrize('special', [True, False], ids=['special', 'plain'])
@pytest.mark.parametrize('name, marker', STRAY, ids=[f'{name} {marker}' for name, marker in STRAY])
def test_a_stray_marker_outside_a_call_is_left_out_where_special(name, marker, special):
    """A marker that starts no call (a lone ``</tool_call>``, ``[ARGS]``) in the text: was kept whatever the
    tokenizer, so the reply showed a special token that the reply without a parser leaves out. Now the message is
    the text as written less the markers that are ``special_markers``, streamed (one character at a time) and
    not."""
    parser = TOOL_PARSERS.lookup(name)
    special_markers = parser.markers if special else ()
    text = f'Hi. {marker} there'
    expected = 'Hi.  there' if special else text
    message = ChoiceParser(None, parser(special_markers=special_markers), special_markers=special_markers).message(text)
    assert (message.content, message.tool_calls) == (expected, None)
    streamed = ChoiceParser(None, parser(special_markers=special_markers), special_markers=special_markers)
    assert ''.join(streamed.feed(char).content for char in text) + streamed.feed('', final=True).content == expected


@pytest.mark.parametrize('special', [True, False], ids=['special', 'plain'])
def test_a_repeated_think_tag_is_left_out_of_reasoning_and_answer_where_special(special):
    """Was: a ``<think>`` inside the reasoning and a ``</think>`` in the answer stayed, special or not."""
    parser = REASONING_PARSERS.lookup('qwen3')
    special_markers = parser.markers if special else ()
    text = '<think>a<think>b</think>c</think>d'
    message = ChoiceParser(parser('prompt'), special_markers=special_markers).message(text)
    assert (message.reasoning_content, message.content) == (('ab', 'cd') if special else ('a<think>b', 'c</think>d'))


@pytest.fixture(scope='module', params=[True, False], ids=['special tags', 'plain tags'])
def servers(request, tmp_path_factory):
    """A server per tool parser, all on the tiny model of ``tests/tool_models.py`` whose tokenizer makes its
    tags (``<think>``, ``<tool_call>``...) special tokens, or plain added tokens as Qwen's do."""
    path = save_tool_model(str(tmp_path_factory.mktemp('markers')), special=ADDED_TOKENS if request.param else ())
    yield from serve_per_parser(tiny_engine(path))


def tag_bias(server: ServerThread, tags: tuple[str, ...] = ('<tool_call>', '</tool_call>')) -> dict[str, float]:
    """A logit bias that makes the model write each tag as its one token (else it may spell it in pieces)."""
    tokenizer = server.engine.tokenizer
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in tags]
    assert all(len(i) == 1 for i in ids)
    return {str(i[0]): 100.0 for i in ids}


@pytest.mark.parametrize('reply', ['Hi.\n<tool_call>not a call</tool_call>', 'Hi.</tool_call> there'],
                         ids=['a block', 'a stray closing tag'])
@pytest.mark.parametrize('skip_special_tokens', [True, False], ids=['skipping', 'keeping'])
@pytest.mark.parametrize('parser', ['hermes', 'glm45'])
def test_a_block_without_a_call_shows_as_the_reply_without_a_parser(servers, parser, skip_special_tokens, reply):
    """The parser's content is the text a client gets without a parser (``tool_choice: none``): less the tags
    where the served tokenizer makes them special tokens and the request skips them, else as written. Was: the
    parser's class decided (hermes kept the tags, glm45 dropped them), whatever the tokenizer and the request;
    a stray closing tag stayed with both."""
    server = servers(parser)
    body = {'structured_outputs': {'regex': regex(reply)}, 'logit_bias': tag_bias(server),
            'skip_special_tokens': skip_special_tokens}
    without_parser = ask(server, {**body, 'tool_choice': 'none'})
    special = '<tool_call>' in server.engine.tokenizer.special_token_ids.values()
    shown = reply.replace('<tool_call>', '').replace('</tool_call>', '') if special and skip_special_tokens else reply
    assert without_parser == {'content': shown, 'calls': [], 'finish_reason': 'stop'}
    assert ask(server, body) == without_parser


def test_a_think_block_is_reasoning_whether_its_tags_are_special_or_not(servers):
    """Was: the ``qwen3`` parser kept no marker, so with a tokenizer that makes ``</think>`` special the
    detokenizer dropped it and the answer came back as reasoning. The prompt opens the block; the bias closes it
    at once, and the answer is forced after it."""
    engine = servers('hermes').engine
    server = ServerThread(create_app(engine, model_name='m', reasoning_parser='qwen3'))
    server.engine = engine
    try:
        body = {'model': 'm', 'messages': [{'role': 'user', 'content': 'Hi?'}], 'temperature': 0, 'max_tokens': 100,
                'chat_template_kwargs': {'open_think': True}, 'logit_bias': tag_bias(server, ('</think>',)),
                'structured_outputs': {'regex': 'Hi\\.'}}
        r = httpx.post(f'{server.url}/v1/chat/completions', json=body, timeout=120)
        assert r.status_code == 200, r.text
        message = r.json()['choices'][0]['message']
        assert (message['reasoning_content'] or '', message['content']) == ('', 'Hi.')
        assert_released(engine)
    finally:
        server.stop()
