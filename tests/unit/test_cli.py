"""Configuration fails fast with a readable message and exit code 2."""

from __future__ import annotations

import importlib.metadata

import pytest

from kvc_cli.cli import build_parser, main
from kvc_cli.settings_cli import settings_from_args, settings_group


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["agent", "--capacity-blocks", "0"], "--capacity-blocks"),
        (["agent", "--role", "router"], "--role"),
        (["agent", "--model", "/no/such/folder"], "does not exist"),
        (["conductor", "--agents", "no-port-here"], "is not host:port"),
        (["conductor", "--port", "70000"], "--port"),
        (["conductor", "--model", "/tmp"], "tokenizer.json"),
    ],
)
def test_invalid_settings_exit_2_with_message(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err
    assert fragment in err


def test_environment_configures_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from conductor.settings import ConductorSettings

    monkeypatch.setenv("KVC_CONDUCTOR_AGENTS", "a:1, b:2")
    monkeypatch.setenv("KVC_CONDUCTOR_API_KEYS", "k1,k2")
    with pytest.raises(ValueError, match="refusing plaintext gRPC to agent a:1"):
        ConductorSettings()  # agents beyond loopback, no TLS files
    monkeypatch.setenv("KVC_CONDUCTOR_GRPC_PLAINTEXT", "any")
    settings = ConductorSettings()
    assert settings.agents == ["a:1", "b:2"]
    assert settings.api_keys == ["k1", "k2"]


def test_probe_rejects_unknown_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "ftp://x"]) == 2
    assert "unsupported probe URL" in capsys.readouterr().err


def test_configuration_doc_is_fresh() -> None:
    from tools.settings_doc import DOC_PATH, render

    assert DOC_PATH.read_text() == render(), "run `python -m tools.settings_doc` and commit"


REPLAY_ARGS = ["--trace", "t", "--scenario", "s", "--out", "o"]


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, "--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # unwrapped


def test_help_lists_choices_switches_and_groups(capsys: pytest.CaptureFixture[str]) -> None:
    from conductor.settings import ConductorSettings
    from node_agent.settings import AgentSettings

    agent = _help(["agent"], capsys)
    assert "--role {prefill,decode,both}" in agent
    assert "--engine {embedded,vllm}" in agent
    assert "--calibrate, --no-calibrate" in agent
    assert "[env: KVC_AGENT_BLOCK_SIZE]" in agent
    conductor = _help(["conductor"], capsys)
    assert "--policy {round_robin,least_loaded,local_prefix,kv_centric,kv_adaptive}" in conductor
    assert "--admission {none,early,predictive}" in conductor
    for settings_cls, text in ((AgentSettings, agent), (ConductorSettings, conductor)):
        for name, field in settings_cls.model_fields.items():
            group = settings_group(field)
            assert group is not None, f"{settings_cls.__name__}.{name} has no help group"
            assert f"{group}:" in text


def test_switches_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from conductor.settings import ConductorSettings
    from node_agent.settings import AgentSettings

    monkeypatch.setenv("KVC_AGENT_THREADS", "3")
    monkeypatch.setenv("KVC_AGENT_BLOCK_SIZE", "8")
    argv = ["agent", "--no-calibrate", "--block-size", "16", "--capacity-blocks", "64"]
    agent = settings_from_args(AgentSettings, build_parser().parse_args(argv))
    assert (agent.calibrate, agent.block_size, agent.capacity_blocks) == (False, 16, 64)
    assert agent.threads == 3  # environment below the flags
    argv = ["conductor", "--api-keys-in-redis", "--agents", "a:1,b:2", "--policy", "round_robin"]
    argv += ["--grpc-plaintext", "any"]
    conductor = settings_from_args(ConductorSettings, build_parser().parse_args(argv))
    assert conductor.grpc_plaintext == "any"
    assert conductor.api_keys_in_redis
    assert conductor.agents == ["a:1", "b:2"]
    assert conductor.policy == "round_robin"


@pytest.mark.parametrize(
    ("argv", "env", "level"),
    [
        (["probe", "x"], None, "INFO"),
        (["--log-level", "debug", "probe", "x"], None, "DEBUG"),
        (["probe", "x", "--log-level", "ERROR"], None, "ERROR"),
        (
            ["--log-level", "DEBUG", "bench", "replay", "--log-level", "warning", *REPLAY_ARGS],
            None,
            "WARNING",
        ),
        (["probe", "x"], "warning", "WARNING"),
        (["probe", "x", "--log-level", "ERROR"], "warning", "ERROR"),
    ],
)
def test_log_level_before_or_after_the_command_or_from_the_environment(
    argv: list[str], env: str | None, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if env is not None:
        monkeypatch.setenv("KVC_LOG_LEVEL", env)
    ns = build_parser().parse_args(argv)
    assert ns.logging_command.load(ns).log_level == level


def test_invalid_log_level_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--log-level", "LOUD", "probe", "http://127.0.0.1:1/"]) == 2
    assert "--log-level" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvc {importlib.metadata.version('kv-conductor')}"
