"""vLLM prefill/decode through ``kv_transfer_params`` (``pd_connector=nixl``), end to end
from the conductor through two real agents, with stand-in vLLM HTTP servers.

A real NIXL hand-off needs GPUs (docs/engines.md); what is checked here is everything
this project does around it: the prefill leg (``do_remote_decode``, ``max_tokens=1``,
no streaming), the engine's transfer parameters carried from the prefill agent through
the conductor to the decode agent and into the decode request, one ``X-Request-Id`` on
both legs, the tenant as ``cache_salt`` on both, nothing staged for ``FetchKv``, and
the Tx on the prefill agent committed. Without the switch a vLLM node refuses a
separate Prefill.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any, cast

import grpc
import httpx
import pytest
from openai import AsyncOpenAI

from kvc.models import DEFAULT_MODEL_DIR
from kvc.roles import NodeRole
from kvc.tokenization import ChatTokenizer
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from node_agent.engines.vllm.adapter import VllmEngineAdapter
from node_agent.engines.vllm.config import VllmConfig
from node_agent.main import start_engine
from node_agent.server import AgentServer
from node_agent.settings import AgentSettings
from tests.conftest import (
    ConductorFactory,
    assert_no_locks,
    chat_body,
    tool_result_turns,
    wait_until,
)

MODEL = "tiny-llama"
TRANSFER = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2, 3],
    "remote_engine_id": "prefill-engine-0",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
}
METRICS = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="129"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny-llama"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny-llama"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.25
"""


class StandInVllm:
    """Answers like vLLM 0.32's OpenAI server does for the calls the adapter makes."""

    def __init__(self) -> None:
        self.completions: list[tuple[str, dict[str, Any]]] = []
        self.fail_with: httpx.HTTPError | None = None  # raised by the next completion
        self.replies: list[list[int]] = []  # token ids the next streams answer, in order
        self.event_per_read = False  # stream each SSE event as its own read, as tokens come
        self.raw_prefill: bytes | None = None  # the next prefill answer's body, verbatim
        self.raw_stream: bytes | None = None  # the next stream's body, verbatim

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL, "max_model_len": 2048}]})
        if path == "/metrics":
            return httpx.Response(200, text=METRICS)
        assert path == "/v1/completions", path
        if self.fail_with is not None:
            error, self.fail_with = self.fail_with, None
            raise error
        body = json.loads(request.content)
        self.completions.append((request.headers.get("x-request-id", ""), body))
        if not body["stream"] and self.raw_prefill is not None:
            raw, self.raw_prefill = self.raw_prefill, None
            return httpx.Response(200, content=raw, headers={"content-type": "application/json"})
        if body["stream"] and self.raw_stream is not None:
            raw, self.raw_stream = self.raw_stream, None
            return httpx.Response(200, content=raw, headers={"content-type": "text/event-stream"})
        if not body["stream"]:  # the prefill leg
            return httpx.Response(
                200,
                json={
                    "choices": [
                        {"index": 0, "text": "", "token_ids": [42], "finish_reason": "length"}
                    ],
                    "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1},
                    "kv_transfer_params": TRANSFER,
                },
            )
        events: list[dict[str, Any]] = []
        n = body["max_tokens"]
        ids = self.replies.pop(0)[:n] if self.replies else [300 + i for i in range(n)]
        last = "stop" if len(ids) < n else "length"
        for i, token in enumerate(ids):
            choice: dict[str, Any] = {"index": 0, "text": "", "token_ids": [token]}
            choice["finish_reason"] = last if i == len(ids) - 1 else None
            if body.get("logprobs") is not None:  # vLLM adds the sampled token's own
                top = {f"token_id:{7 + k}": -1.0 - k for k in range(body["logprobs"])}
                choice["logprobs"] = {
                    "text_offset": [0],
                    "tokens": [f"token_id:{token}"],
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{**top, f"token_id:{token}": -0.5}],
                }
            events.append({"choices": [choice]})
        n = len(ids)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        events.append(
            {"choices": [], "usage": {**usage, "prompt_tokens_details": {"cached_tokens": 64}}}
        )
        reads = [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]
        headers = {"content-type": "text/event-stream"}
        if self.event_per_read:
            return httpx.Response(200, stream=_Reads(reads), headers=headers)
        return httpx.Response(200, content=b"".join(reads), headers=headers)


