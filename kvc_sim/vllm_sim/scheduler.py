"""The simulated engine's core: vLLM-like continuous batching over the block pool, with
each step's duration from a ``kvc_sim`` profile. Pure: no I/O, no clock of its own.

One step (``schedule`` then, after the step's time has passed, ``complete``)
    * Token budget ``max_num_batched_tokens`` per step. Running requests go first, in
      arrival order: a decoding request takes 1 token, a request still prefilling takes
      the rest of its prompt, capped by what is left of the budget (chunked prefill:
      prefill chunks share the step with decodes).
    * Then waiting requests, first come first served (with ``by_priority``, vLLM's
      ``--scheduling-policy priority``: by ``priority``, lower first, then arrival;
      running requests are not preempted for a higher priority, as vLLM would), while
      budget is left and fewer than ``max_num_seqs`` run. On admission the prefix cache
      is looked up (full blocks only, at most ``tokens - 1`` tokens: the last one is
      always computed); the hits are counted as cached tokens, and with
      ``kv_cache_report_mode="full"`` announced again (``BlockStored``). A request whose
      blocks do not fit waits, and so does everything behind it (as vLLM).
    * Blocks are allocated for the tokens scheduled; when a running request cannot get
      one, the most recently admitted running request is preempted (its blocks freed,
      back to the head of the waiting queue, recomputed later with whatever prefix is
      still cached), as vLLM's recompute preemption does.
    * Full blocks are cached (``BlockStored``) as soon as their tokens are scheduled.
    * At the end of the step every request whose scheduled tokens reach its length
      emits one token (``tokens.OutputTokens``); it finishes with ``"length"`` at
      ``max_tokens`` or at the context limit.

Step duration (profile seconds; ``StepPlan.duration_s``)
    ``prefill_s + decode_s``: ``prefill_s`` sums, over the prefill chunks, the profile's
    prefill time of the chunk given what was already there,
    ``prefill_compute_s(done + chunk, cached) - prefill_compute_s(done, cached)``
    (``cached`` = the tokens the request found in the cache, or pulled, when admitted;
    so cached tokens cost nothing and a prompt cut in chunks costs what it costs
    whole, chunk overheads included); ``decode_s = tbt_s(b, k)`` for the ``b``
    decoding requests holding ``k`` tokens, when ``b > 0``. With CPU offloading, blocks
    found in host memory after the GPU hits are loaded back on admission: they count as
    cached tokens and cost ``h2d_load_s`` of their tokens in that step.

Prefill/decode hand-off
    A request with ``hold_blocks`` (the prefill leg of ``kv_transfer_params``) keeps its
    blocks when it finishes, until ``release_held`` (the decode engine pulled them) or
    ``expire_held`` (timeout). A request with ``external_tokens`` (the decode leg) counts
    that many prompt tokens as computed on admission (their blocks are allocated fresh,
    then cached), except what the local prefix cache already had.

Knobs
    ``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``; the pool's size and
    block size; the profile.

Complexity
    ``schedule`` and ``complete`` O(running + admitted + blocks touched) per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from kvc_sim.profile import Profile
from kvc_sim.vllm_sim.cache import KvBlockPool
from kvc_sim.vllm_sim.hashing import BlockHash, hash_blocks
from kvc_sim.vllm_sim.tokens import OutputTokens

__all__ = [
    "EngineRequest",
    "EngineScheduler",
    "FinishReason",
    "HeldBlocks",
    "RequestOutput",
    "ScheduledChunk",
    "StepPlan",
]

FinishReason = Literal["length", "stop", "abort"]


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One request inside the engine (its tokens, blocks and progress)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    token_key: int  # OutputTokens.request_key
    cache_salt: str | None = None
    report_full: bool = False  # kv_cache_report_mode="full"
    hold_blocks: bool = False  # prefill leg: keep the KV for a decode engine
    external_tokens: int = 0  # decode leg: prompt tokens whose KV was pulled
    priority: int = 0  # lower first, with by_priority
    # progress
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0
    admitted_computed: int = 0  # tokens present (cached or pulled) when last admitted
    num_cached_tokens: int | None = None  # first admission: what usage reports
    blocks: list[int] = field(default_factory=list)
    hashes: list[BlockHash] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks registered in the cache
    finish_reason: FinishReason | None = None
    preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    request: EngineRequest
    tokens: int
    decode: bool  # one token of a request that already finished its prompt
    preemptions: int  # the request's count when scheduled: a preemption voids the chunk
    load_tokens: int = 0  # prompt tokens loaded back from host memory on admission


@dataclass(frozen=True, slots=True)
class StepPlan:
    chunks: tuple[ScheduledChunk, ...]
    prefill_s: float
    decode_s: float

    @property
    def duration_s(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def scheduled_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request: EngineRequest
    token_id: int
    finish_reason: FinishReason | None


@dataclass(slots=True)
class HeldBlocks:
    """A finished prefill leg's KV, kept for the decode engine."""

    blocks: list[int]
    num_tokens: int
    expires_s: float


