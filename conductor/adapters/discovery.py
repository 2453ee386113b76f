"""Agent discovery from the Redis node registry (``kvc/registry.py``).

Every ``interval_s`` the conductor lists the registered agents serving its model and
makes its fleet equal to those plus the static ``--agents`` list. When Redis cannot be
reached, the fleet keeps the last known membership (agents that stay reachable keep
serving) and ``conductor_redis_up`` drops to 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
) -> None:
    healthy = True
    while not stop.is_set():
        try:
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
            await fleet.sync(set(static) | {r.address for r in records})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
