"""Streaming a run to its client and watching for the client to go: server-sent events, and the
collection of a non-streaming run that ends as soon as its client has gone."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from lmdeploy.messages import Response
from lmdeploy.serve.openai.errors import error_body
from lmdeploy.serve.openai.request_start import wait_disconnect
from lmdeploy.serve.openai.protocol import StreamOptions
from lmdeploy.serve.openai.serving_common import ChoiceRun, raise_for_error, usage

logger = logging.getLogger('lmdeploy')


async def collect_or_abort(request: Request, run: ChoiceRun) -> list[Response] | None:
    """Collects a non-streaming run, raising its first failed choice's error; returns None (after aborting
    the run) if the client goes away first."""
    collect = asyncio.create_task(run.collect())
    watch = asyncio.create_task(wait_disconnect(request.receive))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        if collect.done():
            responses = collect.result()
            raise_for_error(run, responses)
            return responses
        watch.result()  # a watch that failed is a server error, not a client that went away
        return None
    finally:
        watch.cancel()
        collect.cancel()
        await run.close()


# JSON leaves U+0085, U+2028 and U+2029 raw, but clients that split lines as str.splitlines does (httpx's
# aiter_lines) break an event there: escaped, every event stays one line.
_LINE_BREAKS = str.maketrans({'\x85': '\\u0085', '\u2028': '\\u2028', '\u2029': '\\u2029'})


def _event(body: str) -> str:
    return f'data: {body.translate(_LINE_BREAKS)}\n\n'


def sse(data: BaseModel | dict) -> str:
    """The event of a pydantic model or a dict."""
    return _event(data.model_dump_json(exclude_unset=False) if isinstance(data, BaseModel) else json.dumps(data))


def sse_chunk(head: dict, choice: dict, usage_body: dict | None = None) -> str:
    """The event of one streamed chunk: ``head`` (id, object, created, model) with ``choice`` and ``usage_body``,
    serialised as its pydantic model would be, without building one (this runs for every token)."""
    return _event(json.dumps({**head, 'choices': [choice], 'usage': usage_body}, ensure_ascii=False,
                             separators=(',', ':')))


def chunk_usage(stream_options: StreamOptions | None, chunk: Response) -> dict | None:
    """With ``stream_options.continuous_usage_stats`` (and ``include_usage``), the usage so far of ``chunk``'s
    choice, which every chunk of a stream carries (vLLM's extension); else None."""
    if not (stream_options and stream_options.include_usage and stream_options.continuous_usage_stats):
        return None
    return usage([chunk], 1).model_dump()


class EventStream(StreamingResponse):
    """The server-sent events of a run. The events of all chunks ready at once go out in one write; the
    stream stops when the client goes away (or at the first failed write), and however it ends, also when
    it never started, the run is closed: what still runs is aborted and its KV blocks are freed."""

    def __init__(self, run: ChoiceRun, events: AsyncIterator[str]):
        super().__init__(events, media_type='text/event-stream')
        self.run = run

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def watch() -> None:
                    await wait_disconnect(receive)
                    group.cancel_scope.cancel()

                group.start_soon(watch)
                await self._write(send)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.run.close()

    async def _write(self, send: Send) -> None:
        try:
            await send({'type': 'http.response.start', 'status': self.status_code, 'headers': self.raw_headers})
            async for text in self.body_iterator:
                await send({'type': 'http.response.body', 'body': text.encode(), 'more_body': True})
            await send({'type': 'http.response.body', 'body': b'', 'more_body': False})
        except OSError:  # a server that reports the failed write of a client that has gone
            logger.debug('stream stopped: the client has gone')


Tail = Callable[[], Awaitable[Iterable[str]]]


def sse_stream(run: ChoiceRun, render: Callable[[Response], Iterable[str]], tail: Tail | None = None) -> EventStream:
    """The response streaming a run: ``render`` each chunk, then the events of ``tail`` (awaited once every
    chunk is out), then ``[DONE]``; an engine error becomes an error event."""
    return EventStream(run, _events(run, render, tail))


async def _events(run: ChoiceRun, render: Callable[[Response], Iterable[str]],
                  tail: Tail | None) -> AsyncIterator[str]:
    """The text of the events of each batch of chunks (see :meth:`ChoiceRun.batches`), then of the tail."""
    async for batch in run.batches():
        events = []
        for chunk in batch:
            if chunk.finish_reason == 'error':
                code = run.error_code(chunk.index)
                events.append(sse(error_body(code.http_status, chunk.error or 'the engine failed', code=code.value[0])))
            else:
                events.extend(render(chunk))
        if events:
            yield ''.join(events)
    yield ''.join([*(await tail() if tail else ()), 'data: [DONE]\n\n'])
