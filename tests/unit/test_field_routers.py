"""The field benchmark's pure parts: targets, engines, commands, /proc and metrics parsing,
the table. (The benchmark itself runs peers and a fleet: never in ``make test``.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.field_fleet import parse_proc_stat
from bench.field_report import (
    TABLE_HEADERS,
    TargetResult,
    hit_ratio_delta,
    kv_input_counts,
    status_note,
    table_rows,
)
from bench.field_routers import build_parser, options_from_args
from bench.field_targets import (
    Engine,
    EngineInfo,
    FieldOptions,
    agent_argv,
    conductor_argv,
    parse_engines,
    parse_targets,
    sim_engine_argv,
    smg_argv,
    vllm_router_argv,
)

ENGINES = [
    Engine("http://127.0.0.1:9001", "tcp://127.0.0.1:9101", "tcp://127.0.0.1:9201"),
    Engine("http://127.0.0.1:9002", "tcp://127.0.0.1:9102", None),
]
INFO = EngineInfo(model="tiny-llama", block_size=512, num_gpu_blocks=5860)


def test_targets_keep_the_given_order() -> None:
    targets = parse_targets("conductor:kv_adaptive, round_robin,smg:cache_aware")
    assert [t.name for t in targets] == ["conductor:kv_adaptive", "round_robin", "smg:cache_aware"]
    assert [(t.kind, t.policy) for t in targets] == [
        ("conductor", "kv_adaptive"),
        ("vllm-router", "round_robin"),
        ("smg", "cache_aware"),
    ]
    assert targets[0].slug == "conductor-kv_adaptive"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "no targets"),
        ("round_robin,vllm-router:random", "unknown target"),
        ("smg:cache_aware,smg:cache_aware", "given twice"),
    ],
)
def test_bad_targets_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_targets(text)


def test_engines_with_their_event_endpoints() -> None:
    engines = parse_engines(
        ["http://h:1/", "http://h:2"],
        ["http://h:1/=tcp://h:11,tcp://h:12", "http://h:2=tcp://h:21"],
    )
    assert engines == [
        Engine("http://h:1", "tcp://h:11", "tcp://h:12"),
        Engine("http://h:2", "tcp://h:21", None),
    ]
    assert parse_engines(["http://h:3"], []) == [Engine("http://h:3")]


@pytest.mark.parametrize(
    ("urls", "events", "message"),
    [
        (["h:1"], [], "not an http"),
        (["http://h:1", "http://h:1"], [], "given twice"),
        (["http://h:1"], ["http://h:2=tcp://h:3"], "no --engine-url"),
        (["http://h:1"], ["http://h:1"], "URL=EVENTS"),
        (["http://h:1"], ["http://h:1=udp://h:3"], "tcp://"),
        (["http://h:1"], ["http://h:1=tcp://a:1,tcp://b:2,tcp://c:3"], "URL=EVENTS"),
    ],
)
def test_bad_engines_are_refused(urls: list[str], events: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_engines(urls, events)


def test_kv_aware_subscribes_to_every_engine_with_the_engines_block_size() -> None:
    argv = vllm_router_argv(Path("/p/vllm-router"), "kv_aware", 10, 11, ENGINES, INFO)
    assert argv[argv.index("--policy") + 1] == "kv_aware"
    sources = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-source"]
    assert sources == [f"{e.url}={e.events}" for e in ENGINES]
    replays = [argv[i + 1] for i, a in enumerate(argv) if a == "--kv-event-replay-source"]
    assert replays == [f"{ENGINES[0].url}={ENGINES[0].replay}"]
    assert argv[argv.index("--kv-event-block-size") + 1] == "512"
    assert argv[argv.index("--kv-event-model") + 1] == "tiny-llama"


def test_other_policies_take_no_kv_events() -> None:
    for policy in ("round_robin", "cache_aware"):
        argv = vllm_router_argv(Path("/p/vllm-router"), policy, 10, 11, ENGINES, INFO)
        assert not any(a.startswith("--kv-event") for a in argv)
        workers = argv.index("--worker-urls")
        assert argv[workers + 1 : workers + 3] == [e.url for e in ENGINES]
    with pytest.raises(ValueError, match="KV events"):
        vllm_router_argv(Path("/p"), "kv_aware", 10, 11, [Engine("http://h:1")], INFO)


def test_smg_launches_with_an_explicit_host() -> None:
    argv = smg_argv(Path("/p/smg"), "cache_aware", 10, 11, ENGINES)
    assert argv[:2] == ["/p/smg", "launch"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--disable-tokenizer-autoload" in argv


def test_conductor_slos_are_scaled_to_wall_time() -> None:
    opts = FieldOptions(time_scale=0.1, ttft_slo_s=30.0, tbt_slo_s=0.1)
    argv = conductor_argv(opts, "kv_adaptive", 10, ["127.0.0.1:1", "127.0.0.1:2"])
    assert float(argv[argv.index("--ttft-slo-s") + 1]) == pytest.approx(3.0)
    assert float(argv[argv.index("--tbt-slo-s") + 1]) == pytest.approx(0.01)
    assert argv[argv.index("--agents") + 1] == "127.0.0.1:1,127.0.0.1:2"
    assert argv[argv.index("--policy") + 1] == "kv_adaptive"


def test_options_from_the_command_line() -> None:
    ns = build_parser().parse_args(
        ["--engines", "16", "--limit", "0", "--time-scale", "0.05", "--targets", "round_robin"]
    )
    opts = options_from_args(ns)
    assert (opts.engines, opts.limit, opts.time_scale) == (16, None, 0.05)
    assert [t.name for t in opts.targets] == ["round_robin"]


def test_conductor_args_reach_the_conductor_targets_last() -> None:
    ns = build_parser().parse_args(["--conductor-arg=--admission=none"])
    argv = conductor_argv(options_from_args(ns), "kv_centric", 10, ["127.0.0.1:1"])
    assert argv[-1] == "--admission=none"  # after the defaults, so it overrides them


def test_event_driven_targets_need_every_engines_events() -> None:
    ns = build_parser().parse_args(
        ["--engine-url", "http://h:1", "--targets", "round_robin,conductor:kv_centric"]
    )
    with pytest.raises(ValueError, match="KV events"):
        options_from_args(ns)
    ns = build_parser().parse_args(["--engine-url", "http://h:1", "--targets", "round_robin"])
    assert options_from_args(ns).engine_urls == (Engine("http://h:1"),)


def test_proc_stat_with_spaces_and_parentheses_in_the_name() -> None:
    fields = ["S", "42", *["0"] * 9, "250", "150", "7", "9"]
    ppid, seconds = parse_proc_stat("1234 (smg::router (x) y) " + " ".join(fields))
    assert ppid == 42
    assert seconds == pytest.approx(400 / os.sysconf("SC_CLK_TCK"))  # utime + stime, in ticks


def test_hit_ratio_over_the_replay_only() -> None:
    before = {"hits": 100.0, "queries": 1000.0}
    assert hit_ratio_delta(before, {"hits": 400.0, "queries": 2000.0}) == pytest.approx(0.3)
    assert hit_ratio_delta(before, before) is None


def test_table_rows_show_the_conductor_and_its_agents_apart() -> None:
    summary = {
        "hit_ratio": 0.5,
        "ttft_p50_s": 1.25,
        "ttft_p90_s": 4.0,
        "tbt_p90_s": 0.125,
        "effective_capacity_ratio": 0.9,
        "completed": 98,
        "rejected": 2,
    }
    ok = TargetResult(
        "conductor:kv_centric",
        summary=summary,
        engine_hit_ratio=0.49,
        cpu_s={"conductor": 3.5, "agents": 2.0, "engines": 10.0, "client": 4.0},
        replay_wall_s=61.0,
    )
    peer = TargetResult(
        "round_robin", summary=summary, cpu_s={"router": 0.25, "client": 4.0}, replay_wall_s=60.0
    )
    skipped = TargetResult("smg:cache_aware", status="skipped: no network")
    rows = table_rows([ok, peer, skipped])
    assert all(len(row) == len(TABLE_HEADERS) for row in rows)
    assert rows[0] == [
        "conductor:kv_centric", "50.0%", "49.0%", "1.250", "4.000", "0.125", "90.0%", "98", "2",
        "3.50", "2.00", "10.00", "4.00", "61.0",
    ]  # fmt: skip
    assert rows[1][9:11] == ["0.25", "-"]
    assert rows[2][0] == "smg:cache_aware (skipped: no network)"
    assert set(rows[2][1:]) == {"-"}


def test_kv_aware_token_inputs_by_result() -> None:
    text = (
        'vllm_router_kv_routing_inputs_total{transport="http",result="tokenize"} 8\n'
        'vllm_router_kv_routing_inputs_total{transport="http",result="render_unavailable"} 8\n'
        'vllm_router_kv_routing_inputs_total{transport="grpc",result="tokenize"} 2\n'
    )
    assert kv_input_counts(text) == {"tokenize": 10.0, "render_unavailable": 8.0}
    assert kv_input_counts("") == {}


def test_engines_and_agents_use_vllms_default_empty_topic() -> None:
    opts = FieldOptions()
    engine = sim_engine_argv(opts, 0, 1, 2, 3)
    events = json.loads(engine[engine.index("--kv-events-config") + 1])
    assert events["topic"] == ""
    assert events["endpoint"] == "tcp://*:2"  # bound: every subscriber connects
    assert events["replay_endpoint"] == "tcp://*:3"
    agent = agent_argv(opts, 0, 4, ENGINES[0])
    assert agent[agent.index("--kv-events-topic") + 1] == ""
    assert agent[agent.index("--kv-events-endpoint") + 1] == ENGINES[0].events


def test_answers_other_than_200_are_noted() -> None:
    assert status_note({"status_counts": {"200": 5}}) is None
    assert status_note({}) is None
    note = status_note({"status_counts": {"200": 5, "429": 2, "400": 3}})
    assert note is not None
    assert "400 ×3, 429 ×2" in note
