"""Both services' /metrics follow Prometheus conventions (STYLE.md principle 15).

The registries are rendered after every label value has been exercised, then checked
twice: here, rule by rule (prefix, snake case, base units, ``_total`` on counters only,
ratios 0–1 (gauges; a ratio histogram may exceed 1), help text, every label value from
a fixed set), and by ``promtool check metrics``, Prometheus's own linter. Also: every
label value the code can record comes from the sets the metrics modules declare, and
docs/operations.md lists every metric.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

from conductor import metrics as cm
from conductor.core.scheduler import RejectReason
from kvc.roles import NODE_ROLES
from node_agent import metrics as am
from tests.metrics_catalog import AGENT_ADDRESSES, exposition_texts, families
from tests.tooling import require_tool, run_tool

ROOT = Path(__file__).resolve().parents[2]
PREFIX = {"conductor": "conductor_", "node_agent": "node_agent_"}
# prometheus_client's process, platform and GC collectors: standard names, no prefix.
STANDARD_FAMILIES = {
    "process_virtual_memory_bytes",
    "process_resident_memory_bytes",
    "process_start_time_seconds",
    "process_cpu_seconds",
    "process_open_fds",
    "process_max_fds",
    "python_gc_objects_collected",
    "python_gc_objects_uncollectable",
    "python_gc_collections",
    "python_info",
}
# Their labels: a GC generation (0-2) and python_info's version fields (one series).
STANDARD_LABELS = {"generation", "implementation", "major", "minor", "patchlevel", "version"}
NAME_RE = re.compile(r"^[a-z][a-z0-9_]*$")

# Every label a metric may carry, with the values it may take (None: taken from the
# service's configuration, checked separately).
ALLOWED_LABELS: dict[str, tuple[str, ...] | None] = {
    "endpoint": cm.ENDPOINTS,
    "outcome": (*cm.OUTCOMES, *am.TX_OUTCOMES, *cm.RETENTION_OUTCOMES, *am.RETENTION_OUTCOMES),
    "reason": cm.REJECTION_REASONS,
    "source": (*cm.PROMPT_SOURCES, *am.TOKEN_SOURCES),
    "role": NODE_ROLES,
    "quantity": cm.PREDICTED_QUANTITIES,
    "method": cm.AGENT_METHODS,
    "code": cm.GRPC_CODES,
    "op": am.TX_OPS,
    "state": am.BLOCK_STATES,
    "medium": am.TIER_MEDIA,
    "direction": am.TRANSFER_DIRECTIONS,
    "kind": (*am.TRANSFER_KINDS, *am.EVENT_KINDS),
    "agent": None,  # configured or registry-discovered agent addresses
    "engine": None,  # node_agent_info: configured engine adapter
    "model": None,  # node_agent_info: configured served model name
    "le": None,  # histogram buckets
}
CONFIGURED_LABELS = {
    "agent": set(AGENT_ADDRESSES),
    "engine": {"embedded"},
    "model": {"tiny-llama"},
}
# Words that mean a non-base unit; base units are seconds and bytes.
NON_BASE_UNITS = re.compile(
    r"_(ms|milliseconds|us|microseconds|ns|minutes|hours|kb|mb|gb|kib|mib|gib|percent)(_|$)"
)


@pytest.fixture(scope="module")
def texts() -> dict[str, str]:
    return exposition_texts()


@pytest.mark.parametrize("service", ["conductor", "node_agent"])
def test_names_units_and_types(texts: dict[str, str], service: str) -> None:
    fams = families(texts[service])
    assert fams, "nothing exported"
    assert {"process_resident_memory_bytes", "python_info"} <= set(fams), service
    for name, (mtype, help_text, samples) in fams.items():
        if name in STANDARD_FAMILIES:
            continue
        assert name.startswith(PREFIX[service]), name
        assert NAME_RE.match(name), f"{name}: not snake case (and no colons)"
        assert help_text.strip(), f"{name}: no help text"
        assert not NON_BASE_UNITS.search(name), f"{name}: use base units (seconds, bytes)"
        assert mtype in ("counter", "gauge", "histogram"), (name, mtype)
        for sample in samples:
            if mtype == "counter":
                assert sample.name.endswith("_total"), f"{sample.name}: counter without _total"
            else:
                assert not sample.name.endswith("_total"), f"{sample.name}: _total on a {mtype}"
        if mtype == "histogram":  # durations, or predicted/actual ratios of durations
            assert name.endswith(("_seconds", "_ratio")), f"{name}: histogram of what unit?"
        if "bytes" in name:
            assert name.endswith(("_bytes", "_bytes_total")), f"{name}: bytes is the unit suffix"
        if name.endswith("_ratio") and mtype != "histogram":
            assert all(0.0 <= s.value <= 1.0 for s in samples), f"{name}: a ratio is 0-1"
        if "seconds" in name:
            assert name.endswith(("_seconds", "_seconds_total")), name


@pytest.mark.parametrize("service", ["conductor", "node_agent"])
def test_labels_are_bounded(texts: dict[str, str], service: str) -> None:
    for name, (_type, _help, samples) in families(texts[service]).items():
        for sample in samples:
            for label, value in sample.labels.items():
                if name in STANDARD_FAMILIES and label in STANDARD_LABELS:
                    assert label != "generation" or value in ("0", "1", "2"), (name, value)
                    continue
                assert label in ALLOWED_LABELS, (
                    f"{name}: label {label!r} is not a known bounded one"
                )
                allowed = ALLOWED_LABELS[label]
                if allowed is not None:
                    assert value in allowed, f"{name}{{{label}={value!r}}}: not in {allowed}"
                elif label in CONFIGURED_LABELS:
                    assert value in CONFIGURED_LABELS[label], (name, label, value)


@pytest.mark.parametrize("service", ["conductor", "node_agent"])
def test_promtool_check_metrics_is_clean(texts: dict[str, str], service: str) -> None:
    promtool = require_tool("promtool")
    output = run_tool([promtool, "check", "metrics"], input_text=texts[service])
    assert output.strip() == "", output


def test_every_rejection_reason_the_code_records_is_declared() -> None:
    assert set(typing.get_args(RejectReason)) <= set(cm.REJECTION_REASONS)
    code = "\n".join(p.read_text() for p in (ROOT / "conductor").rglob("*.py"))
    literals = set(re.findall(r'rejections\.labels\("([a-z_]+)"\)', code))
    literals |= set(re.findall(r'\breason="([a-z_]+)"', code))
    literals |= set(re.findall(r'\.refuse\("([a-z_]+)"\)', code))
    assert literals, "found no recording site: the pattern is stale"
    assert literals <= set(cm.REJECTION_REASONS), literals - set(cm.REJECTION_REASONS)
    assert cm.rejection_reason("something new") == "other"


def test_agent_call_labels_are_bounded() -> None:
    m = cm.ConductorMetrics()
    m.record_agent_call("/kvc.v1.NodeAgent/TxAllocate", "RESOURCE_EXHAUSTED")
    m.record_agent_call(b"/evil/whatever".decode(), "NOT_A_CODE")
    assert m.agent_calls.labels("TxAllocate", "RESOURCE_EXHAUSTED")._value.get() == 1
    assert m.agent_calls.labels("other", "UNKNOWN")._value.get() == 1


def test_agent_up_forgets_agents_that_left() -> None:
    from tests.metrics_catalog import FakeAgent

    m = cm.ConductorMetrics()
    m.refresh_agents([FakeAgent("a:1", True, True, "both"), FakeAgent("b:1", True, True, "both")])
    m.refresh_agents([FakeAgent("a:1", False, False, "both")])
    text = m.exposition().decode()
    assert 'conductor_agent_up{agent="a:1"} 0.0' in text
    assert 'agent="b:1"' not in text


def test_redis_up_only_with_redis() -> None:
    without = cm.ConductorMetrics(redis=False)
    without.set_redis_up(False)  # a Redis callback without Redis: nothing to say
    assert "conductor_redis_up" not in without.exposition().decode()
    with_redis = cm.ConductorMetrics(redis=True)
    with_redis.set_redis_up(False)
    assert "conductor_redis_up 0.0" in with_redis.exposition().decode()


def test_tx_outcomes_cover_the_pool_errors() -> None:
    from node_agent.blocks.types import (
        BlockPoolError,
        CapacityExhausted,
        InvalidArgument,
        TxClosed,
        TxExpired,
        TxNotFound,
    )

    cases: list[tuple[BaseException | None, str]] = [
        (None, "ok"),
        (CapacityExhausted(4, 1), "capacity"),
        (InvalidArgument("bad"), "invalid"),
        (TxNotFound("t"), "not_found"),
        (TxExpired("t"), "expired"),
        (TxClosed("t", "aborted"), "closed"),
        (BlockPoolError("?"), "error"),
    ]
    for exc, outcome in cases:
        assert am.tx_outcome(exc) == outcome
        assert outcome in am.TX_OUTCOMES


def test_operations_guide_lists_every_metric(texts: dict[str, str]) -> None:
    guide = (ROOT / "docs" / "operations.md").read_text()
    for text in texts.values():
        for name, (mtype, _help, _samples) in families(text).items():
            shown = f"{name}_total" if mtype == "counter" else name
            assert f"`{shown}`" in guide, f"docs/operations.md does not list {shown}"
