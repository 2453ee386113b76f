"""Scheduling decision latency: block keys + shadow prefix match + placement, with the
cost models learning between decisions as they do live.

  python -m bench.scheduler_decision [--out bench/results] [--repeats 200]

For prompts of 1k/8k/32k/128k tokens over 8/64/256/1024 nodes: each node's shadow holds
``--keys-per-node`` unrelated keys, and a quarter of the nodes also hold a prefix of
the prompt of varying length (so matching walks real candidate sets). The decision is
timed as the conductor's dispatcher runs it: keys, ``PrefixIndex.match``, then
``PlacementLoop.begin`` + ``RequestPlacement.decide`` (the policy's placement and
admission). Between decisions, untimed, the placed request reports what a live one
does — allocated, prefill done (the predicted time x a factor in [0.7, 1.4]), decode
started, finished after 64 tokens at the predicted TBT x the same kind of factor — so
every timed decision finds the cost models freshly observed (their lazy refresh is in
the time) and the in-flight prefix book in use. Tokenization of an equally long text
is reported separately. After the timed decisions, ``PROFILED`` more run under
``cProfile`` (untimed) to count the Python calls (functions and built-ins) one placement
makes: a measure of work that a shared, noisy machine cannot move, for comparing code
versions. Writes ``scheduler_decision.md``/``.json`` and a PNG (p99 by prompt length,
one line per fleet size).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time
from dataclasses import dataclass
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


def measure(prompt_tokens: int, fleet: Fleet, repeats: int) -> dict[str, Any]:
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
    now_s = 1000.0
    profiler = cProfile.Profile()
    for r in range(repeats + PROFILED):
        profiled = r >= repeats
        started = time.perf_counter()
        keys = compute_block_keys(tokens[:-1], tenant="t", model=MODEL, block_size=32)
        request = ScheduleRequest(
            request_id=f"r{r}",
            prompt_tokens=prompt_tokens,
            prefix_blocks=fleet.index.match(keys),
            max_new_tokens=256,
            slo=Slo(ttft_s=30.0, tbt_s=0.1),
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
        now_s = _report_like_live(placement, step, prompt_tokens, now_s, rng)
    return {
        "prompt_tokens": prompt_tokens,
        "nodes": len(fleet.nodes),
        **summarize_ms(samples),
        "placement_p50_ms": summarize_ms(placing)["p50_ms"],
        "placement_calls": pstats.Stats(profiler).total_calls / PROFILED,  # type: ignore[attr-defined]
    }


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
    placement.allocated()
    prefill_s = step.prefill_s * rng.uniform(0.7, 1.4)
    placement.prefill_done(prompt_tokens, step.cached_tokens, prefill_s)
    placement.committed()
    now_s += step.queue_s + prefill_s
    placement.decode_started(now_s)
    gap_s = step.tbt_s * rng.uniform(0.7, 1.4)
    now_s += 64 * gap_s
    placement.finished(64, stopped=True, now_s=now_s, mean_gap_s=gap_s)
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
    for n in sorted({r["nodes"] for r in rows}):
        series = sorted((r["prompt_tokens"], r["p99_ms"]) for r in rows if r["nodes"] == n)
        ax.plot([x for x, _ in series], [y for _, y in series], marker="o", label=f"{n} nodes")
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
    ns = parser.parse_args(argv)
    rows = []
    for n in ns.fleets:
        per_node = min(ns.keys_per_node, ns.max_total_keys // n)
        fleet = build_fleet(n, per_node, random.Random(n))
        rows += [{**measure(p, fleet, ns.repeats), "keys_per_node": per_node} for p in ns.prompts]
        del fleet
    tok = {p: tokenization_ms(p, ns.repeats) for p in ns.prompts}
    table = markdown_table(
        [
            "prompt tokens",
            "nodes",
            "shadow keys per node",
            "decision p50 ms",
            "decision p99 ms",
            "of which placement p50 ms",
            "Python calls per placement",
            "tokenize p50 ms",
        ],
        [
            [
                r["prompt_tokens"],
                r["nodes"],
                r["keys_per_node"],
                r["p50_ms"],
                r["p99_ms"],
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
        f"decisions as live.\n\n{table}",
        {"rows": rows, "tokenization": {str(k): v for k, v in tok.items()}},
    )
    plot(ns.out / "scheduler_decision.png", rows)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
