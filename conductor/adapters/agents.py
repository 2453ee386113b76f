"""gRPC adapter to node agents: channels, info/health polling, error translation.

Each configured address gets one ``grpc.aio`` channel for the conductor's life.
A poll loop calls ``GetInfo`` on every agent; an agent is *usable* when it
answered the latest poll and serves the model this conductor serves. gRPC errors
become ``AgentCallError`` here, and the dispatcher maps those to HTTP once. An agent
whose token stream serves ``GetInfo`` (``NodeInfo.stream_methods``) is polled there, a
frame each way instead of a gRPC call (~20–30× less CPU: ``bench/stream_cost.py``);
when that listener is gone (``UNAVAILABLE``) the same poll asks over gRPC, whose answer
says where the stream is now. ``Prefill`` goes the same way (without the second try).

Two client interceptors sit on every channel: the outer one retries ``TxCommit`` and
``TxAbort`` (idempotent by ``tx_id``) that ended UNAVAILABLE or DEADLINE_EXCEEDED, at
most 3 attempts 50 ms, then 100 ms apart plus up to 50 ms jitter (tenacity); the inner
one counts every attempt's status for ``conductor_agent_calls_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc
from google.protobuf.message import Message
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_result,
    stop_after_attempt,
    wait_exponential_jitter,
)

from conductor.adapters.token_stream import TokenStreamClient
from kvc.block_keys import KEY_LAYOUT
from kvc.roles import NodeRole
from kvc.tls import PlaintextPolicy, TlsFiles, client_channel
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from kvc.wire import ERROR_INFO_KEY, MAX_MESSAGE_BYTES, ROLE_FROM_PB, SERVICE_NAME

log = logging.getLogger("conductor.agents")

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    # A restarted agent is dialled again within a second or two (gRPC's default backoff
    # grows to 120 s: a restarted agent sat unused for 5-55 s, longer after an outage).
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]
_GET_INFO = pb.GetInfoRequest()
M = TypeVar("M", bound=Message)
_RETRIED_METHODS = frozenset(f"/{SERVICE_NAME}/{name}" for name in ("TxCommit", "TxAbort"))
_TRANSIENT_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_RETRY_ATTEMPTS = 3
_RETRY_FIRST_WAIT_S = 0.05
_RETRY_MAX_WAIT_S = 0.5
_RETRY_JITTER_S = 0.05


class AgentCallError(Exception):
    """An agent call failed; ``code`` is the gRPC status, ``info`` optional details."""

    def __init__(
        self, address: str, code: grpc.StatusCode, message: str, info: pb.ErrorInfo | None
    ) -> None:
        super().__init__(f"{address}: {code.name}: {message}")
        self.address = address
        self.code = code
        self.message = message
        self.info = info

    @property
    def reason(self) -> str:
        """The agent's ErrorInfo reason: capacity, busy, draining, transfer, or ""."""
        return self.info.reason if self.info is not None else ""

    @property
    def node_unreachable(self) -> bool:
        """The node itself is down (not: draining, or a peer failing a transfer)."""
        if self.reason in ("draining", "transfer"):
            return False
        return self.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def translate_rpc_error(address: str, exc: grpc.aio.AioRpcError) -> AgentCallError:
    info: pb.ErrorInfo | None = None
    for key, value in exc.trailing_metadata() or ():
        if key == ERROR_INFO_KEY and isinstance(value, bytes):
            info = pb.ErrorInfo.FromString(value)
    return AgentCallError(address, exc.code(), exc.details() or "", info)


class StreamingCall(Protocol):
    """A running server-streaming call (``Generate``, ``WatchEvents``): a gRPC call or
    a token stream call (``StreamCall``)."""

    async def read(self) -> Any: ...  # a GenerateResponse or EventBatch, or grpc.aio.EOF
    def cancel(self) -> bool: ...


def incompatibility(info: pb.NodeInfo, model: str) -> str:
    """Why a conductor serving ``model`` cannot schedule onto the agent of ``info``;
    empty when it can. Block keys of another layout would never match the agent's
    events, and the agent would verify our transactions' keys in vain."""
    if info.model != model:
        return f"serves model {info.model!r}, this conductor serves {model!r}"
    layout = info.block_key_layout or 1  # 0: an agent from before the field
    if layout != KEY_LAYOUT:
        older = "the agent" if layout < KEY_LAYOUT else "the conductor"
        return (
            f"keys blocks in layout {layout}, this conductor in layout {KEY_LAYOUT} "
            f"(kvc/block_keys.py): upgrade {older}"
        )
    return ""


