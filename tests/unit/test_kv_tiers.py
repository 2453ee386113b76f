"""The block pool over lower KV tiers (host memory L2, disk files L3): demotion on
eviction, promotion in the Tx, damaged files as misses, tenants across tiers, and the
pool's invariants under random traffic (hypothesis). Real tensors, real files."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvc.block_keys import BlockKey
from node_agent.blocks.pool import BlockPool
from node_agent.blocks.tiers import FileStore, InlineRunner, LowerTiers
from node_agent.blocks.types import (
    AllocateParams,
    BlockEvent,
    BlockMoved,
    BlockRemoved,
    BlockStored,
    CapacityExhausted,
    KvMedium,
    TenantMismatch,
    TxMode,
)
from node_agent.engines.embedded.kv_tensors import KvCache, TensorKvCodec
from node_agent.kv import KvContent, is_kv_content
from node_agent.tier_runner import ThreadRunner

T = TypeVar("T")

BLOCK_TOKENS = 2


def content_of(key: int) -> KvCache:
    """A block's KV as a function of its key, so any copy can be checked."""
    base = torch.arange(BLOCK_TOKENS * 4, dtype=torch.float32).reshape(1, 1, BLOCK_TOKENS, 4)
    return KvCache([(base + key, base - key), (base * 2 + key, base * 3 - key)])


BLOCK_BYTES = content_of(0).nbytes


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_pool(
    tmp_path: Path | None, *, l1: int = 2, l2: int = 2, l3: int = 2
) -> tuple[BlockPool, LowerTiers]:
    lower = LowerTiers(
        TensorKvCodec("cpu"),
        host_bytes=l2 * BLOCK_BYTES,
        disk_dir=None if tmp_path is None else tmp_path / "l3",
        disk_bytes=0 if tmp_path is None else l3 * BLOCK_BYTES,
    )
    return BlockPool(l1, Clock(), lower=lower), lower


def store(pool: BlockPool, tx_id: str, keys: list[int], tenant: str = "t") -> None:
    """Allocate, fill the new blocks with their content, commit."""
    result = pool.tx_allocate(AllocateParams(tx_id, tenant, [BlockKey(k) for k in keys], 30.0))
    for key, handle in zip(keys, result.handles, strict=True):
        pool.set_payload(handle, content_of(key))
    pool.tx_commit(tx_id)


def moved(events: list[BlockEvent]) -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = []
    for ev in events:
        if isinstance(ev, BlockMoved):
            out.append((ev.medium.name, ev.keys))
        elif isinstance(ev, BlockRemoved):
            out.append(("removed", ev.keys))
        elif isinstance(ev, BlockStored):
            out.append(("stored", ev.keys))
    return out


def same(a: object, b: KvCache) -> bool:
    assert isinstance(a, KvCache)
    return all(
        torch.equal(x, y)
        for pa, pb in zip(a.layers, b.layers, strict=True)
        for x, y in zip(pa, pb, strict=True)
    )


def test_eviction_demotes_l1_to_l2_to_l3_then_drops(tmp_path: Path) -> None:
    pool, lower = make_pool(tmp_path)
    for i, key in enumerate((1, 2, 3, 4, 5, 6, 7)):
        store(pool, f"tx{i}", [key])
        pool.check_invariants()
    events = moved(pool.take_events())
    # key 1 went to L2 when 3 arrived, on to L3 when 5 arrived, off the node when 7 did.
    assert ("HOST", (1,)) in events
    assert ("DISK", (1,)) in events
    assert ("removed", (1,)) in events
    assert sorted(pool.cached_keys()) == [6, 7]
    assert pool.tier_keys(KvMedium.HOST) == [4, 5]
    assert pool.tier_keys(KvMedium.DISK) == [2, 3]
    assert sorted(p.name for p in (tmp_path / "l3").iterdir()) == [
        f"{2:016x}.kvblock",
        f"{3:016x}.kvblock",
    ]
    host, disk = lower.stats()
    assert (host.blocks, host.used_bytes, disk.blocks, disk.used_bytes) == (
        2,
        2 * BLOCK_BYTES,
        2,
        2 * BLOCK_BYTES,
    )
    assert host.write_bytes_per_s > 0
    assert disk.write_bytes_per_s > 0


