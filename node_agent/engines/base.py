"""The engine port: what a node agent needs from the inference engine it wraps.

An adapter (embedded, vLLM, SGLang, sim) turns the agent's requests into engine
work. The agent owns the block table; the adapter owns compute. Prompt KV is
split the way every paged engine splits it: the KV of ``prompt[:-1]`` is the
cacheable prefix (full blocks become pool blocks), and the last prompt token is
always computed by whoever decodes, so it yields the logits of the first token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvc.block_keys import BlockKey
from kvc.sampling import Sampling, TokenLogprob
from node_agent.errors import PromptRejected
from node_agent.kv import KvCodec, KvContent, KvLayout


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model: str
    engine: str
    max_model_len: int
    vocab_size: int
    kv_layout: KvLayout
    eos_token_ids: frozenset[int]
    device: str = "cpu"  # where the engine computes (a torch device string for embedded)
    # True for engines with their own paged KV cache (vLLM): the agent's pool is then a
    # capacity ledger plus a mirror of the engine's cache, and prefill runs in generate().
    owns_kv_cache: bool = False


@dataclass(frozen=True, slots=True)
class PrefillJob:
    """Compute the KV of ``prompt_ids[:-1]`` into pool blocks.

    ``block_payloads[i]`` is the cached KV of block ``i`` (or None when it must be
    computed); the adapter returns the KV for every block it computed.
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    block_size: int
    block_payloads: tuple[KvContent | None, ...]
    tenant: str = ""  # isolates prefix caching in engines that key it (vLLM cache_salt)


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    kv: KvContent | None  # KV of prompt[:-1]; None for a one-token prompt
    cached_tokens: int
    computed_tokens: int
    prefill_s: float
    new_block_payloads: dict[int, KvContent] = field(default_factory=dict)
    # Engine-to-engine KV hand-off (vLLM's kv_transfer_params): what the decode engine
    # needs to pull this prefill's KV itself; None when the KV is in ``kv``.
    engine_transfer_params: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class GenerateJob:
    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    prefix_kv: KvContent | None  # KV of prompt[:-1] when already known
    tenant: str = ""  # isolates prefix caching in engines that key it (vLLM cache_salt)
    engine_transfer_params: Mapping[str, Any] | None = None  # from the prefill engine


@dataclass(frozen=True, slots=True)
class GenerationStep:
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None = None  # "stop" | "length" on the last step
    cached_tokens: int | None = None  # engine-reported prefix-cache hit (last step)
    stop_sequence: str = ""  # the stop string that ended it (last step; "" otherwise)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the sampling asks


@dataclass(frozen=True, slots=True)
class EngineLoad:
    queued_prefill_tokens: int
    running_requests: int
    waiting_requests: int
    kv_usage_ratio: float = 0.0  # the engine's own KV usage (0-1) where it reports one


@dataclass(frozen=True, slots=True)
class CacheStored:
    """The engine cached ``keys`` (canonical block keys, a chain after ``parent_key``).

    ``engine_time_s``: wall time the engine reported the change (vLLM's batch timestamp),
    carried into the published events so conductors measure engine → shadow lag."""

    keys: tuple[BlockKey, ...]
    parent_key: BlockKey | None
    engine_time_s: float | None = field(default=None, compare=False)
    # A copy in the engine's host memory (vLLM's CPU offloading), not its device cache:
    # no chain (``parent_key`` None), the keys of blocks it cached on the device before.
    host: bool = False


@dataclass(frozen=True, slots=True)
class CacheRemoved:
    """The engine evicted ``keys`` (``engine_time_s`` as for ``CacheStored``); ``host``:
    from its host-memory copies."""

    keys: tuple[BlockKey, ...]
    engine_time_s: float | None = field(default=None, compare=False)
    host: bool = False


@dataclass(frozen=True, slots=True)
class CacheCleared:
    """The engine dropped its whole cache (or the mirror lost track of it)."""

    engine_time_s: float | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class PrefillProbe:
    """Calibration: time one prefill of ``prompt_ids`` whose first ``cached_tokens`` tokens'
    KV the engine already holds (it computes that prefix first, untimed)."""

    prompt_ids: tuple[int, ...]
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class PrefillProbeResult:
    total_tokens: int
    cached_tokens: int  # what the engine actually reused (vLLM: its own report)
    duration_s: float


@dataclass(frozen=True, slots=True)
class DecodeProbe:
    """Calibration: run one generation per prompt at once, ``steps`` tokens each after
    the first, and time the tokens of the steady batch."""

    prompts: tuple[tuple[int, ...], ...]
    steps: int


