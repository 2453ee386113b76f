"""Targets, engines and options of the field benchmark (``bench.field_routers``), and the
command line of every process it starts: pure functions, no process started here.

Targets
    ``round_robin`` (vllm-router's), ``vllm-router:cache_aware``, ``vllm-router:kv_aware``,
    ``smg:cache_aware``, ``conductor:kv_centric``, ``conductor:kv_adaptive`` (``TARGETS``).

Commands
    ``kvc sim-engine`` aggregated, its KV-event PUB and replay sockets bound (vLLM's rule: an
    endpoint with ``*`` binds; every subscriber here connects); ``vllm-router`` with
    ``--kv-event-source URL=tcp://...`` per engine for ``kv_aware``; ``smg launch`` with the
    flags REFERENCE.md records as working here; ``kvc agent --engine vllm`` attached to an
    engine's URL and events; ``kvc conductor`` with the client's SLOs scaled to wall time;
    ``kvc bench live``.

Knobs: ``FieldOptions``. Complexity: O(engines) per command.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = Path("/work/shared/traces/synthetic_trace.jsonl")
HOST = "127.0.0.1"
KV_TOPIC = ""
"""The engines' KV-event topic: vLLM's default, empty. vllm-router 0.1.17's static event
sources take no topic and drop every message with another one (measured), so a named topic
would leave its kv_aware index empty; our agents subscribe to the same one."""

TargetKind = Literal["vllm-router", "smg", "conductor"]


@dataclass(frozen=True, slots=True)
class Target:
    name: str  # as on the command line and in the table
    kind: TargetKind
    policy: str

    @property
    def slug(self) -> str:
        """The target's folder name under ``--out``."""
        return self.name.replace(":", "-")


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("round_robin", "vllm-router", "round_robin"),
        Target("vllm-router:cache_aware", "vllm-router", "cache_aware"),
        Target("vllm-router:kv_aware", "vllm-router", "kv_aware"),
        Target("smg:cache_aware", "smg", "cache_aware"),
        Target("conductor:kv_centric", "conductor", "kv_centric"),
        Target("conductor:kv_adaptive", "conductor", "kv_adaptive"),
    )
}


def parse_targets(text: str) -> list[Target]:
    """Comma-separated target names, in the order given; unknown or repeated ones refused."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError("no targets given")
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise ValueError(f"unknown target(s) {unknown}; choose from {', '.join(TARGETS)}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"target(s) given twice: {repeated}")
    return [TARGETS[n] for n in names]


@dataclass(frozen=True, slots=True)
class Engine:
    url: str  # http://host:port
    events: str | None = None  # ZMQ PUB endpoint as subscribers connect to it
    replay: str | None = None  # ZMQ ROUTER replay endpoint


def parse_engines(urls: Sequence[str], events: Sequence[str]) -> list[Engine]:
    """``--engine-url`` values with their ``--engine-events URL=EVENTS[,REPLAY]``."""
    by_url: dict[str, tuple[str, str | None]] = {}
    for item in events:
        url, sep, endpoints = item.partition("=")
        parts = [p.strip() for p in endpoints.split(",") if p.strip()]
        if not sep or not 1 <= len(parts) <= 2:
            raise ValueError(f"--engine-events {item!r}: expected URL=EVENTS[,REPLAY]")
        if url not in urls:
            raise ValueError(f"--engine-events names {url!r}, which is no --engine-url")
        if not all(p.startswith("tcp://") for p in parts):
            raise ValueError(f"--engine-events {item!r}: endpoints must be tcp://host:port")
        by_url[url] = (parts[0], parts[1] if len(parts) == 2 else None)
    if len(set(urls)) != len(urls):
        raise ValueError("an --engine-url is given twice")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--engine-url {url!r} is not an http(s) URL")
    out = []
    for url in urls:
        ev, replay = by_url.get(url, (None, None))
        out.append(Engine(url.rstrip("/"), ev, replay))
    return out


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What every engine of the fleet reports alike (checked equal across engines)."""

    model: str
    block_size: int
    num_gpu_blocks: int


@dataclass(frozen=True, slots=True)
class FieldOptions:
    targets: tuple[Target, ...] = tuple(TARGETS.values())
    engines: int = 4
    engine_urls: tuple[Engine, ...] = ()  # external engines instead of starting ``engines``
    trace: Path = DEFAULT_TRACE
    limit: int | None = 100
    time_scale: float = 0.1
    speed: float = 1.0
    ttft_slo_s: float = 30.0  # trace time, as kvc bench live and the conductor take it
    tbt_slo_s: float = 0.1
    prompt_format: str = "text"
    profile: str = "llama3-70b-8xa800"
    block_size: int = 512
    num_gpu_blocks: int = 5860
    max_model_len: int = 262_144
    served_model_name: str = "tiny-llama"
    max_running: int = 256
    engine_args: tuple[str, ...] = ()
    live_args: tuple[str, ...] = ()
    conductor_args: tuple[str, ...] = ()
    out: Path = REPO / "bench" / "results" / "field"
    peers_dir: Path = REPO / ".peers"
    startup_timeout_s: float = 300.0
    replay_timeout_s: float = 7200.0

    def __post_init__(self) -> None:
        if not self.engine_urls and self.engines < 1:
            raise ValueError("--engines must be >= 1 (or give --engine-url)")
        if self.time_scale <= 0 or self.speed <= 0:
            raise ValueError("--time-scale and --speed must be > 0")
        if self.limit is not None and self.limit < 1:
            raise ValueError("--limit must be >= 1")
        if self.ttft_slo_s <= 0 or self.tbt_slo_s <= 0:
            raise ValueError("SLOs must be > 0")
        needs_events = [
            t.name for t in self.targets if t.policy == "kv_aware" or t.kind == "conductor"
        ]
        missing = [e.url for e in self.engine_urls if e.events is None]
        if needs_events and missing:
            raise ValueError(
                f"{needs_events} need every engine's KV events: give --engine-events for {missing}"
            )


