"""The simulated engine's HTTP answers have vLLM 0.32's shapes (kvc_sim.vllm_sim.protocol,
.server): the same keys in the same order as vLLM's own response models produce.

``VLLM`` holds bodies made in ``.venv-vllm`` by vLLM's pydantic models, serialized the way
vLLM's routes serialize them (``model_dump()`` for whole responses,
``model_dump_json(exclude_unset=True)`` for stream chunks, ``exclude_none=True`` for the
usage chunk): only their structure is compared, not the values.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvc.models import DEFAULT_MODEL_DIR
from kvc_sim.profile import load_profile
from kvc_sim.vllm_sim.config import SimEngineConfig
from kvc_sim.vllm_sim.server import create_app

VLLM: dict[str, Any] = {
    "completion": {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "ab",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": [4, 5],
                "prompt_logprobs": None,
                "prompt_token_ids": [1, 2, 3],
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 3,
            "total_tokens": 5,
            "completion_tokens": 2,
            "prompt_tokens_details": {
                "cached_tokens": 0,
                "created_cache_tokens": None,
                "multimodal_tokens": None,
            },
            "completion_tokens_details": None,
        },
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    },
    "completion_chunk": {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "a",
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "prompt_token_ids": [1, 2, 3],
                "token_ids": [4],
            }
        ],
    },
    "completion_chunk_later": {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": "b",
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_token_ids": None,
                "token_ids": [5],
            }
        ],
    },
    "completion_usage_chunk": {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [],
        "usage": {
            "prompt_tokens": 3,
            "total_tokens": 5,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    },
    "chat": {
        "id": "chatcmpl-x",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "ab",
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 3,
            "total_tokens": 5,
            "completion_tokens": 2,
            "prompt_tokens_details": {
                "cached_tokens": 0,
                "created_cache_tokens": None,
                "multimodal_tokens": None,
            },
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    },
    "chat_role_chunk": {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": None,
        "prompt_text": None,
    },
    "chat_chunk": {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "a"},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": None,
            }
        ],
    },
    "chat_final_chunk": {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {"content": "b"},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": None,
            }
        ],
    },
    "chat_usage_chunk": {
        "id": "chatcmpl-x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [],
        "usage": {
            "prompt_tokens": 3,
            "total_tokens": 5,
            "completion_tokens": 2,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    },
    "error": {"error": {"message": "bad", "type": "BadRequestError", "param": None, "code": 400}},
    "models": {
        "object": "list",
        "data": [
            {
                "id": "m",
                "object": "model",
                "created": 1,
                "owned_by": "vllm",
                "root": "/x",
                "parent": None,
                "max_model_len": 2048,
                "permission": [],
            }
        ],
    },
}


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return [(key, _shape(item)) for key, item in value.items()]
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return None


@contextlib.asynccontextmanager
async def serving(model: str = "tiny-llama") -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """A running simulated engine (no time passes in its steps) and a client of it."""
    config = SimEngineConfig(
        model_dir=DEFAULT_MODEL_DIR,
        served_model_name=model,
        max_model_len=256,
        num_gpu_blocks=65,
        time_scale=0.0,
    )
    app = create_app(config, load_profile("llama3-70b-8xa800"))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://sim") as http:
            yield app, http


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with serving() as (_, http):
        yield http


def _events(text: str) -> list[dict[str, Any]]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


async def test_completion_shapes(client: httpx.AsyncClient) -> None:
    body = {"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 3}
    r = await client.post("/v1/completions", json={**body, "return_token_ids": True})
    assert r.status_code == 200, r.text
    data = r.json()
    assert _shape(data) == _shape(VLLM["completion"])
    assert len(data["choices"][0]["token_ids"]) == 3
    assert data["usage"]["completion_tokens"] == 3
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json={**stream, "return_token_ids": True})
    first, second, last, usage = _events(r.text)
    assert _shape(first) == _shape(VLLM["completion_chunk"])
    assert second["choices"][0]["prompt_token_ids"] is None
    assert _shape(last) == _shape(VLLM["completion_chunk_later"])
    assert last["choices"][0]["finish_reason"] == "length"
    assert _shape(usage) == _shape(VLLM["completion_usage_chunk"])
    text = "".join(e["choices"][0]["text"] for e in (first, second, last))
    assert text == data["choices"][0]["text"]  # same prompt, same deterministic output


async def test_chat_shapes(client: httpx.AsyncClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert _shape(r.json()) == _shape(VLLM["chat"])
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    role, content, final, usage = _events(
        (await client.post("/v1/chat/completions", json=stream)).text
    )
    assert _shape(role) == _shape(VLLM["chat_role_chunk"])
    assert _shape(content) == _shape(VLLM["chat_chunk"])
    assert _shape(final) == _shape(VLLM["chat_final_chunk"])
    assert _shape(usage) == _shape(VLLM["chat_usage_chunk"])


async def test_models_and_errors(client: httpx.AsyncClient) -> None:
    models = (await client.get("/v1/models")).json()
    assert _shape(models) == _shape(VLLM["models"])
    assert models["data"][0]["max_model_len"] == 256
    cases = [
        ({"prompt": "x", "best_of": 2}, 400),  # not honoured: refused, not ignored
        ({"prompt": "x", "n": 2}, 400),
        ({"prompt": list(range(3, 300))}, 400),  # over max_model_len
        ({"prompt": [5, 999999]}, 400),  # out of vocabulary
        ({"prompt": [5, -1]}, 400),
        ({"prompt": []}, 400),
        ({"prompt": "x", "model": "other"}, 404),
        ({"prompt": "x", "vllm_xargs": {"kv_cache_report_mode": "sometimes"}}, 400),
        ({"prompt": "x", "skip_special_tokens": False}, 400),  # only vLLM's default
        ({"prompt": "x", "no_stop_trim": True}, 400),
        ({"prompt": "x", "return_hidden_states": True}, 400),
        ({"prompt": "x", "frequency_penalty": 0.5}, 400),  # no logits to reshape
        ({"prompt": "x", "presence_penalty": -1}, 400),
        ({"prompt": "x", "logit_bias": {"5": 1.0}}, 400),
    ]
    for body, status in cases:
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == status, (body, r.text)
        assert _shape(r.json()) == _shape(VLLM["error"])


async def test_a_routers_spelled_out_defaults_are_served(client: httpx.AsyncClient) -> None:
    """vllm-router re-serializes a streamed body with vLLM's defaults written out."""
    body = {
        "prompt": "x", "max_tokens": 2, "stream": True, "ignore_eos": True, "echo": False,
        "no_stop_trim": False, "return_hidden_states": False, "skip_special_tokens": True,
        "frequency_penalty": 0.0, "presence_penalty": 0, "logit_bias": {},
    }  # fmt: skip
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text


