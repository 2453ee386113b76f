"""Admission of one generation: bounds, tenant rate limits, the in-flight bound, then
placement and the first token — all before the HTTP response starts, so every refusal
is a status code with the OpenAI error envelope.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field, replace

from conductor.api.accounting import RequestAccount
from conductor.api.limits import check_tenant_rate
from conductor.api.schemas import ChatCompletionRequest, CompletionRequest, logit_bias_pairs
from conductor.core.scheduler import Slo
from conductor.errors import (
    ConductorError,
    ContextLengthExceeded,
    InvalidRequest,
    RateLimited,
    ServiceUnavailable,
)
from conductor.generation import (
    Breakpoint,
    ChoiceStreams,
    GenerationRequest,
    GenerationStream,
    TokenStream,
    UsageCounts,
)
from conductor.state import AppState
from conductor.tenants import Tenant
from kvc.sampling import Sampling, TokenLogprob

GenerationBody = ChatCompletionRequest | CompletionRequest

# With --placement-headers: the nodes that served a generation (for n > 1, choice 0's).
PREFILL_NODE_HEADER = "x-kvc-prefill-node"
DECODE_NODE_HEADER = "x-kvc-decode-node"


def sampling_for(
    body: GenerationBody, max_tokens: int, response_format: str | None = None
) -> Sampling:
    """Token selection from either OpenAI request (``ignore_eos``: vLLM's extension)."""
    return Sampling(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_tokens=max_tokens,
        seed=body.seed,
        stop=tuple(body.stop_sequences),
        ignore_eos=body.ignore_eos,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        logit_bias=logit_bias_pairs(body.logit_bias),
        response_format=_structured(body) if response_format is None else response_format,
        top_k=max(0, body.top_k or 0),
        min_p=body.min_p or 0.0,
        min_tokens=body.min_tokens or 0,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        logprobs=_logprobs(body),
    )


def _logprobs(body: GenerationBody) -> int | None:
    """How many alternatives per token to report (chat: ``logprobs`` + ``top_logprobs``;
    completions: ``logprobs``, the count); None: no logprobs."""
    if isinstance(body, ChatCompletionRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    if body.logprobs is None and generations(body) > body.n:
        return 0  # best_of ranks the generations by their tokens' logprobs
    return body.logprobs


def generations(body: GenerationBody) -> int:
    """Generations to run: ``n``, or for a completion ``best_of`` (the best ``n`` of them
    are answered)."""
    if isinstance(body, ChatCompletionRequest):
        return body.n
    return max(body.n, body.best_of or 1)


def _structured(body: GenerationBody) -> str:
    """A non-text ``response_format`` as JSON for the wire; else ""."""
    fmt = body.response_format
    if not isinstance(fmt, dict) or fmt.get("type") == "text":
        return ""
    return json.dumps(fmt, separators=(",", ":"))


@dataclass(slots=True)
class ChoiceResult:
    """One choice of a generation run to its end (``Admitted.collect``)."""

    text: str = ""
    finish: str = "stop"
    stop_sequence: str = ""  # the stop string that ended it, if one did
    # When the request asked for logprobs: (token id, its entry), in order.
    logprobs: list[tuple[int, TokenLogprob]] = field(default_factory=list)


@dataclass(slots=True)
class Admitted:
    """A generation (its ``n`` choices) that has its first token; its account closes
    exactly once."""

    account: RequestAccount
    stream: TokenStream
    headers: dict[str, str]  # the tenant's x-ratelimit-* headers
    n: int = 1
    choices: list[ChoiceResult] = field(default_factory=list)  # filled by ``collect``

    def finish(self, outcome: str, usage: UsageCounts | None) -> None:
        self.account.close(outcome, self.stream, usage)

    async def abandon(self) -> None:
        """Nobody reads on (the client left before the stream began): cancel the
        generation and count it cancelled; a no-op once finished."""
        await self.stream.aclose()
        self.finish("cancelled", None)

    async def collect(self) -> tuple[str, str, UsageCounts]:
        """Run a non-streamed generation to its end: (text, finish_reason) of choice 0
        and the usage; every choice's in ``choices``."""
        self.choices = [ChoiceResult() for _ in range(self.n)]
        parts: list[list[str]] = [[] for _ in range(self.n)]
        usage: UsageCounts | None = None
        outcome = "cancelled"
        try:
            async for delta in self.stream:
                choice = self.choices[delta.index]
                parts[delta.index].append(delta.text)
                if delta.logprobs:
                    choice.logprobs.extend(zip(delta.token_ids, delta.logprobs, strict=True))
                if delta.finish_reason is not None:
                    choice.finish = delta.finish_reason
                    choice.stop_sequence = delta.stop_sequence
                if delta.usage is not None:
                    usage = delta.usage
            outcome = "success"
        except ConductorError:
            outcome = "upstream_error"
            raise
        finally:
            await self.stream.aclose()
            self.finish(outcome, usage)
        assert usage is not None
        for choice, texts in zip(self.choices, parts, strict=True):
            choice.text = "".join(texts)
        return self.choices[0].text, self.choices[0].finish, usage


async def admit(
    state: AppState,
    endpoint: str,
    request_id: str,
    tenant: Tenant,
    prompt_ids: list[int],
    body: GenerationBody,
    max_tokens_requested: int | None,
    prompt_param: str,
    slo: Slo,
    response_format: str | None = None,
    *,
    breakpoints: tuple[Breakpoint, ...] = (),
    cache_key: str = "",
) -> Admitted:
    """Bound, check and place one generation; return once its first token exists.

    The request's account opens here; whatever stops admission (a refusal, an error,
    a cancellation) closes it with its outcome, once."""
    account = RequestAccount(state, endpoint)
    try:
        return await _admit(
            account,
            request_id,
            tenant,
            prompt_ids,
            body,
            max_tokens_requested,
            prompt_param,
            slo,
            response_format,
            breakpoints,
            cache_key,
        )
    except BaseException as exc:
        account.failed_to_start(exc)
        raise


async def _admit(
    account: RequestAccount,
    request_id: str,
    tenant: Tenant,
    prompt_ids: list[int],
    body: GenerationBody,
    max_tokens_requested: int | None,
    prompt_param: str,
    slo: Slo,
    response_format: str | None,
    breakpoints: tuple[Breakpoint, ...],
    cache_key: str,
) -> Admitted:
    state = account.state
    account.tenant = tenant.name
    max_len = state.max_model_len()
    if max_len is None:
        account.refuse("no_capacity")
        raise ServiceUnavailable("No node serving this model is ready yet.", retry_after_s=2.0)
    if not prompt_ids:
        account.close("client_error")
        raise InvalidRequest("The prompt is empty.", param=prompt_param)
    room = max_len - len(prompt_ids)
    if room < 1 or (max_tokens_requested is not None and max_tokens_requested > room):
        account.close("client_error")
        raise ContextLengthExceeded(
            max_context_tokens=max_len,
            prompt_tokens=len(prompt_ids),
            max_new_tokens=max_tokens_requested,
            param=prompt_param,
        )
    max_tokens = max_tokens_requested or min(state.settings.default_max_tokens, room)
    n = generations(body)
    rate_headers = await check_tenant_rate(account, tenant, len(prompt_ids) + n * max_tokens)
    if state.inflight >= state.settings.max_inflight_requests:
        account.refuse("conductor_overloaded")
        state.dispatcher.refusals.log(
            "conductor_overloaded", request_id,
            f"{state.inflight} requests in flight, max_inflight_requests "
            f"{state.settings.max_inflight_requests}; Retry-After 1.0 s",
        )  # fmt: skip
        raise RateLimited(
            "This conductor has too many requests in flight; retry shortly.",
            retry_after_s=1.0,
            reason="conductor_overloaded",
        )
    account.enter()
    sampling = sampling_for(body, max_tokens, response_format)
    request = GenerationRequest(
        request_id=request_id,
        tenant=tenant.name,
        prompt_ids=tuple(prompt_ids),
        sampling=sampling,
        slo=slo,
        breakpoints=breakpoints,
        cache_key=cache_key,
    )
    stream: TokenStream
    if n == 1:
        stream = await state.dispatcher.start(request)
    else:
        stream = ChoiceStreams(await _start_choices(state, request, n))
    account.first_token()
    if state.settings.placement_headers:
        rate_headers[PREFILL_NODE_HEADER] = stream.placed.prefill_node
        rate_headers[DECODE_NODE_HEADER] = stream.placed.decode_node
    return Admitted(account=account, stream=stream, headers=rate_headers, n=n)


async def _start_choices(
    state: AppState, request: GenerationRequest, n: int
) -> list[GenerationStream]:
    """Start the ``n`` choices of one request side by side, each its own generation
    (``request_id.i``; with a seed, choice i samples with ``seed + i``: repeatable and
    not all alike). One failing to start closes the others and is the request's error."""
    seed = request.sampling.seed
    requests = [
        replace(
            request,
            request_id=request.request_id if i == 0 else f"{request.request_id}.{i}",
            sampling=request.sampling
            if seed is None
            else replace(request.sampling, seed=_wrap_seed(seed + i)),
        )
        for i in range(n)
    ]
    tasks = [asyncio.ensure_future(state.dispatcher.start(r)) for r in requests]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # this request cancelled: nothing it started may run on
        await _discard(tasks)
        raise
    errors = [e for t in tasks if t.done() and not t.cancelled() and (e := t.exception())]
    if errors:
        await _discard(tasks)
        raise errors[0]
    return [task.result() for task in tasks]


async def _discard(tasks: list[asyncio.Task[GenerationStream]]) -> None:
    """Cancel the choices still starting and close those that started."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is None:
            await task.result().aclose()


def _wrap_seed(seed: int) -> int:
    """A seed in vLLM's signed 64-bit range."""
    return (seed + 2**63) % 2**64 - 2**63
