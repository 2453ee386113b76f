"""The simulated engine's core (kvc_sim.vllm_sim.scheduler, .runner, .tokens): batching,
chunked prefill, preemption, P/D holds and step times from the profile. No real time:
the scheduler is pure and the runner's sleep is injected."""

from __future__ import annotations

import asyncio

import pytest

from kvc_sim.profile import Profile, load_profile
from kvc_sim.vllm_sim.cache import KvBlockPool
from kvc_sim.vllm_sim.events import BlockStored
from kvc_sim.vllm_sim.runner import EngineRunner
from kvc_sim.vllm_sim.scheduler import EngineRequest, EngineScheduler, StepPlan
from kvc_sim.vllm_sim.tokens import OutputTokens, StopStrings

BS = 16
PROFILE = load_profile("llama3-70b-8xa800")
TOKENS = OutputTokens(2048, frozenset({0, 1, 2}))


def _engine(
    blocks: int = 65, *, seqs: int = 8, budget: int = 8192, profile: Profile = PROFILE
) -> EngineScheduler:
    return EngineScheduler(
        KvBlockPool(blocks, BS),
        profile,
        TOKENS,
        max_model_len=4096,
        max_num_seqs=seqs,
        max_num_batched_tokens=budget,
    )


def _request(
    rid: str,
    n: int,
    max_tokens: int = 4,
    *,
    report_full: bool = False,
    hold_blocks: bool = False,
    external_tokens: int = 0,
) -> EngineRequest:
    prompt = tuple(3 + (i % 1000) for i in range(n))
    return EngineRequest(
        rid,
        prompt,
        max_tokens,
        TOKENS.request_key(prompt, None),
        report_full=report_full,
        hold_blocks=hold_blocks,
        external_tokens=external_tokens,
    )


def _step(engine: EngineScheduler) -> StepPlan:
    plan = engine.schedule()
    assert plan is not None
    engine.complete(plan)
    return plan


def test_a_request_prefills_then_decodes_one_token_per_step() -> None:
    engine = _engine()
    request = _request("a", 40, max_tokens=3)
    engine.add(request)
    first = _step(engine)
    assert [(c.tokens, c.decode) for c in first.chunks] == [(40, False)]
    assert first.prefill_s == PROFILE.prefill_compute_s(40, 0)
    assert first.decode_s == 0.0
    second = _step(engine)
    assert [(c.tokens, c.decode) for c in second.chunks] == [(1, True)]
    assert second.duration_s == PROFILE.tbt_s(1, 41)
    _step(engine)
    assert request.finish_reason == "length"
    assert request.num_output_tokens == 3
    assert engine.schedule() is None
    assert engine.pool.free_blocks == engine.pool.usable_blocks


def test_cached_tokens_are_free_and_reported() -> None:
    engine = _engine()
    engine.add(_request("a", 40, max_tokens=1))
    _step(engine)
    again = _request("b", 40, max_tokens=1)
    engine.add(again)
    plan = _step(engine)
    assert again.num_cached_tokens == 32  # two full blocks; the third is partial
    assert plan.prefill_s == PROFILE.prefill_compute_s(40, 32)
    assert (engine.prefix_cache_queries, engine.prefix_cache_hits) == (80, 32)


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    engine = _engine()
    engine.add(_request("a", 32, max_tokens=1))
    _step(engine)
    again = _request("b", 32, max_tokens=1)
    engine.add(again)
    _step(engine)
    assert again.num_cached_tokens == 16  # the hit stops short of the last token's block


def test_chunked_prefill_shares_steps_with_decodes_and_costs_the_whole() -> None:
    engine = _engine(budget=64)
    decoding = _request("d", 10, max_tokens=10)
    engine.add(decoding)
    _step(engine)
    long = _request("p", 150, max_tokens=1)
    engine.add(long)
    plans = [_step(engine) for _ in range(3)]
    assert [[c.tokens for c in p.chunks] for p in plans] == [[1, 63], [1, 63], [1, 24]]
    assert all(p.decode_s > 0 for p in plans)
    total = sum(p.prefill_s for p in plans)
    assert total == pytest.approx(PROFILE.prefill_compute_s(150, 0))
    assert long.finish_reason == "length"


