"""KV-cache events in vLLM 0.32's wire format, and the ZMQ publisher that sends them.

Wire (what ``vllm/distributed/kv_events.py`` produces with msgspec)
    One message per engine step that has events, three frames: the topic, the sequence
    number as 8 bytes big-endian (0, 1, 2, ... per process) and a msgpack payload. The
    payload is the batch as an array ``[ts, events, data_parallel_rank]`` (a float64
    wall-clock timestamp, rank 0). Each event is a map whose first key is the tag
    ``"type"``, then the fields in declaration order; fields without a default are
    always present (``None`` encodes as nil), fields with one are left out while they
    equal it:

    * ``BlockStored``: type, block_hashes, parent_block_hash, token_ids (all blocks
      concatenated), block_size, lora_id, medium ("GPU"), lora_name, [extra_keys: one
      entry per block, ``[salt]`` for a salted block 0, else nil], group_idx (0);
    * ``BlockRemoved``: type, block_hashes, medium, group_idx;
    * ``AllBlocksCleared``: type.

    Integers take msgpack's smallest encoding and strings str8 past 31 bytes, as msgspec
    does; ``tests/unit/test_vllm_sim_wire.py`` holds bytes made by vLLM's own encoder.

Publisher (``ZmqEventPublisher``)
    A PUB socket (bound when the endpoint has ``*``, ``::``, or is ipc/inproc; connected
    otherwise, as vLLM does), high-water mark ``hwm``; batches go through a queue of at
    most ``max_queue_size`` (the engine waits when it is full, as vLLM's engine does on
    its blocking queue). With a ``replay_endpoint`` a ROUTER socket answers a DEALER's
    ``[b"", start_seq]`` with ``[b"", topic, seq, payload]`` for every buffered batch from
    ``start_seq`` on, then ``[b"", b"", -1 (8 bytes, signed), b""]``. The replay buffer
    keeps the last ``buffer_steps`` batches.

Complexity
    O(tokens + blocks) per encoded event; replay O(buffered batches).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence
from typing import Any, Final

import msgpack
import zmq
import zmq.asyncio

from kvc_sim.vllm_sim.config import KvEventsConfig
from kvc_sim.vllm_sim.events import BlockRemoved, BlockStored, KvCacheEvent

log = logging.getLogger("kvc_sim.vllm_sim.kv_events")

__all__ = ["END_SEQ", "ZmqEventPublisher", "encode_batch"]

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)


def _event_map(event: KvCacheEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        out: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
        if event.extra_keys is not None:
            out["extra_keys"] = [None if k is None else list(k) for k in event.extra_keys]
        out["group_idx"] = event.group_idx
        return out
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
            "group_idx": event.group_idx,
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(ts: float, events: Sequence[KvCacheEvent], data_parallel_rank: int = 0) -> bytes:
    """One batch as vLLM's msgspec encoder writes a ``KVEventBatch``."""
    payload = [float(ts), [_event_map(e) for e in events], data_parallel_rank]
    packed: bytes = msgpack.packb(payload, use_bin_type=True)
    return packed


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """PUB + optional ROUTER replay on the caller's event loop (see the module docstring).

    ``start()`` opens the sockets and starts the sender and replay tasks; ``publish`` is
    awaited by the engine loop once per step with events; ``aclose()`` sends what is
    queued (bounded by ``drain_timeout_s``) and closes everything.
    """

    def __init__(self, config: KvEventsConfig, *, drain_timeout_s: float = 1.0) -> None:
        self._config = config
        self._topic = config.topic.encode("utf-8")
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._drain_timeout_s = drain_timeout_s
        self.endpoint = config.endpoint
        self.replay_endpoint = config.replay_endpoint

    @property
    def next_seq(self) -> int:
        return self._seq

    def start(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(self._config.hwm)
        if _binds(self._config.endpoint):
            pub.bind(self._config.endpoint)
            self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            pub.connect(self._config.endpoint)
        self._pub = pub
        self._tasks.append(asyncio.create_task(self._send_loop(), name="kv-events-send"))
        if self._config.replay_endpoint:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(self._config.replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._router = router
            self._tasks.append(asyncio.create_task(self._replay_loop(), name="kv-events-replay"))

    async def publish(self, ts: float, events: Sequence[KvCacheEvent]) -> None:
        """Queue one batch (waits while ``max_queue_size`` batches are queued)."""
        await self._queue.put(encode_batch(ts, events))

    async def _send_loop(self) -> None:
        assert self._pub is not None
        while True:
            payload = await self._queue.get()
            if payload is None:
                return
            seq = self._seq
            self._seq += 1
            try:
                await self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            except zmq.ZMQError as exc:  # the batch is lost; replay still has it
                log.warning("KV events: batch %d not sent: %s", seq, exc)
            self._buffer.append((seq, payload))

    async def _replay_loop(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV events: invalid replay request of %d frames", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(
                        [client, b"", self._topic, seq.to_bytes(8, "big"), payload]
                    )
            await router.send_multipart([client, b"", b"", END_SEQ, b""])

    async def aclose(self) -> None:
        if self._tasks:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue.put(None), timeout=self._drain_timeout_s)
            sender = self._tasks[0]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(sender), timeout=self._drain_timeout_s)
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._tasks.clear()
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