@dataclass(slots=True)
class AgentHandle:
    address: str
    channel: grpc.aio.Channel
    stub: pb_grpc.NodeAgentAsyncStub
    info: pb.NodeInfo | None = None
    stream: TokenStreamClient | None = None  # the agent's token stream, when offered
    reachable: bool = False
    # Serves this conductor's model and keys blocks in its layout (``incompatibility``).
    compatible: bool = False
    inflight: int = 0
    last_error: str = field(default="not polled yet")
    load: pb.LoadUpdate | None = None  # latest from Snapshot / WatchEvents (``set_load``)
    # This conductor's work on the node that ended since ``load`` came: the report
    # still counts it until the next one (every ``load_interval_s``), and a prefill
    # queue or decode batch that is gone must not steer placements meanwhile.
    ended_prefill_tokens: int = 0
    ended_generations: int = 0
    # Keys the node retains for prompt-cache breakpoints (its snapshot and events).
    retained: set[int] = field(default_factory=set)
    # When a call over ``stream`` last got its answer (monotonic seconds): a shadow
    # session that fell back to gRPC moves back once this passes its start.
    stream_answered_s: float = -math.inf

    def set_load(self, load: pb.LoadUpdate) -> None:
        """A new load report: it already leaves out what ended before it."""
        self.load = load
        self.ended_prefill_tokens = 0
        self.ended_generations = 0

    @property
    def queued_prefill_tokens(self) -> int:
        """Reported prompt tokens waiting for or in a prefill, less ours that ended since."""
        if self.load is None:
            return 0
        return max(0, self.load.queued_prefill_tokens - self.ended_prefill_tokens)

    @property
    def running_requests(self) -> int:
        """Reported generations, less ours that ended since; at least ours in flight."""
        reported = 0 if self.load is None else self.load.running_requests
        return max(self.inflight, reported - self.ended_generations)

    @property
    def usable(self) -> bool:
        return (
            self.reachable and self.compatible and self.info is not None and not self.info.draining
        )

    def stream_for(self, method: str) -> TokenStreamClient | None:
        """The agent's token stream when it serves ``method`` there, else None."""
        stream = self.stream
        if stream is None or self.info is None or method not in self.info.stream_methods:
            return None
        return stream

    def generate(self, request: pb.GenerateRequest, *, timeout: float | None) -> StreamingCall:
        """``Generate`` over the agent's token stream when it offers one, else gRPC."""
        if self.stream is not None:
            return self.stream.generate(request, timeout=timeout)
        return self.stub.Generate(request, timeout=timeout)

    @property
    def role(self) -> NodeRole:
        if self.info is None:
            return "both"
        return ROLE_FROM_PB.get(self.info.role, "both")


CallObserver = Callable[[str, str], None]  # (gRPC method path, status code name)
_Continuation = Callable[
    [grpc.aio.ClientCallDetails, Any], Awaitable[grpc.aio.UnaryUnaryCall[Any, Any]]
]
_Attempt = tuple[grpc.aio.UnaryUnaryCall[Any, Any], grpc.StatusCode]


def _method_path(details: grpc.aio.ClientCallDetails) -> str:
    method: object = details.method  # bytes at run time, str in stubs
    return method.decode() if isinstance(method, bytes) else str(method)


def _transient(attempt: _Attempt) -> bool:
    return attempt[1] in _TRANSIENT_CODES


def _last_attempt(state: RetryCallState) -> _Attempt:
    assert state.outcome is not None
    attempt: _Attempt = state.outcome.result()
    return attempt


