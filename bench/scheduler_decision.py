"""Scheduling decision latency: block keys + shadow prefix match + placement, with the
cost models learning between decisions as they do live.

  python -m bench.scheduler_decision [--out bench/results] [--repeats 200]

For prompts of 1k/8k/32k/128k tokens over 8/64/256/1024 nodes: each node's shadow holds
``--keys-per-node`` unrelated keys, and a quarter of the nodes also hold a prefix of
the prompt of varying length (so matching walks real candidate sets). The decision is
timed as the conductor's dispatcher runs it (each part is also reported on its own):
keys, ``PrefixIndex.match``, then
``PlacementLoop.begin`` + ``RequestPlacement.decide`` (the policy's placement and
admission). Between decisions, untimed, the placed request reports what a live one
does — allocated, prefill done (the predicted time x a factor in [0.7, 1.4]), decode
started, finished after 64 tokens at the predicted TBT x the same kind of factor — so
every timed decision finds the cost models freshly observed (their lazy refresh is in
the time) and the in-flight prefix book in use. With ``--decodes-in-flight A`` (one row
per value) every decode node also runs ``A`` of this scheduler's decodes while it
decides, as a busy live fleet does: each placed request stays decoding and the oldest
open one finishes (64 tokens) for it, so the forecasts of every decode node walk ``A``
decodes; the fleet starts with ``A`` decodes per node booked at the decode-time
prior, 8k-token prompts, started up to 5 s before, and the clock moves 5 ms per
decision. Agents' load reports change node states between decisions as they do live
(the dispatcher builds a node's state again only when its report or this conductor's
work on it changed): after each decision the placed prefill and decode nodes and
``--reports-per-decision`` other random nodes get a new ``NodeState`` (queued prefill
tokens and free blocks redrawn; running requests kept, so that which decode nodes meet
the TBT SLO does not change under the benchmark). Live, each agent reports every 0.5 s: 1,024
agents at 600 decisions/s are ~3.4 reports per decision, so the default 4 is what the
largest fleet sees. Tokenization of an equally long text is reported separately. After the
timed decisions, ``PROFILED`` more run under ``cProfile`` (untimed) to count the
Python calls (functions and built-ins) one placement makes: a measure of work that a
shared, noisy machine cannot move, for comparing code versions. Writes
``scheduler_decision.md``/``.json`` and a PNG (p99 by prompt length, one line per fleet
size and decodes in flight).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.report import markdown_table, summarize_ms, write_results
from conductor.core.placement import PlacementLoop, Refusal, RequestPlacement, Wait
from conductor.core.prefix_index import NodeId, PrefixIndex
from conductor.core.scheduler import (
    NodeState,
    Placement,
    Scheduler,
    SchedulerConfig,
    ScheduleRequest,
    Slo,
)
from kvc import native
from kvc.block_keys import BlockKey, compute_block_keys
from kvc.models import DEFAULT_MODEL_DIR
from kvc.roles import NodeRole
from kvc.tokenization import ChatTokenizer

PROMPTS = (1024, 8192, 32768, 131072)
PROFILED = 20  # decisions counted under cProfile after the timed ones
FLEETS = (8, 64, 256, 1024)
MODEL = "bench-model"


def build_fleet(n_nodes: int, keys_per_node: int, rng: random.Random) -> Fleet:
    """``n_nodes`` nodes, half prefill and half decode, each with unrelated shadow keys."""
    index = PrefixIndex()
    nodes = []
    for i in range(n_nodes):
        node = NodeId(f"node-{i:03d}")
        index.reset_node(
            node, "epoch", 0, (BlockKey(rng.getrandbits(64)) for _ in range(keys_per_node))
        )
        role: NodeRole = "prefill" if i % 2 == 0 else "decode"
        nodes.append(
            NodeState(
                node_id=node,
                role=role,
                healthy=True,
                block_size=32,
                capacity_blocks=1_000_000,
                free_blocks=500_000,
                kv_bytes_per_token=327_680,
                queued_prefill_tokens=rng.randint(0, 50_000),
                running_requests=rng.randint(0, 64),
            )
        )
    return Fleet(index=index, nodes=nodes)


@dataclass
class Fleet:
    index: PrefixIndex
    nodes: list[NodeState]
    seq: int = 0


def measure(
    prompt_tokens: int, fleet: Fleet, repeats: int, in_flight: int = 0, reports: int = 4
) -> dict[str, Any]:
    rng = random.Random(prompt_tokens * 1000 + len(fleet.nodes))
    tokens = [rng.randrange(0, 150_000) for _ in range(prompt_tokens)]
    prompt_keys = compute_block_keys(tokens[:-1], tenant="t", model=MODEL, block_size=32)
    fleet.seq += 1
    for i, node in enumerate(fleet.nodes):  # a quarter of the fleet holds part of the prompt
        if i % 4 == 0:
            held = prompt_keys[: rng.randint(1, len(prompt_keys))]
            fleet.index.apply(node.node_id, "epoch", fleet.seq, stored=held)
        else:
            fleet.index.apply(node.node_id, "epoch", fleet.seq)
    loop = PlacementLoop(Scheduler(SchedulerConfig()))
    samples: list[float] = []
    placing: list[float] = []  # the placement loop alone (no keys, no match)
    keying: list[float] = []  # the block keys alone
    matching: list[float] = []  # the prefix match alone
    now_s = 1000.0
    profiler = cProfile.Profile()
    busy = _Busy(loop.scheduler, fleet.nodes, in_flight, now_s, rng) if in_flight else None
    placed = 0
    for r in range(repeats + PROFILED):
        profiled = r >= repeats
        started = time.perf_counter()
        keys = compute_block_keys(
            tokens, tenant="t", model=MODEL, block_size=32, end=len(tokens) - 1
        )  # as the dispatcher asks
        keyed = time.perf_counter()
        prefix_blocks = fleet.index.match(keys)
        request = ScheduleRequest(
            request_id=f"r{r}",
            prompt_tokens=prompt_tokens,
            prefix_blocks=prefix_blocks,
            max_new_tokens=256,
            slo=Slo(ttft_s=30.0, tbt_s=0.1 if busy is None else 1.0),
            length_key=(MODEL, "t"),
        )
        matched = time.perf_counter()
        if profiled:
            profiler.enable()
        placement = loop.begin(request, keys, now_s)
        step = placement.decide(fleet.nodes, now_s)
        ended = time.perf_counter()
        if profiled:
            profiler.disable()
        else:
            samples.append(ended - started)
            placing.append(ended - matched)
            keying.append(keyed - started)
            matching.append(matched - keyed)
        placed += isinstance(step, Placement)
        _report_loads(fleet, step, reports, rng)
        if busy is None:
            now_s = _report_like_live(placement, step, prompt_tokens, now_s, rng)
        else:
            now_s = busy.keep_decoding(placement, step, prompt_tokens, now_s, rng)
    return {
        "prompt_tokens": prompt_tokens,
        "nodes": len(fleet.nodes),
        "decodes_in_flight": in_flight,
        "placed_share": placed / (repeats + PROFILED),
        **summarize_ms(samples),
        "placement_p50_ms": summarize_ms(placing)["p50_ms"],
        "keys_p50_ms": summarize_ms(keying)["p50_ms"],
        "match_p50_ms": summarize_ms(matching)["p50_ms"],
        "placement_calls": pstats.Stats(profiler).total_calls / PROFILED,  # type: ignore[attr-defined]
    }


def _report_loads(
    fleet: Fleet, step: Placement | Wait | Refusal, reports: int, rng: random.Random
) -> None:
    """New states, as the dispatcher builds on load reports, for the placed pair (its
    in-flight work changed) and ``reports`` random nodes."""
    nodes = fleet.nodes
    changed = {rng.randrange(len(nodes)) for _ in range(reports)}
    if isinstance(step, Placement):
        changed.update(i for i, n in enumerate(nodes) if n.node_id in (step.prefill, step.decode))
    for i in changed:
        nodes[i] = replace(
            nodes[i],
            queued_prefill_tokens=rng.randint(0, 50_000),
            free_blocks=rng.randint(450_000, 500_000),
        )


def _report_like_live(
    placement: RequestPlacement,
    step: Placement | Wait | Refusal,
    prompt_tokens: int,
    now_s: float,
    rng: random.Random,
) -> float:
    """What the dispatcher reports of a placed request, with measured times near the
    predictions; returns the clock after it."""
    if not isinstance(step, Placement):
        placement.finished()
        return now_s + 0.01
    now_s += step.queue_s + _prefill_like_live(placement, step, prompt_tokens, rng)
    placement.decode_started(now_s)
    gap_s = step.tbt_s * rng.uniform(0.7, 1.4)
    now_s += 64 * gap_s
    placement.finished(64, stopped=True, now_s=now_s, mean_gap_s=gap_s)
    return now_s


def _prefill_like_live(
    placement: RequestPlacement, step: Placement, prompt_tokens: int, rng: random.Random
) -> float:
    """Report the placed request allocated, prefilled (in the predicted time x a factor
    in [0.7, 1.4], returned) and its blocks committed."""
    placement.allocated()
    prefill_s = step.prefill_s * rng.uniform(0.7, 1.4)
    placement.prefill_done(prompt_tokens, step.cached_tokens, prefill_s)
    placement.committed()
    return prefill_s


class _Busy:
    """Keeps ``in_flight`` of the scheduler's decodes running on every decode node."""

    def __init__(
        self,
        scheduler: Scheduler,
        nodes: list[NodeState],
        in_flight: int,
        now_s: float,
        rng: random.Random,
    ) -> None:
        self.scheduler = scheduler
        warm: list[tuple[float, RequestPlacement | tuple[str, NodeId, NodeId]]] = []
        self.limit = in_flight * sum(1 for n in nodes if n.can_decode)
        prefill = next(n.node_id for n in nodes if n.can_prefill)
        prior = scheduler.config.decode_prior
        step_s = prior.fixed_s + prior.per_request_s * in_flight
        step_s += prior.per_context_token_s * in_flight * 8192
        for node in (n for n in nodes if n.can_decode):
            for i in range(in_flight):
                rid = f"warm-{node.node_id}-{i}"
                started = now_s - rng.uniform(0.0, 5.0)
                req = ScheduleRequest(
                    request_id=rid, prompt_tokens=8192, prefix_blocks={}, max_new_tokens=256,
                    slo=Slo(ttft_s=30.0, tbt_s=1.0), length_key=(MODEL, "t"),
                )  # fmt: skip
                placement = Placement(
                    prefill=prefill, decode=node.node_id, prefix_blocks=0, migration=None,
                    queue_s=0.0, prefill_s=0.0, handoff_s=0.0, ttft_s=0.0, tbt_s=step_s,
                )  # fmt: skip
                scheduler.on_assigned(req, placement, started)
                scheduler.on_decode_started(rid, node.node_id, started)
                scheduler.on_prefill_done(rid, prefill, 8192, 0, None)
                warm.append((started, (rid, prefill, node.node_id)))
        rng.shuffle(warm)  # not node by node
        self.open = deque(warm)

    def keep_decoding(
        self,
        placement: RequestPlacement,
        step: Placement | Wait | Refusal,
        prompt_tokens: int,
        now_s: float,
        rng: random.Random,
    ) -> float:
        """Report the new request allocated, prefilled and decoding; finish the oldest
        open decode past the limit; returns the clock after it."""
        if not isinstance(step, Placement):
            placement.finished()
            return now_s + 0.005
        _prefill_like_live(placement, step, prompt_tokens, rng)
        placement.decode_started(now_s)
        self.open.append((now_s, placement))
        now_s += 0.005
        while len(self.open) > self.limit:
            started, done = self.open.popleft()
            gap_s = max(1e-6, (now_s - started) / 64)
            if isinstance(done, RequestPlacement):
                done.finished(64, stopped=True, now_s=now_s, mean_gap_s=gap_s)
            else:
                rid, prefill, decode = done
                self.scheduler.observe_decode(rid, decode, gap_s, now_s)
                self.scheduler.on_finished(
                    rid, prefill, decode, output_tokens=64, stopped=True, now_s=now_s
                )
        return now_s


