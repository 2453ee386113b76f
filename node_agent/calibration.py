"""Start-up calibration: measure this node's own engine and fit the cost-model priors.

Conductors estimate prefill and decode times with the models of
``conductor/core/cost_model.py``; their priors otherwise come from configuration. Each
agent measures its engine once, before it serves, and reports the fit in
``NodeInfo.calibration`` (Mooncake fits its prefill model offline; this does it per node).

Models (``u`` uncached, ``n`` total, ``p`` cached tokens; ``ctx`` KV tokens of the batch)::

    T_prefill = fixed + per_token*u + per_token_context*u*(n + p)
    TBT       = fixed + per_request*batch + per_context_token*ctx

Plan (``CalibrationPlan``), run in this order so that a small budget still ends with
something to fit:

1. prefills of the two smallest sizes, then decode probes at the two smallest batches;
2. the remaining prefill sizes, the remaining decode probes, then prefills whose head is
   cached (``cached_prefills``: they separate the attention term's ``n + p``);
3. long prompts (``long_prefill_sizes``, 4k and 16k tokens), as far as the budget, the
   cache share and the context length allow. Without them the attention term is fitted
   on prompts of at most 1k tokens, where it is a percent of the time and noise decides
   it, then extrapolated 40-fold: measured on a 16-engine simulated fleet (llama3-70b
   profile), eight identical engines got ``per_token_context`` from 0 to 13x the truth
   and estimated a 40k-token prefill at 0.46x to 6.2x its time, so the conductor queued
   four such prompts on the node that looked fastest while others idled, until the
   first of them ended. Each long size runs ``long_prefill_repeats`` times without a warm-up (at
   these lengths interference is a smaller share of the time).

Every prefill size runs once as a warm-up (discarded), then ``prefill_repeats`` timed
times, and the fastest of those is the size's sample (interference from elsewhere on a
busy host only ever adds time, so the minimum is the engine's own cost). Every prompt
is fresh random token ids, so nothing is reused by accident (a cached-head prefill
shares only its head, with a run of its own). Decode runs one discarded warm-up probe;
each probe starts ``batch`` generations at once and takes the median time between
tokens (each request's first interval dropped). The engine does the work through
``EngineAdapter.probe_prefill``/``probe_decode``, which leave nothing a tenant could
reuse (see each adapter).

Budget: ``budget_s`` is a hard bound. Before each step its duration is guessed from
what was measured (prefill time scaled by the size ratio to the power the two largest
measured sizes show, between 1.25 and 2; decode by the batch and the steps); a step
that would not fit is skipped, and a probe
still running at the deadline is cancelled. An engine that keeps calibration's KV in its
own prefix cache (vLLM: unreachable for tenants, but it takes room) also gets a token
budget, ``cache_tokens``: steps beyond it are skipped, so a restart next to a warm
cache displaces little of it. The fit uses what was measured by then;
fewer than 2 prefill sizes or 2 decode batch sizes, or a failed fit, give no calibration
(``None``): conductors then keep their configured priors.

Co-located agents: engines that compute in this process on a shared device (the
embedded engine on the CPU, or on one GPU) would measure each other when several
agents of one host start together (``kvc demo``, tests): two torch processes on the
same cores slowed each other ten- to twenty-fold in a measurement here. ``host_lock``
(an advisory ``flock`` per device in the temp dir) makes their calibrations take turns;
the wait counts against the budget.

Complexity: O(steps) probes, each one engine call; the fits are O(samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvc.priors import DecodePrior, PrefillPrior, fit_decode_prior, fit_prefill_prior
from node_agent.engines.base import (
    DecodeProbe,
    EngineAdapter,
    PrefillProbe,
    PrefillProbeResult,
)
from node_agent.errors import EngineError

log = logging.getLogger("node_agent.calibration")

__all__ = ["Calibration", "CalibrationPlan", "calibrate", "calibrate_before_serving", "host_lock"]


@dataclass(frozen=True, slots=True)
class CalibrationPlan:
    prefill_sizes: tuple[int, ...] = (16, 64, 256, 1024)  # prompt tokens, ascending
    prefill_repeats: int = 3  # timed runs per size (the fastest counts), after a warm-up
    cached_prefills: tuple[tuple[int, int], ...] = ((1024, 768),)  # (total, cached) tokens
    # Measured last, when budget, cache share and context length allow (module docstring).
    long_prefill_sizes: tuple[int, ...] = (4096, 16384)
    long_prefill_repeats: int = 2  # timed runs per long size (the fastest counts), no warm-up
    # (concurrent generations, prompt tokens of each): batch and context varied apart.
    decode_probes: tuple[tuple[int, int], ...] = ((1, 32), (2, 32), (4, 32), (1, 512), (4, 256))
    decode_steps: int = 8  # tokens each generation decodes after its first
    seed: int = 0

    def __post_init__(self) -> None:
        if self.prefill_repeats < 1 or self.long_prefill_repeats < 1 or self.decode_steps < 2:
            raise ValueError(
                "prefill_repeats and long_prefill_repeats must be >= 1, decode_steps >= 2"
            )
        sizes = (*self.prefill_sizes, *self.long_prefill_sizes)
        if list(sizes) != sorted(set(sizes)) or any(n < 2 for n in sizes):
            raise ValueError(
                "prefill_sizes then long_prefill_sizes must be distinct, ascending and >= 2"
            )


@dataclass(frozen=True, slots=True)
class Calibration:
    """The fitted profile and how it was obtained."""

    prefill: PrefillPrior
    decode: DecodePrior
    prefill_samples: int
    decode_samples: int
    duration_s: float


@dataclass(slots=True)
class _Samples:
    prefill: list[tuple[int, int, float]] = field(default_factory=list)  # one per size
    prefill_runs: int = 0  # timed prefills behind them
    decode: list[tuple[float, float, float]] = field(default_factory=list)

    def prefill_guess_s(self, tokens: int) -> float | None:
        """The largest smaller measured size, scaled by the size ratio to the power the
        two largest measured sizes show (1.25 to 2; 2 when only one was measured)."""
        fastest: dict[int, float] = {}  # a cached-head run may report nothing cached
        for n, p, d in self.prefill:
            if p == 0 and n <= tokens:
                fastest[n] = min(d, fastest.get(n, math.inf))
        if not fastest:
            return None
        below = sorted(fastest.items())
        n, d = below[-1]
        power = 2.0
        if len(below) >= 2:
            n0, d0 = below[-2]
            if d0 > 0 and d > 0:
                power = min(2.0, max(1.25, math.log(d / d0) / math.log(n / n0)))
        return d * math.pow(tokens / n, power)

    def decode_guess_s(self, batch: int, prompt_tokens: int, steps: int) -> float | None:
        if not self.decode:
            return None
        tbt_per_request = max(tbt / b for b, _, tbt in self.decode)
        prefills = batch * (self.prefill_guess_s(prompt_tokens) or 0.0)
        return prefills + tbt_per_request * batch * (steps + 1)


class _Budget:
    """Time left, and (engines that own their KV cache) prompt tokens left to send."""

    def __init__(
        self, budget_s: float, cache_tokens: int | None, clock: Callable[[], float]
    ) -> None:
        self._clock = clock
        self.deadline = clock() + budget_s
        self.cache_tokens_left = math.inf if cache_tokens is None else float(cache_tokens)

    @property
    def left_s(self) -> float:
        return self.deadline - self._clock()

    def take(self, guess_s: float | None, tokens: int) -> bool:
        """Whether a step of ``tokens`` tokens, guessed to take ``guess_s``, still fits;
        if so its tokens are counted as spent."""
        if self.left_s <= 0 or (guess_s is not None and guess_s > self.left_s):
            return False
        if tokens > self.cache_tokens_left:
            return False
        self.cache_tokens_left -= tokens
        return True


@contextlib.asynccontextmanager
async def host_lock(
    name: str, timeout_s: float, *, slots: int = 1, poll_s: float = 0.05
) -> AsyncIterator[bool]:
    """An advisory lock shared by the processes of this host (``flock`` on a file in the
    temp dir, released when its holder exits, even by a crash), which ``slots``
    holders may hold at once (one file per slot). Yields whether it is held: False after
    ``timeout_s`` of waiting. When the files cannot be opened the caller goes ahead
    unlocked (True)."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    safe = "".join(c if c.isalnum() else "_" for c in name)
    folder = Path(tempfile.gettempdir())
    paths = [folder / f"kvc-{safe}.lock"]
    paths += [folder / f"kvc-{safe}-{i}.lock" for i in range(1, slots)]
    fds: list[int] = []
    try:
        try:
            for path in paths:
                fds.append(os.open(path, os.O_RDWR | os.O_CREAT))
        except OSError as exc:
            log.info("no host lock %s (%s): going ahead unlocked", name, exc)
            yield True
            return
        deadline = time.monotonic() + timeout_s
        held = False
        while not held:
            for fd in fds:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    continue
            if held or time.monotonic() >= deadline:
                break
            await asyncio.sleep(poll_s)
        yield held
    finally:
        for fd in fds:
            os.close(fd)  # releases the lock


