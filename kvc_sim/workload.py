"""Synthetic workloads in the Mooncake trace format, for tests and what-if runs.

What it generates (a small version of the paper's synthetic workload, §7.2.1)
    A mix of three request kinds, each a *stream* of requests whose order is kept:

    * ``agent``: one of ``system_prompts`` shared system prompts (popularity Zipf(1)),
      then a fresh user part — prefix sharing across users (tool & agent calls);
    * ``chat``: a multi-turn session; turn ``t`` re-sends the whole conversation so far
      (previous prompt + previous answer) plus a new user message;
    * ``doc``: several questions about one long document (the document is the shared
      prefix, each question a fresh suffix).

    Streams are interleaved at random (each keeps its order, as the paper's preprocessing
    does) and arrivals are a Poisson process of rate ``rate_per_s``.

Block ids
    Prompts are built from *segments* (a system prompt, a user message, an answer, a
    document), each with a unique id. Block ``i`` of a prompt covers tokens
    ``[i*B, (i+1)*B)``; its id is interned from ``(id of block i-1, the segment pieces
    inside block i)``, so equal ids mean equal prefixes — exactly the trace's
    prefix-chained ``hash_ids`` (``B = 512`` by default).

Knobs
    ``SyntheticSpec`` (counts, lengths, mix, rate, seed). Same spec → same workload.
    (Session-structured agentic tool loops with prompt-cache breakpoints: ``agentic``.)

Complexity
    O(total blocks) time and memory.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvc_sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["PrefixBlocks", "Segment", "SyntheticSpec", "generate"]


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    requests: int = 400
    rate_per_s: float = 2.0
    seed: int = 0
    agent_share: float = 0.4
    chat_share: float = 0.35  # the rest are document questions
    system_prompts: int = 8
    system_prompt_tokens: int = 4096
    user_tokens: tuple[int, int] = (64, 1024)  # uniform range of a user message
    answer_tokens: tuple[int, int] = (32, 512)  # uniform range of an output
    chat_turns: tuple[int, int] = (2, 6)
    doc_tokens: tuple[int, int] = (8192, 32768)
    doc_questions: tuple[int, int] = (2, 5)
    block_tokens: int = TRACE_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.requests <= 0 or self.rate_per_s <= 0 or self.block_tokens <= 0:
            raise ValueError("requests, rate_per_s and block_tokens must be > 0")
        if not (self.agent_share >= 0 and 0 <= self.chat_share <= 1 - self.agent_share):
            raise ValueError("agent_share + chat_share must lie in [0, 1]")
        if self.system_prompts <= 0:
            raise ValueError("system_prompts must be > 0")


Segment = tuple[int, int]  # (segment id, tokens)


class PrefixBlocks:
    """Interns prefix-chained block ids from segment lists (see "Block ids" above)."""

    def __init__(self, block_tokens: int) -> None:
        self._bt = block_tokens
        self._ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def ids(self, segments: list[Segment]) -> tuple[int, ...]:
        bt = self._bt
        out: list[int] = []
        parent = -1
        piece: list[tuple[int, int, int]] = []
        room = bt
        for seg_id, length in segments:
            offset = 0
            while offset < length:
                take = min(room, length - offset)
                piece.append((seg_id, offset, offset + take))
                offset += take
                room -= take
                if room == 0:
                    parent = self._intern(parent, piece)
                    out.append(parent)
                    piece, room = [], bt
        if piece:
            out.append(self._intern(parent, piece))
        return tuple(out)

    def _intern(self, parent: int, piece: list[tuple[int, int, int]]) -> int:
        key = (parent, tuple(piece))
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids)
        return found


def _zipf_pick(rng: random.Random, n: int) -> int:
    weights = [1.0 / (i + 1) for i in range(n)]
    return rng.choices(range(n), weights=weights)[0]


def generate(spec: SyntheticSpec) -> list[TraceRequest]:
    """``spec.requests`` requests in arrival order (see the module docstring)."""
    rng = random.Random(spec.seed)
    next_segment = iter(range(1, 1 << 62))
    blocks = PrefixBlocks(spec.block_tokens)
    systems = [(next(next_segment), spec.system_prompt_tokens) for _ in range(spec.system_prompts)]

    def uniform(bounds: tuple[int, int]) -> int:
        return rng.randint(bounds[0], bounds[1])

    streams: list[list[tuple[list[Segment], int]]] = []  # per stream: (prompt, output)
    total = 0
    while total < spec.requests:
        kind = rng.random()
        stream: list[tuple[list[Segment], int]] = []
        if kind < spec.agent_share:
            system = systems[_zipf_pick(rng, len(systems))]
            user = (next(next_segment), uniform(spec.user_tokens))
            stream.append(([system, user], uniform(spec.answer_tokens)))
        elif kind < spec.agent_share + spec.chat_share:
            history: list[Segment] = []
            for _ in range(uniform(spec.chat_turns)):
                history = [*history, (next(next_segment), uniform(spec.user_tokens))]
                answer = uniform(spec.answer_tokens)
                stream.append((list(history), answer))
                history.append((next(next_segment), answer))
        else:
            doc = (next(next_segment), uniform(spec.doc_tokens))
            for _ in range(uniform(spec.doc_questions)):
                question = (next(next_segment), uniform(spec.user_tokens))
                stream.append(([doc, question], uniform(spec.answer_tokens)))
        streams.append(stream)
        total += len(stream)

    order = [i for i, stream in enumerate(streams) for _ in stream]
    rng.shuffle(order)
    cursor = [0] * len(streams)
    out: list[TraceRequest] = []
    now = 0.0
    for stream_index in order[: spec.requests]:
        prompt, output = streams[stream_index][cursor[stream_index]]
        cursor[stream_index] += 1
        now += rng.expovariate(spec.rate_per_s)
        out.append(
            TraceRequest(
                request_id=f"s{len(out):06d}",
                arrival_s=round(now, 3),
                input_tokens=sum(length for _, length in prompt),
                output_tokens=output,
                hash_ids=blocks.ids(prompt),
            )
        )
    return out