@pytest.mark.parametrize("key", [4, 2], ids=["from_host", "from_disk"])
def test_a_demoted_prefix_is_promoted_in_the_tx_with_its_content(tmp_path: Path, key: int) -> None:
    pool, lower = make_pool(tmp_path)
    for i, k in enumerate((1, 2, 3, 4, 5, 6)):
        store(pool, f"tx{i}", [k])
    pool.take_events()
    result = pool.tx_allocate(AllocateParams("again", "t", [BlockKey(key), BlockKey(99)], 30.0))
    assert (result.reused_blocks, result.promoted_blocks, result.new_blocks) == (1, 1, 1)
    assert same(pool.get_payload(result.handles[0]), content_of(key))
    assert lower.medium_of(BlockKey(key)) is None
    events = moved(pool.take_events())
    assert ("DEVICE", (key,)) in events
    pool.tx_commit("again")
    pool.check_invariants()
    medium = KvMedium.HOST if key == 4 else KvMedium.DISK
    assert pool.promoted_blocks == {KvMedium.HOST: 0, KvMedium.DISK: 0} | {medium: 1}
    host, disk = lower.stats()
    assert (host if key == 4 else disk).read_bytes_per_s > 0


def test_a_damaged_file_is_a_miss_not_a_crash(tmp_path: Path) -> None:
    pool, lower = make_pool(tmp_path)
    for i, k in enumerate((1, 2, 3, 4, 5, 6)):
        store(pool, f"tx{i}", [k])
    pool.take_events()
    path = tmp_path / "l3" / f"{2:016x}.kvblock"
    path.write_bytes(path.read_bytes()[:-3])  # torn: the tail never reached the disk
    result = pool.tx_allocate(AllocateParams("again", "t", [BlockKey(2), BlockKey(3)], 30.0))
    assert (result.reused_blocks, result.promoted_blocks, result.new_blocks) == (0, 0, 2)
    # 2 is gone (a miss) and 3 superseded: one removal (neighbouring events join).
    assert ("removed", (2, 3)) in moved(pool.take_events())
    assert not path.exists()
    assert lower.torn_files == 1
    # key 3 sat past the miss: the tx recomputes it, so its L3 copy is discarded.
    assert lower.medium_of(BlockKey(3)) is None
    pool.tx_abort("again")
    pool.check_invariants()


@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[:10],
        lambda raw: raw + b"x",
        lambda raw: raw[:-1] + bytes([raw[-1] ^ 1]),
        lambda raw: b"XXXX" + raw[4:],
    ],
    ids=["short_header", "long", "flipped_bit", "bad_magic"],
)
def test_every_kind_of_damage_is_detected(tmp_path: Path, damage: object) -> None:
    pool, lower = make_pool(tmp_path, l2=0)
    store(pool, "a", [1])
    store(pool, "b", [2])
    store(pool, "c", [3])  # evicts 1 straight to disk (no L2)
    path = tmp_path / "l3" / f"{1:016x}.kvblock"
    assert callable(damage)
    path.write_bytes(damage(path.read_bytes()))
    assert lower.load(BlockKey(1)) is None
    assert lower.torn_files == 1


def test_an_intact_file_round_trips_exactly(tmp_path: Path) -> None:
    pool, lower = make_pool(tmp_path, l2=0)
    for i, k in enumerate((7, 8, 9)):
        store(pool, f"tx{i}", [k])
    assert same(lower.load(BlockKey(7)), content_of(7))


def test_capacity_refusal_leaves_the_lower_tiers_as_they_were(tmp_path: Path) -> None:
    pool, _lower = make_pool(tmp_path)
    for i, k in enumerate((1, 2, 3, 4)):
        store(pool, f"tx{i}", [k])
    pool.tx_allocate(AllocateParams("hold", "t", [BlockKey(3), BlockKey(4)], 30.0))
    before = (pool.tier_keys(KvMedium.HOST), pool.tier_keys(KvMedium.DISK))
    with pytest.raises(CapacityExhausted):
        pool.tx_allocate(AllocateParams("x", "t", [BlockKey(1)], 30.0))
    assert (pool.tier_keys(KvMedium.HOST), pool.tier_keys(KvMedium.DISK)) == before
    pool.check_invariants()


