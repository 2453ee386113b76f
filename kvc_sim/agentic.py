"""A session-structured agentic workload with the prompt-cache breakpoints its clients send.

What it generates (the ``prompt-cache-ttl`` scenario's trace; docs/benchmarks.md (g))
    ``apps`` agent apps. Each has a static prefix shared by all its sessions: a system
    prompt (``system_tokens``) then its tool definitions (``tools_tokens``). Apps are
    picked with Zipf(1) popularity (app 0 the most popular). A share of them
    (``dynamic_app_share``, spread evenly over the popularity ranks) put *dynamic content
    in the middle* of every prompt: a per-request part (a timestamp, retrieved context:
    ``dynamic_tokens``) after the tools and before the conversation.

    Sessions start as a Poisson process (``session_rate_per_s``, ``sessions`` in all); each
    runs ``turns`` requests of a tool loop. Turn 1 brings a user message; each later turn
    brings a tool result (probability ``tool_share``, ``tool_result_tokens``) or a new user
    message (``user_tokens``). Every turn re-sends the whole conversation so far — each
    earlier message and answer (``answer_tokens``, also the request's output length) —
    plus its new content::

        static app:   [system][tools][m1][a1][m2][a2] ... [mt]
        dynamic app:  [system][tools][dyn_t][m1][a1] ... [mt]     (dyn_t new every request)

    So in a dynamic app only the static prefix is ever reused: the conversation's blocks
    are chained after content no other request carries. The next turn arrives after the
    answer has been generated (``answer_s_per_token`` per answer token) plus a think time:
    a tool's latency (``tool_latency_s``, uniform) before a tool result, a user's think
    time (``user_think_s``, log-uniform: tens of seconds to minutes) before a user
    message — long enough, under load, for an LRU to evict the session in between.

    One-shot requests arrive alongside (Poisson, ``oneshot_rate_per_s``, while sessions
    start): unique prompts (``oneshot_tokens``) nothing reuses, batch jobs and RAG
    one-offs — the flood that turns an LRU over.

Breakpoints (``TraceRequest.breakpoints``: (trace blocks, ttl_s))
    Placed where the issue has Anthropic's clients put ``cache_control``:

    * after system prompt + tools, TTL ``static_ttl_s`` (1 hour), on every session request;
    * at the end of the conversation so far, TTL ``conversation_ttl_s`` (5 minutes): the
      prompt's full blocks, which the next turn re-sends (from the next turn's side, the
      end of the previous turn's conversation). Static apps only: in a dynamic app
      nothing after the dynamic part is asked again, and a client that knows where its
      dynamic content sits marks the static prefix alone (the published "manual
      breakpoint" strategy); ``conversation_breakpoint_in_dynamic_apps`` marks it anyway.

    A breakpoint covers the whole blocks before it (``tokens // block_tokens``; none when
    that is 0). One-shot requests carry none.

Block ids: prefix-chained and interned by ``workload.PrefixBlocks`` (equal ids, equal
prefixes), one segment id per system prompt, tool set, dynamic part, message and answer.

Knobs: ``AgenticSpec``; the same spec gives the same workload (one ``random.Random``
seeded with ``seed``). ``python -m kvc_sim.agentic --out FILE`` writes it as a trace;
``--breakdown DIR`` splits the hit ratio of a replay of that trace (``kvc bench replay
--out DIR``: its ``requests_RUN.csv``) by request kind: session requests of static apps,
of dynamic apps, one-shot requests (``hit_ratio_by_kind``; line ``i`` of the trace is
the replay's request ``r{i:06d}``).

Complexity: O(total blocks of all prompts) time; memory O(distinct blocks).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvc_sim.trace import TRACE_BLOCK_TOKENS, TraceRequest, trace_stats, write_trace
from kvc_sim.workload import PrefixBlocks, Segment

__all__ = [
    "AgenticSpec",
    "AgenticTurn",
    "TurnKind",
    "generate",
    "generate_turns",
    "hit_ratio_by_kind",
    "main",
]

TurnKind = Literal["user", "tool", "oneshot"]

_Range = tuple[int, int]
_RangeS = tuple[float, float]


@dataclass(frozen=True, slots=True)
class AgenticSpec:
    sessions: int = 500
    session_rate_per_s: float = 0.2
    seed: int = 0
    apps: int = 40
    system_tokens: _Range = (2000, 8000)  # uniform, per app
    tools_tokens: _Range = (1000, 6000)  # uniform, per app
    dynamic_app_share: float = 0.375  # apps with dynamic content after the tools
    dynamic_tokens: _Range = (200, 2000)  # per request of a dynamic app
    turns: _Range = (3, 14)  # requests per session
    tool_share: float = 0.7  # later turns that bring a tool result (else a user message)
    user_tokens: _Range = (20, 600)
    tool_result_tokens: _Range = (100, 4000)
    answer_tokens: _Range = (30, 600)
    answer_s_per_token: float = 0.02  # the answer's generation before the next turn
    tool_latency_s: _RangeS = (1.0, 20.0)  # uniform
    user_think_s: _RangeS = (20.0, 600.0)  # log-uniform
    oneshot_rate_per_s: float = 1.6
    oneshot_tokens: _Range = (2000, 16000)
    static_ttl_s: float = 3600.0
    conversation_ttl_s: float = 300.0
    conversation_breakpoint_in_dynamic_apps: bool = False
    block_tokens: int = TRACE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.sessions <= 0 or self.apps <= 0 or self.block_tokens <= 0:
            raise ValueError("sessions, apps and block_tokens must be > 0")
        if self.session_rate_per_s <= 0 or self.oneshot_rate_per_s < 0:
            raise ValueError("session_rate_per_s must be > 0 and oneshot_rate_per_s >= 0")
        if not (0 <= self.dynamic_app_share <= 1 and 0 <= self.tool_share <= 1):
            raise ValueError("dynamic_app_share and tool_share must lie in [0, 1]")
        if self.static_ttl_s <= 0 or self.conversation_ttl_s <= 0:
            raise ValueError("breakpoint TTLs must be > 0")
        if self.answer_s_per_token < 0:
            raise ValueError("answer_s_per_token must be >= 0")
        ranges: tuple[_Range, ...] = (
            self.system_tokens, self.tools_tokens, self.dynamic_tokens, self.turns,
            self.user_tokens, self.tool_result_tokens, self.answer_tokens, self.oneshot_tokens,
        )  # fmt: skip
        if any(not 1 <= lo <= hi for lo, hi in ranges):
            raise ValueError("token and turn ranges must be (lo, hi) with 1 <= lo <= hi")
        lo_s, hi_s = self.user_think_s
        if not (0 <= self.tool_latency_s[0] <= self.tool_latency_s[1] and 0 < lo_s <= hi_s):
            raise ValueError("tool_latency_s needs 0 <= lo <= hi, user_think_s 0 < lo <= hi")

    def is_dynamic(self, app: int) -> bool:
        """Whether ``app`` (popularity rank) puts dynamic content in the middle: the share
        is spread evenly over the ranks (0.5: every second app, starting with app 1)."""
        share = self.dynamic_app_share
        return math.floor((app + 1) * share + 1e-9) > math.floor(app * share + 1e-9)


@dataclass(frozen=True, slots=True)
class AgenticTurn:
    """One request of the workload with where it came from (tests, analyses)."""

    request: TraceRequest
    kind: TurnKind
    app: int  # -1: a one-shot request
    session: int  # -1: a one-shot request
    turn: int  # 1-based within its session; 0: a one-shot request
    static_tokens: int  # system prompt + tools (0: a one-shot request)
    dynamic: bool  # its app puts dynamic content after the tools


@dataclass(frozen=True, slots=True)
class _App:
    system: Segment
    tools: Segment
    dynamic: bool


def generate_turns(spec: AgenticSpec) -> list[AgenticTurn]:
    """Every request in arrival order (stable), ids ``a000000``... in that order."""
    rng = random.Random(spec.seed)
    segment_ids = iter(range(1, 1 << 62))
    blocks = PrefixBlocks(spec.block_tokens)
    bt = spec.block_tokens

    def uniform(bounds: _Range) -> int:
        return rng.randint(bounds[0], bounds[1])

    def segment(bounds: _Range) -> Segment:
        return (next(segment_ids), uniform(bounds))

    apps = [
        _App(segment(spec.system_tokens), segment(spec.tools_tokens), spec.is_dynamic(i))
        for i in range(spec.apps)
    ]
    weights = [1.0 / (i + 1) for i in range(spec.apps)]
    out: list[tuple[float, AgenticTurn]] = []
    start = 0.0
    for session in range(spec.sessions):
        start += rng.expovariate(spec.session_rate_per_s)
        app_index = rng.choices(range(spec.apps), weights=weights)[0]
        app = apps[app_index]
        static_tokens = app.system[1] + app.tools[1]
        conversation: list[Segment] = []
        now = start
        kind: TurnKind = "user"
        for turn in range(1, uniform(spec.turns) + 1):
            if turn > 1:
                kind = "tool" if rng.random() < spec.tool_share else "user"
                if kind == "tool":
                    now += rng.uniform(*spec.tool_latency_s)
                else:
                    lo, hi = spec.user_think_s
                    now += math.exp(rng.uniform(math.log(lo), math.log(hi)))
            conversation.append(
                segment(spec.tool_result_tokens if kind == "tool" else spec.user_tokens)
            )
            middle = [segment(spec.dynamic_tokens)] if app.dynamic else []
            prompt = [app.system, app.tools, *middle, *conversation]
            input_tokens = sum(n for _, n in prompt)
            answer = uniform(spec.answer_tokens)
            breakpoints: list[tuple[int, float]] = []
            if static_tokens // bt:
                breakpoints.append((static_tokens // bt, spec.static_ttl_s))
            if (not app.dynamic or spec.conversation_breakpoint_in_dynamic_apps) and (
                input_tokens // bt > static_tokens // bt
            ):
                breakpoints.append((input_tokens // bt, spec.conversation_ttl_s))
            request = TraceRequest(
                request_id="",
                arrival_s=round(now, 3),
                input_tokens=input_tokens,
                output_tokens=answer,
                hash_ids=blocks.ids(prompt),
                breakpoints=tuple(breakpoints),
            )
            out.append(
                (
                    now,
                    AgenticTurn(
                        request, kind, app_index, session, turn, static_tokens, app.dynamic
                    ),
                )
            )
            conversation.append((next(segment_ids), answer))
            now += answer * spec.answer_s_per_token
    if spec.oneshot_rate_per_s > 0:
        now = 0.0
        while True:
            now += rng.expovariate(spec.oneshot_rate_per_s)
            if now > start:
                break
            prompt = [segment(spec.oneshot_tokens)]
            request = TraceRequest(
                request_id="",
                arrival_s=round(now, 3),
                input_tokens=prompt[0][1],
                output_tokens=uniform(spec.answer_tokens),
                hash_ids=blocks.ids(prompt),
            )
            out.append((now, AgenticTurn(request, "oneshot", -1, -1, 0, 0, False)))
    out.sort(key=lambda item: item[1].request.arrival_s)  # stable: generation order on ties
    return [_with_id(turn, f"a{i:06d}") for i, (_, turn) in enumerate(out)]


def _with_id(turn: AgenticTurn, request_id: str) -> AgenticTurn:
    r = turn.request
    request = TraceRequest(
        request_id, r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, r.breakpoints
    )
    return AgenticTurn(
        request, turn.kind, turn.app, turn.session, turn.turn, turn.static_tokens, turn.dynamic
    )


def generate(spec: AgenticSpec) -> list[TraceRequest]:
    """The workload's requests in arrival order (see the module docstring)."""
    return [turn.request for turn in generate_turns(spec)]


