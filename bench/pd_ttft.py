"""Prefill/decode disaggregation on the embedded engine: what moving a prompt's KV from a
prefill agent to a decode agent costs in TTFT and buys in TBT, through the real conductor.

  python -m bench.pd_ttft [--device cpu|cuda] [--model DIR | --shape llama-8b]
      [--tokens 2048,8192] [--repeats 5] [--max-tokens 32] [--out bench/results]

Three deployments, one after the other, on the same device and the same seeded weights
(real processes on loopback; ``kvc conductor`` and ``kvc agent``):

- **aggregated**: one agent (role both) prefills and decodes each request;
- **P/D streamed**: a prefill agent and a decode agent; the conductor runs the prefill on
  the first, which hands the KV of every prompt token but the last to the second, which
  runs the last token as its first step and streams the tokens. The handoff is the
  agents' gRPC stream (CRC per chunk, device → host → device), as between two hosts
  (``--kv-shm-dir ""``);
- **P/D shared memory**: the same, with the agents' default same-host handoff: the KV
  written into a shared-memory file the decode agent offers (docs/protocol.md).

For each prompt length N (a multiple of the 32-token block): two warm-up requests, then
``--repeats`` fresh prompts (random token ids, never seen: no prefix reuse — checked,
``cached_tokens`` must be 0), each a streamed greedy ``/v1/completions`` of
``--max-tokens`` tokens (``ignore_eos``). Measured by the client: TTFT, and TBT (the time
from the first to the last token over the tokens between). Measured by the decode agent
(its ``node_agent_kv_transfer_seconds`` / ``_bytes_total{direction="received",
kind="handoff"}``, read before and after each request): the handoff's duration and bytes.
The same prompts go to every deployment; ``same output`` counts the requests whose greedy
text equals the aggregated one's. On the CPU in float32 every one must be (the KV moves
bit for bit); in bf16 on a GPU the decode is not run-to-run deterministic, so long
outputs of a random model can differ even between two runs on one deployment
(``bench.decode_determinism`` tells the two apart).

Writes ``pd_ttft-<model>-<device>.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from bench.kv_tiers import BLOCK_TOKENS, block_token_counts
from bench.report import markdown_table, write_results
from bench.tier_ttft import (
    CheckFailed,
    ConductorSystem,
    add_model_args,
    device_name,
    kv_bytes_per_token,
    model_folder,
    stream_completion,
)
from kvc.processes import free_ports
from node_agent.engines.vllm.http_parsing import metric_values

MODES: Final = ("aggregated", "P/D streamed", "P/D shared memory")
_AGENT_ARGS: Final = {
    "aggregated": [],
    "P/D streamed": ["--kv-shm-dir", ""],
    "P/D shared memory": [],  # the default
}
_SHARED: Final = "node_agent_kv_shared_memory_transfers_total"
_SECONDS: Final = "node_agent_kv_transfer_seconds_sum"
_COUNT: Final = "node_agent_kv_transfer_seconds_count"
_BYTES: Final = "node_agent_kv_transfer_bytes_total"


@dataclass(frozen=True, slots=True)
class Sample:
    mode: str
    tokens: int
    ttft_ms: float
    tbt_ms: float  # mean gap between tokens after the first
    total_ms: float
    handoff_ms: float  # the decode agent's handoff duration (0 when aggregated)
    handoff_bytes: int
    text: str


def _handoff(text: str) -> tuple[float, float, float]:
    """(seconds, count, bytes) of received handoffs so far, from an agent's exposition."""
    values = metric_values(text)

    def one(name: str) -> float:
        return sum(
            v
            for labels, v in values.get(name, [])
            if labels.get("direction") == "received" and labels.get("kind") == "handoff"
        )

    return one(_SECONDS), one(_COUNT), one(_BYTES)


