"""Server-side back-pressure: a cap on concurrent requests plus a bounded waiting queue."""
from __future__ import annotations

import asyncio
from collections import deque

from lmdeploy.serve.openai.errors import APIError


class Admission:
    """Lets ``max_running`` requests run at once and ``max_waiting`` more wait in line (FIFO).

    :meth:`acquire` raises a 429 :class:`APIError` with ``Retry-After`` when both are full. Used from
    one event loop (the server's).
    """

    def __init__(self, max_running: int, max_waiting: int, retry_after: int = 1):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Takes a running slot, waiting in line for one if needed."""
        if self.running < self.max_running and not self._waiters:
            self.running += 1
            return
        if len(self._waiters) >= self.max_waiting:
            raise APIError(429, f'the server is busy ({self.running} requests running, {len(self._waiters)} '
                           'waiting); retry later', code='too_many_requests',
                           headers={'Retry-After': str(self.retry_after)})
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter in self._waiters:
                self._waiters.remove(waiter)
            elif waiter.done() and not waiter.cancelled():
                self.release()
            raise

    def release(self) -> None:
        """Gives a slot back, straight to the longest waiter if there is one."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.running -= 1
