"""Time to first token through the real conductor for a prompt served from each KV tier.

  python -m bench.tier_ttft [--device cpu|cuda] [--model DIR | --shape llama-8b]
      [--tokens 2048,8192] [--repeats 3] [--out bench/results]

``bench.kv_tiers`` times the tiers' copies in one process; this is the same question asked
live: one conductor and one agent (embedded engine, role both, token stream on) as real
processes on loopback, a streamed ``/v1/completions`` with a token-id prompt, TTFT taken by
the client. For each cached-prefix length N (a multiple of the 32-token block; the prompt
is N + 1 tokens), ``--repeats`` rounds, each with a fresh prompt P:

1. **cold**: P the first time (cached tokens must be 0): the prefill of N + 1 tokens;
2. **L1**: P again at once: its N tokens are in the engine's memory;
3. **L2**: other prompts (fillers, each as long as the longest P) until P's blocks have
   left the engine's memory for host memory, then P (its N tokens promoted from L2) at
   once, whatever the fillers' demotions left queued on the agent's I/O thread (the
   backlog is recorded: a promotion must not wait behind it);
4. **L3**: fillers, each followed by a wait for the agent's tier I/O backlog to drain
   (``node_agent_tier_io_queued_jobs``: evicted blocks' files are removed behind the
   writes), until every block of P is a file on disk, then P (promoted from L3).

Every measured request is checked: cached tokens (``usage.prompt_tokens_details``) are N
for 2-4, the agent's ``node_agent_tier_promoted_blocks_total{medium}`` rose by exactly
P's blocks from the tier named (and not from the other); a check that fails stops the run
with what it saw. Whether the greedy output equals the cold one is recorded and reported
(``greedy = cold``): on CPU in float32 it always does (tests/system/test_kv_tiers.py asserts
it); in bf16 on a GPU a prefill over cached KV runs other kernel shapes than one over the
whole prompt, and a near tie between two tokens of a random model can go either way.

Sizes: the agent's pool holds 2 x (blocks of the longest prompt + 1) blocks, host memory
2 x that, disk 4 x that; so four fillers always push P out of the pool (and not on out
of host memory), and P reaches disk only through host memory.

``--shape llama-8b`` writes a model folder with Llama-3-8B's shape (32 layers, 8 KV heads
of 128, bf16: 128 KiB of KV per token) and ``kvc_init.json`` (seeded random weights,
nothing downloaded), the tokenizer and its vocabulary taken from the bundled tiny model,
and a 16k context.

Writes ``tier_ttft-<model>-<device>.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import httpx

from bench.field_fleet import http_ok
from bench.kv_tiers import BLOCK_TOKENS, SHAPES, block_token_counts
from bench.report import markdown_table, write_results
from kvc.block_keys import compute_block_keys
from kvc.models import DEFAULT_MODEL_DIR
from kvc.processes import free_ports
from kvc_cli.supervisor import Supervisor

STEPS: Final = ("cold", "L1", "L2", "L3")
TENANT: Final = "default"  # what the conductor names a request without a tenant
MAX_TOKENS: Final = 4
L2_FILLERS: Final = 4
MAX_FILLERS: Final = 24
START_S: Final = 900.0  # an 8B model with random weights is built on the CPU first
_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True, slots=True)
class Sample:
    step: str
    ttft_ms: float
    total_ms: float
    cached_tokens: int
    promoted_host: int
    promoted_disk: int
    fillers: int  # sent before this request to move P down
    same_as_cold: bool  # greedy output equal to the cold (fully computed) one
    io_queued: int  # the agent's tier I/O backlog (jobs) when the request was sent


@dataclass(frozen=True, slots=True)
class LengthResult:
    tokens: int  # the cached prefix N; the prompt is N + 1 tokens
    blocks: int
    kv_bytes: int
    samples: tuple[Sample, ...]

    def median(self, step: str, what: str = "ttft_ms") -> float:
        values: list[float] = [getattr(s, what) for s in self.samples if s.step == step]
        return statistics.median(values)


class CheckFailed(RuntimeError):
    """A measured request was not served the way its step says."""


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streamed greedy completion as the client saw it."""

    started: float  # perf_counter at the request
    stamps: tuple[float, ...]  # perf_counter at each chunk carrying a choice
    text: str
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens (-1: no usage chunk)
    completion_tokens: int  # usage.completion_tokens (-1: no usage chunk)


