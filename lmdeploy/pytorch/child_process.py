"""Helper processes started with 'spawn' (tensor-parallel workers, grammar compilers): they start from
lmdeploy's code alone and end with the process that started them."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from typing import NoReturn

PR_SET_PDEATHSIG = 1


@contextlib.contextmanager
def main_module_hidden() -> Iterator[None]:
    """Around ``Process.start()``: 'spawn' would otherwise run the caller's script again in the child, and a
    script without an ``if __name__ == '__main__':`` guard would start another engine there."""
    main = sys.modules['__main__']
    saved = {name: main.__dict__[name] for name in ('__file__', '__spec__') if name in main.__dict__}
    for name in saved:
        setattr(main, name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(main, name, value)


def die_with_parent(parent_pid: int) -> None:
    """Has the kernel kill this process when the thread that started it ends (Linux); exits at once when
    that already happened."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)


def exit_now(code: int = 0) -> NoReturn:
    """Ends this process with ``code`` once stdout and stderr are flushed, skipping the interpreter's teardown
    of its modules: with torch and transformers loaded that took 0.5-1.5 s, which whoever waits for the
    process (an engine closing its tensor-parallel workers) would wait too."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def unreaped_exit_code(pid: int) -> int | None:
    """The exit code (negative: the signal that killed it) of ``pid``, a child of this process that ended and
    was not reaped yet, read from /proc without reaping it (whoever started it still may); None while it runs,
    or once it is reaped."""
    try:
        with open(f'/proc/{pid}/stat') as stat:
            fields = stat.read().rsplit(')', 1)[1].split()
    except (OSError, IndexError):
        return None
    # proc(5): field 3 is the state, field 52 the wait status (fields[0] and fields[49] after the name)
    if fields[0] != 'Z' or len(fields) < 50:
        return None
    return os.waitstatus_to_exitcode(int(fields[49]))


def is_stopped(pid: int) -> bool:
    """Whether process ``pid`` of this machine is stopped (SIGSTOP, SIGTSTP): alive, but it runs nothing."""
    try:
        with open(f'/proc/{pid}/stat') as stat:
            return stat.read().rsplit(')', 1)[1].split()[0] == 'T'
    except (OSError, IndexError):
        return False


def ending(exitcode: int | None) -> str:
    """How a process ended, from its exit code (negative: the signal)."""
    if exitcode is None:
        return 'ended'
    if exitcode < 0:
        return f'was killed by {signal.Signals(-exitcode).name}'
    return f'exited with code {exitcode}'
