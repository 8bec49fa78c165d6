"""Per-request KV-cache bookkeeping on top of the block pool: prefix lookup, allocation, free.

A request owns a list of blocks; block ``j`` holds the K/V of tokens ``j*block_size ..
(j+1)*block_size - 1``. Prefix caching (vLLM v1 style) caches a block at allocation time, as soon
as the tokens scheduled in that step fill it: the worker writes a layer's K/V for the whole batch
before that layer's attention reads it, so even a request scheduled later in the same step can
share the block.

The request's ``block_hashes`` are extended here, lazily, each time they are read: whenever the
manager looks at them they cover every full block of ``request.all_token_ids``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from lightwell.kvcache.block_pool import BlockPool, KVBlock
from lightwell.kvcache.hashing import extend_block_hashes

if TYPE_CHECKING:
    from lightwell.scheduler.request import Request


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0 (got {block_size})")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # req_id -> how many of its leading blocks were offered to the prefix cache already.
        self._num_cached: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(req_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks prefixing the request, and the tokens they hold.

        At least the last token is left uncomputed (the step must produce its logits), so hits are
        capped at ``(num_tokens - 1) // block_size`` blocks. Touches nothing: pass the blocks to
        :meth:`allocate_slots` to take them.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._sync_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = ()
    ) -> list[int] | None:
        """Give the request blocks for ``num_computed_tokens + hits + num_new_tokens`` tokens.

        ``new_computed_blocks`` are prefix hits from :meth:`get_computed_blocks`, only for a request
        that owns no blocks yet; their tokens count as computed on top of
        ``request.num_computed_tokens``. Returns the ids of the blocks added to the request (hits
        first, then fresh blocks), or None when too few blocks are free, changing nothing.
        """
        blocks = self._req_blocks.get(request.req_id, [])
        if not new_computed_blocks and self._fits(request, blocks, num_new_tokens):
            return []  # the common decode step: no new block, nothing newly full
        if new_computed_blocks and blocks:
            raise RuntimeError(f"prefix hits for {request.req_id}, which already owns blocks")
        num_hit_tokens = len(new_computed_blocks) * self.block_size
        total = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(new_computed_blocks)
        # Hits that sit in the free queue stop being free once touched.
        num_free = self.pool.num_free_blocks - sum(b.ref_count == 0 for b in new_computed_blocks)
        if num_needed > num_free:
            return None
        self.pool.touch(new_computed_blocks)
        added = list(new_computed_blocks) + self.pool.get_new_blocks(max(num_needed, 0))
        blocks.extend(added)
        self._req_blocks[request.req_id] = blocks
        if new_computed_blocks:
            self._num_cached[request.req_id] = len(new_computed_blocks)
        if self.enable_prefix_caching:
            num_full = min(total, request.num_tokens) // self.block_size
            self._cache_full_blocks(request, blocks, num_full)
        return [b.block_id for b in added]

    def _fits(self, request: Request, blocks: list[KVBlock], num_new_tokens: int) -> bool:
        total = request.num_computed_tokens + num_new_tokens
        if total > len(blocks) * self.block_size:
            return False
        if not self.enable_prefix_caching:
            return True
        num_full = min(total, request.num_tokens) // self.block_size
        return num_full <= self._num_cached.get(request.req_id, 0)

    def free(self, request: Request) -> None:
        """Return all the request's blocks, last block first, so its tail is evicted first."""
        blocks = self._req_blocks.pop(request.req_id, [])
        self._num_cached.pop(request.req_id, None)
        self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix; returns how many blocks were uncached."""
        return self.pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_full: int) -> None:
        start = self._num_cached.get(request.req_id, 0)
        if num_full <= start:
            return
        hashes = self._sync_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_cached[request.req_id] = num_full

    def _sync_hashes(self, request: Request) -> list[int]:
        if len(request.block_hashes) < request.num_tokens // self.block_size:
            salt = request.sampling_params.cache_salt
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, salt)
        return request.block_hashes
