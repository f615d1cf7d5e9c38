"""``POST /v1/chat/completions``."""
from __future__ import annotations

import time
from collections.abc import Iterable

from fastapi import Request
from fastapi.responses import StreamingResponse

from lmdeploy.messages import Response
from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.limits import check_fanout, check_messages, check_stop
from lmdeploy.serve.openai.logprobs import chat_logprobs
from lmdeploy.serve.openai.protocol import (ChatChoice, ChatCompletionRequest, ChatCompletionResponse, ChatMessage,
                                            random_id)
from lmdeploy.serve.openai.serving_common import (ChoiceRun, Job, ServerState, admit, check_model, check_session,
                                                  choice_config, collect_or_abort, gen_config, process,
                                                  raise_for_error, sse, sse_chunk, sse_stream, start_run,
                                                  usage)


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.response_format is not None and req.response_format.type != 'text':
        raise APIError(400, f'response_format {req.response_format.type!r} is not supported (no guided decoding); '
                       "only 'text' is", 'response_format.type', 'unsupported_value')
    if req.tools:
        raise APIError(400, 'tools are not supported by this server', 'tools', 'unsupported_value')
    if req.tool_choice not in (None, 'none'):
        raise APIError(400, 'tool_choice is not supported by this server', 'tool_choice', 'unsupported_value')
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, 'top_logprobs requires logprobs to be true', 'top_logprobs')


def _check(state: ServerState, req: ChatCompletionRequest) -> None:
    """The cheap checks, before admission."""
    check_model(state, req.model)
    _check_unsupported(req)
    check_session(state, req.session_id, req.n)
    check_messages(state.limits, req.messages)
    check_stop(state.limits, req.stop, req.stop_token_ids)
    check_fanout(state.limits, req.n, 1)


async def _jobs(state: ServerState, req: ChatCompletionRequest) -> list[Job]:
    """The engine jobs of an admitted request: the chat template, tokenization and images run here."""
    prompt = await process(state, req.messages, 'messages')
    config = gen_config(state, req, len(prompt.input_ids), (req.top_logprobs or 0) if req.logprobs else None, None)
    return [Job(i, prompt.input_ids, choice_config(config, i), req.session_id, prompt.multimodal)
            for i in range(req.n)]


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    """Answers a chat request, streamed as server-sent events when ``req.stream``."""
    _check(state, req)
    ticket = await admit(state, req.n)
    try:
        run = start_run(state, ticket, await _jobs(state, req))
    except BaseException:
        ticket.release()
        raise
    request_id, top = random_id('chatcmpl'), req.top_logprobs or 0
    tokenizer = state.engine.tokenizer
    if req.stream:
        return StreamingResponse(_stream(state, req, run, request_id, top), media_type='text/event-stream')
    responses = await collect_or_abort(raw, run)
    if responses is None:
        return None
    raise_for_error(run, responses)
    choices = [ChatChoice(index=r.index, message=ChatMessage(content=r.text), finish_reason=r.finish_reason,
                          logprobs=chat_logprobs(tokenizer, r.token_ids, r.logprobs, top)) for r in responses]
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=usage(responses, req.n))


def _stream(state: ServerState, req: ChatCompletionRequest, run: ChoiceRun, request_id: str, top: int):
    tokenizer = state.engine.tokenizer
    started: set[int] = set()
    head = {'id': request_id, 'object': 'chat.completion.chunk', 'created': int(time.time()),
            'model': state.model_name}

    def chunk_of(index: int, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None) -> str:
        return sse_chunk(head, {'index': index, 'message': None, 'delta': delta, 'logprobs': logprobs,
                                'finish_reason': finish_reason})

    def render(r: Response) -> Iterable[str]:
        if r.index not in started:
            started.add(r.index)
            yield chunk_of(r.index, {'role': 'assistant', 'content': ''})
        if r.text or r.token_ids or r.finish_reason:
            yield chunk_of(r.index, {'role': None, 'content': r.text}, r.finish_reason,
                           chat_logprobs(tokenizer, r.token_ids, r.logprobs, top))

    def tail() -> Iterable[str]:
        if req.stream_options and req.stream_options.include_usage:
            yield sse(ChatCompletionResponse(**head, choices=[], usage=usage(run.last.values(), req.n)))

    return sse_stream(run, render, tail)