def stream_completion(
    client: httpx.Client, base: str, model: str, prompt: list[int], max_tokens: int
) -> Streamed:
    """A streamed greedy ``/v1/completions`` of a token-id prompt (``ignore_eos``, usage
    included); a non-200 answer or a stream without a token raises ``CheckFailed``."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    stamps: list[float] = []
    pieces: list[str] = []
    cached, completion = -1, -1
    with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise CheckFailed(f"HTTP {response.status_code}: {response.text[:500]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                stamps.append(time.perf_counter())
                pieces.append(choice.get("text", ""))
            usage = chunk.get("usage")
            if usage:
                completion = int(usage.get("completion_tokens", 0))
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    if not stamps:
        raise CheckFailed("the stream carried no token")
    return Streamed(started, tuple(stamps), "".join(pieces), cached, completion)


# ---------------------------------------------------------------------------- the model
def write_shape_folder(shape: str, folder: Path) -> Path:
    """A model folder of ``shape`` with seeded random weights (``kvc_init.json``) and the
    bundled tiny model's tokenizer (the vocabulary size follows it)."""
    from tokenizers import Tokenizer

    target = folder / shape
    target.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, target / name)
    vocab = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")).get_vocab_size()
    tiny = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    config = {
        **SHAPES[shape],
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "bos_token_id": tiny.get("bos_token_id"),
        "eos_token_id": tiny.get("eos_token_id"),
        "max_position_embeddings": 16384,
        "dtype": "bfloat16",
        "hidden_act": "silu",
    }
    (target / "config.json").write_text(json.dumps(config, indent=2))
    (target / "kvc_init.json").write_text(json.dumps({"seed": 1, "initializer_range": 0.02}))
    return target


def kv_bytes_per_token(model_dir: Path) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    width = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * width


# ---------------------------------------------------------------------------- the system
class ConductorSystem:
    """A conductor (no SLO admission: every request is measured, however slow the device)
    in front of agents, real processes on loopback run by a ``Supervisor``."""

    def __init__(self, model_dir: Path, agents: list[str], http: int, log_dir: Path) -> None:
        self.base = f"http://127.0.0.1:{http}"
        self.procs = Supervisor(grace_s=60.0, log_dir=log_dir)
        self._conductor = [
            "conductor", "--port", str(http), "--agents", ",".join(agents),
            "--model", str(model_dir), "--admission", "none",
        ]  # fmt: skip
        self.client = httpx.Client(timeout=600.0)
        self.model = ""

    def start_conductor(self) -> None:
        """After the agents: their processes are spawned first."""
        self.procs.spawn("conductor", self._conductor)

    def wait_ready(self, timeout_s: float = START_S) -> None:
        """Until the conductor is ready (a child that exits raises with its log)."""
        self.procs.wait_until(lambda: http_ok(f"{self.base}/ready"), "the conductor", timeout_s)
        self.model = self.client.get(f"{self.base}/v1/models").json()["data"][0]["id"]

    def stop(self) -> None:
        self.client.close()
        self.procs.stop_all()


class TieredSystem(ConductorSystem):
    """One agent (tiers on) and one conductor, real processes on loopback."""

    def __init__(
        self, model_dir: Path, device: str, work: Path, *, pool_blocks: int, block_bytes: int
    ) -> None:
        self.model_dir = model_dir
        self.disk = work / "l3"
        http, grpc, metrics = free_ports(3)
        super().__init__(model_dir, [f"127.0.0.1:{grpc}"], http, work)
        self.metrics_url = f"http://127.0.0.1:{metrics}/metrics"
        agent = [
            "agent", "--host", "127.0.0.1", "--port", str(grpc), "--metrics-port", str(metrics),
            "--stream-port", "0", "--role", "both", "--no-calibrate", "--model", str(model_dir),
            "--device", device, "--block-size", str(BLOCK_TOKENS),
            "--capacity-blocks", str(pool_blocks),
            "--host-tier-bytes", str(2 * pool_blocks * block_bytes),
            "--disk-tier-dir", str(self.disk),
            "--disk-tier-bytes", str(4 * pool_blocks * block_bytes),
        ]  # fmt: skip
        self.procs.spawn("agent", agent)
        self.start_conductor()

    def complete(self, prompt: list[int]) -> tuple[float, float, int, str]:
        """Stream a greedy completion: (TTFT s, total s, cached tokens, text)."""
        got = stream_completion(self.client, self.base, self.model, prompt, MAX_TOKENS)
        ended = time.perf_counter()
        return got.stamps[0] - got.started, ended - got.started, got.cached_tokens, got.text

    def io_queued(self) -> int:
        """The agent's tier I/O backlog: copies, writes and removals not started yet."""
        text = self.client.get(self.metrics_url).text
        found = re.search(r"^node_agent_tier_io_queued_jobs (\S+)$", text, re.MULTILINE)
        return 0 if found is None else int(float(found.group(1)))

    def settle(self, timeout_s: float = 300.0) -> None:
        """Until the agent's tier I/O backlog is empty (its disk tier then equals the
        files on disk: removals of evicted blocks are done)."""
        self.procs.wait_until(lambda: self.io_queued() == 0, "the tier I/O backlog", timeout_s)

    def promoted(self) -> tuple[int, int]:
        text = self.client.get(self.metrics_url).text
        out = []
        for medium in ("host", "disk"):
            found = re.search(
                rf'^node_agent_tier_promoted_blocks_total{{medium="{medium}"}} (\S+)$',
                text,
                re.MULTILINE,
            )
            out.append(0 if found is None else int(float(found.group(1))))
        return out[0], out[1]

    def on_disk(self, prompt: list[int]) -> bool:
        keys = compute_block_keys(
            prompt[:-1], tenant=TENANT, model=self.model, block_size=BLOCK_TOKENS
        )
        return all((self.disk / f"{key:016x}.kvblock").exists() for key in keys)


