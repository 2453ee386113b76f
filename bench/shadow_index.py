"""The conductor's shadow prefix index: memory per indexed block and the cost of each
operation, at fleet sizes the conductor is built for.

  python -m bench.shadow_index [--out bench/results] [--repeats 300]

Per fleet (nodes x keys per node, each node's keys unrelated to the others', plus a
variant where every node also holds one shared 5,000-block prefix): the bytes the index
allocates per (node, key) entry, measured with ``tracemalloc`` around building it from
snapshots (``reset_node``, timed; the keys made inside the window, so the
int objects the index keeps alive count); then p50/p99 of ``apply`` (a 16-key stored event and
the matching removal, as an agent publishes them) and of ``match`` for prompts of 256 and
4,096 keys (8k and 128k tokens at 32-token blocks) that a quarter of the nodes hold to a
random depth, and for a prompt nobody holds (a cold prompt's cost). Writes
``shadow_index.md``/``.json`` and a PNG (bytes per entry, match p50 by fleet).
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench.report import bar_panels, markdown_table, summarize_ms, write_results
from conductor.core.prefix_index import NodeId, PrefixIndex
from kvc.block_keys import BlockKey

FLEETS = ((64, 50_000, 0), (64, 45_000, 5_000), (256, 12_500, 0), (1_024, 15_625, 0))


def build(
    nodes: int, per_node: int, shared: int, rng: random.Random
) -> tuple[PrefixIndex, dict[str, float]]:
    """An index of ``nodes`` x (``per_node`` own keys + ``shared`` common keys); returns
    it and its allocated bytes per (node, key) entry.

    Every snapshot's keys are new ``int`` objects made inside the measured window, as
    the conductor gets them (decoded from a ``Snapshot`` reply), so what the index keeps
    alive of them is counted and nothing else is.
    """
    common_seed = rng.getrandbits(32)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    build_s = 0.0
    for i in range(nodes):
        common = random.Random(common_seed)
        snapshot = [BlockKey(common.getrandbits(64)) for _ in range(shared)]
        snapshot += [BlockKey(rng.getrandbits(64)) for _ in range(per_node)]
        started = time.perf_counter()
        index.reset_node(NodeId(f"node-{i:04d}"), "e", 0, snapshot)
        build_s += time.perf_counter() - started
        del snapshot
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    entries = index.stats().entries
    return index, {"bytes_per_entry": (after - before) / entries, "build_s": build_s}


def time_ops(index: PrefixIndex, nodes: int, repeats: int, rng: random.Random) -> dict[str, Any]:
    ids = [NodeId(f"node-{i:04d}") for i in range(nodes)]
    seq = dict.fromkeys(ids, 0)
    apply_samples: list[float] = []
    for _ in range(repeats):
        node = rng.choice(ids)
        event = [BlockKey(rng.getrandbits(64)) for _ in range(16)]
        started = time.perf_counter()
        index.apply(node, "e", seq[node] + 1, stored=event)
        apply_samples.append(time.perf_counter() - started)
        index.apply(node, "e", seq[node] + 2, removed=event)
        seq[node] += 2
    out: dict[str, Any] = {"apply": summarize_ms(apply_samples)}
    for n_keys in (256, 4_096):
        prompt = [BlockKey(rng.getrandbits(64)) for _ in range(n_keys)]
        for i, node in enumerate(ids):
            if i % 4 == 0:
                seq[node] += 1
                held = prompt[: rng.randint(1, n_keys)]
                index.apply(node, "e", seq[node], stored=held)
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            index.match(prompt)
            samples.append(time.perf_counter() - started)
        out[f"match_{n_keys}"] = summarize_ms(samples)
    cold = [BlockKey(rng.getrandbits(64)) for _ in range(256)]
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        index.match(cold)
        samples.append(time.perf_counter() - started)
    out["match_cold"] = summarize_ms(samples)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--repeats", type=int, default=300)
    ns = parser.parse_args(argv)
    rows = []
    for nodes, per_node, shared in FLEETS:
        rng = random.Random(nodes * 7 + shared)
        index, memory = build(nodes, per_node, shared, rng)
        ops = time_ops(index, nodes, ns.repeats, rng)
        rows.append({"nodes": nodes, "own_keys": per_node, "shared_keys": shared, **memory, **ops})
        print(rows[-1], flush=True)
        del index
        gc.collect()
    table = markdown_table(
        [
            "nodes",
            "keys per node (own + shared)",
            "bytes per entry",
            "build s",
            "apply p50 / p99 ms",
            "match 256 keys p50 / p99 ms",
            "match 4,096 keys p50 / p99 ms",
            "match, nobody holds it, p50 ms",
        ],
        [
            [
                r["nodes"],
                f"{r['own_keys']:,} + {r['shared_keys']:,}",
                round(r["bytes_per_entry"], 1),
                round(r["build_s"], 2),
                f"{r['apply']['p50_ms']:.3f} / {r['apply']['p99_ms']:.3f}",
                f"{r['match_256']['p50_ms']:.3f} / {r['match_256']['p99_ms']:.3f}",
                f"{r['match_4096']['p50_ms']:.3f} / {r['match_4096']['p99_ms']:.3f}",
                f"{r['match_cold']['p50_ms']:.4f}",
            ]
            for r in rows
        ],
    )
    md = write_results(
        ns.out,
        "shadow_index",
        "Shadow prefix index: memory and operation costs",
        f"{ns.repeats} operations per cell; bytes per (node, key) entry by tracemalloc.\n\n{table}",
        {"rows": rows},
    )
    labels = [
        f"{r['nodes']} x {r['own_keys']:,}"
        + (f"\n+ {r['shared_keys']:,} shared" if r["shared_keys"] else "")
        for r in rows
    ]
    bar_panels(
        ns.out / "shadow_index.png",
        "Shadow prefix index (nodes x keys per node)",
        labels,
        [
            ("bytes per (node, key) entry", [r["bytes_per_entry"] for r in rows]),
            ("match p50 ms, 4,096 keys", [r["match_4096"]["p50_ms"] for r in rows]),
            ("apply p50 ms, 16 keys", [r["apply"]["p50_ms"] for r in rows]),
        ],
    )
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
