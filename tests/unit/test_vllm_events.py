"""vLLM KV events → canonical block keys: the pure decoder, then the ZMQ subscriber's
sequencing (gaps, replay, clear, duplicates, engine restarts) against a publisher that
speaks vLLM 0.32's wire format over real ZMQ sockets (``ipc://``)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import msgpack
import pytest
import zmq
import zmq.asyncio

from kvc.block_keys import BlockKey, compute_block_keys
from node_agent.engines.base import CacheCleared, CacheRemoved, CacheStored, EngineCacheEvent
from node_agent.engines.vllm.config import salt_for_tenant
from node_agent.engines.vllm.events import KvEventDecoder, KvEventSubscriber

BS = 4
MODEL = "tiny-llama"


def stored(
    hashes: Sequence[int | bytes],
    tokens: Sequence[int],
    parent: int | bytes | None = None,
    *,
    salt: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    if salt is not None:
        ev["extra_keys"] = [[salt]] + [None] * (len(hashes) - 1)
    ev.update(extra)
    return ev


def removed(hashes: Sequence[int | bytes], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU", **extra}


def batch(*events: dict[str, Any], ts: float = 1.0) -> bytes:
    data: bytes = msgpack.packb([ts, list(events), 0])
    return data


def keys(
    tokens: Sequence[int], tenant: str, parent: BlockKey | None = None
) -> tuple[BlockKey, ...]:
    return tuple(
        compute_block_keys(tokens, tenant=tenant, model=MODEL, block_size=BS, parent=parent)
    )


def decoder(max_tracked: int = 1024) -> KvEventDecoder:
    return KvEventDecoder(
        model=MODEL,
        block_size=BS,
        tenant_of_salt=lambda salt: "" if salt is None else salt,
        max_tracked=max_tracked,
    )


TOKENS = list(range(100, 112))  # three blocks


# ------------------------------------------------------------------------ decoder


def test_stored_blocks_get_the_conductors_keys() -> None:
    d = decoder()
    (ev,) = d.decode(batch(stored([11, 12, 13], TOKENS, salt="acme")))
    assert ev == CacheStored(keys(TOKENS, "acme"), None)
    # The conductor hashes a prompt the same way: equal keys mean a routing hit.
    assert ev.keys == tuple(
        compute_block_keys([*TOKENS, 7], tenant="acme", model=MODEL, block_size=BS)
    )


def test_events_carry_the_engines_batch_time() -> None:
    """The time vLLM stamped on the batch travels with the mirror events, so a
    conductor's event lag runs from the engine's event, not the agent's."""
    d = decoder()
    (stored_ev,) = d.decode(batch(stored([11, 12, 13], TOKENS, salt="acme"), ts=1_700_000_123.5))
    assert stored_ev.engine_time_s == 1_700_000_123.5
    (removed_ev,) = d.decode(batch({"type": "BlockRemoved", "block_hashes": [13]}, ts=7.0))
    assert removed_ev.engine_time_s == 7.0


def test_a_chain_continues_from_its_parent_and_inherits_the_tenant() -> None:
    d = decoder()
    d.decode(batch(stored([11], TOKENS[:4], salt="acme")))
    (ev,) = d.decode(batch(stored([12, 13], TOKENS[4:], parent=11)))
    head = keys(TOKENS[:4], "acme")
    assert ev == CacheStored(keys(TOKENS[4:], "acme", parent=head[-1]), head[-1])
    assert ev.keys == keys(TOKENS, "acme")[1:]


def test_unsalted_blocks_belong_to_the_empty_tenant() -> None:
    (ev,) = decoder().decode(batch(stored([1, 2, 3], TOKENS)))
    assert ev == CacheStored(keys(TOKENS, ""), None)


def test_bytes_hashes_work_too() -> None:
    d = decoder()
    d.decode(batch(stored([b"a" * 32], TOKENS[:4], salt="t")))
    (ev,) = d.decode(batch(stored([b"b" * 32], TOKENS[4:8], parent=b"a" * 32)))
    assert isinstance(ev, CacheStored)
    assert ev.keys == keys(TOKENS[:8], "t")[1:]


