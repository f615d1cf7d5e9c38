"""Paged KV-cache bookkeeping: ref-counted blocks and a prefix cache keyed by chained block hashes."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from lmdeploy.pytorch.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    key: tuple = ()


def chain_hash(prev_hash: int | None, key: tuple) -> int:
    """The hash of a full block given its key (see ``Sequence.block_key``) and the hash of the block before it."""
    return hash((prev_hash, key))


class BlockManager:
    """Hands out KV blocks to sequences.

    Free blocks wait in LRU order; a free block that still holds a full, hashed block of tokens
    can be revived by a later request with the same prefix until it is evicted for reuse.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        # prefix-cache hit rate: full blocks looked up and found, counted once per request, when it is
        # first admitted (a request waiting for blocks is looked up again every step, a preempted one
        # again when it is readmitted: neither counts again)
        self.num_queries = 0
        self.num_hits = 0
        self._lookup: tuple[Sequence, int] | None = None  # the last match_prefix: its sequence and full blocks

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold reusable prefix-cache content."""
        return sum(1 for block_id in self.free if self.blocks[block_id].hash is not None)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq``; at least one token is always left to compute. A
        sequence that asks for prompt logprobs computes its whole prompt."""
        if not self.enable_prefix_caching or seq.gen_config.prompt_logprobs is not None:
            return []
        num_tokens, bs = seq.num_tokens, self.block_size
        matched: list[int] = []
        prev = None
        for start in range(0, num_tokens - bs, bs):
            key = seq.block_key(start, bs)
            prev = chain_hash(prev, key)
            block_id = self.hash_to_block.get(prev)
            if block_id is None or self.blocks[block_id].key != key:
                break
            matched.append(block_id)
        self._lookup = (seq, num_tokens // bs)
        return matched

    def can_allocate(self, num_new_blocks: int, revived: list[int] = ()) -> bool:
        """Whether ``num_new_blocks`` fresh blocks fit once the ``revived`` cached ones are taken."""
        taken_from_free = sum(1 for b in revived if self.blocks[b].ref_count == 0)
        return num_new_blocks <= self.num_free_blocks - taken_from_free

    def allocate(self, seq: Sequence, num_tokens: int, revived: list[int] = ()) -> None:
        """Gives ``seq`` the ``revived`` prefix blocks, then fresh ones until ``num_tokens`` fit.

        Admitting a sequence right after its :meth:`match_prefix` counts that lookup in the hit rate,
        the first time the sequence is admitted only."""
        if self._lookup is not None and self._lookup[0] is seq and not seq.block_ids:
            if seq.num_preemptions == 0:
                self.num_queries += self._lookup[1]
                self.num_hits += len(revived)
            self._lookup = None
        for block_id in revived:
            self._ref(block_id)
            seq.block_ids.append(block_id)
            seq.block_hashes.append(self.blocks[block_id].hash)
        while len(seq.block_ids) < self.blocks_needed(num_tokens):
            block_id, _ = self.free.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                del self.hash_to_block[block.hash]
                block.hash, block.key = None, ()
            block.ref_count = 1
            seq.block_ids.append(block_id)

    def free_blocks(self, seq: Sequence) -> None:
        """Drops ``seq``'s references; its tail blocks become the first to be evicted."""
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_ids.clear()
        seq.block_hashes.clear()

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publishes the blocks of ``seq`` that have become full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for index in range(len(seq.block_hashes), seq.num_computed // bs):
            key = seq.block_key(index * bs, bs)
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = chain_hash(prev, key)
            seq.block_hashes.append(block_hash)
            block = self.blocks[seq.block_ids[index]]
            if block_hash not in self.hash_to_block:
                self.hash_to_block[block_hash] = block.block_id
                block.hash, block.key = block_hash, key

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1
