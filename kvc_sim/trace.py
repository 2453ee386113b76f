"""Mooncake trace files: reading, writing, statistics and the unbounded-cache hit ratio.

Format (one JSON object per line, the paper's appendix A)::

    {"timestamp": 27000, "input_length": 6955, "output_length": 52,
     "hash_ids": [46, 47, ..., 2112]}

``timestamp`` is the arrival in milliseconds; ``hash_ids[i]`` names block ``i`` of the
prompt (512 tokens, ``TRACE_BLOCK_TOKENS``) *and its whole prefix*: ids are prefix-chained,
so equal ids mean equal prefixes and a flat key map is a prefix index. The last id covers
the trailing partial block (``len(hash_ids) == ceil(input_length / 512)``); it can be
reused only by a prompt carrying the same id, i.e. the same partial content.

Prompt-cache breakpoints (our extension, optional; Mooncake traces have none)::

    {..., "hash_ids": [...], "breakpoints": [[24, 3600], [61, 300]]}

``breakpoints``: the client's cache breakpoints, each ``[blocks, ttl_s]``: keep the
prompt's first ``blocks`` trace blocks (``1 <= blocks <= len(hash_ids)``) cached for
``ttl_s`` (> 0) seconds after their last use (Anthropic's ``cache_control`` with its
TTL). ``TraceRequest.breakpoints``; written only when a request has some, so a trace
without them is byte-for-byte a Mooncake trace. The simulator honours them when its
cluster says so (``ClusterConfig.retention``); ``kvc_sim/agentic.py`` generates them.

Hit ratio accounting (shared by the simulator and ``theoretical_hit_ratio``): a prompt of
``n`` tokens whose first ``k`` blocks are reused has ``min(k * 512, n - 1)`` cached tokens
(at least one token is always computed, to produce the first output token).

Knobs
    ``read_trace(limit=)``: the first ``limit`` requests; ``speed`` belongs to the replay.

Complexity
    Reading O(total hash ids); ``theoretical_hit_ratio`` O(total hash ids) with one set.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "TraceError",
    "TraceRequest",
    "TraceStats",
    "cached_tokens",
    "read_trace",
    "theoretical_hit_ratio",
    "trace_stats",
    "write_trace",
]

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` entry in the published Mooncake traces."""


class TraceError(ValueError):
    """A trace line is malformed."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: str
    arrival_s: float  # at replay speed 1
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]
    # Prompt-cache breakpoints: (leading trace blocks, ttl_s), see the module docstring.
    breakpoints: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TraceStats:
    requests: int
    duration_s: float
    input_mean: float
    input_median: float
    input_p99: float
    output_mean: float
    distinct_blocks: int
    theoretical_hit_ratio: float


def cached_tokens(reused_blocks: int, input_tokens: int, block_tokens: int) -> int:
    """Tokens a prefill skips when its first ``reused_blocks`` blocks are cached."""
    return max(0, min(reused_blocks * block_tokens, input_tokens - 1))


def _parse(line: str, lineno: int) -> TraceRequest:
    try:
        raw = json.loads(line)
        ts = raw["timestamp"]
        n_in = raw["input_length"]
        n_out = raw["output_length"]
        ids = raw["hash_ids"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise TraceError(f"line {lineno}: {exc}") from exc
    if not (isinstance(ts, int | float) and isinstance(n_in, int) and isinstance(n_out, int)):
        raise TraceError(f"line {lineno}: timestamp/input_length/output_length must be numbers")
    if n_in <= 0 or n_out < 0 or ts < 0:
        raise TraceError(f"line {lineno}: lengths and timestamp must be non-negative")
    if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
        raise TraceError(f"line {lineno}: hash_ids must be a list of non-negative ints")
    if len(set(ids)) != len(ids):
        raise TraceError(f"line {lineno}: hash_ids repeat within one request")
    return TraceRequest(
        request_id=f"r{lineno:06d}",
        arrival_s=float(ts) / 1000.0,
        input_tokens=n_in,
        output_tokens=n_out,
        hash_ids=tuple(ids),
        breakpoints=_parse_breakpoints(raw.get("breakpoints", []), len(ids), lineno),
    )


def _parse_breakpoints(raw: object, n_blocks: int, lineno: int) -> tuple[tuple[int, float], ...]:
    if not isinstance(raw, list):
        raise TraceError(f"line {lineno}: breakpoints must be a list of [blocks, ttl_s]")
    out: list[tuple[int, float]] = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2):
            raise TraceError(f"line {lineno}: a breakpoint is [blocks, ttl_s], got {item!r}")
        blocks, ttl_s = item
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 1 <= blocks <= n_blocks:
            raise TraceError(f"line {lineno}: breakpoint blocks must lie in [1, {n_blocks}]")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or not ttl_s > 0:
            raise TraceError(f"line {lineno}: breakpoint ttl_s must be a number > 0")
        out.append((blocks, float(ttl_s)))
    return tuple(out)


def read_trace(path: Path | str, limit: int | None = None) -> list[TraceRequest]:
    """Requests of a JSONL trace in arrival order (stable for equal timestamps)."""
    out: list[TraceRequest] = []
    with Path(path).open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            out.append(_parse(line, lineno))
            if limit is not None and len(out) >= limit:
                break
    out.sort(key=lambda r: r.arrival_s)
    return out


def write_trace(path: Path | str, requests: Iterable[TraceRequest]) -> None:
    with Path(path).open("w") as fh:
        for r in requests:
            row = {
                "timestamp": round(r.arrival_s * 1000),
                "input_length": r.input_tokens,
                "output_length": r.output_tokens,
                "hash_ids": list(r.hash_ids),
            }
            if r.breakpoints:
                row["breakpoints"] = [[blocks, ttl_s] for blocks, ttl_s in r.breakpoints]
            fh.write(json.dumps(row) + "\n")


def theoretical_hit_ratio(
    requests: Sequence[TraceRequest], block_tokens: int = TRACE_BLOCK_TOKENS
) -> float:
    """Cached input tokens / input tokens with an unbounded cache shared by everyone.

    Every block ever computed stays cached; each request reuses its longest prefix of
    blocks already seen. This is the ceiling any placement policy can reach.
    """
    seen: set[int] = set()
    total = cached = 0
    for r in requests:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        total += r.input_tokens
        cached += cached_tokens(k, r.input_tokens, block_tokens)
        seen.update(r.hash_ids)
    return cached / total if total else 0.0


def trace_stats(requests: Sequence[TraceRequest]) -> TraceStats:
    if not requests:
        raise TraceError("empty trace")
    inputs = sorted(r.input_tokens for r in requests)
    return TraceStats(
        requests=len(requests),
        duration_s=requests[-1].arrival_s - requests[0].arrival_s,
        input_mean=statistics.fmean(inputs),
        input_median=statistics.median(inputs),
        input_p99=inputs[min(len(inputs) - 1, round(0.99 * (len(inputs) - 1)))],
        output_mean=statistics.fmean(r.output_tokens for r in requests),
        distinct_blocks=len({h for r in requests for h in r.hash_ids}),
        theoretical_hit_ratio=theoretical_hit_ratio(requests),
    )