def tokenization_ms(prompt_tokens: int, repeats: int) -> dict[str, float]:
    tokenizer = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    words = (DEFAULT_MODEL_DIR.parent / "corpus.txt").read_text().split()
    text = " ".join(words)
    while len(tokenizer.encode(text)) < prompt_tokens:
        text = text + " " + text
    ids = tokenizer.encode(text)[:prompt_tokens]
    text = tokenizer.decode(ids)
    samples = []
    for _ in range(max(3, repeats // 10)):
        started = time.perf_counter()
        tokenizer.encode(text)
        samples.append(time.perf_counter() - started)
    return summarize_ms(samples)


def plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, busy in sorted({(r["nodes"], r["decodes_in_flight"]) for r in rows}):
        series = sorted(
            (r["prompt_tokens"], r["p99_ms"])
            for r in rows
            if r["nodes"] == n and r["decodes_in_flight"] == busy
        )
        label = f"{n} nodes" + (f", {busy} decodes per decode node" if busy else "")
        ax.plot([x for x, _ in series], [y for _, y in series], marker="o", label=label)
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="1 ms target (8k × 64)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("decision p99 (ms), tokenization excluded")
    ax.set_title("Scheduling decision: block keys + prefix match + Algorithm 1")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _native_note() -> str:
    if native.AVAILABLE:
        return "compiled (kvc._native)"
    return "pure Python (kvc._native not loaded; KVC_NATIVE=0 or not built)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--keys-per-node", type=int, default=50_000)
    parser.add_argument(
        "--max-total-keys",
        type=int,
        default=16_000_000,
        help="cap on keys over the whole fleet (a fleet gets min(keys-per-node, this / nodes) "
        "per node; 1,024 nodes x 50k keys would need ~7 GiB)",
    )
    parser.add_argument("--prompts", type=int, nargs="*", default=list(PROMPTS))
    parser.add_argument("--fleets", type=int, nargs="*", default=list(FLEETS))
    parser.add_argument(
        "--decodes-in-flight",
        type=int,
        nargs="*",
        default=[0],
        help="this scheduler's decodes running on every decode node while it decides "
        "(one row per value; 0: every placed request finishes before the next decision)",
    )
    parser.add_argument(
        "--reports-per-decision",
        type=int,
        default=4,
        help="random nodes whose state a load report renews between decisions (besides "
        "the placed pair)",
    )
    ns = parser.parse_args(argv)
    if ns.reports_per_decision < 0:
        parser.error("--reports-per-decision must be >= 0")
    rows = []
    for n in ns.fleets:
        per_node = min(ns.keys_per_node, ns.max_total_keys // n)
        fleet = build_fleet(n, per_node, random.Random(n))
        for busy in ns.decodes_in_flight:
            if busy < 0:
                parser.error("--decodes-in-flight must be >= 0")
            for p in ns.prompts:
                measured = measure(p, fleet, ns.repeats, busy, ns.reports_per_decision)
                rows.append({**measured, "keys_per_node": per_node})
        del fleet
    tok = {p: tokenization_ms(p, ns.repeats) for p in ns.prompts}
    table = markdown_table(
        [
            "prompt tokens",
            "nodes",
            "decodes in flight per decode node",
            "shadow keys per node",
            "decision p50 ms",
            "decision p99 ms",
            "of which keys p50 ms",
            "match p50 ms",
            "placement p50 ms",
            "Python calls per placement",
            "tokenize p50 ms",
        ],
        [
            [
                r["prompt_tokens"],
                r["nodes"],
                r["decodes_in_flight"],
                r["keys_per_node"],
                r["p50_ms"],
                r["p99_ms"],
                r["keys_p50_ms"],
                r["match_p50_ms"],
                r["placement_p50_ms"],
                round(r["placement_calls"]),
                tok[r["prompt_tokens"]]["p50_ms"],
            ]
            for r in rows
        ],
    )
    md = write_results(
        ns.out,
        "scheduler_decision",
        "Scheduling decision latency",
        f"Up to {ns.keys_per_node} shadow keys per node ({ns.max_total_keys} over a fleet), "
        f"32-token blocks, {ns.repeats} decisions per cell, cost models observed between "
        f"decisions as live, the placed pair and {ns.reports_per_decision} other nodes given "
        f"a new state (load reports) after each decision. Block keys and prefix lookups: "
        f"{_native_note()}.\n\n{table}",
        {"rows": rows, "tokenization": {str(k): v for k, v in tok.items()}},
    )
    plot(ns.out / "scheduler_decision.png", rows)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
