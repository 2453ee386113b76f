"""FastAPI dependencies of the API routes: the app state, the caller's tenant, the
request id and the request's SLOs."""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import Depends, Request

from conductor.core.scheduler import Slo
from conductor.errors import AuthenticationFailed, InvalidRequest
from conductor.state import AppState
from conductor.tenants import Tenant

SLO_TTFT_HEADER = "x-kvc-slo-ttft-ms"
SLO_TBT_HEADER = "x-kvc-slo-tbt-ms"


def get_state(request: Request) -> AppState:
    state: AppState = request.app.state.conductor
    return state


StateDep = Annotated[AppState, Depends(get_state)]


async def authenticate(request: Request, state: StateDep) -> Tenant:
    """Return the caller's tenant; 401 when keys are configured and none matches."""
    if not state.tenants.auth_required:
        return state.tenants.default
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        )
    tenant = await state.tenants.resolve(token.strip())
    if tenant is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    return tenant


TenantDep = Annotated[Tenant, Depends(authenticate)]


def request_id(request: Request) -> str:
    """The id the request-id middleware gave this request (``X-Request-Id``)."""
    rid: str = request.state.request_id
    return rid


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