class Deployment(ConductorSystem):
    """A conductor and one agent (aggregated) or a prefill and a decode agent."""

    def __init__(
        self, mode: str, model_dir: Path, device: str, work: Path, *, pool_blocks: int
    ) -> None:
        self.mode = mode
        http, *ports = free_ports(5)
        roles = ("both",) if mode == "aggregated" else ("prefill", "decode")
        addresses = [f"127.0.0.1:{ports[2 * i]}" for i in range(len(roles))]
        logs = work / mode.replace("/", "").replace(" ", "-")
        super().__init__(model_dir, addresses, http, logs)
        self.decode_metrics = ""
        for i, role in enumerate(roles):
            grpc, metrics = ports[2 * i], ports[2 * i + 1]
            if role != "prefill":
                self.decode_metrics = f"http://127.0.0.1:{metrics}/metrics"
            self.procs.spawn(
                f"agent-{role}",
                [
                    "agent", "--host", "127.0.0.1", "--port", str(grpc),
                    "--metrics-port", str(metrics), "--role", role, "--no-calibrate",
                    "--model", str(model_dir), "--device", device,
                    "--block-size", str(BLOCK_TOKENS), "--capacity-blocks", str(pool_blocks),
                    *_AGENT_ARGS[mode],
                ],
            )  # fmt: skip
        self.start_conductor()

    def handoffs(self) -> tuple[float, float, float, float]:
        """(seconds, count, bytes) of received handoffs, and shared-memory transfers."""
        text = self.client.get(self.decode_metrics).text
        shared = sum(v for _, v in metric_values(text).get(_SHARED, []))
        return (*_handoff(text), shared)

    def complete(self, prompt: list[int], max_tokens: int) -> Sample:
        before = self.handoffs()
        got = stream_completion(self.client, self.base, self.model, prompt, max_tokens)
        after = self.handoffs()
        if got.cached_tokens != 0:
            raise CheckFailed(f"a fresh prompt reported {got.cached_tokens} cached tokens")
        if got.completion_tokens != max_tokens:
            raise CheckFailed(f"{got.completion_tokens} tokens generated, asked for {max_tokens}")
        moved, shared = int(after[1] - before[1]), int(after[3] - before[3])
        want = {"aggregated": (0, 0), "P/D streamed": (1, 0), "P/D shared memory": (1, 1)}
        if (moved, shared) != want[self.mode]:
            raise CheckFailed(
                f"{self.mode}: {moved} handoffs ({shared} through shared memory) for one request"
            )
        first, last = got.stamps[0], got.stamps[-1]
        return Sample(
            self.mode, len(prompt), (first - got.started) * 1e3,
            (last - first) * 1e3 / max(got.completion_tokens - 1, 1),
            (last - got.started) * 1e3, (after[0] - before[0]) * 1e3,
            int(after[2] - before[2]), got.text,
        )  # fmt: skip


def prompts_for(
    lengths: Sequence[int], repeats: int, vocab: int, seed: int
) -> dict[int, list[list[int]]]:
    """The same fresh prompts for every deployment: ``repeats`` + 2 warm-ups per length."""
    rng = random.Random(seed)
    return {
        n: [[rng.randrange(10, vocab) for _ in range(n)] for _ in range(repeats + 2)]
        for n in lengths
    }


