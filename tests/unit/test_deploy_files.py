"""Dockerfile, docker-compose.yml and deploy/ are checked statically (no Docker engine here).

Every kvc command they run must parse and validate against the real CLI and settings.
Each Dockerfile target (``conductor``: the core install; ``agent``: the embedded and vllm
extras) runs as non-root with a healthcheck, and .dockerignore lets in exactly what the
Dockerfile copies. The compose topology must hang together (each service runs its role's
image, agents register in the Redis the conductors read, Prometheus scrapes every
conductor and agent on the ports they serve, Grafana gets the data source and the
dashboard); Prometheus's own ``promtool`` checks the scrape config; yamllint checks every
YAML file; checkov checks the Dockerfile.

Not checked here, because nothing can run containers on these machines: that the
images build, that the containers start and pass their healthchecks, and the flags of
third-party images (redis, prometheus, grafana) beyond their pinned tags.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from conductor.settings import ConductorSettings
from kvc_cli.cli import build_parser
from kvc_cli.settings_cli import settings_from_args
from node_agent.settings import AgentSettings
from tests.tooling import require_tool, run_tool

ROOT = Path(__file__).resolve().parents[2]


def tls_env(role: str, certs: Path) -> dict[str, str]:
    """The TLS files a deployment mounts at /certs, here from a real bundle."""
    name = {"conductor": "conductor", "agent": "agent"}[role]
    return {
        f"KVC_{role.upper()}_TLS_CERT_FILE": str(certs / f"{name}.pem"),
        f"KVC_{role.upper()}_TLS_KEY_FILE": str(certs / f"{name}-key.pem"),
        f"KVC_{role.upper()}_TLS_CA_FILE": str(certs / "ca.pem"),
    }


def validate_command(argv: list[str], env: dict[str, str] | None = None) -> None:
    """Parse and validate a kvc command line, with ``env`` as its environment."""
    ns = build_parser().parse_args(argv)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in (env or {}).items():
            mp.setenv(key, value)
        if ns.command == "conductor":
            settings_from_args(ConductorSettings, ns)
        elif ns.command == "agent":
            settings_from_args(AgentSettings, ns)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def kvc_services(role: str) -> dict[str, list[str]]:
    """Compose services running ``kvc <role>`` (conductor | agent) → their command."""
    return {
        name: svc["command"]
        for name, svc in compose()["services"].items()
        if "build" in svc and svc["command"][0] == role
    }


def test_compose_commands_are_valid(tls_bundle: Path) -> None:
    services = compose()["services"]
    for name, svc in services.items():
        if "build" in svc:
            env = {
                key: str(tls_bundle / Path(value).name) if value.startswith("/certs/") else value
                for key, value in (svc.get("environment") or {}).items()
            }
            validate_command(svc["command"], env)
            if svc["command"][0] == "certs":  # a one-shot job, no healthcheck
                assert svc["healthcheck"] == {"disable": True}
                continue
            test = svc["healthcheck"]["test"]
            assert test[:3] == ["CMD", "kvc", "probe"], name
            build_parser().parse_args(test[2:])
        else:
            image = svc["image"]
            assert re.match(r"^[\w./-]+:[\w.-]+$", image), f"{name}: pin the image tag"
            assert not image.endswith(":latest"), name


def test_compose_grpc_is_mtls_with_certificates_made_on_up() -> None:
    services = compose()["services"]
    certs = services["certs"]
    assert certs["command"][:3] == ["certs", "--out", "/certs"]
    assert certs["volumes"] == ["kvc-certs:/certs"]
    assert "kvc-certs" in compose()["volumes"]
    for role in ("conductor", "agent"):
        for name in kvc_services(role):
            svc = services[name]
            env = svc["environment"]
            prefix = f"KVC_{role.upper()}_"
            assert env[prefix + "TLS_CERT_FILE"] == f"/certs/{role}.pem", name
            assert env[prefix + "TLS_KEY_FILE"] == f"/certs/{role}-key.pem", name
            assert env[prefix + "TLS_CA_FILE"] == "/certs/ca.pem", name
            assert prefix + "GRPC_PLAINTEXT" not in env, name
            assert "--grpc-plaintext" not in svc["command"], name
            assert "kvc-certs:/certs:ro" in svc["volumes"], name
            assert svc["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
            if role == "agent":
                assert svc["healthcheck"]["test"][-1] == "grpcs://127.0.0.1:50051", name


def test_compose_runs_the_whole_system() -> None:
    services = compose()["services"]
    conductors = kvc_services("conductor")
    agents = kvc_services("agent")
    assert len(conductors) == 2
    assert sorted(flag(cmd, "--role") or "" for cmd in agents.values()) == ["decode", "prefill"]
    assert {"redis", "prometheus", "grafana"} <= set(services)


def test_compose_agents_are_reachable_by_every_conductor() -> None:
    services = compose()["services"]
    agents = kvc_services("agent")
    redis_urls = set()
    for name, cmd in agents.items():
        port = flag(cmd, "--port")
        assert flag(cmd, "--advertise-address") == f"{name}:{port}", name
        redis_urls.add(flag(cmd, "--redis-url"))
    for name, cmd in kvc_services("conductor").items():
        static = flag(cmd, "--agents")
        if static:
            for address in static.split(","):
                host, _, port = address.partition(":")
                assert flag(agents[host], "--port") == port, (name, address)
        else:  # discovery: the conductor reads the registry every agent writes to
            assert redis_urls == {flag(cmd, "--redis-url")}, name
        for dependency in ("redis", *agents):
            assert dependency in services[name]["depends_on"], (name, dependency)
    for url in redis_urls:
        assert url is not None
        assert url.startswith("redis://redis:6379"), url


def prometheus_config() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    return data


def test_prometheus_config_is_valid() -> None:
    promtool = require_tool("promtool")
    run_tool([promtool, "check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")])


def test_compose_prometheus_scrapes_every_kvc_process() -> None:
    jobs = {
        job["job_name"]: {t for sc in job["static_configs"] for t in sc["targets"]}
        for job in prometheus_config()["scrape_configs"]
    }
    conductors = {
        f"{name}:{flag(cmd, '--port')}" for name, cmd in kvc_services("conductor").items()
    }
    agents = set()
    for name, cmd in kvc_services("agent").items():
        port = flag(cmd, "--metrics-port")
        assert port is not None, f"{name} serves no metrics"
        assert int(port) > 0, f"{name} serves no metrics"
        agents.add(f"{name}:{port}")
    # The alert rules select these job names.
    assert jobs == {"kvc-conductor": conductors, "kvc-agent": agents}
    prometheus = compose()["services"]["prometheus"]
    assert "./deploy/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_compose_grafana_gets_data_source_and_dashboard() -> None:
    grafana = compose()["services"]["grafana"]
    mounts = dict(v.removesuffix(":ro").split(":", 1) for v in grafana["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provisioning = ROOT / "deploy/grafana/provisioning"
    providers = yaml.safe_load((provisioning / "dashboards/kv-conductor.yml").read_text())
    dashboard_dir = providers["providers"][0]["options"]["path"]
    assert mounts["./deploy/grafana/kv-conductor.json"] == f"{dashboard_dir}/kv-conductor.json"
    json.loads((ROOT / "deploy/grafana/kv-conductor.json").read_text())
    sources = yaml.safe_load((provisioning / "datasources/prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["type"] == "prometheus"
    assert source["url"] == "http://prometheus:9090"


def test_yaml_files_pass_yamllint() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "yamllint", "--strict", "deploy", "docker-compose.yml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@dataclass(frozen=True, slots=True)
class Stage:
    """One build stage of the Dockerfile: its base (an image or an earlier stage) and its
    instructions (continuation lines joined, comments dropped)."""

    base: str
    instructions: tuple[tuple[str, str], ...]

    def all(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]


def dockerfile_stages() -> dict[str, Stage]:
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    stages: dict[str, Stage] = {}
    name, base = "", ""
    instructions: list[tuple[str, str]] = []
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keyword, _, arg = line.strip().partition(" ")
        if keyword == "FROM":
            if name:
                stages[name] = Stage(base, tuple(instructions))
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", arg.strip())
            assert match, f"unnamed stage: FROM {arg}"
            base, name = match.groups()
            instructions = []
        else:
            instructions.append((keyword, arg.strip()))
    stages[name] = Stage(base, tuple(instructions))
    return stages


def base_chain(stages: dict[str, Stage], target: str) -> list[Stage]:
    """``target`` and the stages it is built on, nearest first (what the image runs)."""
    chain = [stages[target]]
    while chain[-1].base in stages:
        chain.append(stages[chain[-1].base])
    return chain


def build_inputs(stages: dict[str, Stage], target: str) -> list[Stage]:
    """Every stage ``target`` needs: its bases and the stages it copies from."""
    needed, todo = [], [target]
    while todo:
        stage = stages[todo.pop()]
        needed.append(stage)
        todo += [stage.base] if stage.base in stages else []
        for copy in stage.all("COPY"):
            todo += re.findall(r"--from=(\S+)", copy)
    return needed


def installed_packages(stages: dict[str, Stage], target: str) -> set[str]:
    """What ``pip install`` gets from the repository (``.`` plus extras) for ``target``."""
    specs = set()
    for stage in build_inputs(stages, target):
        for run in stage.all("RUN"):
            for command in re.findall(r"pip install ([^&;]*)", run):
                specs |= {a for a in shlex.split(command) if a.startswith(".")}
    return specs


def in_force(chain: list[Stage], keyword: str) -> str:
    """The instruction the image runs with: the target's own or its nearest base's."""
    for stage in chain:
        if found := stage.all(keyword):
            return found[-1]
    raise AssertionError(f"no {keyword}")


def test_dockerfile_builds_one_image_per_role() -> None:
    stages = dockerfile_stages()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    # The conductor's image is the core install (no torch); the agent's adds the
    # embedded engine and the vLLM adapter.
    assert installed_packages(stages, "conductor") == {"."}
    assert installed_packages(stages, "agent") == {".[embedded,vllm]"}
    assert {"embedded", "vllm"} <= set(extras)
    assert list(stages)[-1] == "conductor", "the default target (last stage) is the conductor"


@pytest.mark.parametrize("target", ["conductor", "agent"])
def test_dockerfile_images_run_non_root_with_healthcheck(target: str, tls_bundle: Path) -> None:
    chain = base_chain(dockerfile_stages(), target)
    assert in_force(chain, "USER") not in ("root", "0")
    healthcheck = re.search(r"CMD\s+(\[.*\])", in_force(chain, "HEALTHCHECK"))
    assert healthcheck is not None
    probe = yaml.safe_load(healthcheck.group(1))
    assert probe[:2] == ["kvc", "probe"]
    build_parser().parse_args(probe[1:])
    assert yaml.safe_load(in_force(chain, "ENTRYPOINT")) == ["kvc"]
    command = yaml.safe_load(in_force(chain, "CMD"))
    assert command[0] == target
    # Serving on 0.0.0.0 needs TLS files: without them the agent refuses to start.
    validate_command(command, tls_env(target, tls_bundle))


def test_dockerignore_lets_in_exactly_what_the_dockerfile_copies() -> None:
    lines = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "exclude everything, then let the sources in"
    let_in = {line.removeprefix("!") for line in lines if line.startswith("!")}
    copied = set()
    for stage in dockerfile_stages().values():
        for copy in stage.all("COPY"):
            if not copy.startswith("--from"):
                copied |= set(copy.split()[:-1])
    for src in copied:
        assert (ROOT / src).exists(), f"Dockerfile copies missing path {src}"
    assert copied == let_in


def test_compose_services_run_their_role_image() -> None:
    stages = dockerfile_stages()
    for name, svc in compose()["services"].items():
        if "build" in svc:
            target = svc["build"]["target"]
            assert target in stages, name
            # kvc fleet up runs agents and simulated engines: the agent image (ZMQ extra);
            # kvc certs needs only the core install: the conductor image.
            images = {"fleet": "agent", "certs": "conductor"}
            expected = images.get(svc["command"][0], svc["command"][0])
            assert target == expected, name


def test_compose_fleet_profile_plans_a_fleet() -> None:
    from kvc_cli.fleet import FleetOptions, plan_fleet

    fleet = compose()["services"]["fleet"]
    assert fleet["profiles"] == ["fleet"]
    ns = build_parser().parse_args(fleet["command"])
    plan = plan_fleet(FleetOptions(prefill=ns.prefill, decode=ns.decode, port=ns.port), "/tmp/x")
    assert f"{ns.port}:{ns.port}" in fleet["ports"]
    assert len(plan.engines) == 8


def test_dockerfile_passes_checkov() -> None:
    checkov = require_tool("checkov")
    output = run_tool(
        [checkov, "--quiet", "--compact", "--skip-download", "--framework", "dockerfile",
         "-f", str(ROOT / "Dockerfile")],
        timeout_s=300,
    )  # fmt: skip
    assert "Failed checks: 0" in output, output


@pytest.mark.parametrize("command", ["conductor", "agent"])
def test_help_documents_every_setting(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    settings = ConductorSettings if command == "conductor" else AgentSettings
    for name in settings.model_fields:
        assert f"--{name.replace('_', '-')}" in out
