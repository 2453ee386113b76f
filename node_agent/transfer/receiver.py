"""The receiving half of KV transfer: a decode node's hand-off (``FetchKv``) and a
prefix migration into this node's own blocks (``PullBlocks`` → the source's
``ReadBlocks``).

Every transfer is verified the same way before anything is used: the peer's layout
equals this node's, the announced size is ``expected_tokens`` of it, chunks arrive in
order with good checksums, and no more and no fewer bytes than announced. Any failure,
the peer's refusal included, is a ``TransferError``. A migration writes nothing until
everything was received and verified, and only into blocks of a still-open transaction
that still lack content, so a failed pull leaves this node's pool exactly as it was.

An engine that keeps KV in its own process (vLLM) takes a prefix through its own
connector instead: the source's ``LendBlocks`` has its engine hold the prefix (the
tokens checked against both Txs' keys), this node's engine loads it into its prefix
cache, where the request's prefill finds it. Best effort like any migration: vLLM may
evict the loaded blocks before the prefill runs (then it computes them), and a failed
load is computed by the engine (``cached_tokens`` says how much was loaded).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from pathlib import Path

from kvc import fast_json
from kvc.block_keys import compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from node_agent.agent_state import AgentState
from node_agent.blocks.types import AllocateResult, InvalidArgument
from node_agent.engines.base import PrefixJob, PrefixLendingEngine
from node_agent.errors import PromptRejected, TransferError
from node_agent.kv import KvCodec, KvContent, KvLayout
from node_agent.transfer.shm import SharedOffer
from node_agent.transfer.transport import KvRequest, KvTransport

__all__ = ["KvReceiver"]


class KvReceiver:
    def __init__(self, state: AgentState, transport: KvTransport) -> None:
        self._state = state
        self._transport = transport

    async def fetch(self, source: pb.KvSource, tenant: str) -> tuple[KvContent | None, float, int]:
        """Pull a staged prefill from a peer: (kv, seconds, bytes)."""
        if not source.stage_handle:
            raise PromptRejected("kv_source.stage_handle is required")
        request = pb.FetchKvRequest(
            request_id=source.request_id, stage_handle=source.stage_handle, tenant=tenant
        )
        try:
            kv, seconds, nbytes = await self._receive(
                source.address, request, expected_tokens=source.num_tokens
            )
        except TransferError:
            self._state.metrics.transfer_failures.labels("handoff").inc()
            raise
        self._state.metrics.record_transfer("received", "handoff", nbytes, seconds)
        return kv, seconds, nbytes

    async def pull_blocks(self, request: pb.PullBlocksRequest) -> tuple[int, int, float]:
        """Copy the first ``num_blocks`` blocks of our Tx from the source's Tx:
        (blocks copied, bytes, seconds)."""
        state = self._state
        if not request.source_address or not request.source_tx_id:
            raise InvalidArgument("source_address and source_tx_id are required")
        if request.num_blocks == 0:
            raise InvalidArgument("num_blocks must be > 0")
        tx = state.pool.get_tx(request.tx_id)
        n = request.num_blocks
        if n > len(tx.handles):
            raise InvalidArgument(
                f"transaction {request.tx_id!r} holds {len(tx.handles)} blocks, num_blocks is {n}"
            )
        handles = tx.handles[:n]
        tokens = tuple(request.prompt_token_ids)
        owns_kv = state.engine.info.owns_kv_cache
        if tokens or owns_kv:  # given, they must be the blocks' tokens, whatever the engine
            self._check_tokens(request.tx_id, handles, tokens, pulls_by_tokens=owns_kv)
        wanted = [i for i, h in enumerate(handles) if state.needs_content(h)]
        if not wanted:
            return 0, 0, 0.0  # everything is here already: no transfer
        if owns_kv:
            return await self._pull_through_engine(request, tx, tokens, len(wanted))
        keys = [k for h in handles if (k := state.pool.block_key(h)) is not None]
        lease_left = max(0.001, tx.lease_deadline - state.clock())
        read = pb.ReadBlocksRequest(
            tx_id=request.source_tx_id,
            block_keys=keys,
            tenant=state.pool.tx_tenant(request.tx_id),
            read_token=request.source_read_token,
        )
        bs = state.settings.block_size
        try:
            kv, transfer_s, nbytes = await self._receive(
                request.source_address, read, expected_tokens=n * bs, timeout_s=lease_left
            )
        except TransferError:
            state.metrics.transfer_failures.labels("migration").inc()
            await state.require_open(request.tx_id)  # our lease ran out: report that instead
            raise
        state.metrics.record_transfer("received", "migration", nbytes, transfer_s)
        assert kv is not None  # n > 0 blocks of > 0 tokens
        blocks = await asyncio.to_thread(
            lambda: {i: kv.slice(i * bs, (i + 1) * bs) for i in wanted}
        )
        # The lease may have run out during the transfer: then the handles may
        # belong to someone else now and must not be written (as in Prefill).
        await state.require_open(request.tx_id)
        copied = 0
        for i, block in blocks.items():
            # Re-checked: a concurrent Prefill may have filled it meanwhile.
            if state.needs_content(handles[i]) and state.pool.set_payload(handles[i], block):
                copied += 1
        return copied, nbytes, transfer_s

    def _check_tokens(
        self,
        tx_id: str,
        handles: tuple[int, ...],
        tokens: tuple[int, ...],
        *,
        pulls_by_tokens: bool,
    ) -> None:
        """``tokens`` are exactly the tokens of ``handles``, the Tx's first blocks."""
        state = self._state
        bs = state.settings.block_size
        n = len(handles)
        if len(tokens) != n * bs:
            why = " (this engine pulls by tokens)" if pulls_by_tokens else ""
            raise InvalidArgument(
                f"prompt_token_ids must be the {n * bs} tokens of the first {n} blocks{why}, "
                f"got {len(tokens)}"
            )
        pool = state.pool
        keys = compute_block_keys(
            tokens, tenant=pool.tx_tenant(tx_id), model=state.engine.info.model, block_size=bs,
            layout=pool.tx_key_layout(tx_id),
        )  # fmt: skip
        if any(state.pool.block_key(h) != k for h, k in zip(handles, keys, strict=True)):
            raise InvalidArgument(
                f"prompt_token_ids are not the tokens of transaction {tx_id!r}'s blocks"
            )

    async def _pull_through_engine(
        self,
        request: pb.PullBlocksRequest,
        tx: AllocateResult,
        tokens: tuple[int, ...],
        missing: int,
    ) -> tuple[int, int, float]:
        """The prefix pull of an engine that owns its KV (module docstring), ``tokens``
        checked: (blocks loaded that this node lacked, their bytes, seconds of the load)."""
        state = self._state
        engine = state.engine
        if not isinstance(engine, PrefixLendingEngine) or not engine.lends_prefixes:
            raise PromptRejected(
                f"this node's engine ({engine.info.engine}) cannot take a prefix from a peer"
            )
        bs = state.settings.block_size
        n = request.num_blocks
        tenant = state.pool.tx_tenant(request.tx_id)
        # Half of what the lease has left, at most: the request's prefill still needs the
        # Tx after a pull given up (seen live: pulls queued behind busy engines outlived
        # the lease, and the request failed with it).
        budget_s = max(0.001, (tx.lease_deadline - state.clock()) / 2)
        lend = pb.LendBlocksRequest(
            tx_id=request.source_tx_id,
            tenant=tenant,
            read_token=request.source_read_token,
            prompt_token_ids=tokens,
            request_id=request.tx_id,
        )
        job = PrefixJob(request_id=request.tx_id, prompt_ids=tokens, tenant=tenant)
        try:
            async with asyncio.timeout(budget_s):
                lent = await self._transport.lend(request.source_address, lend)
                params = fast_json.loads_object(lent.engine_transfer_params)
                if params is None:
                    raise TransferError("the source's engine_transfer_params are not a JSON object")
                loaded = await engine.load_prefix(job, params)
        except (TransferError, TimeoutError) as exc:
            state.metrics.transfer_failures.labels("migration").inc()
            await state.require_open(request.tx_id)  # our lease ran out: report that instead
            if isinstance(exc, TimeoutError):
                raise TransferError(
                    f"the prefix pull took over {budget_s:.3f} s, half of what the "
                    "transaction's lease had left; computing the prefix instead"
                ) from None
            raise
        await state.require_open(request.tx_id)
        # The engine computes the prefix's last token itself: a whole load is one short.
        loaded_blocks = min(n, (loaded.cached_tokens + 1) // bs)
        copied = max(0, loaded_blocks - (n - missing))
        nbytes = copied * bs * engine.info.kv_layout.bytes_per_token
        state.metrics.record_transfer("received", "migration", nbytes, loaded.seconds)
        return copied, nbytes, loaded.seconds

    async def _receive(
        self,
        address: str,
        request: KvRequest,
        *,
        expected_tokens: int,
        timeout_s: float | None = None,
    ) -> tuple[KvContent | None, float, int]:
        """Receive and verify: (kv of ``expected_tokens`` tokens or None for zero, seconds,
        bytes). A same-host peer writes into a shared-memory file this node offers
        (``node_agent.transfer.shm``); any other streams."""
        codec = self._state.codec() if expected_tokens else None
        started = time.perf_counter()
        own = self._state.engine.info.kv_layout
        offer = self._offer(expected_tokens * own.bytes_per_token)
        if offer is not None:
            request.shared_memory_name = offer.name
        try:
            return await self._take(address, request, codec, own, expected_tokens, offer, started,
                                    timeout_s)  # fmt: skip
        finally:
            if offer is not None:
                offer.close()

    def _offer(self, nbytes: int) -> SharedOffer | None:
        """A same-host offer, made on the loop (a sparse file: microseconds) so that a
        cancellation can never leave it unclosed."""
        shm_dir = self._state.settings.kv_shm_dir
        if not shm_dir or nbytes <= 0:
            return None
        return SharedOffer.create(Path(shm_dir), nbytes)

    async def _take(
        self,
        address: str,
        request: KvRequest,
        codec: KvCodec | None,
        own: KvLayout,
        expected_tokens: int,
        offer: SharedOffer | None,
        started: float,
        timeout_s: float | None,
    ) -> tuple[KvContent | None, float, int]:
        buffer = bytearray()
        expected_total = -1
        shared = False
        stream = self._transport.receive(address, request, timeout_s=timeout_s)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if shared:
                    raise TransferError("peer sent chunks after its shared-memory transfer")
                if chunk.in_shared_memory and expected_total >= 0:
                    raise TransferError("peer claims a shared-memory transfer mid-stream")
                if expected_total < 0:
                    lay = chunk.layout
                    theirs = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype)
                    if theirs != (own.num_layers, own.num_kv_heads, own.head_dim, own.dtype):
                        raise TransferError("peer KV layout differs from this node's model")
                    if chunk.num_tokens != expected_tokens:
                        raise TransferError(
                            f"peer sends {chunk.num_tokens} tokens, expected {expected_tokens}"
                        )
                    expected_total = chunk.total_bytes
                    if expected_total != expected_tokens * own.bytes_per_token:
                        raise TransferError("peer announced a KV size that does not match")
                    if chunk.in_shared_memory:
                        if offer is None or chunk.data or expected_total != offer.nbytes:
                            raise TransferError("peer claims a shared-memory transfer not offered")
                        shared = True
                        continue
                if chunk.offset != len(buffer):
                    raise TransferError("KV chunk out of order")
                if zlib.crc32(chunk.data) != chunk.crc32:
                    raise TransferError(f"KV chunk at offset {chunk.offset} failed its checksum")
                buffer.extend(chunk.data)
                if len(buffer) > expected_total:
                    raise TransferError("peer sent more KV than announced")
        if shared:
            assert offer is not None  # shared is set only against an offer
            assert codec is not None  # and an offer only for a transfer of > 0 tokens
            try:
                data = await asyncio.to_thread(offer.read)
            except (OSError, ValueError) as exc:
                raise TransferError(f"the shared-memory transfer cannot be read: {exc}") from exc
            # Decoded from the mapping: one copy onto a GPU, none on a CPU engine.
            got = await asyncio.to_thread(codec.from_bytes, own, data, expected_tokens)
            self._state.metrics.shared_memory_transfers.inc()
            return got, time.perf_counter() - started, expected_total
        if len(buffer) != expected_total:
            raise TransferError("KV transfer ended early")
        kv = None
        if codec is not None:
            # The buffer is handed over: decoded in place, not copied once more.
            kv = await asyncio.to_thread(codec.from_bytes, own, buffer, expected_tokens)
        return kv, time.perf_counter() - started, len(buffer)
