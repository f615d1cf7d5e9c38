"""``AsyncEngine``: the request lifecycle (sessions, admission, streaming, abort) over the PyTorch engine."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import hmac
import json
import os
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from lmdeploy.model_source import model_name
from lmdeploy.messages import ChatTemplateConfig, EngineOutput, GenerationConfig, PytorchEngineConfig, Response
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.grammar_worker import GrammarJob, GrammarProcessPool, GrammarWorkerDied
from lmdeploy.pytorch.engine.guided import Grammar
from lmdeploy.serve.engine_loop import EngineLoop
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.serve.inst_manager import InferInstManager
from lmdeploy.serve.openai.reasoning_parsers import ReasoningParser
from lmdeploy.serve.reasoning import ReasoningCounter, ReasoningSplitter, assistant_message, for_parser
from lmdeploy.serve.session_manager import Reservation, Session, SessionManager
from lmdeploy.tokenizer import IncrementalDetokenizer
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.vl.image_inputs import ImageInputs
from lmdeploy.vl.media import MediaPolicy
from lmdeploy.vl.processor import MultiModalProcessor, ProcessedPrompt, Prompt, PromptTooLong

T = TypeVar('T')

# Who makes the requests started in this context (the server sets it to an id of the caller's API key):
# a request remembers its owner, and :meth:`AsyncEngine.abort_session` with an ``owner`` aborts only
# that owner's requests. None: no owner (the Python API, a server without keys).
request_owner: contextvars.ContextVar[str | None] = contextvars.ContextVar('lmdeploy_request_owner', default=None)
# Grammars compile in worker processes (at most this many at once), each driven by a thread of its own, so that
# formats slow to compile never hold the threads of the event loop's default executor, and can be stopped.
GRAMMAR_COMPILE_THREADS = 2


@dataclass
class _Compile:
    """A grammar compile and the number of requests waiting for it."""

    job: GrammarJob
    waiters: int = 0


def _to_response(out: EngineOutput) -> Response:
    return Response(out.text, out.num_output_tokens, out.num_prompt_tokens, out.finish_reason, out.token_ids,
                    out.logprobs, 0, out.num_cached_tokens, out.error, out.prompt_logprobs)


def _check_arguments(model_path: object, backend_config: object, chat_template_config: object) -> None:
    """A ``TypeError`` that says what to pass, before anything loads (a dict of settings failed deep in the
    engine as ``'dict' object has no attribute 'device'``)."""
    if model_path is not None and not isinstance(model_path, (str, os.PathLike)):
        raise TypeError(f'model_path must be a path (str) or None for the default model, got '
                        f'{type(model_path).__name__}')
    for name, value, kind in (('backend_config', backend_config, PytorchEngineConfig),
                              ('chat_template_config', chat_template_config, ChatTemplateConfig)):
        if value is not None and not isinstance(value, kind):
            hint = f'; for a dict d, pass {kind.__name__}(**d)' if isinstance(value, dict) else ''
            raise TypeError(f'{name} must be a {kind.__name__} or None, got {type(value).__name__}{hint}')


class AsyncEngine:
    """Serves prompts from asyncio code, from any number of event loops and threads.

    It owns the tokenizer, the chat template and image preprocessing (in its :class:`MultiModalProcessor`,
    which loads images under ``media_policy``), the engine (driven by one engine-loop thread), and its
    own :class:`SessionManager` and :class:`InferInstManager`.

    ``media_policy`` defaults to ``MediaPolicy()``, which loads no URL and no local file (only PIL
    images, bytes and data URLs): an app built with ``create_app(AsyncEngine(path))`` serves remote
    clients. A local caller passes ``MediaPolicy.for_local_caller()`` (as ``pipeline()`` does).
    """

    def __init__(self, model_path: str | None = None, backend_config: PytorchEngineConfig | None = None,
                 chat_template_config: ChatTemplateConfig | None = None, show_progress: bool = True,
                 media_policy: MediaPolicy | None = None):
        _check_arguments(model_path, backend_config, chat_template_config)
        self.backend_config = backend_config or PytorchEngineConfig()
        self.session_manager = SessionManager()
        self.engine_loop = EngineLoop(lambda: Engine(model_path, self.backend_config, show_progress=show_progress),
                                      lambda: self.session_manager.epoch)
        self.engine: Engine | None = self.engine_loop.engine
        self.tokenizer = self.engine.tokenizer
        self.session_len = self.engine.session_len
        self.vocab_size = self.engine.model_config.vocab_size
        self.model_dir = self.engine.model_dir
        self.model_name = model_name(model_path)
        template = chat_template_config.chat_template if chat_template_config else None
        mm_config = self.engine.model_config.mm_config
        image_inputs = (ImageInputs.for_model(self.model_dir, mm_config, self.tokenizer.hf) if mm_config is not None
                        else None)
        self.processor = MultiModalProcessor(self.tokenizer, template, image_inputs, media_policy or MediaPolicy())
        self.inst_manager = InferInstManager(self.engine_loop, self.backend_config.max_batch_size)
        self.grammars = self.engine.grammars
        self._grammar_pool = GrammarProcessPool(self.grammars, GRAMMAR_COMPILE_THREADS)
        self._compiling: dict[str, _Compile] = {}  # a format (with its marker) -> its compile, until it ends
        self._owners: dict[int, tuple[object, str]] = {}  # session id -> (its active request, that one's owner)

    def encode(self, prompt: Prompt, do_preprocess: bool = True) -> list[int]:
        """Token ids of a prompt; raises :class:`SafeRunException` (INVALID_ARGUMENT) for bad input."""
        try:
            return self.processor.encode(prompt, do_preprocess)
        except ValueError as exc:
            raise SafeRunException(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc

    async def process(self, prompt: Prompt, do_preprocess: bool = True) -> ProcessedPrompt:
        """Token ids and images of a prompt; images are fetched and preprocessed on a worker thread, which
        stops before the next image once this is cancelled. Raises :class:`SafeRunException` (INVALID_ARGUMENT)
        for bad input, bad images included, and (INPUT_LENGTH_ERROR) for a prompt with images too long for
        ``session_len``, before its images are preprocessed where their headers tell."""
        stop = threading.Event()
        try:
            if self.processor.accepts_images:
                return await asyncio.to_thread(self.processor.process, prompt, do_preprocess, None, None, stop,
                                               self.session_len)
            return self.processor.process(prompt, do_preprocess)
        except PromptTooLong as exc:
            raise SafeRunException(ErrorCode.INPUT_LENGTH_ERROR, str(exc)) from exc
        except ValueError as exc:
            raise SafeRunException(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc
        finally:
            stop.set()

    async def compile_grammar(self, gen_config: GenerationConfig, timeout: float | None = None) -> Grammar | None:
        """``gen_config.response_format`` compiled in a grammar worker process (compiled grammars are cached
        by their source), None without one; raises :class:`SafeRunException` (INVALID_ARGUMENT) with
        xgrammar's reason for a schema, regex or grammar it cannot compile, (ABORTED) when the system killed
        the worker process, and ``TimeoutError`` when it has not compiled after ``timeout`` seconds (waiting
        for a worker included, the workers' first start not). Requests for a format that is compiling wait
        for that compile, on no thread of their own. A compile that every request waiting for it gave up is
        stopped: never started if queued, its worker process killed if running."""
        if gen_config.response_format is None:
            return None
        key = json.dumps([gen_config.response_format, gen_config.response_format_after,
                          gen_config.response_format_opener], sort_keys=True,
                         default=repr)
        await asyncio.wrap_future(self._grammar_pool.start())  # the processes' start-up is not the format's
        compile = self._compiling.get(key)
        if compile is None:
            compile = self._compiling[key] = _Compile(self._grammar_pool.submit(gen_config))
            loop = asyncio.get_running_loop()

            def forget(_: object) -> None:
                with contextlib.suppress(RuntimeError):  # the loop has closed (a compile given up was forgotten then)
                    loop.call_soon_threadsafe(self._forget, key, compile)

            compile.job.future.add_done_callback(forget)
        compile.waiters += 1
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compile.job.future)), timeout)
        except ValueError as exc:
            raise SafeRunException(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc
        except GrammarWorkerDied as exc:
            raise SafeRunException(ErrorCode.ABORTED, str(exc)) from exc
        finally:
            compile.waiters -= 1
            if not compile.waiters and not compile.job.future.done():
                compile.job.cancel()
                self._forget(key, compile)

    def grammar_cache_size(self) -> tuple[int, int]:
        """The compiled grammars kept for reuse: how many, and their bytes."""
        return self._grammar_pool.cache_size()

    def _forget(self, key: str, compile: _Compile) -> None:
        if self._compiling.get(key) is compile:
            del self._compiling[key]

    async def generate(self, messages: Prompt | None = None, session_id: int | None = None,
                       gen_config: GenerationConfig | None = None, do_preprocess: bool = True,
                       input_ids: list[int] | None = None,
                       multimodal: list[MultiModalInput] | None = None,
                       reasoning_parser: type[ReasoningParser] | None = None,
                       reservation: Reservation | None = None) -> AsyncIterator[Response]:
        """Streams incremental :class:`Response` chunks for one prompt (or ``input_ids`` with the
        ``multimodal`` inputs that :meth:`process` made for them).

        Each chunk carries the new text and token ids (and logprobs if asked); the counts are totals
        so far; the last chunk has a ``finish_reason``: 'stop', 'length', 'abort', or 'error' when
        the engine failed while the request ran (``error`` says why). With a ``reasoning_parser``, the
        reply is read by it (the markers it reads kept where they are special tokens; a ``response_format`` without
        ``response_format_after`` applies after the reasoning): each chunk's ``text`` is its share of the
        answer, ``reasoning_content`` its share of the reasoning, and the last chunk's ``reasoning_tokens`` the
        reply's count of reasoning tokens.

        Bad input (malformed prompt, empty or longer than ``session_len``, bad token ids, a
        ``response_format`` that does not compile) and a session that already has a request running raise :class:`SafeRunException` before anything
        is yielded. ``session_id`` picks an existing session (see :meth:`session`) or names a new
        one-request session; None makes an anonymous one. A ``reservation`` (see :meth:`reserve`) names the
        session instead; the request ends it however it ends. Cancelling the consumer or closing the
        generator aborts the request in the engine and frees everything it held.
        """
        if reservation is not None:
            session_id = reservation.session.session_id
        try:
            session = self.session_manager.get(session_id) if session_id is not None else None
            gen_config = gen_config or (session and session.gen_config) or GenerationConfig()
            gen_config = self._checked(gen_config)
            if gen_config.n != 1:
                raise SafeRunException(ErrorCode.INVALID_ARGUMENT, f'one request gives one reply: GenerationConfig.n '
                                       f'must be 1 here (got {gen_config.n}); pass the prompt n times, each with its '
                                       'own random_seed, or use the server, whose n does that')
            if input_ids is not None:
                if multimodal is not None and not (isinstance(multimodal, list)
                                                   and all(isinstance(m, MultiModalInput) for m in multimodal)):
                    raise SafeRunException(ErrorCode.INVALID_ARGUMENT, 'multimodal must be a list of MultiModalInput')
                prompt = ProcessedPrompt(self._input_ids(input_ids), multimodal or [])
            else:
                prompt = await self.process(messages, do_preprocess)
            split = ReasoningSplitter(None)
            if reasoning_parser is not None:
                parser = reasoning_parser(prompt.text or self.tokenizer.decode(prompt.input_ids,
                                                                               skip_special_tokens=False))
                gen_config = for_parser(gen_config, parser)
                split = ReasoningSplitter(parser, ReasoningCounter(IncrementalDetokenizer(
                    self.tokenizer, [], gen_config.skip_special_tokens, gen_config.keep_special_tokens)))
            grammar = await self.compile_grammar(gen_config)
            reservation = reservation or self.reserve(session_id)
            request = reservation.request
            async with self.inst_manager.instance(request) as inst:
                if inst is None or request.aborted or request.epoch != self.session_manager.epoch:
                    yield split(Response('', 0, len(prompt.input_ids), 'abort'))
                    return
                stream = inst.start(request, prompt, gen_config, grammar)
                try:
                    while True:
                        out = await stream.queue.get()
                        if out.finish_reason == 'error' and stream.error_code is not ErrorCode.ENGINE_ERROR:
                            raise SafeRunException(stream.error_code, out.error)
                        yield split(_to_response(out))
                        if out.finish_reason is not None:
                            break
                finally:
                    if not stream.done.done():
                        await asyncio.wrap_future(inst.cancel(stream))
        finally:
            if reservation is not None:
                self.release(reservation)

    def _checked(self, gen_config: object) -> GenerationConfig:
        """``gen_config`` checked again (a field set after it was made was not) and against the vocabulary: a
        bad value fails this request alone, not the engine step of every request batched with it."""
        if not isinstance(gen_config, GenerationConfig):
            raise SafeRunException(ErrorCode.INVALID_ARGUMENT, 'gen_config must be a GenerationConfig')
        try:
            gen_config = dataclasses.replace(gen_config)
        except ValueError as exc:
            raise SafeRunException(ErrorCode.INVALID_ARGUMENT, str(exc)) from exc
        for name in ('stop_token_ids', 'logit_bias'):
            if any(t >= self.vocab_size for t in getattr(gen_config, name) or ()):
                raise SafeRunException(ErrorCode.INVALID_ARGUMENT, f'the token ids of {name} must be in '
                                       f'[0, {self.vocab_size}), the vocabulary of this model')
        return gen_config

    def reserve(self, session_id: int | None = None) -> Reservation:
        """Starts a request on session ``session_id`` (see :meth:`SessionManager.reserve`) before it is generated:
        an abort (by the :data:`request_owner` of now) reaches it while it waits, and :meth:`generate` with the
        reservation ends as 'abort' then. Raises :class:`SafeRunException` (SESSION_OCCUPIED) for a session that
        has a request; :meth:`release` gives it back if it never reaches :meth:`generate`."""
        reservation = self.session_manager.reserve(session_id)
        owner = request_owner.get()
        if owner is not None:
            self._owners[reservation.session.session_id] = (reservation.request, owner)
        return reservation

    def release(self, reservation: Reservation) -> None:
        """Ends a reserved request (idempotent)."""
        session_id = reservation.session.session_id
        if self._owners.get(session_id, (None,))[0] is reservation.request:
            self._owners.pop(session_id, None)
        self.session_manager.release(reservation)

    async def collect(self, responses: AsyncIterator[Response], index: int = 0) -> Response:
        """Merges a stream of chunks into one :class:`Response`."""
        total = Response('', 0, 0, index=index)
        async for chunk in responses:
            total.extend(chunk)
        return total

    def session(self, session_id: int | None = None, gen_config: GenerationConfig | None = None) -> Session:
        """A new session for multi-turn chat, kept until :meth:`end_session`."""
        return self.session_manager.create(session_id, gen_config)

    async def chat(self, prompt: Prompt, session: Session, gen_config: GenerationConfig | None = None,
                   do_preprocess: bool = True, reasoning_parser: type[ReasoningParser] | None = None) -> Response:
        """One chat turn: answers ``prompt`` after the session's history, then records both in it (with a
        ``reasoning_parser``, the answer as the reply's content and the reasoning where the model's template
        takes it, see :func:`~lmdeploy.serve.reasoning.assistant_message`).

        The earlier turns' KV blocks are found again by the prefix cache (``Response.cached_tokens``).
        """
        if not isinstance(prompt, (str, list)):
            raise TypeError(f'a chat turn is a str or a list of messages, got {type(prompt).__name__}')
        turn = [{'role': 'user', 'content': prompt}] if isinstance(prompt, str) else list(prompt)
        response = await self.collect(self.generate(session.history + turn, session.session_id, gen_config,
                                                    do_preprocess, reasoning_parser=reasoning_parser))
        session.history += turn + [assistant_message(response.text, response.reasoning_content, reasoning_parser)]
        session.response = response
        return response

    async def abort_session(self, session_id: int, owner: str | None = None) -> bool:
        """Stops the session's request; a no-op for unknown or idle sessions.

        With an ``owner``, only a request started with that :data:`request_owner` is stopped: for one
        of another owner (or of none) nothing happens and it returns False. Otherwise it returns True.
        """
        if owner is None:
            await self.session_manager.abort(session_id)
            return True
        session = self.session_manager.get(session_id)
        request = session.request if session is not None else None
        if request is None:
            return True
        started_by = self._owners.get(session_id)
        if started_by is None or started_by[0] is not request or not hmac.compare_digest(started_by[1], owner):
            return False
        future = request.abort()
        if future is not None:
            await asyncio.wrap_future(future)
        return True

    async def end_session(self, session_id: int) -> None:
        """Aborts the session's request and forgets the session."""
        await self.session_manager.end(session_id)

    async def stop_all_session(self) -> None:
        """Aborts every request in flight, also those still waiting for admission."""
        await self.session_manager.abort_all()

    def _input_ids(self, input_ids: object) -> list[int]:
        if not isinstance(input_ids, list) or not all(type(t) is int for t in input_ids):
            raise SafeRunException(ErrorCode.INVALID_ARGUMENT, 'input_ids must be a list of ints')
        return input_ids

    async def get_logits(self, input_ids: list[int], reduce: Callable[[torch.Tensor], T] | None = None) -> T:
        """fp32 logits ``[len(input_ids), vocab]`` at every position of the prompt, or ``reduce(logits)``.

        ``reduce`` runs on the engine-loop thread, where torch work does not slow the engine down.
        """
        ids = self._input_ids(input_ids)
        reduce = reduce or (lambda logits: logits)
        try:
            return await asyncio.wrap_future(self.engine_loop.call(lambda engine: reduce(engine.get_logits(ids))))
        except ValueError as exc:
            code = ErrorCode.INPUT_LENGTH_ERROR if len(ids) >= self.session_len else ErrorCode.INVALID_ARGUMENT
            raise SafeRunException(code, str(exc)) from exc

    async def get_ppl(self, input_ids: list[int]) -> float:
        """Mean negative log-likelihood per predicted token of ``input_ids`` (at least two tokens), from the
        prompt logprobs of a one-token request: it is scheduled like any other, in chunks."""
        if not isinstance(input_ids, list) or len(input_ids) < 2:
            raise SafeRunException(ErrorCode.INVALID_ARGUMENT, 'get_ppl needs at least two token ids')
        gen = GenerationConfig(max_new_tokens=1, prompt_logprobs=0, ignore_eos=True)
        response = await self.collect(self.generate(input_ids=input_ids, gen_config=gen))
        if response.prompt_logprobs is None:
            code = ErrorCode.ENGINE_ERROR if response.finish_reason == 'error' else ErrorCode.ABORTED
            raise SafeRunException(code, response.error or 'the request was aborted before its prefill')
        return -sum(entry[token] for token, entry in zip(input_ids[1:], response.prompt_logprobs[1:])) / (
            len(input_ids) - 1)

    def close(self) -> None:
        """Ends every request (in flight or waiting) as 'abort', stops the engine-loop thread and drops
        the engine."""
        self.session_manager.abort_all_nowait()
        self._grammar_pool.close()
        self.engine_loop.stop()
        self.engine_loop.engine = self.engine = None
