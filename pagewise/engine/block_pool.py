"""Physical KV blocks: ref counts, the LRU free queue and the prefix-cache map from block hash to block."""

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
    """Doubly linked list of free blocks. Its order is the eviction order: allocation takes the head.

    Freed blocks join at the tail, so the least recently freed block is evicted first; removal of a block from
    the middle (a prefix-cache hit on a free block) is O(1).
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

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
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


class BlockPool:
    """All KV blocks of the engine. Invariant: ``num_free + blocks in use == num_blocks``; a block is in the free
    queue exactly when its ref count is 0; every hash in the cache map points at a block carrying that hash."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, count: int) -> list[KVBlock]:
        """Take ``count`` blocks from the head of the free queue, evicting their cached hashes."""
        if count > self.num_free:
            raise ValueError(f"need {count} free blocks, have {self.num_free}")
        taken = []
        for _ in range(count):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference to each block (a prefix hit or a fork), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block, in the given order; blocks reaching 0 join the queue's tail."""
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block.block_id} freed with ref count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

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
