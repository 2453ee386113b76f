"""A soak: the conductor and two agents (embedded engine, real processes on loopback)
under a steady mixed load for ``--duration-s`` (default 10 minutes). What must hold at
the end: the memory of every process bounded (resident size sampled every
``--sample-s``; the growth from the first minute to the last reported), every request
accounted for (what the client sent equals what the conductor counted, by outcome), no
5xx, no lock left on any agent.

  python -m bench.soak [--duration-s 600] [--concurrency 8] [--out bench/results/soak]

The load (seeded, ``--seed``): 55% streamed chat completions whose prompts share one of
``--prefixes`` long prefixes (so the agents' pools cache, evict and reuse), 20%
non-streamed completions, 15% bad requests (a 4xx expected), 10% streams the client
drops after the first chunk. Each request asks for 8-48 tokens. Writes ``OUT/soak.md``
(tables, command, machine), ``OUT/soak.json`` and ``OUT/soak.png`` (resident memory of
each process over time).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.field_fleet import http_ok
from bench.fleet_scale import proc_memory_kib
from bench.report import markdown_table, write_results
from kvc.processes import free_ports
from kvc_cli.supervisor import Supervisor
from node_agent.engines.vllm.http_parsing import metric_values

MODEL = "tiny-llama"
WORDS = (
    "harbor", "lantern", "keeper", "tide", "north", "wind", "ledger", "copper", "orchard",
    "river", "stone", "meadow", "signal", "bridge", "winter", "garden", "compass", "archive",
)  # fmt: skip


@dataclass
class Options:
    duration_s: float = 600.0
    concurrency: int = 8
    prefixes: int = 24
    sample_s: float = 10.0
    seed: int = 0
    out: Path = Path("bench/results/soak")


@dataclass
class Tally:
    sent: int = 0
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    transport_errors: int = 0

    def add(self, kind: str, outcome: str) -> None:
        counts = self.by_kind.setdefault(kind, {})
        counts[outcome] = counts.get(outcome, 0) + 1


def _prompt(rng: random.Random, prefixes: list[str]) -> str:
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    return f"{rng.choice(prefixes)} {tail}"


async def _one(client: httpx.AsyncClient, rng: random.Random, prefixes: list[str],
               tally: Tally) -> None:  # fmt: skip
    roll = rng.random()
    max_tokens = rng.randint(8, 48)
    tally.sent += 1
    try:
        if roll < 0.55 or roll >= 0.90:
            kind = "stream" if roll < 0.55 else "dropped_stream"
            body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
                    "messages": [{"role": "user", "content": _prompt(rng, prefixes)}]}  # fmt: skip
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    tally.add(kind, str(resp.status_code))
                    return
                lines = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        lines += 1
                        if kind == "dropped_stream":
                            break  # the client goes away mid-stream
                        if line == "data: [DONE]":
                            break
                tally.add(kind, "200")
        elif roll < 0.75:
            body = {"model": MODEL, "prompt": _prompt(rng, prefixes), "max_tokens": max_tokens}
            resp = await client.post("/v1/completions", json=body)
            tally.add("completion", str(resp.status_code))
        else:
            bad = rng.choice([
                {"model": MODEL},
                {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "seed": 2**64},
                {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]},
                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 17},
            ])  # fmt: skip
            resp = await client.post("/v1/chat/completions", json=bad)
            tally.add("bad", str(resp.status_code))
    except httpx.HTTPError:
        tally.transport_errors += 1


def _metric_sum(text: str, name: str) -> float:
    """The sum of a metric's samples over every label set (0 when absent)."""
    return sum(value for _, value in metric_values(text).get(name, []))


async def _load(opts: Options, base: str, tally: Tally, stop_at: float) -> None:
    rng = random.Random(opts.seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(300)) for _ in range(opts.prefixes)]
    limits = httpx.Limits(max_connections=opts.concurrency * 2)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:

        async def worker(i: int) -> None:
            local = random.Random(opts.seed * 1000 + i)
            while time.monotonic() < stop_at:
                await _one(client, local, prefixes, tally)

        await asyncio.gather(*(worker(i) for i in range(opts.concurrency)))


def run(opts: Options) -> int:
    http, pre, dec, pre_m, dec_m = free_ports(5)
    base = f"http://127.0.0.1:{http}"
    agent = ["agent", "--host", "127.0.0.1", "--threads", "1", "--capacity-blocks", "1024"]
    commands = {
        "prefill": [*agent, "--role", "prefill", "--port", str(pre), "--metrics-port", str(pre_m)],
        "decode": [*agent, "--role", "decode", "--port", str(dec), "--metrics-port", str(dec_m)],
        "conductor": ["conductor", "--port", str(http), "--agents",
                      f"127.0.0.1:{pre},127.0.0.1:{dec}"],
    }  # fmt: skip
    procs = Supervisor(grace_s=60.0, log_dir=opts.out)
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    tally = Tally()
    try:
        pids = {name: procs.spawn(name, args).proc.pid for name, args in commands.items()}
        procs.wait_until(lambda: http_ok(f"{base}/ready"), "the conductor's /ready", 180)
        started = time.monotonic()
        stop_at = started + opts.duration_s

        async def main() -> None:
            load = asyncio.create_task(_load(opts, base, tally, stop_at))
            while not load.done():
                now = time.monotonic() - started
                for name, pid in pids.items():
                    rss = proc_memory_kib(pid).get("VmRSS")
                    if rss is not None:
                        samples[name].append((now, rss / 1024))
                await asyncio.wait({load}, timeout=opts.sample_s)
            await load

        asyncio.run(main())
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        agent_locks = {
            name: _metric_sum(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text,
                              "node_agent_kv_locked_blocks")
            for name, port in (("prefill", pre_m), ("decode", dec_m))
        }  # fmt: skip
    finally:
        procs.stop_all()
    return _report(opts, tally, samples, metrics, agent_locks, commands)


