"""Runs one generation across node agents as a Mooncake-style transaction.

1. Rank (prefill, decode) candidates (``conductor.core.placement``).
2. ``TxAllocate`` the prompt's block keys on the prefill node (reuse + lock).
3. Disaggregated: ``Prefill`` there, then ``Generate`` on the decode node with a
   ``kv_source`` pointing back at the staged KV. Colocated ("both" node):
   ``Generate`` with the ``tx_id`` and the node prefills locally.
4. When the first token arrives, ``TxCommit`` on the prefill node: the new blocks
   become reusable prefix cache.
5. Any failure or cancellation before the commit ``TxAbort``s the Tx (shielded
   from cancellation). Node-side leases are the backstop if this process dies.

A node that is out of capacity (RESOURCE_EXHAUSTED) or unreachable makes the
dispatcher try the next candidate; every error leaves here as a ``ConductorError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass

import grpc

from conductor.adapters.agents import AgentCallError, AgentFleet, AgentHandle, translate_rpc_error
from conductor.core.block_keys import compute_block_keys
from conductor.core.placement import rank_candidates
from conductor.errors import (
    ConductorError,
    GatewayTimeout,
    InvalidRequest,
    RateLimited,
    ServiceUnavailable,
    UpstreamError,
)
from kvc.v1 import node_agent_pb2 as pb

log = logging.getLogger("conductor.dispatch")

_FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingSpec


@dataclass(frozen=True, slots=True)
class UsageCounts:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class TokenDelta:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None  # "stop" | "length" on the last delta
    usage: UsageCounts | None  # on the last delta


@dataclass(frozen=True, slots=True)
class Placement:
    prefill_node: str
    decode_node: str
    disaggregated: bool
    reused_blocks: int
    cached_tokens: int


def _to_delta(msg: pb.GenerateResponse, cached_tokens: int) -> TokenDelta:
    usage = None
    if msg.HasField("usage"):
        usage = UsageCounts(
            prompt_tokens=msg.usage.prompt_tokens,
            completion_tokens=msg.usage.completion_tokens,
            cached_tokens=max(cached_tokens, msg.usage.cached_tokens),
        )
    return TokenDelta(
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        finish_reason=_FINISH_NAMES.get(msg.finish_reason),
        usage=usage,
    )


class GenerationStream:
    """The running generation: iterate ``TokenDelta``s; ``aclose()`` cancels it."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse],
        first: pb.GenerateResponse,
        placement: Placement,
        release: list[AgentHandle],
        decode_address: str,
    ) -> None:
        self._call = call
        self._pending: pb.GenerateResponse | None = first
        self.placement = placement
        self._release = release
        self._decode_address = decode_address
        self._closed = False
        self._finished = False

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> TokenDelta:
        if self._finished:
            raise StopAsyncIteration
        if self._pending is not None:
            msg, self._pending = self._pending, None
        else:
            try:
                read = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                await self.aclose()
                raise _map_error(translate_rpc_error(self._decode_address, exc)) from exc
            if read is grpc.aio.EOF:
                await self.aclose()
                raise UpstreamError("the decode node ended the stream without a finish reason")
            assert isinstance(read, pb.GenerateResponse)
            msg = read
        delta = _to_delta(msg, self.placement.cached_tokens)
        if delta.finish_reason is not None:
            self._finished = True
            await self.aclose()
        return delta

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            self._call.cancel()
        for agent in self._release:
            agent.inflight -= 1


def _map_error(exc: AgentCallError) -> ConductorError:
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(exc.message)
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RateLimited(
            "No node has capacity for this request right now.",
            retry_after_s=1.0,
            reason="insufficient_capacity",
        )
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayTimeout("A node did not answer in time.")
    if exc.node_unreachable:
        return ServiceUnavailable("A node became unavailable.", retry_after_s=1.0)
    return UpstreamError(f"A node failed the request: {exc.message}")


