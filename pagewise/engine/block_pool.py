"""Physical KV blocks: ref counts, the LRU free queue, the prefix-cache map from block hash to block, and where a
request's blocks are placed (runs of neighbouring blocks, in extents)."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass


def hash_block_tokens(parent: bytes | None, token_ids: Sequence[int], extra: tuple = ()) -> bytes:
    """Chain hash of a full block: equal hashes mean equal prefixes (and equal tenant salt, kept in block 0)."""
    payload = pickle.dumps((parent, tuple(token_ids), extra), protocol=5)
    return hashlib.sha256(payload).digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    """A physical KV block. ``block_hash`` is set once the block is full and registered in the prefix cache."""

    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    prev_free: KVBlock | None = None
    next_free: KVBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed first: the eviction order where the pool's
    placement leaves the choice to it (``BlockPool``).

    Freed blocks join at the tail; removal of a block from the middle (a prefix-cache hit on a free block, a
    block placed next to its request's last one) is O(1).
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def head(self) -> KVBlock:
        """The least recently freed block (not removed)."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self._len += 1

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self._len -= 1


# Tokens of KV a request's blocks are kept together in, where the engine sets the pool's extents
# (``extent_blocks``). Decode attention on a CPU reads a sequence's blocks one after another, and 16-token blocks
# scattered over the cache read at half the rate of blocks in runs (12.0 vs 23.2 GB/s in ``pagewise bench step``
# at 1,024 tokens on an AMD EPYC Zen 4 with AVX512-BF16); in its engine, extents of 32, 128 and 512 tokens came
# out within noise of each other (docs/benchmarks.md, "a sequence's blocks kept together"), and the smaller the
# extent, the closer eviction stays to LRU. Other CPUs of this kind are not measured yet.
EXTENT_TOKENS = 128


def extent_blocks(block_size: int) -> int:
    """Blocks per extent for ``block_size``-token blocks: ``EXTENT_TOKENS`` of them, at least one."""
    return max(1, EXTENT_TOKENS // block_size)


class BlockPool:
    """All KV blocks of the engine. Invariant: ``num_free + blocks in use == num_blocks``; a block is in the free
    queue exactly when its ref count is 0; every hash in the cache map points at a block carrying that hash.

    Placement. With ``extent_blocks`` > 1 the block ids fall in extents of that many neighbours, and an allocation
    given the block it follows (``after``: the requester's last block) takes, in this order: the block after that
    one, if free and in the same extent, or if it begins a wholly free extent and holds no cached prefix; the
    first block of the extent that has been wholly free the longest; the head of the free queue. So a request's
    blocks form runs as long as an extent while wholly free extents remain, and the free queue's LRU order
    decides only once they are gone. Cached prefixes are evicted by extent, the one wholly freed longest ago
    first (never a younger one for the sake of a longer run: its first block would be the head of a cached
    chain, and a chain is hit from its head), the blocks of an extent as a request grows into them — whatever
    they hold: a run entered at an uncached first block takes the rest of that extent too. Placement
    never refuses a block: any ``count <= num_free`` is served. With ``extent_blocks`` 1 allocation takes the
    free queue's head, exact LRU.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, extent_blocks: int = 1) -> None:
        if extent_blocks < 1:
            raise ValueError(f"extent_blocks must be at least 1, got {extent_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.extent_blocks = extent_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        num_extents = -(-num_blocks // extent_blocks)
        self._in_use = [0] * num_extents  # blocks with a reference, per extent
        # Wholly free extents, in the order they became so (a dict as an ordered set: O(1) removal anywhere).
        self._free_extents: dict[int, None] = dict.fromkeys(range(num_extents))

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int, after: int | None = None) -> list[KVBlock]:
        """Take ``count`` blocks, the first placed after block ``after`` where it can be (class docstring), each
        next one after the one before; their cached hashes are evicted."""
        if count > self.num_free:
            raise ValueError(f"need {count} free blocks, have {self.num_free}")
        taken = []
        for _ in range(count):
            block = self._place(after)
            self.free_queue.remove(block)
            self._evict(block)
            self._referenced(block)
            block.ref_count = 1
            taken.append(block)
            after = block.block_id
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference to each block (a prefix hit or a fork), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
                self._referenced(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block, in the given order; blocks reaching 0 join the queue's tail."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)
                self._released(block)

    def check_extents(self) -> list[int]:
        """Extents whose bookkeeping disagrees with their blocks' ref counts (empty when it is right)."""
        wrong = []
        for extent, in_use in enumerate(self._in_use):
            members = self.blocks[extent * self.extent_blocks : (extent + 1) * self.extent_blocks]
            actual = sum(1 for b in members if b.ref_count > 0)
            if in_use != actual or (extent in self._free_extents) != (actual == 0):
                wrong.append(extent)
        return wrong

    def _place(self, after: int | None) -> KVBlock:
        """The free block ``allocate`` takes next (class docstring); the pool has one."""
        size = self.extent_blocks
        if size == 1:
            return self.free_queue.head()
        if after is not None and after + 1 < self.num_blocks:
            following = self.blocks[after + 1]
            extent = following.block_id // size
            if following.ref_count == 0 and (
                extent == after // size or (extent in self._free_extents and following.block_hash is None)
            ):
                return following
        if self._free_extents:
            return self.blocks[next(iter(self._free_extents)) * size]
        return self.free_queue.head()

    def _referenced(self, block: KVBlock) -> None:
        """Count a free block's first new reference in its extent."""
        extent = block.block_id // self.extent_blocks
        if self._in_use[extent] == 0:
            del self._free_extents[extent]
        self._in_use[extent] += 1

    def _released(self, block: KVBlock) -> None:
        """Count a block's last reference gone from its extent; a wholly free extent joins the end of the order."""
        extent = block.block_id // self.extent_blocks
        self._in_use[extent] -= 1
        if self._in_use[extent] == 0:
            self._free_extents[extent] = None

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def register(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full block hittable. A hash already cached by another block keeps its first block."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only while no block is in use (returns False and changes nothing otherwise):
        a live request registers each of its blocks once, so a block unhashed under it would never be hittable
        again."""
        if self.num_free != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
