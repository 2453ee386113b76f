"""The vLLM adapter's streamed completions: the lean client against real sockets on
loopback, server-sent events in batches, and tokens relayed in batches.

Each test runs a small scripted HTTP/1.1 server (``asyncio.start_server``) and runs on
both event loops the agent may use: asyncio's and uvloop's (the agent's default).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import httpx
import pytest
import uvloop

from kvc.models import DEFAULT_MODEL_DIR
from kvc.sampling import Sampling
from kvc.tokenization import ChatTokenizer
from node_agent.engines.base import GenerateJob
from node_agent.engines.vllm.adapter import VllmEngineAdapter
from node_agent.engines.vllm.config import VllmConfig
from node_agent.engines.vllm.http_parsing import sse_payload_batches, sse_payloads
from node_agent.engines.vllm.stream_client import HttpStreamClient, StreamClientError
from node_agent.settings import AgentSettings
from tests.conftest import MODEL, wait_until

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]
LOOPS = ["asyncio", "uvloop"]


def run(loop: str, coro: Coroutine[Any, Any, None]) -> None:
    factory = uvloop.new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(coro)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length)


class Server:
    """Serves each connection with ``handler(reader, writer, connection_number)``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await self.handler(reader, writer, self.connections)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def chunked(*pieces: bytes) -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + b"0\r\n\r\n"


def fixed(status: int, body: bytes, extra: bytes = b"") -> bytes:
    head = b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%s\r\n" % (status, len(body), extra)
    return head + body


