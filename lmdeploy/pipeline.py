"""``Pipeline``: the synchronous Python API, on top of an :class:`AsyncEngine` run by its own event-loop thread."""
from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Coroutine, Iterator
from contextlib import aclosing
from typing import Any, TypeVar, Union

from tqdm import tqdm

from lmdeploy.messages import ChatTemplateConfig, GenerationConfig, PytorchEngineConfig, Response
from lmdeploy.serve.async_engine import AsyncEngine
from lmdeploy.serve.exceptions import SafeRunException
from lmdeploy.serve.reasoning import AUTO, check_reasoning_parser, pick_reasoning_parser
from lmdeploy.serve.session_manager import Session
from lmdeploy.vl.media import MediaPolicy
from lmdeploy.vl.processor import Prompt

Prompts = Union[Prompt, list[Prompt]]
GenConfigs = Union[GenerationConfig, list[GenerationConfig], None]
T = TypeVar('T')
_DONE = object()


def _as_batch(prompts: Prompts) -> tuple[list[Prompt], bool]:
    """Normalizes to a list of prompts; the flag says whether a single prompt was given."""
    if isinstance(prompts, (str, tuple)):
        return [prompts], True
    if isinstance(prompts, list) and prompts and all(isinstance(p, dict) for p in prompts):
        return [prompts], True
    if isinstance(prompts, list) and all(isinstance(p, (str, list, tuple)) for p in prompts):
        return list(prompts), False
    raise TypeError('prompts must be a str, an OpenAI-style message list, a (text, image or [images]) tuple, '
                    'or a list of those')


def _per_prompt(gen_config: GenConfigs, count: int) -> list[GenerationConfig | None]:
    configs = gen_config if isinstance(gen_config, list) else [gen_config] * count
    if len(configs) != count:
        raise ValueError(f'got {len(configs)} gen_configs for {count} prompts')
    return configs


