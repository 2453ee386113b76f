"""The simulated engine's block pool and block hashes (kvc_sim.vllm_sim.cache, .hashing).

Hash vectors were computed with vLLM 0.32's own ``hash_block_tokens`` (sha256,
``init_none_hash``, ``maybe_convert_block_hash``) in ``.venv-vllm``.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvc_sim.vllm_sim.cache import NULL_BLOCK, KvBlockPool
from kvc_sim.vllm_sim.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvc_sim.vllm_sim.hashing import external_hash, hash_blocks

BS = 4

# vLLM 0.32: blocks 1..16 salted "tenant-a", 17..32 chained; 1..16 unsalted (block size 16).
VLLM_SALTED = [14725353451287653808, 11679162194730534105]
VLLM_UNSALTED = [1403909460543360175]


def test_block_hashes_are_vllms() -> None:
    salted = hash_blocks(list(range(1, 33)), 16, "tenant-a")
    assert [external_hash(h) for h in salted] == VLLM_SALTED
    assert [external_hash(h) for h in hash_blocks(list(range(1, 17)), 16, None)] == VLLM_UNSALTED
    # Only full blocks hash; chaining from a parent gives the same as hashing it all.
    assert len(hash_blocks(list(range(1, 32)), 16, None)) == 1
    tail = hash_blocks(list(range(1, 33)), 16, "tenant-a", start=1, parent=salted[0])
    assert tail == salted[1:]


def _store(pool: KvBlockPool, tokens: list[int], salt: str | None = None) -> list[int]:
    """Allocate and cache a prompt's full blocks like a finished prefill would."""
    hashes = hash_blocks(tokens, BS, salt)
    blocks = pool.allocate(len(hashes))
    pool.cache_blocks(blocks, hashes, tokens, start=0, end=len(hashes), cache_salt=salt)
    return blocks


def test_null_block_is_reserved_and_usage_counts_usable_blocks() -> None:
    pool = KvBlockPool(5, BS)
    assert (pool.usable_blocks, pool.free_blocks, pool.usage) == (4, 4, 0.0)
    blocks = pool.allocate(2)
    assert NULL_BLOCK not in blocks
    assert pool.usage == 0.5
    pool.free(blocks)
    assert pool.usage == 0.0
    pool.check_invariants()


def test_a_prefix_is_reused_and_announced_once_per_store() -> None:
    pool = KvBlockPool(9, BS)
    tokens = list(range(10, 22))  # 3 blocks
    blocks = _store(pool, tokens)
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.parent_block_hash is None
    assert stored.token_ids == tuple(tokens)
    assert stored.extra_keys == (None, None, None)
    hashes = hash_blocks([*tokens, 99], BS, None)
    assert pool.cached_prefix(hashes, max_blocks=3) == blocks
    assert pool.cached_prefix(hashes, max_blocks=2) == blocks[:2]
    # Another prompt diverging in block 1 reuses block 0 only.
    other = hash_blocks([*tokens[:4], 7, 7, 7, 7], BS, None)
    assert pool.cached_prefix(other, max_blocks=2) == blocks[:1]
    pool.check_invariants()


def test_salted_caches_do_not_share() -> None:
    pool = KvBlockPool(9, BS)
    tokens = list(range(8))
    _store(pool, tokens, salt="a")
    (stored,) = pool.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.extra_keys == (("a",), None)  # the salt in block 0's extra keys only
    assert pool.cached_prefix(hash_blocks(tokens, BS, "b"), 2) == []
    assert pool.cached_prefix(hash_blocks(tokens, BS, None), 2) == []
    assert len(pool.cached_prefix(hash_blocks(tokens, BS, "a"), 2)) == 2


