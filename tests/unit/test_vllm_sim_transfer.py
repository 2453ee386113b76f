"""The simulated engines' KV pull lasts its profile time from its start: the side
channel's HTTP exchange is inside that time, not added to it."""

from __future__ import annotations

import httpx
import pytest

from kvc_sim.profile import load_profile
from kvc_sim.vllm_sim.transfer import PULL_PATH, KvPuller, KvPullError, RemotePrefill

PROFILE = load_profile("llama3-70b-8xa800")
REMOTE = RemotePrefill(engine_id="prefill-0", request_id="r1", host="10.0.0.1", port=9000)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def puller(clock: Clock, exchange_s: float, tokens: int, status: int = 200) -> KvPuller:
    def side_channel(request: httpx.Request) -> httpx.Response:
        assert request.url.path == PULL_PATH
        clock.now += exchange_s  # the round trip takes this long
        return httpx.Response(status, json={"num_tokens": tokens})

    http = httpx.AsyncClient(transport=httpx.MockTransport(side_channel))
    return KvPuller(http, PROFILE, time_scale=2.0, sleep=clock.sleep, clock=clock)


@pytest.mark.parametrize("exchange_s", [0.0, 0.004, 0.03])
async def test_a_pull_lasts_its_scaled_profile_time_from_its_start(exchange_s: float) -> None:
    clock = Clock()
    pull = puller(clock, exchange_s, tokens=8192)
    expected_s = pull.transfer_s(8192) * 2.0
    assert expected_s > 0.03  # the exchanges above fit inside it
    assert await pull.pull(REMOTE) == 8192
    assert clock.now - 100.0 == pytest.approx(expected_s)
    assert clock.slept == [pytest.approx(expected_s - exchange_s)]
    assert (pull.pulls, pull.failures) == (1, 0)


async def test_an_exchange_longer_than_the_transfer_adds_no_wait() -> None:
    clock = Clock()
    pull = puller(clock, exchange_s=5.0, tokens=16)
    assert pull.transfer_s(16) * 2.0 < 5.0
    assert await pull.pull(REMOTE) == 16
    assert clock.slept == [0.0]


async def test_a_refused_pull_waits_for_nothing() -> None:
    clock = Clock()
    pull = puller(clock, exchange_s=0.01, tokens=0, status=404)
    with pytest.raises(KvPullError, match="answered 404"):
        await pull.pull(REMOTE)
    assert clock.slept == []
    assert (pull.pulls, pull.failures) == (0, 1)