async def test_a_routers_spelled_out_chat_defaults_are_served(client: httpx.AsyncClient) -> None:
    """vllm-router and smg re-serialize chat bodies with chat's logprobs switch off, vLLM's
    continue_final_message and SGLang's reasoning switches written out; anything that would
    change the answer is still refused."""
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
    spelled = {
        **base, "logprobs": False, "continue_final_message": False,
        "separate_reasoning": True, "stream_reasoning": True, "include_reasoning": True,
    }  # fmt: skip
    r = await client.post("/v1/chat/completions", json=spelled)
    assert r.status_code == 200, r.text
    for bad in ({"logprobs": True}, {"continue_final_message": True}, {"reasoning_effort": 1}):
        r = await client.post("/v1/chat/completions", json={**base, **bad})
        assert r.status_code == 400, (bad, r.text)
    r = await client.post("/v1/completions", json={"prompt": "x", "logprobs": False})
    assert r.status_code == 400, r.text  # completions' logprobs is a count: unset only


async def test_every_generated_token_streams_as_a_chunk_with_text(
    client: httpx.AsyncClient,
) -> None:
    """No byte pieces of a character among the outputs: a client sees each token's gap."""
    body = {"prompt": list(range(5, 40)), "max_tokens": 60, "stream": True, "seed": 3}
    texts = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                texts += [c["text"] for c in json.loads(line[6:])["choices"] if c["text"]]
    assert len(texts) == 60
    assert all("\ufffd" not in t for t in texts)


