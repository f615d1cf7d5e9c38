"""Grammar compiles in worker processes, so that one running too long can be stopped.

xgrammar cannot stop a compile once started; a process can be killed. The pool's worker processes start
together on its first use (an engine that never sees a grammar starts none); a compile takes an idle one on a
thread of the pool, sends the format down its pipe and waits for the word that it compiled. A compile that
every waiting request gave up is killed with its process, and a new process starts at once in its place (its
start-up overlaps whatever comes next). A format that compiled in a worker then compiles again in this process,
on the pool's thread (xgrammar lets go of the GIL): xgrammar serializes a compiled grammar as JSON, each state's
token mask a list of numbers, hundreds of MB for a tool set (a 31-tool set on SmolLM2's vocabulary: 194 MB,
26 s to serialize and 13 s to read back, for a 1.6 s compile).

Workers are started with the 'spawn' context: the engine process runs threads and torch, which a forked child
would inherit half-done (locks held by other threads), and a spawned child's parent is the engine itself, so
it can ask the kernel to kill it when the engine dies ('forkserver' would make the server its parent and add
a process shared by all of the engine's multiprocessing users).
"""
from __future__ import annotations

import json
import os
import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection

import xgrammar as xgr

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.child_process import die_with_parent, main_module_hidden
from lmdeploy.pytorch.engine.guided import Grammar, GrammarCompiler, compile_format

_SPAWN = get_context('spawn')
# Compiled grammars kept for reuse, the least recently used dropped first past this many bytes.
CACHE_BYTES = 512 << 20


class GrammarWorkerDied(RuntimeError):
    """A worker process ended in the middle of a compile that nobody cancelled (the OS killed it)."""


def _serve(conn: Connection, parent: int) -> None:
    """A worker's life: receive the tokenizer info and say 'ready', then compile each format received, answer
    ``(True, '')`` or ``(False, reason)``; ends with its parent (the kernel kills it) or when the pipe closes."""
    die_with_parent(parent)
    try:
        info = conn.recv()
    except EOFError:
        return
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info), cache_enabled=False)
    conn.send('ready')
    while True:
        try:
            fmt = conn.recv()
        except EOFError:
            return
        try:
            compile_format(compiler, fmt)
            conn.send((True, ''))
        except ValueError as exc:
            conn.send((False, str(exc)))