@pytest.mark.parametrize(
    "event",
    [
        stored([1, 2, 3], TOKENS, parent=999),  # unknown parent: cannot be chained
        stored([1, 2, 3], TOKENS, lora_name="adapter"),
        stored([1, 2, 3], TOKENS, medium="CPU"),  # an offload tier, not vLLM's KV pool
        stored([1, 2, 3], TOKENS, group_idx=1),
        stored([1, 2, 3], TOKENS, block_size=8),
        stored([1, 2, 3], TOKENS[:-1]),  # token count does not match the blocks
        stored([1, 2, 3], TOKENS, extra_keys=[["img", 0], None, None]),  # multimodal
    ],
)
def test_blocks_canonical_keys_cannot_describe_are_skipped(event: dict[str, Any]) -> None:
    d = decoder()
    assert d.decode(batch(event)) == []
    assert d.skipped_blocks == 3
    assert d.tracked == 0


def test_a_chain_stops_at_the_first_block_with_extra_keys() -> None:
    event = stored([1, 2, 3], TOKENS, salt="t")
    event["extra_keys"] = [["t"], None, [b"embeds"]]
    (ev,) = decoder().decode(batch(event))
    assert isinstance(ev, CacheStored)
    assert ev.keys == keys(TOKENS[:8], "t")


def test_an_unknown_hashed_salt_is_skipped() -> None:
    d = KvEventDecoder(model=MODEL, block_size=BS, tenant_of_salt=lambda salt: None)
    assert d.decode(batch(stored([1, 2, 3], TOKENS, salt="kvc-t-00"))) == []


def test_removed_and_cleared() -> None:
    d = decoder()
    d.decode(batch(stored([11, 12, 13], TOKENS, salt="t")))
    all_keys = keys(TOKENS, "t")
    assert d.decode(batch(removed([12, 99]))) == [CacheRemoved((all_keys[1],))]
    assert d.decode(batch(removed([12]))) == []  # already gone
    assert d.decode(batch(removed([11], medium="CPU"))) == []
    assert d.decode(batch({"type": "AllBlocksCleared"})) == [CacheCleared()]
    assert d.tracked == 0


def test_engine_hash_memory_is_bounded() -> None:
    d = decoder(max_tracked=2)
    d.decode(batch(stored([11, 12, 13], TOKENS, salt="t")))
    assert d.tracked == 2
    assert d.decode(batch(removed([11]))) == []  # the oldest was forgotten


def test_salt_for_tenant() -> None:
    assert salt_for_tenant("") is None
    assert salt_for_tenant("acme") == "acme"
    odd = salt_for_tenant("team/acme@corp")
    assert odd is not None
    assert odd.startswith("kvc-t-")
    assert "/" not in odd
    assert salt_for_tenant("x" * 200) == salt_for_tenant("x" * 200) != salt_for_tenant("y" * 200)


# ------------------------------------------------------------------------ subscriber


