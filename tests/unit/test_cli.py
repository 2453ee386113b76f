"""Configuration fails fast with a readable message and exit code 2."""

from __future__ import annotations

import pytest

from kvc_cli.cli import main


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
    settings = ConductorSettings()
    assert settings.agents == ["a:1", "b:2"]
    assert settings.api_keys == ["k1", "k2"]


def test_probe_rejects_unknown_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", "ftp://x"]) == 2
    assert "unsupported probe URL" in capsys.readouterr().err


def test_configuration_doc_is_fresh() -> None:
    from tools.settings_doc import DOC_PATH, render

    assert DOC_PATH.read_text() == render(), "run `python -m tools.settings_doc` and commit"
