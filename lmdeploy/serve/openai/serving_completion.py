"""``POST /v1/completions``: raw-text (or token-id) prompts, no chat template."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable

from fastapi import Request

from lmdeploy.messages import Response
from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.limits import check_fanout, check_grammar_cost, check_prompt_chars, check_stop
from lmdeploy.serve.openai.logprobs import completion_logprobs, join_logprobs
from lmdeploy.serve.openai.protocol import CompletionChoice, CompletionRequest, CompletionResponse, random_id
from lmdeploy.serve.openai.request_start import admitted
from lmdeploy.serve.openai.serving_common import (ChoiceRun, Job, ServerState, check_model, check_prompt_ids,
                                                  check_session, check_token_ids, choice_config, encode, gen_config,
                                                  run_blocking, usage)
from lmdeploy.serve.openai.streaming import chunk_usage, collect_or_abort, sse, sse_chunk, sse_stream
from lmdeploy.serve.openai.structured import compile_format, requested_format, with_format
from lmdeploy.serve.session_manager import Reservation


def _split_prompts(state: ServerState, prompt: object) -> list[str | list[int]]:
    """Each prompt of a str, a list of str, a list of ids or a list of id lists; token-id prompts are
    checked here (cheap), text ones are only counted."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, 'prompt must not be empty', 'prompt')
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    for p in prompt:
        if isinstance(p, str):
            continue
        check_token_ids(state, p, 'prompt', 'a token-id prompt')
        check_prompt_ids(state, p)
    return prompt


def _check(state: ServerState, req: CompletionRequest) -> list[str | list[int]]:
    """The cheap checks, before admission; returns the prompts."""
    check_model(state, req.model)
    check_grammar_cost(state.limits, *requested_format(req))
    if req.suffix:
        raise APIError(400, 'suffix is not supported by this server', 'suffix', 'unsupported_value')
    if req.best_of is not None and req.best_of < req.n:
        raise APIError(400, f'best_of ({req.best_of}) must be at least n ({req.n})', 'best_of')
    if req.best_of is not None and req.best_of > req.n:
        raise APIError(400, 'best_of greater than n is not supported by this server (it returns every sample: '
                       'send n alone)', 'best_of', 'unsupported_value')
    check_stop(state.limits, req.stop, req.stop_token_ids)
    if isinstance(req.prompt, list) and req.prompt and not all(isinstance(p, int) for p in req.prompt):
        check_fanout(state.limits, req.n, len(req.prompt))
    prompts = _split_prompts(state, req.prompt)
    check_fanout(state.limits, req.n, len(prompts))
    check_prompt_chars(state.limits, sum(len(p) for p in prompts if isinstance(p, str)))
    check_session(state, req.session_id, req.n * len(prompts))
    return prompts


async def _jobs(state: ServerState, req: CompletionRequest, raw_prompts: list[str | list[int]],
                reservations: list[Reservation]) -> tuple[list[Job], list[list[int]], list[str]]:
    """The engine jobs (``n`` per prompt) of an admitted request, each prompt's token ids and, with
    ``echo``, its text; tokenizing runs here, on the executor."""
    prompts = [await encode(state, p, False, 'prompt') if isinstance(p, str) else p for p in raw_prompts]
    fmt, param = requested_format(req)
    jobs = []
    for p, ids in enumerate(prompts):
        config = with_format(gen_config(state, req, len(ids), req.logprobs, req.max_tokens), fmt, None, param)
        if req.echo and req.logprobs is not None:  # the prompt's logprobs come from the request's own prefill
            config = dataclasses.replace(config, prompt_logprobs=req.logprobs)
        await compile_format(state.engine, config, param, state.limits)
        jobs += [Job(p * req.n + i, ids, choice_config(config, i), reservations[p * req.n + i])
                 for i in range(req.n)]
    tokenizer = state.engine.tokenizer
    echoes = [await run_blocking(state, tokenizer.decode, ids, req.skip_special_tokens) if req.echo else ''
              for ids in prompts]
    return jobs, prompts, echoes


def _echo_logprobs(state: ServerState, req: CompletionRequest, prompt_ids: list[int], r: Response) -> dict | None:
    """With ``echo`` and ``logprobs``, the completions-schema logprobs of the prompt's tokens."""
    if r.prompt_logprobs is None:
        return None
    return completion_logprobs(state.engine.tokenizer, prompt_ids, r.prompt_logprobs, req.logprobs or 0, 0,
                               req.skip_special_tokens)


async def create_completion(state: ServerState, req: CompletionRequest, raw: Request):
    """Completes each prompt ``n`` times; choice ``i * n + j`` is prompt ``i``'s ``j``-th."""
    raw_prompts = _check(state, req)
    async with admitted(state, req.n * len(raw_prompts), req.session_id, raw.receive) as request:
        prepared = await request.unless_gone(_jobs(state, req, raw_prompts, request.reservations))
        if prepared is None:
            return None
        jobs, prompts, echoes = prepared
        run = request.start(jobs)
    request_id = random_id('cmpl')
    if req.stream:
        return _stream(state, req, run, request_id, prompts, echoes)
    responses = await collect_or_abort(raw, run)
    if responses is None:
        return None
    top, tokenizer = req.logprobs or 0, state.engine.tokenizer
    choices = []
    for r in responses:
        echo = echoes[r.index // req.n]
        logprobs = completion_logprobs(tokenizer, r.token_ids, r.logprobs, top, len(echo))
        choices.append(CompletionChoice(index=r.index, text=echo + r.text, finish_reason=r.finish_reason,
                                        logprobs=join_logprobs(_echo_logprobs(state, req, prompts[r.index // req.n],
                                                                              r), logprobs)))
    return CompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=usage(responses, req.n))


def _stream(state: ServerState, req: CompletionRequest, run: ChoiceRun, request_id: str,
            prompts: list[list[int]], echoes: list[str]):
    top, tokenizer = req.logprobs or 0, state.engine.tokenizer
    offsets: dict[int, int] = {}
    head = {'id': request_id, 'object': 'text_completion', 'created': int(time.time()), 'model': state.model_name}

    def render(r: Response) -> Iterable[str]:
        text, prefix = '', None
        if r.index not in offsets:
            text, prefix = echoes[r.index // req.n], _echo_logprobs(state, req, prompts[r.index // req.n], r)
            offsets[r.index] = len(text)
        logprobs = completion_logprobs(tokenizer, r.token_ids, r.logprobs, top, offsets[r.index])
        offsets[r.index] += sum(len(t) for t in logprobs['tokens']) if logprobs else 0
        logprobs = join_logprobs(prefix, logprobs)
        text += r.text
        if text or r.token_ids or r.finish_reason:
            yield sse_chunk(head, {'index': r.index, 'text': text, 'logprobs': logprobs,
                                   'finish_reason': r.finish_reason}, chunk_usage(req.stream_options, r))

    async def tail() -> list[str]:
        if not (req.stream_options and req.stream_options.include_usage):
            return []
        return [sse(CompletionResponse(**head, choices=[], usage=usage(run.last.values(), req.n)))]

    return sse_stream(run, render, tail)