# ---------------------------------------------------------------------------- measuring
def _prompt(rng: random.Random, tokens: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(tokens)]


def measure_length(
    sysm: TieredSystem,
    tokens: int,
    *,
    filler_tokens: int,
    repeats: int,
    vocab: int,
    bytes_per_token: int,
    rng: random.Random,
    log: Callable[[str], None] = lambda _: None,
) -> LengthResult:
    """``repeats`` rounds of cold, L1, L2, L3 for a prefix of ``tokens``; see the module doc."""
    blocks = tokens // BLOCK_TOKENS
    samples: list[Sample] = []

    def filler() -> None:
        sysm.complete(_prompt(rng, filler_tokens + 1, vocab))

    for round_ in range(repeats):
        prompt = _prompt(rng, tokens + 1, vocab)
        reference: str | None = None
        fillers = 0
        for step in STEPS:
            if step == "L2":
                for _ in range(L2_FILLERS):
                    filler()
                fillers = L2_FILLERS
            elif step == "L3":
                fillers = 0
                # Files of evicted blocks are removed on the I/O thread, behind the writes:
                # only a settled backlog makes "a file for every block" mean "on disk".
                sysm.settle()
                while not sysm.on_disk(prompt):
                    if fillers == MAX_FILLERS:
                        raise CheckFailed(f"P not on disk after {fillers} fillers")
                    filler()
                    fillers += 1
                    sysm.settle()
            queued = sysm.io_queued()
            host0, disk0 = sysm.promoted()
            ttft, total, cached, text = sysm.complete(prompt)
            host1, disk1 = sysm.promoted()
            if reference is None:
                reference = text
            sample = Sample(step, ttft * 1e3, total * 1e3, cached, host1 - host0, disk1 - disk0,
                            fillers, text == reference, queued)  # fmt: skip
            want = {
                "cold": (0, 0, 0),
                "L1": (tokens, 0, 0),
                "L2": (tokens, blocks, 0),
                "L3": (tokens, 0, blocks),
            }[step]
            got = (cached, sample.promoted_host, sample.promoted_disk)
            if got != want:
                raise CheckFailed(
                    f"{tokens} tokens, round {round_}, {step}: (cached, promoted host, promoted "
                    f"disk) = {got}, expected {want}"
                )
            samples.append(sample)
            log(
                f"{tokens} tokens, round {round_}, {step}: TTFT {sample.ttft_ms:.1f} ms "
                f"(tier I/O backlog {queued} jobs)"
            )
    return LengthResult(tokens, blocks, tokens * bytes_per_token, tuple(samples))


def run(
    model_dir: Path,
    device: str,
    lengths: Sequence[int],
    *,
    repeats: int,
    work: Path,
    seed: int = 7,
    log: Callable[[str], None] = lambda _: None,
) -> list[LengthResult]:
    longest = max(lengths)
    bytes_per_token = kv_bytes_per_token(model_dir)
    pool_blocks = 2 * (longest // BLOCK_TOKENS + 1)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    sysm = TieredSystem(
        model_dir, device, work, pool_blocks=pool_blocks,
        block_bytes=BLOCK_TOKENS * bytes_per_token,
    )  # fmt: skip
    try:
        log(f"starting an agent on {device} and a conductor")
        sysm.wait_ready()
        rng = random.Random(seed)
        warm = _prompt(rng, longest + 1, vocab)
        for _ in range(2):  # kernels, allocator, the conductor's first estimates
            sysm.complete(warm)
        results = []
        for n in lengths:
            result = measure_length(
                sysm, n, filler_tokens=longest, repeats=repeats, vocab=vocab,
                bytes_per_token=bytes_per_token, rng=rng, log=log,
            )  # fmt: skip
            results.append(result)
        return results
    except Exception:
        for child in sysm.procs.children:  # the folder goes with the run: show what they said
            log(f"{child.name}, last lines:\n{child.log_tail(4000)}")
        raise
    finally:
        sysm.stop()


