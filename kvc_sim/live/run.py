"""``kvc bench live``: replay a Mooncake trace against a live OpenAI-compatible server and
write what ``kvc bench replay`` writes (``summary.json``, ``requests_RUN.csv``, plots).

Flow
    1. Check every request can get a prompt (``prompts``), tokenize the first
       ``check_prompts`` text prompts to prove they give the intended token ids.
    2. Ask the server for its models (``GET …/v1/models``): a bad URL or key fails here,
       and without ``model`` the first model served is used.
    3. Send each request at its arrival (``schedule``) as one streamed completion
       (``client``), at most ``max_in_flight`` at once.
    4. Turn every ``LiveResult`` into the simulator's ``RequestRecord`` in trace time
       (``records``) and summarise with the simulator's own ``metrics.summarize``.

``summary.json`` has the layout of ``kvc_sim.replay`` with one run, named ``run_name``;
what has no live equivalent is ``null`` (``profile``, ``cluster``, ``paper``; per run
``prefill_gpu_s``, ``prefill_gpu_s_per_request``, ``wasted_prefill_s``,
``prefill_utilization``, ``migrations``, ``migrated_tokens``, ``events``,
``sim_wall_s``). Live-only figures sit in the run's ``live`` block (``live_figures``)
and the run's settings at the top (``url``, ``model``, ``time_scale``, ...).

Knobs: ``LiveOptions``. Complexity: O(total prompt tokens) to build prompts, O(R log R)
to summarise R requests.
"""

from __future__ import annotations

import csv
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvc.machine import machine
from kvc.models import DEFAULT_MODEL_DIR
from kvc.tokenization import ChatTokenizer
from kvc_sim.live.client import CompletionTarget, PromptFormat, completions_url, send_completion
from kvc_sim.live.prompts import PromptSynthesizer, RoundTripVocabulary
from kvc_sim.live.records import LiveResult, live_figures, to_record
from kvc_sim.live.schedule import Arrival, Clock, MonotonicClock, arrivals, dispatch
from kvc_sim.metrics import RequestRecord, SimResult, summarize
from kvc_sim.plots import PlotRun, write_plots
from kvc_sim.replay import ProgressLine, finite_or_null
from kvc_sim.scenario import SloSpec
from kvc_sim.trace import TraceRequest, trace_stats

__all__ = ["LiveOptions", "LiveReplayError", "replay_live"]

NO_LIVE_EQUIVALENT = (
    "prefill_gpu_s",
    "prefill_gpu_s_per_request",
    "wasted_prefill_s",
    "prefill_utilization",
    "migrations",
    "migrated_tokens",
    "events",
    "sim_wall_s",
    "donated_blocks",
    "donation_hits",
)
"""Summary fields the simulator measures and a client cannot: written as null."""

_LIVE_CSV_FIELDS = (
    "status",
    "sent_s",
    "max_tokens",
    "chunks",
    "finish_reason",
    "retry_after_s",
    "error_code",
    "client_error",
    "error_message",
)


class LiveReplayError(RuntimeError):
    """The replay cannot start: the server is unreachable, refuses us, or serves no model."""


@dataclass(frozen=True, slots=True)
class LiveOptions:
    url: str  # the server's base URL (``http://host:port`` or ``…/v1``)
    trace_name: str = "-"
    run_name: str = "live"
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    prompt_format: PromptFormat = "text"
    model_dir: Path = DEFAULT_MODEL_DIR
    seed: int = 0
    max_tokens: int = 1024
    time_scale: float = 1.0
    speed: float = 1.0
    max_in_flight: int = 256
    timeout_s: float = 600.0
    slo: SloSpec = field(default_factory=SloSpec)
    check_prompts: int = 3
    plots: bool = True
    progress: ProgressLine | None = None

    def __post_init__(self) -> None:
        completions_url(self.url)  # raises ValueError for a bad URL
        if self.time_scale <= 0 or self.speed <= 0 or self.timeout_s <= 0:
            raise ValueError("time_scale, speed and timeout_s must be > 0")
        if self.max_tokens < 1 or self.max_in_flight < 1 or self.check_prompts < 0:
            raise ValueError("max_tokens and max_in_flight must be >= 1, check_prompts >= 0")
        if not self.run_name or "/" in self.run_name:
            raise ValueError("run_name must be a non-empty name without '/'")