class FakeVllm:
    """vLLM's ZmqEventPublisher, reduced: PUB with seq + msgpack, ROUTER replay buffer."""

    def __init__(self, root: Path, *, replay: bool) -> None:
        self.ctx = zmq.asyncio.Context()
        self.endpoint = f"ipc://{root}/events"
        self.replay_endpoint = f"ipc://{root}/replay" if replay else ""
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(self.endpoint)
        self.router: zmq.asyncio.Socket | None = None
        if replay:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.bind(self.replay_endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.task: asyncio.Task[None] | None = None

    async def publish(self, *events: dict[str, Any], drop: bool = False) -> None:
        payload = batch(*events, ts=time.time())
        self.buffer.append((self.seq, payload))
        if not drop:  # drop: published while nobody listened (PUB drops it)
            await self.pub.send_multipart([b"kv-events", self.seq.to_bytes(8, "big"), payload])
        self.seq += 1

    def restart(self) -> None:
        self.seq = 0
        self.buffer.clear()

    async def serve_replay(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    await self.router.send_multipart(
                        [client, b"", b"kv-events", seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart(
                [client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        self.ctx.term()


class Mirror:
    def __init__(self) -> None:
        self.events: list[EngineCacheEvent] = []

    async def __call__(self, events: Sequence[EngineCacheEvent]) -> None:
        self.events.extend(events)

    @property
    def cached(self) -> set[BlockKey]:
        out: set[BlockKey] = set()
        for ev in self.events:
            if isinstance(ev, CacheStored):
                out.update(ev.keys)
            elif isinstance(ev, CacheRemoved):
                out.difference_update(ev.keys)
            else:
                out.clear()
        return out

    def clears(self) -> int:
        return sum(isinstance(ev, CacheCleared) for ev in self.events)


@pytest.fixture
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvc-ev-"))  # ipc paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


Rig = tuple[FakeVllm, KvEventSubscriber, Mirror]


async def _rig(root: Path, *, replay: bool) -> AsyncIterator[Rig]:
    engine = FakeVllm(root, replay=replay)
    if replay:
        engine.task = asyncio.create_task(engine.serve_replay())
    mirror = Mirror()
    sub = KvEventSubscriber(
        endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint,
        topic="kv-events",
        decoder=decoder(),
        sink=lambda: mirror,
        settle_s=0.05,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(sub.run(stop))
    try:
        await eventually(lambda: sub.stats.connected)
        await asyncio.sleep(0.3)  # the subscription reaches the PUB socket
        yield engine, sub, mirror
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        if engine.task is not None:
            engine.task.cancel()
        engine.close()


@pytest.fixture
async def with_replay(short_dir: Path) -> AsyncIterator[Rig]:
    async for rig in _rig(short_dir, replay=True):
        yield rig


@pytest.fixture
async def without_replay(short_dir: Path) -> AsyncIterator[Rig]:
    async for rig in _rig(short_dir, replay=False):
        yield rig


async def eventually(predicate: Any, timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():  # noqa: ASYNC110 - a socket on the other side, no event
            await asyncio.sleep(0.01)


A = TOKENS[:4]
B = TOKENS[4:8]
C = TOKENS[8:12]


async def test_live_batches_in_order(with_replay: Rig) -> None:
    engine, sub, mirror = with_replay
    await engine.publish(stored([1], A, salt="t"))
    await engine.publish(stored([2], B, parent=1))
    await engine.publish(removed([1]))
    await eventually(lambda: sub.stats.batches == 3)
    assert mirror.cached == {keys(A + B, "t")[1]}
    assert (sub.stats.gaps, mirror.clears()) == (0, 0)


async def test_a_gap_is_replayed(with_replay: Rig) -> None:
    engine, sub, mirror = with_replay
    await engine.publish(stored([1], A, salt="t"))
    await engine.publish(stored([2], B, parent=1), drop=True)  # lost on the wire
    await engine.publish(stored([3], C, parent=2))
    await eventually(lambda: sub.stats.batches == 3)
    assert mirror.cached == set(keys(TOKENS, "t"))
    assert sub.stats.gaps == 1
    assert mirror.clears() == 0


async def test_a_gap_without_replay_clears_the_mirror(without_replay: Rig) -> None:
    engine, sub, mirror = without_replay
    await engine.publish(stored([1], A, salt="t"))
    await eventually(lambda: sub.stats.batches == 1)
    await engine.publish(removed([1]), drop=True)  # the mirror would keep a stale key
    await engine.publish(stored([7], C, salt="u"))
    await eventually(lambda: sub.stats.batches == 2)
    assert mirror.clears() == 1
    assert mirror.cached == set(keys(C, "u"))


async def test_a_late_subscriber_replays_from_the_start(short_dir: Path) -> None:
    engine = FakeVllm(short_dir, replay=True)
    engine.task = asyncio.create_task(engine.serve_replay())
    await engine.publish(stored([1], A, salt="t"))  # before anyone subscribed
    await engine.publish(stored([2], B, parent=1))
    mirror = Mirror()
    sub = KvEventSubscriber(
        endpoint=engine.endpoint,
        replay_endpoint=engine.replay_endpoint,
        topic="kv-events",
        decoder=decoder(),
        sink=lambda: mirror,
        settle_s=0.05,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(sub.run(stop))
    try:
        await eventually(lambda: sub.stats.batches == 2)
        assert mirror.cached == set(keys(A + B, "t"))
        await engine.publish(stored([3], C, parent=2))
        await eventually(lambda: sub.stats.batches == 3)
        assert mirror.cached == set(keys(TOKENS, "t"))
        assert mirror.clears() == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        engine.task.cancel()
        engine.close()


async def test_a_resubscribe_catches_up_through_replay(with_replay: Rig) -> None:
    engine, sub, mirror = with_replay
    await engine.publish(stored([1], A, salt="t"))
    await eventually(lambda: sub.stats.batches == 1)
    sub.resubscribe()
    await engine.publish(stored([2], B, parent=1), drop=True)  # while reconnecting
    await eventually(lambda: sub.stats.batches == 2)
    assert mirror.cached == set(keys(A + B, "t"))
    assert mirror.clears() == 0


async def test_an_engine_restart_clears_the_mirror(with_replay: Rig) -> None:
    engine, sub, mirror = with_replay
    await engine.publish(stored([1], A, salt="t"))
    await engine.publish(stored([2], B, parent=1))
    await eventually(lambda: sub.stats.batches == 2)
    engine.restart()  # a new vLLM process: sequence numbers start at 0 again
    await engine.publish(stored([5], C, salt="u"))
    await eventually(lambda: mirror.clears() == 1 and sub.stats.batches == 3)
    assert mirror.cached == set(keys(C, "u"))


async def test_a_silent_replay_endpoint_does_not_block_live_events(short_dir: Path) -> None:
    engine = FakeVllm(short_dir, replay=False)
    mirror = Mirror()
    sub = KvEventSubscriber(
        endpoint=engine.endpoint,
        replay_endpoint=f"ipc://{short_dir}/nobody",  # configured, but no vLLM behind it
        topic="kv-events",
        decoder=decoder(),
        sink=lambda: mirror,
        replay_timeout_s=0.2,
        settle_s=0.05,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(sub.run(stop))
    try:
        await eventually(lambda: sub.stats.connected)
        await asyncio.sleep(0.5)  # past the start-up replay attempt
        await engine.publish(stored([1], A, salt="t"))
        await eventually(lambda: sub.stats.batches == 1)
        assert mirror.cached == set(keys(A, "t"))
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        engine.close()


async def test_cancelling_the_subscriber_is_not_taken_for_a_stop(with_replay: Rig) -> None:
    """A cancellation from outside ends the receive loop as a cancellation (the stop
    and reconnect events are what end it quietly)."""
    _, sub, _ = with_replay
    socket = sub._ctx.socket(zmq.SUB)
    asked = asyncio.Event()

    class _Watched:  # the real socket; says when the loop waits on a receive
        def recv_multipart(self) -> Any:
            asked.set()
            return socket.recv_multipart()

    try:
        receiving = asyncio.create_task(sub._receive(cast(Any, _Watched()), asyncio.Event()))
        await asyncio.wait_for(asked.wait(), 5)  # the loop waits for a message
        receiving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await receiving
        assert receiving.cancelled()
    finally:
        socket.close(linger=0)


def offloaded(hashes: Sequence[int | bytes], *, removed: bool = False) -> dict[str, Any]:
    """What vLLM's OffloadingConnector publishes for its CPU copies: hashes only."""
    if removed:
        return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "CPU"}
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": BS,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }


def test_host_copies_map_to_the_device_blocks_keys_when_mirrored() -> None:
    tokens = list(range(8))
    k = keys(tokens, "")
    d = KvEventDecoder(
        model=MODEL, block_size=BS, tenant_of_salt=lambda s: "" if s is None else s,
        host_media=frozenset({"CPU"}),
    )  # fmt: skip
    events = d.decode(batch(stored([1, 2], tokens), offloaded([1, 2, 99])))
    assert events == [CacheStored(k, None), CacheStored(k, None, host=True)]
    assert d.skipped_blocks == 1  # 99: never announced by the device cache
    # The device evicts block 2; vLLM reloads it later from host memory as a child of 1.
    assert d.decode(batch(removed([2]))) == [CacheRemoved((k[1],))]
    assert d.decode(batch(removed([1]))) == [CacheRemoved((k[0],))]
    reloaded = d.decode(batch(stored([3], tokens[4:], parent=1)))
    assert reloaded == [CacheStored((k[1],), k[0])]  # the parent resolved from its host copy
    assert d.decode(batch(offloaded([1, 2], removed=True))) == [CacheRemoved(k, host=True)]


def test_host_copies_are_skipped_unless_mirrored() -> None:
    d = decoder()
    tokens = list(range(4))
    assert d.decode(batch(stored([1], tokens), offloaded([1]))) == [
        CacheStored(keys(tokens, ""), None)
    ]
    assert d.decode(batch(offloaded([1], removed=True))) == []
