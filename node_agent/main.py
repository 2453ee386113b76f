"""Run one node agent: load the engine, serve gRPC until SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar, cast

from kvc import native
from kvc.tokenization import ChatTokenizer
from node_agent.engines.base import EngineAdapter
from node_agent.errors import EngineError
from node_agent.server import AgentServer
from node_agent.settings import AgentSettings

if TYPE_CHECKING:
    from node_agent.engines.vllm.adapter import VllmEngineAdapter

log = logging.getLogger("node_agent")

T = TypeVar("T")


def _vllm_adapter(engine: EngineAdapter) -> VllmEngineAdapter | None:
    """``engine`` as the vLLM adapter, without importing it (and pyzmq, msgpack) when no
    vLLM adapter was ever built in this process."""
    module = sys.modules.get("node_agent.engines.vllm.adapter")
    if module is None or not isinstance(engine, module.VllmEngineAdapter):
        return None
    return cast("VllmEngineAdapter", engine)


def _missing_extra(extra: str, exc: ImportError) -> EngineError:
    return EngineError(
        f"the {extra} engine needs the [{extra}] extra (pip install 'kv-conductor[{extra}]'): {exc}"
    )


def build_engine(settings: AgentSettings) -> EngineAdapter:
    """The engine adapter the settings name: the embedded transformer, or vLLM."""
    if settings.engine == "vllm":
        try:
            from node_agent.engines.vllm.adapter import VllmEngineAdapter
            from node_agent.engines.vllm.config import VllmConfig
        except ImportError as exc:
            raise _missing_extra("vllm", exc) from exc

        tokenizer = ChatTokenizer.from_dir(settings.model)
        return VllmEngineAdapter(VllmConfig.from_settings(settings), tokenizer)

    try:
        from node_agent.engines.embedded.adapter import EmbeddedEngineAdapter
        from node_agent.engines.embedded.model import EmbeddedModel
    except ImportError as exc:
        raise _missing_extra("embedded", exc) from exc

    model = EmbeddedModel.load(
        settings.model, device=settings.device, threads=settings.threads or None
    )
    tokenizer = ChatTokenizer.from_dir(settings.model)
    return EmbeddedEngineAdapter(
        model,
        tokenizer,
        served_model_name=settings.resolved_served_model_name(),
        max_running=settings.resolved_max_running(),
    )


async def start_engine(engine: EngineAdapter, settings: AgentSettings) -> AgentSettings:
    """Bring up an engine that runs outside the agent (vLLM) and size the pool to it.

    The pool's block size and capacity become the engine's own, so a TxAllocate
    refuses what the engine cannot hold. Other engines need nothing: ``settings``.
    """
    vllm = _vllm_adapter(engine)
    if vllm is None:
        return settings
    geometry = await vllm.start()
    if (geometry.block_size, geometry.capacity_blocks) != (
        settings.block_size,
        settings.capacity_blocks,
    ):
        log.info(
            "block pool follows vLLM: %d blocks of %d tokens",
            geometry.capacity_blocks,
            geometry.block_size,
        )
    return settings.model_copy(
        update={"block_size": geometry.block_size, "capacity_blocks": geometry.capacity_blocks}
    )


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``work``'s result, or None (``work`` cancelled) when ``stop`` is set first."""
    task = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _stop_when_engine_fails(engine: EngineAdapter, stop: asyncio.Event) -> str:
    """An agent without its engine has nothing to serve: a launched vLLM that exits
    stops the agent too, which then exits non-zero (its supervisor restarts both)."""
    vllm = _vllm_adapter(engine)
    if vllm is None:
        await stop.wait()
        return ""
    reason = await vllm.wait_failed()
    log.error("%s: stopping the agent", reason)
    stop.set()
    return reason


async def serve(settings: AgentSettings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    native.log_if_missing(log)
    engine = await asyncio.to_thread(build_engine, settings)
    try:
        started = await _unless_stopped(start_engine(engine, settings), stop)
    except BaseException:
        await engine.aclose()
        raise
    if started is None:  # SIGTERM while the engine was starting
        await engine.aclose()
        return
    settings = started
    server = AgentServer(settings, engine)
    await server.start()
    watch = asyncio.create_task(_stop_when_engine_fails(engine, stop))
    await stop.wait()
    failure = watch.result() if watch.done() else ""
    watch.cancel()
    log.info("node agent draining (up to %.0f s), then stopping", settings.shutdown_grace_s)
    await server.drain_and_stop(grace_s=settings.shutdown_grace_s)
    if failure:
        raise EngineError(failure)
