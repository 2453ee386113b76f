"""deploy/grafana/kv-conductor.json: a Grafana dashboard whose every query is valid PromQL
(``promtool check rules`` on the queries written as recording rules) and names only
metrics the services export, laid out on the 24-column grid without overlaps, with the
panels the operations guide refers to. The system test (tests/system/test_prometheus.py)
also runs every query against a real Prometheus scraping a running system."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.metrics_catalog import exported_names
from tests.tooling import require_tool, run_tool

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/kv-conductor.json"
METRIC_RE = re.compile(r"(?<![\w:])(?:conductor|node_agent)_[a-z0-9_]+\b")
REQUIRED_PANELS = [
    "Request rate by outcome",
    "Refusals (429/503) by reason",
    "Time to first token",
    "Time between tokens",
    "Prompt tokens by KV source",
    "Scheduling decision latency",
    "Shadow index event lag",
    "KV blocks by state",
    "Locked blocks and open transactions",
    "Lease expiries",
    "KV transfer throughput",
]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def queries() -> list[str]:
    """Every panel query, with Grafana's variables given concrete values."""
    out = []
    for panel in panels():
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "5m")
            out.append(expr.replace("$conductor", ".*").replace("$agent", ".*"))
    return out


def test_dashboard_structure() -> None:
    d = dashboard()
    assert d["uid"] == "kv-conductor"
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    titles = {p["title"] for p in panels()}
    assert set(REQUIRED_PANELS) <= titles, set(REQUIRED_PANELS) - titles
    for panel in panels():
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        assert panel["description"], panel["title"]
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]


def test_panels_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0, panel["title"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_queries_name_only_exported_metrics() -> None:
    exported = exported_names()
    for expr in queries():
        names = METRIC_RE.findall(expr)
        assert names or expr.startswith("up{"), expr
        for name in names:
            assert name in exported, f"no metric {name} in: {expr}"
    for variable in dashboard()["templating"]["list"]:
        for name in METRIC_RE.findall(variable.get("definition", "")):
            assert name in exported, name


def test_queries_are_valid_promql(tmp_path: Path) -> None:
    promtool = require_tool("promtool")
    rules = [
        {"record": f"kvc:dashboard_query_{i}:check", "expr": q} for i, q in enumerate(queries())
    ]
    path = tmp_path / "queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    output = run_tool([promtool, "check", "rules", str(path)])
    assert f"SUCCESS: {len(rules)} rules found" in output, output
