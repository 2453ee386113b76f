"""Start-up calibration (node_agent/calibration.py): the plan run on the real embedded
engine, its budget, and the vLLM probes against a stand-in vLLM that keeps time."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import pytest
import torch

from kvc.models import DEFAULT_MODEL_DIR
from kvc.priors import DecodePrior, PrefillPrior
from kvc.sampling import Sampling
from kvc.tokenization import ChatTokenizer
from node_agent.calibration import CalibrationPlan, calibrate, host_lock
from node_agent.engines.base import GenerateJob, PrefillJob
from node_agent.engines.embedded.adapter import EmbeddedEngineAdapter
from node_agent.engines.vllm.adapter import VllmEngineAdapter
from node_agent.engines.vllm.config import CALIBRATION_SALT, VllmConfig, salt_for_tenant
from node_agent.engines.vllm.events import KvEventDecoder
from node_agent.main import build_engine, start_engine
from node_agent.settings import AgentSettings

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def engine() -> Iterator[EmbeddedEngineAdapter]:
    # One torch thread: timings on a shared CI host then do not hinge on a second core.
    # (torch's thread count is per process: put back for the tests that follow.)
    threads = torch.get_num_threads()
    adapter = build_engine(AgentSettings(port=0, threads=1))
    assert isinstance(adapter, EmbeddedEngineAdapter)
    yield adapter
    asyncio.run(adapter.aclose())
    torch.set_num_threads(threads)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(2048) for _ in range(n))


def _prefill_estimate(p: PrefillPrior, n: int) -> float:
    return p.fixed_s + p.per_token_s * n + p.per_token_context_s * n * n


def _decode_estimate(d: DecodePrior, batch: int, context: int) -> float:
    return d.fixed_s + d.per_request_s * batch + d.per_context_token_s * context


async def _measured_prefill_s(engine: EmbeddedEngineAdapter, n: int, rng: random.Random) -> float:
    """Median of 3 prefills of ``n`` tokens through the adapter's ordinary ``prefill``."""
    runs = []
    for i in range(4):
        job = PrefillJob(
            request_id=f"p{n}-{i}",
            prompt_ids=_tokens(rng, n + 1),  # prefill computes prompt[:-1]
            block_size=32,
            block_payloads=(),
        )
        runs.append((await engine.prefill(job)).prefill_s)
    return statistics.median(runs[1:])


async def _measured_tbt_s(
    engine: EmbeddedEngineAdapter, batch: int, prompt_tokens: int, rng: random.Random
) -> float:
    """Median time between tokens of ``batch`` concurrent ordinary generations."""
    sampling = Sampling(temperature=0.0, max_tokens=14, ignore_eos=True)

    async def one(i: int) -> list[float]:
        job = GenerateJob(f"g{i}", _tokens(rng, prompt_tokens), sampling, prefix_kv=None)
        stamps = [time.perf_counter() async for _ in engine.generate(job)]
        return [b - a for a, b in itertools.pairwise(stamps[2:])]

    gaps = await asyncio.gather(*(one(i) for i in range(batch)))
    return statistics.median(g for gs in gaps for g in gs)


async def test_the_fit_predicts_the_embedded_engine_within_2x(
    engine: EmbeddedEngineAdapter,
) -> None:
    cal = await calibrate(engine, budget_s=4.0)
    assert cal is not None
    assert cal.duration_s < 4.0
    assert cal.prefill_samples >= 12  # 4 sizes x 3 timed runs, plus the cached-head runs
    assert cal.decode_samples >= 4
    rng = random.Random(7)
    for n in (500, 1000):
        measured = await _measured_prefill_s(engine, n, rng)
        estimate = _prefill_estimate(cal.prefill, n)
        assert measured / 2 <= estimate <= measured * 2, (n, measured, estimate, cal)
    for batch, prompt in ((1, 300), (3, 100)):
        measured = await _measured_tbt_s(engine, batch, prompt, rng)
        context = batch * (prompt + 7)
        estimate = _decode_estimate(cal.decode, batch, context)
        assert measured / 2 <= estimate <= measured * 2, (batch, measured, estimate, cal)


async def test_the_budget_is_a_hard_bound(engine: EmbeddedEngineAdapter) -> None:
    started = time.perf_counter()
    await calibrate(engine, budget_s=0.5)
    assert time.perf_counter() - started < 1.5
    # Too short to measure two sizes of each: nothing is reported.
    assert await calibrate(engine, budget_s=0.001) is None