def test_tenants_hold_across_tiers(tmp_path: Path) -> None:
    pool, _ = make_pool(tmp_path)
    for i, k in enumerate((1, 2, 3)):
        store(pool, f"tx{i}", [k], tenant="alice")
    with pytest.raises(TenantMismatch):
        pool.tx_allocate(AllocateParams("mallory", "bob", [BlockKey(1)], 30.0))
    pool.check_invariants()


def test_clear_empties_every_tier(tmp_path: Path) -> None:
    pool, lower = make_pool(tmp_path)
    for i, k in enumerate((1, 2, 3, 4, 5, 6)):
        store(pool, f"tx{i}", [k])
    pool.clear()
    assert len(lower) == 0
    assert not list((tmp_path / "l3").glob("*.kvblock"))
    pool.check_invariants()


def test_a_previous_process_files_are_removed_and_nothing_else(tmp_path: Path) -> None:
    folder = tmp_path / "l3"
    folder.mkdir()
    (folder / f"{5:016x}.kvblock").write_bytes(b"old")
    (folder / "notes.txt").write_text("mine")
    make_pool(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_budgets_are_checked() -> None:
    with pytest.raises(ValueError, match="directory"):
        LowerTiers(TensorKvCodec("cpu"), host_bytes=0, disk_bytes=10)
    with pytest.raises(ValueError, match=">= 0 bytes"):
        LowerTiers(TensorKvCodec("cpu"), host_bytes=-1)
    pool = BlockPool(2, Clock(), lower=LowerTiers(TensorKvCodec("cpu"), host_bytes=0))
    assert pool.lower is None  # both tiers off: evicted blocks are simply gone


def test_measure_reports_bandwidth_and_leaves_nothing(tmp_path: Path) -> None:
    _, lower = make_pool(tmp_path)
    lower.measure(content_of(3))
    host, disk = lower.stats()
    assert host.read_bytes_per_s > 0
    assert disk.read_bytes_per_s > 0
    assert (host.blocks, disk.blocks) == (0, 0)
    assert not list((tmp_path / "l3").iterdir())


@settings(max_examples=int(os.environ.get("KVC_TIER_EXAMPLES", "60")), deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["store", "reuse", "abort"]),
            st.lists(st.integers(1, 12), min_size=1, max_size=3, unique=True),
            st.booleans(),  # deferred runner: let the I/O thread catch up after this op
        ),
        min_size=1,
        max_size=40,
    ),
    deferred=st.booleans(),
)
def test_invariants_and_contents_under_random_traffic(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, list[int], bool]], deferred: bool
) -> None:
    """Random traffic, with copies and writes either done at once or held back and
    completed at random points (the agent's I/O thread lagging): the pool's invariants
    hold, and every block, wherever it is, reads back as its own KV."""
    folder = tmp_path_factory.mktemp("l3")
    pool, lower = make_pool(folder, l1=3, l2=2, l3=3)
    runner = DeferredRunner()
    if deferred:
        lower.set_runner(runner)
    for n, (op, keys, catch_up) in enumerate(ops):
        try:
            result = pool.tx_allocate(
                AllocateParams(f"tx{n}", "t", [BlockKey(k) for k in keys], 30.0)
            )
        except CapacityExhausted:
            pool.check_invariants()
            continue
        for key, handle in zip(keys, result.handles, strict=True):
            payload = pool.get_payload(handle)
            if payload is not None:  # cached here or promoted: must be the key's own KV
                assert same(payload, content_of(key))
            elif op != "abort":
                pool.set_payload(handle, content_of(key))
        if op == "abort":
            pool.tx_abort(f"tx{n}")
        else:
            pool.tx_commit(f"tx{n}")
        if catch_up:
            runner.run_all()
        pool.check_invariants()
        for medium in (KvMedium.HOST, KvMedium.DISK):
            for key in pool.tier_keys(medium):
                assert same(lower.load(key), content_of(key))
    runner.run_all()
    on_disk = {int(p.name.split(".")[0], 16) for p in folder.glob("l3/*.kvblock")}
    assert on_disk == set(pool.tier_keys(KvMedium.DISK))  # no file lost, none left over


