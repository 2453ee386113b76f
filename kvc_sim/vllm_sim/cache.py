"""The simulated engine's paged KV cache: vLLM's block pool with prefix caching.

What it models (vLLM 0.32's ``BlockPool``; no tensors, only the bookkeeping)
    * ``num_gpu_blocks`` blocks of ``block_size`` tokens; block 0 is vLLM's null block,
      never handed out, so ``num_gpu_blocks - 1`` are usable (what
      ``vllm:cache_config_info`` reports minus one, and what KV usage is a share of).
    * Reference counts: a block is held by every running request that uses it.
    * A free queue holding every block with no reference, in eviction order: blocks
      that carry a hash (cached, reusable) join at the tail when freed (LRU), blocks
      without one at the head (reused first). A request frees its blocks tail first, so
      a prompt's last blocks are evicted before its first ones.
    * Prefix caching: only full blocks are cached, under their engine hash
      (``hashing``); a hash may name several blocks (two requests that computed the
      same block at once), the first is reused. Taking a cached block off the free
      queue for reuse is a hit; taking one to overwrite it evicts it: a
      ``BlockRemoved`` per evicted hash, queued before the ``BlockStored`` of the blocks
      that needed the room. ``cache_blocks`` queues one ``BlockStored`` per call.
    * ``enable_caching=False`` (``--no-enable-prefix-caching``): nothing is hashed,
      cached or announced; every block is freed to the head of the queue.
    * ``reset()``: drops every hash (``AllBlocksCleared``), refused while any block is
      in use, as vLLM's ``reset_prefix_cache`` is.
    * CPU offloading (``num_cpu_blocks`` > 0, vLLM's ``OffloadingConnector`` with
      ``num_cpu_blocks``): every block cached on the GPU is copied to an LRU of host
      blocks, announced as ``BlockStored{medium: "CPU"}`` with hashes only (no tokens,
      no parent), after the GPU ``BlockStored``; host blocks pushed out of the LRU are
      ``BlockRemoved{medium: "CPU"}``. ``cpu_prefix`` counts the blocks that follow a
      GPU hit in host memory: the scheduler loads them back instead of computing them.

Events are queued and drained (``take_events``), never sent from here.

Complexity
    O(1) per block allocated, freed or touched (an ordered dict as the free queue);
    ``cached_prefix`` O(blocks of the prompt).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvc_sim.vllm_sim.events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvCacheEvent,
)
from kvc_sim.vllm_sim.hashing import BlockHash, block_extra_keys, external_hash

__all__ = ["NULL_BLOCK", "KvBlockPool"]

NULL_BLOCK = 0


class KvBlockPool:
    """Blocks, reference counts, the free queue and the hash table (module docstring)."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        enable_events: bool = True,
        num_cpu_blocks: int = 0,
    ) -> None:
        if num_gpu_blocks < 2 or block_size <= 0 or num_cpu_blocks < 0:
            raise ValueError("num_gpu_blocks must be >= 2, block_size > 0, num_cpu_blocks >= 0")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_events = enable_events and enable_caching
        self._ref = [0] * num_gpu_blocks
        self._hash: list[BlockHash | None] = [None] * num_gpu_blocks
        self._blocks_of: dict[BlockHash, dict[int, None]] = {}
        # Free queue, head first; the null block is never in it.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_gpu_blocks))
        self._events: list[KvCacheEvent] = []
        self.num_cpu_blocks = num_cpu_blocks if enable_caching else 0
        self._cpu: OrderedDict[BlockHash, None] = OrderedDict()  # host copies, LRU first

    # ------------------------------------------------------------------ state
    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def free_blocks(self) -> int:
        """Blocks with no reference (cached or not): what an allocation may take."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the share of usable blocks referenced (0-1)."""
        return 1.0 - len(self._free) / self.usable_blocks

    @property
    def cached_blocks(self) -> int:
        return sum(len(blocks) for blocks in self._blocks_of.values())

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def block_hash(self, block: int) -> BlockHash | None:
        return self._hash[block]

    def is_free(self, block: int) -> bool:
        return block in self._free

    def take_events(self) -> list[KvCacheEvent]:
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ lookup
    def cached_prefix(self, hashes: Sequence[BlockHash], max_blocks: int) -> list[int]:
        """Blocks holding the leading run of ``hashes`` (at most ``max_blocks``)."""
        out: list[int] = []
        if not self.enable_caching:
            return out
        for block_hash in hashes[:max_blocks]:
            blocks = self._blocks_of.get(block_hash)
            if not blocks:
                break
            out.append(next(iter(blocks)))
        return out

    def cpu_prefix(self, hashes: Sequence[BlockHash], start: int, max_blocks: int) -> int:
        """How many of ``hashes[start:max_blocks]``, in a row, have a host copy."""
        n = 0
        for block_hash in hashes[start:max_blocks]:
            if block_hash not in self._cpu:
                break
            n += 1
        return n

    @property
    def cpu_blocks(self) -> int:
        return len(self._cpu)

    def can_allocate(self, new_blocks: int, touched: Sequence[int] = ()) -> bool:
        """Whether ``touched`` (cached hits) plus ``new_blocks`` fresh ones fit now."""
        reclaimed = sum(1 for block in touched if self._ref[block] == 0)
        return new_blocks + reclaimed <= len(self._free)

    # ------------------------------------------------------------------ changes
    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached hits (off the free queue if unreferenced)."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def allocate(self, count: int) -> list[int]:
        """``count`` blocks from the head of the free queue; cached ones are evicted."""
        if count > len(self._free):
            raise ValueError(f"cannot allocate {count} blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            out.append(block)
        return out

    def _evict(self, block: int) -> None:
        block_hash = self._hash[block]
        if block_hash is None:
            return
        self._hash[block] = None
        holders = self._blocks_of[block_hash]
        del holders[block]
        if not holders:
            del self._blocks_of[block_hash]
        if self.enable_events:
            self._events.append(BlockRemoved((external_hash(block_hash),)))

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; the last blocks of a request go first."""
        to_head: list[int] = []
        for block in reversed(blocks):
            if block == NULL_BLOCK:
                continue
            self._ref[block] -= 1
            if self._ref[block] < 0:
                raise AssertionError(f"block {block} freed more often than taken")
            if self._ref[block] == 0:
                if self._hash[block] is None:
                    to_head.append(block)
                else:
                    self._free[block] = None  # tail: evicted last (LRU)
        for block in to_head:  # uncached blocks are reused first (they hold nothing)
            self._free[block] = None
            self._free.move_to_end(block, last=False)

    def cache_blocks(
        self,
        blocks: Sequence[int],
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        *,
        start: int,
        end: int,
        cache_salt: str | None,
    ) -> None:
        """Register a request's full blocks ``[start, end)`` (its ``blocks``, ``hashes``
        and ``token_ids`` from position 0) and queue their ``BlockStored``."""
        if not self.enable_caching or end <= start:
            return
        for index in range(start, end):
            block, block_hash = blocks[index], hashes[index]
            if self._hash[block] is not None:
                raise AssertionError(f"block {block} is cached already")
            self._hash[block] = block_hash
            self._blocks_of.setdefault(block_hash, {})[block] = None
        if self.enable_events:
            self._events.append(self._stored(hashes, token_ids, start, end, cache_salt))
        if self.num_cpu_blocks:
            self._offload(hashes[start:end])

    def _offload(self, hashes: Sequence[BlockHash]) -> None:
        """Copy newly cached blocks to host memory (refresh those already there)."""
        cpu = self._cpu
        added: list[BlockHash] = []
        for block_hash in hashes:
            if block_hash in cpu:
                cpu.move_to_end(block_hash)
            else:
                cpu[block_hash] = None
                added.append(block_hash)
        evicted: list[BlockHash] = []
        while len(cpu) > self.num_cpu_blocks:
            evicted.append(cpu.popitem(last=False)[0])
        if not self.enable_events:
            return
        gone = set(evicted)
        stored = [h for h in added if h not in gone]
        if evicted:
            removed = tuple(external_hash(h) for h in evicted if h not in added)
            if removed:
                self._events.append(BlockRemoved(removed, medium=MEDIUM_CPU))
        if stored:
            self._events.append(
                BlockStored(
                    block_hashes=tuple(external_hash(h) for h in stored),
                    parent_block_hash=None,
                    token_ids=(),
                    block_size=self.block_size,
                    extra_keys=None,
                    medium=MEDIUM_CPU,
                )
            )

    def announce(
        self,
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        count: int,
        cache_salt: str | None,
    ) -> None:
        """Queue a ``BlockStored`` for a reused prefix of ``count`` blocks (vLLM's
        ``kv_cache_report_mode="full"``): nothing changes in the pool."""
        if self.enable_events and count > 0:
            self._events.append(self._stored(hashes, token_ids, 0, count, cache_salt))

    def _stored(
        self,
        hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        start: int,
        end: int,
        cache_salt: str | None,
    ) -> BlockStored:
        size = self.block_size
        extra = [block_extra_keys(i, cache_salt) for i in range(start, end)]
        return BlockStored(
            block_hashes=tuple(external_hash(h) for h in hashes[start:end]),
            parent_block_hash=external_hash(hashes[start - 1]) if start > 0 else None,
            token_ids=tuple(token_ids[start * size : end * size]),
            block_size=size,
            extra_keys=tuple(None if e is None else tuple(v for _, v in e) for e in extra),
        )

    def reset(self) -> bool:
        """Forget every cached hash (``AllBlocksCleared``); False while blocks are in use."""
        if len(self._free) != self.usable_blocks:
            return False
        self._blocks_of.clear()
        self._cpu.clear()
        self._hash = [None] * self.num_gpu_blocks
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def check_invariants(self) -> None:
        """Tests: refs >= 0, free queue = unreferenced blocks, hash table consistent."""
        for block in range(1, self.num_gpu_blocks):
            assert self._ref[block] >= 0
            assert (self._ref[block] == 0) == (block in self._free), block
        assert NULL_BLOCK not in self._free
        for block_hash, holders in self._blocks_of.items():
            assert holders
            for block in holders:
                assert self._hash[block] == block_hash
        assert self.cached_blocks == sum(1 for h in self._hash if h is not None)
