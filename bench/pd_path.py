"""The live P/D path's own latency: what the conductor and its two agents add to a
request's time to first token, by prompt length and KV block size, at zero service time.

  python -m bench.pd_path [--tokens 4096,16384] [--block-sizes 16,512] [--repeats 8]
      [--out bench/results/pd_path]

For each block size, the fleet ``kvc fleet up --prefill 1 --decode 1`` would start
(``kvc_cli.fleet.plan_fleet``: two simulated vLLM engines, a vLLM-adapter agent on each,
one conductor) with the engines' profile times scaled by ``--time-scale`` (default 1e-6:
a prefill, a KV pull and a decode step take no time to speak of), started cold and waited
for until the conductor sees both agents usable. Then, for each prompt length N:

1. **through the conductor**: ``--warmup`` then ``--repeats`` streamed ``/v1/completions``
   of ``--max-tokens`` tokens, each on a fresh prompt of N random token ids (no prefix
   reuse), one at a time, ``--gap-s`` apart; TTFT = request sent → first chunk with text,
   the body encoded before the clock starts. The conductor places the prefill on the
   prefill engine's agent, which returns vLLM's ``kv_transfer_params``; the decode agent's
   engine pulls the KV and streams the tokens back through its agent and the conductor;
2. **the engines alone**, the same two legs sent by this client on other fresh prompts of
   N tokens: the prefill leg (``kv_transfer_params.do_remote_decode``, unstreamed, one
   token) on the prefill engine, then the decode leg with that answer's
   ``kv_transfer_params`` on the decode engine, streamed; TTFT = the prefill leg's time +
   the decode leg's time to its first text chunk;
3. **CPU per request** of each process over phase 1 (user + system, ``/proc``), less what
   it spends idle over as long (its rate over ``--idle-s`` before the phase).

"Added" is the difference of the two medians: the HTTP front, the decision, the gRPC and
token-stream hops, the transactions, the block keys and the KV events of the conductor
and both agents. Then ``OUT/pd_path.md`` (table, command, machine), ``OUT/pd_path.json``
and ``OUT/pd_path.png``.

Everything shares the machine's cores. Linux only (``/proc``). Knobs: the flags
(``--help``). Complexity: block sizes × (fleet start + lengths × (warmup + 2 × repeats)
requests).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.field_fleet import cpu_seconds
from bench.fleet_scale import started_fleet
from bench.report import bar_panels, markdown_table, run_then_report, write_run_report
from kvc import fast_json
from kvc.models import DEFAULT_MODEL_DIR
from kvc.tokenization import ChatTokenizer
from kvc_cli.fleet import FleetOptions, FleetPlan
from kvc_cli.supervisor import Supervisor

__all__ = ["HEADERS", "LengthResult", "PathOptions", "RunResult", "main", "table_rows"]

_FIRST_ID = 10  # below: the tiny model's special and byte tokens


@dataclass(frozen=True, slots=True)
class PathOptions:
    tokens: tuple[int, ...]
    block_sizes: tuple[int, ...]
    repeats: int
    warmup: int
    max_tokens: int
    gap_s: float
    idle_s: float
    time_scale: float
    port: int
    base_port: int
    out: Path
    startup_timeout_s: float


@dataclass(slots=True)
class LengthResult:
    tokens: int
    conductor_ttft_ms: list[float] = field(default_factory=list)
    engines_ttft_ms: list[float] = field(default_factory=list)
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)

    @property
    def conductor_p50_ms(self) -> float | None:
        return statistics.median(self.conductor_ttft_ms) if self.conductor_ttft_ms else None

    @property
    def engines_p50_ms(self) -> float | None:
        return statistics.median(self.engines_ttft_ms) if self.engines_ttft_ms else None

    @property
    def added_p50_ms(self) -> float | None:
        via, alone = self.conductor_p50_ms, self.engines_p50_ms
        return None if via is None or alone is None else via - alone


@dataclass(slots=True)
class RunResult:
    block_size: int
    status: str = "ok"
    lengths: list[LengthResult] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- the client


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(_FIRST_ID, vocab) for _ in range(n)]


def _has_text(line: str) -> bool:
    """A ``data:`` line of a completions stream whose choice carries text."""
    if not line.startswith("data: {"):
        return False
    chunk = fast_json.loads(line[6:])
    return any(c.get("text") for c in chunk.get("choices") or ())


async def _first_text_s(client: httpx.AsyncClient, url: str, body: bytes) -> float:
    """Seconds from sending ``body`` to the first chunk with text; the stream is read to
    its end. Raises ``RuntimeError`` on an error status or a stream without text."""
    headers = {"Content-Type": "application/json"}
    started = time.perf_counter()
    first: float | None = None
    async with client.stream("POST", url, content=body, headers=headers) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}")
        async for line in response.aiter_lines():
            if first is None and _has_text(line):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{url} streamed no text")
    return first


async def _through_conductor(
    client: httpx.AsyncClient, base: str, model: str, prompt: list[int], max_tokens: int
) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    return await _first_text_s(client, f"{base}/v1/completions", fast_json.dumps(body))


async def _engines_alone(
    client: httpx.AsyncClient,
    prefill: str,
    decode: str,
    model: str,
    prompt: list[int],
    max_tokens: int,
) -> float:
    """The prefill leg on ``prefill``, then the decode leg on ``decode`` (vLLM's P/D)."""
    leg = {
        "model": model, "prompt": prompt, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }  # fmt: skip
    body = fast_json.dumps(leg)
    headers = {"Content-Type": "application/json"}
    started = time.perf_counter()
    response = await client.post(f"{prefill}/v1/completions", content=body, headers=headers)
    prefill_s = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"the prefill engine answered {response.status_code}")
    params: dict[str, Any] = response.json()["kv_transfer_params"]
    second = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "kv_transfer_params": {**params, "do_remote_prefill": True, "do_remote_decode": False},
    }  # fmt: skip
    return prefill_s + await _first_text_s(
        client, f"{decode}/v1/completions", fast_json.dumps(second)
    )


