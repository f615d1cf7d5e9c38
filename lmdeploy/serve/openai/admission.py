"""Server-side back-pressure: a cap on concurrent request slots plus a bounded waiting queue.

A request takes one slot per engine request it fans out to (``n`` x prompts), so a request of n=8
holds 8 slots; one that needs more slots than the server has is refused at once with a 400.
"""
from __future__ import annotations

import asyncio
from collections import deque

from lmdeploy.serve.openai.errors import APIError


class Ticket:
    """The slots one admitted request holds; :meth:`release` gives them back (idempotent)."""

    def __init__(self, admission: Admission, slots: int):
        self.admission = admission
        self.slots = slots
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.release(self.slots)


class Admission:
    """Lets ``max_running`` slots be held at once and ``max_waiting`` more slots wait in line (FIFO).

    :meth:`acquire` raises a 429 :class:`APIError` with ``Retry-After`` when the request fits neither,
    and a 400 when it asks for more slots than ``max_running``. Used from one event loop (the server's).
    """

    def __init__(self, max_running: int, max_waiting: int, retry_after: int = 1):
        if max_running < 1 or max_waiting < 0:
            raise ValueError('max_running must be >= 1 and max_waiting >= 0')
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self.running = 0
        self.waiting_slots = 0
        self._waiters: deque[tuple[asyncio.Future, int]] = deque()

    @property
    def num_waiting(self) -> int:
        """Requests waiting in line."""
        return len(self._waiters)

    async def acquire(self, slots: int = 1) -> Ticket:
        """Takes ``slots`` running slots, waiting in line for them if needed."""
        if slots > self.max_running:
            raise APIError(400, f'the request fans out to {slots} generations (n x prompts), more than the server '
                           f'ever runs at once (--max-concurrent-requests is {self.max_running}); lower n or send '
                           'fewer prompts per request', 'n', 'max_concurrent_requests_exceeded')
        if self.running + slots <= self.max_running and not self._waiters:
            self.running += slots
            return Ticket(self, slots)
        if self.waiting_slots + slots > self.max_waiting:
            raise APIError(429, f'the server is busy ({self.running} of {self.max_running} slots running, '
                           f'{self.waiting_slots} of {self.max_waiting} waiting; this request needs {slots}); '
                           'retry later', code='rate_limit_exceeded', headers={'Retry-After': str(self.retry_after)})
        waiter = asyncio.get_running_loop().create_future()
        entry = (waiter, slots)
        self._waiters.append(entry)
        self.waiting_slots += slots
        try:
            await waiter
        except asyncio.CancelledError:
            if entry in self._waiters:
                self._waiters.remove(entry)
                self.waiting_slots -= slots
                self._grant()
            elif waiter.done() and not waiter.cancelled():
                self.release(slots)
            raise
        return Ticket(self, slots)

    def release(self, slots: int = 1) -> None:
        """Gives slots back and lets the waiters at the head of the line in while they fit."""
        self.running -= slots
        self._grant()

    def _grant(self) -> None:
        while self._waiters:
            waiter, slots = self._waiters[0]
            if not waiter.done() and self.running + slots > self.max_running:
                return
            self._waiters.popleft()
            self.waiting_slots -= slots
            if not waiter.done():
                self.running += slots
                waiter.set_result(None)
