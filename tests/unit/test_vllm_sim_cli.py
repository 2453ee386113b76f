"""``kvc sim-engine``'s command line (kvc_cli.sim_engine): flags, environment, bad input."""

from __future__ import annotations

import argparse

import pytest

from kvc_cli.settings_cli import InvalidSettings, settings_from_args
from kvc_cli.sim_engine import SimEngineSettings, register_sim_engine


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    root = argparse.ArgumentParser(prog="kvc")
    sub = root.add_subparsers(dest="command", required=True)
    made: list[argparse.ArgumentParser] = []

    def command(name: str, help_text: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, help=help_text)
        made.append(parser)
        return parser

    register_sim_engine(command)
    return root, made[0]


def test_flags_mirror_vllms_and_env_fills_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVC_SIM_ENGINE_TIME_SCALE", "0.25")
    root, sub = _parser()
    help_text = sub.format_help()
    for flag in (
        "--block-size", "--num-gpu-blocks", "--max-model-len", "--kv-events-config",
        "--engine-id", "--max-num-seqs", "--max-num-batched-tokens",
        "--no-enable-prefix-caching", "--profile", "--time-scale", "--served-model-name",
    ):  # fmt: skip
        assert flag in help_text
    ns = root.parse_args(
        ["sim-engine", "--block-size", "32", "--no-enable-prefix-caching", "--port", "0"]
    )
    settings = settings_from_args(SimEngineSettings, ns)
    assert settings.block_size == 32
    assert settings.enable_prefix_caching is False
    assert settings.time_scale == 0.25


def test_bad_values_name_the_flag() -> None:
    root, _ = _parser()
    ns = root.parse_args(["sim-engine", "--kv-events-config", "{not json"])
    with pytest.raises(InvalidSettings, match="--kv-events-config"):
        settings_from_args(SimEngineSettings, ns)
    ns = root.parse_args(["sim-engine", "--num-gpu-blocks", "1"])
    with pytest.raises(InvalidSettings, match="--num-gpu-blocks"):
        settings_from_args(SimEngineSettings, ns)


def test_a_bad_profile_or_events_config_stops_before_serving(
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, _ = _parser()
    ns = root.parse_args(["sim-engine", "--profile", "no-such-profile"])
    assert ns.func(ns, "INFO") == 2
    assert "no-such-profile" in capsys.readouterr().err
    ns = root.parse_args(
        ["sim-engine", "--kv-events-config", '{"enable_kv_cache_events": 1, "x": 2}']
    )
    assert ns.func(ns, "INFO") == 2
    assert "--kv-events-config" in capsys.readouterr().err
