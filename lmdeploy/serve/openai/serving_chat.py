"""``POST /v1/chat/completions``."""
from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from lmdeploy.messages import GenerationConfig, Response
from lmdeploy.serve.reasoning import keep_special_tokens
from lmdeploy.serve.openai.chat_output import ChoiceParser
from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.limits import check_fanout, check_grammar_cost, check_messages, check_stop, text_chars
from lmdeploy.serve.openai.logprobs import chat_logprobs
from lmdeploy.serve.openai.protocol import ChatChoice, ChatCompletionRequest, ChatCompletionResponse, random_id
from lmdeploy.serve.openai.request_start import admitted
from lmdeploy.serve.openai.serving_common import (ChoiceRun, Job, ServerState, check_model, check_session,
                                                  choice_config, gen_config, process, run_blocking, usage)
from lmdeploy.serve.openai.streaming import chunk_usage, collect_or_abort, sse, sse_chunk, sse_stream
from lmdeploy.serve.openai.structured import compile_format, requested_format, with_format
from lmdeploy.serve.openai.tool_choice import ToolPlan, plan_tools, template_messages
from lmdeploy.serve.session_manager import Reservation
from lmdeploy.tokenizer import IncrementalDetokenizer

# What chat_template_kwargs must not set: the arguments of transformers' apply_chat_template itself.
RESERVED_TEMPLATE_KWARGS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
                                     ) - {'self', 'kwargs'} | {'messages'}

ParserFactory = Callable[[], ChoiceParser]


def _check(state: ServerState, req: ChatCompletionRequest) -> ToolPlan:
    """The cheap checks, before admission; returns how the request uses its tools."""
    check_model(state, req.model)
    if req.functions or req.function_call not in (None, 'none'):
        raise APIError(400, 'functions and function_call (OpenAI\'s deprecated form) are not supported: send '
                       'tools and tool_choice', 'functions' if req.functions else 'function_call', 'unsupported_value')
    if any(kind != 'text' for kind in req.modalities or ()):
        raise APIError(400, "this server answers in text only: modalities may hold 'text' alone", 'modalities',
                       'unsupported_value')
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, 'continue_final_message needs add_generation_prompt false', 'continue_final_message')
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, 'top_logprobs requires logprobs to be true', 'top_logprobs')
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & set(req.chat_template_kwargs or ()))
    if reserved:
        raise APIError(400, f'chat_template_kwargs may not set {", ".join(reserved)}', 'chat_template_kwargs')
    plan = plan_tools(req, state.tool_parser, _special_markers(state, req))
    # A forced call's grammar takes the place of a response_format (for the content, which a forced call leaves
    # empty), which is still checked; structured_outputs constrains the whole reply, as the call's grammar does.
    if plan.response_format is not None and requested_format(req)[1] == 'structured_outputs':
        raise APIError(400, "tool_choice 'required' or a named function cannot be combined with structured_outputs",
                       'tool_choice')
    check_grammar_cost(state.limits, *_format(req, plan))
    check_session(state, req.session_id, req.n)
    template_extras = [[t.model_dump(exclude_none=True) for t in req.tools or ()], req.chat_template_kwargs]
    check_messages(state.limits, req.messages, extra_chars=text_chars(template_extras))
    check_stop(state.limits, req.stop, req.stop_token_ids)
    check_fanout(state.limits, req.n, 1)
    return plan


def _special_markers(state: ServerState, req: ChatCompletionRequest) -> frozenset[str]:
    """The parsers' markers that the reply's text would leave out without a parser (see :class:`ToolParser`)."""
    return state.special_markers if req.skip_special_tokens else frozenset()


def _template_kwargs(req: ChatCompletionRequest) -> dict | None:
    """The chat template's arguments: ``reasoning_effort`` (which gpt-oss's template reads), unless
    ``chat_template_kwargs`` sets it, ``chat_template_kwargs``, and vLLM's ``add_generation_prompt`` and
    ``continue_final_message`` where they differ from the defaults."""
    kwargs = {} if req.reasoning_effort is None else {'reasoning_effort': req.reasoning_effort}
    kwargs.update(req.chat_template_kwargs or {})
    if req.continue_final_message or not req.add_generation_prompt:
        kwargs.update(add_generation_prompt=req.add_generation_prompt,
                      continue_final_message=req.continue_final_message)
    return kwargs or None


async def _reasoning_tokens(state: ServerState, parsers: list[ChoiceParser], token_ids: list[list[int]],
                            config: GenerationConfig) -> int | None:
    """The reasoning tokens of all choices (each parser fed its whole reply), counted on the executor (it
    detokenizes the replies token by token); None without a reasoning parser."""
    if state.reasoning_parser is None:
        return None

    def count() -> int:
        return sum(parser.reasoning_tokens(IncrementalDetokenizer(
            state.engine.tokenizer, [], config.skip_special_tokens, config.keep_special_tokens), ids)
            for parser, ids in zip(parsers, token_ids))
    return await run_blocking(state, count)


