"""A fixed pool of KV-cache blocks: reference counts, an LRU free queue and the prefix cache.

Every block is always in exactly one of two states:
- in use: ``ref_count > 0``, owned by one or more requests, not in the free queue;
- free: ``ref_count == 0``, in the free queue. A free block may still carry a ``block_hash``: its
  K/V stay valid and a later request with the same prefix can take it back (:meth:`touch`) until
  it is handed out again by :meth:`get_new_blocks`, which evicts it (drops the hash) lazily.

The free queue is ordered for eviction: the head is evicted first. Blocks enter at the tail when
their last owner frees them, so the least recently freed cached block is evicted first (LRU).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class KVBlock:
    """One KV-cache block. Compared by identity."""

    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_count}, hash={self.block_hash})"


class BlockPool:
    """Blocks ``0..num_blocks-1``; initially all free, handed out in id order."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0 (got {num_blocks})")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, head first. OrderedDict: O(1) pop at the head, O(1) removal anywhere.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[int, KVBlock] = {}  # block_hash -> the block holding that prefix

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref_count > 0)."""
        return 1.0 - len(self._free) / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next evicted) first. For tests and debugging."""
        return list(self._free)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ref_count 1.

        A taken block that is still in the prefix cache is evicted now (its hash is dropped).
        """
        if num_blocks > len(self._free):
            raise ValueError(f"cannot take {num_blocks} blocks: only {len(self._free)} are free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one owner to each block (prefix-cache hits); free ones leave the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one owner from each block; blocks left without owners join the free queue's tail.

        Pass them in eviction order: the first one to reach ref_count 0 is evicted first.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self._cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: int) -> bool:
        """Register a full, in-use block under ``block_hash``.

        Returns False (and leaves the block uncached) when that hash already names another block:
        the same prefix computed twice keeps the first copy, the second is freed as a plain block.
        """
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (e.g. after new weights); returns how many were dropped.

        Blocks in use keep their contents and owners; they are just no longer shareable.
        """
        dropped = len(self._cached)
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return dropped

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            block.block_hash = None
