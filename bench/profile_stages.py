"""Thread-time accounts of named stages of a running conductor or agent (for
``bench.request_profile``).

A process started with ``bench/profile_site`` on its ``PYTHONPATH`` and
``KVC_PROFILE_OUT`` naming a folder loads this module at start-up (``sitecustomize``)
and wraps the stages below: a call's CPU time on its thread (``time.thread_time``) is
added to its stage while accounting is on. SIGUSR1 turns accounting on (from zero) and
writes ``<pid>.started``; SIGUSR2 turns it off and writes ``<pid>.json``: the main
thread's CPU seconds meanwhile and, per stage, calls and seconds. Stages are wrapped at
the first SIGUSR1, so only calls begun after it are seen (not, say, a stream's loop that
began at connection).

What a stage's seconds mean: a plain function's, its whole call; a coroutine's or an
async generator's, the sum of its steps (each resumption until it suspends), so what it
awaits runs inside it and what it waits for does not. Stages nest (``decide`` within
``Dispatcher.start``): inclusive figures, not a partition. The wrappers cost a few
microseconds per call, so absolute figures are slightly high.

Why not a sampling profiler: on a 2-core machine shared by the client, the engines, the
agents and the conductor, a wall-clock sampler charges a thread for the time it waits
to be scheduled back after a syscall, and cProfile inflates call-heavy code severalfold;
thread time charges only what the thread ran.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final

__all__ = ["AGENT_STAGES", "CONDUCTOR_STAGES", "Accounts", "Stage", "install", "role_of"]


@dataclass(frozen=True, slots=True)
class Stage:
    label: str
    module: str
    owner: str  # a class in ``module``, or "" for a module-level function
    name: str


CONDUCTOR_STAGES: Final = (
    Stage("app (request context inclusive)", "conductor.app", "RequestContextMiddleware",
          "__call__"),
    Stage("start_chat", "conductor.api.openai", "", "start_chat"),
    Stage("tokenize", "kvc.tokenization", "ChatTokenizer", "chat_token_ids"),
    Stage("Dispatcher.start", "conductor.dispatch", "Dispatcher", "start"),
    Stage("decide", "conductor.core.placement", "RequestPlacement", "decide"),
    Stage("Dispatcher._attempt", "conductor.dispatch", "Dispatcher", "_attempt"),
    Stage("token stream read", "conductor.adapters.token_stream", "StreamCall", "read"),
    Stage("SSE response", "conductor.api.sse", "GenerationResponse", "__call__"),
    Stage("shadow apply", "conductor.adapters.shadow", "ShadowSync", "_apply"),
    Stage("prefix index apply", "conductor.core.prefix_index", "PrefixIndex", "apply"),
    Stage("fleet view", "conductor.dispatch", "Dispatcher", "node_states"),
    Stage("account close", "conductor.api.accounting", "RequestAccount", "close"),
)  # fmt: skip

AGENT_STAGES: Final = (
    Stage("token stream serve (inclusive)", "node_agent.token_stream", "_Connection", "_serve"),
    Stage("fused generate", "node_agent.server", "NodeAgentService", "_generate_in_tx"),
    Stage("vLLM adapter generate", "node_agent.engines.vllm.adapter", "VllmEngineAdapter",
          "generate"),
    Stage("adapter step (detokenize, stops)", "node_agent.engines.vllm.adapter",
          "VllmEngineAdapter", "_step"),
    Stage("tx allocate", "node_agent.blocks.pool", "BlockPool", "tx_allocate"),
    Stage("tx commit", "node_agent.blocks.pool", "BlockPool", "tx_commit"),
    Stage("KV events batch", "node_agent.engines.vllm.events", "KvEventSubscriber",
          "_on_batch"),
    Stage("KV events decode", "node_agent.engines.vllm.events", "KvEventDecoder", "decode"),
    Stage("pool events published", "node_agent.event_stream", "EventPublisher",
          "publish_pool_events"),
)  # fmt: skip


@dataclass(slots=True)
class Accounts:
    """Calls and thread seconds per stage, while ``on``."""

    on: bool = False
    calls: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, label: str, seconds: float) -> None:
        self.calls[label] = self.calls.get(label, 0) + 1
        self.seconds[label] = self.seconds.get(label, 0.0) + seconds

    def clear(self) -> None:
        self.calls.clear()
        self.seconds.clear()


class _Steps:
    """Awaits ``coro``, adding the thread time of each of its steps to ``label``."""

    __slots__ = ("_accounts", "_coro", "_label")

    def __init__(self, coro: Any, label: str, accounts: Accounts) -> None:
        self._coro, self._label, self._accounts = coro, label, accounts

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, accounts = self._coro, self._accounts
        counted = accounts.on
        spent = 0.0
        value: Any = None
        error: BaseException | None = None
        try:
            while True:
                started = time.thread_time()
                try:
                    yielded = coro.send(value) if error is None else coro.throw(error)
                except StopIteration as stop:
                    return stop.value
                finally:
                    spent += time.thread_time() - started
                try:
                    value, error = (yield yielded), None
                except BaseException as exc:  # thrown in (cancellation): pass it on
                    value, error = None, exc
        finally:
            if counted:
                accounts.add(self._label, spent)


def _wrapped(function: Any, label: str, accounts: Accounts) -> Any:
    if inspect.isasyncgenfunction(function):

        @functools.wraps(function)
        async def generator(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
            inner = function(*args, **kwargs)
            try:
                while True:
                    try:
                        item = await _Steps(inner.__anext__(), label, accounts)
                    except StopAsyncIteration:
                        return
                    yield item
            finally:
                await inner.aclose()

        return generator
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def coroutine(*args: Any, **kwargs: Any) -> Any:
            return await _Steps(function(*args, **kwargs), label, accounts)

        return coroutine

    @functools.wraps(function)
    def plain(*args: Any, **kwargs: Any) -> Any:
        if not accounts.on:
            return function(*args, **kwargs)
        started = time.thread_time()
        try:
            return function(*args, **kwargs)
        finally:
            accounts.add(label, time.thread_time() - started)

    return plain


def wrap_stages(stages: tuple[Stage, ...], accounts: Accounts) -> list[str]:
    """Wrap each stage found; the labels of those not found (renamed code)."""
    missing: list[str] = []
    for stage in stages:
        try:
            module = importlib.import_module(stage.module)
            owner: Any = getattr(module, stage.owner) if stage.owner else module
            function = inspect.getattr_static(owner, stage.name)
        except (ImportError, AttributeError):
            missing.append(stage.label)
            continue
        setattr(owner, stage.name, _wrapped(function, stage.label, accounts))
        if not stage.owner:  # modules that imported the function by name
            for other in list(sys.modules.values()):
                if getattr(other, stage.name, None) is function:
                    setattr(other, stage.name, getattr(owner, stage.name))
    return missing


def _write_atomically(path: Path, text: str) -> None:
    """``path`` appears whole or not at all (its reader polls for it)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def role_of(argv: list[str]) -> str | None:
    """``conductor`` or ``agent`` for a ``kvc`` service's command line, else None."""
    for role in ("conductor", "agent"):
        if role in argv[1:]:
            return role
    return None


