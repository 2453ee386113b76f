"""Reading prompt-cache breakpoints from requests and counting what they wrote."""

from __future__ import annotations

from typing import Any

import pytest

from conductor.api.prompt_cache import TenantCacheLedger, read_marks, retention_ttl_s
from conductor.dispatch import retention_of
from conductor.errors import InvalidRequest, UnprocessableEntity
from conductor.generation import Breakpoint, cache_writes
from kvc.tokenization import ChatMark

EPHEMERAL = {"type": "ephemeral"}
HOUR = {"type": "ephemeral", "ttl": "1h"}


def test_marks_come_in_prompt_order_and_leave_a_clean_request() -> None:
    tools: list[Any] = [
        {"type": "function", "function": {"name": "a"}},
        {"type": "function", "function": {"name": "b"}, "cache_control": HOUR},
    ]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": [{"type": "text", "text": "sys", "cache_control": HOUR}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "one", "cache_control": EPHEMERAL},
                {"type": "text", "text": "two"},
            ],
        },
        {"role": "assistant", "content": "ok", "cache_control": EPHEMERAL},
    ]
    got = read_marks(messages, tools, max_ttl_s=3600.0)
    assert got.marks == [
        ChatMark(tool=1),
        ChatMark(message=0),
        ChatMark(message=1, cut=len("one")),
        ChatMark(message=2),
    ]
    assert got.ttls_s == [3600.0, 3600.0, 300.0, 300.0]
    assert "cache_control" not in str(got.messages) + str(got.tools)
    assert "cache_control" in str(messages)  # the caller's request is not changed


@pytest.mark.parametrize(
    ("cache_control", "needle"),
    [
        ({"type": "persistent"}, "'ephemeral'"),
        ({"type": "ephemeral", "ttl": "30m"}, "'5m' or '1h'"),
        ({"type": "ephemeral", "scope": "global"}, "unknown field"),
        ("ephemeral", "must be an object"),
    ],
)
def test_malformed_cache_control_is_a_400(cache_control: Any, needle: str) -> None:
    messages = [{"role": "user", "content": "x", "cache_control": cache_control}]
    with pytest.raises(InvalidRequest) as info:
        read_marks(messages, None, max_ttl_s=3600.0)
    assert needle in info.value.message
    assert info.value.param == "messages[0].cache_control"


def test_anthropics_rules_on_count_and_ttl_order() -> None:
    five = [{"role": "user", "content": "x", "cache_control": EPHEMERAL}] * 5
    with pytest.raises(InvalidRequest, match="A maximum of 4 blocks"):
        read_marks(five, None, max_ttl_s=3600.0)
    growing = [
        {"role": "system", "content": "s", "cache_control": EPHEMERAL},
        {"role": "user", "content": "u", "cache_control": HOUR},
    ]
    with pytest.raises(InvalidRequest, match="longer TTL may not follow"):
        read_marks(growing, None, max_ttl_s=3600.0)
    with pytest.raises(UnprocessableEntity):
        read_marks(growing[1:], None, max_ttl_s=600.0)


def test_prompt_cache_retention_values() -> None:
    assert retention_ttl_s(None, 3600.0) is None
    assert retention_ttl_s("in_memory", 3600.0) is None
    assert retention_ttl_s("24h", 86_400.0) == 86_400.0
    with pytest.raises(UnprocessableEntity):
        retention_ttl_s("24h", 3600.0)
    with pytest.raises(InvalidRequest):
        retention_ttl_s("1w", 86_400.0)


def test_breakpoints_become_whole_blocks_within_the_tx() -> None:
    bps = [Breakpoint(100, 3600.0), Breakpoint(130, 300.0), Breakpoint(31, 300.0)]
    got = [(r.blocks, r.ttl_s) for r in retention_of(bps, block_size=32, n_keys=3)]
    # 100 -> 3 blocks, 130 -> 4 blocks capped at the Tx's 3 (the longest TTL), 31 -> none.
    assert got == [(3, 3600.0)]


def test_cache_writes_are_counted_from_the_cached_prefix_per_ttl() -> None:
    bps = [Breakpoint(500, 3600.0), Breakpoint(800, 300.0)]
    assert cache_writes(bps, 0, "granted") == {3600.0: 500, 300.0: 300}
    assert cache_writes(bps, 600, "granted") == {300.0: 200}
    assert cache_writes(bps, 900, "granted") == {}
    assert cache_writes(bps, 0, "over_budget") == {}


def test_the_ledger_is_bounded() -> None:
    ledger = TenantCacheLedger(max_tenants=2)
    for name in ("a", "b", "c"):
        ledger.record(name, read_tokens=5, breakpoints=(), retention="none", written_tokens=0)
    assert set(ledger.snapshot()) == {"b", "c"}
    assert ledger.dropped_tenants == 1
    ledger.record(
        "b",
        read_tokens=1,
        breakpoints=(Breakpoint(64, 300.0),),
        retention="granted",
        written_tokens=64,
    )
    ledger.record("b", read_tokens=0, breakpoints=(), retention="node_full", written_tokens=0)
    assert ledger.snapshot()["b"] == {
        "retention_requests": 2,
        "written_tokens": 64,
        "read_tokens": 6,
        "retained_tokens": 64,
        "retention_refused": 1,
    }


def test_a_segment_is_written_under_the_longest_ttl_that_retains_it() -> None:
    """The template may render a 5-minute system mark before a 1-hour tools mark: the
    node keeps the system prompt an hour (the longest TTL covering it), so it is a
    1-hour write."""
    bps = [Breakpoint(9, 300.0), Breakpoint(102, 3600.0)]
    assert cache_writes(bps, 0, "granted") == {3600.0: 102}
