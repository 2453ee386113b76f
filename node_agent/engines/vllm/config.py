"""vLLM's configuration as the agent sees it: where vLLM runs, its KV geometry and
layout, and the ``cache_salt`` that stands for each tenant.

Calibration probes send the reserved salt ``CALIBRATION_SALT``: no tenant's salt can be
it (``salt_for_tenant`` digests tenants that start with ``__kvc``), so no tenant can hit
the blocks they leave in vLLM's prefix cache, and the KV-event mirror skips them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from node_agent.kv import KvLayout
from node_agent.settings import AgentSettings

__all__ = [
    "CALIBRATION_SALT",
    "HASHED_SALT_PREFIX",
    "RESERVED_SALT_PREFIX",
    "KvGeometry",
    "VllmConfig",
    "model_layout",
    "salt_for_tenant",
]

_SALT_MAX_LEN: Final = 128
_SALT_FORBIDDEN: Final = frozenset("@/\\\x00")
HASHED_SALT_PREFIX: Final = "kvc-t-"
RESERVED_SALT_PREFIX: Final = "__kvc"  # salts of the agent's own requests
CALIBRATION_SALT: Final = "__kvc_calibration__"
_DTYPES: Final = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def salt_for_tenant(tenant: str) -> str | None:
    """vLLM's ``cache_salt`` for a tenant: the tenant itself where vLLM accepts it.

    vLLM takes at most 128 characters and none of ``@ / \\ NUL``; other tenants get a
    stable digest, as do tenants starting with ``__kvc`` (salts reserved for the agent's
    own requests, e.g. ``CALIBRATION_SALT``). The empty tenant sends no salt.
    """
    if not tenant:
        return None
    if (
        len(tenant) <= _SALT_MAX_LEN
        and not _SALT_FORBIDDEN.intersection(tenant)
        and not tenant.startswith(RESERVED_SALT_PREFIX)
    ):
        return tenant
    digest = hashlib.blake2b(tenant.encode("utf-8"), digest_size=16).hexdigest()
    return HASHED_SALT_PREFIX + digest


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """What the agent's pool must match: vLLM's block size and usable block count."""

    block_size: int
    capacity_blocks: int


@dataclass(frozen=True, slots=True)
class VllmConfig:
    model_dir: Path
    served_model_name: str
    block_size: int
    capacity_blocks: int  # usable blocks asked of a launched vLLM
    url: str = ""  # attach to this server; empty: launch one
    python: str = ""
    port: int = 0
    launch_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = "kv-events"
    pd_connector: str = "none"
    prefix_pulls: bool = False  # with pd_connector: lend and load prefixes (LendBlocks)
    prefix_pull_priority: int = 0  # vLLM priority of the lend and load legs; 0: none sent
    host_media: frozenset[str] = frozenset()  # KV-event media mirrored as host copies
    max_running: int = 16
    metrics_interval_s: float = 0.5
    request_timeout_s: float = 600.0

    @classmethod
    def from_settings(cls, settings: AgentSettings) -> VllmConfig:
        return cls(
            model_dir=settings.model,
            served_model_name=settings.resolved_served_model_name(),
            block_size=settings.block_size,
            capacity_blocks=settings.capacity_blocks,
            url=settings.vllm_url,
            python=settings.vllm_python,
            port=settings.vllm_port,
            launch_args=tuple(settings.vllm_launch_arg_list()),
            startup_timeout_s=settings.vllm_startup_timeout_s,
            kv_events_endpoint=settings.kv_events_endpoint,
            kv_events_replay_endpoint=settings.kv_events_replay_endpoint,
            kv_events_topic=settings.kv_events_topic,
            pd_connector=settings.pd_connector,
            prefix_pulls=settings.vllm_prefix_pulls,
            prefix_pull_priority=settings.vllm_prefix_pull_priority,
            host_media=frozenset({"CPU"}) if settings.vllm_cpu_offload_bytes > 0 else frozenset(),
            max_running=settings.resolved_max_running(),
            metrics_interval_s=settings.load_interval_s,
        )


def model_layout(model_dir: Path, launch_args: tuple[str, ...]) -> tuple[KvLayout, int, int]:
    """(KV layout, vocab size, max positions) from the model's config.json.

    The dtype follows ``--dtype`` when the launch arguments set it; it only feeds the
    conductor's transfer-cost estimate (vLLM's KV never leaves vLLM here).
    """
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    dtype = _DTYPES.get(str(text.get("torch_dtype", "bfloat16")), "bfloat16")
    if "--dtype" in launch_args:
        i = launch_args.index("--dtype")
        if i + 1 < len(launch_args):
            dtype = _DTYPES.get(launch_args[i + 1], dtype)
    layout = KvLayout(
        num_layers=int(text["num_hidden_layers"]),
        num_kv_heads=int(text.get("num_key_value_heads", heads)),
        head_dim=head_dim,
        dtype=dtype,
    )
    return layout, int(text["vocab_size"]), int(text.get("max_position_embeddings", 2048))