class _Reads(httpx.AsyncByteStream):
    """A body that arrives in the given pieces, one read each."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self._pieces:
            yield piece


@pytest.fixture
async def vllm_agents() -> AsyncIterator[tuple[list[AgentServer], list[StandInVllm]]]:
    agents: list[AgentServer] = []
    fakes: list[StandInVllm] = []

    async def start(role: NodeRole, pd_connector: str) -> None:
        settings = AgentSettings(
            role=role,
            port=0,
            engine="vllm",
            vllm_url=f"http://vllm-{role}",
            pd_connector=pd_connector,
            load_interval_s=0.05,
            calibrate=False,  # the stand-in records every completion it answers
        )
        fake = StandInVllm()
        engine = VllmEngineAdapter(
            VllmConfig.from_settings(settings),
            ChatTokenizer.from_dir(DEFAULT_MODEL_DIR),
            transport=httpx.MockTransport(fake),
        )
        settings = await start_engine(engine, settings)
        server = AgentServer(settings, engine)
        await server.start()
        agents.append(server)
        fakes.append(fake)

    await start("prefill", "nixl")
    await start("decode", "nixl")
    await start("both", "none")
    yield agents, fakes
    for server in agents:
        await server.stop(grace_s=0.5)


def _kv_usage_is(agent: AgentServer, ratio: float) -> bool:
    return agent.service.load_update().kv_usage_ratio == ratio


async def test_pool_takes_vllms_geometry(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]],
) -> None:
    agents, _ = vllm_agents
    for agent in agents:
        info = agent.service.node_info
        assert (info.engine, info.block_size, info.capacity_blocks) == ("vllm", 32, 128)
        assert agent.service.pool.capacity_blocks == 128  # vLLM keeps one null block
        # vLLM's own KV usage (polled from /metrics) reaches the load updates.
        await wait_until(partial(_kv_usage_is, agent, 0.25))


async def test_disaggregated_request_carries_kv_transfer_params(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]], conductor: ConductorFactory
) -> None:
    (prefill, decode, _), (p_vllm, d_vllm, _) = vllm_agents
    async with conductor([prefill, decode], api_keys=["k1"]) as c:
        prompt = " ".join(f"word{i}" for i in range(120))
        r = await c.client.post(
            "/v1/chat/completions",
            json=chat_body(prompt, max_tokens=5),
            headers={"Authorization": "Bearer k1"},
        )
        assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    (p_id, p_body), (d_id, d_body) = p_vllm.completions[-1], d_vllm.completions[-1]
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True
    assert (p_body["max_tokens"], p_body["stream"]) == (1, False)
    # The prefill leg's token is not read: no prompt echo for it to carry back.
    assert (p_body["return_token_ids"], d_body["return_token_ids"]) == (False, True)
    assert d_body["kv_transfer_params"] == TRANSFER
    assert d_body["stream"] is True
    assert p_id == d_id != ""
    assert p_body["prompt"] == d_body["prompt"]
    assert p_body["cache_salt"] == d_body["cache_salt"]
    assert len(prefill.service.staging) == 0  # nothing waits for a FetchKv
    assert_no_locks(prefill, decode)
    assert prefill.service.pool.stats().cached_blocks > 0  # the Tx was committed


async def test_without_the_switch_a_vllm_node_refuses_prefill(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]],
) -> None:
    *_, both = vllm_agents[0]
    async with grpc.aio.insecure_channel(both.address) as channel:
        stub = pb_grpc.NodeAgentStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as exc:
            await stub.Prefill(
                pb.PrefillRequest(request_id="r1", tenant="t", prompt_token_ids=[5, 6, 7])
            )
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "pd_connector" in (exc.value.details() or "")


async def _short_chat(
    conductor: ConductorFactory, prefill: AgentServer, decode: AgentServer
) -> httpx.Response:
    """A short chat completion through a conductor in front of ``prefill`` and ``decode``."""
    async with conductor([prefill, decode], api_keys=["k1"]) as c:
        return await c.client.post(
            "/v1/chat/completions",
            json=chat_body("one two three four five six seven", max_tokens=3),
            headers={"Authorization": "Bearer k1"},
        )


async def test_a_connection_lost_under_a_prefill_is_named_and_frees_the_blocks(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]], conductor: ConductorFactory
) -> None:
    """httpx's ReadError (the engine closed the connection) has an empty message: the
    client is told its type, gets a 502, and nothing stays locked."""
    (prefill, decode, _), (p_vllm, _, _) = vllm_agents
    p_vllm.fail_with = httpx.ReadError("")
    r = await _short_chat(conductor, prefill, decode)
    assert r.status_code == 502, r.text
    assert "vLLM request failed: ReadError" in r.json()["error"]["message"]
    assert_no_locks(prefill, decode)


@pytest.mark.parametrize(
    ("leg", "raw", "expected"),
    [
        ("prefill", b"<html>bad gateway</html>", "not JSON"),
        ("prefill", b"[1, 2]", "not a JSON object: list"),
        ("prefill", b'{"usage": "none"}', "no kv_transfer_params"),
        ("decode", b"data: [1, 2]\n\ndata: [DONE]\n\n", "not a JSON object: list"),
        ("decode", b"data: {oops\n\ndata: [DONE]\n\n", "not JSON"),
        ("decode", b'data: {"choices": "abc"}\n\ndata: [DONE]\n\n', "choices are not JSON"),
    ],
)
async def test_a_malformed_200_from_vllm_is_a_named_502_and_frees_the_blocks(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]],
    conductor: ConductorFactory,
    leg: str,
    raw: bytes,
    expected: str,
) -> None:
    """An engine (or a proxy in front of it) that answers 200 with a body that is not
    vLLM's: the client gets a 502 that says what was wrong, never a 500."""
    (prefill, decode, _), (p_vllm, d_vllm, _) = vllm_agents
    if leg == "prefill":
        p_vllm.raw_prefill = raw
    else:
        d_vllm.raw_stream = raw
    r = await _short_chat(conductor, prefill, decode)
    assert r.status_code == 502, r.text
    assert expected in r.json()["error"]["message"]
    assert_no_locks(prefill, decode)


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
SCHEMA = {
    "name": "answer",
    "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
}