class DeferredRunner:
    """Holds submitted work until ``run_all``: the agent's I/O thread, made visible
    (urgent work first, as there)."""

    def __init__(self) -> None:
        self.queue: list[
            tuple[Callable[[], object], Callable[[object, BaseException | None], None]]
        ] = []
        self.urgent: list[
            tuple[Callable[[], object], Callable[[object, BaseException | None], None]]
        ] = []

    def submit(
        self,
        work: Callable[[], T],
        done: Callable[[T | None, BaseException | None], None],
        *,
        urgent: bool = False,
    ) -> None:
        (self.urgent if urgent else self.queue).append((work, done))  # type: ignore[arg-type]

    @property
    def pending(self) -> int:
        return len(self.urgent) + len(self.queue)

    def run_all(self) -> None:
        while self.urgent or self.queue:
            InlineRunner().submit(*(self.urgent or self.queue).pop(0))


def deferred_pool(tmp_path: Path, **sizes: int) -> tuple[BlockPool, LowerTiers, DeferredRunner]:
    pool, lower = make_pool(tmp_path, **sizes)
    runner = DeferredRunner()
    lower.set_runner(runner)
    return pool, lower, runner


def test_demotion_copies_run_on_the_runner_and_the_block_stays_readable(tmp_path: Path) -> None:
    pool, lower, runner = deferred_pool(tmp_path, l2=1)
    for i, k in enumerate((1, 2, 3, 4)):
        store(pool, f"tx{i}", [k])
    # 1 went to host and on to disk, 2 to host: nothing copied or written yet.
    assert pool.tier_keys(KvMedium.HOST) == [2]
    assert pool.tier_keys(KvMedium.DISK) == [1]
    assert runner.queue
    assert not list((tmp_path / "l3").glob("*.kvblock"))
    assert same(lower.load(BlockKey(1)), content_of(1))  # from memory, write pending
    assert same(lower.load(BlockKey(2)), content_of(2))
    runner.run_all()
    assert [p.name for p in (tmp_path / "l3").glob("*.kvblock")] == [f"{1:016x}.kvblock"]
    assert same(lower.load(BlockKey(1)), content_of(1))  # now from the file
    pool.check_invariants()


def test_a_failed_write_is_reported_removed(tmp_path: Path) -> None:
    pool, _, runner = deferred_pool(tmp_path, l2=0)
    for i, k in enumerate((1, 2, 3)):
        store(pool, f"tx{i}", [k])
    assert pool.tier_keys(KvMedium.DISK) == [1]
    pool.take_events()
    (tmp_path / "l3").rmdir()  # the directory vanished: the write fails
    runner.run_all()
    assert pool.tier_keys(KvMedium.DISK) == []
    assert ("removed", (1,)) in moved(pool.take_events())
    pool.check_invariants()


def test_a_block_discarded_while_its_write_is_pending_leaves_no_file(tmp_path: Path) -> None:
    pool, _, runner = deferred_pool(tmp_path, l2=0)
    for i, k in enumerate((1, 2, 3)):
        store(pool, f"tx{i}", [k])
    result = pool.tx_allocate(AllocateParams("again", "t", [BlockKey(1)], 30.0))
    assert result.promoted_blocks == 1  # promoted from memory: the write never mattered
    runner.run_all()
    names = sorted(p.name for p in (tmp_path / "l3").iterdir())
    assert names == [f"{2:016x}.kvblock"]  # 2 was pushed out to make room: 1's file is gone
    pool.tx_commit("again")
    pool.check_invariants()


