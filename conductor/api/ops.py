"""Operational routes: liveness, readiness and the Prometheus exposition."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from conductor.api.deps import StateDep
from conductor.errors import ServiceUnavailable

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """Liveness: the process serves HTTP."""
    return {"status": "ok"}


@router.get("/ready", response_model=None)
async def ready(state: StateDep) -> Response:
    """Readiness: a prefill-capable and a decode-capable agent are usable."""
    agents = [
        {
            "address": a.address,
            "node_id": a.info.node_id if a.info else None,
            "role": a.role if a.info else None,
            "usable": a.usable,
            "inflight": a.inflight,
            "error": a.last_error or None,
        }
        for a in state.fleet.handles()
    ]
    if state.fleet.ready() and not state.draining:
        return JSONResponse({"status": "ready", "agents": agents})
    reason = "draining" if state.draining else "no usable prefill and decode agents"
    err = ServiceUnavailable(f"Not ready: {reason}.", retry_after_s=2.0)
    body = err.to_response_body()
    body["agents"] = agents
    return JSONResponse(body, status_code=503, headers=err.headers)


@router.get("/metrics")
async def metrics(state: StateDep) -> Response:
    state.metrics.refresh_agents(state.fleet.handles())
    return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4")