def run(
    model_dir: Path,
    device: str,
    lengths: Sequence[int],
    *,
    repeats: int,
    max_tokens: int,
    work: Path,
    seed: int = 11,
    log: Callable[[str], None] = lambda _: None,
) -> list[Sample]:
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    prompts = prompts_for(lengths, repeats, vocab, seed)
    pool_blocks = 4 * ((max(lengths) + max_tokens) // BLOCK_TOKENS + 2)
    samples: list[Sample] = []
    for mode in MODES:
        deployment = Deployment(mode, model_dir, device, work, pool_blocks=pool_blocks)
        try:
            log(f"{mode}: starting on {device}")
            deployment.wait_ready()
            for n in lengths:
                for i, prompt in enumerate(prompts[n]):
                    sample = deployment.complete(prompt, max_tokens)
                    if i >= 2:  # the first two are warm-ups
                        samples.append(sample)
                        log(f"{mode} {n} tokens: TTFT {sample.ttft_ms:.1f} ms, "
                            f"TBT {sample.tbt_ms:.2f} ms, "
                            f"handoff {sample.handoff_ms:.1f} ms")  # fmt: skip
        except Exception:
            for child in deployment.procs.children:
                log(f"{child.name}, last lines:\n{child.log_tail(4000)}")
            raise
        finally:
            deployment.stop()
    return samples


def _median(samples: Sequence[Sample], what: str) -> float:
    return float(statistics.median(float(getattr(s, what)) for s in samples))


def table_rows(samples: Sequence[Sample], bytes_per_token: int) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for n in sorted({s.tokens for s in samples}):
        agg = [s for s in samples if s.tokens == n and s.mode == "aggregated"]
        for mode in MODES:
            group = [s for s in samples if s.tokens == n and s.mode == mode]
            if not group:
                continue
            same = sum(a.text == d.text for a, d in zip(agg, group, strict=True))
            handoff = _median(group, "handoff_ms")
            moved = statistics.median(s.handoff_bytes for s in group)
            rate = f"{moved / (handoff / 1e3) / 1e6:.0f}" if handoff > 0 else ""
            pd = mode != "aggregated"
            rows.append(
                [
                    n, n * bytes_per_token / (1 << 20), mode, _median(group, "ttft_ms"),
                    _median(group, "tbt_ms"), _median(group, "total_ms"),
                    f"{handoff:.1f}" if pd else "", rate if pd else "",
                    f"{same}/{len(agg)}" if pd else "",
                ]
            )  # fmt: skip
    return rows


def plot(path: Path, title: str, samples: Sequence[Sample]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({s.tokens for s in samples})
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    width = 0.8 / len(MODES)
    colors = ("tab:blue", "tab:orange", "tab:green")
    for i, mode in enumerate(MODES):
        xs = [j + i * width for j in range(len(lengths))]
        group = [[s for s in samples if s.tokens == n and s.mode == mode] for n in lengths]
        ttft = [_median(g, "ttft_ms") for g in group]
        left.bar(xs, ttft, width, label=mode, color=colors[i])
        if mode != "aggregated":
            handoff = [_median(g, "handoff_ms") for g in group]
            left.bar(xs, handoff, width, color="none", edgecolor="black", hatch="//",
                     label="of which KV handoff" if i == 1 else None)  # fmt: skip
        right.bar(xs, [_median(g, "tbt_ms") for g in group], width, label=mode,
                  color=colors[i])  # fmt: skip
    for ax, what in ((left, "TTFT median, ms"), (right, "TBT median, ms")):
        ax.set_xticks([j + width * (len(MODES) - 1) / 2 for j in range(len(lengths))],
                      [f"{n} tokens" for n in lengths])  # fmt: skip
        ax.set_ylabel(what)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="the agents' device (cpu, cuda, cuda:N)")
    add_model_args(parser)
    parser.add_argument("--tokens", type=block_token_counts, default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    ns = parser.parse_args(args)
    if ns.repeats < 1:
        parser.error("--repeats must be >= 1")
    if ns.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (TBT needs two tokens)")
    command = "python -m bench.pd_ttft" + ("" if not args else " " + shlex.join(args))

    def log(message: str) -> None:
        print(f"[pd_ttft {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="pd_ttft-") as tmp:
        work = Path(tmp)
        model_dir = model_folder(ns, work)
        bytes_per_token = kv_bytes_per_token(model_dir)
        samples = run(model_dir, ns.device, ns.tokens, repeats=ns.repeats,
                      max_tokens=ns.max_tokens, work=work, log=log)  # fmt: skip
        model = model_dir.name

    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = "\n".join(
        [
            f"Command: `{command}`",
            "",
            f"- Agents' device: {device_name(ns.device)}; Python {platform.python_version()}; "
            f"{date}",
            f"- Model: {model}; block {BLOCK_TOKENS} tokens; {ns.repeats} fresh prompts per "
            f"length (never cached); {ns.max_tokens} tokens each, greedy",
            "",
            "Streamed `/v1/completions` through the conductor, loopback; TTFT and TBT taken by "
            "the client; handoff: the decode agent's own duration of the KV handoff and its "
            "bytes; `same output`: prompts whose greedy text equals the aggregated one's.",
            "",
            "",
        ]
    )
    table = header + markdown_table(
        ["prompt tokens", "KV MiB", "deployment", "TTFT median ms", "TBT median ms",
         "total median ms", "handoff median ms", "handoff MB/s", "same output"],
        table_rows(samples, bytes_per_token),
    )  # fmt: skip
    name = f"pd_ttft-{model}-{ns.device.split(':')[0]}"
    data: dict[str, Any] = {
        "command": command,
        "device": device_name(ns.device),
        "date": date,
        "model": model,
        "samples": [{k: v for k, v in asdict(s).items() if k != "text"} for s in samples],
    }
    md = write_results(ns.out, name, f"Aggregated vs P/D: {model} on {ns.device}", table, data)
    plot(ns.out / f"{name}.png", f"{model} on {device_name(ns.device)}", samples)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
