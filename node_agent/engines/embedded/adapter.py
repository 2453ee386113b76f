"""Engine adapter for the embedded transformer (``node_agent.engines.embedded.model``).

Compute runs on one dedicated engine thread, so forwards never block the agent's
event loop and never run concurrently on the same model. Requests interleave at
step granularity: each prefill is one job, each decode step is one job, so a long
prompt delays other requests' next token by at most one prefill (the simple
"time-sliced" schedule; continuous batching belongs to real engines).

Bounded: at most ``max_running`` generations and ``max_queued_prefills`` prefills
at once; beyond that the adapter raises ``EngineBusy`` (the agent answers
RESOURCE_EXHAUSTED and the conductor tries elsewhere or sheds the request).

Calibration probes (``probe_prefill``, ``probe_decode``) run the model the way
``prefill`` and ``generate`` do — one engine job per forward, timed around the
hop to the engine thread — but on their own KV: nothing reaches the agent's pool.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import torch

from kvc.tokenization import ChatTokenizer, IncrementalDetokenizer
from node_agent.engines.base import (
    DecodeProbe,
    DecodeProbeResult,
    EngineInfo,
    EngineLoad,
    GenerateJob,
    GenerationStep,
    PrefillJob,
    PrefillOutcome,
    PrefillProbe,
    PrefillProbeResult,
    split_prefix,
    validate_prompt,
)
from node_agent.engines.embedded.kv_tensors import KvCache, TensorKvCodec, tensor_kv
from node_agent.engines.embedded.model import EmbeddedModel
from node_agent.engines.embedded.sampler import Sampler
from node_agent.errors import EngineBusy, PromptRejected, Unsupported
from node_agent.kv import KvContent
from node_agent.stopping import StopStringMatcher

T = TypeVar("T")


class EmbeddedEngineAdapter:
    """Runs prefills and decodes of ``EmbeddedModel`` on a single engine thread."""

    def __init__(
        self,
        model: EmbeddedModel,
        tokenizer: ChatTokenizer,
        *,
        served_model_name: str,
        max_running: int = 16,
        max_queued_prefills: int = 64,
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._max_running = max_running
        self._max_queued_prefills = max_queued_prefills
        self._queued_prefill_tokens = 0
        self._queued_prefills = 0
        self._running = 0
        self._info = EngineInfo(
            model=served_model_name,
            engine="embedded",
            max_model_len=model.max_model_len,
            vocab_size=model.vocab_size,
            kv_layout=model.layout,
            eos_token_ids=tokenizer.eos_token_ids,
            device=str(model.device),
        )
        self._codec = TensorKvCodec(model.device)

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def kv_codec(self) -> TensorKvCodec:
        return self._codec

    def load(self) -> EngineLoad:
        return EngineLoad(
            queued_prefill_tokens=self._queued_prefill_tokens,
            running_requests=self._running,
            waiting_requests=self._queued_prefills,
        )

    async def aclose(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def _on_engine(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def validate_prompt(self, prompt_ids: tuple[int, ...], max_tokens: int = 0) -> None:
        validate_prompt(self._info, prompt_ids, max_tokens)

    async def prefill(self, job: PrefillJob) -> PrefillOutcome:
        """KV of ``prompt[:-1]``: reuse the leading cached blocks, compute the rest."""
        self.validate_prompt(job.prompt_ids)
        prefix, _ = split_prefix(job.prompt_ids)
        bs = job.block_size
        reused: list[KvCache] = []
        for payload in job.block_payloads:
            if payload is None:
                break
            reused.append(tensor_kv(payload))
        cached_tokens = len(reused) * bs
        to_compute = tuple(prefix[cached_tokens:])
        if self._queued_prefills >= self._max_queued_prefills:
            raise EngineBusy("prefill queue is full")
        self._queued_prefills += 1
        # Whole prompts, cached part included: what vLLM's adapter reports and what a
        # conductor subtracts when a prefill of its own ends (LoadUpdate in the proto).
        self._queued_prefill_tokens += len(job.prompt_ids)
        try:
            started = time.perf_counter()

            def run() -> KvCache | None:
                past = KvCache.concat(reused) if reused else None
                if not to_compute:
                    return past
                _, kv = self._model.forward(to_compute, past)
                return kv

            kv = await self._on_engine(run)
            prefill_s = time.perf_counter() - started
        finally:
            self._queued_prefills -= 1
            self._queued_prefill_tokens -= len(job.prompt_ids)
        new_payloads: dict[int, KvContent] = {}
        if kv is not None:
            for i in range(len(reused), len(job.block_payloads)):
                new_payloads[i] = kv.slice(i * bs, (i + 1) * bs)
        return PrefillOutcome(
            kv=kv,
            cached_tokens=cached_tokens,
            computed_tokens=len(to_compute),
            prefill_s=prefill_s,
            new_block_payloads=new_payloads,
        )

    async def probe_prefill(self, probe: PrefillProbe) -> PrefillProbeResult:
        """Time a prefill of ``prompt_ids`` after computing its cached head (untimed)."""
        self.validate_prompt(probe.prompt_ids)
        cached = max(0, min(probe.cached_tokens, len(probe.prompt_ids) - 1))
        head, tail = probe.prompt_ids[:cached], probe.prompt_ids[cached:]
        past = None
        if head:
            _, past = await self._on_engine(lambda: self._model.forward(head, None))
        started = time.perf_counter()
        await self._on_engine(lambda: self._model.forward(tail, past))
        return PrefillProbeResult(
            total_tokens=len(probe.prompt_ids),
            cached_tokens=cached,
            duration_s=time.perf_counter() - started,
        )

    async def probe_decode(self, probe: DecodeProbe) -> DecodeProbeResult:
        """Decode ``steps`` greedy tokens for every prompt at once, one engine job per
        token as ``generate`` does; the first interval of each request is dropped."""
        if not probe.prompts or probe.steps < 2:
            raise PromptRejected("a decode probe needs prompts and at least 2 steps")
        for prompt in probe.prompts:
            self.validate_prompt(prompt, probe.steps + 1)
        states = [
            await self._on_engine(partial(self._model.forward, prompt, None))
            for prompt in probe.prompts
        ]

        async def decode(state: tuple[torch.Tensor, KvCache]) -> list[float]:
            stamps = [time.perf_counter()]
            for _ in range(probe.steps):
                logits, kv = state
                token = int(torch.argmax(logits).item())
                state = await self._on_engine(partial(self._model.forward, (token,), kv))
                stamps.append(time.perf_counter())
            return [b - a for a, b in itertools.pairwise(stamps[1:])]

        per_request = await asyncio.gather(*(decode(state) for state in states))
        intervals = [gap for gaps in per_request for gap in gaps]
        context = sum(len(p) for p in probe.prompts) + len(probe.prompts) * probe.steps // 2
        return DecodeProbeResult(
            batch_requests=len(probe.prompts),
            context_tokens=context,
            tbt_s=statistics.median(intervals),
            intervals=len(intervals),
        )

    async def generate(self, job: GenerateJob) -> AsyncIterator[GenerationStep]:
        """Decode loop: first token from the last prompt token, then one per step."""
        sampling = job.sampling
        if sampling.response_format:
            raise Unsupported(
                "response_format json_object/json_schema (structured output) is not "
                "supported by the embedded engine: it has no guided decoding"
            )
        self.validate_prompt(job.prompt_ids, sampling.max_tokens)
        if self._running >= self._max_running:
            raise EngineBusy(f"{self._running} generations already running")
        self._running += 1
        try:
            prefix, last = split_prefix(job.prompt_ids)
            past = None if job.prefix_kv is None else tensor_kv(job.prefix_kv)
            if past is None and prefix:
                self._queued_prefill_tokens += len(job.prompt_ids)
                try:
                    _, past = await self._on_engine(
                        lambda: self._model.forward(tuple(prefix), None)
                    )
                finally:
                    self._queued_prefill_tokens -= len(job.prompt_ids)
            elif past is not None and past.num_tokens != len(prefix):
                raise PromptRejected(
                    f"prefix KV covers {past.num_tokens} tokens, prompt prefix has {len(prefix)}"
                )
            sampler = Sampler(sampling)
            detok = IncrementalDetokenizer(self._tokenizer)
            stops = StopStringMatcher(sampling.stop)
            eos = frozenset() if sampling.ignore_eos else self._info.eos_token_ids
            # stop_token_ids end the generation like EOS, ignore_eos or not (as vLLM).
            enders = eos | frozenset(sampling.stop_token_ids)
            room = self._info.max_model_len - len(job.prompt_ids)
            budget = min(sampling.max_tokens, room)
            state: tuple[torch.Tensor, KvCache] = await self._on_engine(
                lambda: self._model.forward((last,), past)
            )
            produced = 0
            want_logprobs = sampling.logprobs is not None
            while True:
                logits, kv = state
                early = produced < sampling.min_tokens
                token = sampler.sample(logits, ban=enders if early else frozenset())
                produced += 1
                lp = (sampler.logprob(logits, token),) if want_logprobs else ()
                if token in enders:
                    # The detokenizer's held bytes may complete a stop string still.
                    ending = stops.push(detok.flush())
                    yield GenerationStep(
                        token_ids=(token,),
                        text=ending.emit + ("" if ending.stopped else stops.flush()),
                        finish_reason="stop",
                        stop_sequence=ending.matched,
                        logprobs=lp,
                    )
                    return
                check = stops.push(detok.push(token))
                if check.stopped:
                    yield GenerationStep(
                        token_ids=(token,),
                        text=check.emit,
                        finish_reason="stop",
                        stop_sequence=check.matched,
                        logprobs=lp,
                    )
                    return
                if produced >= budget:
                    ending = stops.push(detok.flush())  # a stop string completed at the end
                    yield GenerationStep(
                        token_ids=(token,),
                        text=check.emit + ending.emit + ("" if ending.stopped else stops.flush()),
                        finish_reason="stop" if ending.stopped else "length",
                        stop_sequence=ending.matched,
                        logprobs=lp,
                    )
                    return
                yield GenerationStep(token_ids=(token,), text=check.emit, logprobs=lp)
                state = await self._on_engine(partial(self._model.forward, (token,), kv))
        finally:
            self._running -= 1
