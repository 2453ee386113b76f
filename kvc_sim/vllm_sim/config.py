"""The simulated engine's configuration: ``SimEngineConfig`` and vLLM's ``KvEventsConfig``.

``KvEventsConfig`` takes the JSON of vLLM's ``--kv-events-config`` with vLLM's field
names and defaults (``enable_kv_cache_events``, ``publisher`` "zmq" | "null",
``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``, ``max_queue_size``,
``topic``); an unknown field is an error, not ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = ["KvEventsConfig", "SimEngineConfig", "SimEngineConfigError"]


class SimEngineConfigError(ValueError):
    """The engine's configuration is invalid; the message says which setting."""


class KvEventsConfig(BaseModel):
    """vLLM's ``--kv-events-config`` (same names, same defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = Field(10_000, ge=1)
    hwm: int = Field(100_000, ge=0)
    max_queue_size: int = Field(100_000, ge=1)
    topic: str = ""

    @model_validator(mode="after")
    def _publisher(self) -> KvEventsConfig:
        if self.publisher is None:
            chosen = "zmq" if self.enable_kv_cache_events else "null"
            object.__setattr__(self, "publisher", chosen)
        return self

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KvEventsConfig:
        """Parse the flag's JSON; an empty string means events off."""
        if not text.strip():
            return cls()
        try:
            return cls.model_validate(json.loads(text))
        except (json.JSONDecodeError, ValidationError) as exc:
            raise SimEngineConfigError(f"--kv-events-config: {exc}") from exc


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """Everything one simulated engine needs besides its profile and tokenizer.

    ``time_scale``: wall seconds per profile second (0 runs steps back to back).
    """

    model_dir: Path
    served_model_name: str
    max_model_len: int
    block_size: int = 16
    num_gpu_blocks: int = 4097  # including vLLM's null block
    num_cpu_blocks: int = 0  # CPU offloading (vLLM's OffloadingConnector); 0: off
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    scheduling_policy: str = "fcfs"  # vLLM's: "fcfs" | "priority"
    time_scale: float = 1.0
    engine_id: str = "sim-engine-0"
    side_channel_host: str = "127.0.0.1"
    kv_transfer_timeout_s: float = 480.0
    kv_events: KvEventsConfig = field(default_factory=KvEventsConfig)

    def __post_init__(self) -> None:
        checks = [
            (self.max_model_len > 0, "max_model_len must be > 0"),
            (self.block_size > 0, "block_size must be > 0"),
            (self.num_gpu_blocks >= 2, "num_gpu_blocks must be >= 2 (one is vLLM's null block)"),
            (self.num_cpu_blocks >= 0, "num_cpu_blocks must be >= 0"),
            (self.max_num_seqs > 0, "max_num_seqs must be > 0"),
            (self.max_num_batched_tokens > 0, "max_num_batched_tokens must be > 0"),
            (self.time_scale >= 0, "time_scale must be >= 0"),
            (
                self.scheduling_policy in ("fcfs", "priority"),
                "scheduling_policy must be 'fcfs' or 'priority'",
            ),
            (self.kv_transfer_timeout_s > 0, "kv_transfer_timeout_s must be > 0"),
            (bool(self.engine_id), "engine_id must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise SimEngineConfigError(message)