class Pipeline:
    """Generates text with a local model (see :func:`lmdeploy.pipeline`).

    Every method may be called from any thread, also one that runs an asyncio loop (Jupyter): the
    work runs on the pipeline's own loop thread while the caller waits. Async code may also drive
    ``pipe.async_engine`` directly. A prompt that fails (bad input, too long) gets a Response with
    ``finish_reason='error'`` and the message in ``error``; the other prompts are unaffected.

    Images load under ``media_policy``; the default, ``MediaPolicy.for_local_caller()``, takes local
    files and public http(s) hosts, since the pipeline's caller is local. Pass a stricter one (e.g.
    ``MediaPolicy()``) when the prompts come from someone else.

    ``reasoning_parser`` splits each reply into ``Response.reasoning_content`` and ``Response.text`` (the
    answer), streamed or not: 'auto' (the default) uses the model's own parser, as the server does
    (harmony for gpt-oss; none for other models), a name picks one of the server's ``--reasoning-parser``
    choices (e.g. 'qwen3' for ``<think>`` blocks), None turns parsing off.
    """

    def __init__(self, model_path: str | None = None, backend_config: PytorchEngineConfig | None = None,
                 chat_template_config: ChatTemplateConfig | None = None, show_progress: bool = True,
                 media_policy: MediaPolicy | None = None, reasoning_parser: str | None = AUTO):
        check_reasoning_parser(reasoning_parser)
        self.async_engine = AsyncEngine(model_path, backend_config, chat_template_config, show_progress,
                                        media_policy or MediaPolicy.for_local_caller())
        self.reasoning_parser = pick_reasoning_parser(reasoning_parser,
                                                      self.async_engine.engine.model_config.hf_config.model_type)
        self.tokenizer = self.async_engine.tokenizer
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = threading.Thread(target=self._loop.run_forever,
                                                                 name='lmdeploy-pipeline-loop', daemon=True)
        self._thread.start()
        self._close_lock = threading.Lock()

    def _submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future:
        """Schedules ``coro`` on the pipeline's loop."""
        if self._thread is None or threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError('the pipeline is closed' if self._thread is None else
                               'the synchronous Pipeline API cannot be called from its own event loop')
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` on the pipeline's loop and waits for it; interrupting the wait cancels it."""
        future = self._submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def _check_open(self) -> None:
        if self._thread is None:
            raise RuntimeError('the pipeline is closed')

    def encode(self, prompt: Prompt, do_preprocess: bool = True) -> list[int]:
        """Token ids of a prompt; ``do_preprocess`` applies the chat template."""
        self._check_open()
        return self.async_engine.encode(prompt, do_preprocess)

    async def _one(self, index: int, prompt: Prompt, gen_config: GenerationConfig | None,
                   do_preprocess: bool) -> Response:
        try:
            generate = self.async_engine.generate(prompt, gen_config=gen_config, do_preprocess=do_preprocess,
                                                  reasoning_parser=self.reasoning_parser)
            return await self.async_engine.collect(generate, index)
        except SafeRunException as exc:
            return Response('', 0, 0, 'error', index=index, error=exc.message)

    async def _infer(self, batch: list[Prompt], configs: list, do_preprocess: bool, use_tqdm: bool) -> list[Response]:
        with tqdm(total=len(batch), disable=not use_tqdm, desc='Generating') as progress:
            async def one(index: int) -> Response:
                response = await self._one(index, batch[index], configs[index], do_preprocess)
                progress.update(1)
                return response
            return list(await asyncio.gather(*(one(i) for i in range(len(batch)))))

    def __call__(self, prompts: Prompts, gen_config: GenConfigs = None, do_preprocess: bool = True,
                 use_tqdm: bool = False) -> Response | list[Response]:
        """Generates a full response for each prompt (a single prompt gives a single Response).

        ``gen_config`` is one config or one per prompt; ``do_preprocess=False`` skips the chat template.
        """
        batch, single = _as_batch(prompts)
        responses = self._run(self._infer(batch, _per_prompt(gen_config, len(batch)), do_preprocess, use_tqdm))
        return responses[0] if single else responses

    infer = __call__

    async def _stream(self, batch: list[Prompt], configs: list, do_preprocess: bool, put) -> None:
        async def one(index: int) -> None:
            try:
                generate = self.async_engine.generate(batch[index], gen_config=configs[index],
                                                      do_preprocess=do_preprocess,
                                                      reasoning_parser=self.reasoning_parser)
                async with aclosing(generate) as chunks:
                    async for chunk in chunks:
                        chunk.index = index
                        put(chunk)
            except SafeRunException as exc:
                put(Response('', 0, 0, 'error', index=index, error=exc.message))
        try:
            await asyncio.gather(*(one(i) for i in range(len(batch))))
        finally:
            put(_DONE)

    def stream_infer(self, prompts: Prompts, gen_config: GenConfigs = None,
                     do_preprocess: bool = True) -> Iterator[Response]:
        """Yields incremental ``Response`` chunks; ``chunk.index`` says which prompt each belongs to. With a
        reasoning parser, a chunk's ``reasoning_content`` and ``text`` are its shares of the reasoning and
        of the answer: each adds up to the non-streamed ``Response``'s.

        Closing the iterator early aborts the prompts still running.
        """
        batch, _ = _as_batch(prompts)
        configs = _per_prompt(gen_config, len(batch))
        chunks: queue.SimpleQueue = queue.SimpleQueue()
        future = self._submit(self._stream(batch, configs, do_preprocess, chunks.put))
        try:
            while (chunk := chunks.get()) is not _DONE:
                yield chunk
            future.result()
        finally:
            future.cancel()

    def session(self, session_id: int | None = None, gen_config: GenerationConfig | None = None) -> Session:
        """A new chat session (an automatic id unless ``session_id`` is given)."""
        self._check_open()
        return self.async_engine.session(session_id, gen_config)

    def chat(self, prompt: Prompt, session: Session | None = None, gen_config: GenerationConfig | None = None,
             do_preprocess: bool = True) -> Session:
        """One chat turn in ``session``; returns the session, whose ``response`` holds the reply and
        ``history`` the conversation (a reply's answer as its content, its reasoning where the model's
        chat template takes it back). Bad input raises :class:`SafeRunException`.

        Without a session (or with one this pipeline does not hold, such as one this method returned
        or one already ended), the turn runs in a temporary session that is ended right after it, so
        nothing is left behind: the Session returned carries the reply and the history, and passing
        it back continues the conversation the same way."""
        if session is not None and not isinstance(session, Session):
            raise TypeError(f'session must be a Session (from pipe.session() or pipe.chat()) or None, got '
                            f'{type(session).__name__}')
        if session is not None and self.async_engine.session_manager.get(session.session_id) is session:
            self._run(self.async_engine.chat(prompt, session, gen_config, do_preprocess, self.reasoning_parser))
            return session
        temporary = self.session(gen_config=session.gen_config if session is not None else None)
        temporary.history = list(session.history) if session is not None else []
        try:
            self._run(self.async_engine.chat(prompt, temporary, gen_config, do_preprocess, self.reasoning_parser))
            history, response = list(temporary.history), temporary.response
        finally:
            self._run(self.async_engine.end_session(temporary.session_id))
        session = session if session is not None else Session(temporary.session_id, temporary.gen_config)
        session.history, session.response = history, response
        return session

    def end_session(self, session: Session) -> None:
        """Aborts the session's request, if any, and forgets the session."""
        self._run(self.async_engine.end_session(session.session_id))

    def get_ppl(self, input_ids: list[int] | list[list[int]]) -> float | list[float]:
        """Mean negative log-likelihood per predicted token, for one token list or a list of them."""
        if input_ids and isinstance(input_ids[0], list):
            return [self._run(self.async_engine.get_ppl(ids)) for ids in input_ids]
        return self._run(self.async_engine.get_ppl(input_ids))

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._loop.shutdown_asyncgens()

    def close(self) -> None:
        """Aborts what is in flight, stops both threads and frees the engine; calling it again is a no-op."""
        with self._close_lock:
            if self._thread is None:
                return
            self._run(self.async_engine.stop_all_session())
            self.async_engine.close()
            self._run(self._cancel_tasks())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._thread = None
            self._loop.close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