class CountingCodec(TensorKvCodec):
    def __init__(self) -> None:
        super().__init__("cpu")
        self.to_device_calls = 0

    def to_device(self, content: KvContent) -> KvCache:
        self.to_device_calls += 1
        return super().to_device(content)


def test_prefetch_stages_on_the_runner_and_the_tx_promotes_what_it_staged(tmp_path: Path) -> None:
    codec = CountingCodec()
    lower = LowerTiers(codec, host_bytes=4 * BLOCK_BYTES)
    pool = BlockPool(3, Clock(), lower=lower)
    for i, k in enumerate((1, 2, 3, 4, 5)):
        store(pool, f"tx{i}", [k])
    runner = DeferredRunner()
    lower.set_runner(runner)
    ready: list[bool] = []
    keys = [BlockKey(1), BlockKey(2), BlockKey(9)]
    assert lower.prefetch(keys, lambda: ready.append(True)) == 2
    assert not ready
    runner.run_all()
    assert ready == [True]
    calls = codec.to_device_calls
    result = pool.tx_allocate(AllocateParams("again", "t", keys, 30.0))
    assert (result.reused_blocks, result.promoted_blocks) == (2, 2)
    assert codec.to_device_calls == calls  # nothing copied on the caller's thread
    assert same(pool.get_payload(result.handles[0]), content_of(1))
    lower.unstage(keys)
    pool.tx_abort("again")
    pool.check_invariants()


def test_replica_aware_eviction_drops_what_other_nodes_hold_and_demotes_last_copies() -> None:
    """Victims in LRU order as always; one another node also holds is dropped, not
    demoted, so the lower tiers keep the fleet's last copies."""
    elsewhere = {BlockKey(2), BlockKey(3)}
    lower = LowerTiers(TensorKvCodec("cpu"), host_bytes=8 * BLOCK_BYTES)
    pool = BlockPool(
        4, Clock(), lower=lower, replicas_elsewhere=lambda key: 1 if key in elsewhere else 0
    )
    for i, k in enumerate((1, 2, 3, 4)):
        store(pool, f"tx{i}", [k])
    pool.take_events()
    store(pool, "new", [5, 6, 7])  # three victims, oldest first: 1, 2, 3
    assert sorted(pool.cached_keys()) == [4, 5, 6, 7]
    events = moved(pool.take_events())
    assert ("HOST", (1,)) in events
    assert ("removed", (2, 3)) in events
    assert pool.tier_keys(KvMedium.HOST) == [1]  # the last copy kept, the replicas not
    pool.check_invariants()


def test_a_pull_source_lends_its_demoted_blocks_too(tmp_path: Path) -> None:
    """LOCK_ONLY (the source of a peer's pull) promotes the demoted blocks that continue
    its prefix, as far as it has room without evicting what it locks."""
    pool, _ = make_pool(tmp_path, l1=3)
    store(pool, "chain", [1, 2, 3])
    store(pool, "other", [7, 8])  # two of the chain's blocks demoted to make room
    demoted = set(pool.tier_keys(KvMedium.HOST)) | set(pool.tier_keys(KvMedium.DISK))
    assert demoted
    pool.take_events()
    keys = [BlockKey(1), BlockKey(2), BlockKey(3)]
    lock = pool.tx_allocate(AllocateParams("lend", "t", keys, 30.0, mode=TxMode.LOCK_ONLY))
    assert lock.reused_blocks == 3
    assert lock.promoted_blocks == len(demoted & {1, 2, 3})
    for key, handle in zip(keys, lock.handles, strict=True):
        assert same(pool.get_payload(handle), content_of(key))
    assert ("DEVICE", tuple(sorted(demoted & {1, 2, 3}))) in [
        (m, tuple(sorted(k))) for m, k in moved(pool.take_events())
    ]
    pool.tx_commit("lend")
    pool.check_invariants()
    # No room at all (everything locked): it lends the pool's prefix and stops there.
    full, _ = make_pool(tmp_path / "full", l1=2)
    store(full, "a", [1])
    store(full, "b", [2])
    store(full, "c", [3])  # 1 demoted
    full.tx_allocate(AllocateParams("hold", "t", [BlockKey(2), BlockKey(3)], 30.0))
    lock = full.tx_allocate(AllocateParams("lend", "t", [BlockKey(1)], 30.0, mode=TxMode.LOCK_ONLY))
    assert (lock.reused_blocks, lock.promoted_blocks) == (0, 0)
    full.check_invariants()