# Every OpenAI sampling parameter either reaches vLLM's request body, as vLLM spells it,
# or is refused with 422 naming it: none is accepted and dropped. Values are exact in
# float32 (the wire's type), so they arrive unchanged.
HONOURED: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    (
        "chat",
        {"logprobs": True, "top_logprobs": 2},
        {"logprobs": 2, "return_tokens_as_token_ids": True},
    ),
    ("chat", {"logprobs": True}, {"logprobs": 0}),
    ("completions", {"logprobs": 3}, {"logprobs": 3, "return_tokens_as_token_ids": True}),
    ("chat", {"temperature": 0.25}, {"temperature": 0.25}),
    ("chat", {"top_p": 0.5}, {"top_p": 0.5}),
    ("chat", {"max_tokens": 3}, {"max_tokens": 3}),
    ("chat", {"max_completion_tokens": 4, "max_tokens": 9}, {"max_tokens": 4}),
    ("chat", {"seed": 7}, {"seed": 7}),
    ("chat", {"stop": ["zz", "yy"]}, {"stop": ["zz", "yy"]}),
    ("chat", {"frequency_penalty": 0.5}, {"frequency_penalty": 0.5}),
    ("chat", {"presence_penalty": -1.5}, {"presence_penalty": -1.5}),
    ("chat", {"logit_bias": {"5": 3, "17": -100}}, {"logit_bias": {"5": 3.0, "17": -100.0}}),
    ("chat", {"ignore_eos": True}, {"ignore_eos": True}),
    ("chat", {"tools": TOOLS, "tool_choice": "none"}, {}),  # shown to the model, no calls
    # The demo template writes Hermes-style calls: its parser reads them (none here).
    ("chat", {"tools": TOOLS}, {}),
    ("chat", {"tools": TOOLS, "tool_choice": "auto"}, {}),
    ("chat", {"response_format": {"type": "text"}}, {}),
    (
        "chat",
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_object"}},
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": SCHEMA}},
        {"response_format": {"type": "json_schema", "json_schema": SCHEMA}},
    ),
    ("chat", {"parallel_tool_calls": False}, {}),  # vacuous: no call is ever made
    ("completions", {"frequency_penalty": -0.5}, {"frequency_penalty": -0.5}),
    ("completions", {"presence_penalty": 2}, {"presence_penalty": 2.0}),
    ("completions", {"logit_bias": {"9": 0.5}}, {"logit_bias": {"9": 0.5}}),
    ("completions", {"seed": 3, "stop": "q"}, {"seed": 3, "stop": ["q"]}),
    ("completions", {"best_of": 1}, {}),
    ("completions", {"best_of": 2}, {"logprobs": 0}),  # ranked by the tokens' logprobs
    ("completions", {"echo": True}, {}),  # the conductor leads with the prompt's text
    ("chat", {"top_k": 5, "min_p": 0.25}, {"top_k": 5, "min_p": 0.25}),
    ("chat", {"top_k": -1}, {}),  # vLLM's "off"
    (
        "completions",
        {"min_tokens": 2, "stop_token_ids": [7, 9]},
        {"min_tokens": 2, "stop_token_ids": [7, 9]},
    ),
    (
        "completions",
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_object"}},
    ),
]
REFUSED: list[tuple[str, dict[str, Any], int, str]] = [
    ("chat", {"n": 17}, 422, "n"),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        400,
        "response_format.json_schema",
    ),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        400,
        "response_format.json_schema.schema",
    ),
    ("chat", {"response_format": {"type": "yaml"}}, 400, "response_format"),
    (
        "chat",
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
        400,
        "tool_choice",
    ),
    (
        "chat",
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        400,
        "tool_choice",
    ),
    ("chat", {"tools": [{"type": "function"}]}, 400, "tools[0]"),
    ("chat", {"tool_choice": "auto"}, 400, "tool_choice"),
    ("chat", {"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("chat", {"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("chat", {"logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ("chat", {"frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("completions", {"best_of": 20}, 422, "best_of"),
    ("completions", {"best_of": 1, "n": 2}, 400, "best_of"),
    ("completions", {"best_of": 2, "stream": True}, 400, "best_of"),
    ("chat", {"top_k": -2}, 400, "top_k"),
    ("chat", {"min_p": 1.5}, 400, "min_p"),
    ("completions", {"stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ("completions", {"min_tokens": 3, "max_tokens": 2}, 400, "min_tokens"),
    ("completions", {"response_format": {"type": "xml"}}, 400, "response_format"),
    ("completions", {"suffix": "tail"}, 422, "suffix"),
    ("completions", {"echo": True, "logprobs": 1}, 422, "echo"),
    ("completions", {"logprobs": 6}, 400, "logprobs"),  # OpenAI's bound: 5
    ("completions", {"n": 20}, 422, "n"),
]


def _request(route: str, fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if route == "chat":
        base = chat_body("one two three four", max_tokens=2)
        if "max_completion_tokens" in fields:
            del base["max_tokens"]
        return "/v1/chat/completions", {**base, **fields}
    body = {"model": MODEL, "prompt": "one two three four", "max_tokens": 2, **fields}
    return "/v1/completions", body


@pytest.mark.parametrize(
    ("route", "fields", "expected"),
    HONOURED,
    ids=[f"{r}-{','.join(f)}" for r, f, _ in HONOURED],
)
async def test_each_parameter_reaches_vllm(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]],
    conductor: ConductorFactory,
    route: str,
    fields: dict[str, Any],
    expected: dict[str, Any],
) -> None:
    (*_, both), (*_, engine) = vllm_agents
    path, body = _request(route, fields)
    async with conductor([both]) as c:
        r = await c.client.post(path, json=body)
    assert r.status_code == 200, r.text
    _, sent = engine.completions[-1]
    for name, value in expected.items():
        assert sent.get(name) == value, (name, sent)
    for name in (
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "seed",
        "stop",
        "response_format",
    ):
        if name not in expected:
            assert name not in sent, (name, sent)  # vLLM's default: not spelled out
    assert_no_locks(both)


@pytest.mark.parametrize(
    ("route", "fields", "status", "param"),
    REFUSED,
    ids=[f"{r}-{','.join(f)}-{s}" for r, f, s, _ in REFUSED],
)
async def test_each_parameter_that_cannot_be_honoured_is_refused(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]],
    conductor: ConductorFactory,
    route: str,
    fields: dict[str, Any],
    status: int,
    param: str,
) -> None:
    (*_, both), (*_, engine) = vllm_agents
    path, body = _request(route, fields)
    async with conductor([both]) as c:
        r = await c.client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["code"] == ("unsupported_value" if status == 422 else error["code"])
    assert engine.completions == []  # refused before any engine work
    assert_no_locks(both)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


async def test_a_function_calling_loop_with_the_openai_sdk(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]], conductor: ConductorFactory
) -> None:
    """The model (a stand-in vLLM streaming the token ids of Hermes-style text) calls a
    tool; the official SDK sees ``tool_calls`` and ``finish_reason: "tool_calls"``,
    streamed and not; the tool's result goes back and the final answer is content."""
    (*_, both), (*_, engine) = vllm_agents
    tok = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    call_text = (
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    async with conductor([both], tool_call_parser="hermes") as c:
        # The SDK types its own httpx fork; httpx's client, which this test's ASGI transport
        # needs, serves it the same.
        transport: Any = c.client
        client = AsyncOpenAI(
            base_url="http://conductor/v1", api_key="unused", http_client=transport
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]

        async def ask(stream: bool = False) -> Any:
            return await client.chat.completions.create(
                model=MODEL,
                messages=cast(Any, messages),
                tools=cast(Any, [WEATHER_TOOL]),
                max_tokens=64,
                stream=stream,
            )

        engine.replies.append(tok.encode(call_text))
        reply = await ask()
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        (call,) = choice.message.tool_calls or []
        assert call.type == "function"
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Oslo"}
        assert call.id.startswith("call_")

        # Streamed with the tokens arriving one by one, as a real engine sends them: the
        # call's arguments come fragment by fragment, as OpenAI streams them.
        engine.replies.append(tok.encode(call_text))
        engine.event_per_read = True
        stream = await ask(stream=True)
        text, finish = "", None
        streamed: dict[int, dict[str, str]] = {}
        fragments = 0
        async for chunk in stream:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                for part in ch.delta.tool_calls or []:
                    entry = streamed.setdefault(part.index, {"name": "", "arguments": ""})
                    if part.function is not None:
                        entry["name"] += part.function.name or ""
                        entry["arguments"] += part.function.arguments or ""
                        fragments += bool(part.function.arguments)
                finish = ch.finish_reason or finish
        engine.event_per_read = False
        assert finish == "tool_calls"
        assert text == "Checking."
        assert list(streamed) == [0]
        assert streamed[0]["name"] == "get_weather"
        assert json.loads(streamed[0]["arguments"]) == {"city": "Oslo"}
        assert fragments > 2

        # Cut by max_tokens inside the arguments: the streamed call ends with what was
        # written and the finish reason says so.
        ids = tok.encode(call_text)
        cut_at = next(n for n in range(len(ids)) if tok.decode(ids[:n]).endswith('"Os'))
        engine.replies.append(ids)
        r = await c.client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL],
                  "max_tokens": cut_at, "stream": True},
        )  # fmt: skip
        events = [
            json.loads(b[len("data: ") :]) for b in r.text.split("\n\n") if b.startswith("data: {")
        ]
        deltas = [e["choices"][0] for e in events if e["choices"]]
        arguments = "".join(
            t["function"]["arguments"] for d in deltas for t in d["delta"].get("tool_calls", [])
        )
        assert arguments == '{"city": "Os'
        assert deltas[-1]["finish_reason"] == "length"

        messages += tool_result_turns(
            call.id, "get_weather", call.function.arguments, '{"sky": "clear", "c": 21}'
        )
        engine.replies.append(tok.encode("Clear sky, 21 degrees."))
        final = await ask()
        assert final.choices[0].finish_reason == "stop"
        assert final.choices[0].message.content == "Clear sky, 21 degrees."
        assert final.choices[0].message.tool_calls is None
        # The tool's result reached the prompt the engine saw.
        _, sent = engine.completions[-1]
        assert "clear" in tok.decode(sent["prompt"])
    assert_no_locks(both)


