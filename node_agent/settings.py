"""Node agent settings: environment (``KVC_AGENT_*``) and CLI flags, validated once.

Each field's ``json_schema_extra`` group is its section of ``kvc agent --help`` and of
docs/configuration.md.
"""

from __future__ import annotations

import shlex
import socket
from pathlib import Path
from typing import Final, Literal

from pydantic import Field, model_validator
from pydantic.config import JsonDict
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvc.models import DEFAULT_MODEL_DIR
from kvc.roles import NodeRole
from kvc.tls import GrpcTlsSettings

_NODE: Final[JsonDict] = {"group": "node: gRPC server, registry, metrics"}
_ENGINE: Final[JsonDict] = {"group": "engine"}
_BLOCKS: Final[JsonDict] = {"group": "KV blocks and transfer"}
_VLLM: Final[JsonDict] = {"group": "vLLM engine (--engine vllm, docs/engines.md)"}


DEFAULT_MAX_RUNNING: Final = {"embedded": 16, "vllm": 256}
_MIN_STAGED_BYTES: Final = 512 * 1024 * 1024


class AgentSettings(GrpcTlsSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVC_AGENT_", extra="forbid")

    node_id: str = Field(
        "", description="Stable node name; default host:port", json_schema_extra=_NODE
    )
    role: NodeRole = Field(
        "both", description="What the conductor schedules here", json_schema_extra=_NODE
    )
    host: str = Field(
        "127.0.0.1", description="Address the gRPC server binds", json_schema_extra=_NODE
    )
    port: int = Field(
        50051,
        ge=0,
        le=65535,
        description="gRPC port (0 = pick a free one)",
        json_schema_extra=_NODE,
    )
    advertise_address: str = Field(
        "",
        description="host:port peers and conductors dial; default host:port",
        json_schema_extra=_NODE,
    )
    stream_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description=(
            "Also serve Generate, Prefill, GetInfo, Snapshot and WatchEvents on this TCP "
            "port as a lean framed stream (mTLS with the gRPC files); conductors prefer "
            "it (0 = pick a free one; unset = off)"
        ),
        json_schema_extra=_NODE,
    )
    metrics_host: str = Field(
        "",
        description="Address the Prometheus /metrics HTTP server binds; default: host",
        json_schema_extra=_NODE,
    )
    # Off by default: several agents often share a host (kvc demo, tests), where one
    # fixed port would collide. Deployments set it (compose and the Helm chart use 9464).
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="Prometheus /metrics HTTP port (0 = no metrics server)",
        json_schema_extra=_NODE,
    )
    redis_url: str = Field(
        "", description="Redis to register in (empty: no registry)", json_schema_extra=_NODE
    )
    registry_ttl_s: float = Field(
        10.0,
        gt=0,
        description="Registry record TTL; refreshed every third of it",
        json_schema_extra=_NODE,
    )
    event_buffer: int = Field(
        65536, ge=16, description="Events kept for WatchEvents resume", json_schema_extra=_NODE
    )
    load_interval_s: float = Field(
        0.5, gt=0, description="Load update period", json_schema_extra=_NODE
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM, time in-flight work gets before Txs are aborted",
        json_schema_extra=_NODE,
    )

    engine: Literal["embedded", "vllm"] = Field(
        "embedded",
        description="Inference engine adapter: embedded (in-process) or vllm",
        json_schema_extra=_ENGINE,
    )
    model: Path = Field(
        DEFAULT_MODEL_DIR,
        description="Model folder (Hugging Face layout)",
        json_schema_extra=_ENGINE,
    )
    served_model_name: str = Field(
        "", description="Model name clients use; default folder name", json_schema_extra=_ENGINE
    )
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N", json_schema_extra=_ENGINE)
    threads: int = Field(
        0, ge=0, description="torch CPU threads (0 = torch default)", json_schema_extra=_ENGINE
    )
    max_running: int = Field(
        0,
        ge=0,
        description=(
            "Concurrent generations before busy (0 = the engine's own: 16 embedded, "
            "256 vLLM, as vLLM's max_num_seqs; a launched vLLM gets it as --max-num-seqs)"
        ),
        json_schema_extra=_ENGINE,
    )
    calibrate: bool = Field(
        True,
        description="Measure the engine at start and report the fit to conductors",
        json_schema_extra=_ENGINE,
    )
    calibration_budget_s: float = Field(
        10.0,
        gt=0,
        le=600,
        description="Hard bound on the start-up calibration; it fits what was measured by then",
        json_schema_extra=_ENGINE,
    )
    calibration_turns: int = Field(
        0,
        ge=0,
        le=1024,
        description=(
            "Calibrations that may run at once among this host's agents that set it "
            "(advisory locks in the temp dir; the wait counts against the budget): for "
            "engines that compute elsewhere but share this host's CPUs, such as a fleet of "
            "simulated engines. 0: only engines computing in the agent's process take "
            "turns, one at a time"
        ),
        json_schema_extra=_ENGINE,
    )

    block_size: int = Field(
        32, ge=1, le=4096, description="Tokens per KV block", json_schema_extra=_BLOCKS
    )
    capacity_blocks: int = Field(
        4096, ge=1, description="KV block pool size in blocks", json_schema_extra=_BLOCKS
    )
    max_lease_s: float = Field(
        600.0, gt=0, description="Longest Tx lease a conductor may ask", json_schema_extra=_BLOCKS
    )
    require_node_certificates: bool = Field(
        False,
        description=(
            "With mTLS: serve KV pulls (FetchKv, ReadBlocks) to an agent only when its "
            "certificate names its node (kvc certs --node) and the conductor bound the "
            "grant to that node; this agent's own certificate must name its node too"
        ),
        json_schema_extra={"group": "gRPC security: mTLS (docs/security.md)"},
    )
    tenant_max_locked_share: float = Field(
        0.9,
        gt=0,
        le=1,
        description=(
            "Share of the pool one tenant's locked blocks may reach while another "
            "tenant holds locks (alone, a tenant uses the whole pool); 1: no limit"
        ),
        json_schema_extra=_BLOCKS,
    )
    max_retention_s: float = Field(
        3600.0,
        gt=0,
        le=86_400,
        description=(
            "Longest prompt-cache retention (a cache_control breakpoint's TTL) a "
            "conductor may ask; longer is refused"
        ),
        json_schema_extra=_BLOCKS,
    )
    retention_budget_block_s: float | None = Field(
        None,
        ge=0,
        description=(
            "Each tenant's prompt-cache retention budget in KV block-seconds (the sum over "
            "its retained blocks of the seconds left); past it a retention is refused and "
            "the request served with ordinary caching. Unset: a quarter of the pool for "
            "max_retention_s"
        ),
        json_schema_extra=_BLOCKS,
    )
    max_retained_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description=(
            "Share of the pool that retained blocks may fill, all tenants together (the "
            "rest stays for automatic caching and new work); 0: no retention"
        ),
        json_schema_extra=_BLOCKS,
    )
    max_staged_bytes: int = Field(
        0,
        ge=0,
        description=(
            "KV bytes a prefill node holds staged for decode nodes to fetch (a copy on the "
            "engine's device until fetched); 0: the KV of the longest prompt this node can "
            "prefill (the model's context, at most the pool's capacity), at least 512 MiB. "
            "A prompt whose KV alone exceeds it is refused"
        ),
        json_schema_extra=_BLOCKS,
    )
    host_tier_bytes: int = Field(
        0,
        ge=0,
        description=(
            "Host-memory (L2) budget for KV blocks evicted from the engine's pool: they are "
            "demoted there and promoted back on a hit instead of recomputed; 0: off "
            "(embedded engine; vLLM offloads with its own flags, docs/engines.md)"
        ),
        json_schema_extra=_BLOCKS,
    )
    disk_tier_dir: Path | None = Field(
        None,
        description=(
            "Local directory for the disk (L3) tier: blocks pushed out of host memory "
            "(or of the pool, without L2) are written there, one file each; the agent "
            "deletes its own *.kvblock files there at start"
        ),
        json_schema_extra=_BLOCKS,
    )
    disk_tier_bytes: int = Field(
        0,
        ge=0,
        description="Disk (L3) budget in bytes (needs disk_tier_dir); 0: off",
        json_schema_extra=_BLOCKS,
    )
    replica_aware_eviction: bool = Field(
        False,
        description=(
            "Evicted blocks that conductors see on another node are dropped, not demoted, "
            "so the lower tiers keep the fleet's last copies (replica hints pushed by "
            "conductors); needs host_tier_bytes or disk_tier_bytes. Off by default: it "
            "did not pay in the simulator (docs/benchmarks.md)"
        ),
        json_schema_extra=_BLOCKS,
    )
    donate_before_evict: bool = Field(
        False,
        description=(
            "A hot block this node drops that conductors see nowhere else is offered to a "
            "peer agent with this setting (the one whose own next victim is coldest, if it "
            "holds the block's parent), and such peers' blocks are taken here; embedded "
            "engine only. Off by default: it did not pay in the simulator "
            "(docs/benchmarks.md)"
        ),
        json_schema_extra=_BLOCKS,
    )
    donate_min_hits: int = Field(
        1, ge=0, description="Reuses on this node before a dropped block is offered",
        json_schema_extra=_BLOCKS,
    )  # fmt: skip
    donate_max_hops: int = Field(
        1, ge=1, description="Times one block's KV may be donated", json_schema_extra=_BLOCKS
    )
    stage_ttl_s: float = Field(
        30.0, gt=0, description="Staged KV expires unfetched after this", json_schema_extra=_BLOCKS
    )
    transfer_chunk_bytes: int = Field(
        1024 * 1024,
        ge=4096,
        le=3 * 1024 * 1024,
        description="KV transfer chunk size",
        json_schema_extra=_BLOCKS,
    )
    kv_shm_dir: str = Field(
        "/dev/shm",
        description=(
            "Directory for same-host KV transfers through shared-memory files (both "
            "agents on one machine: the KV is written there instead of streamed over "
            "gRPC); empty: always stream"
        ),
        json_schema_extra=_BLOCKS,
    )

    # engine=vllm (docs/engines.md): the agent launches vLLM with vllm_python, or attaches
    # to vllm_url; either way it talks HTTP (generation, /metrics) and ZMQ (KV events).
    vllm_url: str = Field(
        "",
        description="vLLM OpenAI server to attach to (http://host:port); empty: launch one",
        json_schema_extra=_VLLM,
    )
    vllm_python: str = Field(
        "",
        description="Python that has vllm installed, to launch it (e.g. .venv-vllm/bin/python)",
        json_schema_extra=_VLLM,
    )
    vllm_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="HTTP port of a launched vLLM on 127.0.0.1 (0 = a free one)",
        json_schema_extra=_VLLM,
    )
    vllm_launch_args: str = Field(
        "",
        description="Extra arguments for a launched vLLM, shell-quoted (e.g. '--enforce-eager')",
        json_schema_extra=_VLLM,
    )
    vllm_startup_timeout_s: float = Field(
        300.0,
        gt=0,
        description="How long a launched or attached vLLM may take to become healthy",
        json_schema_extra=_VLLM,
    )
    kv_events_endpoint: str = Field(
        "",
        description="ZMQ endpoint of vLLM's KV-event publisher (tcp://host:port or ipc://path), "
        "bound by vLLM; launch: empty = a private ipc socket; attach: empty = no cache mirror",
        json_schema_extra=_VLLM,
    )
    kv_events_replay_endpoint: str = Field(
        "",
        description="ZMQ endpoint of vLLM's KV-event replay socket, to fill sequence gaps "
        "(attach: empty = a gap clears the mirror; launch: empty = a private ipc socket)",
        json_schema_extra=_VLLM,
    )
    kv_events_topic: str = Field(
        "kv-events", description="Topic of vLLM's KV events", json_schema_extra=_VLLM
    )
    vllm_cpu_offload_bytes: int = Field(
        0,
        ge=0,
        description=(
            "Host memory vLLM offloads KV to (its OffloadingConnector, set in the launch "
            "args: docs/engines.md); > 0: its CPU-medium KV events are mirrored and "
            "conductors count those blocks as held in host memory; 0: not mirrored"
        ),
        json_schema_extra=_VLLM,
    )
    vllm_cpu_offload_read_bytes_per_s: float = Field(
        0.0,
        ge=0,
        description=(
            "Bandwidth at which vLLM loads offloaded KV back (reported to conductors, who "
            "charge a host hit its load time); 0: unknown, conductors use their default"
        ),
        json_schema_extra=_VLLM,
    )
    pd_connector: Literal["none", "nixl"] = Field(
        "none",
        description="vLLM prefill/decode hand-off via kv_transfer_params (nixl: vLLM's "
        "NixlConnector, GPUs only); none: vLLM nodes run role both",
        json_schema_extra=_VLLM,
    )
    vllm_prefix_pull_priority: int = Field(
        0,
        ge=-(2**31),
        lt=2**31,
        description=(
            "vLLM request priority of a prefix pull's two legs (the holder's lend, this "
            "node's load): below 0 they go before waiting requests under vLLM's "
            "--scheduling-policy priority (which vLLM then needs); 0: none sent, they "
            "queue first come first served, behind the engines' whole waiting queues"
        ),
        json_schema_extra=_VLLM,
    )
    vllm_prefix_pulls: bool = Field(
        False,
        description=(
            "With pd_connector: lend and take prefixes between vLLM nodes through the "
            "connector (hot-spot replication: the holder's vLLM keeps a prefix for one "
            "pull, this node's vLLM loads it into its prefix cache); off by default: "
            "measured live, it raised the hit ratio but not TTFT (docs/benchmarks.md); "
            "false: this node neither lends nor pulls, conductors plan no pulls with it"
        ),
        json_schema_extra=_VLLM,
    )

    @model_validator(mode="after")
    def _check(self) -> AgentSettings:
        if not self.model.is_dir():
            raise ValueError(f"model folder {self.model} does not exist")
        if self.engine == "vllm":
            self._check_vllm()
        if self.disk_tier_bytes > 0 and self.disk_tier_dir is None:
            raise ValueError("disk_tier_bytes needs disk_tier_dir (the directory to write to)")
        if self.engine != "vllm" and (
            self.vllm_cpu_offload_bytes or self.vllm_cpu_offload_read_bytes_per_s
        ):
            raise ValueError("vllm_cpu_offload_* settings apply to --engine vllm only")
        if self.engine != "embedded" and (self.host_tier_bytes or self.disk_tier_bytes):
            raise ValueError(
                f"host/disk KV tiers need the embedded engine; {self.engine} keeps its KV "
                "in its own process (vLLM: its own CPU offloading, see docs/engines.md)"
            )
        if self.donate_before_evict and self.engine != "embedded":
            raise ValueError(
                f"donate_before_evict needs the embedded engine; {self.engine} evicts its KV "
                "inside its own process, where the agent cannot take it"
            )
        if self.replica_aware_eviction and not (self.host_tier_bytes or self.disk_tier_bytes):
            raise ValueError(
                "replica_aware_eviction chooses between demoting and dropping: it needs a "
                "lower tier (host_tier_bytes or disk_tier_bytes)"
            )
        return self

    def _check_vllm(self) -> None:
        if bool(self.vllm_url) == bool(self.vllm_python):
            raise ValueError(
                "engine=vllm needs exactly one of vllm_url (attach) or vllm_python (launch)"
            )
        if self.vllm_url and not self.vllm_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_url {self.vllm_url!r} is not an http(s) URL")
        if self.vllm_python and not Path(self.vllm_python).is_file():
            raise ValueError(f"vllm_python {self.vllm_python} does not exist")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"{name} {value!r} must be tcp://host:port or ipc://path")
        if self.role != "both" and self.pd_connector == "none":
            raise ValueError("a vLLM node runs role both unless pd_connector is set")
        try:
            self.vllm_launch_arg_list()
        except ValueError as exc:
            raise ValueError(f"vllm_launch_args: {exc}") from exc

    def vllm_launch_arg_list(self) -> list[str]:
        """``vllm_launch_args`` split the way a POSIX shell would."""
        return shlex.split(self.vllm_launch_args)

    def resolved_max_running(self) -> int:
        """``max_running``, or the engine's default when 0: the embedded engine time-slices
        one model on this process (16); vLLM batches up to its ``max_num_seqs`` (256 by
        default) and a lower cap here would leave its batch half empty unnoticed."""
        if self.max_running:
            return self.max_running
        return DEFAULT_MAX_RUNNING[self.engine]

    def resolved_max_staged_bytes(self, kv_bytes_per_token: int, max_model_len: int) -> int:
        """``max_staged_bytes``, or by default room for the KV of the longest prompt this
        node can prefill: the model's context, bounded by the pool's capacity (a prompt's
        blocks must fit the pool), at least 512 MiB. Staged KV is a copy on the device,
        so the default never exceeds the pool's own size beyond the floor. Seen on an
        H200: the old fixed 512 MiB refused every 8k-token prompt of an 8B model (1 GiB
        of KV) as busy, for ever."""
        if self.max_staged_bytes:
            return self.max_staged_bytes
        longest = min(max_model_len, self.capacity_blocks * self.block_size)
        return max(_MIN_STAGED_BYTES, longest * kv_bytes_per_token)

    def resolved_served_model_name(self) -> str:
        return self.served_model_name or self.model.name

    def resolved_retention_budget_block_s(self) -> float:
        if self.retention_budget_block_s is not None:
            return self.retention_budget_block_s
        return 0.25 * self.capacity_blocks * self.max_retention_s

    def max_retained_blocks(self) -> int:
        return int(self.capacity_blocks * self.max_retained_share)

    def tenant_max_locked_blocks(self) -> int | None:
        if self.tenant_max_locked_share >= 1.0:
            return None
        return max(1, int(self.capacity_blocks * self.tenant_max_locked_share))

    def resolved_node_id(self, bound_port: int) -> str:
        return self.node_id or f"{socket.gethostname()}:{bound_port}"

    def resolved_advertise_address(self, bound_port: int) -> str:
        return self.advertise_address or f"{self.host}:{bound_port}"
