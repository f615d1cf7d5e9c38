"""What the chat, completion and native handlers share: request checks, generation config, running the choices
of one request, and usage (admitting and starting one is in :mod:`.request_start`, streaming it in
:mod:`.streaming`)."""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TypeVar

from lmdeploy.messages import MAX_NEW_TOKENS_LIMIT, GenerationConfig, Response
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.serve.openai.admission import Admission
from lmdeploy.serve.openai.errors import APIError, from_safe_run
from lmdeploy.serve.openai.limits import RequestLimits
from lmdeploy.serve.openai.metrics import Metrics
from lmdeploy.serve.openai.protocol import CompletionTokensDetails, PromptTokensDetails, SamplingFields, UsageInfo
from lmdeploy.serve.openai.reasoning_parsers import ReasoningParser
from lmdeploy.serve.openai.tool_parsers import ToolParser
from lmdeploy.serve.session_manager import Reservation
from lmdeploy.vl.processor import ProcessedPrompt, PromptTooLong

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
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    # What a chat or completion request that leaves a sampling field out gets (see sampling_defaults).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # The parsers' markers that the served tokenizer makes special tokens (see ToolParser.special_markers).
    special_markers: frozenset[str] = frozenset()


SAMPLING_FIELDS = ('temperature', 'top_p', 'top_k', 'min_p', 'repetition_penalty')


def sampling_defaults(model_dir: str) -> dict[str, float]:
    """The sampling fields the model's ``generation_config.json`` sets (vLLM's ``--generation-config auto``)."""
    path = os.path.join(model_dir, 'generation_config.json')
    if not os.path.isfile(path):
        return {}
    with open(path, encoding='utf-8') as f:
        config = json.load(f)
    return {name: config[name] for name in SAMPLING_FIELDS if isinstance(config.get(name), (int, float))}


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
    reservation: Reservation  # its session, taken on arrival (see :func:`.request_start.admitted`)
    multimodal: list[MultiModalInput] = field(default_factory=list)


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(404, f'the model {model!r} does not exist; this server serves {state.model_name!r}',
                       'model', 'model_not_found')


def check_token_ids(state: ServerState, ids: list[int], param: str, what: str) -> None:
    """``ids`` (``what`` they are, for the error) must be non-empty and in the model's vocabulary."""
    vocab = state.engine.vocab_size
    if not ids or not all(0 <= t < vocab for t in ids):
        raise APIError(400, f'{what} must be a non-empty list of token ids in [0, {vocab})', param)


def check_prompt_ids(state: ServerState, input_ids: list[int], param: str = 'prompt') -> None:
    limit = state.engine.session_len
    if len(input_ids) >= limit:
        raise APIError(400, f'the prompt has {len(input_ids)} tokens, but the context limit (session_len) is '
                       f'{limit} tokens, output included; shorten the prompt', param, 'context_length_exceeded')


def check_session(state: ServerState, session_id: int | None, n: int) -> None:
    """An explicit ``session_id`` must serve a single choice (:func:`.request_start.reserve` checks that it is free)."""
    if session_id is not None and n > 1:
        raise APIError(400, 'session_id cannot be combined with n > 1', 'session_id')


async def encode(state: ServerState, prompt: object, do_preprocess: bool, param: str) -> list[int]:
    """Token ids of a text prompt (tokenized on the executor); bad input is a 400 about ``param``."""
    try:
        ids = await run_blocking(state, state.engine.encode, prompt, do_preprocess)
    except SafeRunException as exc:
        raise APIError(400, exc.message, param, exc.code.value[0]) from exc
    check_prompt_ids(state, ids, param)
    return ids


async def process(state: ServerState, messages: object, param: str, tools: list[dict] | None = None,
                  template_kwargs: dict | None = None, do_preprocess: bool = True) -> ProcessedPrompt:
    """Token ids and images of chat messages, made on the executor (chat template with ``tools`` and
    ``template_kwargs``, tokenizer, image fetch and preprocessing); bad input (bad images included) is a
    400 about ``param``, one too long for ``session_len`` before its images are preprocessed where their headers
    tell. Cancelled (its client gone), it stops the executor's work before the next image."""
    stop = threading.Event()
    try:
        prompt = await run_blocking(state, state.engine.processor.process, messages, do_preprocess, tools,
                                    template_kwargs, stop, state.engine.session_len)
    except PromptTooLong as exc:
        raise APIError(400, str(exc), param, 'context_length_exceeded') from exc
    except ValueError as exc:
        raise APIError(400, str(exc), param, ErrorCode.INVALID_ARGUMENT.value[0]) from exc
    finally:
        stop.set()
    check_prompt_ids(state, prompt.input_ids, param)
    return prompt