def _report(opts: Options, tally: Tally, samples: dict[str, list[tuple[float, float]]],
            metrics: str, agent_locks: dict[str, float],
            commands: dict[str, list[str]]) -> int:  # fmt: skip
    counted = _metric_sum(metrics, "conductor_requests_total")
    by_status: dict[str, int] = {}
    for counts in tally.by_kind.values():
        for status, n in counts.items():
            by_status[status] = by_status.get(status, 0) + n
    fivexx = sum(n for s, n in by_status.items() if s.startswith("5"))
    mem_rows = []
    growth_ok = True
    for name, series in samples.items():
        first = [m for t, m in series if t <= 60] or [series[0][1]]
        last = [m for t, m in series if t >= series[-1][0] - 60]
        early, late = sum(first) / len(first), sum(last) / len(last)
        peak = max(m for _, m in series)
        growth = 100 * (late - early) / early
        growth_ok &= growth < 15
        mem_rows.append([name, round(early, 1), round(late, 1), round(peak, 1), f"{growth:+.1f}%"])
    # Every request got an answer; the conductor counted every generation request that
    # passed validation (the bad ones are refused before a generation is accounted).
    answered = sum(by_status.values())
    generations = sum(sum(c.values()) for k, c in tally.by_kind.items() if k != "bad")
    bad_4xx = all(s.startswith("4") for s in tally.by_kind.get("bad", {}))
    status = "ok" if (fivexx == 0 and not tally.transport_errors and growth_ok and bad_4xx
                      and answered == tally.sent and counted == generations
                      and not any(agent_locks.values())) else "failed"  # fmt: skip
    kinds = sorted(tally.by_kind)
    req_rows = [[k, json.dumps(dict(sorted(tally.by_kind[k].items())))] for k in kinds]
    command = "python -m bench.soak " + shlex.join(
        [f"--duration-s={opts.duration_s:g}", f"--concurrency={opts.concurrency}",
         f"--seed={opts.seed}"])  # fmt: skip
    text = "\n\n".join([
        f"Command: `{command}`",
        f"Status: **{status}**. Requests sent {tally.sent:,} in {opts.duration_s:g} s "
        f"({tally.sent / opts.duration_s:.1f}/s at concurrency {opts.concurrency}); "
        f"answered {answered:,}; transport errors {tally.transport_errors}; 5xx {fivexx}; "
        f"generation requests past validation {generations:,}, counted by the conductor "
        f"(conductor_requests_total) {counted:,.0f}; locked blocks left: {agent_locks}.",
        "Resident memory (MiB): mean of the first minute, of the last minute, peak:",
        markdown_table(["process", "first min", "last min", "peak", "growth"], mem_rows),
        "Requests by kind and status:",
        markdown_table(["kind", "status: count"], req_rows),
        "Processes:\n" + "\n".join(f"- {n}: `kvc {shlex.join(a)}`" for n, a in commands.items()),
    ])  # fmt: skip
    data = {"options": {k: str(v) for k, v in vars(opts).items()}, "sent": tally.sent,
            "by_kind": tally.by_kind, "transport_errors": tally.transport_errors,
            "conductor_counted": counted, "locked_blocks": agent_locks, "rss_mib": samples,
            "status": status}  # fmt: skip
    md = write_results(opts.out, "soak", "Soak: memory and accounting under steady load", text,
                       data)  # fmt: skip
    _plot(opts.out / "soak.png", samples, opts)
    print(md.read_text())
    return 0 if status == "ok" else 1


def _plot(path: Path, samples: dict[str, list[tuple[float, float]]], opts: Options) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, series in samples.items():
        ax.plot([t / 60 for t, _ in series], [m for _, m in series], label=name)
    ax.set_xlabel("minutes")
    ax.set_ylabel("resident memory, MiB")
    ax.set_title(f"Soak, concurrency {opts.concurrency}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=600.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--prefixes", type=int, default=24)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/results/soak"))
    ns = p.parse_args(argv)
    return run(Options(ns.duration_s, ns.concurrency, ns.prefixes, ns.sample_s, ns.seed, ns.out))


if __name__ == "__main__":
    raise SystemExit(main())
