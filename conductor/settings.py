"""Conductor settings: environment (``KVC_CONDUCTOR_*``) and CLI flags, validated once.

Each field's ``json_schema_extra`` group is its section of ``kvc conductor --help`` and
of docs/configuration.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.config import JsonDict
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from conductor.core.policies import Policy
from conductor.core.scheduler import Admission, SchedulerConfig
from kvc.models import DEFAULT_MODEL_DIR
from kvc.priors import DecodePrior, PrefillPrior
from kvc.tls import GrpcTlsSettings, check_plaintext

_HTTP: Final[JsonDict] = {"group": "HTTP server"}
_AGENTS: Final[JsonDict] = {"group": "node agents"}
_TENANTS: Final[JsonDict] = {"group": "tenants, API keys and rate limits"}
_SCHEDULING: Final[JsonDict] = {"group": "scheduling and admission"}
_PRIORS: Final[JsonDict] = {"group": "cost-model priors (until measured)"}


def _split_csv(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class ConductorSettings(GrpcTlsSettings, BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVC_CONDUCTOR_", extra="forbid")

    host: str = Field("127.0.0.1", description="HTTP bind address", json_schema_extra=_HTTP)
    port: int = Field(8000, ge=0, le=65535, description="HTTP port", json_schema_extra=_HTTP)
    workers: int = Field(
        1,
        ge=1,
        le=64,
        description="Conductor processes sharing the HTTP port (SO_REUSEPORT), each a whole "
        "conductor with its own view of the fleet; /metrics sums them. Per-conductor limits "
        "(max_inflight_requests, rate limits without Redis) apply to each",
        json_schema_extra=_HTTP,
    )
    model: Path = Field(
        DEFAULT_MODEL_DIR,
        description="Model folder with the tokenizer and chat template",
        json_schema_extra=_HTTP,
    )
    served_model_name: str = Field(
        "", description="Model name clients use; default folder name", json_schema_extra=_HTTP
    )
    tool_call_parser: Literal["auto", "none", "hermes", "llama3_json"] = Field(
        "auto",
        description="How tool calls are read from the model's text: hermes (<tool_call> "
        "tags: Hermes, Qwen), llama3_json (Llama 3.x JSON), auto (from the chat template), "
        "none (a request with tools that may call them gets 422)",
        json_schema_extra=_HTTP,
    )
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens when a request omits it", json_schema_extra=_HTTP
    )
    prompt_cache_min_tokens: int = Field(
        1024,
        ge=1,
        description="Shortest prompt prefix a cache_control breakpoint retains (Anthropic: "
        "1,024); a shorter one is ordinary automatic caching, and the usage says so",
        json_schema_extra=_HTTP,
    )
    prompt_cache_max_ttl_s: float = Field(
        3600.0,
        gt=0,
        le=86_400,
        description="Longest retention a request may ask (cache_control ttl, "
        "prompt_cache_retention '24h'); longer is 422. A node that retains for less "
        "(its --max-retention-s) serves the request and answers retention too_long",
        json_schema_extra=_HTTP,
    )
    prompt_cache_affinity_slack_s: float = Field(
        0.05,
        ge=0,
        description="prompt_cache_key: requests sharing a key go to the node the last one "
        "used while its predicted time to first token is within this of the best node's",
        json_schema_extra=_HTTP,
    )
    max_inflight_requests: int = Field(
        1024,
        ge=1,
        description="Requests in flight (waiting or generating) on this conductor before 429; "
        "a memory bound: the SLO-aware queue is max_waiting_requests",
        json_schema_extra=_HTTP,
    )
    max_request_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1024,
        description="Largest accepted request body (413 above)",
        json_schema_extra=_HTTP,
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="Deadline of one generation", json_schema_extra=_HTTP
    )
    keepalive_timeout_s: int = Field(
        75,
        gt=0,
        description=(
            "Close an idle client connection after this long; longer than the idle "
            "timeout of the load balancer or client pool in front (AWS ALB: 60 s), so "
            "the server never closes a connection a client is about to reuse"
        ),
        json_schema_extra=_HTTP,
    )
    drain_delay_s: float = Field(
        5.0,
        ge=0,
        description="On SIGTERM, report not-ready this long before closing",
        json_schema_extra=_HTTP,
    )
    shutdown_timeout_s: float = Field(
        30.0,
        gt=0,
        description=(
            "After the drain delay, how long requests in flight may finish; a stream "
            "still open then ends with an error event and [DONE]. Keep drain delay plus "
            "this under the deployment's grace period (Kubernetes: "
            "terminationGracePeriodSeconds)"
        ),
        json_schema_extra=_HTTP,
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A connection whose request headers are not complete this long after "
        "it opened (or after the request's first byte) gets 408 and is closed",
        json_schema_extra=_HTTP,
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A request body that has not arrived in full by then is refused (408)",
        json_schema_extra=_HTTP,
    )
    max_connections: int = Field(
        4096,
        ge=1,
        description="Open HTTP connections at once; a connection beyond it gets 503",
        json_schema_extra=_HTTP,
    )
    access_log: bool = Field(
        False,
        description="One log line per HTTP request (uvicorn's access log) at INFO; off by "
        "default, as in the field's routers: each request is counted in /metrics and "
        "answers with its X-Request-Id, and at hundreds of requests a second the line costs "
        "a few percent of the conductor's CPU",
        json_schema_extra=_HTTP,
    )
    placement_headers: bool = Field(
        False,
        description="Answer each generation with X-Kvc-Prefill-Node and X-Kvc-Decode-Node "
        "(the nodes that served it), for debugging and benchmarks; off by default: they "
        "name the fleet's nodes to every client",
        json_schema_extra=_HTTP,
    )

    agents: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Node agent gRPC addresses, comma-separated host:port",
        json_schema_extra=_AGENTS,
    )
    redis_url: str = Field(
        "",
        description="Redis for the node registry, rate limits and keys (empty: none)",
        json_schema_extra=_AGENTS,
    )
    rpc_timeout_s: float = Field(
        30.0, gt=0, description="Deadline of one unary agent call", json_schema_extra=_AGENTS
    )
    token_stream: bool = Field(
        True,
        description=(
            "Run Generate over an agent's token stream when it offers one (agent "
            "--stream-port), and Prefill, the GetInfo poll, Snapshot and WatchEvents "
            "where it lists them: the same calls without gRPC's per-message cost"
        ),
        json_schema_extra=_AGENTS,
    )
    registry_grace_s: float = Field(
        30.0,
        ge=0,
        description=(
            "An agent missing from the registry stays this long before it leaves the "
            "fleet (a Redis restarted empty lists nobody until agents re-register)"
        ),
        json_schema_extra=_AGENTS,
    )
    agent_poll_interval_s: float = Field(
        2.0, gt=0, description="Agent health/info poll period", json_schema_extra=_AGENTS
    )
    replica_hints_interval_s: float = Field(
        2.0,
        gt=0,
        description=(
            "Period of the replica hints pushed to agents that evict replica-aware "
            "(their replica_aware_eviction); other agents get none"
        ),
        json_schema_extra=_AGENTS,
    )
    lease_s: float = Field(
        30.0,
        gt=0,
        le=600,
        description="Lease on node-side block locks; a request's Tx gets this plus twice its "
        "predicted TTFT (at most 600 s)",
        json_schema_extra=_AGENTS,
    )

    api_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Accepted bearer keys, comma-separated (empty: no auth)",
        json_schema_extra=_TENANTS,
    )
    default_tenant: str = Field(
        "default", description="Tenant of unauthenticated requests", json_schema_extra=_TENANTS
    )
    tenants_file: Path | None = Field(
        None,
        description="JSON/YAML file: tenants with their API keys and rate limits",
        json_schema_extra=_TENANTS,
    )
    api_keys_in_redis: bool = Field(
        False,
        description="Also resolve API keys from Redis (kvc:apikey:<sha256>)",
        json_schema_extra=_TENANTS,
    )
    admin_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Bearer keys for /admin endpoints (empty: admin off)",
        json_schema_extra=_TENANTS,
    )
    default_requests_per_minute: int = Field(
        0,
        ge=0,
        description="Per-tenant request limit when a tenant sets none (0: unlimited)",
        json_schema_extra=_TENANTS,
    )
    default_tokens_per_minute: int = Field(
        0,
        ge=0,
        description="Per-tenant token limit (prompt + max_tokens) (0: unlimited)",
        json_schema_extra=_TENANTS,
    )

    policy: Literal["round_robin", "least_loaded", "local_prefix", "kv_centric", "kv_adaptive"] = (
        Field(
            "kv_centric",
            description="Scheduling policy (kv_centric = Mooncake Algorithm 1; kv_adaptive "
            "also counts in-flight prefixes and pulls only at break-even)",
            json_schema_extra=_SCHEDULING,
        )
    )
    admission: Literal["none", "early", "predictive"] = Field(
        "predictive",
        description="SLO admission (predictive also forecasts decode load)",
        json_schema_extra=_SCHEDULING,
    )
    ttft_slo_s: float = Field(
        30.0, gt=0, description="Default time-to-first-token SLO", json_schema_extra=_SCHEDULING
    )
    tbt_slo_s: float = Field(
        0.2, gt=0, description="Default time-between-tokens SLO", json_schema_extra=_SCHEDULING
    )
    kvcache_balancing_threshold: float = Field(
        2.0,
        ge=1.0,
        description="Pull a remote prefix when best/local prefix exceeds this ratio",
        json_schema_extra=_SCHEDULING,
    )
    output_length_prior_tokens: float = Field(
        256.0,
        gt=0,
        description="Prior mean output length (tokens) until lengths are learned per tenant",
        json_schema_extra=_SCHEDULING,
    )
    max_waiting_requests: int = Field(
        64,
        ge=0,
        description="Requests that may wait here for decode capacity when waiting still "
        "meets their TTFT SLO (0: refuse instead of waiting)",
        json_schema_extra=_SCHEDULING,
    )

    prefill_prior_fixed_s: float = Field(
        0.002, ge=0, description="Prefill time prior: fixed", json_schema_extra=_PRIORS
    )
    prefill_prior_per_token_s: float = Field(
        2e-5, ge=0, description="Prefill time prior: per uncached token", json_schema_extra=_PRIORS
    )
    prefill_prior_per_token_context_s: float = Field(
        1e-9,
        ge=0,
        description="Prefill time prior: per uncached token × context token",
        json_schema_extra=_PRIORS,
    )
    decode_prior_fixed_s: float = Field(
        0.002, ge=0, description="TBT prior: fixed", json_schema_extra=_PRIORS
    )
    decode_prior_per_request_s: float = Field(
        5e-4, ge=0, description="TBT prior: per request", json_schema_extra=_PRIORS
    )
    decode_prior_per_context_token_s: float = Field(
        1e-7, ge=0, description="TBT prior: per KV token in the batch", json_schema_extra=_PRIORS
    )
    transfer_bandwidth_bytes_per_s: float = Field(
        1e9,
        gt=0,
        description="KV transfer bandwidth prior between nodes",
        json_schema_extra=_PRIORS,
    )
    transfer_latency_s: float = Field(
        0.001, ge=0, description="KV transfer latency prior", json_schema_extra=_PRIORS
    )

    @field_validator("agents", "api_keys", "admin_keys", mode="before")
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

    @model_validator(mode="after")
    def _workers_share_a_port(self) -> ConductorSettings:
        if self.workers > 1 and self.port == 0:
            raise ValueError("workers > 1 share one fixed port: set port (0 picks one per worker)")
        return self

    @model_validator(mode="after")
    def _agents_reachable_securely(self) -> ConductorSettings:
        if self.tls_files() is None:
            for address in self.agents:
                check_plaintext(address, self.grpc_plaintext, "to agent " + address)
        return self

    @field_validator("tenants_file")
    @classmethod
    def _tenants_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            from conductor.tenants import load_tenants_file

            load_tenants_file(value)  # fail fast with the file's problem
        return value

    @field_validator("model")
    @classmethod
    def _model_dir(cls, value: Path) -> Path:
        if not (value / "tokenizer.json").is_file():
            raise ValueError(f"{value} has no tokenizer.json")
        return value

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            policy=Policy(self.policy),
            admission=Admission(self.admission),
            kvcache_balancing_threshold=self.kvcache_balancing_threshold,
            output_length_prior_tokens=self.output_length_prior_tokens,
            prefill_prior=PrefillPrior(
                fixed_s=self.prefill_prior_fixed_s,
                per_token_s=self.prefill_prior_per_token_s,
                per_token_context_s=self.prefill_prior_per_token_context_s,
            ),
            decode_prior=DecodePrior(
                fixed_s=self.decode_prior_fixed_s,
                per_request_s=self.decode_prior_per_request_s,
                per_context_token_s=self.decode_prior_per_context_token_s,
            ),
            transfer_bandwidth_bytes_per_s=self.transfer_bandwidth_bytes_per_s,
            transfer_latency_s=self.transfer_latency_s,
        )

    def resolved_served_model_name(self) -> str:
        return self.served_model_name or self.model.name