def _kind_label(turn: AgenticTurn) -> str:
    if turn.kind == "oneshot":
        return "oneshot"
    return "dynamic_app" if turn.dynamic else "static_app"


def hit_ratio_by_kind(
    turns: Sequence[AgenticTurn], rows: Iterable[Mapping[str, str]]
) -> dict[str, float]:
    """Cached / prompt tokens per request kind (``static_app``, ``dynamic_app``,
    ``oneshot``) over the prefilled requests among ``rows`` (a replay's request CSV of
    the trace written from ``turns``: request ``r{i:06d}`` is ``turns[i - 1]``)."""
    label = {f"r{i:06d}": _kind_label(t) for i, t in enumerate(turns, start=1)}
    cached: dict[str, int] = {}
    total: dict[str, int] = {}
    for row in rows:
        if row["outcome"] == "rejected":
            continue
        kind = label[row["request_id"]]
        cached[kind] = cached.get(kind, 0) + int(row["cached_tokens"])
        total[kind] = total.get(kind, 0) + int(row["input_tokens"])
    return {kind: cached[kind] / n for kind, n in sorted(total.items()) if n}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvc_sim.agentic [--out FILE] [--breakdown DIR] [--sessions N]
    [--seed S]``: write the trace, and/or split a replay's hit ratio by request kind."""
    parser = argparse.ArgumentParser(
        prog="python -m kvc_sim.agentic",
        description="the agentic prompt-cache workload as a Mooncake trace (with "
        "breakpoints); or a replay's hit ratio by request kind",
    )
    defaults = AgenticSpec()
    parser.add_argument("--out", help="JSONL trace to write")
    parser.add_argument(
        "--breakdown", help="a replay's --out folder of this trace: hit ratio by request kind"
    )
    parser.add_argument("--sessions", type=int, default=defaults.sessions)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    ns = parser.parse_args(argv)
    if not ns.out and not ns.breakdown:
        parser.error("give --out, --breakdown or both")
    turns = generate_turns(AgenticSpec(sessions=ns.sessions, seed=ns.seed))
    if ns.out:
        requests = [t.request for t in turns]
        write_trace(ns.out, requests)
        stats = trace_stats(requests)
        print(
            f"{stats.requests} requests over {stats.duration_s:,.0f} s, input mean "
            f"{stats.input_mean:,.0f} tokens, {stats.distinct_blocks:,} distinct blocks, "
            f"unbounded-cache hit ratio {stats.theoretical_hit_ratio:.1%} -> {ns.out}",
            file=sys.stderr,
        )
    if ns.breakdown:
        kinds = ("static_app", "dynamic_app", "oneshot")
        print("| run | " + " | ".join(kinds) + " |")
        print("|---" * (len(kinds) + 1) + "|")
        folder = Path(ns.breakdown)
        summary = folder / "summary.json"
        runs = (
            list(json.loads(summary.read_text())["policies"])
            if summary.exists()
            else sorted(p.stem.removeprefix("requests_") for p in folder.glob("requests_*.csv"))
        )
        for run in runs:
            with (folder / f"requests_{run}.csv").open(newline="") as fh:
                ratios = hit_ratio_by_kind(turns, csv.DictReader(fh))
            cells = [f"{ratios[k]:.1%}" if k in ratios else "-" for k in kinds]
            print(f"| `{run}` | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