class EngineScheduler:
    """The engine core (see the module docstring); the caller provides time."""

    def __init__(
        self,
        pool: KvBlockPool,
        profile: Profile,
        tokens: OutputTokens,
        *,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        hold_timeout_s: float = 480.0,
        by_priority: bool = False,
    ) -> None:
        self.pool = pool
        self.profile = profile
        self.tokens = tokens
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.hold_timeout_s = hold_timeout_s
        self.by_priority = by_priority
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.held: dict[str, HeldBlocks] = {}
        self._by_id: dict[str, EngineRequest] = {}
        # Counters (vLLM's prefix-cache queries and hits are in tokens).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.preemptions = 0
        self.steps = 0

    # ------------------------------------------------------------------ requests
    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: EngineRequest) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self._by_id[request.request_id] = request
        if self.by_priority and self.waiting and request.priority < self.waiting[-1].priority:
            # Before the first waiting request of a larger priority value (stable: FCFS
            # among equals). O(waiting).
            at = next(
                i for i, other in enumerate(self.waiting) if other.priority > request.priority
            )
            self.waiting.insert(at, request)
            return
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (its blocks are freed); False if unknown."""
        request = self._by_id.get(request_id)
        if request is None:
            return False
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._end(request, "abort")
        return True

    def _end(self, request: EngineRequest, reason: FinishReason, now_s: float = 0.0) -> None:
        request.finish_reason = reason
        del self._by_id[request.request_id]
        if request.hold_blocks and reason != "abort" and request.blocks:
            self.held[request.request_id] = HeldBlocks(
                request.blocks, request.num_prompt_tokens, now_s + self.hold_timeout_s
            )
        else:
            self.pool.free(request.blocks)
        request.blocks = []

    # ------------------------------------------------------------------ held KV
    def release_held(self, request_id: str) -> int | None:
        """Free a prefill leg's blocks (the decode engine has them); its token count."""
        held = self.held.pop(request_id, None)
        if held is None:
            return None
        self.pool.free(held.blocks)
        return held.num_tokens

    def expire_held(self, now_s: float) -> list[str]:
        expired = [rid for rid, held in self.held.items() if held.expires_s <= now_s]
        for rid in expired:
            self.pool.free(self.held.pop(rid).blocks)
        return expired

    def next_hold_expiry_s(self) -> float | None:
        return min((h.expires_s for h in self.held.values()), default=None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()

    # ------------------------------------------------------------------ one step
    def _ensure_hashes(self, request: EngineRequest, blocks: int) -> None:
        have = len(request.hashes)
        if blocks > have:
            request.hashes += hash_blocks(
                request.token_ids[: blocks * self.pool.block_size],
                self.pool.block_size,
                request.cache_salt,
                start=have,
                parent=request.hashes[-1] if have else None,
            )

    def _blocks_needed(self, request: EngineRequest, tokens: int) -> int:
        size = self.pool.block_size
        return max(0, -(-(request.num_computed + tokens) // size) - len(request.blocks))

    def _cache_full(self, request: EngineRequest, upto_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        full = min(upto_tokens, request.num_tokens) // self.pool.block_size
        if full <= request.num_cached_blocks:
            return
        self._ensure_hashes(request, full)
        self.pool.cache_blocks(
            request.blocks,
            request.hashes,
            request.token_ids,
            start=request.num_cached_blocks,
            end=full,
            cache_salt=request.cache_salt,
        )
        request.num_cached_blocks = full

    def _preempt(self, request: EngineRequest) -> None:
        self.running.remove(request)
        self.pool.free(request.blocks)
        request.blocks = []
        request.num_computed = 0
        request.num_cached_blocks = 0
        request.external_tokens = 0  # the pulled KV is gone with the blocks
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def schedule(self) -> StepPlan | None:
        """Choose this step's work and allocate its blocks; None when there is none."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        for request in list(self.running):
            if budget <= 0:
                break
            if request not in self.running:  # preempted for an earlier request
                continue
            tokens = min(request.num_tokens - request.num_computed, budget)
            while not self.pool.can_allocate(self._blocks_needed(request, tokens)):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request not in self.running:
                break
            request.blocks += self.pool.allocate(self._blocks_needed(request, tokens))
            self._cache_full(request, request.num_computed + tokens)
            decode = request.num_computed >= request.num_prompt_tokens and tokens == 1
            chunks.append(ScheduledChunk(request, tokens, decode, request.preemptions))
            budget -= tokens
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
        ):
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            self.running.append(chunk.request)
            chunks.append(chunk)
            budget -= chunk.tokens
        if not chunks:
            return None
        self.steps += 1
        return self._plan(chunks)

    def _admit(self, request: EngineRequest, budget: int) -> ScheduledChunk | None:
        size = self.pool.block_size
        hits: list[int] = []
        loaded = 0  # blocks after the GPU hits that host memory holds: loaded, not computed
        if self.pool.enable_caching:
            max_hit_blocks = (request.num_tokens - 1) // size
            self._ensure_hashes(request, max_hit_blocks)
            hits = self.pool.cached_prefix(request.hashes, max_hit_blocks)
            loaded = self.pool.cpu_prefix(request.hashes, len(hits), max_hit_blocks)
        hit_tokens = len(hits) * size
        load_tokens = loaded * size
        present = hit_tokens + load_tokens
        external = max(0, min(request.external_tokens, request.num_tokens - 1) - present)
        computed = present + external
        tokens = min(request.num_tokens - computed, budget)
        need = -(-(computed + tokens) // size) - len(hits)
        if not self.pool.can_allocate(need, hits):
            return None
        if self.pool.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit_tokens
        if request.report_full:
            self.pool.announce(request.hashes, request.token_ids, len(hits), request.cache_salt)
        self.pool.touch(hits)
        request.blocks = hits + self.pool.allocate(need)
        request.num_cached_blocks = len(hits)
        request.num_computed = computed
        request.admitted_computed = computed
        if request.num_cached_tokens is None:
            request.num_cached_tokens = computed
            self.prompt_tokens += request.num_prompt_tokens
        self._cache_full(request, computed + tokens)
        return ScheduledChunk(
            request, tokens, decode=False, preemptions=request.preemptions,
            load_tokens=load_tokens,
        )  # fmt: skip

    def _plan(self, chunks: list[ScheduledChunk]) -> StepPlan:
        profile = self.profile
        prefill_s = 0.0
        batch = context = 0
        for chunk in chunks:
            request = chunk.request
            if chunk.decode:
                batch += 1
                context += request.num_computed + 1
                continue
            done, cached = request.num_computed, request.admitted_computed
            prefill_s += profile.prefill_compute_s(done + chunk.tokens, cached)
            prefill_s -= profile.prefill_compute_s(done, cached)
            prefill_s += profile.h2d_load_s(chunk.load_tokens)  # host copies loaded back
        decode_s = profile.tbt_s(batch, context) if batch else 0.0
        return StepPlan(tuple(chunks), prefill_s, decode_s)

    def complete(self, plan: StepPlan, now_s: float = 0.0) -> list[RequestOutput]:
        """Apply a step that has run: progress, one token per caught-up request."""
        outputs: list[RequestOutput] = []
        for chunk in plan.chunks:
            request = chunk.request
            if request.finish_reason is not None or request.preemptions != chunk.preemptions:
                continue  # aborted, stopped or preempted meanwhile
            request.num_computed += chunk.tokens
            if request.num_computed < request.num_tokens:
                continue  # a prefill chunk short of the prompt's end
            token = self.tokens.token(request.token_key, request.num_output_tokens)
            request.token_ids.append(token)
            self.generation_tokens += 1
            finish: FinishReason | None = None
            if (
                request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                finish = "length"
                self.running.remove(request)
                self._end(request, finish, now_s)
            outputs.append(RequestOutput(request, token, finish))
        return outputs

    def finish_stopped(self, request_id: str, now_s: float = 0.0) -> bool:
        """End a request whose output matched a stop string (``finish_reason="stop"``)."""
        request = self._by_id.get(request_id)
        if request is None:
            return False
        if request in self.running:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._end(request, "stop", now_s)
        return True
