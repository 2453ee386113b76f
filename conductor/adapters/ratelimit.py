"""Cluster-wide per-tenant rate limits in Redis, with a local fallback.

The GCRA of ``conductor/core/ratelimit.py`` runs as one Lua script over all of a
tenant's dimensions (requests, tokens), so the check and the consumption are atomic
across every conductor replica, and time comes from the Redis server's clock (replicas'
clocks never matter). When Redis is unreachable the conductor keeps serving with an
in-process limiter holding the same limits per replica (documented: N replicas may then
admit up to N× the limit) and reports ``conductor_redis_up 0``; it tries Redis again
after ``retry_s``.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError

from conductor.core.ratelimit import Limit, RateDecision, dimension_state, gcra_check

log = logging.getLogger("conductor.ratelimit")

_GCRA_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local refused, retry = 0, 0
local tats = {}
for i = 1, #KEYS do
  local limit = tonumber(ARGV[(i - 1) * 3 + 1])
  local period = tonumber(ARGV[(i - 1) * 3 + 2])
  local cost = tonumber(ARGV[(i - 1) * 3 + 3])
  local interval = period / limit
  local tat = tonumber(redis.call('GET', KEYS[i]) or now)
  if tat < now then tat = now end
  local new_tat = tat + cost * interval
  if new_tat - now > period + 1e-9 then
    local wait = new_tat - now - period
    if refused == 0 or wait > retry then refused, retry = i, wait end
  end
  tats[i] = {tat, new_tat, period}
end
local out = {tostring(refused), tostring(retry), tostring(now)}
for i = 1, #KEYS do
  local chosen = tats[i][2]
  if refused ~= 0 then chosen = tats[i][1] end
  if refused == 0 then
    redis.call('SET', KEYS[i], tostring(chosen), 'PX', math.ceil(tats[i][3] * 1000) + 1000)
  end
  table.insert(out, tostring(chosen))
end
return out
"""

_MAX_LOCAL_TENANTS = 100_000


class RateLimiter:
    def __init__(
        self,
        redis: Redis | None,
        *,
        clock: Callable[[], float] = time.time,
        retry_s: float = 2.0,
        on_redis_state: Callable[[bool], None] | None = None,
    ) -> None:
        self._redis = redis
        self._script = redis.register_script(_GCRA_LUA) if redis is not None else None
        self._clock = clock
        self._retry_s = retry_s
        self._down_until = 0.0
        self._on_redis_state = on_redis_state
        self._local: OrderedDict[str, dict[str, float]] = OrderedDict()

    async def check(
        self, tenant: str, limits: Mapping[str, Limit], costs: Mapping[str, int]
    ) -> RateDecision:
        active = {name: lim for name, lim in limits.items() if lim.limit > 0}
        if not active:
            return RateDecision(True, 0.0, {})
        if self._script is not None and self._clock() >= self._down_until:
            try:
                return await self._check_redis(tenant, active, costs)
            except (RedisError, OSError, ValueError) as exc:
                log.warning("rate limits: Redis unavailable (%s); limiting locally", exc)
                self._down_until = self._clock() + self._retry_s
                if self._on_redis_state is not None:
                    self._on_redis_state(False)
        return self._check_local(tenant, active, costs)

    async def _check_redis(
        self, tenant: str, limits: Mapping[str, Limit], costs: Mapping[str, int]
    ) -> RateDecision:
        assert self._script is not None
        names = list(limits)
        args: list[float | int] = []
        for name in names:
            args += [limits[name].limit, limits[name].period_s, max(0, costs.get(name, 0))]
        raw = await self._script(keys=[f"kvc:rl:{tenant}:{n}" for n in names], args=args)
        if self._on_redis_state is not None:
            self._on_redis_state(True)
        refused_index, retry, now = int(raw[0]), float(raw[1]), float(raw[2])
        tats = [float(v) for v in raw[3:]]
        dims = {n: dimension_state(limits[n], tat, now) for n, tat in zip(names, tats, strict=True)}
        refused_by = names[refused_index - 1] if refused_index else None
        return RateDecision(refused_by is None, retry if refused_by else 0.0, dims, refused_by)

    def _check_local(
        self, tenant: str, limits: Mapping[str, Limit], costs: Mapping[str, int]
    ) -> RateDecision:
        tats = self._local.get(tenant, {})
        decision, new = gcra_check(tats, limits, costs, self._clock())
        self._local[tenant] = new
        self._local.move_to_end(tenant)
        while len(self._local) > _MAX_LOCAL_TENANTS:
            self._local.popitem(last=False)
        return decision
