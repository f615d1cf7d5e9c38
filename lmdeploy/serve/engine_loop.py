"""The one thread that builds and drives the synchronous :class:`Engine`.

The engine is built on that thread too, so that all of its torch work runs on one thread: every
thread that runs parallel torch ops gets an OpenMP team of its own, and once the process has more
OpenMP threads than cores, libgomp stops spinning between parallel regions, which made each small
op several times slower (an ``add`` of [64, 576]: 6 us -> 40 us).

Requests, aborts and calls go in through a thread-safe queue; the thread runs them, steps the
batch while there is work and sleeps on the queue when there is none. The outputs of one step go
back to their consumers' event loops with one ``loop.call_soon_threadsafe`` per loop. Other threads
never touch the engine: they read the :class:`EngineSnapshot` the thread publishes after each step, or
send it a call.

No request ever hangs: every command the thread runs is guarded, so a request that the engine
cannot take ends alone as 'error'; a step that fails ends the requests it may have touched as
'error' and the thread goes on; if the thread itself dies, everything in flight and everything
queued ends, and new requests are refused. A tensor-parallel engine whose worker failed
(:class:`WorkerError`, in a step or noticed between steps) kills the thread that way: it cannot run
another step.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmdeploy.messages import EngineOutput, FinishReason, GenerationConfig
from lmdeploy.pytorch.distributed.parallel_state import WorkerError
from lmdeploy.pytorch.engine.engine import Engine
from lmdeploy.pytorch.engine.guided import Grammar
from lmdeploy.pytorch.engine.sequence import SequenceStatus
from lmdeploy.pytorch.multimodal import MultiModalInput
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException

logger = logging.getLogger('lmdeploy')


def _running_future() -> concurrent.futures.Future:
    """A future that waiters cannot cancel (``asyncio.wrap_future`` would cancel it with the waiter)."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


@dataclass(frozen=True)
class EngineSnapshot:
    """What other threads may read of the engine: published by the engine-loop thread after every step and
    batch of commands, never changed once published."""

    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0

    @classmethod
    def of(cls, engine: Engine) -> EngineSnapshot:
        bm = engine.block_manager
        return cls(bm.num_blocks, bm.num_free_blocks, bm.num_queries, bm.num_hits)


@dataclass(eq=False)
class RequestStream:
    """One request's channel between its consumer's event loop and the engine-loop thread.

    ``done`` resolves once the engine holds nothing of the request any more.
    """

    prompt_ids: list[int]
    gen_config: GenerationConfig
    epoch: int
    multimodal: list[MultiModalInput] = field(default_factory=list)
    grammar: Grammar | None = None
    done: concurrent.futures.Future = field(default_factory=_running_future)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq_id: int | None = None
    error_code: ErrorCode | None = None

    def deliver(self, output: EngineOutput) -> None:
        """Hands an output to the consumer (called on the engine-loop thread)."""
        deliver_all([(self, output)])

    def end(self, reason: FinishReason, error: str | None = None, code: ErrorCode | None = None) -> None:
        """Ends the request with a made-up final output (it never ran, or the engine cannot report on it);
        a no-op once it has ended."""
        if self.done.done():
            return
        self.error_code = code
        self.deliver(EngineOutput(-1, [], '', None, reason, len(self.prompt_ids), 0, 0, error))


def _put_all(items: list[tuple[RequestStream, EngineOutput]]) -> None:
    for stream, output in items:
        stream.queue.put_nowait(output)