def test_a_prefetch_runs_ahead_of_queued_demotions_and_reads_what_is_not_yet_written(
    tmp_path: Path,
) -> None:
    """A promotion waits for no demotion queued before it; a block whose file is not
    written yet is read from memory, one whose write finished from its file."""
    pool, lower, runner = deferred_pool(tmp_path, l1=2, l2=1, l3=8)
    store(pool, "a", [1])
    store(pool, "b", [2])
    store(pool, "c", [3])  # 1 → host
    runner.run_all()
    store(pool, "d", [4])  # 2 → host, 1 → disk: its write is queued
    assert lower.medium_of(BlockKey(1)) is KvMedium.DISK
    backlog = len(runner.queue)
    assert lower.io_backlog == backlog > 0
    ready: list[bool] = []
    assert lower.prefetch([BlockKey(1), BlockKey(2)], lambda: ready.append(True)) == 2
    work, done = runner.urgent.pop(0)  # the prefetch alone, ahead of the backlog
    assert not runner.urgent
    InlineRunner().submit(work, done)
    assert ready == [True]
    assert len(runner.queue) == backlog  # the demotions still wait
    result = pool.tx_allocate(AllocateParams("again", "t", [BlockKey(1), BlockKey(2)], 30.0))
    assert result.promoted_blocks == 2
    assert same(pool.get_payload(result.handles[0]), content_of(1))
    assert same(pool.get_payload(result.handles[1]), content_of(2))
    pool.tx_abort("again")
    runner.run_all()
    pool.check_invariants()


async def test_thread_runner_runs_urgent_work_before_queued_background_work() -> None:
    runner = ThreadRunner(asyncio.get_running_loop())
    started, gate = threading.Event(), threading.Event()
    ran: list[str] = []
    finished: list[str] = []
    all_done = asyncio.Event()

    def job(name: str, wait: bool = False) -> Callable[[], str]:
        def work() -> str:
            if wait:
                started.set()
                gate.wait(5)
            ran.append(name)
            return name

        return work

    def done(result: str | None, error: BaseException | None) -> None:
        assert error is None
        assert result is not None
        finished.append(result)
        if len(finished) == 5:
            all_done.set()

    runner.submit(job("busy", wait=True), done)  # holds the thread
    assert await asyncio.to_thread(started.wait, 5)
    runner.submit(job("write-1"), done)
    runner.submit(job("write-2"), done)
    runner.submit(job("promote-1"), done, urgent=True)
    runner.submit(job("promote-2"), done, urgent=True)
    assert runner.pending == 5  # the running job counts until its completion is handed over
    gate.set()
    await asyncio.wait_for(all_done.wait(), 10)
    assert ran == ["busy", "promote-1", "promote-2", "write-1", "write-2"]
    assert finished == ran  # completions come back in the order the work ran
    assert runner.pending == 0
    runner.close()


async def test_thread_runner_close_finishes_both_lanes_then_runs_inline() -> None:
    loop = asyncio.get_running_loop()
    runner = ThreadRunner(loop)
    gate = threading.Event()
    results: list[str] = []
    three = asyncio.Event()

    def record(result: str | None, _error: BaseException | None) -> None:
        results.append(str(result))
        if len(results) == 3:
            three.set()

    def slow() -> str:
        gate.wait(5)
        return "slow"

    runner.submit(slow, record)
    runner.submit(lambda: "write", record)
    runner.submit(lambda: "promote", record, urgent=True)
    gate.set()
    await asyncio.to_thread(runner.close)  # as the agent does at shutdown
    await asyncio.wait_for(three.wait(), 10)  # the completions queued on the loop
    assert results == ["slow", "promote", "write"]
    assert runner.pending == 0
    runner.submit(lambda: "late", lambda r, _e: results.append(str(r)))  # a last clear
    assert results[-1] == "late"  # at once, on this thread
    assert runner.pending == 0


