"""Paged KV-cache bookkeeping: ref-counted blocks in one or two pools and a prefix cache keyed by chained
block hashes."""
from __future__ import annotations

from dataclasses import dataclass

from lmdeploy.pytorch.engine.sequence import Sequence
from lmdeploy.pytorch.paging.block_pool import BlockPool

# the Sequence attribute holding each pool's block table, in pool order
TABLES = ('block_ids', 'window_block_ids')


def chain_hash(prev_hash: int | None, key: tuple) -> int:
    """The hash of a full block given its key (see ``Sequence.block_key``) and the hash of the block before it."""
    return hash((prev_hash, key))


def given_back_as_zero(table: list[int | None]) -> list[int]:
    """A block table whose given-back entries (a prefix of None) read block 0, for the kernels."""
    if not table or table[0] is not None:
        return table
    return [0 if b is None else b for b in table]


@dataclass
class PrefixMatch:
    """A cached prefix of ``num_blocks`` full blocks: its block hashes and, per pool, the blocks to revive
    (None where a sliding-window pool needs no block)."""

    num_blocks: int
    hashes: list[int]
    tables: list[list[int | None]]

    @property
    def block_ids(self) -> list[int | None]:
        """The first pool's blocks."""
        return self.tables[0]


class BlockManager:
    """Hands out KV blocks to sequences, from one pool per kind of layer.

    Without ``window`` one pool serves every layer. With it, the layers attend over a sliding window of
    ``window`` tokens (or within attention chunks of ``window`` tokens, which never reach further back): with ``num_window_blocks`` as well, the sliding layers have a pool of their own
    (``Sequence.window_block_ids``) beside the full layers' pool of ``num_blocks`` (``Sequence.block_ids``);
    without it every layer slides and the one pool is the sliding one. A sliding pool gives back a
    sequence's blocks that fell out of its window: their place in the sequence's table becomes None.

    A cached prefix can be revived when every pool still holds what computing the next token needs: the
    full pools its every block, the sliding pools the blocks of its last ``window - 1`` tokens.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: int | None = None, num_window_blocks: int | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        if num_window_blocks is None:
            self.pools = [BlockPool(num_blocks, window)]
        else:
            self.pools = [BlockPool(num_blocks), BlockPool(num_window_blocks, window)]
        # prefix-cache hit rate: full blocks looked up and found, counted once per request, when it is
        # first admitted (a request waiting for blocks is looked up again every step, a preempted one
        # again when it is readmitted: neither counts again)
        self.num_queries = 0
        self.num_hits = 0
        self._lookup: tuple[Sequence, int] | None = None  # the last match_prefix: its sequence and full blocks

    @property
    def num_blocks(self) -> int:
        """Blocks of all pools."""
        return sum(pool.num_blocks for pool in self.pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(pool.num_free_blocks for pool in self.pools)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold reusable prefix-cache content."""
        return sum(pool.num_cached_free_blocks for pool in self.pools)

    def token_capacity(self, max_chunk_tokens: int) -> int | None:
        """The most tokens one sequence can hold alone: what the first pool's blocks hold, or None (no bound)
        where that pool slides and holds a window and a prefill chunk of ``max_chunk_tokens`` tokens."""
        pool, bs = self.pools[0], self.block_size
        if pool.window is not None and pool.num_blocks >= -(-(pool.window - 1 + max_chunk_tokens) // bs) + 1:
            return None
        return pool.num_blocks * bs

    def _tables(self, seq: Sequence) -> list[tuple[BlockPool, list[int | None]]]:
        return [(pool, getattr(seq, name)) for pool, name in zip(self.pools, TABLES)]

    def match_prefix(self, seq: Sequence) -> PrefixMatch:
        """Cached blocks holding a prefix of ``seq``; at least one token is always left to compute, and the
        prefix never ends inside one of its bidirectional spans. A sequence that asks for prompt logprobs
        computes its whole prompt."""
        bs = self.block_size
        hashes: list[int] = []
        found: list[list[int | None]] = [[] for _ in self.pools]
        if self.enable_prefix_caching and seq.gen_config.prompt_logprobs is None:
            prev = None
            for start in range(0, seq.num_tokens - bs, bs):
                key = seq.block_key(start, bs)
                prev = chain_hash(prev, key)
                ids = [pool.cached(prev, key) for pool in self.pools]
                if self.pools[0].window is None and ids[0] is None:
                    break
                hashes.append(prev)
                for column, block_id in zip(found, ids):
                    column.append(block_id)
        num_blocks = len(hashes)
        while num_blocks and (seq.span_start_before(num_blocks * bs) < num_blocks * bs or any(
                ids[i] is None for pool, ids in zip(self.pools, found)
                for i in range(pool.first_kept_block(num_blocks * bs, bs), num_blocks))):
            num_blocks -= 1
        tables = []
        for pool, ids in zip(self.pools, found):
            first = pool.first_kept_block(num_blocks * bs, bs)
            tables.append([None] * first + ids[first:num_blocks])
        self._lookup = (seq, seq.num_tokens // bs)
        return PrefixMatch(num_blocks, hashes[:num_blocks], tables)

    def blocks_needed(self, seq: Sequence, num_tokens: int, match: PrefixMatch | None = None) -> list[int]:
        """Per pool, the fresh blocks ``seq`` takes to hold ``num_tokens`` tokens (after the ``match``ed
        prefix it revives, when it has no blocks yet)."""
        total = -(-num_tokens // self.block_size)
        if match is not None:
            return [total - match.num_blocks] * len(self.pools)
        return [total - len(table) for _, table in self._tables(seq)]

    def can_allocate(self, needed: list[int], match: PrefixMatch | None = None) -> bool:
        """Whether every pool has its ``needed`` fresh blocks once the ``match``ed cached ones are taken."""
        revived = match.tables if match is not None else [[] for _ in self.pools]
        return all(n <= pool.num_free_blocks - pool.num_taken_from_free(ids)
                   for n, pool, ids in zip(needed, self.pools, revived))

    def allocate(self, seq: Sequence, num_tokens: int, match: PrefixMatch | None = None) -> None:
        """Gives ``seq`` the ``match``ed prefix blocks, then fresh ones until ``num_tokens`` fit (a running
        sequence gives back what its sliding pool no longer needs first: :meth:`release_out_of_window`).

        Admitting a sequence right after its :meth:`match_prefix` counts that lookup in the hit rate,
        the first time the sequence is admitted only."""
        if self._lookup is not None and self._lookup[0] is seq and not seq.block_ids and not seq.window_block_ids:
            if seq.num_preemptions == 0:
                self.num_queries += self._lookup[1]
                self.num_hits += match.num_blocks if match is not None else 0
            self._lookup = None
        if match is not None:
            for (pool, table), revived in zip(self._tables(seq), match.tables):
                for block_id in revived:
                    if block_id is not None:
                        pool.ref(block_id)
                    table.append(block_id)
            seq.block_hashes.extend(match.hashes)
        total = -(-num_tokens // self.block_size)
        for pool, table in self._tables(seq):
            while len(table) < total:
                table.append(pool.take())

    def release_out_of_window(self, seq: Sequence) -> None:
        """Gives back the blocks of ``seq`` that its sliding pools' window no longer reaches from its next
        token (``seq.num_computed``); idempotent. A step still in flight may read them: it runs before the
        next step, queued after it on the same stream, can write them."""
        for pool, table in self._tables(seq):
            index = min(pool.first_kept_block(seq.num_computed, self.block_size), len(table)) - 1
            while index >= 0 and table[index] is not None:
                pool.unref(table[index])
                table[index] = None
                index -= 1

    def free_blocks(self, seq: Sequence) -> None:
        """Drops ``seq``'s references; its tail blocks become the first to be evicted."""
        for pool, table in self._tables(seq):
            for block_id in reversed(table):
                if block_id is not None:
                    pool.unref(block_id)
            table.clear()
        seq.block_hashes.clear()

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publishes the blocks of ``seq`` that have become full of computed tokens (those still held)."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for index in range(len(seq.block_hashes), seq.num_computed // bs):
            key = seq.block_key(index * bs, bs)
            prev = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = chain_hash(prev, key)
            seq.block_hashes.append(block_hash)
            for pool, table in self._tables(seq):
                if table[index] is not None:
                    pool.publish(table[index], block_hash, key)