# ---------------------------------------------------------------- one fleet


def _cpu(groups: dict[str, list[int]]) -> dict[str, float]:
    return {name: sum(cpu_seconds(p) for p in pids) for name, pids in groups.items()}


async def _measure(
    opts: PathOptions,
    result: RunResult,
    base: str,
    engines: tuple[str, str],
    groups: dict[str, list[int]],
) -> None:
    vocab = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR).vocab_size
    rng = random.Random(20261128)
    async with httpx.AsyncClient(timeout=120.0) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        for n in opts.tokens:
            length = LengthResult(n)
            for _ in range(opts.warmup):
                await _through_conductor(
                    client, base, model, _prompt(rng, n, vocab), opts.max_tokens
                )
            idle0 = _cpu(groups)
            await asyncio.sleep(opts.idle_s)  # the idle sample's window, not a wait
            idle1 = _cpu(groups)
            before, started = _cpu(groups), time.perf_counter()
            for _ in range(opts.repeats):
                prompt = _prompt(rng, n, vocab)
                ttft = await _through_conductor(client, base, model, prompt, opts.max_tokens)
                length.conductor_ttft_ms.append(1000 * ttft)
                await asyncio.sleep(opts.gap_s)  # requests one at a time, on a quiet fleet
            after, elapsed = _cpu(groups), time.perf_counter() - started
            for name in groups:
                idle_rate = (idle1[name] - idle0[name]) / opts.idle_s
                busy = after[name] - before[name] - idle_rate * elapsed
                length.cpu_ms_per_request[name] = 1000 * max(0.0, busy) / opts.repeats
            for _ in range(opts.repeats):
                prompt = _prompt(rng, n, vocab)
                ttft = await _engines_alone(client, *engines, model, prompt, opts.max_tokens)
                length.engines_ttft_ms.append(1000 * ttft)
                await asyncio.sleep(opts.gap_s)
            result.lengths.append(length)