class _Worker:
    """One worker process and its end of the pipe; starting one returns at once, its start-up (imports)
    goes on while :meth:`wait_ready` is not called."""

    def __init__(self, tokenizer_info: str):
        self.conn, child = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=_serve, args=(child, os.getpid()), daemon=True,
                                      name='lmdeploy-grammar')
        with main_module_hidden():
            self.process.start()
        child.close()
        self.tokenizer_info: str | None = tokenizer_info

    def wait_ready(self) -> None:
        """Sends the tokenizer info (once) and waits for the process's start-up; raises ``EOFError`` or
        ``OSError`` if it died."""
        if self.tokenizer_info is not None:
            self.conn.send(self.tokenizer_info)
            if self.conn.recv() == 'ready':
                self.tokenizer_info = None

    def compile(self, fmt: dict) -> tuple[bool, str]:
        self.wait_ready()
        self.conn.send(fmt)
        return self.conn.recv()

    def close(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


@dataclass(eq=False)
class GrammarJob:
    """One compile: ``future`` gives its :class:`Grammar` (None when cancelled); ``cancel`` stops it."""

    fmt: dict
    future: Future = field(default_factory=Future)
    worker: _Worker | None = None
    cancelled: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        """Drops the compile if queued, kills its worker process if running."""
        with self.lock:
            self.cancelled = True
            if not self.future.cancel() and self.worker is not None:
                self.worker.process.kill()


class GrammarProcessPool:
    """Compiles response formats in ``size`` worker processes (each compile on a thread of the pool's own), then
    in this process once one did, keeping the compiled grammars (by format, least recently used dropped past
    :data:`CACHE_BYTES`).

    Workers are started from the pool's threads, which live as long as the pool: a process asks the kernel to
    kill it when the thread that started it ends.
    """

    def __init__(self, compiler: GrammarCompiler, size: int):
        self.compiler = compiler
        self.size = size
        self._threads = ThreadPoolExecutor(size, thread_name_prefix='lmdeploy-grammar')
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()
        self._idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self._started: Future | None = None
        self._info: str | None = None
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._closed = False
        self._local = threading.local()  # each thread of the pool its own compiler (the pool keeps the cache)

    def start(self) -> Future:
        """Starts the worker processes (once); the future is done when they are ready to compile."""
        with self._lock:
            if self._started is None:
                self._started = self._threads.submit(self._start)
            return self._started

    def submit(self, gen_config: GenerationConfig) -> GrammarJob:
        """Starts compiling ``gen_config.response_format`` (which must be set); a cached one is done at once."""
        job = GrammarJob(gen_config.response_format)
        with self._lock:
            compiled = self._cache.get(self._key(job.fmt))
            if compiled is not None:
                self._cache.move_to_end(self._key(job.fmt))
        if compiled is not None:
            job.future.set_result(self.compiler.grammar(compiled, gen_config))
        else:
            self.start()
            job.future = self._threads.submit(self._run, job, gen_config)
        return job

    def worker_pids(self) -> list[int]:
        """The ids of the worker processes alive now."""
        with self._lock:
            return [w.process.pid for w in self._workers if w.process.is_alive()]

    def close(self) -> None:
        """Drops the queued compiles and kills every worker process."""
        self._threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._closed = True
            workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.close()
        for _ in range(self.size):
            self._idle.put(None)

    @staticmethod
    def _key(fmt: dict) -> str:
        return json.dumps(fmt, sort_keys=True)

    def _start(self) -> None:
        try:
            self._info = self.compiler.tokenizer_info().serialize_json()
            workers = [self._new_worker() for _ in range(self.size)]
        except BaseException:
            for _ in range(self.size):
                self._idle.put(None)
            raise
        for worker in workers:
            try:
                if worker is not None:
                    worker.wait_ready()
            except (EOFError, OSError):
                pass  # found dead by the compile that takes it
            self._idle.put(worker)

    def _new_worker(self) -> _Worker | None:
        """A new worker process (None once the pool is closed)."""
        worker = None if self._closed else _Worker(self._info)
        with self._lock:
            if self._closed and worker is not None:
                worker.close()
                return None
            if worker is not None:
                self._workers.add(worker)
        return worker

    def _replace(self, worker: _Worker) -> _Worker | None:
        with self._lock:
            self._workers.discard(worker)
        worker.close()
        return self._new_worker()

    def _run(self, job: GrammarJob, gen_config: GenerationConfig) -> Grammar | None:
        worker = self._idle.get()
        if worker is not None and worker.process.exitcode is not None:
            worker = self._replace(worker)
        if worker is None:
            self._idle.put(None)
            if self._closed:
                return None
            raise GrammarWorkerDied('the grammar compile processes could not start')
        with job.lock:
            if job.cancelled or self._closed:
                self._idle.put(worker)
                return None
            job.worker = worker
        try:
            ok, text = worker.compile(job.fmt)
        except (EOFError, OSError):
            ok = text = None
        with job.lock:
            job.worker = None
        if text is None or job.cancelled:  # a cancel may have killed it after its answer
            self._idle.put(self._replace(worker))
            if job.cancelled or self._closed:
                return None
            raise GrammarWorkerDied(f'the grammar compile process died (exit code {worker.process.exitcode}: '
                                    'killed by the system, out of memory?); retry, or simplify the format')
        self._idle.put(worker)
        if not ok:
            raise ValueError(text)
        if not hasattr(self._local, 'compiler'):
            self._local.compiler = xgr.GrammarCompiler(self.compiler.tokenizer_info(), cache_enabled=False)
        compiled = compile_format(self._local.compiler, job.fmt)
        self._remember(self._key(job.fmt), compiled)
        return self.compiler.grammar(compiled, gen_config)

    def _remember(self, key: str, compiled: xgr.CompiledGrammar) -> None:
        with self._lock:
            if key in self._cache:
                return
            self._cache[key] = compiled
            self._cache_bytes += compiled.memory_size_bytes
            while self._cache_bytes > CACHE_BYTES and len(self._cache) > 1:
                self._cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes

