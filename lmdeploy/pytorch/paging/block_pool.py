"""One pool of KV blocks: ref counts, free blocks in LRU order and the prefix cache's hashes."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    key: tuple = ()


class BlockPool:
    """The blocks of the layers that share one block table per sequence.

    ``window`` (None: the layers attend over every token) is the sliding window (or attention chunk) of the
    pool's layers: a sequence needs only the blocks that hold one of the last ``window - 1`` tokens before the
    next one it computes, and gives the others back. Free blocks wait in LRU order; a free block that still holds a
    full, hashed block of tokens can be revived by a later request with the same prefix until it is evicted
    for reuse.
    """

    def __init__(self, num_blocks: int, window: int | None = None):
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[int, int] = {}

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

    def first_kept_block(self, start: int, block_size: int) -> int:
        """The first block a sequence still needs when the next token it computes is at position ``start``."""
        if self.window is None:
            return 0
        return max(0, start - self.window + 1) // block_size

    def cached(self, block_hash: int, key: tuple) -> int | None:
        """The block holding the tokens of ``key`` after the prefix that ``block_hash`` chains, if cached."""
        block_id = self.hash_to_block.get(block_hash)
        if block_id is None or self.blocks[block_id].key != key:
            return None
        return block_id

    def num_taken_from_free(self, block_ids: list[int | None]) -> int:
        """How many of ``block_ids`` (None: no block) are free now, so that reviving them takes free blocks."""
        return sum(1 for b in block_ids if b is not None and self.blocks[b].ref_count == 0)

    def take(self) -> int:
        """A fresh block, the least recently freed; its cached content is forgotten."""
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            del self.hash_to_block[block.hash]
            block.hash, block.key = None, ()
        block.ref_count = 1
        return block_id

    def ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[block_id] = None

    def publish(self, block_id: int, block_hash: int, key: tuple) -> None:
        """Makes a block full of computed tokens findable by its hash, unless another block already is."""
        if block_hash not in self.hash_to_block:
            self.hash_to_block[block_hash] = block_id
            block = self.blocks[block_id]
            block.hash, block.key = block_hash, key
