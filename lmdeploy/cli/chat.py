"""``lmdeploy chat [MODEL]``: an interactive terminal chat that streams its replies.

On a terminal the input line (prompt_toolkit) has history (up/down, kept in
``~/.cache/lmdeploy/chat_history``) and takes several lines: end a line with ``\\`` or press
Esc then Enter to go on to the next one. Ctrl-C during a reply stops that reply (what it said so
far stays in the conversation); Ctrl-D or ``exit`` (``quit``, ``/exit``) quits, ``reset`` starts a new
conversation, ``/image PATH`` (or URL) attaches an image to the next message when the model takes images, and
``/help`` lists these. Any other ``/word`` is refused as an unknown command rather than sent to the model (a
message may still start with a path such as ``/etc/hosts``).

A message that cannot be sent (a bad image, a message longer than ``session_len`` on its own)
prints an error and leaves the conversation as it was. When the conversation outgrows
``session_len``, its oldest turns are left out until the new message fits, and the chat says so.

A reasoning model's reply (read by ``--reasoning-parser``, by default the model's own: harmony for
gpt-oss) shows its reasoning between a ``Thinking...`` and a ``...done thinking.`` line, dimmed on a
terminal, then the answer; ``--hide-reasoning`` shows the answer only. The conversation goes on with
the answer as the reply and the reasoning where the model's chat template takes it back.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lmdeploy.cli.args import (HelpFormatter, add_engine_args, add_generation_args, engine_config, generation_config,
                               setup_logging)
from lmdeploy.messages import GenerationConfig
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.serve.openai.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from lmdeploy.serve.reasoning import AUTO, assistant_message, pick_reasoning_parser
from lmdeploy.serve.session_manager import Session

if TYPE_CHECKING:
    from lmdeploy.serve.async_engine import AsyncEngine

PROMPT = '>>> '
CONTINUATION = '... '
THINKING, DONE_THINKING = 'Thinking...', '...done thinking.'
DIM, RESET = '\033[2m', '\033[0m'
NO_PARSER = 'none'
HELP = "Type a message; 'reset' starts over, 'exit' (or Ctrl-D) quits, '/help' shows this. End a line with \\ to go on."
COMMANDS = {'exit': 'exit', '/exit': 'exit', 'quit': 'exit', '/quit': 'exit', 'reset': 'reset', '/reset': 'reset',
            '/image': 'image', '/help': 'help', '/?': 'help'}


def add_chat_parser(commands) -> None:
    """Registers ``lmdeploy chat``."""
    parser = commands.add_parser('chat', help='chat with a model in the terminal', formatter_class=HelpFormatter)
    add_engine_args(parser)
    add_generation_args(parser)
    parser.add_argument('--reasoning-parser', default=AUTO, choices=[AUTO, NO_PARSER, *sorted(REASONING_PARSERS)],
                        help="splits replies into reasoning and answer: 'auto' uses the model's own (harmony for "
                             "gpt-oss, none for most models), 'none' shows replies as they are")
    parser.add_argument('--hide-reasoning', action='store_true', help="show a reply's answer only, not its reasoning")
    parser.set_defaults(run=run_chat)


def _history_path() -> str:
    cache = os.environ.get('LMDEPLOY_CACHE_DIR') or os.path.join(os.path.expanduser('~'), '.cache', 'lmdeploy')
    os.makedirs(cache, exist_ok=True)
    return os.path.join(cache, 'chat_history')


class LineReader:
    """Reads one (possibly multi-line) message: prompt_toolkit on a terminal, plain lines otherwise.

    Returns None at end of input.
    """

    def __init__(self):
        self.session = None
        if sys.stdin.isatty() and sys.stdout.isatty():
            from prompt_toolkit import PromptSession
            from prompt_toolkit.history import FileHistory
            self.session = PromptSession(history=FileHistory(_history_path()), multiline=True,
                                         key_bindings=_key_bindings(),
                                         prompt_continuation=lambda *_: CONTINUATION)

    async def read(self) -> str | None:
        if self.session is not None:
            while True:
                try:
                    return await self.session.prompt_async(PROMPT)
                except KeyboardInterrupt:
                    continue
                except EOFError:
                    return None
        lines = []
        while True:
            print(CONTINUATION if lines else PROMPT, end='', flush=True)
            line = await asyncio.to_thread(sys.stdin.readline)
            if not line:
                return '\n'.join(lines) if lines else None
            line = line.rstrip('\n')
            if not line.endswith('\\'):
                return '\n'.join(lines + [line])
            lines.append(line[:-1])


def _key_bindings():
    from prompt_toolkit.key_binding import KeyBindings
    bindings = KeyBindings()

    @bindings.add('enter')
    def _enter(event) -> None:
        buffer = event.current_buffer
        if buffer.document.text_before_cursor.endswith('\\'):
            buffer.delete_before_cursor(1)
            buffer.insert_text('\n')
        else:
            buffer.validate_and_handle()

    @bindings.add('escape', 'enter')
    def _newline(event) -> None:
        event.current_buffer.insert_text('\n')

    return bindings


CONTROL_CHARACTERS = re.compile('[\x00-\x08\x0b-\x1f\x7f-\x9f]')


def shown(text: str) -> str:
    """``text`` with control characters other than newline and tab written as ``\\xNN``, so that a reply cannot
    move the cursor, retitle the terminal or reach its clipboard with escape sequences."""
    return CONTROL_CHARACTERS.sub(lambda match: f'\\x{ord(match.group()):02x}', text)


class ReplyPrinter:
    """Prints a reply as it streams: its reasoning (unless hidden) between a :data:`THINKING` and a
    :data:`DONE_THINKING` line, dimmed when ``dim``, and its answer, each as :func:`shown` writes it."""

    def __init__(self, show_reasoning: bool = True, dim: bool = False):
        self.show_reasoning = show_reasoning
        self.dim = dim
        self.thinking = False

    def start(self) -> None:
        """A new reply begins."""
        self.thinking = False

    def write(self, reasoning: str, answer: str) -> None:
        """Prints the reply's next pieces."""
        if reasoning and self.show_reasoning:
            if not self.thinking:
                self._faint(THINKING + '\n')
                self.thinking = True
            self._faint(shown(reasoning))
        if answer:
            if self.thinking:
                self._faint(f'\n{DONE_THINKING}\n\n')
                self.thinking = False
            print(shown(answer), end='', flush=True)

    def _faint(self, text: str) -> None:
        print(f'{DIM}{text}{RESET}' if self.dim else text, end='', flush=True)