def test_max_num_seqs_bounds_the_batch() -> None:
    engine = _engine(seqs=2)
    for rid in "abc":
        engine.add(_request(rid, 8, max_tokens=2))
    plan = _step(engine)
    assert len(plan.chunks) == 2
    assert len(engine.waiting) == 1


def test_priority_scheduling_admits_lower_priority_values_first() -> None:
    """vLLM's --scheduling-policy priority: waiting requests by priority, then arrival;
    without it, arrival order whatever the priority."""
    for by_priority, expected in ((True, ["p", "q", "a", "b"]), (False, ["a", "b", "p", "q"])):
        engine = _engine(seqs=1)
        engine.by_priority = by_priority
        for rid, priority in (("a", 0), ("b", 0), ("p", -1), ("q", -1)):
            request = _request(rid, 8, max_tokens=1)
            request.priority = priority
            engine.add(request)
        assert [r.request_id for r in engine.waiting] == expected


def test_a_request_that_does_not_fit_waits() -> None:
    engine = _engine(blocks=5)  # 4 usable blocks of 16
    first = _request("a", 40, max_tokens=3)  # 3 blocks
    engine.add(first)
    _step(engine)
    second = EngineRequest("b", tuple(range(500, 530)), 2, 1)  # needs 2: 1 free
    engine.add(second)
    _step(engine)
    assert second in engine.waiting
    while engine.has_work:
        _step(engine)
    assert first.finish_reason == second.finish_reason == "length"
    assert engine.preemptions == 0
    engine.pool.check_invariants()
    assert engine.pool.free_blocks == engine.pool.usable_blocks


def test_preemption_frees_the_latest_request_and_recomputes_it() -> None:
    engine = _engine(blocks=5)
    old = _request("old", 16, max_tokens=40)
    engine.add(old)
    _step(engine)
    new = _request("new", 16, max_tokens=40)
    engine.add(new)
    _step(engine)
    # Both decode until the pool (4 blocks) is full, then "new" is preempted for "old".
    while not engine.preemptions:
        _step(engine)
    assert new.preemptions == 1
    assert old.preemptions == 0
    assert engine.waiting[0] is new
    engine.pool.check_invariants()