async def test_sizes_beyond_the_context_length_are_left_out(
    engine: EmbeddedEngineAdapter,
) -> None:
    plan = CalibrationPlan(
        prefill_sizes=(16, 64, 100_000),
        cached_prefills=((100_000, 50_000),),
        long_prefill_sizes=(200_000,),
        decode_probes=((1, 16), (2, 16), (1, 100_000)),
        decode_steps=3,
    )
    cal = await calibrate(engine, budget_s=4.0, plan=plan)
    assert cal is not None
    assert cal.prefill_samples == 2 * 3  # two sizes, three timed runs each
    assert cal.decode_samples == 2


async def test_agents_of_one_host_take_turns() -> None:
    name = f"test_{uuid.uuid4().hex}"  # as it is on disk
    async with host_lock(name, timeout_s=1.0) as first:
        assert first
        started = time.perf_counter()
        async with host_lock(name, timeout_s=0.2) as second:
            assert not second  # held elsewhere: gave up after its timeout
        assert 0.2 <= time.perf_counter() - started < 1.0
    async with host_lock(name, timeout_s=0.2) as third:
        assert third
    (Path(tempfile.gettempdir()) / f"kvc-{name}.lock").unlink()


async def test_a_lock_of_two_slots_lets_two_in_and_the_third_waits() -> None:
    name = f"test_{uuid.uuid4().hex}"
    async with host_lock(name, 1.0, slots=2) as first, host_lock(name, 1.0, slots=2) as second:
        assert first
        assert second
        async with host_lock(name, timeout_s=0.2, slots=2) as third:
            assert not third
    async with host_lock(name, 0.2, slots=2) as again:
        assert again
    folder = Path(tempfile.gettempdir())
    for path in (folder / f"kvc-{name}.lock", folder / f"kvc-{name}-1.lock"):
        path.unlink()
    with pytest.raises(ValueError, match="slots"):
        async with host_lock(name, 0.1, slots=0):
            pass  # pragma: no cover


# ------------------------------------------------------------------ vLLM (stand-in)

PREFILL_FIXED_S, PREFILL_PER_TOKEN_S = 0.004, 40e-6
PREFILL_QUADRATIC_S = 1e-9  # per token squared: 2% of a 1k prefill, 29% of a 16k one
TBT_FIXED_S, TBT_PER_REQUEST_S = 0.004, 0.002
METRICS = """\
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",enable_prefix_caching="True",num_gpu_blocks="129"} 1.0
"""


