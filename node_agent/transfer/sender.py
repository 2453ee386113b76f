"""The sending half of KV transfer: a staged prefill (``FetchKv``) or the KV of an open
transaction's blocks (``ReadBlocks``), streamed through the ``KvTransport``; or, for an
engine that keeps KV in its own process (vLLM), a prefix of an open transaction lent
engine to engine (``LendBlocks``: the engine holds it for one pull by its peer).

Bytes sent are counted even of a transfer cut short; the duration only of complete ones.
A lend sends no bytes through the agent: the engines move them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from kvc import fast_json
from kvc.block_keys import compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from node_agent.agent_state import AgentState
from node_agent.auth import Caller, check_grantee
from node_agent.blocks.types import (
    BlockPoolError,
    InvalidArgument,
    TenantMismatch,
    TxClosed,
    TxNotFound,
)
from node_agent.engines.base import PrefixJob, PrefixLendingEngine
from node_agent.errors import ContentMissing, NotPermitted, NotStaged, PromptRejected
from node_agent.kv import KvContent
from node_agent.transfer.shm import write_shared
from node_agent.transfer.staging import ReadGrants, StagingArea
from node_agent.transfer.transport import KvTransport, layout_to_pb

__all__ = ["KvSender"]

_MIN_CHUNK_BYTES = 4096


class KvSender:
    def __init__(
        self,
        state: AgentState,
        staging: StagingArea,
        grants: ReadGrants,
        transport: KvTransport,
    ) -> None:
        self._state = state
        self._staging = staging
        self._grants = grants
        self._transport = transport

    def _may_use(self, caller: Caller) -> Callable[[str], None]:
        strict = self._state.settings.require_node_certificates
        return lambda grantee: check_grantee(caller, grantee, require_node_certificates=strict)

    async def fetch_kv(
        self, request: pb.FetchKvRequest, caller: Caller
    ) -> AsyncIterator[pb.KvChunk]:
        """Stream a staged prefill, claimed first so that a retry cannot double-serve it;
        only to the node the conductor bound it to (``check_grantee``)."""
        if not request.stage_handle:
            raise InvalidArgument("stage_handle is required")
        staged = self._staging.claim(request.stage_handle, request.tenant, self._may_use(caller))
        if staged is None:  # the same answer whether absent or another tenant's
            raise NotStaged(f"no staged KV under this handle (request {request.request_id!r})")
        stream = self._stream(
            staged.kv, staged.num_tokens, request.max_chunk_bytes, request.shared_memory_name
        )
        async for msg in self._count_sent(stream, "handoff"):
            yield msg

    async def _check_grant(self, tx_id: str, read_token: str, caller: Caller) -> None:
        """The caller holds the Tx's read grant, and the grant is for its node."""
        grantee = self._grants.grantee(tx_id, read_token)
        if grantee is None:
            # A closed Tx's grant is forgotten at the next housekeeping: a read after
            # the Tx closed gets the same answer (closed) before and after that.
            try:
                self._state.pool.get_tx(tx_id)
            except (TxNotFound, TxClosed) as exc:
                await self._state.events.after_mutation()  # the lookup may expire leases
                if isinstance(exc, TxClosed):
                    raise
            raise NotPermitted(f"no read grant for transaction {tx_id!r}")
        self._may_use(caller)(grantee)

    async def read_blocks(
        self, request: pb.ReadBlocksRequest, caller: Caller
    ) -> AsyncIterator[pb.KvChunk]:
        """Stream the KV of the first blocks of an open Tx (any role may serve), to a
        caller holding the Tx's read grant, if the grant is for its node."""
        await self._check_grant(request.tx_id, request.read_token, caller)
        try:
            kv = await self._read_tx_blocks(
                request.tx_id, tuple(request.block_keys), request.tenant
            )
        except (BlockPoolError, ContentMissing):
            await self._state.events.after_mutation()  # the lookup may have expired leases
            raise
        num_tokens = len(request.block_keys) * self._state.settings.block_size
        stream = self._stream(kv, num_tokens, request.max_chunk_bytes, request.shared_memory_name)
        async for msg in self._count_sent(stream, "migration"):
            yield msg

    async def lend_blocks(
        self, request: pb.LendBlocksRequest, caller: Caller
    ) -> pb.LendBlocksResponse:
        """Have the engine hold the prefix of an open Tx for one pull by its peer engine
        (the caller holds the Tx's read grant, for its node) and answer how to pull it.

        The tokens are checked against the Tx's keys, so a caller cannot have this node
        lend anything but the blocks the conductor locked for it."""
        await self._check_grant(request.tx_id, request.read_token, caller)
        state = self._state
        engine = state.engine
        if not isinstance(engine, PrefixLendingEngine) or not engine.lends_prefixes:
            raise PromptRejected(
                f"this node's engine ({engine.info.engine}) does not lend prefixes to peers"
            )
        tokens = tuple(request.prompt_token_ids)
        bs = state.settings.block_size
        if not tokens or len(tokens) % bs:
            raise InvalidArgument(
                f"prompt_token_ids must be whole blocks of {bs} tokens, got {len(tokens)}"
            )
        try:
            keys = compute_block_keys(
                tokens, tenant=request.tenant, model=engine.info.model, block_size=bs,
                layout=state.pool.tx_key_layout(request.tx_id),  # the Tx's keys' layout
            )  # fmt: skip
            self._tx_handles(request.tx_id, tuple(keys), request.tenant)
        except BlockPoolError:
            await state.events.after_mutation()  # the lookup may have expired leases
            raise
        lent = await engine.lend_prefix(
            PrefixJob(request_id=request.request_id, prompt_ids=tokens, tenant=request.tenant)
        )
        return pb.LendBlocksResponse(
            engine_transfer_params=fast_json.dumps(dict(lent.transfer_params)).decode(),
            num_tokens=len(tokens),
            cached_tokens=lent.cached_tokens,
        )

    def _stream(
        self, kv: KvContent | None, num_tokens: int, max_chunk_bytes: int, shared_name: str
    ) -> AsyncIterator[pb.KvChunk]:
        limit = self._state.settings.transfer_chunk_bytes
        chunk_bytes = max(_MIN_CHUNK_BYTES, min(max_chunk_bytes or limit, limit))
        return self._framed(kv, num_tokens, chunk_bytes, shared_name)

    async def _framed(
        self, kv: KvContent | None, num_tokens: int, chunk_bytes: int, shared_name: str
    ) -> AsyncIterator[pb.KvChunk]:
        layout = self._state.engine.info.kv_layout
        shm_dir = self._state.settings.kv_shm_dir
        # The caller offers a same-host file: written there if it is here, else streamed.
        if shared_name and shm_dir and kv is not None and kv.nbytes > 0:
            nbytes = kv.nbytes
            where = Path(shm_dir)
            if await asyncio.to_thread(write_shared, where, shared_name, kv.to_buffers(), nbytes):
                yield pb.KvChunk(
                    layout=layout_to_pb(layout),
                    num_tokens=num_tokens,
                    total_bytes=nbytes,
                    in_shared_memory=True,
                )
                return
        data = await asyncio.to_thread(kv.to_bytes) if kv is not None else b""
        async for msg in self._transport.send(
            data, layout=layout, num_tokens=num_tokens, chunk_bytes=chunk_bytes
        ):
            yield msg

    async def _count_sent(
        self, stream: AsyncIterator[pb.KvChunk], kind: str
    ) -> AsyncIterator[pb.KvChunk]:
        """Pass chunks through, counting bytes sent (even of a transfer cut short)."""
        metrics = self._state.metrics
        started = time.perf_counter()
        sent = 0
        complete = False
        try:
            async for msg in stream:
                sent += msg.total_bytes if msg.in_shared_memory else len(msg.data)
                yield msg
            complete = True
        finally:
            metrics.transfer_bytes.labels("sent", kind).inc(sent)
            if complete:
                metrics.transfer_seconds.labels("sent", kind).observe(time.perf_counter() - started)

    def _tx_handles(self, tx_id: str, keys: tuple[int, ...], tenant: str) -> tuple[int, ...]:
        """The open Tx's first ``len(keys)`` blocks, which must hold exactly ``keys``."""
        state = self._state
        if not keys:
            raise InvalidArgument("block_keys must not be empty")
        handles = state.pool.get_tx(tx_id).handles
        if state.pool.tx_tenant(tx_id) != tenant:
            raise TenantMismatch(f"transaction {tx_id!r} belongs to another tenant")
        if len(keys) > len(handles):
            raise InvalidArgument(
                f"transaction {tx_id!r} holds {len(handles)} blocks, {len(keys)} were asked for"
            )
        if any(state.pool.block_key(h) != k for h, k in zip(handles, keys, strict=False)):
            raise InvalidArgument(f"transaction {tx_id!r} holds other blocks than those asked for")
        return handles[: len(keys)]

    async def _read_tx_blocks(self, tx_id: str, keys: tuple[int, ...], tenant: str) -> KvContent:
        """KV of the open Tx's first ``len(keys)`` blocks, which must hold exactly ``keys``."""
        state = self._state
        handles = self._tx_handles(tx_id, keys, tenant)
        # Taken now, before any await: payloads are immutable, so what is streamed
        # stays the content of these keys even if the lease ran out meanwhile.
        payloads = [state.content(h) for h in handles]
        bs = state.settings.block_size
        missing = sum(p is None or p.num_tokens != bs for p in payloads)
        if missing:
            raise ContentMissing(
                f"{missing} of the {len(keys)} blocks of transaction {tx_id!r} hold no KV"
            )
        codec = state.codec()
        return await asyncio.to_thread(codec.concat, [p for p in payloads if p is not None])