def _format(req: ChatCompletionRequest, plan: ToolPlan) -> tuple[dict | None, str | None]:
    """The response format of the reply (None: free text) and the request field that asks for it."""
    return (plan.response_format, 'tools') if plan.response_format else requested_format(req)


async def _jobs(state: ServerState, req: ChatCompletionRequest, plan: ToolPlan,
                reservations: list[Reservation]) -> tuple[list[Job], ParserFactory]:
    """The engine jobs of an admitted request, and what makes each choice's reply parser: the chat
    template, tokenization, images and the grammar's compilation run here."""
    messages = template_messages(req.messages, not state.engine.processor.template_holds('developer'))
    prompt = await process(state, messages, 'messages', plan.template_tools,
                           _template_kwargs(req))
    config = gen_config(state, req, len(prompt.input_ids), (req.top_logprobs or 0) if req.logprobs else None, None)
    reasoning = state.reasoning_parser
    config = keep_special_tokens(config, [*(reasoning.markers if reasoning else ()), *plan.markers])

    def make_parser() -> ChoiceParser:
        return ChoiceParser(reasoning(prompt.text) if reasoning else None,
                            plan.make_parser() if plan.make_parser else None, plan.max_calls,
                            _special_markers(state, req))

    fmt, param = _format(req, plan)
    config = with_format(config, fmt, reasoning(prompt.text) if reasoning else None, param)
    await compile_format(state.engine, config, param, state.limits)
    jobs = [Job(i, prompt.input_ids, choice_config(config, i), reservations[i], prompt.multimodal)
            for i in range(req.n)]
    return jobs, make_parser


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    """Answers a chat request, streamed as server-sent events when ``req.stream``."""
    plan = _check(state, req)
    async with admitted(state, req.n, req.session_id, raw.receive) as request:
        prepared = await request.unless_gone(_jobs(state, req, plan, request.reservations))
        if prepared is None:
            return None
        jobs, make_parser = prepared
        run = request.start(jobs)
    request_id, top = random_id('chatcmpl'), req.top_logprobs or 0
    tokenizer = state.engine.tokenizer
    if req.stream:
        return _stream(state, req, run, request_id, top, make_parser, jobs[0].gen_config)
    responses = await collect_or_abort(raw, run)
    if responses is None:
        return None
    choices, parsers = [], [make_parser() for _ in responses]
    for r, parser in zip(responses, parsers):
        choices.append(ChatChoice(index=r.index, message=parser.message(r.text),
                                  finish_reason=parser.finish_reason(r.finish_reason),
                                  logprobs=chat_logprobs(tokenizer, r.token_ids, r.logprobs, top)))
    reasoning = await _reasoning_tokens(state, parsers, [r.token_ids for r in responses], jobs[0].gen_config)
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                  usage=usage(responses, req.n, reasoning))


def _stream(state: ServerState, req: ChatCompletionRequest, run: ChoiceRun, request_id: str, top: int,
            make_parser: ParserFactory, config: GenerationConfig):
    tokenizer = state.engine.tokenizer
    parsers: dict[int, ChoiceParser] = {}
    token_ids: dict[int, list[int]] = {}  # each choice's, for its reasoning tokens
    head = {'id': request_id, 'object': 'chat.completion.chunk', 'created': int(time.time()),
            'model': state.model_name}

    def chunk_of(r: Response, delta: dict, finish_reason: str | None = None, logprobs: dict | None = None,
                 num_tokens: int | None = None) -> str:
        """The chunk of choice ``r.index``; its usage (if asked for) counts ``num_tokens`` (default: ``r``'s)."""
        counted = r if num_tokens is None else Response('', num_tokens, r.input_token_len,
                                                         cached_tokens=r.cached_tokens)
        return sse_chunk(head, {'index': r.index, 'message': None, 'delta': delta, 'logprobs': logprobs,
                                'finish_reason': finish_reason}, chunk_usage(req.stream_options, counted))

    def render(r: Response) -> Iterable[str]:
        parser = parsers.get(r.index)
        if parser is None:
            parser = parsers[r.index] = make_parser()
            token_ids[r.index] = []
            yield chunk_of(r, {'role': 'assistant', 'content': ''}, num_tokens=0)
        token_ids[r.index] += r.token_ids
        delta = parser.feed(r.text, final=r.finish_reason is not None)
        logprobs = chat_logprobs(tokenizer, r.token_ids, r.logprobs, top)
        if delta or r.finish_reason or logprobs is not None:
            yield chunk_of(r, parser.delta_body(delta), parser.finish_reason(r.finish_reason), logprobs)

    async def tail() -> list[str]:
        if not (req.stream_options and req.stream_options.include_usage):
            return []
        indexes = sorted(parsers)
        reasoning = await _reasoning_tokens(state, [parsers[i] for i in indexes], [token_ids[i] for i in indexes],
                                            config)
        return [sse(ChatCompletionResponse(**head, choices=[], usage=usage(run.last.values(), req.n, reasoning)))]

    return sse_stream(run, render, tail)
