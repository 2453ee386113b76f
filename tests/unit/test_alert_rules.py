"""deploy/prometheus/alerts.yml: valid (``promtool check rules``), tested (``promtool test
rules`` runs alerts_test.yml: every alert fires on a history that should page and stays
quiet on one that should not), built only on metrics the services export, and every
alert has its section in docs/operations.md."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tests.metrics_catalog import exported_names
from tests.tooling import require_tool, run_tool

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy/prometheus/alerts.yml"
METRIC_RE = re.compile(r"(?<![\w:])(?:conductor|node_agent)_[a-z0-9_]+\b")


def rules() -> list[dict[str, Any]]:
    data = yaml.safe_load(RULES.read_text())
    return [rule for group in data["groups"] for rule in group["rules"]]


def test_promtool_check_rules() -> None:
    promtool = require_tool("promtool")
    output = run_tool([promtool, "check", "rules", str(RULES)])
    assert "SUCCESS" in output


def test_promtool_test_rules() -> None:
    promtool = require_tool("promtool")
    output = run_tool([promtool, "test", "rules", "alerts_test.yml"], cwd=RULES.parent)
    assert "SUCCESS" in output


def test_every_alert_is_unit_tested() -> None:
    tests = yaml.safe_load((RULES.parent / "alerts_test.yml").read_text())
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts == fired, f"alerts never seen firing in alerts_test.yml: {alerts - fired}"


def test_rules_use_only_exported_metrics() -> None:
    exported = exported_names()
    recorded = {r["record"] for r in rules() if "record" in r}
    for rule in rules():
        for name in METRIC_RE.findall(rule["expr"]):
            assert name in exported, f"{rule.get('alert') or rule.get('record')}: no metric {name}"
        for name in re.findall(r"\bkvc:[a-z0-9_:]+", rule["expr"]):
            assert name in recorded, f"{rule.get('alert')}: no recording rule {name}"
    for name in recorded:
        assert re.match(r"^kvc:[a-z0-9_]+:[a-z0-9_]+$", name), f"{name}: level:metric:operations"


def test_every_alert_has_a_runbook_section() -> None:
    guide = (ROOT / "docs/operations.md").read_text()
    headings = {
        re.sub(r"[^a-z0-9 -]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", guide, flags=re.MULTILINE)
    }
    for rule in rules():
        if "alert" in rule:
            anchor = rule["annotations"]["runbook"].split("#", 1)[1]
            assert anchor == rule["alert"].lower()
            assert anchor in headings, f"docs/operations.md has no section {rule['alert']}"
            assert rule["labels"]["severity"] in ("warning", "critical")
