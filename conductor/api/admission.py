"""Admission of one generation: bounds, tenant rate limits, the in-flight bound, then
placement and the first token — all before the HTTP response starts, so every refusal
is a status code with the OpenAI error envelope.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

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
from conductor.generation import Breakpoint, GenerationRequest, GenerationStream, UsageCounts
from conductor.state import AppState
from conductor.tenants import Tenant
from kvc.sampling import Sampling, TokenLogprob

GenerationBody = ChatCompletionRequest | CompletionRequest


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
    return body.logprobs


def _structured(body: GenerationBody) -> str:
    """A non-text ``response_format`` as JSON for the wire; else ""."""
    fmt = body.response_format
    if not isinstance(fmt, dict) or fmt.get("type") == "text":
        return ""
    return json.dumps(fmt, separators=(",", ":"))


@dataclass(slots=True)
class Admitted:
    """A generation that has its first token; its account closes exactly once."""

    account: RequestAccount
    stream: GenerationStream
    headers: dict[str, str]  # the tenant's x-ratelimit-* headers
    stop_sequence: str = ""  # after ``collect``: the stop string that ended it, if one did
    # After ``collect``, when the request asked for logprobs: (token id, its entry).
    logprobs: list[tuple[int, TokenLogprob]] = field(default_factory=list)

    def finish(self, outcome: str, usage: UsageCounts | None) -> None:
        self.account.close(outcome, self.stream, usage)

    async def abandon(self) -> None:
        """Nobody reads on (the client left before the stream began): cancel the
        generation and count it cancelled; a no-op once finished."""
        await self.stream.aclose()
        self.finish("cancelled", None)

    async def collect(self) -> tuple[str, str, UsageCounts]:
        """Run a non-streamed generation to its end: (text, finish_reason, usage)."""
        parts: list[str] = []
        finish = "stop"
        usage: UsageCounts | None = None
        outcome = "cancelled"
        try:
            async for delta in self.stream:
                parts.append(delta.text)
                if delta.logprobs:
                    self.logprobs.extend(zip(delta.token_ids, delta.logprobs, strict=True))
                if delta.finish_reason is not None:
                    finish = delta.finish_reason
                    usage = delta.usage
                    self.stop_sequence = delta.stop_sequence
            outcome = "success"
        except ConductorError:
            outcome = "upstream_error"
            raise
        finally:
            await self.stream.aclose()
            self.finish(outcome, usage)
        assert usage is not None
        return "".join(parts), finish, usage


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
    rate_headers = await check_tenant_rate(account, tenant, len(prompt_ids) + max_tokens)
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
    stream = await state.dispatcher.start(
        GenerationRequest(
            request_id=request_id,
            tenant=tenant.name,
            prompt_ids=tuple(prompt_ids),
            sampling=sampling_for(body, max_tokens, response_format),
            slo=slo,
            breakpoints=breakpoints,
            cache_key=cache_key,
        )
    )
    account.first_token()
    return Admitted(account=account, stream=stream, headers=rate_headers)