@dataclass(frozen=True, slots=True)
class DecodeProbeResult:
    batch_requests: int
    context_tokens: int  # KV tokens of the whole batch, mid-measurement
    tbt_s: float  # median time between tokens of one request
    intervals: int  # token intervals the median was taken over


EngineCacheEvent = CacheStored | CacheRemoved | CacheCleared
EngineCacheSink = Callable[[Sequence[EngineCacheEvent]], Awaitable[None]]


class EngineAdapter(Protocol):
    """What the node agent drives. Implementations: ``EmbeddedEngineAdapter``,
    ``VllmEngineAdapter``."""

    @property
    def info(self) -> EngineInfo: ...

    @property
    def kv_codec(self) -> KvCodec | None:
        """Builds this engine's KV content from peers' bytes; None for an engine that
        keeps KV in its own process (vLLM): it neither sends nor takes pool KV."""
        ...

    def load(self) -> EngineLoad: ...

    async def prefill(self, job: PrefillJob) -> PrefillOutcome: ...

    def generate(self, job: GenerateJob) -> AsyncIterator[GenerationStep]: ...

    # Calibration (node_agent/calibration.py), before the agent serves. A probe leaves
    # nothing anyone can reuse: no pool blocks, no mirrored cache, no tenant's cache,
    # and it is not counted in ``load()``.
    async def probe_prefill(self, probe: PrefillProbe) -> PrefillProbeResult: ...

    async def probe_decode(self, probe: DecodeProbe) -> DecodeProbeResult: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class CacheMirroringEngine(Protocol):
    """An engine that owns its KV cache and reports its changes (vLLM's KV events).

    The agent hands it a sink once; the engine calls it, on the agent's event loop, with
    canonical block keys so the pool (and every conductor's shadow) sees the real cache.
    """

    def set_cache_sink(self, sink: EngineCacheSink) -> None: ...


@dataclass(frozen=True, slots=True)
class PrefixJob:
    """Whole blocks of a prompt's prefix, lent to or loaded from a peer engine."""

    request_id: str
    prompt_ids: tuple[int, ...]
    tenant: str = ""


@dataclass(frozen=True, slots=True)
class PrefixLent:
    """A prefix held by the lending engine for one pull."""

    transfer_params: Mapping[str, Any]  # what the pulling engine passes to its connector
    cached_tokens: int  # of the prefix, found in the lending engine's cache


@dataclass(frozen=True, slots=True)
class PrefixLoaded:
    """A prefix pulled into this engine's own cache."""

    # Of the prefix, tokens the engine did not compute (loaded, or already cached); the
    # engine computes the last one itself, so a whole load reports one less.
    cached_tokens: int
    seconds: float


@runtime_checkable
class PrefixLendingEngine(Protocol):
    """An engine that owns its KV but moves a prefix between two engines of its kind
    through its own connector (vLLM: ``kv_transfer_params``): the holder's engine keeps
    the prefix's KV for one pull (``lend_prefix``), the other engine loads it into its
    prefix cache (``load_prefix``), where the request's own prefill then finds it."""

    @property
    def lends_prefixes(self) -> bool:
        """Configured to (vLLM: a KV connector); False: pulls are refused."""
        ...

    async def lend_prefix(self, job: PrefixJob) -> PrefixLent: ...

    async def load_prefix(
        self, job: PrefixJob, transfer_params: Mapping[str, Any]
    ) -> PrefixLoaded: ...


def split_prefix(prompt_ids: Sequence[int]) -> tuple[Sequence[int], int]:
    """Return the cacheable prefix ``prompt[:-1]`` and the last prompt token."""
    if not prompt_ids:
        raise PromptRejected("prompt must contain at least one token")
    return prompt_ids[:-1], prompt_ids[-1]


def validate_prompt(info: EngineInfo, prompt_ids: Sequence[int], max_tokens: int = 0) -> None:
    """Reject a prompt this engine cannot take: empty, out-of-vocabulary ids, too long."""
    if not prompt_ids:
        raise PromptRejected("prompt must contain at least one token")
    vocab = info.vocab_size
    bad = None  # min and max run at C speed; the offender is looked for only if one is out
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        bad = next(t for t in prompt_ids if not 0 <= t < vocab)
    if bad is not None:
        raise PromptRejected(f"token id {bad} is outside the vocabulary [0, {vocab})")
    limit = info.max_model_len
    if len(prompt_ids) + max_tokens > limit:
        raise PromptRejected(
            f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds "
            f"the model's context length of {limit} tokens"
        )
