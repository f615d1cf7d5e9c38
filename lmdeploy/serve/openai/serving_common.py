"""What the chat, completion and native handlers share: request checks, generation config, running
the choices of one request, disconnect handling, SSE framing and usage."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TypeVar

import anyio
from fastapi import Request
from pydantic import BaseModel

from lmdeploy.messages import MAX_NEW_TOKENS_LIMIT, GenerationConfig, Response
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.serve.openai.admission import Admission, Ticket
from lmdeploy.serve.openai.errors import APIError, error_body, from_safe_run
from lmdeploy.serve.openai.limits import RequestLimits
from lmdeploy.serve.openai.metrics import Metrics
from lmdeploy.serve.openai.protocol import PromptTokensDetails, SamplingFields, UsageInfo
from lmdeploy.vl.processor import ProcessedPrompt

logger = logging.getLogger('lmdeploy')


@dataclass
class ServerState:
    """Everything the handlers of one app need."""

    engine: AsyncEngine
    model_name: str
    admission: Admission
    metrics: Metrics
    heartbeat_timeout: float = 30.0
    limits: RequestLimits = field(default_factory=RequestLimits)
    # Where tokenization and image preprocessing run, off the event loop (None: the loop's default).
    executor: Executor | None = None


T = TypeVar('T')


async def run_blocking(state: ServerState, fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` on the server's preprocessing executor; only admitted requests get here, so its
    queue is bounded by admission."""
    return await asyncio.get_running_loop().run_in_executor(state.executor, fn, *args)


@dataclass
class Job:
    """One engine request: choice ``index`` of a client request."""

    index: int
    input_ids: list[int]
    gen_config: GenerationConfig
    session_id: int | None = None
    multimodal: list[MultiModalInput] = field(default_factory=list)


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f'the model {model!r} does not exist; this server serves {state.model_name!r}',
                       'model', 'model_not_found')


def check_prompt_ids(state: ServerState, input_ids: list[int], param: str = 'prompt') -> None:
    limit = state.engine.session_len
    if len(input_ids) >= limit:
        raise APIError(400, f'the prompt has {len(input_ids)} tokens, but the context limit (session_len) is '
                       f'{limit} tokens, output included; shorten the prompt', param, 'context_length_exceeded')


def check_session(state: ServerState, session_id: int | None, n: int) -> None:
    """An explicit ``session_id`` must be free and serve a single choice."""
    if session_id is None:
        return
    if n > 1:
        raise APIError(400, 'session_id cannot be combined with n > 1', 'session_id')
    session = state.engine.session_manager.get(session_id)
    if session is not None and session.request is not None:
        raise APIError(400, f'session {session_id} already has a request running', 'session_id', 'session_occupied')


async def encode(state: ServerState, prompt: object, do_preprocess: bool, param: str) -> list[int]:
    """Token ids of a text prompt (tokenized on the executor); bad input is a 400 about ``param``."""
    try:
        ids = await run_blocking(state, state.engine.encode, prompt, do_preprocess)
    except SafeRunException as exc:
        raise APIError(400, exc.message, param, exc.code.value[0]) from exc
    check_prompt_ids(state, ids, param)
    return ids


async def process(state: ServerState, messages: object, param: str) -> ProcessedPrompt:
    """Token ids and images of chat messages, made on the executor (chat template, tokenizer, image fetch
    and preprocessing); bad input (bad images included) is a 400 about ``param``."""
    try:
        prompt = await run_blocking(state, state.engine.processor.process, messages, True)
    except ValueError as exc:
        raise APIError(400, str(exc), param, ErrorCode.INVALID_ARGUMENT.value[0]) from exc
    check_prompt_ids(state, prompt.input_ids, param)
    return prompt


