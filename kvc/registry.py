"""The node registry in Redis, shared by agents (writers) and conductors (readers).

Each agent keeps ``kvc:agent:<node_id>`` = JSON ``AgentRecord`` alive with a TTL,
refreshed every ``ttl_s / 3``; a crashed agent disappears within ``ttl_s``. A clean
stop deletes its record. Conductors list the records for their model (SCAN + MGET,
O(agents)) and merge them with their static ``--agents`` list.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from pydantic import BaseModel, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger("kvc.registry")

AGENT_KEY_PREFIX = "kvc:agent:"


class AgentRecord(BaseModel):
    node_id: str
    address: str  # host:port conductors and peers dial
    role: str
    model: str
    epoch: str
    block_size: int
    updated_at: float


def agent_key(node_id: str) -> str:
    return f"{AGENT_KEY_PREFIX}{node_id}"


def connect(url: str, *, timeout_s: float = 0.5) -> Redis:
    """A client with short timeouts: Redis trouble must never stall a request."""
    client: Redis = Redis.from_url(
        url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
    )
    return client


async def publish(redis: Redis, record: AgentRecord, ttl_s: float) -> None:
    await redis.set(agent_key(record.node_id), record.model_dump_json(), px=int(ttl_s * 1000))


async def withdraw(redis: Redis, node_id: str) -> None:
    await redis.delete(agent_key(node_id))


async def list_agents(redis: Redis, model: str) -> list[AgentRecord]:
    keys = [key async for key in redis.scan_iter(match=f"{AGENT_KEY_PREFIX}*", count=500)]
    if not keys:
        return []
    records = []
    for raw in await redis.mget(keys):
        if raw is None:
            continue  # expired between SCAN and MGET
        try:
            record = AgentRecord.model_validate_json(raw)
        except ValidationError:
            log.warning("ignoring a malformed registry record")
            continue
        if record.model == model:
            records.append(record)
    return records


async def keep_registered(
    redis: Redis,
    make_record: Callable[[], AgentRecord],
    ttl_s: float,
    stop: asyncio.Event,
) -> None:
    """Heartbeat until ``stop``; then withdraw. Redis errors are logged and retried."""
    healthy = True
    while not stop.is_set():
        try:
            await publish(redis, make_record(), ttl_s)
            if not healthy:
                log.info("registry: Redis reachable again")
            healthy = True
        except (RedisError, OSError) as exc:
            if healthy:
                log.warning("registry: cannot reach Redis (%s); retrying", exc)
            healthy = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=ttl_s / 3)
    with contextlib.suppress(RedisError, OSError):
        await withdraw(redis, make_record().node_id)
