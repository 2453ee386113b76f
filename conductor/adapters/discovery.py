"""Agent discovery from the Redis node registry (``kvc/registry.py``).

Every ``interval_s`` the conductor lists the registered agents serving its model and
makes its fleet equal to those plus the static ``--agents`` list: an agent that
withdrew (a clean stop) or whose record expired leaves. Except for ``grace_s`` after the
Redis server restarted (its ``run_id`` changed): a Redis without persistence comes back
empty and lists nobody until the agents' next heartbeat re-registers them, and dropping
every agent meanwhile would turn every request into a 503, so the fleet keeps every
agent it knew. When Redis
cannot be reached, the fleet keeps the last known membership (agents that stay
reachable keep serving) and ``conductor_redis_up`` drops to 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from conductor.adapters.agents import AgentFleet
from kvc.registry import list_agents

log = logging.getLogger("conductor.discovery")


async def run_discovery(
    fleet: AgentFleet,
    redis: Redis,
    *,
    model: str,
    static: list[str],
    interval_s: float,
    stop: asyncio.Event,
    on_redis_state: Callable[[bool], None],
    grace_s: float = 30.0,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    healthy = True
    run_id: str | None = None  # the Redis server's; a new one: it restarted
    grace_until = -math.inf
    while not stop.is_set():
        try:
            server_run_id = str((await redis.info("server")).get("run_id", ""))
            records = await list_agents(redis, model)
        except (RedisError, OSError) as exc:
            if healthy:
                log.warning("registry unreachable (%s): keeping the last known agents", exc)
            healthy = False
            on_redis_state(False)
        else:
            if not healthy:
                log.info("registry reachable again")
            healthy = True
            on_redis_state(True)
            if run_id is not None and server_run_id != run_id:
                grace_until = clock() + grace_s
                log.warning(
                    "Redis restarted: keeping the known agents %.0f s while they re-register",
                    grace_s,
                )
            run_id = server_run_id
            listed = set(static) | {r.address for r in records}
            if clock() < grace_until:
                listed |= {agent.address for agent in fleet.handles()}
            await fleet.sync(listed)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
