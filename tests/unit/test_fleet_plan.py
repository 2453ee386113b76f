"""``kvc fleet up``'s plan: which processes, with which flags and ports (nothing started)."""

from __future__ import annotations

import json

import pytest
from pydantic_settings import BaseSettings

from kvc_cli.cli import build_parser
from kvc_cli.fleet import FleetConfigError, FleetOptions, plan_fleet

IPC = "/tmp/kvc-fleet-test"


def _flag(args: tuple[str, ...], name: str) -> str:
    return args[args.index(name) + 1]


def test_disaggregated_fleet_pairs_each_engine_with_an_agent() -> None:
    plan = plan_fleet(FleetOptions(prefill=2, decode=3, conductors=2, base_port=40000), IPC)
    assert [s.name for s in plan.engines] == [
        "engine-prefill-0", "engine-prefill-1",
        "engine-decode-0", "engine-decode-1", "engine-decode-2",
    ]  # fmt: skip
    assert len(plan.agents) == 5
    assert len(plan.conductors) == 2
    ports = plan.ports
    assert len(ports) == len(set(ports)) == 5 * 2 + 2
    for engine, agent in zip(plan.engines, plan.agents, strict=True):
        (http,) = engine.ports
        assert _flag(agent.args, "--vllm-url") == f"http://127.0.0.1:{http}"
        events = json.loads(_flag(engine.args, "--kv-events-config"))
        assert events["endpoint"].startswith(f"ipc://{IPC}/")
        assert _flag(agent.args, "--kv-events-endpoint") == events["endpoint"]
        assert _flag(agent.args, "--kv-events-replay-endpoint") == events["replay_endpoint"]
        assert _flag(agent.args, "--pd-connector") == "nixl"
        assert _flag(agent.args, "--role") in ("prefill", "decode")
        assert "--no-vllm-prefix-pulls" in agent.args  # as live-parity's simulator: no pulls
    pulls = plan_fleet(FleetOptions(prefill=2, decode=1, prefix_pulls=True), IPC)
    assert all("--vllm-prefix-pulls" in a.args for a in pulls.agents)
    # The legs of a pull go before waiting requests: vLLM's priority scheduling.
    assert all("--vllm-prefix-pull-priority=-1" in a.args for a in pulls.agents)
    assert {_flag(e.args, "--scheduling-policy") for e in pulls.engines} == {"priority"}
    for conductor in plan.conductors:
        assert _flag(conductor.args, "--agents").split(",") == list(plan.agent_addresses)
    assert plan.conductor_urls == ("http://127.0.0.1:8000", "http://127.0.0.1:8001")


def test_aggregated_engines_run_without_the_pd_connector() -> None:
    plan = plan_fleet(FleetOptions(prefill=0, decode=0, aggregated=2), IPC)
    assert {_flag(a.args, "--role") for a in plan.agents} == {"both"}
    assert {_flag(a.args, "--pd-connector") for a in plan.agents} == {"none"}


def test_slos_are_given_in_trace_time_and_scaled_with_the_engines() -> None:
    plan = plan_fleet(FleetOptions(time_scale=0.25, ttft_slo_s=30.0, tbt_slo_s=0.1), IPC)
    (conductor,) = plan.conductors
    assert float(_flag(conductor.args, "--ttft-slo-s")) == pytest.approx(7.5)
    assert float(_flag(conductor.args, "--tbt-slo-s")) == pytest.approx(0.025)
    assert {_flag(e.args, "--time-scale") for e in plan.engines} == {"0.25"}


def test_agents_calibrate_in_turns_with_a_budget_that_covers_the_wait() -> None:
    """The engines share the machine's CPUs: agents calibrate a few at a time, and the
    last round's wait fits in their (time-scaled) budget."""
    plan = plan_fleet(FleetOptions(prefill=4, decode=4, time_scale=2.0, calibration_turns=2), IPC)
    for agent in plan.agents:
        assert _flag(agent.args, "--calibration-turns") == "2"
        assert float(_flag(agent.args, "--calibration-budget-s")) == pytest.approx(20.0 * 2 * 4)
    at_once = plan_fleet(FleetOptions(calibration_turns=0), IPC)
    assert {_flag(a.args, "--calibration-turns") for a in at_once.agents} == {"0"}
    assert {float(_flag(a.args, "--calibration-budget-s")) for a in at_once.agents} == {20.0}
    big = plan_fleet(FleetOptions(prefill=32, decode=32, calibration_turns=1), IPC)
    assert float(_flag(big.agents[0].args, "--calibration-budget-s")) == 600.0  # the agent's cap


def test_pass_through_arguments_reach_every_process_of_their_kind() -> None:
    plan = plan_fleet(
        FleetOptions(
            engine_args=("--max-num-seqs=8",),
            agent_args=("--no-calibrate",),
            conductor_args=("--admission=predictive",),
        ),
        IPC,
    )
    assert all(e.args[-1] == "--max-num-seqs=8" for e in plan.engines)
    assert all(a.args[-1] == "--no-calibrate" for a in plan.agents)
    assert all(c.args[-1] == "--admission=predictive" for c in plan.conductors)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (FleetOptions(prefill=1, decode=0), "both --prefill and --decode"),
        (FleetOptions(prefill=0, decode=0, aggregated=0), "no engines"),
        (FleetOptions(conductors=0), "--conductors"),
        (FleetOptions(time_scale=0.0), "--time-scale"),
        (FleetOptions(calibration_turns=-1), "--calibration-turns"),
        (FleetOptions(base_port=65_530), "out of range"),
    ],
)
def test_impossible_fleets_are_refused(options: FleetOptions, message: str) -> None:
    with pytest.raises(FleetConfigError, match=message):
        plan_fleet(options, IPC)


def test_cli_flags_map_onto_the_options() -> None:
    ns = build_parser().parse_args(
        ["fleet", "up", "--prefill", "4", "--decode", "4", "--time-scale", "0.5",
         "--agent-arg=--no-calibrate", "--policy", "kv_centric", "--prefix-pulls",
         "--calibration-turns", "3"]
    )  # fmt: skip
    assert (ns.prefill, ns.decode, ns.time_scale, ns.policy) == (4, 4, 0.5, "kv_centric")
    assert ns.prefix_pulls
    assert ns.calibration_turns == 3
    assert ns.agent_arg == ["--no-calibrate"]


def test_every_planned_process_parses_and_validates_with_the_real_commands() -> None:
    """The fleet's flags are the real CLIs' flags: each process's arguments parse and
    build its settings (engine, agent, conductor) exactly as the process will."""
    from conductor.settings import ConductorSettings
    from kvc_cli.settings_cli import settings_from_args
    from kvc_cli.sim_engine import SimEngineSettings
    from node_agent.settings import AgentSettings

    kinds: dict[str, type[BaseSettings]] = {
        "sim-engine": SimEngineSettings,
        "agent": AgentSettings,
        "conductor": ConductorSettings,
    }
    plan = plan_fleet(FleetOptions(prefill=1, decode=1, aggregated=1, time_scale=0.5), IPC)
    parser = build_parser()
    for spec in plan.processes:
        ns = parser.parse_args(list(spec.args))
        settings: BaseSettings = settings_from_args(kinds[ns.command], ns)
        assert isinstance(settings, kinds[ns.command]), spec.name