async def test_stop_strings_end_the_output_before_them(client: httpx.AsyncClient) -> None:
    body = {"prompt": "Hello there", "max_tokens": 12, "seed": 7}
    full = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]
    stop = full[5:8]
    r = await client.post("/v1/completions", json={**body, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert choice["text"] == full[: full.index(stop)]
    assert r.json()["usage"]["completion_tokens"] < 12


async def test_tokenize_and_reset(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"prompt": "Hello there"})
    data = r.json()
    assert list(data) == ["count", "max_model_len", "tokens", "token_strs"]
    assert data["count"] == len(data["tokens"])
    detok = await client.post("/detokenize", json={"tokens": data["tokens"]})
    assert "Hello there" in detok.json()["prompt"]
    assert (await client.post("/reset_prefix_cache")).status_code == 200
    metrics = (await client.get("/metrics")).text
    (info,) = [
        sample.labels
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "vllm:cache_config_info"
    ]
    assert (info["block_size"], info["enable_prefix_caching"], info["num_gpu_blocks"]) == (
        "16",
        "True",
        "65",
    )


async def test_a_priority_needs_priority_scheduling(client: httpx.AsyncClient) -> None:
    """As vLLM: under --scheduling-policy fcfs (the default) a priority other than 0 is
    refused, not ignored; 0 is served."""
    body = {"prompt": "x", "max_tokens": 1}
    assert (await client.post("/v1/completions", json={**body, "priority": 0})).status_code == 200
    r = await client.post("/v1/completions", json={**body, "priority": -1})
    assert r.status_code == 400, r.text
    assert "Priority scheduling is not enabled" in r.text


def _reference_exposition(state: Any, model: str) -> bytes:
    """What prometheus_client's own collect-and-render writes for the engine's families
    (the sim engine renders the same bytes by hand)."""
    runner = state.runner
    scheduler = runner.scheduler
    pool = scheduler.pool
    registry = CollectorRegistry(auto_describe=False)
    info = GaugeMetricFamily(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        labels=[
            "block_size",
            "enable_prefix_caching",
            "num_gpu_blocks",
            "prefix_caching_hash_algo",
            "engine",
        ],
    )
    info.add_metric(
        [str(pool.block_size), str(pool.enable_caching), str(pool.num_gpu_blocks), "sha256", "0"],
        1.0,
    )
    families: list[Metric] = [info]
    for name, doc, value in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         runner.num_running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         runner.num_waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", pool.usage),
    ):  # fmt: skip
        gauge = GaugeMetricFamily(name, doc, labels=["model_name", "engine"])
        gauge.add_metric([model, "0"], float(value))
        families.append(gauge)
    for name, doc, count in (
        ("vllm:prefix_cache_queries",
         "Prefix cache queries, in terms of number of queried tokens.",
         scheduler.prefix_cache_queries),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
         scheduler.prefix_cache_hits),
        ("vllm:prompt_tokens", "Number of prefill tokens processed.", scheduler.prompt_tokens),
        ("vllm:generation_tokens", "Number of generation tokens processed.",
         scheduler.generation_tokens),
        ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
         scheduler.preemptions),
    ):  # fmt: skip
        counter = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
        counter.add_metric([model, "0"], float(count))
        families.append(counter)

    class Fixed(Collector):
        def collect(self) -> Iterator[Metric]:
            yield from families

    registry.register(Fixed())
    rendered: bytes = generate_latest(registry)
    return rendered


@pytest.mark.parametrize("model", ["tiny-llama", 'odd "name"\\ with\nbreaks'])
async def test_metrics_are_prometheus_clients_bytes(model: str) -> None:
    """The hand-written exposition is byte for byte prometheus_client's, before and
    after traffic (counters past 10^6 take Go's exponent form); scraped ahead of the
    framework, other methods on /metrics still get FastAPI's answer."""
    async with serving(model) as (app, http):
        state = app.state.sim
        first = await http.get("/metrics")
        assert first.status_code == 200
        assert first.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert first.content == _reference_exposition(state, model)
        body = {"model": model, "prompt": "Hello there, how are you", "max_tokens": 5}
        assert (await http.post("/v1/completions", json=body)).status_code == 200
        state.runner.scheduler.prompt_tokens += 12_345_678
        after = (await http.get("/metrics")).content
        assert after == _reference_exposition(state, model)
        assert b"e+07" in after
        assert after != first.content
        assert (await http.post("/metrics")).status_code in (404, 405)
