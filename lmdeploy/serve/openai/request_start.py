"""A request from its arrival to its start: its sessions taken at once, its wait in the admission line, its
preparation, its start; a request whose client goes away, read from the ASGI ``receive``, leaves at any of them."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.types import Receive

from lmdeploy.serve.exceptions import SafeRunException
from lmdeploy.serve.openai.admission import Ticket
from lmdeploy.serve.openai.errors import APIError
from lmdeploy.serve.openai.serving_common import ChoiceRun, Job, ServerState
from lmdeploy.serve.session_manager import Reservation

T = TypeVar('T')


def reserve(state: ServerState, session_id: int | None, slots: int) -> list[Reservation]:
    """The sessions of a request's ``slots`` engine requests taken at once (see :meth:`AsyncEngine.reserve`): its
    ``session_id`` (then ``slots`` is 1), else anonymous ones; an abort by ``session_id`` or ``abort_all`` reaches
    them from now on, also while the request waits for admission or is prepared."""
    if session_id is None:
        return [state.engine.reserve() for _ in range(slots)]
    try:
        return [state.engine.reserve(session_id)]
    except SafeRunException as exc:
        raise APIError(400, exc.message, 'session_id', exc.code.value[0]) from exc


def release(state: ServerState, reservations: list[Reservation]) -> None:
    for reservation in reservations:
        state.engine.release(reservation)


async def admit(state: ServerState, slots: int) -> Ticket:
    """Waits for ``slots`` admission slots (one per engine request); raises 429 when the server is full
    and 400 when it could never hold them. Cheap checks go before, heavy work (tokenization, images)
    after it."""
    return await state.admission.acquire(slots)


async def wait_disconnect(receive: Receive) -> None:
    """Returns once the client has gone (or the response is complete); call it after the body was read."""
    while (await receive())['type'] != 'http.disconnect':
        pass


async def _until(work: Awaitable[T], stop: asyncio.Future) -> T | None:
    """``await work``, or None if ``stop`` is done first: ``work`` is cancelled then, and waited for."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    return None if task.cancelled() else task.result()


async def while_connected(work: Awaitable[T], receive: Receive) -> T | None:
    """``await work`` for a request that holds no session (``/v1/encode``: its wait for admission and its
    tokenization), or None as soon as its client, read from ``receive``, has gone: ``work`` is cancelled then."""
    gone = asyncio.ensure_future(wait_disconnect(receive))
    try:
        return await _until(work, gone)
    finally:
        gone.cancel()


def _all_aborted(reservations: list[Reservation]) -> asyncio.Future:
    """A future done once every one of ``reservations`` is aborted."""
    loop = asyncio.get_running_loop()
    all_aborted = loop.create_future()

    def check() -> None:
        if all(r.request.aborted for r in reservations) and not all_aborted.done():
            all_aborted.set_result(None)

    def on_abort() -> None:  # an abort may come from another thread (AsyncEngine.close)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(check)

    for reservation in reservations:
        reservation.request.on_abort(on_abort)
    return all_aborted


class Admitted:
    """A request between its admission and its start (see :func:`admitted`): its ``ticket`` and its sessions
    (``reservations``, one a slot)."""

    def __init__(self, state: ServerState, ticket: Ticket, reservations: list[Reservation], gone: asyncio.Future):
        self.state = state
        self.ticket = ticket
        self.reservations = reservations
        self.run: ChoiceRun | None = None
        self._gone = gone

    async def unless_gone(self, work: Awaitable[T]) -> T | None:
        """``await work`` (the request's preparation: template, tokenizer, images, grammar), or None as soon as
        the client has gone: ``work`` is cancelled then (a compile no other request waits for stops)."""
        return await _until(work, self._gone)

    def start(self, jobs: list[Job]) -> ChoiceRun:
        """Starts the jobs; the run takes the ticket and the sessions over, one to each job."""
        self.run = start_run(self.state, self.ticket, jobs)
        return self.run


@contextlib.asynccontextmanager
async def admitted(state: ServerState, slots: int, session_id: int | None,
                   receive: Receive) -> AsyncIterator[Admitted]:
    """:func:`admit` for a block that prepares a request (in :meth:`Admitted.unless_gone`) and starts it
    (:meth:`Admitted.start`). Its sessions are taken on arrival (:func:`reserve`); unless the block started the
    run, they and the slots go back when it ends. A request whose every engine request is aborted while it waits
    leaves the line at once with a ticket of no slot (its jobs end as 'abort' before they run); one whose client,
    read from ``receive``, goes away is aborted: it leaves the line, and its preparation, at once."""
    reservations = reserve(state, session_id, slots)
    gone = asyncio.ensure_future(wait_disconnect(receive))

    def abort(_: asyncio.Future) -> None:
        if not gone.cancelled():
            for reservation in reservations:
                reservation.request.abort()

    gone.add_done_callback(abort)
    request = None
    try:
        ticket = await _until(admit(state, slots), _all_aborted(reservations))
        request = Admitted(state, Ticket(state.admission, 0) if ticket is None else ticket, reservations, gone)
        yield request
    finally:
        gone.cancel()
        if request is None or request.run is None:
            if request is not None:
                request.ticket.release()
            release(state, reservations)


def start_run(state: ServerState, ticket: Ticket, jobs: list[Job]) -> ChoiceRun:
    """Starts the jobs of an admitted request; the run gives the ticket's slots back when all end."""
    return ChoiceRun(dataclasses.replace(state, admission=ticket), jobs)
