"""Sessions: a conversation's id, history and generation config, and its one active request."""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from lmdeploy.messages import GenerationConfig, Response
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException

AbortAction = Callable[[], 'concurrent.futures.Future | None']


class Request:
    """A session's active request, as seen from outside: it can be aborted from any thread.

    What an abort does depends on how far the request got (waiting for admission, or running in
    the engine); the stage sets it with :meth:`on_abort`.
    """

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.aborted = False
        self._action: AbortAction | None = None
        self._lock = threading.Lock()

    def on_abort(self, action: AbortAction) -> None:
        """Sets what an abort does from now on; runs it at once if the request is already aborted."""
        with self._lock:
            self._action = action
            aborted = self.aborted
        if aborted:
            action()

    def abort(self) -> concurrent.futures.Future | None:
        """Stops the request; returns a future that resolves once the engine holds nothing of it."""
        with self._lock:
            self.aborted = True
            action = self._action
        return action() if action else None


@dataclass(eq=False)
class Session:
    """One conversation: ``history`` holds its OpenAI-style messages, ``response`` the last reply."""

    session_id: int
    gen_config: GenerationConfig | None = None
    history: list[dict] = field(default_factory=list)
    response: Response | None = None
    request: Request | None = None


@dataclass(eq=False)
class Reservation:
    """A request started on ``session`` before it reached the engine (see :meth:`SessionManager.reserve`);
    ``one_shot``: the session was made for this one request and goes with it."""

    session: Session
    request: Request
    one_shot: bool


def check_session_id(session_id: object) -> int:
    """Returns ``session_id`` if it is a non-negative int; raises INVALID_ARGUMENT otherwise."""
    if isinstance(session_id, bool) or not isinstance(session_id, int) or session_id < 0:
        raise SafeRunException(ErrorCode.INVALID_ARGUMENT, f'session_id must be a non-negative int, got {session_id!r}')
    return session_id


class SessionManager:
    """The sessions of one AsyncEngine; safe to use from several threads.

    ``epoch`` grows with every :meth:`abort_all`: a request that carries an older epoch ends as
    'abort' without running.
    """

    def __init__(self):
        self.sessions: dict[int, Session] = {}
        self.epoch = 0
        self._ids = itertools.count()
        # One-request sessions without an id of their own count down from -1: ids that no caller may give, so that
        # they never take (or make occupied) a session id a caller names.
        self._anonymous_ids = itertools.count(-1, -1)
        self._lock = threading.Lock()

    def create(self, session_id: int | None = None, gen_config: GenerationConfig | None = None) -> Session:
        """A new session with ``session_id``, or the next free id when it is None."""
        with self._lock:
            return self._create(session_id, gen_config)

    def _create(self, session_id: int | None, gen_config: GenerationConfig | None = None) -> Session:
        if session_id is None:
            session_id = next(i for i in self._ids if i not in self.sessions)
        elif check_session_id(session_id) in self.sessions:
            raise SafeRunException(ErrorCode.SESSION_OCCUPIED, f'session {session_id} already exists')
        session = self.sessions[session_id] = Session(session_id, gen_config)
        return session

    def reserve(self, session_id: int | None = None) -> Reservation:
        """Starts a request on session ``session_id`` (made for this one request when unknown; when None, with
        a negative id) in one step: :meth:`abort` and :meth:`abort_all` reach it from now on, also before it
        reaches the engine. Raises SESSION_OCCUPIED if the session has a request; :meth:`release` ends it."""
        with self._lock:
            if session_id is None:
                anonymous = next(self._anonymous_ids)
                session = self.sessions[anonymous] = Session(anonymous)
                return Reservation(session, self._start(session), True)
            session = self.sessions.get(session_id)
            one_shot = session is None
            session = session or self._create(session_id)
            return Reservation(session, self._start(session), one_shot)

    def release(self, reservation: Reservation) -> None:
        """Ends a reserved request (idempotent); a one-shot session goes with it."""
        self.finish_request(reservation.session, reservation.request, end_session=reservation.one_shot)

    def get(self, session_id: int) -> Session | None:
        return self.sessions.get(session_id)

    @property
    def num_active(self) -> int:
        """Sessions that have a request in flight."""
        return sum(1 for s in list(self.sessions.values()) if s.request is not None)

    def start_request(self, session: Session) -> Request:
        """Makes a new request the session's active one; raises SESSION_OCCUPIED if it has one."""
        with self._lock:
            return self._start(session)

    def _start(self, session: Session) -> Request:
        if session.request is not None:
            raise SafeRunException(ErrorCode.SESSION_OCCUPIED,
                                   f'session {session.session_id} already has a request running')
        session.request = Request(self.epoch)
        return session.request

    def finish_request(self, session: Session, request: Request, end_session: bool = False) -> None:
        """Clears the session's active slot; ``end_session`` also forgets the session."""
        with self._lock:
            if session.request is request:
                session.request = None
            if end_session and self.sessions.get(session.session_id) is session:
                del self.sessions[session.session_id]

    async def abort(self, session_id: int) -> None:
        """Stops the session's request and waits until the engine let go of it; a no-op if it has none."""
        session = self.sessions.get(session_id)
        request = session.request if session else None
        if request is not None:
            await _wait(request.abort())

    def abort_all_nowait(self) -> list[concurrent.futures.Future]:
        """Starts :meth:`abort_all`; returns futures that resolve as the engine lets go of each request."""
        with self._lock:
            self.epoch += 1
            requests = [s.request for s in self.sessions.values() if s.request is not None]
        return [f for f in (r.abort() for r in requests) if f is not None]

    async def abort_all(self) -> None:
        """Stops every request, also those not yet admitted or still queued for the engine."""
        await asyncio.gather(*(asyncio.wrap_future(f) for f in self.abort_all_nowait()))

    async def end(self, session_id: int) -> None:
        """Aborts the session's request, then forgets the session and its history; unknown ids are a no-op."""
        await self.abort(session_id)
        with self._lock:
            session = self.sessions.pop(session_id, None)
        if session is not None:
            session.history.clear()
            session.response = None


async def _wait(future: concurrent.futures.Future | None) -> None:
    if future is not None:
        await asyncio.wrap_future(future)