def gen_config(state: ServerState, req: SamplingFields, num_prompt_tokens: int, logprobs: int | None,
               default_max_tokens: int | None) -> GenerationConfig:
    """The :class:`GenerationConfig` of a request; invalid values are a 400."""
    if req.stream_options is not None and not req.stream:
        raise APIError(400, 'stream_options is only allowed when stream is true', 'stream_options')
    max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
    max_tokens = max_tokens or max(1, min(state.engine.session_len - num_prompt_tokens, MAX_NEW_TOKENS_LIMIT))
    vocab = state.engine.engine.model_config.vocab_size
    bias = None
    if req.logit_bias:
        try:
            bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        except ValueError as exc:
            raise APIError(400, 'logit_bias keys must be token ids', 'logit_bias') from exc
        if not all(0 <= k < vocab and -100 <= v <= 100 for k, v in bias.items()):
            raise APIError(400, f'logit_bias maps token ids in [0, {vocab}) to values in [-100, 100]', 'logit_bias')
    if req.stop_token_ids and max(req.stop_token_ids) >= vocab:
        raise APIError(400, f'stop_token_ids must be in [0, {vocab})', 'stop_token_ids')
    if req.min_tokens > max_tokens:
        raise APIError(400, f'min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})', 'min_tokens')
    try:
        return GenerationConfig(
            max_new_tokens=max_tokens, do_sample=req.temperature > 0, temperature=req.temperature, top_p=req.top_p,
            top_k=max(req.top_k, 0), min_p=req.min_p, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logit_bias=bias,
            random_seed=req.seed, stop_words=req.stop or None, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, min_new_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def choice_config(config: GenerationConfig, choice: int) -> GenerationConfig:
    """The config of the ``choice``-th of n samples: its own seed, so that seeded choices differ."""
    if config.random_seed is None or choice == 0:
        return config
    return GenerationConfig(**{**config.__dict__, 'random_seed': config.random_seed + choice})


class ChoiceRun:
    """Runs the jobs of one client request concurrently, holding one admission slot until all end.

    Iterating yields every chunk (``Response.index`` is the job's index) until all jobs finished;
    ``last`` keeps each job's latest chunk (its counts are totals), ``error_code`` says why a job failed;
    :meth:`close` aborts what still runs and waits until the engine let go of it (idempotent).
    """

    def __init__(self, state: ServerState, jobs: list[Job]):
        self.state = state
        self.queue: asyncio.Queue[Response] = asyncio.Queue()
        self.num_jobs = len(jobs)
        self.tasks = [asyncio.create_task(self._produce(job)) for job in jobs]
        self._pending = len(jobs)
        self.error_codes: dict[int, ErrorCode] = {}
        self.last: dict[int, Response] = {}

    async def _produce(self, job: Job) -> None:
        """Streams one job's chunks into the queue; whatever happens, its last chunk has a finish_reason."""
        start, first, last = time.perf_counter(), None, None
        try:
            async for chunk in self.state.engine.generate(session_id=job.session_id, gen_config=job.gen_config,
                                                          input_ids=job.input_ids, multimodal=job.multimodal):
                if first is None and chunk.token_ids:
                    first = time.perf_counter()
                chunk.index, last = job.index, chunk
                self.queue.put_nowait(chunk)
        except SafeRunException as exc:
            last = self._end(job, last, 'error', exc.message, exc.code)
        except Exception as exc:
            logger.exception('request choice %d failed', job.index)
            last = self._end(job, last, 'error', f'{type(exc).__name__}: {exc}', ErrorCode.ENGINE_ERROR)
        finally:
            if last is not None and last.finish_reason is None:  # cancelled (or killed) while it streamed
                last = self._end(job, last, 'abort', 'the request was stopped before it finished', ErrorCode.ABORTED)
            elif last is None:  # cancelled before its first chunk: the consumer still gets an end
                self._end(job, None, 'abort', 'the request was stopped before it started', ErrorCode.ABORTED)
            if last is not None:
                self.state.metrics.observe(last.finish_reason, last.input_token_len, last.generate_token_len, start,
                                           first, time.perf_counter())
            self._pending -= 1
            if self._pending == 0:
                self.state.admission.release()

    def _end(self, job: Job, last: Response | None, reason: str, message: str, code: ErrorCode) -> Response:
        """Puts the final chunk of a job whose producer stopped without one (its counts stay those of ``last``)."""
        self.error_codes[job.index] = code
        chunk = Response('', last.generate_token_len if last else 0, len(job.input_ids), reason, index=job.index,
                         cached_tokens=last.cached_tokens if last else 0, error=message)
        self.queue.put_nowait(chunk)
        return chunk

    async def __aiter__(self) -> AsyncIterator[Response]:
        finished = 0
        while finished < self.num_jobs:
            chunk = await self.queue.get()
            finished += chunk.finish_reason is not None
            self.last[chunk.index] = chunk
            yield chunk

    def error_code(self, index: int) -> ErrorCode:
        return self.error_codes.get(index, ErrorCode.ENGINE_ERROR)

    async def collect(self) -> list[Response]:
        """The merged response of every job, in index order."""
        totals = {}
        async for chunk in self:
            totals.setdefault(chunk.index, Response('', 0, 0, index=chunk.index)).extend(chunk)
        return [totals[i] for i in sorted(totals)]

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def admit(state: ServerState, slots: int) -> Ticket:
    """Waits for ``slots`` admission slots (one per engine request); raises 429 when the server is full
    and 400 when it could never hold them. Cheap checks go before, heavy work (tokenization, images)
    after it."""
    return await state.admission.acquire(slots)


def start_run(state: ServerState, ticket: Ticket, jobs: list[Job]) -> ChoiceRun:
    """Starts the jobs of an admitted request; the run gives the ticket's slots back when all end."""
    return ChoiceRun(dataclasses.replace(state, admission=ticket), jobs)


async def _wait_disconnect(request: Request, interval: float = 0.1) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(interval)


async def collect_or_abort(request: Request, run: ChoiceRun) -> list[Response] | None:
    """Collects a non-streaming run; returns None (after aborting it) if the client goes away first."""
    collect = asyncio.create_task(run.collect())
    watch = asyncio.create_task(_wait_disconnect(request))
    try:
        await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        if collect.done():
            return collect.result()
        return None
    finally:
        watch.cancel()
        collect.cancel()
        await run.close()


def raise_for_error(run: ChoiceRun, responses: Iterable[Response]) -> None:
    """Turns the first failed choice into an :class:`APIError`."""
    for r in responses:
        if r.finish_reason == 'error':
            raise from_safe_run(SafeRunException(run.error_code(r.index), r.error or 'the engine failed'))


def sse(data: BaseModel | dict) -> str:
    body = data.model_dump_json(exclude_unset=False) if isinstance(data, BaseModel) else json.dumps(data)
    return f'data: {body}\n\n'


def sse_chunk(head: dict, choice: dict) -> str:
    """The event of one streamed chunk: ``head`` (id, object, created, model) with ``choice`` and no usage,
    serialised as its pydantic model would be, without building one (this runs for every token)."""
    body = json.dumps({**head, 'choices': [choice], 'usage': None}, ensure_ascii=False, separators=(',', ':'))
    return f'data: {body}\n\n'


async def sse_stream(run: ChoiceRun, render: Callable[[Response], Iterable[str]],
                     tail: Callable[[], Iterable[str]]) -> AsyncIterator[str]:
    """Server-sent events of a run: ``render`` each chunk, then ``tail``, then ``[DONE]``; an engine error
    becomes an error event. Leaving early (client gone) aborts the run."""
    try:
        async for chunk in run:
            if chunk.finish_reason == 'error':
                code = run.error_code(chunk.index)
                yield sse(error_body(code.http_status, chunk.error or 'the engine failed', code=code.value[0]))
                continue
            for event in render(chunk):
                yield event
        for event in tail():
            yield event
        yield 'data: [DONE]\n\n'
    finally:
        with anyio.CancelScope(shield=True):
            await run.close()


def usage(responses: Iterable[Response], n: int) -> UsageInfo:
    """Usage over all choices; the prompt of each group of ``n`` choices counts once."""
    responses = list(responses)
    prompts = [r for r in responses if r.index % n == 0]
    prompt_tokens = sum(r.input_token_len for r in prompts)
    completion = sum(r.generate_token_len for r in responses)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in prompts)))
