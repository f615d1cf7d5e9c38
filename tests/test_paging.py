"""BlockManager and Scheduler on their own, without a model."""
from __future__ import annotations

from lmdeploy.messages import GenerationConfig
from lmdeploy.pytorch.engine.sequence import Sequence, SequenceStatus
from lmdeploy.pytorch.paging.block_manager import BlockManager
from lmdeploy.pytorch.paging.scheduler import Scheduler


def make_seq(seq_id: int, num_tokens: int, first: int = 0) -> Sequence:
    return Sequence(seq_id, list(range(first, first + num_tokens)), GenerationConfig(max_new_tokens=8))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretends the model computed every token of ``seq``."""
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    bm.register_full_blocks(seq)


def test_allocate_and_free_refcounts():
    bm = BlockManager(8, 4)
    seq = make_seq(0, 10)
    bm.allocate(seq, 10)
    assert len(seq.block_ids) == 3 and bm.num_free_blocks == 5
    assert all(bm.pools[0].blocks[b].ref_count == 1 for b in seq.block_ids)
    bm.free_blocks(seq)
    assert bm.num_free_blocks == 8 and seq.block_ids == []


def test_prefix_match_shares_blocks_and_leaves_one_token():
    bm = BlockManager(16, 4)
    first = make_seq(0, 12)
    compute_all(bm, first)
    same = make_seq(1, 12)
    matched = bm.match_prefix(same)
    assert matched.block_ids == first.block_ids[:2], 'the last full block is recomputed so one token is left'
    longer = make_seq(2, 14)
    assert bm.match_prefix(longer).block_ids == first.block_ids
    bm.allocate(longer, 14, bm.match_prefix(longer))
    assert all(bm.pools[0].blocks[b].ref_count == 2 for b in first.block_ids)


def test_hash_hit_checks_tokens():
    bm = BlockManager(16, 4)
    first = make_seq(0, 9)
    compute_all(bm, first)
    block = bm.pools[0].blocks[first.block_ids[0]]
    block.key = (99, 99, 99, 99)  # a hash collision in disguise
    assert bm.match_prefix(make_seq(1, 9)).block_ids == []


def test_cached_blocks_survive_free_and_are_evicted_lru():
    bm = BlockManager(4, 4)
    first = make_seq(0, 9)
    compute_all(bm, first)
    block_ids = list(first.block_ids)
    bm.free_blocks(first)
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    assert bm.match_prefix(make_seq(1, 9)).block_ids == block_ids[:2]
    hog = make_seq(2, 16, first=1000)
    bm.allocate(hog, 16)
    assert bm.num_cached_free_blocks == 0 and bm.pools[0].hash_to_block == {}
    assert bm.match_prefix(make_seq(3, 9)).block_ids == []


def test_scheduler_chunks_prefill_within_budget():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_batch_size=8, max_prefill_token_num=16)
    long_seq, short_seq = make_seq(0, 40), make_seq(1, 5, first=500)
    sched.add(long_seq)
    sched.add(short_seq)
    plan = sched.schedule()
    assert [(i.seq.seq_id, i.num_tokens) for i in plan.prefill] == [(0, 16)]
    long_seq.num_computed += 16
    plan = sched.schedule()
    assert [(i.seq.seq_id, i.num_tokens) for i in plan.prefill] == [(0, 16)]


def two_decoding_seqs() -> tuple[BlockManager, Scheduler, Sequence, Sequence]:
    """Two 8-token prompts prefilled into all 4 blocks of a 4-token-block cache, each with one output
    token to decode: the next step must preempt one."""
    bm = BlockManager(4, 4)
    sched = Scheduler(bm, max_batch_size=8, max_prefill_token_num=64)
    a, b = make_seq(0, 8), make_seq(1, 8, first=100)
    sched.add(a)
    sched.add(b)
    sched.schedule()
    for seq in (a, b):
        seq.num_computed = 8
        seq.output_ids.append(1)
    return bm, sched, a, b


def test_scheduler_preempts_latest_and_requeues_it_first():
    bm, sched, a, b = two_decoding_seqs()
    assert bm.num_free_blocks == 0
    plan = sched.schedule()
    assert [i.seq.seq_id for i in plan.decode] == [0]
    assert b.status == SequenceStatus.WAITING and sched.waiting[0] is b and b.block_ids == []
    assert b.num_computed == 0 and sched.num_preemptions == 1
    assert len(a.block_ids) == 3
    sched.finish(a)
    assert bm.num_free_blocks == 4


def test_a_readmitted_sequence_waits_for_all_its_blocks_and_is_not_the_next_victim():
    """b, preempted while c (a token in flight) could not be, comes back once the blocks for all its tokens are
    free, ahead of c, and is not preempted again while c and d, which came after it, run."""
    bm = BlockManager(7, 4)
    sched = Scheduler(bm, max_batch_size=8, max_prefill_token_num=64)
    a, b, c, d = (make_seq(i, 8, first=100 * i) for i in range(4))
    for seq in (a, b, c):
        sched.add(seq)
    sched.schedule()
    for seq in (a, b, c):
        seq.num_computed = 8
        seq.output_ids.append(1)
    c.num_computed, c.num_inflight = 9, 1
    sched.schedule()  # a takes the free block; b needs one and c cannot be preempted: b is
    assert b.status == SequenceStatus.WAITING and bm.num_free_blocks == 2, 'its 9 tokens take 3 blocks'
    sched.finish(a)
    sched.add(d)
    c.num_inflight, c.num_computed, c.output_ids = 0, 11, [1, 2, 3, 4]
    plan = sched.schedule()
    assert [item.seq for item in plan.prefill] == [b, d] and bm.num_free_blocks == 0
    b.num_computed, d.num_computed, c.num_computed, d.num_inflight = 8, 8, 12, 1
    c.output_ids.append(5)
    d.output_ids.append(1)
    plan = sched.schedule()  # b and c each need a block, d has a token in flight: c, after b, gives its blocks
    assert [item.seq for item in plan.decode] == [b, d]
    assert c.status == SequenceStatus.WAITING and b.num_preemptions == 1 and sched.num_preemptions == 2


def test_scheduler_respects_max_batch_size():
    bm = BlockManager(64, 4)
    sched = Scheduler(bm, max_batch_size=2, max_prefill_token_num=256)
    for i in range(5):
        sched.add(make_seq(i, 3, first=10 * i))
    plan = sched.schedule()
    assert len(plan.prefill) == 2 and len(sched.waiting) == 3


def test_hit_rate_counts_a_blocked_request_once():
    bm = BlockManager(6, 4)
    sched = Scheduler(bm, max_batch_size=8, max_prefill_token_num=64)
    first = make_seq(0, 12)
    compute_all(bm, first)
    bm.free_blocks(first)  # its 3 full blocks stay cached
    hog = make_seq(1, 12, first=1000)  # takes the 3 blocks that hold nothing
    sched.add(hog)
    sched.schedule()
    hog.num_computed = 12
    waiting = make_seq(2, 14)  # 3 full blocks, all cached
    sched.add(waiting)
    for _ in range(5):  # blocked: besides its 3 cached blocks (all that is free) it needs a fresh one
        sched.schedule()
        assert sched.waiting[0] is waiting and waiting.block_ids == []
    assert (bm.num_queries, bm.num_hits) == (3, 0), 'only the hog was counted (3 blocks, no hit)'
    sched.finish(hog)
    plan = sched.schedule()
    assert [item.seq for item in plan.prefill] == [waiting]
    assert (bm.num_queries, bm.num_hits) == (6, 3)
    sched.schedule()
    assert (bm.num_queries, bm.num_hits) == (6, 3)


def test_hit_rate_counts_a_preempted_request_once():
    bm, sched, a, b = two_decoding_seqs()
    for seq in (a, b):
        bm.register_full_blocks(seq)
    assert (bm.num_queries, bm.num_hits) == (4, 0)
    sched.schedule()  # b is preempted
    assert sched.waiting[0] is b
    sched.finish(a)
    sched.schedule()  # b comes back, finding its first block in the prefix cache
    assert b in sched.running and b.num_computed == 4
    assert (bm.num_queries, bm.num_hits) == (4, 0)