class _RetryIdempotentCalls(grpc.aio.UnaryUnaryClientInterceptor):
    """Retries TxCommit and TxAbort that ended UNAVAILABLE or DEADLINE_EXCEEDED.

    Both are idempotent by ``tx_id``, so a repeat after a lost reply is harmless. Each
    attempt has the call's full timeout; the caller sees the last attempt's outcome.
    """

    def __init__(self, address: str) -> None:
        self._address = address

    async def intercept_unary_unary(
        self,
        continuation: _Continuation,
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryUnaryCall[Any, Any]:
        method = _method_path(client_call_details)
        if method not in _RETRIED_METHODS:
            return await continuation(client_call_details, request)

        async def attempt() -> _Attempt:
            call = await continuation(client_call_details, request)
            return call, await call.code()  # waits for the end; never raises the call's error

        def log_retry(state: RetryCallState) -> None:
            code = state.outcome.result()[1].name if state.outcome is not None else "?"
            log.info("%s on %s: %s; retrying", method, self._address, code)

        retrying = AsyncRetrying(
            retry=retry_if_result(_transient),
            stop=stop_after_attempt(_RETRY_ATTEMPTS),
            wait=wait_exponential_jitter(
                multiplier=_RETRY_FIRST_WAIT_S, max=_RETRY_MAX_WAIT_S, jitter=_RETRY_JITTER_S
            ),
            before_sleep=log_retry,
            retry_error_callback=_last_attempt,
        )
        last: _Attempt = await retrying(attempt)
        return last[0]


class _ObserveUnaryCalls(grpc.aio.UnaryUnaryClientInterceptor):
    """Reports every unary call's method and final status (``conductor_agent_calls_total``).

    Streams (Generate, WatchEvents) are not observed: their status arrives at their end.
    """

    def __init__(self, observe: CallObserver) -> None:
        self._observe = observe

    async def intercept_unary_unary(
        self,
        continuation: _Continuation,
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> grpc.aio.UnaryUnaryCall[Any, Any]:
        call = await continuation(client_call_details, request)
        code = await call.code()  # waits for the end; never raises the call's error
        self._observe(_method_path(client_call_details), code.name)
        return call


class AgentFleet:
    """The agents this conductor knows, polled for info and health."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        model: str,
        rpc_timeout_s: float,
        observe_call: CallObserver | None = None,
        tls: TlsFiles | None = None,
        plaintext: PlaintextPolicy = "loopback",
        token_stream: bool = True,
    ) -> None:
        self.model = model
        self._token_stream = token_stream
        self._tls = tls
        self._plaintext = plaintext
        self.rpc_timeout_s = rpc_timeout_s
        self._observe_call = observe_call
        self._observer = _ObserveUnaryCalls(observe_call) if observe_call else None
        self._agents: dict[str, AgentHandle] = {}
        self._closing: list[grpc.aio.Channel] = []
        for address in addresses:
            self.add(address)

    def add(self, address: str) -> AgentHandle:
        """The agent at ``address``, with a channel opened on first sight (mTLS with
        the conductor's certificate; ``ValueError`` where plaintext is not allowed)."""
        agent = self._agents.get(address)
        if agent is None:
            interceptors: list[grpc.aio.ClientInterceptor] = [_RetryIdempotentCalls(address)]
            if self._observer is not None:
                interceptors.append(self._observer)  # inside the retries: sees each attempt
            channel = client_channel(
                address,
                self._tls,
                self._plaintext,
                options=_CHANNEL_OPTIONS,
                interceptors=interceptors,
            )
            agent = self._agents[address] = AgentHandle(
                address=address, channel=channel, stub=pb_grpc.NodeAgentStub(channel)
            )
        return agent

    def remove(self, address: str) -> None:
        agent = self._agents.pop(address, None)
        if agent is not None:
            self._closing.append(agent.channel)  # closed at shutdown: calls may be in flight

    async def sync(self, addresses: set[str]) -> None:
        """Make the fleet exactly ``addresses`` (registry discovery); poll new agents."""
        for address in set(self._agents) - addresses:
            log.info("agent %s left the registry", address)
            self.remove(address)
        new = []
        for address in sorted(addresses - set(self._agents)):
            try:
                new.append(self.add(address))
            except ValueError as exc:  # registered, but not reachable securely: skipped
                log.error("agent %s not added: %s", address, exc)
        await asyncio.gather(*(self.refresh_one(a) for a in new))

    def get(self, address: str) -> AgentHandle:
        return self._agents[address]

    def handles(self) -> list[AgentHandle]:
        return list(self._agents.values())

    def ready(self) -> bool:
        """A prefill-capable and a decode-capable agent are usable."""
        usable = [a for a in self._agents.values() if a.usable]
        has_prefill = any(a.role in ("prefill", "both") for a in usable)
        has_decode = any(a.role in ("decode", "both") for a in usable)
        return has_prefill and has_decode

    def observe_call(self, method: str, code: grpc.StatusCode) -> None:
        """Count a unary call made over a token stream, as the gRPC interceptor counts
        the others (``conductor_agent_calls_total``)."""
        if self._observe_call is not None:
            self._observe_call(method, code.name)

    async def stream_unary(
        self,
        agent: AgentHandle,
        method: str,
        request: Message,
        parse: Callable[[bytes], M],
        *,
        deadline_s: float,
        fall_back: bool,
    ) -> M | None:
        """``method`` over the agent's token stream, counted as the gRPC interceptor counts
        the others. ``None`` when the caller should ask over gRPC instead: the agent does
        not serve ``method`` on its stream, or (``fall_back``) the listener is gone
        (``UNAVAILABLE``). Any other failure raises ``grpc.aio.AioRpcError``."""
        stream = agent.stream_for(method)
        if stream is None:
            return None
        try:
            answer = await stream.unary(method, request, parse, deadline_s=deadline_s)
        except grpc.aio.AioRpcError as exc:
            self.observe_call(method, exc.code())
            if not fall_back or exc.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            log.debug("agent %s: token stream: %s", agent.address, exc.details())
            return None
        self.observe_call(method, grpc.StatusCode.OK)
        agent.stream_answered_s = time.monotonic()
        return answer

    async def prefill(
        self, agent: AgentHandle, request: pb.PrefillRequest, *, deadline_s: float
    ) -> pb.PrefillResponse:
        """``Prefill`` over the agent's token stream when it serves it there, else gRPC.

        No second try over gRPC when the stream fails: the prefill (and its fused Tx)
        may have run; the failure goes to the caller as a gRPC call's would."""
        answer = await self.stream_unary(
            agent, "Prefill", request, pb.PrefillResponse.FromString,
            deadline_s=deadline_s, fall_back=False,
        )  # fmt: skip
        if answer is None:
            return await agent.stub.Prefill(request, timeout=deadline_s)
        return answer

    async def get_info(self, agent: AgentHandle) -> pb.NodeInfo:
        """``GetInfo`` over the agent's token stream when it serves it there, else (or
        when that listener is gone) over gRPC; ``grpc.aio.AioRpcError`` on failure."""
        info = await self.stream_unary(
            agent, "GetInfo", _GET_INFO, pb.NodeInfo.FromString,
            deadline_s=self.rpc_timeout_s, fall_back=True,
        )  # fmt: skip
        if info is None:
            return await agent.stub.GetInfo(_GET_INFO, timeout=self.rpc_timeout_s)
        return info

    async def refresh_one(self, agent: AgentHandle) -> None:
        try:
            info = await self.get_info(agent)
        except grpc.aio.AioRpcError as exc:
            if agent.reachable:
                log.warning("agent %s unreachable: %s", agent.address, exc.details())
            agent.reachable = False
            agent.last_error = exc.details() or exc.code().name
            return
        if not agent.reachable:
            log.info("agent %s (%s) reachable, model %s", agent.address, info.node_id, info.model)
        agent.info = info
        self._follow_stream(agent, info.stream_address)
        agent.reachable = True
        why = incompatibility(info, self.model)
        agent.compatible = not why
        if why and why != agent.last_error:
            log.warning("agent %s: not scheduled: %s", agent.address, why)
        agent.last_error = why

    def _follow_stream(self, agent: AgentHandle, address: str) -> None:
        """Use the token stream the agent advertises (unless switched off)."""
        current = agent.stream
        if current is not None and current.address == address and self._token_stream:
            return
        if current is not None:
            current.close()
            agent.stream = None
        if address and self._token_stream:
            try:
                agent.stream = TokenStreamClient(address, self._tls, self._plaintext)
            except ValueError as exc:  # plaintext beyond loopback, a malformed address
                log.warning("agent %s: not using its token stream: %s", agent.address, exc)

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh_one(a) for a in self._agents.values()))

    def mark_unreachable(self, address: str, reason: str) -> None:
        agent = self._agents.get(address)
        if agent is not None:
            agent.reachable = False
            agent.last_error = reason

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.refresh_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)

    async def aclose(self) -> None:
        for agent in self._agents.values():
            if agent.stream is not None:
                agent.stream.close()
        for channel in [*(a.channel for a in self._agents.values()), *self._closing]:
            await channel.close()