def test_tier_io_backlog_is_a_gauge(tmp_path: Path) -> None:
    from node_agent.engines.base import EngineLoad
    from node_agent.metrics import AgentMetrics

    pool, lower, runner = deferred_pool(tmp_path, l1=1, l2=1, l3=4)
    store(pool, "a", [1])
    store(pool, "b", [2])  # 1 → host: a copy queued
    store(pool, "c", [3])  # 2 → host, 1 → disk: more queued
    metrics = AgentMetrics()
    metrics.refresh(pool, EngineLoad(0, 0, 0), 0)
    gauge = "node_agent_tier_io_queued_jobs"
    assert metrics.registry.get_sample_value(gauge) == lower.io_backlog == len(runner.queue) > 0
    runner.run_all()
    metrics.refresh(pool, EngineLoad(0, 0, 0), 0)
    assert metrics.registry.get_sample_value(gauge) == 0
    pool.check_invariants()


async def test_thread_runner_hands_a_failure_to_done() -> None:
    runner = ThreadRunner(asyncio.get_running_loop())
    got: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()

    def fail() -> int:
        raise OSError("disk full")

    runner.submit(fail, lambda _result, error: got.set_result(error))
    error = await asyncio.wait_for(got, 10)
    assert isinstance(error, OSError)
    runner.close()


class FailFirstWrite(FileStore):
    def __init__(self, directory: Path) -> None:
        super().__init__(directory, TensorKvCodec("cpu"))
        self.failed = False

    def write(self, key: BlockKey, content: KvContent) -> None:
        if not self.failed:
            self.failed = True
            raise OSError("disk full")
        super().write(key, content)


def test_a_late_failed_write_never_removes_a_newer_file_of_its_key(tmp_path: Path) -> None:
    """The I/O thread runs ahead of the loop: a write that failed, whose key was promoted
    and demoted to disk again meanwhile, must not take the newer file with it."""
    disk = FailFirstWrite(tmp_path / "l3")
    lower = LowerTiers(
        TensorKvCodec("cpu"), host_bytes=0, disk_bytes=8 * BLOCK_BYTES, disk_store=disk
    )
    pool = BlockPool(2, Clock(), lower=lower)
    runner = DeferredRunner()
    lower.set_runner(runner)
    for i, k in enumerate((1, 2, 3)):
        store(pool, f"tx{i}", [k])  # 1 → disk: its write (to fail) queued
    result = pool.tx_allocate(AllocateParams("again", "t", [BlockKey(1)], 30.0))
    assert result.promoted_blocks == 1  # from memory; its old entry discarded
    pool.tx_commit("again")
    store(pool, "tx3", [4])
    store(pool, "tx4", [5])  # 1 → disk again, a newer write queued
    assert lower.medium_of(BlockKey(1)) is KvMedium.DISK
    # Every queued job runs on the thread before any completion reaches the loop.
    jobs = runner.urgent + runner.queue
    runner.urgent.clear()
    runner.queue.clear()
    outcomes: list[tuple[object, BaseException | None]] = []
    for work, _done in jobs:
        try:
            outcomes.append((work(), None))
        except OSError as exc:
            outcomes.append((None, exc))
    for (_work, done), (result_, error) in zip(jobs, outcomes, strict=True):
        done(result_, error)
    runner.run_all()  # whatever the completions queued
    assert disk.path(BlockKey(1)).exists()  # the newer file stays
    assert lower.load(BlockKey(1)) is not None
    assert not list((tmp_path / "l3").glob("*.tmp"))
    pool.check_invariants()


def test_is_kv_content_answers_as_isinstance_does() -> None:
    class NotKv:
        num_tokens = 1  # one member of the protocol is not enough

    samples: list[object] = [None, content_of(1), content_of(2), NotKv(), b"kv", 7]
    for obj in samples * 2:  # the second time from what it remembered per type
        assert is_kv_content(obj) is isinstance(obj, KvContent)
    assert is_kv_content(content_of(3))