def gen_config(state: ServerState, req: SamplingFields, num_prompt_tokens: int, logprobs: int | None,
               default_max_tokens: int | None, model_defaults: bool = True) -> GenerationConfig:
    """The :class:`GenerationConfig` of a request; invalid values are a 400. With ``model_defaults``, the
    sampling fields the request leaves out take the values of ``state.sampling_defaults``."""
    if model_defaults:
        unset = {k: v for k, v in state.sampling_defaults.items() if k not in req.model_fields_set}
        req = req.model_copy(update=unset)
    unsupported = req.unsupported_fields()
    if unsupported:
        raise APIError(400, f'{", ".join(unsupported)} (vLLM\'s) not supported by this server', unsupported[0],
                       'unsupported_value')
    if req.stream_options is not None and not req.stream:
        raise APIError(400, 'stream_options is only allowed when stream is true', 'stream_options')
    max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
    max_tokens = max_tokens or max(1, min(state.engine.session_len - num_prompt_tokens, MAX_NEW_TOKENS_LIMIT))
    bias = None
    if req.logit_bias:
        if not all(k.isascii() and k.isdigit() for k in req.logit_bias):
            raise APIError(400, 'logit_bias keys must be token ids (decimal digits)', 'logit_bias')
        # No token id has more digits than the vocabulary's size (and int() refuses over 4300 of them).
        digits = len(str(state.engine.vocab_size))
        if any(len(k.lstrip('0')) > digits for k in req.logit_bias):
            raise APIError(400, f'the keys of logit_bias must be token ids in [0, {state.engine.vocab_size})',
                           'logit_bias')
        bias = {int(k): float(v) for k, v in req.logit_bias.items()}
        check_token_ids(state, list(bias), 'logit_bias', 'the keys of logit_bias')
        if not all(-100 <= v <= 100 for v in bias.values()):
            raise APIError(400, 'logit_bias values must be in [-100, 100]', 'logit_bias')
    if req.stop_token_ids:
        check_token_ids(state, req.stop_token_ids, 'stop_token_ids', 'stop_token_ids')
    if req.min_tokens > max_tokens:
        raise APIError(400, f'min_tokens ({req.min_tokens}) exceeds max_tokens ({max_tokens})', 'min_tokens')
    try:
        return GenerationConfig(
            max_new_tokens=max_tokens, do_sample=req.temperature > 0, temperature=req.temperature, top_p=req.top_p,
            top_k=max(req.top_k, 0), min_p=req.min_p, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, logit_bias=bias,
            random_seed=req.seed, stop_words=req.stop or None,
            include_stop_str_in_output=req.include_stop_str_in_output, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, min_new_tokens=req.min_tokens, skip_special_tokens=req.skip_special_tokens,
            logprobs=logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


def choice_config(config: GenerationConfig, choice: int) -> GenerationConfig:
    """The config of the ``choice``-th of n samples: its own seed, so that seeded choices differ (seeds are
    taken modulo 2**64, as torch takes them)."""
    if config.random_seed is None or choice == 0:
        return config
    return GenerationConfig(**{**config.__dict__, 'random_seed': (config.random_seed + choice) % 2 ** 64})


class ChoiceRun:
    """Runs the jobs of one client request concurrently, holding one admission slot until all end.

    Iterating yields every chunk (``Response.index`` is the job's index) until each job gave its one final
    chunk (one with a finish_reason), which it always does, also when its task is cancelled before it ran;
    :meth:`batches` yields the chunks ready at once together. ``last`` keeps each job's latest chunk (its
    counts are totals), ``error_code`` says why a job failed; :meth:`close` aborts what still runs and waits
    until the engine let go of it (idempotent).
    """

    def __init__(self, state: ServerState, jobs: list[Job]):
        self.state = state
        self.queue: asyncio.Queue[Response] = asyncio.Queue()
        self.num_jobs = len(jobs)
        self.error_codes: dict[int, ErrorCode] = {}
        self.last: dict[int, Response] = {}
        self._final: dict[int, Response] = {}
        self._first_token: dict[int, float] = {}
        self._pending = len(jobs)
        self._start = time.perf_counter()
        self.tasks = []
        for job in jobs:
            task = asyncio.create_task(self._produce(job))
            task.add_done_callback(functools.partial(self._job_done, job))
            self.tasks.append(task)

    async def _produce(self, job: Job) -> None:
        """Streams one job's chunks into the queue and ends it with a final chunk whatever happens."""
        last = None
        try:
            async for chunk in self.state.engine.generate(gen_config=job.gen_config, input_ids=job.input_ids,
                                                          multimodal=job.multimodal, reservation=job.reservation):
                if chunk.token_ids:
                    self._first_token.setdefault(job.index, time.perf_counter())
                chunk.index, last = job.index, chunk
                self._put(chunk)
        except SafeRunException as exc:
            self._end(job, last, 'error', exc.message, exc.code)
        except Exception as exc:
            logger.exception('request choice %d failed', job.index)
            self._end(job, last, 'error', f'{type(exc).__name__}: {exc}', ErrorCode.ENGINE_ERROR)
        finally:
            self._end(job, last, 'abort', 'the request was stopped before it finished', ErrorCode.ABORTED)

    def _job_done(self, job: Job, _: asyncio.Task) -> None:
        """Runs when a job's task ends, also one cancelled before it started (its body never ran): the job
        gets its final chunk, the run its admission slots back once all jobs are done."""
        final = self._end(job, None, 'abort', 'the request was stopped before it started', ErrorCode.ABORTED)
        if job.reservation is not None:
            self.state.engine.release(job.reservation)
        self._pending -= 1
        if self._pending == 0:
            self.state.admission.release()
        self.state.metrics.observe(final.finish_reason, final.input_token_len, final.generate_token_len, self._start,
                                   self._first_token.get(job.index), time.perf_counter())

    def _put(self, chunk: Response) -> None:
        if chunk.finish_reason is not None:
            self._final[chunk.index] = chunk
        self.queue.put_nowait(chunk)

    def _end(self, job: Job, last: Response | None, reason: str, message: str, code: ErrorCode) -> Response:
        """Puts the final chunk of a job that has none yet (its counts stay those of ``last``); returns the
        job's final chunk."""
        if job.index in self._final:
            return self._final[job.index]
        self.error_codes[job.index] = code
        chunk = Response('', last.generate_token_len if last else 0, len(job.input_ids), reason, index=job.index,
                         cached_tokens=last.cached_tokens if last else 0, error=message)
        self._put(chunk)
        return chunk

    async def batches(self) -> AsyncIterator[list[Response]]:
        """The chunks in arrival order, those ready at once in one list, until every job ended."""
        finished = 0
        while finished < self.num_jobs:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            for chunk in batch:
                finished += chunk.finish_reason is not None
                self.last[chunk.index] = chunk
            yield batch

    async def __aiter__(self) -> AsyncIterator[Response]:
        async for batch in self.batches():
            for chunk in batch:
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


def raise_for_error(run: ChoiceRun, responses: Iterable[Response]) -> None:
    """Turns the first failed choice into an :class:`APIError`."""
    for r in responses:
        if r.finish_reason == 'error':
            raise from_safe_run(SafeRunException(run.error_code(r.index), r.error or 'the engine failed'))


def usage(responses: Iterable[Response], n: int, reasoning_tokens: int | None = None) -> UsageInfo:
    """Usage over all choices; the prompt of each group of ``n`` choices counts once. ``reasoning_tokens``
    (those of all choices) goes in ``completion_tokens_details`` when given."""
    responses = list(responses)
    prompts = [r for r in responses if r.index % n == 0]
    prompt_tokens = sum(r.input_token_len for r in prompts)
    completion = sum(r.generate_token_len for r in responses)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion,
                     total_tokens=prompt_tokens + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.cached_tokens for r in prompts)),
                     completion_tokens_details=None if reasoning_tokens is None else CompletionTokensDetails(
                         reasoning_tokens=reasoning_tokens))