# ---------------------------------------------------------------- commands (pure)


def kvc(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvc_cli", *args]


def sim_engine_argv(
    opts: FieldOptions, index: int, port: int, events_port: int, replay_port: int
) -> list[str]:
    """``kvc sim-engine``: aggregated, its PUB and replay sockets bound on the ports."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # vLLM's rule: an endpoint with '*' binds, an explicit host connects. Every
        # subscriber here (vllm-router, our agents) connects, so the engine binds.
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": KV_TOPIC,
    }
    return kvc(
        "sim-engine", "--host", HOST, "--port", str(port),
        "--served-model-name", opts.served_model_name, "--engine-id", f"engine-{index}",
        "--profile", opts.profile, "--time-scale", repr(opts.time_scale),
        "--block-size", str(opts.block_size), "--num-gpu-blocks", str(opts.num_gpu_blocks),
        "--max-model-len", str(opts.max_model_len),
        "--kv-events-config", json.dumps(events), *opts.engine_args,
    )  # fmt: skip


def vllm_router_argv(
    exe: Path,
    policy: str,
    port: int,
    metrics_port: int,
    engines: Sequence[Engine],
    info: EngineInfo,
) -> list[str]:
    argv = [
        str(exe), "--host", HOST, "--port", str(port), "--policy", policy,
        "--worker-urls", *(e.url for e in engines),
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
        "--log-level", "warning",
    ]  # fmt: skip
    if policy == "kv_aware":
        for e in engines:
            if e.events is None:
                raise ValueError(f"kv_aware needs the KV events of {e.url}")
            argv += ["--kv-event-source", f"{e.url}={e.events}"]
            if e.replay is not None:
                argv += ["--kv-event-replay-source", f"{e.url}={e.replay}"]
        argv += ["--kv-event-model", info.model, "--kv-event-block-size", str(info.block_size)]
    return argv


def smg_argv(
    exe: Path, policy: str, port: int, metrics_port: int, engines: Sequence[Engine]
) -> list[str]:
    """The flags REFERENCE.md records as working here (explicit host, no tokenizer load)."""
    return [
        str(exe), "launch", "--host", HOST, "--port", str(port), "--policy", policy,
        "--worker-urls", *(e.url for e in engines),
        "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
        "--disable-tokenizer-autoload", "--worker-warmup-secs", "0",
        "--disable-worker-overload-protection", "--shutdown-grace-period-secs", "1",
        "--log-level", "warn",
    ]  # fmt: skip


def agent_argv(opts: FieldOptions, index: int, port: int, engine: Engine) -> list[str]:
    if engine.events is None:
        raise ValueError(f"an agent needs the KV events of {engine.url}")
    return kvc(
        "agent", "--engine", "vllm", "--role", "both", "--host", HOST, "--port", str(port),
        "--stream-port", "0",
        "--node-id", f"engine-{index}", "--served-model-name", opts.served_model_name,
        "--vllm-url", engine.url, "--kv-events-endpoint", engine.events,
        *(("--kv-events-replay-endpoint", engine.replay) if engine.replay else ()),
        "--kv-events-topic", KV_TOPIC, "--max-running", str(opts.max_running),
        "--shutdown-grace-s", "2",
    )  # fmt: skip


def conductor_argv(opts: FieldOptions, policy: str, port: int, agents: Sequence[str]) -> list[str]:
    """SLOs in wall time: the trace's × the time scale (the engines run that much faster)."""
    return kvc(
        "conductor", "--host", HOST, "--port", str(port),
        "--served-model-name", opts.served_model_name, "--agents", ",".join(agents),
        "--policy", policy, "--drain-delay-s", "0",
        "--ttft-slo-s", f"{opts.ttft_slo_s * opts.time_scale:.6g}",
        "--tbt-slo-s", f"{opts.tbt_slo_s * opts.time_scale:.6g}",
        *opts.conductor_args,
    )  # fmt: skip


def live_argv(opts: FieldOptions, url: str, out_dir: Path, run_name: str) -> list[str]:
    return kvc(
        "bench", "live", "--url", url, "--trace", str(opts.trace), "--out", str(out_dir),
        "--name", run_name, "--time-scale", repr(opts.time_scale),
        "--speed", repr(opts.speed), "--prompt-format", opts.prompt_format,
        "--ttft-slo-s", repr(opts.ttft_slo_s), "--tbt-slo-s", repr(opts.tbt_slo_s),
        *(("--limit", str(opts.limit)) if opts.limit is not None else ()),
        "--quiet", *opts.live_args,
    )  # fmt: skip