def _prompt(rng: random.Random, vocab: int, tokens: int) -> tuple[int, ...]:
    return tuple(rng.randrange(vocab) for _ in range(tokens))


async def calibrate(
    engine: EngineAdapter,
    budget_s: float,
    plan: CalibrationPlan | None = None,
    *,
    cache_tokens: int | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Calibration | None:
    """Measure ``engine`` within ``budget_s`` and fit; None when too little was measured.

    ``cache_tokens`` bounds the tokens sent in all (prompts and generated), for an engine
    whose own prefix cache keeps what calibration computed (vLLM): the steps that would
    exceed it are skipped, so calibration displaces at most that much of a warm cache.
    """
    plan = plan or CalibrationPlan()
    started = clock()
    budget = _Budget(budget_s, cache_tokens, clock)
    samples = _Samples()
    try:
        async with asyncio.timeout_at(asyncio.get_running_loop().time() + budget_s):
            await _measure(engine, plan, samples, budget)
    except TimeoutError:
        log.info("calibration budget of %.1f s ran out; fitting what was measured", budget_s)
    except EngineError as exc:
        log.warning("calibration stopped: %s; fitting what was measured", exc)
    duration_s = clock() - started
    log.debug(
        "calibration samples: prefill (tokens, cached, s) %s; decode (batch, context, s) %s",
        samples.prefill, samples.decode,
    )  # fmt: skip
    sizes = {n for n, p, _ in samples.prefill if p == 0}
    batches = {b for b, _, _ in samples.decode}
    if len(sizes) < 2 or len(batches) < 2:
        log.warning(
            "calibration measured %d prefill size(s) and %d decode batch size(s) in %.2f s; "
            "at least 2 of each are needed: not reported",
            len(sizes), len(batches), duration_s,
        )  # fmt: skip
        return None
    try:
        prefill = fit_prefill_prior(samples.prefill)
        decode = fit_decode_prior(samples.decode)
    except ValueError as exc:
        log.warning("calibration fit failed: %s: not reported", exc)
        return None
    result = Calibration(
        prefill=prefill,
        decode=decode,
        prefill_samples=samples.prefill_runs,
        decode_samples=len(samples.decode),
        duration_s=duration_s,
    )
    log.info(
        "engine calibrated in %.2f s (%d prefills, %d decode batches): prefill %.3g s + "
        "%.3g s/token + %.3g s/token^2; decode %.3g s + %.3g s/request + %.3g s/context token",
        duration_s, result.prefill_samples, result.decode_samples,
        *prefill.coefficients, *decode.coefficients,
    )  # fmt: skip
    return result


async def _measure(
    engine: EngineAdapter, plan: CalibrationPlan, samples: _Samples, budget: _Budget
) -> None:
    info = engine.info
    limit = info.max_model_len
    rng = random.Random(plan.seed)
    sizes = [n for n in plan.prefill_sizes if n <= limit]
    decodes = [(b, t) for b, t in plan.decode_probes if t + plan.decode_steps + 1 <= limit]

    async def prefill(tokens: int, cached: int = 0, *, long: bool = False) -> None:
        """A warm-up run (not for long sizes), then the timed ones; the fastest is the
        sample."""
        runs: list[PrefillProbeResult] = []
        warmup = 0 if long else 1
        for run in range(warmup + (plan.long_prefill_repeats if long else plan.prefill_repeats)):
            if not budget.take(samples.prefill_guess_s(tokens), tokens + 1):
                break
            prompt = _prompt(rng, info.vocab_size, tokens)
            result = await engine.probe_prefill(PrefillProbe(prompt, cached_tokens=cached))
            if run >= warmup:
                runs.append(result)
        if runs:
            samples.prefill_runs += len(runs)
            samples.prefill.append(
                (
                    tokens,
                    round(statistics.median(r.cached_tokens for r in runs)),
                    min(r.duration_s for r in runs),
                )
            )

    async def decode(batch: int, prompt_tokens: int, *, keep: bool = True) -> None:
        guess_s = samples.decode_guess_s(batch, prompt_tokens, plan.decode_steps)
        if not budget.take(guess_s, batch * (prompt_tokens + plan.decode_steps + 1)):
            return
        prompts = tuple(_prompt(rng, info.vocab_size, prompt_tokens) for _ in range(batch))
        result = await engine.probe_decode(DecodeProbe(prompts, plan.decode_steps))
        if keep:
            samples.decode.append(
                (float(result.batch_requests), float(result.context_tokens), result.tbt_s)
            )

    for tokens in sizes[:2]:
        await prefill(tokens)
    if decodes:
        await decode(*decodes[0], keep=False)  # warm-up
    for probe in decodes[:2]:
        await decode(*probe)
    for tokens in sizes[2:]:
        await prefill(tokens)
    for probe in decodes[2:]:
        await decode(*probe)
    for total, cached in plan.cached_prefills:
        if total <= limit and 0 < cached < total:
            await prefill(total, cached)
    for tokens in plan.long_prefill_sizes:
        if tokens <= limit:
            await prefill(tokens, long=True)


_AGENT_CACHE_SHARE = 0.125  # of an engine-owned cache's tokens calibration may fill


async def calibrate_before_serving(
    engine: EngineAdapter,
    *,
    cache_capacity_tokens: int,
    budget_s: float,
    turns: int = 0,
    plan: CalibrationPlan | None = None,
) -> Calibration | None:
    """An agent's start-up calibration; whatever goes wrong, None (it serves without).

    An engine with its own prefix cache (vLLM) keeps calibration's blocks (under a
    salt no tenant has) until it evicts them: calibration may send at most
    ``_AGENT_CACHE_SHARE`` of ``cache_capacity_tokens``, so little of a warm cache is
    displaced. An engine that computes in this process takes turns with this host's
    other agents (``host_lock``, one at a time); ``turns`` > 0 makes every engine take
    turns, that many at once, with the host's agents that set it (engines computing
    elsewhere that still share this host's CPUs: a fleet of simulated engines measured
    each other otherwise). The wait counts against ``budget_s``.
    """
    info = engine.info
    started = time.monotonic()
    turn: contextlib.AbstractAsyncContextManager[bool]
    cache_tokens: int | None = None
    if info.owns_kv_cache:  # vLLM computes in its own server; its cache is bounded
        cache_tokens = int(cache_capacity_tokens * _AGENT_CACHE_SHARE)
    if turns > 0:
        turn = host_lock("calibration-turns", budget_s, slots=turns)
    elif info.owns_kv_cache:
        turn = contextlib.nullcontext(True)
    else:
        turn = host_lock(f"calibration-{info.device}", budget_s)
    try:
        async with turn as held:
            if not held:
                log.warning("calibration skipped: other agents of this host took %.1f s", budget_s)
                return None
            left_s = budget_s - (time.monotonic() - started)
            return await calibrate(engine, left_s, plan, cache_tokens=cache_tokens)
    except Exception:
        log.warning("engine calibration failed; serving without", exc_info=True)
        return None
