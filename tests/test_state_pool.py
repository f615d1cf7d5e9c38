"""The recurrent-state pool of models with linear-attention layers: a slot per admitted sequence, given back
on finish, abort and preemption; a sequence that finds no free slot waits."""
from __future__ import annotations

import random

import pytest

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.engine.sequence import Sequence, SequenceStatus
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.scheduler import Scheduler, SchedulerOutput, recurrent_grain
from lmdeploy.pytorch.paging.state_pool import StatePool


def make_seq(seq_id: int, num_tokens: int) -> Sequence:
    return Sequence(seq_id, list(range(100 * seq_id, 100 * seq_id + num_tokens)), GenerationConfig(max_new_tokens=8))


def make_scheduler(num_blocks: int, num_slots: int, max_batch_size: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4, enable_prefix_caching=False), max_batch_size, 64,
                     state_pool=StatePool(num_slots))


def computed(sched: Scheduler) -> None:
    """Marks every scheduled token computed and gives each running sequence one new token."""
    for seq in sched.running:
        seq.num_computed = seq.num_tokens
        seq.output_ids.append(1)


def run_step(sched: Scheduler) -> SchedulerOutput:
    """Schedules a step and marks its tokens computed, each sampling sequence given one new token."""
    plan = sched.schedule()
    for item in plan.prefill + plan.decode:
        samples = item.samples
        item.seq.num_computed += item.num_tokens
        if samples:
            item.seq.output_ids.append(1)
    return plan


def test_take_and_give_back():
    pool = StatePool(2)
    a, b, c = make_seq(0, 3), make_seq(1, 3), make_seq(2, 3)
    pool.take(a)
    pool.take(b)
    assert {a.state_slot, b.state_slot} == {0, 1} and pool.num_free == 0
    with pytest.raises(RuntimeError, match='no free'):
        pool.take(c)
    with pytest.raises(RuntimeError, match='already holds'):
        pool.take(a)
    slot = a.state_slot
    pool.give_back(a)
    pool.give_back(a)
    assert a.state_slot is None and pool.num_free == 1
    pool.take(c)
    assert c.state_slot == slot
    with pytest.raises(ValueError, match='at least one slot'):
        StatePool(0)


def test_exhausted_pool_queues_the_rest():
    sched = make_scheduler(64, num_slots=2)
    seqs = [make_seq(i, 5) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    plan = sched.schedule()
    assert [item.seq for item in plan.prefill] == seqs[:2]
    assert list(sched.waiting) == seqs[2:] and all(seq.block_ids == [] for seq in seqs[2:])
    computed(sched)
    assert not sched.schedule().prefill  # still no free slot
    sched.finish(seqs[0])
    assert seqs[0].state_slot is None
    plan = sched.schedule()
    assert [item.seq for item in plan.prefill] == [seqs[2]] and seqs[2].state_slot is not None
    assert [item.seq for item in plan.decode] == [seqs[1]]


def test_abort_of_running_and_waiting_gives_back():
    sched = make_scheduler(64, num_slots=1)
    a, b = make_seq(0, 5), make_seq(1, 5)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    assert a.state_slot == 0 and b.state_slot is None
    sched.finish(b)  # waiting: holds nothing
    sched.finish(a)
    assert sched.state_pool.num_free == 1 and a.status == SequenceStatus.FINISHED


def test_preemption_gives_back_the_slot():
    """Two 8-token sequences fill all 4 blocks; the next decode step preempts the later one, whose slot goes back
    until it is admitted again."""
    sched = make_scheduler(4, num_slots=2)
    a, b = make_seq(0, 8), make_seq(1, 8)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    computed(sched)
    plan = sched.schedule()
    assert [item.seq for item in plan.decode] == [a] and sched.num_preemptions == 1
    assert b.state_slot is None and b.num_computed == 0 and sched.state_pool.num_free == 1
    sched.finish(a)
    plan = sched.schedule()
    assert [item.seq for item in plan.prefill] == [b] and b.state_slot is not None


@pytest.mark.parametrize('seed', range(5))
def test_random_traffic_never_shares_or_leaks_a_slot(seed):
    """Random arrivals, aborts and finishes over a small cache (so that sequences get preempted) and a pool smaller
    than the batch: no two admitted sequences share a slot, every running one holds one, and all come back."""
    rng = random.Random(seed)
    sched = make_scheduler(12, num_slots=3, max_batch_size=5)
    pool, live, next_id = sched.state_pool, [], 0
    for _ in range(300):
        if rng.random() < 0.4:
            seq = make_seq(next_id, rng.randint(1, 20))
            next_id += 1
            sched.add(seq)
            live.append(seq)
        if live and rng.random() < 0.15:
            sched.finish(live.pop(rng.randrange(len(live))))
        run_step(sched)
        for seq in [s for s in sched.running if s.num_generated >= 8]:
            sched.finish(seq)
            live.remove(seq)
        slots = [seq.state_slot for seq in sched.running]
        assert None not in slots and len(set(slots)) == len(slots)
        assert all(seq.state_slot is None for seq in sched.waiting)
        assert pool.num_free == pool.num_slots - len(slots)
    assert sched.num_preemptions > 0
    for seq in live:
        sched.finish(seq)
    assert pool.num_free == pool.num_slots and sched.block_manager.num_free_blocks == 12


def test_recurrent_grain_leaves_room_for_a_full_batchs_decode_rows():
    """The delta rule's 64-token chunk where a budget holds it beside the other sequences' decode rows (the default
    4096 beside 63), else the room those rows leave, but half the budget at the least; none without a recurrent
    chunk."""
    cases = {(4096, 64): 64, (127, 64): 64, (126, 64): 63, (100, 64): 50, (100, 32): 64, (16, 4): 13, (16, 64): 8,
             (5, 1): 5, (1, 64): 1}
    assert {case: recurrent_grain(64, *case) for case in cases} == cases
    assert recurrent_grain(0, 16, 4) == 0
    few_slots = Scheduler(BlockManager(8, 4), 64, 100, state_pool=StatePool(4), recurrent_chunk=64)
    assert few_slots.recurrent_grain == 64  # 4 slots: at most 3 other rows


@pytest.mark.parametrize('seed', range(3))
def test_prefill_chunks_are_one_grain_and_the_first_in_prefill_always_runs(seed):
    """A budget of 16 beside up to 3 other sequences (grain 13), random arrivals: every prefill chunk is its
    prompt's next 13 tokens from a multiple of 13 (or the rest), whatever else runs, and the earliest arrived
    running sequence in prefill gets its chunk in every step (before: chunks ended where the budget did)."""
    rng = random.Random(seed)
    sched = Scheduler(BlockManager(256, 4, enable_prefix_caching=False), 4, 16, state_pool=StatePool(4),
                      recurrent_chunk=64)
    next_id, finished = 0, 0
    for _ in range(200):
        if rng.random() < 0.3:
            sched.add(make_seq(next_id, rng.randint(1, 60)))
            next_id += 1
        in_prefill = [seq for seq in sched.running if seq.num_computed < seq.prefill_end]
        plan = run_step(sched)
        for item in plan.prefill:
            start = item.seq.num_computed - item.num_tokens
            assert start % 13 == 0 and item.num_tokens == min(13, item.seq.prefill_end - start)
        assert not in_prefill or in_prefill[0] in [item.seq for item in plan.prefill]
        for seq in [s for s in sched.running if s.num_generated >= 8]:
            sched.finish(seq)
            finished += 1
    assert finished > 30 and not sched.num_preemptions
