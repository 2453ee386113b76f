"""Run one node agent: load the engine, serve gRPC until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from kvc.tokenization import ChatTokenizer
from node_agent.engines.base import EngineAdapter
from node_agent.server import AgentServer
from node_agent.settings import AgentSettings

log = logging.getLogger("node_agent")


def build_engine(settings: AgentSettings) -> EngineAdapter:
    """The engine adapter the settings name (the embedded transformer for now)."""
    from node_agent.engines.embedded import EmbeddedModel
    from node_agent.engines.embedded_adapter import EmbeddedEngineAdapter

    model = EmbeddedModel.load(
        settings.model, device=settings.device, threads=settings.threads or None
    )
    tokenizer = ChatTokenizer.from_dir(settings.model)
    return EmbeddedEngineAdapter(
        model,
        tokenizer,
        served_model_name=settings.resolved_served_model_name(),
        max_running=settings.max_running,
    )


async def serve(settings: AgentSettings) -> None:
    engine = await asyncio.to_thread(build_engine, settings)
    server = AgentServer(settings, engine)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("node agent stopping")
    await server.stop(grace_s=5.0)