@dataclass
class Replying:
    """How the chat replies: the generation config, the reasoning parser (if any) and the printer."""

    gen: GenerationConfig
    reasoning_parser: type[ReasoningParser] | None
    printer: ReplyPrinter


@dataclass
class Reply:
    """The reply being streamed: its answer and reasoning so far, and how many history messages were left
    out for it."""

    text: str = ''
    reasoning: str = ''
    dropped: int = 0
    failed: bool = False


async def _reply(engine: AsyncEngine, session: Session, turn: list[dict], how: Replying,
                 history: list[dict], reply: Reply) -> None:
    """Streams the reply to ``history + turn`` into ``reply``; a failure mid-reply is printed and marks it failed.

    Raises :class:`SafeRunException` before printing anything when the prompt is rejected.
    """
    reply.text = reply.reasoning = ''
    how.printer.start()
    async for chunk in engine.generate(history + turn, session.session_id, how.gen,
                                       reasoning_parser=how.reasoning_parser):
        how.printer.write(chunk.reasoning_content or '', chunk.text)
        reply.text += chunk.text
        reply.reasoning += chunk.reasoning_content or ''
        if chunk.finish_reason == 'error':
            print(f'\n[error: {chunk.error}]', end='')
            reply.failed = True
            return


async def _reply_fitting(engine: AsyncEngine, session: Session, turn: list[dict], how: Replying,
                         reply: Reply) -> None:
    """Replies to ``turn`` after as much of the history as fits in ``session_len``.

    When the whole conversation is too long, the oldest turns (a user message and its reply each)
    are left out, one at a time, until the prompt fits (``reply.dropped`` says how many history
    messages); raises the length error if even the new message alone is too long (and every other
    :class:`SafeRunException` at once).
    """
    history = session.history
    while True:
        try:
            return await _reply(engine, session, turn, how, history[reply.dropped:], reply)
        except SafeRunException as exc:
            if exc.code is not ErrorCode.INPUT_LENGTH_ERROR or reply.dropped >= len(history):
                raise
            reply.dropped = _next_turn_start(history, reply.dropped)


def _next_turn_start(history: list[dict], start: int) -> int:
    """Index of the user message that begins the turn after the one at ``start`` (``len(history)`` if none)."""
    index = start + 1
    while index < len(history) and history[index].get('role') != 'user':
        index += 1
    return index


def _attach_error(engine: AsyncEngine, source: str) -> str | None:
    """Why ``/image source`` cannot be attached, or None when it loads."""
    from lmdeploy.vl.media import load_image
    if not engine.processor.accepts_images:
        return 'this model does not accept images'
    try:
        load_image(os.path.expanduser(source), engine.processor.media_policy)
    except ValueError as exc:
        return str(exc)
    return None