class Dispatcher:
    """Places and runs generations; owns the cleanup tasks it starts."""

    def __init__(
        self, fleet: AgentFleet, *, lease_s: float, rpc_timeout_s: float, request_timeout_s: float
    ) -> None:
        self._fleet = fleet
        self._lease_s = lease_s
        self._rpc_timeout_s = rpc_timeout_s
        self._request_timeout_s = request_timeout_s
        self._tick = 0
        self._cleanup: set[asyncio.Task[None]] = set()

    async def _shielded(self, coro: Awaitable[None]) -> None:
        """Run cleanup to completion even if the caller is being cancelled."""

        async def run() -> None:
            await coro

        task = asyncio.create_task(run())
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)

    async def _abort_tx(self, agent: AgentHandle, tx_id: str) -> None:
        try:
            await agent.stub.TxAbort(pb.TxAbortRequest(tx_id=tx_id), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            # The node-side lease frees the blocks if this abort is lost.
            log.warning("TxAbort %s on %s failed: %s", tx_id, agent.address, exc.details())

    async def drain(self) -> None:
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)

    async def start(self, req: GenerationRequest) -> GenerationStream:
        """Place the request and return once its first token has been produced."""
        self._tick += 1
        candidates = rank_candidates(self._fleet.views(), self._tick)
        if not candidates.prefill or not candidates.decode:
            raise ServiceUnavailable(
                "No prefill and decode capable node is available.", retry_after_s=2.0
            )
        last: AgentCallError | None = None
        exhausted = 0
        for prefill_address in candidates.prefill:
            prefill = self._fleet.get(prefill_address)
            decode = prefill if prefill.role == "both" else self._fleet.get(candidates.decode[0])
            try:
                return await self._attempt(prefill, decode, req)
            except AgentCallError as exc:
                last = exc
                if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted += 1
                    continue
                if exc.node_unreachable:
                    self._fleet.mark_unreachable(exc.address, exc.message)
                    continue
                raise _map_error(exc) from exc
        assert last is not None
        if exhausted:
            raise RateLimited(
                "Every node is out of KV capacity for this request; retry shortly.",
                retry_after_s=1.0,
                reason="insufficient_capacity",
            ) from last
        raise _map_error(last) from last

    async def _attempt(
        self, prefill: AgentHandle, decode: AgentHandle, req: GenerationRequest
    ) -> GenerationStream:
        assert prefill.info is not None
        info = prefill.info
        keys = compute_block_keys(
            req.prompt_ids[:-1], tenant=req.tenant, model=info.model, block_size=info.block_size
        )
        tx_id = f"{req.request_id}:{uuid.uuid4().hex[:12]}"
        disaggregated = decode is not prefill
        release = [prefill, decode] if disaggregated else [prefill]
        for agent in release:
            agent.inflight += 1
        call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse] | None = None
        tx_open = False
        address = prefill.address
        try:
            if keys:
                alloc = await prefill.stub.TxAllocate(
                    pb.TxAllocateRequest(
                        tx_id=tx_id,
                        tenant=req.tenant,
                        block_keys=keys,
                        lease_s=self._lease_s,
                        mode=pb.TX_MODE_ALLOCATE,
                    ),
                    timeout=self._rpc_timeout_s,
                )
                tx_open = True
                reused_blocks = alloc.reused_blocks
            else:
                tx_id, reused_blocks = "", 0  # shorter than one block: no Tx needed
            cached_tokens = reused_blocks * info.block_size
            sampling = pb.SamplingParams(
                temperature=req.sampling.temperature,
                top_p=req.sampling.top_p,
                max_tokens=req.sampling.max_tokens,
                stop=list(req.sampling.stop),
                ignore_eos=req.sampling.ignore_eos,
            )
            if req.sampling.seed is not None:
                sampling.seed = req.sampling.seed
            gen = pb.GenerateRequest(
                request_id=req.request_id,
                tenant=req.tenant,
                prompt_token_ids=req.prompt_ids,
                sampling=sampling,
            )
            if disaggregated:
                pre = await prefill.stub.Prefill(
                    pb.PrefillRequest(
                        request_id=req.request_id,
                        tenant=req.tenant,
                        tx_id=tx_id,
                        prompt_token_ids=req.prompt_ids,
                        stage_ttl_s=self._lease_s,
                    ),
                    timeout=self._request_timeout_s,
                )
                cached_tokens = pre.cached_tokens
                gen.kv_source.CopyFrom(
                    pb.KvSource(
                        address=info.advertise_address,
                        request_id=req.request_id,
                        num_tokens=len(req.prompt_ids) - 1,
                    )
                )
            else:
                gen.tx_id = tx_id
            address = decode.address
            call = decode.stub.Generate(gen, timeout=self._request_timeout_s)
            first = await call.read()
            if first is grpc.aio.EOF:
                raise AgentCallError(
                    decode.address, grpc.StatusCode.INTERNAL, "empty generation stream", None
                )
            assert isinstance(first, pb.GenerateResponse)
            # Mooncake §5.3: commit when the first decode token arrives.
            address = prefill.address
            if tx_open:
                await prefill.stub.TxCommit(
                    pb.TxCommitRequest(tx_id=tx_id), timeout=self._rpc_timeout_s
                )
                tx_open = False
            placement = Placement(
                prefill_node=prefill.address,
                decode_node=decode.address,
                disaggregated=disaggregated,
                reused_blocks=reused_blocks,
                cached_tokens=cached_tokens,
            )
            return GenerationStream(call, first, placement, release, decode.address)
        except BaseException as exc:
            if call is not None:
                call.cancel()
            if tx_open:
                await self._shielded(self._abort_tx(prefill, tx_id))
            for agent in release:
                agent.inflight -= 1
            if isinstance(exc, grpc.aio.AioRpcError):
                raise translate_rpc_error(address, exc) from exc
            raise
