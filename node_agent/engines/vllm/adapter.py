"""Engine adapter for a vLLM OpenAI server (attached by URL, or launched by the agent).

The agent stays in its own environment and talks to vLLM over HTTP and ZMQ only:

* generation: ``POST /v1/completions`` with the token-id prompt, streamed, with
  ``return_token_ids`` (text is detokenized here, with the same tokenizer files the
  conductor uses), ``stream_options.include_usage`` (vLLM's ``cached_tokens`` becomes the
  usage the client sees), ``cache_salt`` = tenant (vLLM's prefix cache is per tenant, as
  the canonical block keys are) and ``vllm_xargs.kv_cache_report_mode = "full"`` (vLLM
  re-announces reused prefix blocks, which heals the mirror after any gap);
* the KV cache mirror: vLLM's KV events (``events``) re-keyed to canonical block
  keys and pushed into the agent's pool through the ``CacheMirroringEngine`` sink;
* capacity and load: the pool's capacity is vLLM's KV block count (usable blocks, read
  from ``vllm:cache_config_info``; a launched vLLM gets ``--num-gpu-blocks-override``),
  so a TxAllocate refuses what vLLM cannot hold; ``/metrics`` is polled for waiting and
  running requests and KV usage;
* prefill/decode disaggregation through vLLM's ``kv_transfer_params`` (NixlConnector),
  behind ``pd_connector`` (GPUs only, see docs/engines.md): ``prefill`` sends the
  ``do_remote_decode`` leg with ``max_tokens=1`` and returns the engine's transfer
  parameters; ``generate`` forwards them to the decode engine.

Calibration probes (``probe_prefill``, ``probe_decode``) send token-id prompts of random
ids with the reserved ``cache_salt`` ``CALIBRATION_SALT``: no tenant's salt can be it
(``salt_for_tenant`` digests tenants that start with ``__kvc``), so no tenant can hit the
blocks they leave in vLLM's prefix cache, and the KV-event mirror skips them (an unknown
salt: ``_tenant_of_salt`` → None), so they never reach the pool or a conductor's shadow.
vLLM evicts them like any unlocked cached block; they are counted as free in its KV
usage. Prefill is the latency of a ``max_tokens=1`` completion (vLLM's time to first
token, as the agent reports ``prefill_s`` for a vLLM Generate); decode is the spacing of
streamed tokens of concurrent streams.

Launch mode (``node_agent.engines.vllm.process``) starts vLLM in its own process group;
``aclose`` stops it. Salts, geometry and layout: ``node_agent.engines.vllm.config``; the
KV-event mirror: ``node_agent.engines.vllm.events``.

Errors: vLLM's 400 → ``PromptRejected``, 429/503 or too many generations →
``EngineBusy``, anything else → ``EngineError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import statistics
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any, Final

import httpx

from kvc import fast_json
from kvc.sampling import Sampling, TokenLogprob
from kvc.tokenization import ChatTokenizer, IncrementalDetokenizer
from node_agent.engines.base import (
    DecodeProbe,
    DecodeProbeResult,
    EngineCacheSink,
    EngineInfo,
    EngineLoad,
    GenerateJob,
    GenerationStep,
    PrefillJob,
    PrefillOutcome,
    PrefillProbe,
    PrefillProbeResult,
    PrefixJob,
    PrefixLent,
    PrefixLoaded,
    validate_prompt,
)
from node_agent.engines.vllm.config import (
    CALIBRATION_SALT,
    HASHED_SALT_PREFIX,
    RESERVED_SALT_PREFIX,
    KvGeometry,
    VllmConfig,
    model_layout,
    salt_for_tenant,
)
from node_agent.engines.vllm.events import KvEventDecoder, KvEventSubscriber
from node_agent.engines.vllm.http_parsing import (
    metric_values,
    sample_values,
    sse_data,
    sse_payload_batches,
)
from node_agent.engines.vllm.process import VllmProcess
from node_agent.engines.vllm.stream_client import (
    HttpStreamClient,
    HttpxStreamClient,
    StreamClientError,
    StreamingPost,
)
from node_agent.errors import EngineBusy, EngineError, PromptRejected
from node_agent.kv import KvCodec
from node_agent.stopping import StopStringMatcher

log = logging.getLogger("node_agent.vllm")

__all__ = ["VllmEngineAdapter"]


# The prefill leg of a P/D request and nothing else: one greedy token, EOS ignored.
_ONE_TOKEN: Final = Sampling(temperature=0.0, max_tokens=1, ignore_eos=True)
# What the load poll reads of vLLM's /metrics (summed, or the max for the usage).
# A poll that takes longer is abandoned (the next one starts after the interval).
_METRICS_POLL_TIMEOUT_S: Final = 10.0
_POLLED_METRICS: Final = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


class VllmEngineAdapter:
    """Drives one vLLM server; mirrors its KV cache into the agent's pool."""

    def __init__(
        self,
        config: VllmConfig,
        tokenizer: ChatTokenizer,
        *,
        transport: httpx.AsyncBaseTransport | None = None,  # tests: a stand-in vLLM
    ) -> None:
        self._config = config
        self._transport = transport
        self._tokenizer = tokenizer
        layout, vocab, max_len = model_layout(config.model_dir, config.launch_args)
        self._info = EngineInfo(
            model=config.served_model_name,
            engine="vllm",
            max_model_len=max_len,
            vocab_size=vocab,
            kv_layout=layout,
            eos_token_ids=tokenizer.eos_token_ids,
            owns_kv_cache=True,
        )
        self._process: VllmProcess | None = None if config.url else VllmProcess(config)
        self.url = config.url.rstrip("/") if config.url else self._process_url()
        self._http: httpx.AsyncClient | None = None
        self._stream: StreamingPost | None = None  # Generate's streamed completions
        self._sink: EngineCacheSink | None = None
        self._subscriber: KvEventSubscriber | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self._closed = False
        self._tenants_by_salt: OrderedDict[str, str] = OrderedDict()
        self.geometry = KvGeometry(config.block_size, config.capacity_blocks)
        # Load: this agent's own requests, and vLLM's view from /metrics.
        self._running = 0
        self._awaiting_first_token = 0
        self._queued_prefill_tokens = 0
        self._vllm_running = 0
        self._vllm_waiting = 0
        self._vllm_kv_usage = 0.0

    def _process_url(self) -> str:
        assert self._process is not None
        return self._process.url

    # ------------------------------------------------------------------ port
    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def kv_codec(self) -> KvCodec | None:
        """None: vLLM's KV stays in vLLM (P/D hands it over engine to engine)."""
        return None

    def load(self) -> EngineLoad:
        return EngineLoad(
            queued_prefill_tokens=self._queued_prefill_tokens,
            running_requests=max(self._running - self._awaiting_first_token, self._vllm_running),
            waiting_requests=max(self._awaiting_first_token, self._vllm_waiting),
            kv_usage_ratio=self._vllm_kv_usage,
        )

    async def wait_failed(self) -> str:
        """Return (with the reason) when a launched vLLM exits by itself; attached: never."""
        if self._process is None:
            await asyncio.Event().wait()  # an attached server is not ours to watch
        assert self._process is not None
        code = await self._process.wait()
        if self._closed:
            await asyncio.Event().wait()  # stopped by aclose: not a failure
        return f"vLLM exited with code {code}"

    def set_cache_sink(self, sink: EngineCacheSink) -> None:
        self._sink = sink
        if self._started:
            self._start_subscriber()

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> KvGeometry:
        """Launch (or reach) vLLM, wait until it serves, learn its KV geometry."""
        # Connect/write within 10 s; a response may take the request timeout, and so may a
        # wait for a pooled connection. No cap on connections: the agent's admission and the
        # conductor bound the concurrency, and httpx's default cap (100, 10 s pool timeout)
        # below them would fail requests queued behind it.
        timeout = httpx.Timeout(
            10.0, read=self._config.request_timeout_s, pool=self._config.request_timeout_s
        )
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=timeout, limits=limits, transport=self._transport
        )
        self._stream = (
            HttpxStreamClient(self._http)
            if self._transport is not None
            else HttpStreamClient(self.url, read_timeout_s=self._config.request_timeout_s)
        )
        if self._process is not None:
            await self._process.start()
        try:
            await self._wait_healthy()
            await self._discover()
        except BaseException:
            await self.aclose()
            raise
        self._started = True
        self._tasks.append(asyncio.create_task(self._poll_metrics(), name="vllm-metrics"))
        if self._sink is not None:
            self._start_subscriber()
        return self.geometry

    async def _wait_healthy(self) -> None:
        assert self._http is not None
        deadline = time.monotonic() + self._config.startup_timeout_s
        while True:
            if self._process is not None and self._process.returncode is not None:
                raise EngineError(f"vLLM exited with code {self._process.returncode} at start")
            with contextlib.suppress(httpx.HTTPError):
                if (await self._http.get("/health", timeout=2.0)).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"vLLM at {self.url} not healthy after {self._config.startup_timeout_s} s"
                )
            await asyncio.sleep(0.5)

    async def _discover(self) -> None:
        assert self._http is not None
        models = (await self._http.get("/v1/models")).json().get("data", [])
        served = {m.get("id"): m for m in models}
        model = served.get(self._config.served_model_name)
        if model is None:
            raise EngineError(
                f"vLLM at {self.url} serves {sorted(served)}, "
                f"not {self._config.served_model_name!r}"
            )
        max_len = int(model.get("max_model_len") or self._info.max_model_len)
        self._info = replace(self._info, max_model_len=max_len)
        metrics = metric_values((await self._http.get("/metrics")).text)
        (labels, _), *_ = metrics.get("vllm:cache_config_info") or [({}, 0.0)]
        block_size = int(labels.get("block_size") or self._config.block_size)
        gpu_blocks = labels.get("num_gpu_blocks")
        capacity = int(gpu_blocks) - 1 if gpu_blocks and gpu_blocks.isdigit() else 0
        if capacity <= 0:
            raise EngineError(f"vLLM at {self.url} does not report its KV block count")
        if labels.get("enable_prefix_caching") == "False":
            log.warning("vLLM at %s runs without prefix caching: nothing to reuse", self.url)
        self.geometry = KvGeometry(block_size, capacity)
        log.info(
            "vLLM at %s: model %s, max_model_len %d, %d KV blocks of %d tokens",
            self.url, self._config.served_model_name, max_len, capacity, block_size,
        )  # fmt: skip

    def _start_subscriber(self) -> None:
        if self._subscriber is not None:
            return
        endpoint = self._config.kv_events_endpoint
        replay = self._config.kv_events_replay_endpoint
        if self._process is not None:
            endpoint, replay = self._process.events_endpoint, self._process.replay_endpoint
        if not endpoint:
            log.warning("no kv_events_endpoint: vLLM's cache is not mirrored")
            return
        decoder = KvEventDecoder(
            model=self._config.served_model_name,
            block_size=self.geometry.block_size,
            tenant_of_salt=self._tenant_of_salt,
            max_tracked=max(4 * self.geometry.capacity_blocks, 4096),
            host_media=self._config.host_media,
        )
        self._subscriber = KvEventSubscriber(
            endpoint=endpoint,
            replay_endpoint=replay,
            topic=self._config.kv_events_topic,
            decoder=decoder,
            sink=lambda: self._sink,
        )
        self._tasks.append(
            asyncio.create_task(self._subscriber.run(self._stop), name="vllm-kv-events")
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._stream is not None:
            await self._stream.aclose()
        if self._http is not None:
            await self._http.aclose()
        if self._process is not None:
            await self._process.stop()

    async def _poll_metrics(self) -> None:
        """vLLM's running and waiting requests and KV usage, every ``metrics_interval_s``
        (what the load reports carry). A failed poll keeps the last values."""
        assert self._stream is not None
        while not self._stop.is_set():
            try:
                status, body = await self._stream.get("/metrics", _METRICS_POLL_TIMEOUT_S)
                if status != 200:
                    raise ValueError(f"/metrics answered {status}")
                metrics = sample_values(body.decode("utf-8", "replace"), _POLLED_METRICS)
                self._vllm_running = int(sum(metrics["vllm:num_requests_running"]))
                self._vllm_waiting = int(sum(metrics["vllm:num_requests_waiting"]))
                self._vllm_kv_usage = max(metrics["vllm:kv_cache_usage_perc"], default=0.0)
            except (StreamClientError, ValueError) as exc:
                log.debug("vLLM metrics: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=self._config.metrics_interval_s)

    # ------------------------------------------------------------------ tenants
    def _salt(self, tenant: str) -> str | None:
        salt = salt_for_tenant(tenant)
        if salt is not None and salt != tenant:
            self._tenants_by_salt[salt] = tenant
            self._tenants_by_salt.move_to_end(salt)
            while len(self._tenants_by_salt) > 65_536:
                self._tenants_by_salt.popitem(last=False)
        return salt

    def _tenant_of_salt(self, salt: str | None) -> str | None:
        if salt is None:
            return ""
        tenant = self._tenants_by_salt.get(salt)
        if tenant is not None:
            return tenant
        if salt.startswith(HASHED_SALT_PREFIX):
            return None  # a digest of a tenant this agent has not seen: unknown
        if salt.startswith(RESERVED_SALT_PREFIX):
            return None  # the agent's own requests (calibration): never mirrored
        return salt

    # ------------------------------------------------------------------ requests
    def _validate(self, prompt_ids: tuple[int, ...], max_tokens: int) -> None:
        validate_prompt(self._info, prompt_ids, max_tokens)

    def _body(
        self,
        prompt_ids: tuple[int, ...],
        tenant: str,
        sampling: Sampling,
        *,
        stream: bool,
        transfer: Mapping[str, Any] | None,
        token_ids: bool = True,
    ) -> dict[str, Any]:
        """The completion body; ``token_ids=False`` for an answer whose tokens are not
        read (the prefill leg): vLLM's ``return_token_ids`` also echoes the whole prompt."""
        body: dict[str, Any] = {
            "model": self._config.served_model_name,
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "ignore_eos": sampling.ignore_eos,
            "stream": stream,
            "return_token_ids": token_ids,
            # Re-announce reused prefix blocks as BlockStored: the mirror heals by itself.
            "vllm_xargs": {"kv_cache_report_mode": "full"},
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        # The rest only when set: vLLM's defaults are the same, and a stand-in engine that
        # cannot apply them (kvc_sim's) refuses them rather than ignoring them.
        if sampling.frequency_penalty:
            body["frequency_penalty"] = sampling.frequency_penalty
        if sampling.presence_penalty:
            body["presence_penalty"] = sampling.presence_penalty
        if sampling.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias}
        if sampling.response_format:  # vLLM's completions take it as chat does
            body["response_format"] = json.loads(sampling.response_format)
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.min_p:
            body["min_p"] = sampling.min_p
        if sampling.min_tokens:
            body["min_tokens"] = sampling.min_tokens
        if sampling.stop_token_ids:
            body["stop_token_ids"] = list(sampling.stop_token_ids)
        if sampling.logprobs is not None:
            body["logprobs"] = sampling.logprobs
            body["return_tokens_as_token_ids"] = True  # "token_id:N" keys: no re-tokenizing
        salt = self._salt(tenant)
        if salt is not None:
            body["cache_salt"] = salt
        if transfer is not None:
            body["kv_transfer_params"] = dict(transfer)
        return body

    def _require_open(self) -> httpx.AsyncClient:
        if self._http is None or self._closed:
            raise EngineError("the vLLM engine is not running")
        if self._process is not None and self._process.returncode is not None:
            raise EngineError(f"vLLM exited with code {self._process.returncode}")
        return self._http

    @staticmethod
    async def _raise_for_status(response: httpx.Response) -> None:
        if response.status_code != 200:
            raise _status_error(response.status_code, await response.aread())

    async def _unstreamed(self, body: dict[str, Any], request_id: str, what: str) -> dict[str, Any]:
        """One unstreamed completion's answer (the legs of a KV hand-off)."""
        assert self._stream is not None
        try:
            # The lean client, as for Generate: httpx cost ~3 ms of CPU per call here.
            async with self._stream.post(
                "/v1/completions", fast_json.dumps(body), {"X-Request-Id": request_id}
            ) as response:
                content = await response.aread()
                if response.status != 200:
                    raise _status_error(response.status, content)
        except StreamClientError as exc:
            raise EngineError(f"vLLM request failed: {exc}") from exc
        return _json_object(content, what)

    async def _prefill_leg(
        self, prompt_ids: tuple[int, ...], tenant: str, request_id: str, *, priority: int = 0
    ) -> tuple[dict[str, Any], int]:
        """vLLM's prefill leg (``do_remote_decode``): it keeps the KV for one pull and
        answers ``(kv_transfer_params, cached tokens)``."""
        body = self._body(
            prompt_ids, tenant, _ONE_TOKEN, stream=False, token_ids=False,
            transfer={
                "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None,
            },
        )  # fmt: skip
        if priority:
            body["priority"] = priority
        data = await self._unstreamed(body, request_id, "its prefill answer")
        params = data.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise EngineError("vLLM returned no kv_transfer_params: is a KV connector configured?")
        return params, _cached_tokens(data.get("usage"))

    async def prefill(self, job: PrefillJob) -> PrefillOutcome:
        """The prefill leg of vLLM's P/D protocol; only with ``pd_connector`` set."""
        if self._config.pd_connector == "none":
            raise PromptRejected(
                "this vLLM node prefills inside Generate (role both); a separate Prefill "
                "needs pd_connector=nixl (vLLM's kv_transfer_params, GPUs only)"
            )
        self._require_open()
        self._validate(job.prompt_ids, 1)
        self._queued_prefill_tokens += len(job.prompt_ids)
        started = time.perf_counter()
        try:
            params, cached = await self._prefill_leg(job.prompt_ids, job.tenant, job.request_id)
        finally:
            self._queued_prefill_tokens -= len(job.prompt_ids)
        return PrefillOutcome(
            kv=None,
            cached_tokens=cached,
            computed_tokens=len(job.prompt_ids) - cached,
            prefill_s=time.perf_counter() - started,
            engine_transfer_params=params,
        )

    # ------------------------------------------------------------------ prefix pulls
    @property
    def lends_prefixes(self) -> bool:
        return self._config.pd_connector != "none" and self._config.prefix_pulls

    def _require_lending(self, job: PrefixJob) -> None:
        if not self.lends_prefixes:
            raise PromptRejected(
                "this vLLM node neither lends nor pulls prefixes (it needs pd_connector=nixl "
                "and vllm_prefix_pulls=true)"
            )
        self._require_open()
        self._validate(job.prompt_ids, 1)

    async def lend_prefix(self, job: PrefixJob) -> PrefixLent:
        """A prefill leg of the prefix alone: vLLM finds it cached (it computes only the
        last token again) and keeps its blocks for the pulling engine.

        Not counted as queued prefill: the holder's cache is what is lent, not its compute.
        """
        self._require_lending(job)
        params, cached = await self._prefill_leg(
            job.prompt_ids, job.tenant, job.request_id, priority=self._config.prefix_pull_priority
        )
        return PrefixLent(transfer_params=params, cached_tokens=cached)

    async def load_prefix(self, job: PrefixJob, transfer_params: Mapping[str, Any]) -> PrefixLoaded:
        """The decode leg of the prefix alone (one token): vLLM loads the lent KV through
        its connector and caches the prefix's blocks, where the request's own prefill then
        finds them. A failed load is computed here instead (vLLM's
        ``kv_load_failure_policy="recompute"``): ``cached_tokens`` tells which happened."""
        self._require_lending(job)
        body = self._body(
            job.prompt_ids, job.tenant, _ONE_TOKEN, stream=False, token_ids=False,
            transfer={**transfer_params, "do_remote_prefill": True, "do_remote_decode": False},
        )  # fmt: skip
        if self._config.prefix_pull_priority:
            body["priority"] = self._config.prefix_pull_priority
        started = time.perf_counter()
        data = await self._unstreamed(body, job.request_id, "its prefix load answer")
        return PrefixLoaded(
            cached_tokens=_cached_tokens(data.get("usage")),
            seconds=time.perf_counter() - started,
        )

    async def generate(self, job: GenerateJob) -> AsyncIterator[GenerationStep]:
        """Stream one completion from vLLM; text is detokenized here."""
        sampling = job.sampling
        self._validate(job.prompt_ids, sampling.max_tokens)
        self._require_open()
        if self._running >= self._config.max_running:
            raise EngineBusy(f"{self._running} generations already running")
        body = self._body(
            job.prompt_ids, job.tenant, sampling, stream=True, transfer=job.engine_transfer_params
        )
        self._running += 1
        self._awaiting_first_token += 1
        self._queued_prefill_tokens += len(job.prompt_ids)
        waiting = True

        def first_token() -> None:
            nonlocal waiting
            if waiting:
                waiting = False
                self._awaiting_first_token -= 1
                self._queued_prefill_tokens -= len(job.prompt_ids)

        detok = IncrementalDetokenizer(self._tokenizer, prompt_ids=job.prompt_ids)
        stops = StopStringMatcher(sampling.stop)
        final: GenerationStep | None = None
        assert self._stream is not None
        try:
            # The SSE reader is closed where the stream ends, not by the loop's finalizer.
            post = self._stream.post(
                "/v1/completions", fast_json.dumps(body), {"X-Request-Id": job.request_id}
            )
            async with (
                post as response,
                contextlib.aclosing(sse_payload_batches(response.aiter_bytes())) as batches,
            ):
                if response.status != 200:
                    raise _status_error(response.status, await response.aread())
                # Events that arrived together leave as one step (one gRPC message):
                # under load the relay does per-message work once per batch.
                done = False
                async for batch in batches:
                    ids: list[int] = []
                    lps: list[TokenLogprob] = []
                    text = ""
                    for data in batch:
                        chunk = _json_object(data, "a stream chunk")
                        if "error" in chunk:
                            raise EngineError(f"vLLM failed the request: {chunk['error']}")
                        ended_here = False
                        for choice in _choices(chunk):
                            step = self._step(choice, detok, stops, sampling.logprobs)
                            if step is None:
                                continue
                            first_token()
                            if step.finish_reason is None:
                                ids += step.token_ids
                                lps += step.logprobs
                                text += step.text
                                continue
                            final = step
                            # A stop string matched here before vLLM finished: end now.
                            ended_here = choice.get("finish_reason") is None
                        usage = chunk.get("usage")
                        if final is not None and usage:
                            final = replace(final, cached_tokens=_cached_tokens(usage))
                            done = True
                            break
                        if ended_here:
                            done = True
                            break
                    if ids:
                        yield GenerationStep(token_ids=tuple(ids), text=text, logprobs=tuple(lps))
                    if done:
                        break
        except StreamClientError as exc:
            raise EngineError(f"vLLM stream failed: {exc}") from exc
        finally:
            first_token()
            self._running -= 1
        if final is None:
            raise EngineError("vLLM ended the stream without a finish reason")
        yield final

    # ------------------------------------------------------------------ calibration
    def _probe_body(
        self, prompt_ids: tuple[int, ...], max_tokens: int, stream: bool
    ) -> dict[str, Any]:
        probe = Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        body = self._body(prompt_ids, "", probe, stream=stream, transfer=None)
        body["cache_salt"] = CALIBRATION_SALT
        return body

    async def _probe_completion(self, prompt_ids: tuple[int, ...]) -> dict[str, Any]:
        """One unstreamed ``max_tokens=1`` completion under the calibration salt."""
        http = self._require_open()
        self._validate(prompt_ids, 1)
        try:
            response = await http.post(
                "/v1/completions", json=self._probe_body(prompt_ids, 1, stream=False)
            )
        except httpx.HTTPError as exc:
            raise EngineError(f"vLLM calibration request failed: {_describe(exc)}") from exc
        await self._raise_for_status(response)
        data: dict[str, Any] = response.json()
        return data

    async def probe_prefill(self, probe: PrefillProbe) -> PrefillProbeResult:
        """Latency of a one-token completion; a cached head is sent first (untimed)."""
        if probe.cached_tokens > 0:
            await self._probe_completion(probe.prompt_ids[: probe.cached_tokens])
        started = time.perf_counter()
        data = await self._probe_completion(probe.prompt_ids)
        duration_s = time.perf_counter() - started
        details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
        return PrefillProbeResult(
            total_tokens=len(probe.prompt_ids),
            cached_tokens=min(int(details.get("cached_tokens") or 0), len(probe.prompt_ids)),
            duration_s=duration_s,
        )

    async def probe_decode(self, probe: DecodeProbe) -> DecodeProbeResult:
        """Concurrent streams of ``steps + 1`` tokens; the spacing of their tokens after
        the first interval of each (prefill, batch forming) is the time between tokens."""
        if not probe.prompts or probe.steps < 2:
            raise PromptRejected("a decode probe needs prompts and at least 2 steps")
        http = self._require_open()
        for prompt in probe.prompts:
            self._validate(prompt, probe.steps + 1)

        async def stream(prompt: tuple[int, ...]) -> list[float]:
            body = self._probe_body(prompt, probe.steps + 1, stream=True)
            stamps: list[tuple[float, int]] = []  # (arrival, tokens in the chunk)
            try:
                async with http.stream("POST", "/v1/completions", json=body) as response:
                    await self._raise_for_status(response)
                    async for data in sse_data(response):
                        chunk = _json_object(data, "a calibration chunk")
                        if "error" in chunk:
                            raise EngineError(
                                f"vLLM failed a calibration request: {chunk['error']}"
                            )
                        tokens = sum(
                            len(c.get("token_ids") or ()) for c in chunk.get("choices") or []
                        )
                        if tokens:
                            stamps.append((time.perf_counter(), tokens))
            except httpx.HTTPError as exc:
                raise EngineError(f"vLLM calibration stream failed: {_describe(exc)}") from exc
            # Chunk i's tokens took (t_i - t_{i-1}) / n_i each. Dropped: the first token
            # (prefill) and the interval after it (the batch may still be forming).
            return [(t - t_prev) / n for (t_prev, _), (t, n) in itertools.pairwise(stamps[1:])]

        per_request = await asyncio.gather(*(stream(p) for p in probe.prompts))
        intervals = [gap for gaps in per_request for gap in gaps]
        if not intervals:
            raise EngineError("vLLM streamed too few tokens to time a decode step")
        context = sum(len(p) for p in probe.prompts) + len(probe.prompts) * probe.steps // 2
        return DecodeProbeResult(
            batch_requests=len(probe.prompts),
            context_tokens=context,
            tbt_s=statistics.median(intervals),
            intervals=len(intervals),
        )

    def _step(
        self,
        choice: Mapping[str, Any],
        detok: IncrementalDetokenizer,
        stops: StopStringMatcher,
        logprobs: int | None = None,
    ) -> GenerationStep | None:
        ids = tuple(int(t) for t in choice.get("token_ids") or ())
        finish = choice.get("finish_reason")
        if not ids and finish is None:
            return None
        lps = _logprobs_of(choice, len(ids), logprobs) if logprobs is not None else ()
        text = ""
        for token in ids:
            check = stops.push(detok.push(token))
            text += check.emit
            if check.stopped:
                return GenerationStep(
                    token_ids=ids,
                    text=text,
                    finish_reason="stop",
                    stop_sequence=check.matched,
                    logprobs=lps,
                )
        if finish is None:
            return GenerationStep(token_ids=ids, text=text, logprobs=lps)
        if finish not in ("stop", "length"):
            raise EngineError(f"vLLM finished the request with {finish!r}")
        last = stops.push(detok.flush())  # held bytes may complete a stop string
        if last.stopped:
            return GenerationStep(
                token_ids=ids,
                text=text + last.emit,
                finish_reason="stop",
                stop_sequence=last.matched,
                logprobs=lps,
            )
        text += last.emit + stops.flush()
        # vLLM names the stop string it matched itself in stop_reason (a token id there
        # is a stop_token_ids hit, which is no stop sequence).
        matched = choice.get("stop_reason")
        return GenerationStep(
            token_ids=ids,
            text=text,
            finish_reason=str(finish),
            stop_sequence=matched if finish == "stop" and isinstance(matched, str) else "",
            logprobs=lps,
        )


def _token_id(key: str) -> int:
    """vLLM's ``token_id:N`` (``return_tokens_as_token_ids``)."""
    prefix, _, number = key.partition(":")
    if prefix != "token_id" or not number.isdigit():
        raise EngineError(f"vLLM named a logprob token {key!r}, not token_id:N")
    return int(number)


def _logprobs_of(choice: Mapping[str, Any], n_ids: int, k: int) -> tuple[TokenLogprob, ...]:
    """The ``n_ids`` tokens' entries of a completions choice's ``logprobs`` (``tokens``,
    ``token_logprobs``, ``top_logprobs``), the alternatives cut to the ``k`` most likely
    (vLLM adds the sampled token to them when it is not among them)."""
    if n_ids == 0:
        return ()
    block = choice.get("logprobs")
    if not isinstance(block, Mapping):
        raise EngineError("vLLM answered without the logprobs asked for")
    values = block.get("token_logprobs") or []
    tops = block.get("top_logprobs") or []
    if len(values) != n_ids or len(tops) != n_ids:
        raise EngineError(f"vLLM gave {len(values)} logprobs for {n_ids} tokens")
    out = []
    for value, top in zip(values, tops, strict=True):
        pairs = sorted(
            ((_token_id(key), float(lp)) for key, lp in (top or {}).items()),
            key=lambda p: -p[1],
        )
        out.append(TokenLogprob(float(value), tuple(pairs[:k])))
    return tuple(out)


def _describe(exc: httpx.HTTPError) -> str:
    """The exception's type and text: several httpx errors (ReadError, timeouts) have an
    empty message, and "request failed: " alone does not say what happened."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _json_object(raw: bytes | str, what: str) -> dict[str, Any]:
    """A JSON object vLLM sent, or :class:`EngineError` naming ``what`` was malformed."""
    try:
        value = fast_json.loads(raw)
    except ValueError as exc:
        raise EngineError(f"vLLM sent {what} that is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise EngineError(f"vLLM sent {what} that is not a JSON object: {type(value).__name__}")
    return value


def _choices(chunk: dict[str, Any]) -> list[dict[str, Any]]:
    """A stream chunk's ``choices``, or :class:`EngineError` where they are not objects."""
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise EngineError("vLLM sent a stream chunk whose choices are not JSON objects")
    return choices


def _cached_tokens(usage: object) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (0 where absent or not a count)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached > 0 else 0


def _status_error(status: int, body: bytes) -> Exception:
    """The agent's error for a vLLM answer that is not 200."""
    text = body.decode("utf-8", "replace")
    try:
        parsed = json.loads(text)
        message = str(parsed.get("error", {}).get("message") or text)
    except (ValueError, AttributeError):
        message = text
    if status == 400:
        return PromptRejected(f"vLLM refused the request: {message}")
    if status in (429, 503):
        return EngineBusy(f"vLLM is busy: {message}")
    return EngineError(f"vLLM answered {status}: {message}")
