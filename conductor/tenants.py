"""API keys → tenants, with per-tenant rate limits.

Sources, in lookup order: ``--api-keys`` (each key → the default tenant), the tenants
file (``--tenants-file``, JSON or YAML, below), and Redis (``kvc:apikey:<sha256 of the
key>`` → ``{"tenant": …, "requests_per_minute": …, "tokens_per_minute": …}``, cached for
``cache_s``). Keys are held only as SHA-256 digests. When no source is configured,
authentication is off and every request belongs to the default tenant.

Tenants file::

    tenants:
      acme:
        api_keys: ["sk-acme-1"]          # or api_key_sha256: ["<hex>"]
        requests_per_minute: 600         # 0 or absent: the conductor default
        tokens_per_minute: 200000

The tenant is part of every block key's preimage (``kvc/block_keys.py``), so
one tenant can never hit — or time — another tenant's KV cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

log = logging.getLogger("conductor.tenants")

_CACHE_MAX = 10_000


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    requests_per_minute: int  # 0 = unlimited
    tokens_per_minute: int  # 0 = unlimited


class _TenantSpec(BaseModel):
    api_keys: list[str] = Field(default_factory=list)
    api_key_sha256: list[str] = Field(default_factory=list)
    requests_per_minute: int = Field(0, ge=0)
    tokens_per_minute: int = Field(0, ge=0)


class _TenantsFile(BaseModel):
    tenants: dict[str, _TenantSpec]


class _RedisKey(BaseModel):
    tenant: str = Field(min_length=1)
    requests_per_minute: int = Field(0, ge=0)
    tokens_per_minute: int = Field(0, ge=0)


class TenantsFileError(ValueError):
    """The tenants file cannot be read or is invalid."""


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def load_tenants_file(path: Path) -> _TenantsFile:
    try:
        text = path.read_text()
    except OSError as exc:
        raise TenantsFileError(f"cannot read tenants file {path}: {exc}") from exc
    data: Any
    try:
        if path.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        return _TenantsFile.model_validate(data)
    except (ValueError, ValidationError) as exc:
        raise TenantsFileError(f"invalid tenants file {path}: {exc}") from exc


class TenantDirectory:
    def __init__(
        self,
        *,
        default_tenant: str,
        default_requests_per_minute: int,
        default_tokens_per_minute: int,
        api_keys: list[str],
        tenants_file: Path | None,
        redis: Redis | None,
        keys_in_redis: bool,
        cache_s: float = 30.0,
    ) -> None:
        self._defaults = (default_requests_per_minute, default_tokens_per_minute)
        self.default = Tenant(default_tenant, *self._defaults)
        self._by_digest: dict[str, Tenant] = {key_digest(k): self.default for k in api_keys}
        if tenants_file is not None:
            for name, spec in load_tenants_file(tenants_file).tenants.items():
                tenant = Tenant(
                    name,
                    spec.requests_per_minute or default_requests_per_minute,
                    spec.tokens_per_minute or default_tokens_per_minute,
                )
                for key in spec.api_keys:
                    self._by_digest[key_digest(key)] = tenant
                for digest in spec.api_key_sha256:
                    self._by_digest[digest.lower()] = tenant
        self._redis = redis if keys_in_redis else None
        self._cache_s = cache_s
        self._cache: OrderedDict[str, tuple[float, Tenant | None]] = OrderedDict()

    @property
    def auth_required(self) -> bool:
        return bool(self._by_digest) or self._redis is not None

    async def resolve(self, api_key: str) -> Tenant | None:
        digest = key_digest(api_key)
        tenant = self._by_digest.get(digest)
        if tenant is not None or self._redis is None:
            return tenant
        cached = self._cache.get(digest)
        now = time.monotonic()
        if cached is not None and cached[0] > now:
            return cached[1]
        try:
            raw = await self._redis.get(f"kvc:apikey:{digest}")
        except (RedisError, OSError) as exc:
            log.warning("tenant lookup: Redis unavailable (%s)", exc)
            return cached[1] if cached is not None else None
        found: Tenant | None = None
        if raw is not None:
            try:
                spec = _RedisKey.model_validate_json(raw)
                found = Tenant(
                    spec.tenant,
                    spec.requests_per_minute or self._defaults[0],
                    spec.tokens_per_minute or self._defaults[1],
                )
            except ValidationError:
                log.warning("tenant lookup: malformed record for a key; refusing it")
        self._cache[digest] = (now + self._cache_s, found)
        self._cache.move_to_end(digest)
        while len(self._cache) > _CACHE_MAX:
            self._cache.popitem(last=False)
        return found