def _command(prompt: str | None) -> tuple[str, str]:
    """The command a line is and its argument: 'exit' (also at the end of input), 'reset', 'help', 'image' (whose
    argument is the image), 'unknown' (a ``/word`` that is none of these, or one given an argument it does not
    take), or '' for a message (which may start with a path: ``/etc/hosts``)."""
    if prompt is None:
        return 'exit', ''
    word, _, argument = prompt.strip().partition(' ')
    name, argument = COMMANDS.get(word.lower()), argument.strip()
    if name is not None and (name == 'image' or not argument):
        return name, argument
    if word[:1] == '/' and '/' not in word[1:]:
        return 'unknown', prompt.strip()
    return '', ''


def _user_turn(prompt: str, images: list[str]) -> list[dict]:
    if not images:
        return [{'role': 'user', 'content': prompt}]
    parts = [{'type': 'image_url', 'image_url': {'url': os.path.expanduser(image)}} for image in images]
    return [{'role': 'user', 'content': parts + [{'type': 'text', 'text': prompt}]}]


async def chat(engine: AsyncEngine, gen: GenerationConfig, reasoning_parser: type[ReasoningParser] | None = None,
               show_reasoning: bool = True) -> None:
    """The read-reply loop; Ctrl-C (SIGINT) during a reply aborts just that reply. ``reasoning_parser`` (if
    any) splits replies into reasoning, shown unless ``show_reasoning`` is False, and answer."""
    loop = asyncio.get_running_loop()
    how = Replying(gen, reasoning_parser, ReplyPrinter(show_reasoning, dim=sys.stdout.isatty()))
    reader = LineReader()
    session = engine.session()
    images: list[str] = []
    usage = HELP + (" '/image PATH' attaches an image to your next message." if engine.processor.accepts_images
                    else '')
    print(usage)
    while True:
        prompt = await reader.read()
        command, argument = _command(prompt)
        if command == 'exit':
            break
        if command == 'reset':
            await engine.end_session(session.session_id)
            session = engine.session()
            images = []
            print('[new conversation]')
            continue
        if command in ('help', 'unknown'):
            print(f'[unknown command: {argument}] {usage}' if command == 'unknown' else usage)
            continue
        if command == 'image':
            error = _attach_error(engine, argument) if argument else 'usage: /image PATH'
            if error:
                print(f'[error: {error}]')
            else:
                images.append(argument)
                print(f'[image {len(images)} attached: {argument}]')
            continue
        if not prompt.strip():
            continue
        turn = _user_turn(prompt, images)
        images = []
        reply = Reply()
        task = asyncio.create_task(_reply_fitting(engine, session, turn, how, reply))
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        interrupted = False
        try:
            await task
            print()
        except asyncio.CancelledError:  # the partial reply stays: the next message may refer to it
            interrupted = True
            print('\n[interrupted: the partial reply stays in the conversation]' if reply.text
                  else '\n[interrupted: this message was left out of the conversation]')
        except SafeRunException as exc:  # the message is not sent; the conversation stays as it was
            print(f'[error: {exc.message}]')
            continue
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        if reply.dropped:
            turns = sum(1 for message in session.history[:reply.dropped] if message.get('role') == 'user')
            print(f'[the conversation outgrew session_len ({engine.session_len} tokens): '
                  f'left out the oldest {turns} turn{"s" if turns != 1 else ""}]')
            del session.history[:reply.dropped]
        if not reply.failed and (reply.text or not interrupted):
            session.history += turn + [assistant_message(reply.text, reply.reasoning, reasoning_parser)]
    await engine.end_session(session.session_id)


def run_chat(args: argparse.Namespace) -> None:
    from lmdeploy.model_source import check_model_path
    check_model_path(args.model_path)
    setup_logging(args.log_level)
    gen, config = generation_config(args), engine_config(args)  # a bad flag is refused before torch loads
    from lmdeploy.serve.async_engine import AsyncEngine
    from lmdeploy.vl.media import MediaPolicy
    engine = AsyncEngine(args.model_path, config, show_progress=False,
                         media_policy=MediaPolicy.for_local_caller())  # /image PATH: the user's own files
    try:
        parser = pick_reasoning_parser(None if args.reasoning_parser == NO_PARSER else args.reasoning_parser,
                                       engine.engine.model_config.hf_config.model_type)
        asyncio.run(chat(engine, gen, parser, show_reasoning=not args.hide_reasoning))
    finally:
        engine.close()
