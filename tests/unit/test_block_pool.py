"""BlockPool: allocation order, reference counts, LRU free queue, lazy eviction, hashing."""

from __future__ import annotations

import pytest

from lightwell.kvcache.block_pool import BlockPool
from lightwell.kvcache.hashing import (
    compute_block_hashes,
    extend_block_hashes,
    hash_block_tokens,
)


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_new_pool_hands_out_blocks_in_id_order() -> None:
    pool = BlockPool(6)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4, 5]
    first = pool.get_new_blocks(2)
    second = pool.get_new_blocks(3)
    assert ids(first) == [0, 1]
    assert ids(second) == [2, 3, 4]
    assert all(b.ref_count == 1 for b in first + second)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(5 / 6)


def test_taking_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="only 1 are free"):
        pool.get_new_blocks(2)
    assert pool.free_block_ids() == [2]


def test_ref_counting_keeps_shared_block_in_use() -> None:
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_count == 2
    pool.free_blocks([block])
    assert block.ref_count == 1
    assert 0 not in pool.free_block_ids()
    pool.free_blocks([block])
    assert block.ref_count == 0
    assert pool.free_block_ids() == [1, 2, 3, 0]
    assert pool.usage == 0.0


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks(blocks)


def test_freed_blocks_join_the_tail_in_the_order_given() -> None:
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)  # 0 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.free_blocks(reversed(a))  # a request frees its tail first
    pool.free_blocks(reversed(b))
    assert pool.free_block_ids() == [5, 6, 7, 2, 1, 0, 4, 3]
    # Never-used blocks go first, then the least recently freed.
    assert ids(pool.get_new_blocks(5)) == [5, 6, 7, 2, 1]
    assert pool.free_block_ids() == [0, 4, 3]


def test_cached_block_survives_free_until_evicted_lazily() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    assert pool.cache_block(blocks[0], 111)
    assert pool.cache_block(blocks[1], 222)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [2, 1, 0]
    # Free but still cached: a prefix lookup still finds them.
    assert pool.get_cached_block(111) is blocks[0]
    assert pool.get_cached_block(222) is blocks[1]
    taken = pool.get_new_blocks(2)  # block 2 (never cached), then block 1 (evicted now)
    assert ids(taken) == [2, 1]
    assert pool.get_cached_block(222) is None
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(111) is blocks[0]
    assert pool.num_cached_blocks == 1


def test_touch_takes_a_free_cached_block_out_of_the_queue() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], 7)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [2, 3, 1, 0]
    hit = pool.get_cached_block(7)
    pool.touch([hit])
    assert hit.ref_count == 1
    assert pool.free_block_ids() == [2, 3, 1]
    assert pool.num_free_blocks == 3
    # Freed again, it goes to the tail: most recently used, evicted last.
    pool.free_blocks([hit])
    assert pool.free_block_ids() == [2, 3, 1, 0]
    assert pool.get_cached_block(7) is hit


def test_a_hash_names_one_block_only() -> None:
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    assert pool.cache_block(first, 5)
    assert not pool.cache_block(second, 5)
    assert second.block_hash is None
    assert pool.get_cached_block(5) is first


def test_reset_prefix_cache_drops_every_hash() -> None:
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], 1)
    pool.cache_block(blocks[1], 2)
    pool.free_blocks([blocks[1]])
    assert pool.reset_prefix_cache() == 2
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    assert blocks[0].block_hash is None and blocks[0].ref_count == 1


def test_block_hashes_are_chained_over_full_blocks_only() -> None:
    tokens = list(range(10))
    hashes = compute_block_hashes(tokens, 4)
    assert len(hashes) == 2  # the last 2 tokens do not fill a block
    assert hashes[0] == hash_block_tokens(None, [0, 1, 2, 3])
    assert hashes[1] == hash_block_tokens(hashes[0], [4, 5, 6, 7])
    # Same second block after a different first block: a different hash.
    other = compute_block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)
    assert other[1] != hashes[1]
    # Extending as tokens arrive gives the same hashes as computing from scratch.
    grown = extend_block_hashes(list(hashes), tokens + [10, 11], 4)
    assert grown == compute_block_hashes(tokens + [10, 11], 4)
    assert len(grown) == 3
