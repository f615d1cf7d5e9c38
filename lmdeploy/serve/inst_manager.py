"""A bounded pool of engine instances; acquiring one is where admission back-pressure happens."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.engine.guided import Grammar
from lmdeploy.serve.engine_loop import EngineLoop, RequestStream
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.serve.session_manager import Request
from lmdeploy.vl.processor import ProcessedPrompt


class EngineInstance:
    """The right to run one request on the engine; held by one request at a time."""

    def __init__(self, inst_id: int, engine_loop: EngineLoop):
        self.inst_id = inst_id
        self.engine_loop = engine_loop

    def start(self, request: Request, prompt: ProcessedPrompt, gen_config: GenerationConfig,
              grammar: Grammar | None = None) -> RequestStream:
        """Sends the request (with ``gen_config.response_format`` compiled to ``grammar``) to the engine;
        its outputs arrive on the returned stream's queue."""
        stream = RequestStream(prompt.input_ids, gen_config, request.epoch, prompt.multimodal, grammar)
        self.engine_loop.submit(stream)
        request.on_abort(lambda: self.cancel(stream))
        return stream

    def cancel(self, stream: RequestStream) -> concurrent.futures.Future:
        """Asks the engine to stop the request; the future resolves once it has let go of it."""
        self.engine_loop.abort(stream)
        return stream.done


class InferInstManager:
    """``size`` engine instances handed out first come, first served, from any thread or event loop.

    At most ``max_waiting`` requests wait for one (None: no bound, as the pipeline wants); past that
    :meth:`acquire` raises :class:`SafeRunException` (``SERVER_OVERLOADED``, a 503 on the server, whose admission
    normally keeps the line shorter than this).
    """

    def __init__(self, engine_loop: EngineLoop, size: int, max_waiting: int | None = None):
        self.size = size
        self.max_waiting = max_waiting
        self._free = deque(EngineInstance(i, engine_loop) for i in range(size))
        self._waiters: deque[asyncio.Future] = deque()
        self._lock = threading.Lock()

    @property
    def num_busy(self) -> int:
        return self.size - len(self._free)

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def instance(self, request: Request) -> AsyncIterator[EngineInstance | None]:
        """Holds an instance for the block and always gives it back; yields None if ``request``
        was aborted while it waited for one."""
        inst = await self.acquire(request)
        try:
            yield inst
        finally:
            if inst is not None:
                self.release(inst)

    async def acquire(self, request: Request) -> EngineInstance | None:
        """Waits for a free instance; returns None when ``request`` is aborted while it waits."""
        with self._lock:
            if self._free and not self._waiters:
                return self._free.popleft()
            if self.max_waiting is not None and len(self._waiters) >= self.max_waiting:
                raise SafeRunException(ErrorCode.SERVER_OVERLOADED, f'the server is overloaded: {len(self._waiters)} requests '
                                       'already wait for an engine instance; retry later')
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
        request.on_abort(lambda: self._withdraw(waiter))
        try:
            return await waiter
        except asyncio.CancelledError:
            with self._lock:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
            if waiter.done() and not waiter.cancelled() and waiter.result() is not None:
                self.release(waiter.result())
            raise

    def release(self, inst: EngineInstance) -> None:
        """Gives an instance back, straight to the longest waiter if there is one."""
        while True:
            with self._lock:
                if not self._waiters:
                    self._free.append(inst)
                    return
                waiter = self._waiters.popleft()
            try:
                waiter.get_loop().call_soon_threadsafe(self._hand_over, waiter, inst)
                return
            except RuntimeError:
                continue

    def _hand_over(self, waiter: asyncio.Future, inst: EngineInstance) -> None:
        if waiter.done():
            self.release(inst)
        else:
            waiter.set_result(inst)

    def _withdraw(self, waiter: asyncio.Future) -> None:
        with self._lock:
            if waiter not in self._waiters:
                return
            self._waiters.remove(waiter)
        try:
            waiter.get_loop().call_soon_threadsafe(_set_none, waiter)
        except RuntimeError:
            pass


def _set_none(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)
