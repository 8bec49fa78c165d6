"""KVCacheManager: prefix hits over chained hashes, the last-token cap, allocation, LRU reuse."""

from __future__ import annotations

import pytest

from lightwell.kvcache.manager import KVCacheManager

BS = 4


def run_prefill(manager: KVCacheManager, request) -> list[int]:
    """Look up, allocate and 'compute' the whole request, as the scheduler would."""
    hits, num_hit = manager.get_computed_blocks(request)
    new_ids = manager.allocate_slots(request, request.num_tokens - num_hit, hits)
    assert new_ids is not None
    request.num_computed_tokens = request.num_tokens
    return manager.get_block_ids(request.req_id)


def test_allocate_rounds_up_to_blocks_and_extends(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    req = make_request("a", list(range(10)))
    assert manager.allocate_slots(req, 6) == [0, 1]
    req.num_computed_tokens = 6
    assert manager.allocate_slots(req, 2) == []  # 8 tokens still fit in 2 blocks
    req.num_computed_tokens = 8
    assert manager.allocate_slots(req, 2) == [2]
    assert manager.get_block_ids("a") == [0, 1, 2]
    assert manager.num_free_blocks == 5


def test_allocation_failure_changes_nothing(make_request) -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    run_prefill(manager, a)
    b = make_request("b", list(range(100, 108)))
    assert manager.allocate_slots(b, 8) is None
    assert manager.get_block_ids("b") == []
    assert manager.num_free_blocks == 1


def test_prefix_hit_on_chained_hashes(make_request) -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(13)))  # 3 full blocks + 1 token
    assert run_prefill(manager, a) == [0, 1, 2, 3]
    # Same first 2 blocks, different third block.
    b = make_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [0, 1]
    assert num_hit == 8
    # Different first block, identical later blocks: chaining means no hit at all.
    c = make_request("c", [99] + list(range(1, 13)))
    assert manager.get_computed_blocks(c) == ([], 0)
    assert manager.prefix_cache_queries == 13 + 13 + 13
    assert manager.prefix_cache_hits == 8


def test_hit_leaves_the_last_token_uncomputed(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    run_prefill(manager, make_request("a", list(range(8))))
    same = make_request("b", list(range(8)))  # exactly 2 full cached blocks
    hits, num_hit = manager.get_computed_blocks(same)
    assert [blk.block_id for blk in hits] == [0]
    assert num_hit == 4
    longer = make_request("c", list(range(9)))
    assert manager.get_computed_blocks(longer)[1] == 8


def test_only_blocks_computed_after_the_step_are_cached(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(12)))
    manager.allocate_slots(a, 6)  # chunk: tokens 0..5, block 1 not full yet
    assert manager.get_computed_blocks(make_request("x", list(range(12))))[1] == 4
    a.num_computed_tokens = 6
    manager.allocate_slots(a, 6)
    assert manager.get_computed_blocks(make_request("y", list(range(12))))[1] == 8


def test_shared_blocks_are_ref_counted(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    assert run_prefill(manager, a) == [0, 1, 2]
    b = make_request("b", list(range(9)))
    assert run_prefill(manager, b) == [0, 1, 3]
    assert [manager.pool.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]
    manager.free(a)
    assert manager.num_free_blocks == 5  # only block 2 came back
    manager.free(b)
    assert manager.num_free_blocks == 8


def test_freed_prompt_is_reused_by_an_identical_prompt(make_request) -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(10)))
    assert run_prefill(manager, a) == [0, 1, 2]
    manager.free(a)
    assert manager.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    b = make_request("b", list(range(10)))
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert manager.allocate_slots(b, 2, hits) == [0, 1, 3]
    assert manager.pool.free_block_ids() == [4, 5, 2]
    assert manager.num_free_blocks == 3


def test_eviction_is_lru_and_tail_first(make_request) -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request("a", list(range(12)) + [0])  # blocks 0 1 2 cached, 3 partial
    b = make_request("b", list(range(100, 108)) + [0])  # blocks 4 5 ... needs 3
    assert run_prefill(manager, a) == [0, 1, 2, 3]
    manager.free(a)
    assert run_prefill(manager, b) == [4, 5, 3]
    manager.free(b)
    # Queue: a's leftovers (tail first), then b's blocks tail first.
    assert manager.pool.free_block_ids() == [2, 1, 0, 3, 5, 4]
    c = make_request("c", list(range(200, 208)))
    assert run_prefill(manager, c) == [2, 1]  # evicts a's last two cached blocks
    # a's first block survives, b's survive whole.
    assert manager.get_computed_blocks(make_request("a2", list(range(12)) + [0]))[1] == 4
    assert manager.get_computed_blocks(make_request("b2", list(range(100, 108)) + [0]))[1] == 8


def test_hits_sitting_in_the_free_queue_count_against_free_space(make_request) -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(9)))
    run_prefill(manager, a)
    manager.free(a)
    b = make_request("b", list(range(8)) + [7, 7, 7, 7, 7])
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    # 13 tokens need 4 blocks: 2 hits + 2 new, but only 1 block is free besides the hits.
    assert manager.allocate_slots(b, 5, hits) is None
    assert manager.pool.free_block_ids() == [2, 1, 0]
    assert manager.allocate_slots(b, 4, hits) == [0, 1, 2]


def test_generated_tokens_extend_the_hashes(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(6)))
    run_prefill(manager, a)
    for token in (6, 7):
        a.append_token(token)
        manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert len(a.block_hashes) == 2
    hits, num_hit = manager.get_computed_blocks(make_request("b", list(range(9))))
    assert [blk.block_id for blk in hits] == [0, 1]


def test_prefix_caching_off(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    run_prefill(manager, make_request("a", list(range(9))))
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)
    assert manager.pool.num_cached_blocks == 0
    assert manager.prefix_cache_queries == 0


def test_reset_prefix_cache(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(9)))
    run_prefill(manager, a)
    manager.free(a)
    assert manager.reset_prefix_cache() == 2
    assert manager.get_computed_blocks(make_request("b", list(range(9)))) == ([], 0)


def test_hits_for_a_request_that_owns_blocks_are_refused(make_request) -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    run_prefill(manager, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)))
    hits, _ = manager.get_computed_blocks(b)
    manager.allocate_slots(b, 1, hits)
    with pytest.raises(RuntimeError):
        manager.allocate_slots(b, 1, hits)


def test_cache_salt_isolates_prefixes(make_request) -> None:
    from lightwell.kvcache.hashing import compute_block_hashes

    tokens = list(range(12))
    plain = compute_block_hashes(tokens, BS)
    a, b = (compute_block_hashes(tokens, BS, salt) for salt in ("a", "b"))
    assert len({*plain, *a, *b}) == 9  # every block hash differs across salts
    assert compute_block_hashes(tokens, BS, "a") == a
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    run_prefill(manager, make_request("x", tokens + [99], cache_salt="a"))
    assert manager.get_computed_blocks(make_request("y", tokens + [98]))[1] == 0
    assert manager.get_computed_blocks(make_request("z", tokens + [98], cache_salt="b"))[1] == 0
    assert manager.get_computed_blocks(make_request("w", tokens + [98], cache_salt="a"))[1] == 12
