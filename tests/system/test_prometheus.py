"""System tier: a real Prometheus server scrapes a running kv-conductor.

A conductor, a prefill agent and a decode agent run as processes (``python -m kvc_cli.cli``),
the agents with ``--metrics-port``; Prometheus (Debian's ``prometheus`` 2.x) runs with a
generated configuration that scrapes all three under the job names the alert rules use
and loads deploy/prometheus/alerts.yml. After a few chat requests, Prometheus's HTTP API
must return the expected request and transaction counts, and every Grafana dashboard
query must run. Everything started here is stopped, and no port stays open.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvc.processes import free_port
from tests.system.test_processes import MODEL, port_open, spawn, stop, wait_ready
from tests.tooling import require_tool
from tests.unit.test_grafana_dashboard import queries as dashboard_queries

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = 3
SCRAPE_TIMEOUT_S = 60.0
# Longer than one block of the tiny model (32 tokens), so every request holds a Tx.
PROMPT = " ".join(f"word{i}" for i in range(120))


@dataclass
class Running:
    base: str
    prometheus: str
    ports: list[int]


def prometheus_config(http_port: int, metrics_ports: list[int]) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ROOT / "deploy/prometheus/alerts.yml")],
        "scrape_configs": [
            {
                "job_name": "kvc-conductor",
                "static_configs": [{"targets": [f"127.0.0.1:{http_port}"]}],
            },
            {
                "job_name": "kvc-agent",
                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in metrics_ports]}],
            },
        ],
    }


def wait_prometheus_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/-/ready", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"prometheus not ready:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    prometheus_bin = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    http_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    metrics_ports = [free_port(), free_port()]
    prom_port = free_port()
    agent = ["agent", "--host", "127.0.0.1", "--threads", "1"]
    logs = [tmp / "prefill.log", tmp / "decode.log", tmp / "conductor.log"]
    procs = [
        spawn(
            [*agent, "--role", "prefill", "--port", str(prefill_port),
             "--metrics-port", str(metrics_ports[0])],
            logs[0],
        ),
        spawn(
            [*agent, "--role", "decode", "--port", str(decode_port),
             "--metrics-port", str(metrics_ports[1])],
            logs[1],
        ),
        spawn(
            ["conductor", "--port", str(http_port),
             "--agents", f"127.0.0.1:{prefill_port},127.0.0.1:{decode_port}"],
            logs[2],
        ),
    ]  # fmt: skip
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(http_port, metrics_ports)))
    prom_log = tmp / "prometheus-server.log"
    with prom_log.open("wb") as out:
        prometheus = subprocess.Popen(
            [
                prometheus_bin,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    procs.append(prometheus)
    url = f"http://127.0.0.1:{prom_port}"
    ports = [http_port, prefill_port, decode_port, *metrics_ports, prom_port]
    try:
        wait_prometheus_ready(url, prometheus, prom_log)
        wait_ready(f"http://127.0.0.1:{http_port}", procs[:3], logs)
        yield Running(base=f"http://127.0.0.1:{http_port}", prometheus=url, ports=ports)
    finally:
        codes = stop(procs)
    assert codes == [0, 0, 0, 0], [p.read_text()[-2000:] for p in [*logs, prom_log]]
    assert not any(port_open(p) for p in ports), "a port stayed open"


def query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=5.0)
    body = r.json()
    assert r.status_code == 200, (promql, body)
    assert body["status"] == "success", (promql, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def scalar(prometheus: str, promql: str) -> float | None:
    result = query(prometheus, promql)
    return float(result[0]["value"][1]) if result else None


def wait_for(prometheus: str, expected: dict[str, float]) -> None:
    """Wait until every query returns its expected value (Prometheus scrapes every 1 s)."""
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    seen: dict[str, float | None] = {}
    while time.monotonic() < deadline:
        seen = {q: scalar(prometheus, q) for q in expected}
        if seen == expected:
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus has {json.dumps(seen)}, expected {json.dumps(expected)}")


def test_prometheus_scrapes_the_running_system(running: Running) -> None:
    with httpx.Client(base_url=running.base, timeout=120.0) as client:
        for i in range(REQUESTS):
            r = client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"{PROMPT} {i}"}],
                    "max_tokens": 4,
                    "temperature": 0,
                },
            )
            assert r.status_code == 200, r.text
    p = running.prometheus
    wait_for(
        p,
        {
            'sum(up{job="kvc-conductor"})': 1.0,
            'sum(up{job="kvc-agent"})': 2.0,
            'sum(conductor_requests_total{outcome="success"})': float(REQUESTS),
            'sum(conductor_requests_total{outcome!="success"})': 0.0,
            'sum(node_agent_tx_total{op="allocate",outcome="ok"})': float(REQUESTS),
            'sum(node_agent_tx_total{op="commit",outcome="ok"})': float(REQUESTS),
            'sum(node_agent_tx_total{outcome!="ok"})': 0.0,
            'count(node_agent_info{role="prefill",model="tiny-llama",engine="embedded"})': 1.0,
            "sum(node_agent_open_transactions)": 0.0,
            "sum(node_agent_kv_locked_blocks)": 0.0,
            "sum(node_agent_watch_subscribers)": 2.0,
            "sum(conductor_agent_up)": 2.0,
        },
    )
    # The prompt's KV went prefill → decode: the same bytes sent and received.
    sent = scalar(p, 'sum(node_agent_kv_transfer_bytes_total{direction="sent",kind="handoff"})')
    got = scalar(p, 'sum(node_agent_kv_transfer_bytes_total{direction="received",kind="handoff"})')
    assert sent is not None
    assert sent > 0
    assert sent == got
    assert scalar(p, "sum(conductor_time_to_first_token_seconds_count)") == REQUESTS
    # The allocations rode in Prefill (fused Tx): no TxAllocate or TxCommit call.
    assert scalar(p, 'sum(conductor_agent_calls_total{method="Prefill",code="OK"})') == REQUESTS
    assert scalar(p, 'sum(conductor_agent_calls_total{method="TxAllocate",code="OK"})') == 0


def test_rules_load_and_dashboard_queries_run(running: Running) -> None:
    r = httpx.get(f"{running.prometheus}/api/v1/rules", timeout=5.0).json()
    groups = {g["name"]: g for g in r["data"]["groups"]}
    assert set(groups) == {"kvc-recording", "kvc-alerts"}
    for group in groups.values():
        for rule in group["rules"]:
            assert rule["health"] in ("ok", "unknown"), rule  # unknown: not evaluated yet
    for promql in dashboard_queries():
        query(running.prometheus, promql)  # asserts success
