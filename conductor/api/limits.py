"""The limits a generation request carries in and meets on the way out, as headers:
its SLOs (``X-Kvc-Slo-Ttft-Ms`` / ``X-Kvc-Slo-Tbt-Ms``) and its tenant's request and token
budgets (OpenAI's ``x-ratelimit-*`` headers on every answer, 429 when spent).
"""

from __future__ import annotations

import math

from fastapi import Request

from conductor.api.accounting import RequestAccount
from conductor.core.ratelimit import Limit, format_reset
from conductor.core.scheduler import Slo
from conductor.errors import InvalidRequest, RateLimited
from conductor.state import AppState
from conductor.tenants import Tenant

SLO_TTFT_HEADER = "x-kvc-slo-ttft-ms"
SLO_TBT_HEADER = "x-kvc-slo-tbt-ms"


def request_slo(request: Request, state: AppState) -> Slo:
    """The request's SLOs: headers ``X-Kvc-Slo-Ttft-Ms`` / ``X-Kvc-Slo-Tbt-Ms`` or defaults."""
    values = {"ttft": state.settings.ttft_slo_s, "tbt": state.settings.tbt_slo_s}
    for name, header in (("ttft", SLO_TTFT_HEADER), ("tbt", SLO_TBT_HEADER)):
        raw = request.headers.get(header)
        if raw is None:
            continue
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if not (ms > 0 and math.isfinite(ms)):
            raise InvalidRequest(f"Header {header} must be a positive number of milliseconds.")
        values[name] = ms / 1000.0
    return Slo(ttft_s=values["ttft"], tbt_s=values["tbt"])


async def check_tenant_rate(account: RequestAccount, tenant: Tenant, tokens: int) -> dict[str, str]:
    """Consume the tenant's request and token budget, or raise 429 with OpenAI's headers."""
    state = account.state
    limits = {
        "requests": Limit(tenant.requests_per_minute),
        "tokens": Limit(tenant.tokens_per_minute),
    }
    decision = await state.limiter.check(tenant.name, limits, {"requests": 1, "tokens": tokens})
    headers: dict[str, str] = {}
    for name, dim in decision.dimensions.items():
        headers[f"x-ratelimit-limit-{name}"] = str(dim.limit)
        headers[f"x-ratelimit-remaining-{name}"] = str(dim.remaining)
        headers[f"x-ratelimit-reset-{name}"] = format_reset(dim.reset_s)
    if decision.allowed:
        return headers
    refused = decision.refused_by or "requests"
    dim = decision.dimensions[refused]
    unit = "requests per min (RPM)" if refused == "requests" else "tokens per min (TPM)"
    requested = 1 if refused == "requests" else tokens
    account.refuse("tenant_rate_limit")
    state.dispatcher.refusals.log(
        "tenant_rate_limit", f"tenant {tenant.name!r}",
        f"{refused} per minute: limit {dim.limit}, remaining {dim.remaining}, "
        f"requested {requested}; Retry-After {decision.retry_after_s:.1f} s",
    )  # fmt: skip
    raise RateLimited(
        f"Rate limit reached for {unit} of tenant {tenant.name!r}: Limit {dim.limit}, "
        f"Remaining {dim.remaining}, Requested {requested}. "
        f"Please try again in {format_reset(decision.retry_after_s)}.",
        retry_after_s=decision.retry_after_s,
        reason="tenant_rate_limit",
        limit_type="tokens" if refused == "tokens" else "requests",
        headers=headers,
    )
