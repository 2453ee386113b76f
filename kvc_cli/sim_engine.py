"""``kvc sim-engine``: a simulated vLLM 0.32 engine process (``kvc_sim.vllm_sim``).

It answers vLLM's OpenAI API, keeps vLLM's KV-cache books and publishes vLLM's KV events,
computing no tokens: step times come from a ``kvc_sim`` profile, scaled by
``--time-scale``. Settings are flags and ``KVC_SIM_ENGINE_*`` environment variables
(``SimEngineSettings``); the flags mirror vLLM's (``--block-size``,
``--num-gpu-blocks``, ``--max-model-len``, ``--kv-events-config``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--no-enable-prefix-caching``; ``--num-cpu-blocks`` is the
offloading connector's ``num_cpu_blocks``). docs/fleet.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal

from pydantic import Field, field_validator
from pydantic.config import JsonDict
from pydantic_settings import BaseSettings, SettingsConfigDict

from kvc.models import DEFAULT_MODEL_DIR
from kvc_cli.event_loop import run_event_loop
from kvc_cli.settings_cli import SettingsCommand, settings_from_args

__all__ = ["SimEngineSettings", "register_sim_engine"]

_SERVER: Final[JsonDict] = {"group": "server"}
_CACHE: Final[JsonDict] = {"group": "KV cache"}
_SCHED: Final[JsonDict] = {"group": "scheduling and timing"}
_PD: Final[JsonDict] = {"group": "KV events and prefill/decode"}


class SimEngineSettings(BaseSettings):
    """Settings of ``kvc sim-engine``."""

    model_config = SettingsConfigDict(env_prefix="KVC_SIM_ENGINE_", extra="forbid")

    model_dir: Path = Field(
        DEFAULT_MODEL_DIR,
        description="Model folder: tokenizer, chat template, config.json (no weights read)",
        json_schema_extra=_SERVER,
    )
    served_model_name: str = Field(
        "",
        description="Model name in the API (empty: the folder's name)",
        json_schema_extra=_SERVER,
    )
    host: str = Field("127.0.0.1", description="HTTP bind address", json_schema_extra=_SERVER)
    port: int = Field(8100, ge=0, le=65535, description="HTTP port", json_schema_extra=_SERVER)
    engine_id: str = Field(
        "", description="Engine id in kv_transfer_params (empty: random)", json_schema_extra=_SERVER
    )
    block_size: int = Field(
        16, ge=1, le=4096, description="Tokens per KV block", json_schema_extra=_CACHE
    )
    num_gpu_blocks: int = Field(
        4097,
        ge=2,
        description="KV blocks, vLLM's null block included (usable: one less)",
        json_schema_extra=_CACHE,
    )
    num_cpu_blocks: int = Field(
        0,
        ge=0,
        description=(
            "Host-memory KV blocks (vLLM's OffloadingConnector num_cpu_blocks): every "
            "cached block is copied there, hits are loaded back; 0: no CPU offloading"
        ),
        json_schema_extra=_CACHE,
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="Context limit (default: the model's max_position_embeddings)",
        json_schema_extra=_CACHE,
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse cached full blocks across requests", json_schema_extra=_CACHE
    )
    profile: str = Field(
        "llama3-70b-8xa800",
        description="Timing profile: a bundled kvc_sim profile name or a JSON file",
        json_schema_extra=_SCHED,
    )
    time_scale: float = Field(
        1.0,
        ge=0,
        description="Wall seconds per profile second (0: steps back to back)",
        json_schema_extra=_SCHED,
    )
    max_num_seqs: int = Field(
        256, ge=1, description="Requests running at once", json_schema_extra=_SCHED
    )
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="Token budget per step (default: the profile's prefill chunk_tokens)",
        json_schema_extra=_SCHED,
    )
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description=(
            "vLLM's --scheduling-policy: fcfs (a request's priority must be 0) or priority "
            "(waiting requests by priority, lower first, then arrival)"
        ),
        json_schema_extra=_SCHED,
    )
    kv_events_config: str = Field(
        "",
        description="vLLM's --kv-events-config JSON (empty: no KV events)",
        json_schema_extra=_PD,
    )
    side_channel_host: str = Field(
        "",
        description="Host decode engines pull prefill KV from (empty: --host, or 127.0.0.1)",
        json_schema_extra=_PD,
    )
    kv_transfer_timeout_s: float = Field(
        480.0,
        gt=0,
        description="Prefill KV kept this long for a decode engine to pull",
        json_schema_extra=_PD,
    )

    @field_validator("kv_events_config")
    @classmethod
    def _json(cls, value: str) -> str:
        if value.strip():
            json.loads(value)  # a JSON error becomes a settings error naming the flag
        return value


def _run(ns: argparse.Namespace, log_level: str) -> int:
    from kvc_sim.profile import SimConfigError, load_profile
    from kvc_sim.vllm_sim.config import KvEventsConfig, SimEngineConfig, SimEngineConfigError

    settings = settings_from_args(SimEngineSettings, ns)
    try:
        profile = load_profile(settings.profile)
        events = KvEventsConfig.from_json(settings.kv_events_config)
        config = SimEngineConfig(
            model_dir=settings.model_dir,
            served_model_name=settings.served_model_name or settings.model_dir.name,
            max_model_len=settings.max_model_len or _model_max_len(settings.model_dir),
            block_size=settings.block_size,
            num_gpu_blocks=settings.num_gpu_blocks,
            num_cpu_blocks=settings.num_cpu_blocks,
            enable_prefix_caching=settings.enable_prefix_caching,
            max_num_seqs=settings.max_num_seqs,
            scheduling_policy=settings.scheduling_policy,
            max_num_batched_tokens=(
                settings.max_num_batched_tokens or profile.prefill.chunk_tokens
            ),
            time_scale=settings.time_scale,
            engine_id=settings.engine_id or f"sim-{uuid.uuid4().hex[:12]}",
            side_channel_host=settings.side_channel_host or _reachable(settings.host),
            kv_transfer_timeout_s=settings.kv_transfer_timeout_s,
            kv_events=events,
        )
    except (SimConfigError, SimEngineConfigError, OSError, ValueError) as exc:
        print(f"kvc sim-engine: {exc}", file=sys.stderr)
        return 2
    if events.publishes:
        try:
            import msgpack  # noqa: F401
            import zmq  # noqa: F401
        except ImportError:
            print(
                "kvc sim-engine: KV events need pyzmq and msgpack: "
                "pip install 'kv-conductor[vllm]'",
                file=sys.stderr,
            )
            return 1
    import uvicorn

    from kvc_sim.vllm_sim.server import create_app

    app = create_app(config, profile)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=settings.host, port=settings.port, log_level=log_level.lower(),
            access_log=False,
        )
    )  # fmt: skip
    run_event_loop(server.serve())  # uvloop, as vLLM's server runs on (uvicorn's default)
    return 0


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


def _model_max_len(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config", config)
    return int(text.get("max_position_embeddings", 2048))


def register_sim_engine(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add ``kvc sim-engine`` with ``build_parser``'s ``command`` helper."""
    parser = command("sim-engine", "run a simulated vLLM engine (timing from a kvc_sim profile)")
    parser.set_defaults(func=_run, settings_command=SettingsCommand(parser, SimEngineSettings))