async def _resolve_model(client: httpx.AsyncClient, options: LiveOptions) -> str:
    """The model to ask for; fails early on an unreachable server or a refused key."""
    models_url = completions_url(options.url).removesuffix("/completions") + "/models"
    try:
        response = await client.get(models_url, timeout=30.0)
    except httpx.TransportError as exc:
        raise LiveReplayError(f"cannot reach {options.url}: {exc or type(exc).__name__}") from exc
    if response.status_code in (401, 403):
        raise LiveReplayError(
            f"{models_url} answered {response.status_code}: check --api-key / --header"
        )
    if options.model is not None:
        return options.model
    ids: list[str] = []
    if response.status_code == 200:
        try:
            data = response.json().get("data") or []
            ids = [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
        except (ValueError, AttributeError):
            ids = []
    if not ids:
        raise LiveReplayError(
            f"{models_url} answered {response.status_code} without a model: pass --model"
        )
    return ids[0]


def _max_tokens(request: TraceRequest, cap: int) -> int:
    """The simulator's output length: the trace's, capped, at least 1."""
    return max(1, min(cap, request.output_tokens))


async def replay_live(
    requests: Sequence[TraceRequest],
    out_dir: Path,
    options: LiveOptions,
    *,
    clock: Clock | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` against ``options.url``; write and return ``summary.json``.

    Raises ``LiveReplayError`` when the server cannot be used and ``PromptError`` when a
    request cannot get a prompt; every failure of a single request is recorded instead.
    """
    if not requests:
        raise ValueError("no requests to replay")
    clock = clock if clock is not None else MonotonicClock()
    vocabulary = RoundTripVocabulary(ChatTokenizer.from_dir(options.model_dir))
    synth = PromptSynthesizer(vocabulary, seed=options.seed)
    for request in requests:
        synth.check_request(request)
    if options.prompt_format == "text":
        for request in requests[: options.check_prompts]:
            synth.check_prompt(request)
    plan = arrivals(requests, time_scale=options.time_scale, speed=options.speed)
    headers = dict(options.headers)
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"
    limits = httpx.Limits(
        max_connections=options.max_in_flight, max_keepalive_connections=options.max_in_flight
    )
    timeout = httpx.Timeout(options.timeout_s, connect=min(30.0, options.timeout_s))
    results: list[LiveResult] = []
    show = options.progress.callback(options.run_name) if options.progress else None
    started = time.perf_counter()
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = await _resolve_model(client, options)
        target = CompletionTarget(
            url=completions_url(options.url), model=model, timeout_s=options.timeout_s
        )
        origin = clock.now()

        def prepare(arrival: Arrival) -> bytes:
            request = arrival.request
            prompt: str | list[int] = (
                synth.text(request) if options.prompt_format == "text"
                else synth.token_ids(request)
            )  # fmt: skip
            return target.encode(prompt, _max_tokens(request, options.max_tokens))

        async def send(arrival: Arrival, at: float, body: bytes) -> None:
            request = arrival.request
            result = await send_completion(
                client,
                target,
                request,
                body,
                _max_tokens(request, options.max_tokens),
                clock=clock,
                origin=origin,
                arrival=at,
            )
            results.append(result)
            if show is not None:
                show(len(results), len(plan), (clock.now() - origin) / options.time_scale)

        await dispatch(
            plan, prepare, send, clock=clock, start=origin, max_in_flight=options.max_in_flight
        )
    wall_s = time.perf_counter() - started
    results.sort(key=lambda r: (r.arrival_s, r.request.request_id))
    return _write_outputs(requests, results, out_dir, options, model, wall_s)


def _write_outputs(
    requests: Sequence[TraceRequest],
    results: Sequence[LiveResult],
    out_dir: Path,
    options: LiveOptions,
    model: str,
    wall_s: float,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    records = [to_record(r, options.time_scale) for r in results]
    live = live_figures(results, options.time_scale)
    sim_result = SimResult(
        records=tuple(records),
        samples=(),
        migrations=0,
        migrated_blocks=0,
        virtual_s=float(live["trace_s"]),
        events=0,
        wall_s=wall_s,
    )
    slo = options.slo
    block: dict[str, Any] = {
        "policy": None,
        "admission": None,
        "kvcache_balancing_threshold": None,
        **asdict(summarize(sim_result, slo.ttft_s, slo.tbt_s, slo.tbt_thresholds_s)),
    }
    for name in NO_LIVE_EQUIVALENT:
        block[name] = None
    block["live"] = live
    stats = trace_stats(requests)
    rate_at_1 = (stats.requests - 1) / stats.duration_s if stats.duration_s > 0 else math.nan
    summary: dict[str, Any] = {
        "scenario": options.run_name,
        "mode": "live",
        "trace": options.trace_name,
        "description": f"live replay against {options.url}",
        "paper": None,
        "profile": None,
        "url": options.url,
        "model": model,
        "prompt_format": options.prompt_format,
        "model_dir": str(options.model_dir),
        "prompt_seed": options.seed,
        "headers": sorted(options.headers),  # names only: values may be secrets
        "max_tokens": options.max_tokens,
        "max_in_flight": options.max_in_flight,
        "timeout_s": options.timeout_s,
        "time_scale": options.time_scale,
        "speed": options.speed,
        "speeds": [options.speed],
        "request_rate_per_s": rate_at_1 * options.speed,
        "baseline": None,
        "cluster": None,
        "slo": asdict(slo),
        "trace_stats": asdict(stats),
        "machine": machine(),
        "wall_s": wall_s,
        "policies": {options.run_name: block},
        "versus_baseline": {},
    }
    summary = finite_or_null(summary)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_csv(out_dir / f"requests_{options.run_name}.csv", records, results, options)
    if options.plots:
        hit = block["hit_ratio"]
        write_plots(
            out_dir,
            options.run_name,
            [
                PlotRun(
                    name=options.run_name,
                    ttfts_s=[r.ttft_s for r in records if r.ttft_s is not None],
                    hit_ratio=float(hit) if hit is not None else 0.0,
                    load_t_s=[],
                    prefill_load=[],
                    decode_load=[],
                )
            ],
        )
    return summary


def _write_csv(
    path: Path,
    records: Sequence[RequestRecord],
    results: Sequence[LiveResult],
    options: LiveOptions,
) -> None:
    """The simulator's per-request columns, then the live ones (trace seconds)."""
    fields = list(RequestRecord.__dataclass_fields__)
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow([*fields, *_LIVE_CSV_FIELDS])
        for record, result in zip(records, results, strict=True):
            writer.writerow(
                [
                    *(getattr(record, name) for name in fields),
                    result.status,
                    result.sent_s / options.time_scale,
                    result.max_tokens,
                    len(result.chunk_times_s),
                    result.finish_reason,
                    result.retry_after_s,
                    result.error_code,
                    result.client_error,
                    (result.error_message or "")[:200] or None,
                ]
            )