def test_references_keep_blocks_and_freed_cached_blocks_are_evicted_lru() -> None:
    pool = KvBlockPool(5, BS)  # 4 usable
    first = _store(pool, list(range(8)))  # 2 blocks
    second = _store(pool, list(range(100, 108)))  # 2 blocks
    pool.take_events()
    assert not pool.can_allocate(1)
    pool.free(first)
    pool.free(second)
    # Touching a cached hit takes it off the free queue and holds it.
    pool.touch(first[:1])
    assert pool.ref_count(first[0]) == 1
    assert not pool.is_free(first[0])
    # Eviction order: the first request's last block, then the second's last, then its first.
    taken = pool.allocate(3)
    assert taken == [first[1], second[1], second[0]]
    removed = pool.take_events()
    assert all(isinstance(e, BlockRemoved) and len(e.block_hashes) == 1 for e in removed)
    assert len(removed) == 3
    assert pool.cached_blocks == 1  # first[0], still referenced
    pool.free(taken)
    pool.free(first[:1])
    pool.check_invariants()


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = KvBlockPool(5, BS)
    cached = _store(pool, list(range(4)))
    scratch = pool.allocate(1)
    pool.free(cached)
    pool.free(scratch)
    pool.take_events()
    assert pool.allocate(1) == scratch
    assert not any(isinstance(e, BlockRemoved) for e in pool.take_events())
    assert pool.cached_blocks == 1


def test_reset_is_refused_while_blocks_are_in_use() -> None:
    pool = KvBlockPool(5, BS)
    blocks = _store(pool, list(range(8)))
    pool.take_events()
    assert pool.reset() is False
    pool.free(blocks)
    assert pool.reset() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_blocks == 0
    pool.check_invariants()


def test_without_prefix_caching_nothing_is_cached_or_announced() -> None:
    pool = KvBlockPool(5, BS, enable_caching=False)
    tokens = list(range(8))
    blocks = _store(pool, tokens)
    assert pool.take_events() == []
    pool.free(blocks)
    assert pool.cached_prefix(hash_blocks(tokens, BS, None), 2) == []
    assert pool.cached_blocks == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3)), max_size=40))
def test_pool_invariants_hold_under_any_sequence(ops: list[tuple[int, int]]) -> None:
    """Random stores, reuses and frees keep refs, the free queue and the table consistent."""
    pool = KvBlockPool(9, BS)
    held: list[list[int]] = []
    for prompt, count in ops:
        tokens = [prompt] * (count * BS)
        hashes = hash_blocks(tokens, BS, None)
        hits = pool.cached_prefix(hashes, count)
        if not pool.can_allocate(count - len(hits), hits):
            if held:
                pool.free(held.pop(0))
            continue
        pool.touch(hits)
        blocks = hits + pool.allocate(count - len(hits))
        pool.cache_blocks(blocks, hashes, tokens, start=len(hits), end=count, cache_salt=None)
        held.append(blocks)
        pool.check_invariants()
    for blocks in held:
        pool.free(blocks)
    pool.check_invariants()
    assert pool.free_blocks == pool.usable_blocks


def test_cpu_offloading_copies_cached_blocks_and_announces_them_after_the_gpu() -> None:
    pool = KvBlockPool(9, BS, num_cpu_blocks=3)
    tokens = list(range(1, 9))  # two blocks
    hashes = hash_blocks(tokens, BS, None)
    blocks = _store(pool, tokens)
    events = pool.take_events()
    gpu, cpu = events
    assert isinstance(gpu, BlockStored)
    assert isinstance(cpu, BlockStored)
    assert (gpu.medium, cpu.medium) == ("GPU", "CPU")
    assert cpu.block_hashes == gpu.block_hashes  # hashes only: no tokens, no parent
    assert (cpu.token_ids, cpu.parent_block_hash) == ((), None)
    assert pool.cpu_prefix(hashes, 0, 2) == 2
    # Two more blocks: the host LRU (3 blocks) drops the oldest copy.
    pool.free(blocks)
    other = list(range(20, 28))
    _store(pool, other)
    events = pool.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert removed == [BlockRemoved((external_hash(hashes[0]),), medium="CPU")]
    assert pool.cpu_blocks == 3
    assert pool.cpu_prefix(hashes, 0, 2) == 0  # its first block is gone from host memory
    assert pool.cpu_prefix(hashes, 1, 2) == 1
    pool.free(pool.cached_prefix(hash_blocks(other, BS, None), 2))
    assert pool.reset()
    assert pool.cpu_blocks == 0