def test_kv_cache_report_mode_full_reannounces_reused_blocks() -> None:
    engine = _engine()
    engine.add(_request("a", 40, max_tokens=1))
    _step(engine)
    engine.pool.take_events()
    engine.add(_request("b", 40, max_tokens=1, report_full=True))
    _step(engine)
    stored = [e for e in engine.pool.take_events() if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None
    assert len(stored[0].block_hashes) == 2
    engine.add(_request("c", 40, max_tokens=1))
    _step(engine)
    assert not [e for e in engine.pool.take_events() if isinstance(e, BlockStored)]


def test_a_prefill_leg_holds_its_blocks_until_pulled_or_expired() -> None:
    engine = _engine()
    leg = _request("p", 40, max_tokens=1, hold_blocks=True)
    engine.add(leg)
    plan = engine.schedule()
    assert plan is not None
    engine.complete(plan, now_s=100.0)
    assert leg.finish_reason == "length"
    held = engine.held["p"]
    assert len(held.blocks) == 3
    assert held.num_tokens == 40
    assert engine.pool.free_blocks == engine.pool.usable_blocks - 3
    assert engine.release_held("p") == 40
    assert engine.release_held("p") is None
    assert engine.pool.free_blocks == engine.pool.usable_blocks
    engine.add(_request("q", 40, max_tokens=1, hold_blocks=True))
    engine.complete(engine.schedule() or StepPlan((), 0.0, 0.0), now_s=0.0)
    assert engine.expire_held(engine.hold_timeout_s - 1) == []
    assert engine.expire_held(engine.hold_timeout_s) == ["q"]
    assert engine.pool.free_blocks == engine.pool.usable_blocks


def test_a_decode_leg_starts_with_its_pulled_tokens_computed() -> None:
    engine = _engine()
    leg = _request("d", 40, max_tokens=2, external_tokens=40)
    engine.add(leg)
    plan = _step(engine)
    assert leg.num_cached_tokens == 39  # all but the last token, which it computes
    assert [c.tokens for c in plan.chunks] == [1]
    assert plan.prefill_s == PROFILE.prefill_compute_s(40, 39)
    assert leg.num_output_tokens == 1
    assert engine.pool.cached_blocks == 2  # the pulled full blocks are cached here


def test_abort_and_stop_free_the_blocks() -> None:
    engine = _engine()
    a, b = _request("a", 40, max_tokens=9), _request("b", 40, max_tokens=9, hold_blocks=True)
    engine.add(a)
    engine.add(b)
    _step(engine)
    assert engine.abort("a") is True
    assert a.finish_reason == "abort"
    assert engine.finish_stopped("b") is True
    assert b.finish_reason == "stop"
    assert "b" in engine.held  # a stopped prefill leg keeps its KV for the decode side
    engine.release_held("b")
    assert engine.pool.free_blocks == engine.pool.usable_blocks


def test_output_tokens_are_deterministic_and_never_special() -> None:
    excluded = frozenset(range(10))
    tokens = OutputTokens(64, excluded)
    key = tokens.request_key((5, 6, 7), None)
    assert [tokens.token(key, i) for i in range(50)] == [tokens.token(key, i) for i in range(50)]
    assert not {tokens.token(key, i) for i in range(500)} & excluded
    assert tokens.request_key((5, 6, 7), 3) != key  # a seed changes the output
    assert tokens.request_key((5, 6, 7), 3) == tokens.request_key((9,), 3)


def test_stop_strings_hold_back_what_may_start_one() -> None:
    stops = StopStrings(["END", "xx"])
    assert stops.push("abcE") == "ab"
    assert stops.push("N") == "c"
    assert stops.push("D!") == ""
    assert stops.matched == "END"
    assert stops.push("more") == ""
    plain = StopStrings([])
    assert plain.push("abc") == "abc"
    assert plain.flush() == ""


class _VirtualTime:
    """A clock that only moves when the runner sleeps, plus ``work_s`` of CPU work
    after each sleep (completing the step, delivering its tokens)."""

    def __init__(self, work_s: float = 0.0) -> None:
        self.now = 100.0
        self.work_s = work_s
        self.slept: list[float] = []

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.now += seconds + self.work_s


async def _three_tokens(time: _VirtualTime) -> EngineRunner:
    runner = EngineRunner(_engine(), time_scale=0.5, sleep=time.sleep, clock=time.clock)
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    stream = runner.submit(_request("a", 40, max_tokens=3))
    items = [await stream.get() for _ in range(3)]
    assert [i.finish_reason for i in items] == [None, None, "length"]
    stop.set()
    await task
    return runner


STEPS = [PROFILE.prefill_compute_s(40, 0), PROFILE.tbt_s(1, 41), PROFILE.tbt_s(1, 42)]


async def test_the_runner_sleeps_each_step_times_the_scale() -> None:
    time = _VirtualTime()
    runner = await _three_tokens(time)
    assert time.slept == pytest.approx([0.5 * s for s in STEPS])
    assert runner.busy_s == pytest.approx(sum(STEPS))


async def test_work_between_steps_overlaps_the_next_step() -> None:
    """Back to back, a step ends its profile time after the previous step's end: the
    work between them is absorbed, not added. Work longer than a step ends that step
    at once (never shorter than its profile time, no catching up)."""
    work = 0.25 * STEPS[1] * 0.5
    time = _VirtualTime(work_s=work)
    await _three_tokens(time)
    assert time.slept == pytest.approx(
        [0.5 * STEPS[0], 0.5 * STEPS[1] - work, 0.5 * STEPS[2] - work]
    )
    slow = _VirtualTime(work_s=max(STEPS))  # longer than any step at scale 0.5
    await _three_tokens(slow)
    assert slow.slept == pytest.approx([0.5 * STEPS[0], 0.0, 0.0])


def test_a_prompts_output_key_reads_each_id_as_four_little_endian_bytes() -> None:
    """The deterministic outputs of a prompt depend on its ids exactly as before."""
    import hashlib

    ids = [0, 1, 2047, 70_000, 2**31 - 1]
    digest = hashlib.blake2b(digest_size=8)
    for token in ids:
        digest.update(token.to_bytes(4, "little", signed=True))
    assert OutputTokens.request_key(ids, None) == int.from_bytes(digest.digest(), "little")
    assert OutputTokens.request_key(ids, 5) != OutputTokens.request_key(ids, None)
