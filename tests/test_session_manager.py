"""SessionManager: ids, the one-active-request rule, abort (one, all, epochs) and end."""
from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from lmdeploy.messages import GenerationConfig
from lmdeploy.serve.exceptions import ErrorCode, SafeRunException
from lmdeploy.serve.session_manager import Request, SessionManager


def done_future() -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(None)
    return future


def test_auto_ids_are_unique_and_skip_user_ids():
    manager = SessionManager()
    manager.create(1)
    ids = [manager.create().session_id for _ in range(3)]
    assert ids == [0, 2, 3]
    assert set(manager.sessions) == {0, 1, 2, 3}


@pytest.mark.parametrize('bad', [-1, 1.5, '3', True])
def test_user_ids_are_validated(bad):
    with pytest.raises(SafeRunException) as info:
        SessionManager().create(bad)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert 'non-negative int' in str(info.value)


def test_duplicate_id_is_rejected():
    manager = SessionManager()
    manager.create(5, GenerationConfig(max_new_tokens=3))
    with pytest.raises(SafeRunException, match='session 5 already exists') as info:
        manager.create(5)
    assert info.value.code is ErrorCode.SESSION_OCCUPIED
    assert manager.get(5).gen_config.max_new_tokens == 3


def test_one_active_request_per_session():
    manager = SessionManager()
    session = manager.create()
    request = manager.start_request(session)
    assert manager.num_active == 1
    with pytest.raises(SafeRunException, match='already has a request running') as info:
        manager.start_request(session)
    assert info.value.code is ErrorCode.SESSION_OCCUPIED
    manager.finish_request(session, request)
    assert manager.num_active == 0 and session.session_id in manager.sessions
    manager.finish_request(session, manager.start_request(session), end_session=True)
    assert not manager.sessions


def test_abort_runs_the_current_stage_action():
    request = Request(epoch=0)
    assert request.abort() is None  # nothing to stop yet
    calls = []
    request.on_abort(lambda: calls.append('running') or done_future())  # already aborted: runs at once
    assert calls == ['running']
    assert request.abort().done() and calls == ['running', 'running']


def test_abort_is_a_noop_for_unknown_idle_and_twice():
    manager = SessionManager()
    session = manager.create()

    async def main():
        await manager.abort(12345)
        await manager.abort(session.session_id)
        request = manager.start_request(session)
        calls = []
        request.on_abort(lambda: calls.append(1) or done_future())
        await manager.abort(session.session_id)
        await manager.abort(session.session_id)
        assert request.aborted and len(calls) == 2
    asyncio.run(main())


def test_abort_all_bumps_epoch_and_aborts_everything():
    manager = SessionManager()
    sessions = [manager.create() for _ in range(3)]
    requests = [manager.start_request(s) for s in sessions[:2]]
    pending = concurrent.futures.Future()
    pending.set_running_or_notify_cancel()
    requests[0].on_abort(lambda: pending)

    async def main():
        task = asyncio.ensure_future(manager.abort_all())
        await asyncio.sleep(0.01)
        assert not task.done()  # awaits the engine's confirmation
        pending.set_result(None)
        await task
    asyncio.run(main())
    assert manager.epoch == 1 and all(r.aborted for r in requests)
    assert manager.start_request(sessions[2]).epoch == 1


def test_end_forgets_the_session():
    manager = SessionManager()
    session = manager.create()
    session.history.append({'role': 'user', 'content': 'hi'})
    request = manager.start_request(session)
    asyncio.run(manager.end(session.session_id))
    assert request.aborted and not manager.sessions and not session.history
    asyncio.run(manager.end(session.session_id))


def test_managers_are_independent():
    a, b = SessionManager(), SessionManager()
    a.create(7)
    b.create(7)
    a.start_request(a.get(7))
    assert a.num_active == 1 and b.num_active == 0
    asyncio.run(a.abort_all())
    assert a.epoch == 1 and b.epoch == 0
