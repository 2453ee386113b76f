"""Dockerfile and docker-compose.yml are checked statically (no Docker engine here):
every command they run must parse and validate against the real CLI and settings."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from conductor.settings import ConductorSettings
from kvc.cli import build_parser
from kvc.settings_cli import settings_from_args
from node_agent.settings import AgentSettings

ROOT = Path(__file__).resolve().parents[2]


def validate_command(argv: list[str]) -> None:
    ns = build_parser().parse_args(argv)
    if ns.command == "conductor":
        settings_from_args(ConductorSettings, ns)
    elif ns.command == "agent":
        settings_from_args(AgentSettings, ns)


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_compose_commands_are_valid() -> None:
    services = compose()["services"]
    assert {"conductor", "prefill", "decode"} <= set(services)
    for name, svc in services.items():
        validate_command(svc["command"])
        if "healthcheck" in svc:
            test = svc["healthcheck"]["test"]
            assert test[:3] == ["CMD", "kvc", "probe"], name
            build_parser().parse_args(test[2:])


def test_compose_agents_match_services() -> None:
    services = compose()["services"]
    command = services["conductor"]["command"]
    agents = command[command.index("--agents") + 1].split(",")
    for address in agents:
        host, _, port = address.partition(":")
        assert host in services
        svc_cmd = services[host]["command"]
        assert svc_cmd[svc_cmd.index("--port") + 1] == port
        assert svc_cmd[svc_cmd.index("--advertise-address") + 1] == address


def test_dockerfile_is_multi_stage_non_root_with_healthcheck() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+\S+\s+AS\s+(\w+)", text, flags=re.MULTILINE)
    assert len(stages) >= 2
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.MULTILINE)
    assert users
    assert users[-1] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK .*", text, flags=re.MULTILINE)
    for src in re.findall(r"^COPY\s+(?!--from)(\S+)", text, flags=re.MULTILINE):
        assert (ROOT / src).exists(), f"Dockerfile copies missing path {src}"
    cmd = re.search(r"^CMD\s+(\[.*\])", text, flags=re.MULTILINE)
    assert cmd is not None
    validate_command(yaml.safe_load(cmd.group(1)))


@pytest.mark.parametrize("command", ["conductor", "agent"])
def test_help_documents_every_setting(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    settings = ConductorSettings if command == "conductor" else AgentSettings
    for name in settings.model_fields:
        assert f"--{name.replace('_', '-')}" in out
