"""``kvc bench live`` against the simulated vLLM engine (``kvc_sim.vllm_sim``) under
uvicorn on 127.0.0.1:0: a synthetic trace with Mooncake-sized prompts (4-32k tokens),
sent as text, comes back with vLLM's usage (BOS included, cached tokens from its prefix
cache) and the trace's prefix structure intact."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvc.models import DEFAULT_MODEL_DIR
from kvc_sim.live.run import LiveOptions, replay_live
from kvc_sim.profile import load_profile
from kvc_sim.scenario import SloSpec
from kvc_sim.trace import theoretical_hit_ratio, write_trace
from kvc_sim.vllm_sim.config import SimEngineConfig
from kvc_sim.vllm_sim.server import SimEngineServer, create_app
from kvc_sim.workload import SyntheticSpec, generate

MODEL = "tiny-llama"
TIME_SCALE = 0.02  # wall seconds per profile second: the 70B profile, 50x faster


@pytest.fixture
async def engine() -> AsyncIterator[SimEngineServer]:
    config = SimEngineConfig(
        model_dir=DEFAULT_MODEL_DIR,
        served_model_name=MODEL,
        max_model_len=65_536,
        num_gpu_blocks=60_000,  # every block of the trace stays cached (no eviction)
        time_scale=TIME_SCALE,
    )
    server = SimEngineServer(create_app(config, load_profile("llama3-70b-8xa800")))
    await server.start()
    yield server
    await server.stop()


async def test_a_synthetic_trace_replays_against_the_sim_engine(
    engine: SimEngineServer, tmp_path: Path
) -> None:
    requests = generate(SyntheticSpec(requests=20, rate_per_s=2.0, seed=3))
    write_trace(tmp_path / "trace.jsonl", requests)
    out = tmp_path / "out"
    options = LiveOptions(
        url=engine.url,
        trace_name=str(tmp_path / "trace.jsonl"),
        run_name="sim-engine",
        time_scale=TIME_SCALE,
        max_in_flight=1,  # one at a time: each request finds every earlier block cached
        max_tokens=64,
        timeout_s=20.0,
        slo=SloSpec(ttft_s=30.0, tbt_s=0.2),
    )
    summary = await replay_live(requests, out, options)
    assert summary == json.loads((out / "summary.json").read_text())
    block = summary["policies"]["sim-engine"]
    live = block["live"]
    assert block["completed"] == 20, live
    assert live["status_counts"] == {"200": 20}
    # vLLM prepends BOS to a text prompt: one token more than the trace's each
    assert live["prompt_tokens"] == sum(r.input_tokens + 1 for r in requests)
    assert live["completion_tokens"] == sum(min(64, max(1, r.output_tokens)) for r in requests)
    assert live["completed_with_fewer_tokens"] == 0
    # Served one at a time with no eviction, the engine reuses every shared trace block:
    # its hit ratio is the trace's unbounded-cache ceiling, up to block rounding and BOS.
    ceiling = theoretical_hit_ratio(requests)
    assert ceiling > 0.3
    assert block["hit_ratio"] == pytest.approx(ceiling, abs=0.01)
    # Latencies come back in trace (profile) seconds, not wall seconds
    assert block["ttft_p50_s"] > 0
    assert block["tbt_p90_s"] is not None
    assert (out / "requests_sim-engine.csv").read_text().count("\n") == 21
