"""The conductor's HTTP server against slow and greedy clients, on a real socket: a
connection that never completes its headers gets 408 and is closed after
header_timeout_s (uvicorn alone keeps it for ever), an idle kept-alive connection is
not cut by that deadline, and connections beyond max_connections get 503."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import uvicorn

from conductor.app import create_app
from conductor.http_server import uvicorn_config
from conductor.settings import ConductorSettings
from kvc.processes import free_port
from tests.conftest import served, wait_until

GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: conductor\r\n\r\n"


@asynccontextmanager
async def serving(**overrides: Any) -> AsyncIterator[tuple[int, uvicorn.Server]]:
    settings = ConductorSettings(port=free_port(), **overrides)
    async with served(uvicorn_config(settings, create_app(settings), "warning")) as server:
        yield settings.port, server


async def read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout_s)


async def test_headers_that_never_complete_get_408_and_a_closed_connection() -> None:
    async with serving(header_timeout_s=0.5) as (port, _):
        # Silent after connecting; then headers a line at a time, never finished.
        for opening in (b"", b"POST /v1/chat/completions HTTP/1.1\r\nHost: c\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(opening)
            started = time.perf_counter()
            answer = await read_until_closed(reader, 5.0)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b'"code":"request_timeout"' in answer
            assert 0.4 < time.perf_counter() - started < 3.0
            writer.close()


async def test_an_idle_kept_alive_connection_is_not_cut_by_the_header_deadline() -> None:
    async with serving(header_timeout_s=0.3) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(2):
            writer.write(GET_HEALTH)
            status = await asyncio.wait_for(reader.readline(), 5)
            assert status.startswith(b"HTTP/1.1 200"), status
            while (await reader.readline()) not in (b"\r\n", b""):
                pass  # headers
            await reader.readexactly(len(b'{"status":"ok"}'))
            await asyncio.sleep(0.8)  # idle longer than the header deadline
        writer.close()


async def test_connections_beyond_the_cap_get_503() -> None:
    async with serving(header_timeout_s=5.0, max_connections=3) as (port, server):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        await wait_until(lambda: len(server.server_state.connections) == 3)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET_HEALTH)
        status = await asyncio.wait_for(reader.readline(), 5)
        assert status.startswith(b"HTTP/1.1 503"), status
        writer.close()
        for _, w in held:
            w.close()


async def test_the_access_log_is_one_line_per_request_only_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for access_log in (False, True):
        settings = ConductorSettings(port=free_port(), access_log=access_log)
        config = uvicorn_config(settings, create_app(settings), "info")
        async with served(config):
            reader, writer = await asyncio.open_connection("127.0.0.1", settings.port)
            writer.write(GET_HEALTH)
            status = await asyncio.wait_for(reader.readline(), 5)
            assert status.startswith(b"HTTP/1.1 200"), status
            writer.close()
        logged = [line for line in capsys.readouterr().out.splitlines() if "/health" in line]
        assert len(logged) == (1 if access_log else 0), (access_log, logged)