def install() -> None:
    """Set up accounting in this process (from ``sitecustomize``): the stages are wrapped
    at SIGUSR1, once the service has imported its modules."""
    out = os.environ.get("KVC_PROFILE_OUT")
    role = role_of(list(sys.orig_argv))
    if not out or role is None:
        return
    stages = CONDUCTOR_STAGES if role == "conductor" else AGENT_STAGES
    accounts = Accounts()
    state: dict[str, Any] = {"wrapped": False, "missing": [], "started": 0.0}

    def start(signum: int, frame: FrameType | None) -> None:
        if not state["wrapped"]:
            state["missing"] = wrap_stages(stages, accounts)
            state["wrapped"] = True
        accounts.clear()
        accounts.on = True
        state["started"] = time.thread_time()
        _write_atomically(Path(out, f"{os.getpid()}.started"), "")

    def stop(signum: int, frame: FrameType | None) -> None:
        accounts.on = False
        report = {
            "role": role,
            "pid": os.getpid(),
            "main_thread_s": time.thread_time() - state["started"],
            "missing": state["missing"],
            "stages": {
                label: {"calls": accounts.calls[label], "seconds": accounts.seconds[label]}
                for label in accounts.calls
            },
        }
        _write_atomically(Path(out, f"{os.getpid()}.json"), json.dumps(report, indent=2))

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