def run_block_size(opts: PathOptions, block_size: int) -> RunResult:
    result = RunResult(block_size)
    out = opts.out / f"block{block_size}"
    out.mkdir(parents=True, exist_ok=True)
    longest = max(opts.tokens) + opts.max_tokens
    blocks = max(4096, 4 * (opts.warmup + 2 * opts.repeats) * -(-longest // block_size))
    fleet = FleetOptions(
        prefill=1, decode=1, port=opts.port, base_port=opts.base_port,
        time_scale=opts.time_scale, block_size=block_size, num_gpu_blocks=blocks,
        max_model_len=max(262_144, 2 * longest), policy="kv_adaptive",
        conductor_args=("--admission=none",), log_dir=str(out / "logs"),
    )  # fmt: skip
    try:
        with started_fleet(fleet, out / "logs", opts.startup_timeout_s, "kvc-pd-path-") as (
            plan,
            sup,
        ):
            _measure_fleet(opts, result, plan, sup, fleet.host)
    except (RuntimeError, ValueError, KeyError, OSError, httpx.HTTPError) as exc:
        result.status = f"failed: {type(exc).__name__}: {exc}"
    return result


def _measure_fleet(
    opts: PathOptions, result: RunResult, plan: FleetPlan, sup: Supervisor, host: str
) -> None:
    for spec in plan.processes:
        result.commands[spec.name] = shlex.join(["kvc", *spec.args])
    base = plan.conductor_urls[0]
    groups: dict[str, list[int]] = {}
    for child in sup.children:  # engine-prefill-0, agent-decode-0, conductor-0, ...
        kind, _, rest = child.name.partition("-")
        name = kind if kind == "conductor" else f"{kind} {rest.split('-')[0]}"
        groups.setdefault(name, []).append(child.proc.pid)
    engines = tuple(f"http://{host}:{spec.ports[0]}" for spec in plan.engines)
    assert len(engines) == 2
    asyncio.run(_measure(opts, result, base, (engines[0], engines[1]), groups))
    if (dead := sup.exited()) is not None:
        result.status = f"failed: {dead.name} exited (code {dead.proc.returncode})"


# ---------------------------------------------------------------- report

HEADERS = [
    "block size",
    "prompt tokens",
    "TTFT via the conductor p50 ms",
    "engines alone p50 ms",
    "added p50 ms",
    "CPU per request ms: conductor / prefill agent / decode agent",
    "engines (P / D)",
]


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}"


def table_rows(results: Sequence[RunResult]) -> list[list[str]]:
    rows: list[list[str]] = []
    for run in results:
        if run.status != "ok":
            rows.append([str(run.block_size), "–", run.status, "–", "–", "–", "–"])
            continue
        for n in run.lengths:
            cpu = n.cpu_ms_per_request
            rows.append(
                [
                    str(run.block_size),
                    f"{n.tokens:,}",
                    _ms(n.conductor_p50_ms),
                    _ms(n.engines_p50_ms),
                    _ms(n.added_p50_ms),
                    " / ".join(
                        _ms(cpu.get(k)) for k in ("conductor", "agent prefill", "agent decode")
                    ),
                    " / ".join(_ms(cpu.get(k)) for k in ("engine prefill", "engine decode")),
                ]
            )
    return rows


def write_report(opts: PathOptions, results: Sequence[RunResult], command: str) -> Path:
    text = (
        f"{markdown_table(HEADERS, table_rows(results))}\n\n"
        f"1 prefill + 1 decode simulated engine at time scale {opts.time_scale:g}; "
        f"{opts.repeats} requests per cell after {opts.warmup} warm-up, one at a time, "
        f"{opts.gap_s:g} s apart, each a fresh prompt of random token ids, "
        f"max_tokens {opts.max_tokens}. Added = median through the conductor − median of "
        "the same two legs sent to the engines directly. CPU: user + system over the "
        "requests through the conductor, less the process's idle rate, per request."
    )
    commands = [(f"block {r.block_size} {k}", c) for r in results for k, c in r.commands.items()]
    title = "The live P/D path's own latency"
    md = write_run_report(opts.out, "pd_path", title, command, text, commands, opts, results)
    done = [(r, n) for r in results if r.status == "ok" for n in r.lengths]
    if done:
        labels = [f"{n.tokens // 1024}k, block {r.block_size}" for r, n in done]
        panels: list[tuple[str, list[float]]] = [
            ("TTFT via the conductor p50 (ms)", [n.conductor_p50_ms or 0 for _, n in done]),
            ("engines alone p50 (ms)", [n.engines_p50_ms or 0 for _, n in done]),
            ("added by conductor + agents (ms)", [n.added_p50_ms or 0 for _, n in done]),
            (
                "CPU/request, conductor + agents (ms)",
                [
                    sum(v for k, v in n.cpu_ms_per_request.items() if not k.startswith("engine"))
                    for _, n in done
                ],
            ),
        ]
        bar_panels(opts.out / "pd_path.png", title + " (bench.pd_path)", labels, panels)
    return md


# ---------------------------------------------------------------- CLI


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{what} must be positive integers separated by commas: {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.pd_path",
        description="what the conductor and its agents add to a P/D request's TTFT",
    )
    p.add_argument("--tokens", default="4096,16384", help="prompt lengths, comma-separated")
    p.add_argument("--block-sizes", default="16,512", help="KV block sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=8, help="requests per cell and path")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--gap-s", type=float, default=0.3, help="pause between requests")
    p.add_argument("--idle-s", type=float, default=3.0, help="idle CPU sample per cell")
    p.add_argument("--time-scale", type=float, default=1e-6, help="wall s per profile s")
    p.add_argument("--port", type=int, default=8400, help="the conductor's HTTP port")
    p.add_argument("--base-port", type=int, default=21500, help="engines and agents from here")
    p.add_argument("--out", type=Path, default=Path("bench/results/pd_path"))
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    ns = parser.parse_args(args)
    try:
        tokens = _ints(ns.tokens, "--tokens")
        block_sizes = _ints(ns.block_sizes, "--block-sizes")
    except ValueError as exc:
        parser.error(str(exc))
    if ns.repeats < 1 or ns.warmup < 0 or ns.max_tokens < 2:
        parser.error("--repeats must be >= 1, --warmup >= 0, --max-tokens >= 2")
    if ns.time_scale <= 0 or ns.gap_s < 0 or ns.idle_s <= 0:
        parser.error("--time-scale and --idle-s must be > 0, --gap-s >= 0")
    opts = PathOptions(
        tokens=tokens, block_sizes=block_sizes, repeats=ns.repeats, warmup=ns.warmup,
        max_tokens=ns.max_tokens, gap_s=ns.gap_s, idle_s=ns.idle_s,
        time_scale=ns.time_scale, port=ns.port, base_port=ns.base_port, out=ns.out,
        startup_timeout_s=ns.startup_timeout_s,
    )  # fmt: skip
    command = shlex.join(["python", "-m", "bench.pd_path", *args])

    def run(results: list[RunResult]) -> None:
        for block_size in opts.block_sizes:
            results.append(run_block_size(opts, block_size))

    return run_then_report(run, lambda results: write_report(opts, results, command))


if __name__ == "__main__":
    sys.exit(main())
