"""``kvc bench live`` and ``kvc bench compare``: a Mooncake trace replayed against a live
OpenAI-compatible server, and the summaries of any runs side by side.

  kvc bench live --url URL --trace FILE --out DIR [--scenario NAME] [--time-scale X] ...
  kvc bench compare DIR_OR_SUMMARY ... [--png FILE]

Exit status: 0 done, 1 the server could not be used (unreachable, key refused, no
model), 2 a usage error (bad URL, trace, header, number, scenario, prompt).
See docs/simulator.md, "Live replay".
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path

from kvc.models import DEFAULT_MODEL_DIR

__all__ = ["add_bench_commands"]

Command = Callable[..., argparse.ArgumentParser]


def _headers(pairs: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--header wants NAME=VALUE, got {pair!r}")
        headers[name.strip()] = value.strip()
    return headers


def _run_live(ns: argparse.Namespace, log_level: str) -> int:
    from kvc_sim.live.prompts import PromptError
    from kvc_sim.live.run import LiveOptions, LiveReplayError, replay_live
    from kvc_sim.profile import SimConfigError
    from kvc_sim.replay import ProgressLine
    from kvc_sim.scenario import SloSpec, load_scenario
    from kvc_sim.trace import TraceError, read_trace

    prog = "kvc bench live"
    try:
        slo = SloSpec()
        speed, max_tokens = 1.0, 1024
        if ns.scenario is not None:
            scenario = load_scenario(ns.scenario)
            slo, speed, max_tokens = scenario.slo, scenario.speed, scenario.cluster.max_tokens
        if ns.ttft_slo_s is not None or ns.tbt_slo_s is not None:
            slo = SloSpec(
                ttft_s=ns.ttft_slo_s if ns.ttft_slo_s is not None else slo.ttft_s,
                tbt_s=ns.tbt_slo_s if ns.tbt_slo_s is not None else slo.tbt_s,
                tbt_thresholds_s=slo.tbt_thresholds_s,
            )
        if ns.limit is not None and ns.limit < 1:
            raise ValueError("--limit must be >= 1")
        options = LiveOptions(
            url=ns.url,
            trace_name=str(ns.trace),
            run_name=ns.name,
            model=ns.model,
            api_key=ns.api_key,
            headers=_headers(ns.header),
            prompt_format=ns.prompt_format,
            model_dir=Path(ns.model_dir),
            seed=ns.prompt_seed,
            max_tokens=ns.max_tokens if ns.max_tokens is not None else max_tokens,
            time_scale=ns.time_scale,
            speed=ns.speed if ns.speed is not None else speed,
            max_in_flight=ns.max_in_flight,
            timeout_s=ns.timeout_s,
            slo=slo,
            check_prompts=ns.check_prompts,
            plots=not ns.no_plots,
            progress=None if ns.quiet else ProgressLine(),
        )
        requests = read_trace(ns.trace, limit=ns.limit)
        if not requests:
            raise TraceError(f"{ns.trace}: no requests")
    except (SimConfigError, TraceError, ValueError, OSError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        summary = asyncio.run(replay_live(requests, Path(ns.out), options))
    except PromptError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except (LiveReplayError, FileNotFoundError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    block = summary["policies"][options.run_name]
    live = block["live"]

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    print(
        f"{options.run_name}: {block['completed']}/{block['requests']} completed, "
        f"{block['rejected']} not served ({live['rejected_429']} x 429, "
        f"{live['client_errors']} client errors); hit {fmt(block['hit_ratio'], '.1%')}; "
        f"TTFT p50 {fmt(block['ttft_p50_s'], '.3f')} s, p90 {fmt(block['ttft_p90_s'], '.3f')} s; "
        f"TBT p90 {fmt(block['tbt_p90_s'], '.3f')} s; SLO attainment "
        f"{fmt(block['effective_capacity_ratio'], '.1%')} (trace time); "
        f"{fmt(live['achieved_request_rate_per_s'], '.2f')} req/s sent, "
        f"wall {live['wall_s']:.1f} s"
    )
    print(f"wrote {Path(ns.out) / 'summary.json'}")
    return 0


def _run_compare(ns: argparse.Namespace, log_level: str) -> int:
    from kvc_sim.live.compare import CompareError, load_rows, markdown_table, write_compare_plot

    try:
        rows = load_rows(ns.summaries)
    except CompareError as exc:
        print(f"kvc bench compare: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(markdown_table(rows))
    if not ns.no_plot:
        written = write_compare_plot(rows, Path(ns.png))
        if written is not None:
            print(f"\nwrote {written}")
    return 0


def add_bench_commands(
    command: Command, bench_sub: argparse._SubParsersAction[argparse.ArgumentParser]
) -> None:
    """Add ``live`` and ``compare`` under ``kvc bench`` (``command`` makes a subcommand)."""
    p = command(
        "live",
        "replay a Mooncake trace against a live OpenAI-compatible server (/v1/completions)",
        bench_sub,
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--trace", required=True, help="Mooncake JSONL trace file")
    p.add_argument("--out", required=True, help="output folder (summary.json, CSV, plots)")
    p.add_argument("--name", default="live", help="run name in summary.json and the CSV name")
    p.add_argument("--model", default=None, help="model to ask for (default: GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--header", action="append", default=[], metavar="NAME=VALUE",
        help="extra request header, repeatable (e.g. X-Kvc-Slo-Ttft-Ms=2000)",
    )  # fmt: skip
    p.add_argument(
        "--prompt-format", choices=["text", "token-ids"], default="text",
        help="prompts as text (default: every router sees the same text) or token ids",
    )  # fmt: skip
    p.add_argument(
        "--model-dir", default=str(DEFAULT_MODEL_DIR),
        help="tokenizer folder the prompts are built for (default: the shipped tiny-llama)",
    )  # fmt: skip
    p.add_argument("--prompt-seed", type=int, default=0, help="which words each hash id draws")
    p.add_argument(
        "--scenario", default=None,
        help="take the SLOs, speed and max_tokens of this bench replay scenario",
    )  # fmt: skip
    p.add_argument(
        "--max-tokens", type=int, default=None,
        help="cap on each output (default: the scenario's, else 1024)",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=1.0,
        help="wall seconds per trace second (the sim engines' --time-scale); "
        "latencies are reported divided by it",
    )  # fmt: skip
    p.add_argument(
        "--speed", type=float, default=None,
        help="arrival speed-up as in bench replay (default: the scenario's, else 1)",
    )  # fmt: skip
    p.add_argument("--ttft-slo-s", type=float, default=None, help="TTFT SLO, trace seconds")
    p.add_argument("--tbt-slo-s", type=float, default=None, help="TBT SLO, trace seconds")
    p.add_argument(
        "--max-in-flight", type=int, default=256,
        help="requests outstanding at once; later arrivals queue (the wait counts in TTFT)",
    )  # fmt: skip
    p.add_argument(
        "--timeout-s", type=float, default=600.0, help="per request, wall seconds, whole stream"
    )
    p.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    p.add_argument(
        "--check-prompts", type=int, default=3,
        help="tokenize the first N text prompts to prove they give the intended tokens",
    )  # fmt: skip
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_run_live)

    c = command("compare", "runs of several bench summaries side by side", bench_sub)
    c.add_argument("summaries", nargs="+", help="output folders or summary.json files")
    c.add_argument("--png", default="compare.png", help="combined plot (default: compare.png)")
    c.add_argument("--no-plot", action="store_true", help="print the table only")
    c.set_defaults(func=_run_compare)
