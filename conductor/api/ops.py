"""Operational routes: liveness, readiness and the Prometheus exposition."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from conductor.api.admin import is_admin
from conductor.api.deps import StateDep
from conductor.api.schemas import AgentReadiness, HealthResponse, NotReadyResponse, ReadyResponse
from conductor.errors import ServiceUnavailable
from kvc.fast_json import FastJsonRoute

router = APIRouter(route_class=FastJsonRoute)


@router.get("/health")
async def health() -> HealthResponse:
    """Liveness: the process serves HTTP."""
    return HealthResponse()


@router.get(
    "/ready",
    response_model=None,
    responses={
        200: {"model": ReadyResponse, "description": "A prefill- and a decode-capable agent"},
        503: {"model": NotReadyResponse, "description": "Not ready; `Retry-After`"},
    },
)
async def ready(request: Request, state: StateDep) -> Response:
    """Readiness: a prefill-capable and a decode-capable agent are usable.

    The agents as the conductor sees them (addresses, errors) are listed only to an
    admin key, or when the conductor runs without any keys (nothing is private then);
    anyone else learns ready or not."""
    details = is_admin(request, state) or not (
        state.settings.admin_keys or state.tenants.auth_required
    )
    agents = [
        AgentReadiness(
            address=a.address,
            node_id=a.info.node_id if a.info else None,
            role=a.role if a.info else None,
            usable=a.usable,
            inflight=a.inflight,
            error=a.last_error or None,
        )
        for a in (state.fleet.handles() if details else ())
    ]
    if state.fleet.ready() and not state.draining:
        return JSONResponse(ReadyResponse(agents=agents).model_dump())
    reason = "draining" if state.draining else "no usable prefill and decode agents"
    err = ServiceUnavailable(f"Not ready: {reason}.", retry_after_s=2.0)
    body = err.to_response_body()
    body["agents"] = [a.model_dump() for a in agents]
    return JSONResponse(body, status_code=503, headers=err.headers)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text exposition, format 0.0.4"}},
)
async def metrics(state: StateDep) -> Response:
    state.metrics.refresh_agents(state.fleet.handles())
    return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4")
