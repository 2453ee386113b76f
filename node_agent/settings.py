"""Node agent settings: environment (``KVC_AGENT_*``) and CLI flags, validated once."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvc.models import DEFAULT_MODEL_DIR

Role = Literal["prefill", "decode", "both"]


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVC_AGENT_", extra="forbid")

    node_id: str = Field("", description="Stable node name; default host:port")
    role: Role = Field("both", description="prefill | decode | both")
    host: str = Field("127.0.0.1", description="Address the gRPC server binds")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 = pick a free one)")
    advertise_address: str = Field(
        "", description="host:port peers and conductors dial; default host:port"
    )
    engine: Literal["embedded"] = Field("embedded", description="Inference engine adapter")
    model: Path = Field(DEFAULT_MODEL_DIR, description="Model folder (Hugging Face layout)")
    served_model_name: str = Field("", description="Model name clients use; default folder name")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N")
    threads: int = Field(0, ge=0, description="torch CPU threads (0 = torch default)")
    block_size: int = Field(32, ge=1, le=4096, description="Tokens per KV block")
    capacity_blocks: int = Field(4096, ge=1, description="KV block pool size in blocks")
    max_lease_s: float = Field(600.0, gt=0, description="Longest Tx lease a conductor may ask")
    max_running: int = Field(16, ge=1, description="Concurrent generations before busy")
    max_staged_bytes: int = Field(
        512 * 1024 * 1024, ge=1, description="KV bytes staged for decode nodes to fetch"
    )
    stage_ttl_s: float = Field(30.0, gt=0, description="Staged KV expires unfetched after this")
    event_buffer: int = Field(65536, ge=16, description="Events kept for WatchEvents resume")
    load_interval_s: float = Field(0.5, gt=0, description="Load update period")
    transfer_chunk_bytes: int = Field(
        1024 * 1024, ge=4096, le=3 * 1024 * 1024, description="KV transfer chunk size"
    )

    @model_validator(mode="after")
    def _check(self) -> AgentSettings:
        if not self.model.is_dir():
            raise ValueError(f"model folder {self.model} does not exist")
        return self

    def resolved_served_model_name(self) -> str:
        return self.served_model_name or self.model.name

    def resolved_node_id(self, bound_port: int) -> str:
        return self.node_id or f"{socket.gethostname()}:{bound_port}"

    def resolved_advertise_address(self, bound_port: int) -> str:
        return self.advertise_address or f"{self.host}:{bound_port}"