@pytest.mark.parametrize("loop", LOOPS)
def test_streams_chunked_sse_and_reuses_the_connection(loop: str) -> None:
    events = [json.dumps({"i": i, "text": "é" * i}).encode() for i in range(5)]
    sse = b"".join(b"data: " + e + b"\r\n\r\n" for e in events) + b"data: [DONE]\n\n"
    # Pieces that split lines (and a UTF-8 character) anywhere.
    pieces = [sse[i : i + 7] for i in range(0, len(sse), 7)]
    seen: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        while True:
            seen.append(await read_request(r))
            w.write(chunked(*pieces))
            await w.drain()

    async def main() -> None:
        server = Server(handler)
        async with server as url:
            client = HttpStreamClient(url)
            for n in range(3):
                body = json.dumps({"n": n}).encode()
                async with client.post("/v1/completions", body, {"X-Request-Id": "r"}) as resp:
                    assert resp.status == 200
                    got = [json.loads(d) async for d in sse_payloads(resp.aiter_bytes())]
                assert got == [json.loads(e) for e in events]
            await client.aclose()
        assert server.connections == 1  # kept alive and reused
        assert seen == [json.dumps({"n": n}).encode() for n in range(3)]

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_an_error_status_hands_over_its_body(loop: str) -> None:
    error = json.dumps({"error": {"message": "too long"}}).encode()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await read_request(r)
        w.write(fixed(400, error))
        await w.drain()
        await r.read()

    async def main() -> None:
        async with Server(handler) as url:
            client = HttpStreamClient(url)
            async with client.post("/x", b"{}", {}) as resp:
                assert resp.status == 400
                assert await resp.aread() == error
            await client.aclose()

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_connection_left_mid_body_is_not_reused(loop: str) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await read_request(r)
        whole = chunked(b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n")
        w.write(whole[:60])  # the first event; the rest would come later
        await w.drain()
        await r.read()  # returns when the client closes it instead of reusing it

    async def main() -> None:
        server = Server(handler)
        async with server as url:
            client = HttpStreamClient(url)
            for _ in range(2):
                async with client.post("/x", b"{}", {}) as resp:
                    async for _data in sse_payloads(resp.aiter_bytes()):
                        break  # the caller stops reading early
            await client.aclose()
        assert server.connections == 2

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_server_that_closes_its_idle_connections_is_followed(loop: str) -> None:
    """The server closes after each response (keep-alive announced, as after an idle
    timeout), or drops the second request on a reused connection unanswered: the client
    goes on with a new connection either way."""

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await read_request(r)
        w.write(fixed(200, b"one"))
        await w.drain()
        if n == 1:
            await read_request(r)  # read the reused request, then drop it unanswered
            return
        w.close()

    async def main() -> None:
        server = Server(handler)
        async with server as url:
            client = HttpStreamClient(url)
            for _ in range(4):
                async with client.post("/x", b"{}", {}) as resp:
                    assert await resp.aread() == b"one"
            await client.aclose()
        assert server.connections >= 3

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_failures_raise_stream_client_error(loop: str) -> None:
    async def cut(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await w.drain()

    async def silent(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await read_request(r)
        await r.read()  # never answers; returns when the client gives up and closes

    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        await read_request(r)
        w.write(b"NOT HTTP AT ALL\r\n\r\n")
        await w.drain()
        await r.read()  # until the client drops the connection

    async def main() -> None:
        async with Server(cut) as url:
            client = HttpStreamClient(url)
            with pytest.raises(StreamClientError, match="closed mid-response"):
                async with client.post("/x", b"{}", {}) as resp:
                    await resp.aread()
        async with Server(silent) as url:
            client = HttpStreamClient(url, read_timeout_s=0.2)
            with pytest.raises(StreamClientError, match="timed out"):
                async with client.post("/x", b"{}", {}) as resp:
                    pass
            await client.aclose()
        async with Server(garbage) as url:
            client = HttpStreamClient(url)
            with pytest.raises(StreamClientError, match="malformed"):
                async with client.post("/x", b"{}", {}) as resp:
                    pass
        port = url.rsplit(":", 1)[1]  # the server is gone: refused
        client = HttpStreamClient(f"http://127.0.0.1:{port}")
        with pytest.raises(StreamClientError, match="cannot connect"):
            async with client.post("/x", b"{}", {}) as resp:
                pass

    run(loop, main())


@pytest.mark.parametrize("loop", LOOPS)
def test_get_reads_a_whole_answer_on_the_pooled_connections(loop: str) -> None:
    """The adapter's metrics poll: GET and the streamed POSTs share one keep-alive
    connection; the status comes back with the body (an error is the caller's to judge);
    a server that never answers times out at the GET's own bound, not the client's."""
    heads: list[bytes] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            heads.append(head.split(b"\r\n")[0])
            if head.startswith(b"POST"):
                await r.readexactly(2)
                w.write(chunked(b"data: 1\n\n", b"data: [DONE]\n\n"))
            elif b"/broken" in head:
                w.write(fixed(503, b"not now"))
            elif b"/silent" in head:
                await r.read()
                return
            else:
                w.write(chunked(b"vllm:num_requests_running 3\n", b"# end\n"))
            await w.drain()

    async def main() -> None:
        server = Server(handler)
        async with server as url:
            client = HttpStreamClient(url, read_timeout_s=600.0)
            assert await client.get("/metrics", 5.0) == (
                200,
                b"vllm:num_requests_running 3\n# end\n",
            )
            async with client.post("/v1/completions", b"{}", {}) as resp:
                assert [d async for d in sse_payloads(resp.aiter_bytes())] == ["1"]
            assert await client.get("/broken", 5.0) == (503, b"not now")
            assert await client.get("/metrics", 5.0) == (
                200,
                b"vllm:num_requests_running 3\n# end\n",
            )
            assert server.connections == 1
            with pytest.raises(StreamClientError, match="timed out"):
                await client.get("/silent", 0.2)
            await client.aclose()
        assert heads == [
            b"GET /metrics HTTP/1.1",
            b"POST /v1/completions HTTP/1.1",
            b"GET /broken HTTP/1.1",
            b"GET /metrics HTTP/1.1",
            b"GET /silent HTTP/1.1",
        ]

    run(loop, main())


async def test_the_metrics_poll_reads_vllm_load_through_the_lean_client() -> None:
    """The adapter polls ``/metrics`` on the lean client's pooled connection (a real
    socket: no stand-in transport); a failed poll (an error status, a malformed sample)
    keeps the last values instead of reporting an idle engine."""
    polls = {"metrics": 0}
    state = {"answer": "ok"}
    good = (
        b'vllm:cache_config_info{block_size="32",num_gpu_blocks="17"} 1.0\n'
        b"# TYPE vllm:num_requests_running gauge\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    )
    models = json.dumps({"data": [{"id": MODEL, "max_model_len": 2048}]}).encode()

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, _: int) -> None:
        while True:
            head = await r.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1]
            if path == b"/metrics":
                polls["metrics"] += 1
                if state["answer"] == "error":
                    w.write(fixed(500, b"oops"))
                elif state["answer"] == "malformed":
                    w.write(fixed(200, b"vllm:num_requests_running\n"))
                else:
                    w.write(fixed(200, good))
            elif path == b"/v1/models":
                w.write(fixed(200, models))
            else:
                w.write(fixed(200, b""))
            await w.drain()

    async with Server(handler) as url:
        settings = AgentSettings(
            port=0, engine="vllm", vllm_url=url, calibrate=False, load_interval_s=0.02
        )
        engine = VllmEngineAdapter(
            VllmConfig.from_settings(settings), ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
        )
        await engine.start()
        try:
            await wait_until(lambda: engine.load().running_requests == 3)
            load = engine.load()
            assert (load.waiting_requests, load.kv_usage_ratio) == (2, 0.5)
            for answer in ("error", "malformed"):
                state["answer"] = answer
                target = polls["metrics"] + 3

                def polled(target: int = target) -> bool:
                    return polls["metrics"] >= target

                await wait_until(polled)
                assert engine.load() == load
        finally:
            await engine.aclose()


def test_only_plain_http_urls_are_taken() -> None:
    with pytest.raises(ValueError, match="http://host:port"):
        HttpStreamClient("https://vllm:8000")


async def _batches(*pieces: bytes) -> list[list[str]]:
    async def chunks() -> AsyncIterator[bytes]:
        for piece in pieces:
            yield piece

    return [batch async for batch in sse_payload_batches(chunks())]


async def test_sse_batches_group_what_arrived_together() -> None:
    assert await _batches(b"data: 1\n\ndata: 2\n\n", b"data:", b" 3\r\n\r\n: note\n") == [
        ["1", "2"],
        ["3"],
    ]
    assert await _batches(b"data: 1\n\ndata: [DONE]\n\ndata: 9\n\n") == [["1"]]
    assert await _batches(b"data: 1\n\ndata: 2") == [["1"], ["2"]]  # no final newline


async def test_sse_batches_close_their_input_when_closed_or_done() -> None:
    closed: list[str] = []

    async def chunks(name: str) -> AsyncIterator[bytes]:
        try:
            yield b"data: 1\n\ndata: [DONE]\n\n"
            yield b"data: never read\n\n"
        finally:
            closed.append(name)

    early = sse_payload_batches(chunks("early"))
    async with contextlib.aclosing(early):
        assert await anext(early) == ["1"]
    assert closed == ["early"]  # at once, not when the loop's finalizer gets to it
    assert [b async for b in sse_payload_batches(chunks("done"))] == [["1"]]
    assert closed == ["early", "done"]


METRICS = (
    '# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="32",'
    'enable_prefix_caching="True",num_gpu_blocks="17"} 1.0\n'
)


async def test_tokens_that_arrive_together_leave_as_one_step() -> None:
    """Five token events and the finish in one piece of body: the adapter relays the
    four tokens as one step (one gRPC message), then the final step; the text is what
    detokenizing token by token gives."""
    tokenizer = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    ids = tokenizer.encode(" hello brave new world again")[:5]
    events: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "token_ids": [t], "finish_reason": None}]} for t in ids
    ]
    events[-1]["choices"][0]["finish_reason"] = "length"
    events.append({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 32}}})
    sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    def vllm(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL, "max_model_len": 2048}]})
        if request.url.path == "/metrics":
            return httpx.Response(200, text=METRICS)
        return httpx.Response(200)

    settings = AgentSettings(port=0, engine="vllm", vllm_url="http://vllm", calibrate=False)
    engine = VllmEngineAdapter(
        VllmConfig.from_settings(settings), tokenizer, transport=httpx.MockTransport(vllm)
    )
    await engine.start()
    try:
        job = GenerateJob(
            request_id="r", prompt_ids=(1, 2, 3), sampling=Sampling(max_tokens=5), prefix_kv=None
        )
        steps = [step async for step in engine.generate(job)]
    finally:
        await engine.aclose()
    assert [s.token_ids for s in steps] == [tuple(ids[:4]), (ids[4],)]
    assert steps[-1].finish_reason == "length"
    assert steps[-1].cached_tokens == 32
    assert "".join(s.text for s in steps) == tokenizer.decode(ids)
