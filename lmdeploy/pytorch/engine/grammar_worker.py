"""Grammar compiles in worker processes, so that one running too long can be stopped.

xgrammar cannot stop a compile once started; a process can be killed. The pools of one process that ask for the
same number of workers share one set of worker processes (a :class:`_WorkerSet`): it starts on the first use of
any of them (a process that never sees a grammar starts none) and ends when the last of them closes. Each worker
imports xgrammar, and so torch and transformers (xgrammar's own modules import both): about 2.6 s of CPU and
270 MB each, paid once per process rather than once per engine.

A compile takes an idle worker on a thread of the set, sends the format down its pipe (with its tokenizer's
info when the worker last compiled for another one) and waits for the word that it compiled. A compile that
every waiting request gave up is killed with its process, and a new process starts at once in its place (its
start-up overlaps whatever comes next). A format that compiled in a worker then compiles again in this process,
on the set's thread (xgrammar lets go of the GIL): xgrammar serializes a compiled grammar as JSON, each state's
token mask a list of numbers, hundreds of MB for a tool set (a 31-tool set on SmolLM2's vocabulary: 194 MB,
26 s to serialize and 13 s to read back, for a 1.6 s compile).

Workers are started with the 'spawn' context: the engine process runs threads and torch, which a forked child
would inherit half-done (locks held by other threads), and a spawned child's parent is the engine itself, so
it can ask the kernel to kill it when the engine dies ('forkserver' would make the server its parent and add
a process shared by all of the engine's multiprocessing users).
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.child_process import die_with_parent, main_module_hidden
from lmdeploy.pytorch.engine.guided import Grammar, GrammarCompiler, compile_format

if TYPE_CHECKING:  # imported by a worker, and where a grammar is compiled: an engine without one never pays it
    import xgrammar as xgr

_SPAWN = get_context('spawn')


class GrammarWorkerDied(RuntimeError):
    """A worker process ended in the middle of a compile that nobody cancelled (the OS killed it)."""


def _serve(conn: Connection, parent: int) -> None:
    """A worker's life: say 'ready' once imported, then compile each ``(tokenizer_info, format)`` received
    (``tokenizer_info``, serialized, when it changes, else None), answer ``(True, '')`` or ``(False, reason)``;
    ends with its parent (the kernel kills it) or when the pipe closes."""
    die_with_parent(parent)
    import xgrammar as xgr
    compiler = None
    try:
        conn.send('ready')
        while True:
            info, fmt = conn.recv()
            if info is not None:
                compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(info), cache_enabled=False)
            try:
                compile_format(compiler, fmt)
                conn.send((True, ''))
            except ValueError as exc:
                conn.send((False, str(exc)))
    except (EOFError, OSError):
        return


class _Worker:
    """One worker process and its end of the pipe; starting one returns at once, its start-up (imports)
    goes on while :meth:`wait_ready` is not called."""

    def __init__(self):
        self.conn, child = _SPAWN.Pipe()
        self.process = _SPAWN.Process(target=_serve, args=(child, os.getpid()), daemon=True,
                                      name='lmdeploy-grammar')
        with main_module_hidden():
            self.process.start()
        child.close()
        self.ready = False
        self.tokenizer: int | None = None  # the pool whose tokenizer its compiler has

    def wait_ready(self) -> None:
        """Waits for the process's start-up; raises ``EOFError`` or ``OSError`` if it died."""
        if not self.ready:
            self.ready = self.conn.recv() == 'ready'

    def compile(self, tokenizer: int, tokenizer_info: Callable[[], str], fmt: dict) -> tuple[bool, str]:
        self.wait_ready()
        self.conn.send((None if tokenizer == self.tokenizer else tokenizer_info(), fmt))
        self.tokenizer = tokenizer
        return self.conn.recv()

    def close(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class _WorkerSet:
    """``size`` worker processes and the threads that start them and run compiles on them, shared by the pools
    of this process of that size (``users`` of them hold it).

    Workers are started from the set's threads, which live as long as the set: a process asks the kernel to
    kill it when the thread that started it ends.
    """

    def __init__(self, size: int):
        self.size = size
        self.users = 0
        self.threads = ThreadPoolExecutor(size, thread_name_prefix='lmdeploy-grammar')
        self.idle: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        self.closed = False
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()
        self._started: Future | None = None

    def start(self) -> Future:
        """Starts the worker processes (once); the future is done when they are ready to compile."""
        with self._lock:
            if self._started is None:
                self._started = self.threads.submit(self._start)
            return self._started

    def pids(self) -> list[int]:
        with self._lock:
            return [w.process.pid for w in self._workers if w.process.is_alive()]

    def replace(self, worker: _Worker) -> _Worker | None:
        """Kills ``worker``; a new worker in its place (None once the set is closed)."""
        with self._lock:
            self._workers.discard(worker)
        worker.close()
        return self._new_worker()

    def close(self) -> None:
        """Drops the queued compiles and kills every worker process."""
        self.threads.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self.closed = True
            workers, self._workers = list(self._workers), set()
        for worker in workers:
            worker.close()
        for _ in range(self.size):
            self.idle.put(None)

    def _start(self) -> None:
        try:
            workers = [self._new_worker() for _ in range(self.size)]
        except BaseException:
            for _ in range(self.size):
                self.idle.put(None)
            raise
        for worker in workers:
            try:
                if worker is not None:
                    worker.wait_ready()
            except (EOFError, OSError):
                pass  # found dead by the compile that takes it
            self.idle.put(worker)

    def _new_worker(self) -> _Worker | None:
        worker = None if self.closed else _Worker()
        with self._lock:
            if self.closed and worker is not None:
                worker.close()
                return None
            if worker is not None:
                self._workers.add(worker)
        return worker


_shared_lock = threading.Lock()
_shared: dict[int, _WorkerSet] = {}  # size -> the set the pools of that size share
_pool_ids = itertools.count()
os.register_at_fork(after_in_child=_shared.clear)  # a forked child has none of the sets' threads and processes


def _acquire(size: int) -> _WorkerSet:
    with _shared_lock:
        workers = _shared.get(size)
        if workers is None:
            workers = _shared[size] = _WorkerSet(size)
        workers.users += 1
        return workers


def _release(workers: _WorkerSet) -> None:
    with _shared_lock:
        workers.users -= 1
        if workers.users:
            return
        if _shared.get(workers.size) is workers:
            del _shared[workers.size]
    workers.close()


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
    """Compiles response formats in ``size`` worker processes (shared with the other pools of this process of
    that size; each compile on a thread of theirs), then in this process once one did, keeping the compiled
    grammars (by format, the least recently used dropped first) in at most ``compiler.cache_bytes``: the
    accounting is xgrammar's ``memory_size_bytes``, within 1% of the RSS growth that they cause."""

    def __init__(self, compiler: GrammarCompiler, size: int):
        self.compiler = compiler
        self.size = size
        self._workers = _acquire(size)
        self._id = next(_pool_ids)
        self._lock = threading.Lock()
        self._started: Future | None = None
        self._info: str | None = None
        self._jobs: set[GrammarJob] = set()  # the compiles sent to the workers and not done
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._closed = False
        self._local = threading.local()  # each thread of the set its own compiler (the pool keeps the cache)

    def start(self) -> Future:
        """Starts the worker processes (once) and reads the vocabulary; the future is done when both are. It
        cannot be cancelled: it is every compile's, and a caller that gives up (a client that hangs up while
        ``asyncio.wrap_future`` waits on it) must not cancel it for the others."""
        with self._lock:
            if self._started is None:
                self._started = Future()
                self._started.set_running_or_notify_cancel()
                threading.Thread(target=self._start, args=(self._workers.start(),), daemon=True,
                                 name='lmdeploy-grammar-start').start()
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
            return job
        self.start()
        with self._lock:
            self._jobs.add(job)
        job.future = self._workers.threads.submit(self._run, job, gen_config)
        job.future.add_done_callback(lambda _: self._forget(job))
        return job

    def cache_size(self) -> tuple[int, int]:
        """The compiled grammars kept for reuse: how many, and their bytes."""
        with self._lock:
            return len(self._cache), self._cache_bytes

    def worker_pids(self) -> list[int]:
        """The ids of the worker processes alive now (shared with the other pools of this size)."""
        return self._workers.pids()

    def close(self) -> None:
        """Drops this pool's queued compiles and kills the worker processes of its running ones (the set
        replaces them); the last pool of the set kills every worker process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
        _release(self._workers)

    @staticmethod
    def _key(fmt: dict) -> str:
        return json.dumps(fmt, sort_keys=True)

    def _forget(self, job: GrammarJob) -> None:
        with self._lock:
            self._jobs.discard(job)

    def _start(self, workers: Future) -> None:
        """On a thread of its own: the set's threads may all be waiting for busy workers."""
        try:
            self._tokenizer_info()
            workers.result()
        except BaseException as exc:
            self._started.set_exception(exc)
        else:
            self._started.set_result(None)

    def _tokenizer_info(self) -> str:
        """The vocabulary as xgrammar serializes it for the workers (read once)."""
        with self._lock:
            if self._info is None:
                self._info = self.compiler.tokenizer_info().serialize_json()
            return self._info

    def _run(self, job: GrammarJob, gen_config: GenerationConfig) -> Grammar | None:
        workers = self._workers
        worker = workers.idle.get()
        if worker is not None and worker.process.exitcode is not None:
            worker = workers.replace(worker)
        if worker is None:
            workers.idle.put(None)
            if self._closed or workers.closed:
                return None
            raise GrammarWorkerDied('the grammar compile processes could not start')
        with job.lock:
            if job.cancelled or self._closed:
                workers.idle.put(worker)
                return None
            job.worker = worker
        try:
            ok, text = worker.compile(self._id, self._tokenizer_info, job.fmt)
        except (EOFError, OSError):
            ok = text = None
        with job.lock:
            job.worker = None
        if text is None or job.cancelled:  # a cancel may have killed it after its answer
            workers.idle.put(workers.replace(worker))
            if job.cancelled or self._closed:
                return None
            raise GrammarWorkerDied(f'the grammar compile process died (exit code {worker.process.exitcode}: '
                                    'killed by the system, out of memory?); retry, or simplify the format')
        workers.idle.put(worker)
        if not ok:
            raise ValueError(text)
        if not hasattr(self._local, 'compiler'):
            import xgrammar as xgr
            self._local.compiler = xgr.GrammarCompiler(self.compiler.tokenizer_info(), cache_enabled=False)
        compiled = compile_format(self._local.compiler, job.fmt)
        self._remember(self._key(job.fmt), compiled)
        return self.compiler.grammar(compiled, gen_config)

    def _remember(self, key: str, compiled: xgr.CompiledGrammar) -> None:
        size, limit = compiled.memory_size_bytes, self.compiler.cache_bytes
        with self._lock:
            if key in self._cache or size > limit:
                return
            self._cache[key] = compiled
            self._cache_bytes += size
            while self._cache_bytes > limit:
                self._cache_bytes -= self._cache.popitem(last=False)[1].memory_size_bytes