# ---------------------------------------------------------------------------- reporting
def table_rows(results: Sequence[LengthResult]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for r in results:
        cold = r.median("cold")
        for step in STEPS:
            ttft = r.median(step)
            steps = [s for s in r.samples if s.step == step]
            rows.append(
                [
                    r.tokens,
                    r.kv_bytes / (1 << 20),
                    step,
                    ttft,
                    min(s.ttft_ms for s in steps),
                    r.median(step, "total_ms"),
                    "" if step == "cold" else f"{cold / max(ttft, 1e-9):.1f}x",
                    f"{sum(s.same_as_cold for s in steps)}/{len(steps)}",
                ]
            )
    return rows


def plot(path: Path, title: str, results: Sequence[LengthResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(STEPS)
    colors = {"cold": "black", "L1": "tab:purple", "L2": "tab:green", "L3": "tab:blue"}
    for i, step in enumerate(STEPS):
        xs = [j + i * width for j in range(len(results))]
        ax.bar(xs, [r.median(step) for r in results], width, label=step, color=colors[step])
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(results))],
                  [f"{r.tokens} cached tokens" for r in results])  # fmt: skip
    ax.set_ylabel("TTFT median, ms (through the conductor)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend()
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def device_name(device: str) -> str:
    """The accelerator's name for a device string (``cpu``, ``cuda``, ``cuda:N``)."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (cuda)"
    return "CPU"


def add_model_args(parser: argparse.ArgumentParser) -> argparse._MutuallyExclusiveGroup:
    """``--model DIR`` or ``--shape NAME`` (the embedded benches' model choice)."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", type=Path, default=None,
                       help=f"a model folder (default {DEFAULT_MODEL_DIR.name})")  # fmt: skip
    which.add_argument("--shape", choices=sorted(SHAPES), default=None,
                       help="a named shape with seeded random weights")  # fmt: skip
    return which


def model_folder(ns: argparse.Namespace, work: Path) -> Path:
    """The folder ``add_model_args``' flags name (a shape's is written under ``work``)."""
    if ns.shape is not None:
        return write_shape_folder(ns.shape, work / "models")
    return Path(ns.model or DEFAULT_MODEL_DIR)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="the agent's device (cpu, cuda, cuda:N)")
    add_model_args(parser)
    parser.add_argument("--tokens", type=block_token_counts, default=[2048, 8192])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    ns = parser.parse_args(args)
    if ns.repeats < 1:
        parser.error("--repeats must be >= 1")
    command = "python -m bench.tier_ttft" + ("" if not args else " " + shlex.join(args))

    def log(message: str) -> None:
        print(f"[tier_ttft {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="tier_ttft-") as tmp:
        work = Path(tmp)
        model_dir = model_folder(ns, work)
        results = run(model_dir, ns.device, ns.tokens, repeats=ns.repeats, work=work, log=log)
        model = model_dir.name

    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    header = "\n".join(
        [
            f"Command: `{command}`",
            "",
            f"- Agent device: {device_name(ns.device)}; Python {platform.python_version()}; {date}",
            f"- Model: {model}; block {BLOCK_TOKENS} tokens; {ns.repeats} rounds per length, "
            "a fresh prompt each; prompt = cached tokens + 1",
            "",
            "TTFT as the client sees it (streamed `/v1/completions`, conductor + one agent, "
            "loopback). Each hit checked: cached tokens, blocks promoted from the tier named "
            "(agent metrics); `greedy = cold`: rounds whose output equals the cold one.",
            "",
            "",
        ]
    )
    table = header + markdown_table(
        ["cached tokens", "KV MiB", "served from", "TTFT median ms", "TTFT min ms",
         "total median ms", "cold / this", "greedy = cold"],
        table_rows(results),
    )  # fmt: skip
    name = f"tier_ttft-{model}-{ns.device.split(':')[0]}"
    data: dict[str, Any] = {
        "command": command,
        "device": device_name(ns.device),
        "date": date,
        "model": model,
        "results": [asdict(r) for r in results],
    }
    md = write_results(ns.out, name, f"TTFT by KV tier: {model} on {ns.device}", table, data)
    plot(ns.out / f"{name}.png", f"{model} on {device_name(ns.device)}", results)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