async def test_tool_use_with_the_anthropic_sdk(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]], conductor: ConductorFactory
) -> None:
    """The same loop through Anthropic's Messages API and its official SDK: a
    ``tool_use`` block with the parsed input and ``stop_reason: "tool_use"``, streamed
    as ``input_json_delta``; the ``tool_result`` goes back and the answer is text."""
    from anthropic import AsyncAnthropic

    from tests.conftest import over_http

    (*_, both), (*_, engine) = vllm_agents
    tok = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    call_text = (
        'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    tool = {"name": "get_weather", "description": "Current weather in a city.",
            "input_schema": WEATHER_TOOL["function"]["parameters"]}  # type: ignore[index]  # fmt: skip
    async with (
        conductor([both], tool_call_parser="hermes") as c,
        over_http(c.app) as base,
        AsyncAnthropic(base_url=base, api_key="unused", max_retries=0) as client,
    ):
        turns: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]

        async def ask() -> Any:
            return await client.messages.create(
                model=MODEL, max_tokens=64, messages=cast(Any, turns), tools=cast(Any, [tool])
            )

        engine.replies.append(tok.encode(call_text))
        reply = await ask()
        assert reply.stop_reason == "tool_use"
        said, use = reply.content
        assert (said.type, said.text) == ("text", "Checking.")
        assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Oslo"})
        assert use.id.startswith("toolu_")

        engine.replies.append(tok.encode(call_text))
        engine.event_per_read = True  # tokens one by one: the input streams in fragments
        async with client.messages.stream(
            model=MODEL, max_tokens=64, messages=cast(Any, turns), tools=cast(Any, [tool])
        ) as stream:
            fragments = [e.partial_json async for e in stream if e.type == "input_json"]
            final = await stream.get_final_message()
        engine.event_per_read = False
        assert len(fragments) > 2
        assert json.loads("".join(fragments)) == {"city": "Oslo"}
        assert final.stop_reason == "tool_use"
        assert [b.type for b in final.content] == ["text", "tool_use"]
        assert final.content[1].input == {"city": "Oslo"}  # type: ignore[union-attr]

        turns += [
            {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": use.id,
                                               "name": use.name, "input": use.input}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                          "content": '{"sky": "clear", "c": 21}'}]},
        ]  # fmt: skip
        engine.replies.append(tok.encode("Clear sky, 21 degrees."))
        answer = await ask()
        assert answer.stop_reason == "end_turn"
        assert [(b.type, b.text) for b in answer.content] == [("text", "Clear sky, 21 degrees.")]
        _, sent = engine.completions[-1]
        assert "clear" in tok.decode(sent["prompt"])  # the tool's result reached the prompt
    assert_no_locks(both)


