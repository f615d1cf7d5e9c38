"""``lmdeploy chat`` with a reasoning model: a tiny gpt-oss scripted to answer every message with harmony
reasoning and an answer (the chat takes no grammar that could force a random model's reply). The harmony
parser applies by itself; the reasoning shows apart from the answer (dimmed in a terminal, between labels
in plain text); ``--hide-reasoning`` hides it, ``--reasoning-parser none`` shows replies as before; the next
turn's history holds the answer as the content and the reasoning as gpt-oss's template takes it."""
from __future__ import annotations

import asyncio
import copy
import io
import os
import re
import sys

import pexpect
import pytest
from harmony_models import SCRIPTED_ANSWER, SCRIPTED_REASONING, save_scripted_harmony_model
from server_helpers import tiny_engine
from test_chat_cli import PROMPT, quit_cleanly

from lmdeploy.cli.chat import DIM, DONE_THINKING, THINKING, chat
from lmdeploy.messages import GenerationConfig
from lmdeploy.serve.openai.reasoning_parsers import get_reasoning_parser

SHOWN = f'{THINKING}\n{SCRIPTED_REASONING}\n{DONE_THINKING}\n\n{SCRIPTED_ANSWER}\n'


@pytest.fixture(scope='module')
def scripted(tmp_path_factory) -> str:
    return save_scripted_harmony_model(str(tmp_path_factory.mktemp('scripted_harmony')))


def spawn(model: str, cache: str, *flags: str) -> pexpect.spawn:
    """A chat on ``model``, starting: its prompt is not waited for."""
    env = {**os.environ, 'PROMPT_TOOLKIT_NO_CPR': '1', 'TERM': 'dumb', 'LMDEPLOY_CACHE_DIR': cache}
    return pexpect.spawn(sys.executable, ['-m', 'lmdeploy.cli.main', 'chat', model, '--dtype', 'float32',
                                          '--num-gpu-blocks', '64', '--block-size', '16', *flags],
                         env=env, encoding='utf-8', timeout=120, dimensions=(40, 200))


@pytest.fixture(scope='module')
def chats(scripted, tmp_path_factory) -> dict[str, pexpect.spawn]:
    """The file's three chats by their flags, started side by side (a chat's start is most of each test)."""
    flags = {'shown': (), 'hidden': ('--hide-reasoning',), 'no parser': ('--reasoning-parser', 'none')}
    children = {name: spawn(scripted, str(tmp_path_factory.mktemp('chat')), *f) for name, f in flags.items()}
    yield children
    for child in children.values():
        child.close(force=True)


def ready(child: pexpect.spawn) -> pexpect.spawn:
    """``child`` once it shows its prompt (the file's chats start together: a longer wait than a reply's)."""
    child.expect_exact(PROMPT, timeout=240)
    return child


def said(child: pexpect.spawn, message: str) -> str:
    """What the chat printed in reply to ``message``, without terminal styles."""
    child.send(message + '\r')
    child.expect_exact(PROMPT)
    return re.sub(r'\x1b\[[0-9;]*m', '', child.before.replace('\r\n', '\n'))


def test_terminal_shows_the_reasoning_dimmed_before_the_answer(chats):
    child = ready(chats['shown'])
    child.send('Hi\r')
    child.expect_exact(PROMPT)
    assert DIM + THINKING in child.before
    assert SHOWN in re.sub(r'\x1b\[[0-9;]*m', '', child.before.replace('\r\n', '\n'))
    again = said(child, 'And then?')  # the template refuses channel markers in a history's content
    assert SHOWN in again and 'error' not in again
    quit_cleanly(child)


def test_hidden_reasoning_and_no_parser(chats):
    child = ready(chats['hidden'])
    out = said(child, 'Hi')
    assert out.endswith(f'\n{SCRIPTED_ANSWER}\n') and SCRIPTED_REASONING not in out and THINKING not in out
    quit_cleanly(child)
    child = ready(chats['no parser'])
    out = said(child, 'Hi')  # the markers are special tokens: dropped, as without a parser before
    assert out.endswith(f'\nanalysis{SCRIPTED_REASONING}{SCRIPTED_ANSWER}\n') and THINKING not in out
    quit_cleanly(child)


def test_plain_output_and_the_history_sent_back(scripted, monkeypatch, capsys):
    """Not on a terminal: labels without styles. The second message goes to the template after the first
    reply's answer as the content and its reasoning as ``thinking``."""
    engine = tiny_engine(scripted, num_gpu_blocks=64)
    sent: list[list[dict]] = []
    generate = engine.generate

    def recording(messages, *args, **kwargs):
        sent.append(copy.deepcopy(messages))
        return generate(messages, *args, **kwargs)

    monkeypatch.setattr(engine, 'generate', recording)
    monkeypatch.setattr(sys, 'stdin', io.StringIO('Hi\nAnd then?\n'))
    try:
        asyncio.run(chat(engine, GenerationConfig(max_new_tokens=16), get_reasoning_parser('harmony')))
    finally:
        engine.close()
    out = capsys.readouterr().out
    assert '\x1b[' not in out and out.count(SHOWN) == 2
    assert sent[1] == [{'role': 'user', 'content': 'Hi'},
                       {'role': 'assistant', 'content': SCRIPTED_ANSWER, 'thinking': SCRIPTED_REASONING},
                       {'role': 'user', 'content': 'And then?'}]
