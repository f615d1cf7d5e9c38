"""InferInstManager: bounded admission, FIFO hand-over, and instances that always come back."""
from __future__ import annotations

import asyncio
import threading

import pytest

from lmdeploy.serve.inst_manager import InferInstManager
from lmdeploy.serve.session_manager import Request


def pool(size: int = 2) -> InferInstManager:
    return InferInstManager(engine_loop=None, size=size)


def test_acquire_blocks_when_all_busy_and_hands_over_fifo():
    manager = pool(2)

    async def main():
        first = [await manager.acquire(Request(0)) for _ in range(2)]
        assert manager.num_busy == 2
        order = []

        async def wait(name):
            inst = await manager.acquire(Request(0))
            order.append(name)
            return inst
        waiters = [asyncio.ensure_future(wait(n)) for n in 'abc']
        await asyncio.sleep(0.01)
        assert manager.num_waiting == 3 and not order
        manager.release(first[0])
        manager.release(first[1])
        got = await asyncio.gather(*waiters[:2])
        assert order == ['a', 'b'] and {i.inst_id for i in got} == {0, 1}
        manager.release(got[0])
        manager.release(await waiters[2])
        manager.release(got[1])
    asyncio.run(main())
    assert manager.num_busy == 0 and manager.num_waiting == 0


def test_instance_comes_back_on_exception_and_cancellation():
    manager = pool(1)

    async def main():
        with pytest.raises(RuntimeError):
            async with manager.instance(Request(0)):
                raise RuntimeError('boom')
        assert manager.num_busy == 0
        entered = asyncio.Event()

        async def hold():
            async with manager.instance(Request(0)):
                entered.set()
                await asyncio.sleep(10)
        holder = asyncio.ensure_future(hold())
        await entered.wait()
        waiter = asyncio.ensure_future(manager.acquire(Request(0)))
        await asyncio.sleep(0.01)
        waiter.cancel()  # cancelled while waiting: leaves no trace
        holder.cancel()  # cancelled while holding: gives the instance back
        await asyncio.gather(holder, waiter, return_exceptions=True)
        assert manager.num_busy == 0 and manager.num_waiting == 0
    asyncio.run(main())


def test_cancel_right_after_hand_over_returns_the_instance():
    manager = pool(1)

    async def main():
        held = await manager.acquire(Request(0))
        waiter = asyncio.ensure_future(manager.acquire(Request(0)))
        await asyncio.sleep(0)
        manager.release(held)  # hand-over scheduled ...
        waiter.cancel()  # ... and the waiter cancelled before it runs
        await asyncio.gather(waiter, return_exceptions=True)
        await asyncio.sleep(0)
        assert manager.num_busy == 0
    asyncio.run(main())


def test_abort_while_waiting_returns_none():
    manager = pool(1)

    async def main():
        held = await manager.acquire(Request(0))
        request = Request(0)
        waiter = asyncio.ensure_future(manager.acquire(request))
        await asyncio.sleep(0.01)
        assert request.abort() is None
        assert await waiter is None
        manager.release(held)
        async with manager.instance(request) as inst:
            assert inst is not None  # an aborted request may still be admitted; generate checks
    asyncio.run(main())
    assert manager.num_busy == 0


def test_release_from_another_thread_wakes_a_waiter_on_its_loop():
    manager = pool(1)

    async def main():
        held = await manager.acquire(Request(0))
        waiter = asyncio.ensure_future(manager.acquire(Request(0)))
        await asyncio.sleep(0.01)
        thread = threading.Thread(target=manager.release, args=(held,))
        thread.start()
        inst = await asyncio.wait_for(waiter, 5)
        thread.join()
        manager.release(inst)
    asyncio.run(main())
    assert manager.num_busy == 0


def test_waiters_on_different_loops():
    manager = pool(1)
    results = []

    def worker():
        async def main():
            async with manager.instance(Request(0)) as inst:
                await asyncio.sleep(0.01)
                results.append(inst.inst_id)
        asyncio.run(main())
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [0] * 4 and manager.num_busy == 0


def test_managers_are_independent():
    a, b = pool(1), pool(1)

    async def main():
        inst = await a.acquire(Request(0))
        assert b.num_busy == 0 and (await b.acquire(Request(0))) is not inst
    asyncio.run(main())