def deliver_all(items: list[tuple[RequestStream, EngineOutput]]) -> None:
    """Hands each output to its stream's consumer, with one wake-up per event loop (called on the
    engine-loop thread); resolves ``done`` of the streams whose output is their last."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, EngineOutput]]] = {}
    for item in items:
        by_loop.setdefault(item[0].loop, []).append(item)
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:
            logger.debug('%d request outputs dropped: their event loop is closed', len(batch))
    for stream, output in items:
        if output.finish_reason is not None and not stream.done.done():
            stream.done.set_result(None)


class EngineLoop:
    """Owns the engine-loop thread; ``current_epoch`` tells which requests are still wanted."""

    def __init__(self, build_engine: Callable[[], Engine], current_epoch: Callable[[], int],
                 heartbeat_interval: float = 1.0):
        self.engine: Engine | None = None
        self.heartbeat_interval = heartbeat_interval
        self.last_heartbeat = time.monotonic()
        self.error: str | None = None
        self.snapshot = EngineSnapshot()
        self._current_epoch = current_epoch
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}
        self._lock = threading.Lock()
        self._accepting = True
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build_engine, built), name='lmdeploy-engine-loop',
                                        daemon=True)
        self._thread.start()
        built.result()

    @property
    def is_alive(self) -> bool:
        """Whether the loop thread runs and takes requests (``last_heartbeat`` says when it last made
        progress); False from the moment it starts to stop or to die (``error`` says why)."""
        return self._accepting and self._thread.is_alive()

    def _put(self, command: tuple) -> bool:
        with self._lock:
            if self._accepting:
                self._commands.put(command)
            return self._accepting

    def submit(self, stream: RequestStream) -> None:
        """Queues a request; raises :class:`SafeRunException` once the loop has stopped."""
        if not self._put(('add', stream)):
            code = ErrorCode.ENGINE_UNAVAILABLE if self.error else ErrorCode.ABORTED
            raise SafeRunException(code, f'the engine is not running: {self.error or "it was closed"}')

    def abort(self, stream: RequestStream) -> None:
        """Asks the loop to stop a request; a no-op once it has ended."""
        self._put(('abort', stream))

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Runs ``fn(engine)`` on the loop thread between two steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self._put(('call', (fn, future))):
            future.set_exception(SafeRunException(ErrorCode.ABORTED, 'the engine is not running'))
        return future

    def stop(self) -> None:
        """Ends every request still in flight as 'abort' and joins the thread."""
        self._put(('stop', None))
        self._thread.join()

    def _run(self, build_engine: Callable[[], Engine], built: concurrent.futures.Future) -> None:
        try:
            self.engine = build_engine()
        except BaseException as exc:
            built.set_exception(exc)
            return
        self.snapshot = EngineSnapshot.of(self.engine)
        built.set_result(None)
        try:
            while self._run_commands():
                self.snapshot = EngineSnapshot.of(self.engine)
                self.engine.check_alive()
                if self.engine.has_unfinished():
                    self._step()
                self.last_heartbeat = time.monotonic()
        except BaseException as exc:
            logger.exception('the engine loop crashed')
            self.error = f'{type(exc).__name__}: {exc}'
        finally:
            self._shutdown()
            self._close_engine()

    def _close_engine(self) -> None:
        """Stops what the engine runs besides this thread (tensor-parallel workers)."""
        try:
            self.engine.close()
        except Exception:
            logger.exception('could not close the engine')

    def _run_commands(self) -> bool:
        """Runs the queued commands, first waiting for one if the engine is idle; False means stop."""
        block = not self.engine.has_unfinished()
        while True:
            try:
                kind, arg = self._commands.get(block=block, timeout=self.heartbeat_interval)
            except queue.Empty:
                return True
            if kind == 'stop':
                return False
            try:
                getattr(self, f'_do_{kind}')(arg)
            except Exception as exc:
                logger.exception('the engine loop could not run an %r command; it goes on', kind)
                self._fail_command(kind, arg, exc)
            except BaseException as exc:
                self._fail_command(kind, arg, exc)
                raise
            block = False

    def _fail_command(self, kind: str, arg: Any, exc: BaseException) -> None:
        """Ends what a command that raised was about: its request as 'error', or its call's future."""
        if kind == 'call':
            if not arg[1].done():
                arg[1].set_exception(exc)
            return
        stream: RequestStream = arg
        if stream.seq_id is not None and self._streams.get(stream.seq_id) is stream:
            del self._streams[stream.seq_id]
            self._release(stream.seq_id, stream, 'error', f'{type(exc).__name__}: {exc}', ErrorCode.ENGINE_ERROR)
        stream.end('error', f'{type(exc).__name__}: {exc}', ErrorCode.ENGINE_ERROR)

    def _do_add(self, stream: RequestStream) -> None:
        if stream.epoch != self._current_epoch():
            stream.end('abort')
            return
        try:
            stream.seq_id = self.engine.add_request(stream.prompt_ids, stream.gen_config, stream.multimodal,
                                                     stream.grammar)
        except ValueError as exc:
            too_long = len(stream.prompt_ids) >= self.engine.session_len
            stream.end('error', str(exc), ErrorCode.INPUT_LENGTH_ERROR if too_long else ErrorCode.INVALID_ARGUMENT)
            return
        except Exception:
            # add_request may have registered the sequence before it failed: free what no stream owns.
            for seq_id in [seq_id for seq_id in self.engine.sequences if seq_id not in self._streams]:
                self._release(seq_id, None)
            raise
        self._streams[stream.seq_id] = stream

    def _do_abort(self, stream: RequestStream) -> None:
        if self._streams.pop(stream.seq_id, None) is not None:
            self._release(stream.seq_id, stream, 'abort')

    def _do_call(self, arg: tuple[Callable[[Engine], Any], concurrent.futures.Future]) -> None:
        fn, future = arg
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(self.engine))
            except Exception as exc:
                future.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except WorkerError:
            raise
        except Exception as exc:
            logger.exception('engine step failed; failing the requests it ran')
            self._fail_step(f'engine step failed: {type(exc).__name__}: {exc}')
            return
        items = []
        for output in outputs:
            stream = self._streams.get(output.seq_id)
            if stream is None:  # not a request of this loop's: nobody waits for it
                logger.error('engine output for unknown request %d dropped', output.seq_id)
                continue
            if output.finish_reason is not None:
                del self._streams[output.seq_id]
            items.append((stream, output))
        self.snapshot = EngineSnapshot.of(self.engine)  # before the outputs: it holds what they report on
        deliver_all(items)

    def _fail_step(self, error: str) -> None:
        """After a failed step, ends as 'error' (and frees) every request the step may have touched: all
        but those waiting in the scheduler's queue with no KV blocks and no token in flight, which the
        step cannot have run; those stay queued and are served by the next steps."""
        try:
            untouched = {seq.seq_id for seq in self.engine.scheduler.waiting
                         if seq.status is SequenceStatus.WAITING and not seq.block_ids and not seq.num_inflight}
        except Exception:
            logger.exception('could not read the scheduler after a failed step')
            untouched = set()
        failed = {seq_id: stream for seq_id, stream in self._streams.items() if seq_id not in untouched}
        for seq_id in failed:
            del self._streams[seq_id]
        for seq_id, stream in failed.items():
            self._release(seq_id, stream, 'error', error, ErrorCode.ENGINE_ERROR)

    def _end_all(self, reason: FinishReason, error: str | None = None) -> None:
        streams, self._streams = self._streams, {}
        code = ErrorCode.ENGINE_ERROR if error else None
        for seq_id, stream in streams.items():
            self._release(seq_id, stream, reason, error, code)

    def _release(self, seq_id: int, stream: RequestStream | None, reason: FinishReason = 'abort',
                 error: str | None = None, code: ErrorCode | None = None) -> None:
        """Frees request ``seq_id`` in the engine and gives ``stream`` its final output, ending as ``reason``.

        Never raises: when the engine cannot free the request, or it already ended there (a step that
        failed after finishing it), the stream still gets a final output.
        """
        try:
            output = self.engine.abort(seq_id)
        except Exception:
            logger.exception('could not free request %d', seq_id)
            output = None
        if stream is None:
            return
        if output is None:
            stream.end(reason, error, code)
            return
        output.finish_reason, output.error = reason, error
        stream.error_code = code
        stream.deliver(output)

    def _shutdown(self) -> None:
        with self._lock:
            self._accepting = False
        reason: FinishReason = 'error' if self.error else 'abort'
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == 'add':
                arg.end(reason, self.error, ErrorCode.ENGINE_ERROR if self.error else None)
            elif kind == 'call' and arg[1].set_running_or_notify_cancel():
                arg[1].set_exception(SafeRunException(ErrorCode.ABORTED, 'the engine stopped'))
        self._end_all(reason, self.error)
