"""Bounds on what one request may ask for, checked before admission (cheap: no tokenization), and the
ASGI middleware that bounds the request body.

Each limit has a ``--max-...`` flag of ``lmdeploy serve api_server``; breaking one is a 400 (the body: a
413) whose OpenAI error body names the flag and its value, with ``code`` ``<limit>_exceeded``.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lmdeploy.serve.openai.errors import APIError, error_response


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds of the server; None turns a limit off."""

    max_request_body_bytes: int | None = 32 * 1024 * 1024
    max_messages: int | None = 2048
    max_prompt_chars: int | None = 1_000_000
    max_stop_sequences: int | None = 32
    max_stop_length: int | None = 256
    max_stop_token_ids: int | None = 64
    max_fanout: int | None = 128
    max_grammar_compile_seconds: int | None = 30
    max_grammar_size: int | None = 64 * 1024
    max_grammar_repetition: int | None = 1000
    max_grammar_optionals: int | None = 24

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f'{f.name} must be a positive int or None, got {value!r}')


def flag(name: str) -> str:
    return '--' + name.replace('_', '-')


def limit_error(name: str, what: str, value: int | str, limit: int, param: str | None, status: int = 400) -> APIError:
    """A 400 (or ``status``) saying ``what`` is ``value``, over the limit ``limit`` of ``--name``."""
    return APIError(status, f'{what} is {value}, over the limit of {limit} (the server\'s {flag(name)} is {limit})',
                    param, f'{name}_exceeded')


def _check(limits: RequestLimits, name: str, what: str, value: int, param: str | None) -> None:
    limit = getattr(limits, name)
    if limit is not None and value > limit:
        raise limit_error(name, what, value, limit, param)


def text_chars(value: object) -> int:
    """Characters of every string (keys too) in a JSON value."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += sum(len(k) for k in item if isinstance(k, str))
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return total


def message_chars(messages: Iterable[object]) -> int:
    """Characters of the text of chat messages that a chat template may render: string contents, the ``text`` of
    content parts and every string of the other fields (``tool_calls``, ``name``, ...); not images."""
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get('content')
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part['text']) for part in content
                         if isinstance(part, dict) and isinstance(part.get('text'), str))
        total += text_chars({k: v for k, v in message.items() if k != 'content'})
    return total


def check_messages(limits: RequestLimits, messages: list, param: str = 'messages', extra_chars: int = 0) -> None:
    """Bounds the number of messages, and their characters (see :func:`message_chars`) plus ``extra_chars``
    (what else the chat template renders: tools, template variables)."""
    _check(limits, 'max_messages', 'the number of messages', len(messages), param)
    _check(limits, 'max_prompt_chars', 'the number of prompt characters', message_chars(messages) + extra_chars,
           param)


def check_prompt_chars(limits: RequestLimits, chars: int, param: str = 'prompt') -> None:
    _check(limits, 'max_prompt_chars', 'the number of prompt characters', chars, param)


def check_stop(limits: RequestLimits, stop: str | list[str] | None, stop_token_ids: list[int] | None) -> None:
    words = [stop] if isinstance(stop, str) else (stop or [])
    _check(limits, 'max_stop_sequences', 'the number of stop sequences', len(words), 'stop')
    if words:
        _check(limits, 'max_stop_length', 'the length of the longest stop sequence', max(len(w) for w in words),
               'stop')
    _check(limits, 'max_stop_token_ids', 'the number of stop_token_ids', len(stop_token_ids or ()),
           'stop_token_ids')


def check_fanout(limits: RequestLimits, n: int, num_prompts: int, param: str = 'n') -> None:
    _check(limits, 'max_fanout', f'the fan-out n x prompts ({n} x {num_prompts})', n * num_prompts, param)


def check_grammar_cost(limits: RequestLimits, fmt: dict | None, param: str | None) -> None:
    """Bounds what drives the compile time of a ``response_format`` (see
    :mod:`lmdeploy.pytorch.engine.grammar_cost`), before it compiles: its size first, which bounds the time the
    others take to count."""
    if fmt is None:
        return
    from lmdeploy.pytorch.engine.grammar_cost import format_cost, format_size  # the CLI parses without the engine
    _check(limits, 'max_grammar_size', "the size of the response format's text in bytes (a JSON schema's as compact "
           'JSON)', format_size(fmt), param)
    cost = format_cost(fmt)
    _check(limits, 'max_grammar_repetition', "the repetition of the format's regexes (character classes spelled "
           "out, each once more per optional item before it, a schema pattern's {m,n} multiplied out, 20 per string "
           'format, all added)', cost.repetition, param)
    _check(limits, 'max_grammar_optionals', 'the number of optional items (x?, x{0,1}, empty alternatives) of one '
           "of the format's regexes or its grammar", cost.optionals, param)


class BodyLimitMiddleware:
    """Answers 413 when a request body is over ``max_bytes``: at once when ``Content-Length`` says so,
    else as soon as the bytes actually read (chunked bodies included) pass it. The body is read here
    (at most ``max_bytes`` of it) and replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        err = limit_error('max_request_body_bytes', 'the request body size in bytes', size, self.max_bytes, None, 413)
        response = error_response(413, str(err), None, err.code, headers={'Connection': 'close'})
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope['type'] != 'http':
            await self.app(scope, receive, send)
            return
        for key, value in scope['headers']:
            if key == b'content-length':
                try:
                    declared = int(value)
                except ValueError:
                    await error_response(400, 'invalid Content-Length header', code='invalid_argument')(
                        scope, receive, send)
                    return
                if declared > self.max_bytes:
                    await self._reject(scope, receive, send, str(declared))
                    return
        chunks, size = [], 0
        pending: list[Message] = []
        while True:
            message = await receive()
            if message['type'] != 'http.request':
                pending.append(message)
                break
            body = message.get('body', b'')
            size += len(body)
            if size > self.max_bytes:
                await self._reject(scope, receive, send, f'more than {self.max_bytes}')
                return
            chunks.append(body)
            if not message.get('more_body', False):
                break
        pending.insert(0, {'type': 'http.request', 'body': b''.join(chunks), 'more_body': False})

        async def replay() -> Message:
            if pending:
                return pending.pop(0)
            return await receive()

        await self.app(scope, replay, send)
