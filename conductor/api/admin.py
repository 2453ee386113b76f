"""Operator endpoints under ``/admin`` (admin key required; off when none configured).

GET  /admin/nodes                 agents: role, health, draining, load, shadow size
POST /admin/nodes/{node}/drain    stop scheduling onto a node; {"resume": true} undoes
GET  /admin/index                 shadow index and cost-model state
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from typing import Annotated, Any

import grpc
from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from conductor.adapters.agents import AgentHandle, translate_rpc_error
from conductor.api.deps import StateDep
from conductor.api.openapi_doc import errors
from conductor.core.prefix_index import NodeId
from conductor.errors import AuthenticationFailed, NotFound, ServiceUnavailable
from conductor.state import AppState
from kvc.fast_json import FastJsonRoute
from kvc.v1 import node_agent_pb2 as pb

router = APIRouter(prefix="/admin", route_class=FastJsonRoute)


def is_admin(request: Request, state: AppState) -> bool:
    """Whether the request carries one of the admin keys (bearer), compared in constant
    time: digests of equal length, every key compared, no early exit."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not state.settings.admin_keys:
        return False
    offered = hashlib.sha256(token.strip().encode()).digest()
    found = False
    for key in state.settings.admin_keys:
        found |= hmac.compare_digest(offered, hashlib.sha256(key.encode()).digest())
    return found


def require_admin(request: Request, state: StateDep) -> None:
    if not state.settings.admin_keys:
        raise NotFound("Admin endpoints are disabled: start the conductor with --admin-keys.")
    if not is_admin(request, state):
        raise AuthenticationFailed("An admin key is required for this endpoint.")


AdminDep = Annotated[None, Depends(require_admin)]


class DrainBody(BaseModel):
    resume: bool = False


def _node(state: AppState, agent: AgentHandle) -> dict[str, Any]:
    info, load = agent.info, agent.load
    return {
        "address": agent.address,
        "node_id": info.node_id if info else None,
        "role": agent.role if info else None,
        "model": info.model if info else None,
        "engine": info.engine if info else None,
        "epoch": info.epoch if info else None,
        "reachable": agent.reachable,
        "usable": agent.usable,
        "draining": bool(info and info.draining),
        "error": agent.last_error or None,
        "inflight": agent.inflight,
        "capacity_blocks": info.capacity_blocks if info else None,
        "free_blocks": load.free_blocks if load else None,
        "queued_prefill_tokens": load.queued_prefill_tokens if load else None,
        "running_requests": load.running_requests if load else None,
        "shadow_keys": state.index.node_key_count(NodeId(agent.address)),
        "retained_blocks": len(agent.retained),  # prompt-cache breakpoints kept
        # Lower KV tiers (host memory, disk) with their fill and measured bandwidth.
        "tiers": [
            {
                "medium": _MEDIA.get(t.medium, "unknown"),
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "read_bytes_per_s": t.read_bytes_per_s,
                "write_bytes_per_s": t.write_bytes_per_s,
            }
            for t in (load.tiers if load and load.tiers else info.tiers if info else [])
        ],
    }


_MEDIA = {pb.KV_MEDIUM_HOST: "host", pb.KV_MEDIUM_DISK: "disk"}


def _find(state: AppState, node: str) -> AgentHandle:
    for agent in state.fleet.handles():
        if node in (agent.address, agent.info.node_id if agent.info else None):
            return agent
    raise NotFound(f"No node {node!r} in this conductor's fleet.")


@router.get("/nodes", responses=errors(401, 404))
async def list_nodes(state: StateDep, _admin: AdminDep) -> dict[str, Any]:
    return {"nodes": [_node(state, a) for a in state.fleet.handles()]}


@router.post("/nodes/{node}/drain", responses=errors(400, 401, 404, 413, 503))
async def drain_node(
    node: str, state: StateDep, _admin: AdminDep, body: DrainBody | None = None
) -> dict[str, Any]:
    agent = _find(state, node)
    resume = body.resume if body is not None else False
    try:
        resp = await agent.stub.Drain(
            pb.DrainRequest(resume=resume), timeout=state.settings.rpc_timeout_s
        )
    except grpc.aio.AioRpcError as exc:
        err = translate_rpc_error(agent.address, exc)
        raise ServiceUnavailable(f"Node {node!r} did not answer: {err.message}") from exc
    await state.fleet.refresh_one(agent)
    return {
        "node": _node(state, agent),
        "draining": resp.draining,
        "open_txs": resp.open_txs,
        "running_requests": resp.running_requests,
    }


@router.get("/prompt-cache", responses=errors(401, 404))
async def prompt_cache(state: StateDep, _admin: AdminDep) -> dict[str, Any]:
    """Prompt caching per tenant since this conductor started (cache reads, writes at
    granted breakpoints, tokens retained, refused retentions), and what each node
    retains now."""
    ledger = state.cache_ledger
    return {
        "tenants": ledger.snapshot(),
        "dropped_tenants": ledger.dropped_tenants,
        "retained_blocks": {a.address: len(a.retained) for a in state.fleet.handles()},
        "min_tokens": state.settings.prompt_cache_min_tokens,
        "max_ttl_s": state.settings.prompt_cache_max_ttl_s,
    }


@router.get("/index", responses=errors(401, 404))
async def index_stats(state: StateDep, _admin: AdminDep) -> dict[str, Any]:
    stats = state.index.stats()
    scheduler = state.dispatcher.scheduler
    nodes = {}
    for node in state.index.nodes():
        position = state.index.position(node)
        nodes[node] = {
            "keys": state.index.node_key_count(node),
            "epoch": position[0] if position else None,
            "seq": position[1] if position else None,
            "prefill_model": dataclasses.asdict(scheduler.prefill_model(node).coefficients),
            "decode_model": dataclasses.asdict(scheduler.decode_model(node).coefficients),
        }
    return {
        "nodes": stats.nodes,
        "keys": stats.keys,
        "entries": stats.entries,
        "policy": str(scheduler.config.policy),  # a registry name (Policy is a StrEnum)
        "admission": scheduler.config.admission.value,
        "kvcache_balancing_threshold": scheduler.config.kvcache_balancing_threshold,
        "per_node": nodes,
    }
