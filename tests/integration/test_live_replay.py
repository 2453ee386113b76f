"""``kvc bench live`` against a real OpenAI-compatible server on loopback: the conductor
under uvicorn on 127.0.0.1:0 in front of real embedded agents. A small synthetic trace
(short prompts: the tiny model's context is 4096 tokens) goes out as text, and the
summary, CSV and plots come back in the simulator's layout."""

from __future__ import annotations

import asyncio
import csv
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvicorn

from conductor.app import create_app
from conductor.settings import ConductorSettings
from kvc.models import DEFAULT_MODEL_DIR
from kvc.tokenization import ChatTokenizer
from kvc_sim.live.client import PromptFormat
from kvc_sim.live.run import LiveOptions, LiveReplayError, replay_live
from kvc_sim.scenario import SloSpec
from kvc_sim.trace import TraceRequest, write_trace
from kvc_sim.workload import SyntheticSpec, generate
from node_agent.server import AgentServer
from tests.conftest import MODEL, AgentFactory, assert_no_locks, wait_until

SPEC = SyntheticSpec(
    requests=20,
    rate_per_s=20.0,
    seed=5,
    system_prompts=2,
    system_prompt_tokens=1024,
    user_tokens=(16, 200),
    answer_tokens=(2, 8),
    chat_turns=(2, 3),
    doc_tokens=(600, 1500),
    doc_questions=(2, 3),
)


@pytest.fixture
async def served(start_agent: AgentFactory) -> AsyncIterator[tuple[str, list[AgentServer]]]:
    agents = [await start_agent("both"), await start_agent("both")]
    settings = ConductorSettings(port=0, agents=[a.address for a in agents], placement_headers=True)
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started)
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", agents
    server.should_exit = True
    await task


def small_trace(tmp_path: Path) -> tuple[Path, list[TraceRequest]]:
    requests = generate(SPEC)
    path = tmp_path / "trace.jsonl"
    write_trace(path, requests)
    return path, requests


@pytest.mark.parametrize("prompt_format", ["text", "token-ids"])
async def test_a_small_trace_replays_against_the_conductor(
    served: tuple[str, list[AgentServer]], tmp_path: Path, prompt_format: PromptFormat
) -> None:
    url, agents = served
    _, requests = small_trace(tmp_path)
    out = tmp_path / "out"
    options = LiveOptions(
        url=url,
        trace_name="trace.jsonl",
        run_name="conductor",
        prompt_format=prompt_format,
        headers={"X-Kvc-Slo-Ttft-Ms": "60000"},
        time_scale=1.0,
        speed=4.0,
        max_in_flight=4,
        timeout_s=120.0,
        slo=SloSpec(ttft_s=60.0, tbt_s=1.0),
    )
    summary = await replay_live(requests, out, options)
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "live"
    assert summary["prompt_format"] == prompt_format
    assert summary["model"] == MODEL  # from GET /v1/models
    block = summary["policies"]["conductor"]
    assert block["requests"] == 20
    assert block["completed"] == 20, block["live"]
    live = block["live"]
    assert live["status_counts"] == {"200": 20}
    assert live["client_errors"] == 0
    # The conductor counts exactly the prompt built — plus, for a text prompt, the special
    # tokens the tokenizer adds (BOS), as vLLM does — and every output token.
    added = len(ChatTokenizer.from_dir(DEFAULT_MODEL_DIR).encode("", add_special_tokens=True))
    per_request = added if prompt_format == "text" else 0
    assert added == 1
    assert live["prompt_tokens"] == sum(r.input_tokens + per_request for r in requests)
    assert live["completion_tokens"] == sum(r.output_tokens for r in requests)
    assert live["completed_with_fewer_tokens"] == 0
    # The trace shares prefixes (system prompts, documents, chat history): some are reused
    assert 0 < block["hit_ratio"] < 1
    assert block["hit_ratio"] == live["cached_tokens"] / live["prompt_tokens"]
    assert block["ttft_p50_s"] > 0
    assert block["tbt_p90_s"] is not None
    assert block["prefill_gpu_s"] is None  # no live equivalent
    assert block["effective_capacity_ratio"] == 1.0

    with (out / "requests_conductor.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 20
    assert {row["outcome"] for row in rows} == {"completed"}
    assert {row["status"] for row in rows} == {"200"}
    by_id = {r.request_id: r for r in requests}
    for row in rows:
        assert int(row["input_tokens"]) == by_id[row["request_id"]].input_tokens + per_request
    # The conductor names the nodes (--placement-headers) and the CSV records them.
    addresses = {a.address for a in agents}
    assert {row["prefill_node"] for row in rows} <= addresses
    assert {row["decode_node"] for row in rows} <= addresses
    for name in ("ttft_cdf.png", "hit_ratio.png"):
        assert (out / name).stat().st_size > 0
    assert not (out / "load.png").exists()  # no load samples live
    assert_no_locks(*agents)


async def test_an_unreachable_url_fails_before_sending(tmp_path: Path) -> None:
    _, requests = small_trace(tmp_path)
    options = LiveOptions(url="http://127.0.0.1:9")  # the discard port: nobody listens
    with pytest.raises(LiveReplayError, match="cannot reach"):
        await replay_live(requests[:2], tmp_path / "out", options)
    assert not (tmp_path / "out").exists()
