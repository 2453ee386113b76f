"""The engine port: what a node agent needs from the inference engine it wraps.

An adapter (embedded, vLLM, SGLang, sim) turns the agent's requests into engine
work. The agent owns the block table; the adapter owns compute. Prompt KV is
split the way every paged engine splits it: the KV of ``prompt[:-1]`` is the
cacheable prefix (full blocks become pool blocks), and the last prompt token is
always computed by whoever decodes, so it yields the logits of the first token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from node_agent.engines.embedded import KvCache, KvLayout


class EngineError(Exception):
    """An engine could not do what was asked (bad prompt, capacity, failure)."""


class PromptRejected(EngineError):
    """The prompt is invalid for this engine (token ids, length)."""


class EngineBusy(EngineError):
    """The engine's bounded queues are full; retry later or elsewhere."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    engine: str
    max_model_len: int
    vocab_size: int
    kv_layout: KvLayout
    eos_token_ids: frozenset[int]
    device: str = "cpu"  # where KV tensors live (torch device string)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """Compute the KV of ``prompt_ids[:-1]`` into pool blocks.

    ``block_payloads[i]`` is the cached KV of block ``i`` (or None when it must be
    computed); the adapter returns the KV for every block it computed.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    block_size: int
    block_payloads: tuple[KvCache | None, ...]


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    kv: KvCache | None  # KV of prompt[:-1]; None for a one-token prompt
    cached_tokens: int
    computed_tokens: int
    prefill_s: float
    new_block_payloads: dict[int, KvCache] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GenerateJob:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    prefix_kv: KvCache | None  # KV of prompt[:-1] when already known


@dataclass(frozen=True, slots=True)
class GenerationStep:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" | "length" on the last step


@dataclass(frozen=True, slots=True)
class EngineLoad:
    queued_prefill_tokens: int
    running_requests: int
    waiting_requests: int


class EngineAdapter(Protocol):
    """What the node agent drives. Implementations: ``EmbeddedEngineAdapter``."""

    @property
    def info(self) -> EngineInfo: ...

    def load(self) -> EngineLoad: ...

    async def prefill(self, job: PrefillJob) -> PrefillOutcome: ...

    def generate(self, job: GenerateJob) -> AsyncIterator[GenerationStep]: ...

    async def aclose(self) -> None: ...


def split_prefix(prompt_ids: Sequence[int]) -> tuple[Sequence[int], int]:
    """Return the cacheable prefix ``prompt[:-1]`` and the last prompt token."""
    if not prompt_ids:
        raise PromptRejected("prompt must contain at least one token")
    return prompt_ids[:-1], prompt_ids[-1]