class TimedVllm:
    """Answers completions like vLLM, taking the time a simple engine model says:
    prefill ``fixed + per_token*n``, then one token per ``fixed + per_request*streams``."""

    def __init__(
        self, *, fail: bool = False, quadratic_s: float = 0.0, max_model_len: int = 2048
    ) -> None:
        self.fail = fail
        self.quadratic_s = quadratic_s
        self.max_model_len = max_model_len
        self.bodies: list[dict[str, Any]] = []
        self.streams = 0

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(
                200, json={"data": [{"id": MODEL, "max_model_len": self.max_model_len}]}
            )
        if path == "/metrics":
            return httpx.Response(200, text=METRICS)
        assert path == "/v1/completions", path
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.fail:
            return httpx.Response(500, json={"error": {"message": "engine died"}})
        n = len(body["prompt"])
        if not body["stream"]:
            await asyncio.sleep(self.prefill_s(n))
            return httpx.Response(
                200,
                json={
                    "choices": [
                        {"index": 0, "text": "", "token_ids": [7], "finish_reason": "length"}
                    ],
                    "usage": {
                        "prompt_tokens": n,
                        "completion_tokens": 1,
                        "prompt_tokens_details": {"cached_tokens": 0},
                    },
                },
            )
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, content=self._sse(n, body)
        )

    def prefill_s(self, n: int) -> float:
        return PREFILL_FIXED_S + PREFILL_PER_TOKEN_S * n + self.quadratic_s * n * n

    async def _sse(self, n: int, body: dict[str, Any]) -> AsyncIterator[bytes]:
        # Counted out before the last yield: a reader that stops at [DONE] may never
        # resume (or close) this generator.
        self.streams += 1
        await asyncio.sleep(self.prefill_s(n))
        chunks = []
        count = body["max_tokens"]
        for i in range(count):
            if i:
                await asyncio.sleep(TBT_FIXED_S + TBT_PER_REQUEST_S * self.streams)
            choice = {"index": 0, "text": "", "token_ids": [9]}
            choice["finish_reason"] = "length" if i == count - 1 else None
            chunks.append(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
            if i < count - 1:
                yield chunks.pop()
        self.streams -= 1
        yield chunks.pop() + b"data: [DONE]\n\n"


async def _vllm(fake: TimedVllm) -> VllmEngineAdapter:
    settings = AgentSettings(port=0, engine="vllm", vllm_url="http://vllm", calibrate=False)
    engine = VllmEngineAdapter(
        VllmConfig.from_settings(settings),
        ChatTokenizer.from_dir(DEFAULT_MODEL_DIR),
        transport=httpx.MockTransport(fake),
    )
    await start_engine(engine, settings)
    return engine


async def test_vllm_probes_are_timed_and_salted_apart_from_every_tenant() -> None:
    fake = TimedVllm()
    engine = await _vllm(fake)
    try:
        cal = await calibrate(engine, budget_s=8.0)
    finally:
        await engine.aclose()
    assert cal is not None
    assert fake.bodies, "no calibration request reached vLLM"
    for body in fake.bodies:
        assert body["cache_salt"] == CALIBRATION_SALT
        assert all(isinstance(t, int) for t in body["prompt"])
        assert body["ignore_eos"] is True
    for n in (200, 1000):
        truth = PREFILL_FIXED_S + PREFILL_PER_TOKEN_S * n
        assert truth / 2 <= _prefill_estimate(cal.prefill, n) <= truth * 2, (n, cal)
    for batch in (1, 4):
        truth = TBT_FIXED_S + TBT_PER_REQUEST_S * batch
        estimate = _decode_estimate(cal.decode, batch, batch * 100)
        assert truth / 2 <= estimate <= truth * 2, (batch, cal)


async def test_long_prompts_pin_the_attention_term_that_short_ones_cannot() -> None:
    """Up to 1k tokens the quadratic term is a few percent of a prefill, below the
    timing noise; calibration also times 4k and 16k prompts, so a 40k-token prompt is
    predicted from measurement, not from an extrapolated guess."""
    fake = TimedVllm(quadratic_s=PREFILL_QUADRATIC_S, max_model_len=32_768)
    engine = await _vllm(fake)
    try:
        cal = await calibrate(engine, budget_s=20.0)
    finally:
        await engine.aclose()
    assert cal is not None
    assert max(len(body["prompt"]) for body in fake.bodies) == 16_384
    assert cal.prefill.per_token_context_s == pytest.approx(PREFILL_QUADRATIC_S, rel=0.35)
    n = 40_000
    assert _prefill_estimate(cal.prefill, n) == pytest.approx(fake.prefill_s(n), rel=0.2)


async def test_vllm_calibration_sends_no_more_than_its_cache_share() -> None:
    """vLLM keeps calibration's blocks until it evicts them: the token bound holds, and
    the cheap steps that fit still make a calibration."""
    fake = TimedVllm()
    engine = await _vllm(fake)
    try:
        cal = await calibrate(engine, budget_s=8.0, cache_tokens=2048)
    finally:
        await engine.aclose()
    assert cal is not None
    sent = sum(len(body["prompt"]) + body["max_tokens"] for body in fake.bodies)
    assert sent <= 2048
    assert max(len(body["prompt"]) for body in fake.bodies) < 1024  # the big ones skipped


async def test_a_failing_vllm_leaves_the_node_uncalibrated() -> None:
    fake = TimedVllm(fail=True)
    engine = await _vllm(fake)
    try:
        assert await calibrate(engine, budget_s=2.0) is None
    finally:
        await engine.aclose()
    assert len(fake.bodies) == 1  # the first failure ends it


def test_no_tenant_shares_the_calibration_salt_and_the_mirror_skips_it() -> None:
    for tenant in (CALIBRATION_SALT, "__kvc", "__kvc_anything"):
        salt = salt_for_tenant(tenant)
        assert salt is not None
        assert salt != CALIBRATION_SALT
        assert salt.startswith("kvc-t-")
    settings = AgentSettings(port=0, engine="vllm", vllm_url="http://vllm", calibrate=False)
    engine = VllmEngineAdapter(
        VllmConfig.from_settings(settings), ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    )
    decoder = KvEventDecoder(
        model=MODEL, block_size=4, tenant_of_salt=engine._tenant_of_salt, max_tracked=64
    )

    def stored(hashes: list[int], salt: str) -> bytes:
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": list(range(4 * len(hashes))),
            "block_size": 4,
            "lora_name": None,
            "medium": "GPU",
            "group_idx": 0,
            "extra_keys": [[salt]] + [None] * (len(hashes) - 1),
        }
        data: bytes = msgpack.packb([1.0, [event], 0])
        return data

    assert decoder.decode(stored([1, 2], CALIBRATION_SALT)) == []
    assert decoder.skipped_blocks == 2
    assert decoder.tracked == 0
    assert len(decoder.decode(stored([3], "acme"))) == 1  # a tenant's blocks still mirror
