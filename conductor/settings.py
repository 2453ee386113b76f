"""Conductor settings: environment (``KVC_CONDUCTOR_*``) and CLI flags, validated once."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from kvc.models import DEFAULT_MODEL_DIR


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class ConductorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVC_CONDUCTOR_", extra="forbid")

    host: str = Field("127.0.0.1", description="HTTP bind address")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    agents: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Node agent gRPC addresses, comma-separated host:port"
    )
    model: Path = Field(
        DEFAULT_MODEL_DIR, description="Model folder with the tokenizer and chat template"
    )
    served_model_name: str = Field("", description="Model name clients use; default folder name")
    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Accepted bearer keys, comma-separated (empty: no auth)"
    )
    default_tenant: str = Field("default", description="Tenant of unauthenticated requests")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request omits it")
    lease_s: float = Field(30.0, gt=0, le=600, description="Lease on node-side block locks")
    max_inflight_requests: int = Field(
        64, ge=1, description="Requests in flight on this conductor before 429"
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Largest accepted request body (413 above)"
    )
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline of one generation")
    rpc_timeout_s: float = Field(30.0, gt=0, description="Deadline of one unary agent call")
    agent_poll_interval_s: float = Field(2.0, gt=0, description="Agent health/info poll period")

    @field_validator("agents", "api_keys", mode="before")
    @classmethod
    def _csv(cls, value: Any) -> Any:
        return _split_csv(value)

    @field_validator("agents")
    @classmethod
    def _addresses(cls, value: list[str]) -> list[str]:
        for addr in value:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"agent address {addr!r} is not host:port")
        return value

    @field_validator("model")
    @classmethod
    def _model_dir(cls, value: Path) -> Path:
        if not (value / "tokenizer.json").is_file():
            raise ValueError(f"{value} has no tokenizer.json")
        return value

    def resolved_served_model_name(self) -> str:
        return self.served_model_name or self.model.name
