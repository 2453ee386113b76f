"""One generation as the HTTP layer sees it: the request, where it was placed, and the
stream of token deltas from the decode node (``GenerationStream``), with agent errors
mapped to ``ConductorError``s. The dispatcher (``conductor.dispatch``) starts it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import grpc

from conductor.adapters.agents import AgentCallError, StreamingCall, translate_rpc_error
from conductor.core.scheduler import Slo
from conductor.errors import (
    ConductorError,
    GatewayTimeout,
    InvalidRequest,
    RateLimited,
    ServiceUnavailable,
    UnprocessableEntity,
    UpstreamError,
)
from kvc.sampling import Sampling, TokenLogprob
from kvc.v1 import node_agent_pb2 as pb
from kvc.wire import logprobs_from_pb

_FINISH_NAMES = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length"}


@dataclass(frozen=True, slots=True)
class Breakpoint:
    """Retain the prompt's first ``tokens`` tokens for ``ttl_s`` after their last use
    (a ``cache_control`` breakpoint, where it falls in the prompt)."""

    tokens: int
    ttl_s: float


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    tenant: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    slo: Slo
    breakpoints: tuple[Breakpoint, ...] = ()
    cache_key: str = ""  # prompt_cache_key: a routing affinity hint ("" none)


@dataclass(frozen=True, slots=True)
class UsageCounts:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # What became of the request's breakpoints on the prefill node: "none" (none asked),
    # "granted", "over_budget", "node_full", "unsupported", "too_long" (RetentionStatus),
    # or "below_minimum" (every breakpoint shorter than the conductor retains).
    retention: str = "none"
    # Prompt tokens written to the cache at granted breakpoints, per TTL (seconds).
    cache_writes: tuple[tuple[float, int], ...] = ()

    @property
    def cache_write_tokens(self) -> int:
        return sum(n for _, n in self.cache_writes)


@dataclass(frozen=True, slots=True)
class TokenDelta:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None  # "stop" | "length" on the last delta
    usage: UsageCounts | None  # on the last delta
    stop_sequence: str = ""  # the stop string that ended the generation (last delta)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when asked for
    index: int = 0  # the choice it belongs to (n > 1)


@dataclass(frozen=True, slots=True)
class Placed:
    """Where a request runs and what it reused, for metrics, errors and tests."""

    prefill_node: str
    decode_node: str
    prefill_role: str
    decode_role: str
    cached_tokens: int  # reused on the prefill node (incl. migrated blocks)
    migrated_tokens: int  # of those, pulled from another node for this request
    would_have_hit_tokens: int  # prefix another node held at decision time, recomputed
    retention: str = "none"  # the prefill node's answer to the breakpoints (UsageCounts)
    breakpoints: tuple[Breakpoint, ...] = ()  # those the node was asked to retain


def _to_delta(msg: pb.GenerateResponse, placed: Placed) -> TokenDelta:
    usage = None
    if msg.HasField("usage"):
        # Cached = prompt tokens reused from a prefix cache. A decode node that got its
        # KV from a separate prefill node counts the handed-over tokens as cached (vLLM
        # does, for KV a connector loaded): only the prefill node's reuse is a hit then.
        cached = placed.cached_tokens
        if placed.prefill_node == placed.decode_node:
            cached = max(cached, msg.usage.cached_tokens)
        usage = UsageCounts(
            prompt_tokens=msg.usage.prompt_tokens,
            completion_tokens=msg.usage.completion_tokens,
            cached_tokens=cached,
            retention=placed.retention,
            cache_writes=tuple(
                sorted(cache_writes(placed.breakpoints, cached, placed.retention).items())
            ),
        )
    return TokenDelta(
        token_ids=tuple(msg.token_ids),
        text=msg.text,
        finish_reason=_FINISH_NAMES.get(msg.finish_reason),
        usage=usage,
        stop_sequence=msg.stop_sequence,
        logprobs=logprobs_from_pb(msg.logprobs) if msg.logprobs else (),
    )


def cache_writes(
    breakpoints: Sequence[Breakpoint], cached_tokens: int, retention: str
) -> dict[float, int]:
    """Prompt tokens written to the cache under each TTL: from the cached prefix up to
    each breakpoint, a segment under the longest TTL of the breakpoints at or after it
    (what the node retains it for: a template may render the marks in another order
    than the request lists them). Nothing unless the retention was granted."""
    if retention != "granted":
        return {}
    ordered = sorted(breakpoints, key=lambda b: b.tokens)
    out: dict[float, int] = {}
    start = cached_tokens
    for i, bp in enumerate(ordered):
        if bp.tokens > start:
            ttl = max(b.ttl_s for b in ordered[i:])
            out[ttl] = out.get(ttl, 0) + bp.tokens - start
            start = bp.tokens
    return out


def map_agent_error(exc: AgentCallError) -> ConductorError:
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(exc.message)
    if exc.reason == "unsupported":  # a parameter the node's engine cannot honour
        return UnprocessableEntity(exc.message, code="unsupported_value")
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RateLimited(
            "No node has capacity for this request right now.",
            retry_after_s=1.0,
            reason="insufficient_capacity",
        )
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayTimeout("A node did not answer in time.")
    if exc.reason == "transfer":
        return UpstreamError(f"Moving the prompt's KV between nodes failed: {exc.message}")
    if exc.node_unreachable:
        return ServiceUnavailable("A node became unavailable.", retry_after_s=1.0)
    return UpstreamError(f"A node failed the request: {exc.message}")


CloseHook = Callable[[list[float], int, str | None], None]  # (gaps, tokens, finish reason)


class GenerationStream:
    """The running generation: iterate ``TokenDelta``s; ``aclose()`` cancels it.

    The close hook (the scheduler's books, the TBT observation) runs at ``aclose()`` or
    when the reader reads past the last delta, not when the last delta arrives: a reader
    can send the last tokens to its client first (``finished`` says it has them all).
    """

    def __init__(
        self,
        call: StreamingCall,
        first: pb.GenerateResponse,
        placed: Placed,
        on_close: CloseHook,
    ) -> None:
        self._call = call
        self._pending: pb.GenerateResponse | None = first
        self.placed = placed
        self._on_close = on_close
        self._closed = False
        self._finished = False
        self._finish_reason: str | None = None
        self._tokens = 0
        self._last_token_at = time.perf_counter()
        self._gaps_s: list[float] = []
        self._interrupted: ConductorError | None = None

    def __aiter__(self) -> GenerationStream:
        return self

    @property
    def finished(self) -> bool:
        """The last delta (the one with a finish reason) has been read."""
        return self._finished

    @property
    def mean_gap_s(self) -> float | None:
        """Mean time between streamed tokens so far (None before the second token)."""
        return sum(self._gaps_s) / len(self._gaps_s) if self._gaps_s else None

    async def __anext__(self) -> TokenDelta:
        if self._finished:
            await self.aclose()
            raise StopAsyncIteration
        if self._pending is not None:
            msg, self._pending = self._pending, None
        else:
            try:
                read = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                await self.aclose()
                if self._interrupted is not None:
                    raise self._interrupted from None
                raise map_agent_error(translate_rpc_error(self.placed.decode_node, exc)) from exc
            except asyncio.CancelledError:
                # The call was cancelled by ``interrupt``, not this task: an error to send.
                task = asyncio.current_task()
                if self._interrupted is None or (task is not None and task.cancelling()):
                    raise
                await self.aclose()
                raise self._interrupted from None
            if read is grpc.aio.EOF:
                await self.aclose()
                raise UpstreamError("the decode node ended the stream without a finish reason")
            assert isinstance(read, pb.GenerateResponse)
            msg = read
            now = time.perf_counter()
            # A message may carry several tokens (an agent relays what arrived together):
            # each gets its share of the gap, so the mean stays per token.
            tokens = max(1, len(msg.token_ids))
            self._gaps_s.extend([(now - self._last_token_at) / tokens] * tokens)
            self._last_token_at = now
        delta = _to_delta(msg, self.placed)
        self._tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self._finished = True
            self._finish_reason = delta.finish_reason
        return delta

    def interrupt(self, error: ConductorError) -> None:
        """Stop the generation from outside (shutdown): the next read raises ``error``."""
        if self._closed or self._finished:
            return
        self._interrupted = error
        self._call.cancel()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._finished:
            self._call.cancel()
        self._on_close(self._gaps_s, self._tokens, self._finish_reason)


class TokenStream(Protocol):
    """What the HTTP layer reads: one generation, or the choices of an ``n > 1``."""

    placed: Placed

    @property
    def finished(self) -> bool: ...

    def __aiter__(self) -> TokenStream: ...

    async def __anext__(self) -> TokenDelta: ...

    @property
    def mean_gap_s(self) -> float | None: ...

    async def aclose(self) -> None: ...


class ChoiceStreams:
    """The ``n`` generations of one request (OpenAI's ``n``) as one stream: deltas in the
    order they arrive, each tagged with its choice ``index``; each choice's last delta
    has its finish reason, and the last of them all the request's usage (the prompt
    once, the completions summed, the prefix reuse of choice 0). ``aclose()``, or any
    choice failing, ends them all."""

    def __init__(self, streams: Sequence[GenerationStream]) -> None:
        self._streams = list(streams)
        self.placed = self._streams[0].placed
        self._reads: dict[int, asyncio.Future[TokenDelta]] = {}
        self._done: set[int] = set()
        self._usages: dict[int, UsageCounts] = {}

    def __aiter__(self) -> ChoiceStreams:
        return self

    @property
    def finished(self) -> bool:
        return len(self._done) == len(self._streams)

    @property
    def mean_gap_s(self) -> float | None:
        gaps = [g for s in self._streams if (g := s.mean_gap_s) is not None]
        return sum(gaps) / len(gaps) if gaps else None

    async def __anext__(self) -> TokenDelta:
        while len(self._done) < len(self._streams):
            for i, stream in enumerate(self._streams):
                if i not in self._done and i not in self._reads:
                    self._reads[i] = asyncio.ensure_future(anext(stream))
            try:
                ready, _ = await asyncio.wait(
                    self._reads.values(), return_when=asyncio.FIRST_COMPLETED
                )
                i = min(j for j, read in self._reads.items() if read in ready)
                delta = self._reads.pop(i).result()
            except StopAsyncIteration:
                self._done.add(i)
                continue
            except BaseException:
                await self.aclose()
                raise
            if delta.finish_reason is None:
                return replace(delta, index=i)
            self._done.add(i)
            await self._streams[i].aclose()  # its books close with the choice
            if delta.usage is not None:
                self._usages[i] = delta.usage
            last = len(self._done) == len(self._streams)
            return replace(delta, index=i, usage=self._usage() if last else None)
        raise StopAsyncIteration

    def _usage(self) -> UsageCounts | None:
        first = self._usages.get(0)
        if first is None:
            return None
        completion = sum(u.completion_tokens for u in self._usages.values())
        return replace(first, completion_tokens=completion)

    async def aclose(self) -> None:
        for read in self._reads.values():
            read.cancel()
        self._reads.clear()
        for stream in self._streams:
            await stream.aclose()