async def test_without_a_parser_tools_that_may_be_called_are_refused(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]], conductor: ConductorFactory
) -> None:
    (*_, both), (*_, engine) = vllm_agents
    async with conductor([both], tool_call_parser="none") as c:
        body = chat_body("Weather?", tools=[WEATHER_TOOL])
        r = await c.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["param"] == "tools"
        assert "--tool-call-parser" in r.json()["error"]["message"]
        r = await c.client.post(
            "/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 2}
        )
        assert r.status_code == 200, r.text
    assert len(engine.completions) == 1


@pytest.mark.parametrize("forced", ["named", "required"])
async def test_a_forced_tool_call_is_guided_decoding_on_vllm(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]],
    conductor: ConductorFactory,
    forced: str,
) -> None:
    """tool_choice naming a function, or 'required': vLLM is asked for JSON (the
    arguments object, or an array of {name, parameters}) and the conductor answers the
    calls it reads from it, streamed and not."""
    (*_, both), (*_, engine) = vllm_agents
    tok = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    if forced == "named":
        choice: Any = {"type": "function", "function": {"name": "get_weather"}}
        output = '{"city": "Oslo"}'
    else:
        choice = "required"
        output = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    body = chat_body("Weather?", tools=[WEATHER_TOOL], tool_choice=choice, max_tokens=32)
    async with conductor([both], tool_call_parser="none") as c:
        engine.replies.append(tok.encode(output))
        r = await c.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice_out = r.json()["choices"][0]
        assert choice_out["finish_reason"] == "tool_calls"
        assert choice_out["message"]["content"] is None
        (call,) = choice_out["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
        _, sent = engine.completions[-1]
        schema = sent["response_format"]["json_schema"]["schema"]
        parameters = WEATHER_TOOL["function"]["parameters"]  # type: ignore[index]
        if forced == "named":
            assert schema == parameters
        else:
            (item,) = schema["items"]["anyOf"]
            assert item["properties"] == {
                "name": {"const": "get_weather"},
                "parameters": parameters,
            }

        engine.replies.append(tok.encode(output))
        r = await c.client.post("/v1/chat/completions", json={**body, "stream": True})
        events = [
            json.loads(b[len("data: ") :]) for b in r.text.split("\n\n") if b.startswith("data: {")
        ]
        deltas = [e["choices"][0] for e in events if e["choices"]]
        calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
        # As OpenAI streams a call: one delta naming it, one with its arguments, then the
        # finish reason in a chunk of its own.
        head, args = calls
        assert head["id"].startswith("call_")
        assert (head["index"], head["type"]) == (0, "function")
        assert head["function"] == {"name": "get_weather", "arguments": ""}
        assert set(args) == {"index", "function"}
        assert args["index"] == 0
        assert json.loads(args["function"]["arguments"]) == {"city": "Oslo"}
        assert deltas[-1] == {
            "index": 0,
            "delta": {},
            "logprobs": None,
            "finish_reason": "tool_calls",
        }

        # Cut by max_tokens, the JSON does not parse: the text comes back as it is.
        engine.replies.append(tok.encode(output)[:3])
        r = await c.client.post("/v1/chat/completions", json=body)
        cut = r.json()["choices"][0]
        assert cut["message"].get("tool_calls") is None
        assert cut["message"]["content"] == tok.decode(tok.encode(output)[:3])
    assert_no_locks(both)


async def test_logprobs_from_vllm_come_back_in_openais_shapes(
    vllm_agents: tuple[list[AgentServer], list[StandInVllm]], conductor: ConductorFactory
) -> None:
    """vLLM's completions logprobs (token_id:N keys, the sampled token added to the
    alternatives) become chat's ``logprobs.content`` and the legacy parallel lists, the
    alternatives cut to the count asked, most likely first."""
    (*_, both), _ = vllm_agents
    tok = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    async with conductor([both]) as c:
        r = await c.client.post(
            "/v1/chat/completions", json=chat_body("one two", max_tokens=2, logprobs=True,
                                                   top_logprobs=2),
        )  # fmt: skip
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 2
        first = content[0]
        assert first["logprob"] == -0.5
        assert first["token"] == tok.token_bytes(300).decode("utf-8", "replace")
        assert first["bytes"] == list(tok.token_bytes(300))
        assert [t["logprob"] for t in first["top_logprobs"]] == [-0.5, -1.0]
        assert first["top_logprobs"][1]["token"] == tok.token_bytes(7).decode("utf-8", "replace")
        r = await c.client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "one two", "max_tokens": 2, "logprobs": 1},
        )
        legacy = r.json()["choices"][0]["logprobs"]
        assert legacy["token_logprobs"] == [-0.5, -0.5]
        assert [len(t) for t in legacy["top_logprobs"]] == [1, 1]
        assert legacy["text_offset"][0] == 0
        assert legacy["text_offset"][1] == len(legacy["tokens"][0])
    assert_no_locks(both)
