"""Per-request block tables over the ``BlockPool``: prefix lookup, slot allocation, copy-on-write, fork,
free and swap.

Invariants kept here:
- a request holds exactly ``ceil(num_tokens_with_kv / block_size)`` blocks; a new block is taken only when the
  last one is full;
- a prefix hit never covers the last token of a request (it must be recomputed to produce logits);
- a block with ``ref_count > 1`` is never written: the first write copies it (``block_ops`` gets a ``copy``);
- freeing releases a request's blocks tail first, so its tail blocks are evicted before its head blocks;
- a request's new blocks are placed after its last one (``BlockPool.allocate``'s ``after``), except right after a
  prefix hit, whose last block sits among the blocks of the request that computed it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagewise.engine.block_pool import BlockPool, KVBlock
from pagewise.engine.request import Request


@dataclass(slots=True)
class BlockOp:
    """A block copy to run before the step's forward pass: ``copy`` (device→device), ``swap_out`` (device→
    host) or ``swap_in`` (host→device). Ops run in the order the scheduler decided them."""

    kind: str
    src: int
    dst: int


@dataclass(slots=True)
class SwapSpace:
    """Host-side block slots for swapped-out requests."""

    num_slots: int
    free_slots: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.free_slots = list(range(self.num_slots - 1, -1, -1))


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, num_swap_slots: int = 0) -> None:
        self.pool = pool
        self.block_size = block_size
        self.swap = SwapSpace(num_swap_slots)
        self.block_ops: list[BlockOp] = []

    def _blocks(self, request: Request) -> list[KVBlock]:
        return [self.pool.blocks[i] for i in request.block_ids]

    def lookup_prefix(self, request: Request) -> list[KVBlock]:
        """Cached blocks matching the request's leading full blocks, stopping before its last token."""
        if not self.pool.enable_caching:
            return []
        hits = []
        for block_hash in request.full_block_hashes(self.block_size, request.num_tokens - 1):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, prefix: list[KVBlock] | None = None
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of KV (after a prefix hit ``prefix``, at admission).

        Returns False and changes nothing if the pool cannot supply the blocks. On success the prefix blocks are
        referenced and ``num_computed_tokens`` covers them.
        """
        prefix = prefix or []
        num_computed = request.num_computed_tokens + len(prefix) * self.block_size
        num_held = len(request.block_ids) + len(prefix)
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size) - num_held
        write_index = num_computed // self.block_size
        needs_copy = (
            num_new_tokens > 0
            and write_index < len(request.block_ids)
            and self.pool.blocks[request.block_ids[write_index]].ref_count > 1
        )
        reusing_free = sum(1 for b in prefix if b.ref_count == 0)
        if max(num_needed, 0) + needs_copy + reusing_free > self.pool.num_free:
            return False
        after = request.block_ids[-1] if request.block_ids and not prefix else None
        if prefix:
            self.pool.touch(prefix)
            request.block_ids.extend(b.block_id for b in prefix)
            request.num_computed_tokens = num_computed
            request.num_registered_blocks = len(request.block_ids)
        if needs_copy:
            self._copy_on_write(request, write_index)
            after = request.block_ids[-1]
        if num_needed > 0:
            request.block_ids.extend(b.block_id for b in self.pool.allocate(num_needed, after))
        return True

    def _copy_on_write(self, request: Request, index: int) -> None:
        shared = self.pool.blocks[request.block_ids[index]]
        (fresh,) = self.pool.allocate(1)
        self.block_ops.append(BlockOp("copy", shared.block_id, fresh.block_id))
        self.pool.free([shared])
        request.block_ids[index] = fresh.block_id

    def register_full_blocks(self, request: Request) -> None:
        """Make the request's newly filled blocks (all their tokens computed) hittable in the prefix cache."""
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        hashes = request.full_block_hashes(self.block_size, num_full * self.block_size)
        for i in range(request.num_registered_blocks, num_full):
            self.pool.register(self.pool.blocks[request.block_ids[i]], hashes[i])
        request.num_registered_blocks = num_full

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks (shared, ref counts up) and its computed state."""
        self.pool.touch(self._blocks(parent))
        child.block_ids = list(parent.block_ids)
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = parent.num_registered_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first (so the tail is evicted first)."""
        self.pool.free(reversed(self._blocks(request)))
        request.block_ids = []
        request.num_registered_blocks = 0

    def release_swap(self, request: Request) -> None:
        self.swap.free_slots.extend(request.swap_slots)
        request.swap_slots = []

    def swap_out(self, request: Request) -> bool:
        """Copy the request's blocks to host slots and free them; False (nothing changed) if slots run out."""
        if len(request.block_ids) > len(self.swap.free_slots):
            return False
        slots = [self.swap.free_slots.pop() for _ in request.block_ids]
        self.block_ops.extend(
            BlockOp("swap_out", b, s) for b, s in zip(request.block_ids, slots, strict=True)
        )
        request.swap_slots = slots
        self.free(request)
        return True

    def swap_in(self, request: Request) -> bool:
        """Bring a swapped request's blocks back into fresh device blocks; False if the pool is short."""
        if len(request.swap_slots) > self.pool.num_free:
            return False
        blocks = self.pool.allocate(len(request.swap_slots))
        self.block_ops.extend(
            BlockOp("swap_in", s, b.block_id) for s, b in zip(request.swap_slots, blocks, strict=True)
        )
        request.block_ids = [b.block_id for b in blocks]
        self.release_swap(request)
        return True

    def check_accounting(self, live: Iterable[Request]) -> None:
        """Raise RuntimeError unless the ``live`` requests account for every block and swap slot: each block's ref
        count is the number of live requests holding it, the free queue holds exactly the unreferenced blocks,
        and each swap slot is either free or held by one live request."""
        holders: Counter[int] = Counter()
        held_slots: list[int] = []
        for request in live:
            holders.update(request.block_ids)
            held_slots += request.swap_slots
        wrong = [b.block_id for b in self.pool.blocks if b.ref_count != holders[b.block_id]]
        num_unreferenced = sum(1 for b in self.pool.blocks if b.ref_count == 0)
        slots = sorted(held_slots + self.swap.free_slots)
        extents = self.pool.check_extents()
        if wrong or extents or num_unreferenced != self.pool.num_free or slots != list(range(self.swap.num_slots)):
            raise RuntimeError(
                f"KV block accounting is broken: ref counts wrong for blocks {wrong[:8]}, "
                f"{num_unreferenced} unreferenced blocks vs {self.pool.num_free} free, "
                f"in-use counts wrong for extents {extents[:8]}, "
                f"{len(slots)} swap slots accounted of {self.swap.num_slots}"
            )

    def take_block_ops(self) -> list[BlockOp]:
        ops, self.block_ops = self.block_ops, []
        return ops
