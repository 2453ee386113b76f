"""Both services' metrics with every label value exercised, and the names they export.

Used by the conventions test (names, units, labels, promtool), the alert-rule test
and the dashboard test (every query names a metric that exists).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from conductor import metrics as cm
from kvc.roles import NODE_ROLES
from node_agent import metrics as am
from node_agent.blocks.pool import BlockPool
from node_agent.engines.base import EngineLoad

AGENT_ADDRESSES = ("prefill-0:50051", "decode-0:50051")


@dataclass(frozen=True)
class FakeAgent:
    """An agent handle as the conductor's metrics read it."""

    address: str
    reachable: bool
    usable: bool
    role: str


def exercised_conductor() -> cm.ConductorMetrics:
    m = cm.ConductorMetrics()
    for endpoint in cm.ENDPOINTS:
        m.request_duration.labels(endpoint).observe(0.5)
        m.ttft.labels(endpoint).observe(0.1)
        m.tbt.labels(endpoint).observe(0.02)
    m.observe_decision(0.0003)
    for quantity in cm.PREDICTED_QUANTITIES:
        for role in NODE_ROLES:
            m.observe_prediction(quantity, role, 0.9, 1.0)
    m.count_would_have_hit(64)
    m.event_lag.observe(0.002)
    for method in cm.AGENT_METHODS:
        for code in cm.GRPC_CODES:
            m.record_agent_call(f"/kvc.v1.NodeAgent/{method}", code)
    m.refresh_agents(
        [
            FakeAgent(AGENT_ADDRESSES[0], reachable=True, usable=True, role="prefill"),
            FakeAgent(AGENT_ADDRESSES[1], reachable=False, usable=False, role="decode"),
        ]
    )
    return m


def exercised_agent() -> am.AgentMetrics:
    m = am.AgentMetrics()
    m.set_info(role="prefill", engine="embedded", model="tiny-llama")
    for op in am.TX_OPS:
        for outcome in am.TX_OUTCOMES:
            m.tx.labels(op, outcome).inc()
    for direction in am.TRANSFER_DIRECTIONS:
        for kind in am.TRANSFER_KINDS:
            m.record_transfer(direction, kind, 1 << 20, 0.01)
    m.prefill_seconds.observe(0.2)
    pool = BlockPool(capacity_blocks=8, clock=lambda: 0.0)
    m.refresh(pool, EngineLoad(queued_prefill_tokens=3, running_requests=1, waiting_requests=2), 0)
    return m


def exposition_texts() -> dict[str, str]:
    """Service name → its /metrics text (Prometheus text format 0.0.4)."""
    return {
        "conductor": exercised_conductor().exposition().decode(),
        "node_agent": exercised_agent().exposition()[0].decode(),
    }


def families(text: str) -> dict[str, tuple[str, str, list[Sample]]]:
    """Family name → (type, help, samples), leaving out prometheus_client's ``*_created``."""
    out: dict[str, tuple[str, str, list[Sample]]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name.endswith("_created") and fam.type == "gauge":
            continue
        out[fam.name] = (fam.type, fam.documentation, list(fam.samples))
    return out


def exported_names() -> set[str]:
    """Every sample name a scrape of either service can return (``_bucket``, ``_total``…)."""
    names: set[str] = set()
    for text in exposition_texts().values():
        for _type, _help, samples in families(text).values():
            names.update(s.name for s in samples)
    return names
