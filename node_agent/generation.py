"""Prefill and Generate: the engine's work on a prompt, bound to the block table.

``Prefill`` computes the KV of ``prompt[:-1]`` into the blocks of the request's Tx and
stages it for the decode node's ``FetchKv`` (or, for vLLM P/D, returns the engine's
own transfer parameters). ``Generate`` decodes: after pulling a staged prefill from a
peer (``kv_source``), after prefilling into a local Tx (``tx_id``, role ``both``), or
from scratch.

The agent never trusts a conductor's keys for content: a Tx's blocks must carry the
keys of exactly this prompt, tenant and model, or a stale conductor could serve wrong
KV. A lease that ran out while the engine computed means the blocks may belong to
someone else now: nothing is written then.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from kvc import fast_json
from kvc.block_keys import KEY_LAYOUT, compute_block_keys
from kvc.v1 import node_agent_pb2 as pb
from kvc.wire import logprobs_to_pb, sampling_from_pb
from node_agent.agent_state import AgentState
from node_agent.blocks.types import BlockPoolError, InvalidArgument, TxExpired
from node_agent.engines.base import GenerateJob, PrefillJob
from node_agent.errors import PromptRejected
from node_agent.event_stream import LastPrefill
from node_agent.kv import KvContent
from node_agent.transfer.receiver import KvReceiver
from node_agent.transfer.staging import StagedKv, StagingArea

__all__ = ["Generation"]

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class Generation:
    def __init__(self, state: AgentState, staging: StagingArea, receiver: KvReceiver) -> None:
        self._state = state
        self._staging = staging
        self._receiver = receiver
        # Engine-to-engine KV hand-offs (vLLM P/D) of finished prefills, by request id.
        self._engine_transfers: dict[str, dict[str, Any]] = {}

    async def prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        state = self._state
        prompt = tuple(request.prompt_token_ids)
        state.refuse_if_draining()
        state.require_role("prefill", "both")
        if not request.request_id:
            raise PromptRejected("request_id is required")
        kv_bytes = max(0, len(prompt) - 1) * state.engine.info.kv_layout.bytes_per_token
        self._staging.check_room(kv_bytes)
        kv, cached, computed, prefill_s = await self._prefill_into_tx(
            request.request_id, request.tenant, request.tx_id, prompt
        )
        transfer = self._engine_transfers.pop(request.request_id, None)
        if transfer is not None:  # the decode engine pulls the KV itself: nothing to stage
            return pb.PrefillResponse(
                request_id=request.request_id,
                prompt_tokens=len(prompt),
                cached_tokens=cached,
                computed_tokens=computed,
                prefill_s=prefill_s,
                engine_transfer_params=json.dumps(transfer),
            )
        settings = state.settings
        ttl = request.stage_ttl_s if request.stage_ttl_s > 0 else settings.stage_ttl_s
        handle = self._staging.stage(
            StagedKv(
                kv=kv,
                num_tokens=len(prompt) - 1,
                nbytes=kv_bytes,
                expires_at=state.clock() + min(ttl, settings.stage_ttl_s),
                tenant=request.tenant,
                grantee=request.grantee,
            ),
        )
        return pb.PrefillResponse(
            request_id=request.request_id,
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            computed_tokens=computed,
            prefill_s=prefill_s,
            kv_bytes=kv_bytes,
            stage_handle=handle,
        )

    async def _prefill_into_tx(
        self,
        request_id: str,
        tenant: str,
        tx_id: str,
        prompt: tuple[int, ...],
        *,
        for_generate: bool = False,
    ) -> tuple[KvContent | None, int, int, float]:
        """Compute KV of prompt[:-1] into the Tx's blocks. Returns (kv, cached, computed, s).

        An engine that owns its KV cache (vLLM) prefills inside ``generate``: for a local
        Generate the Tx is then only checked (it reserved the capacity), not computed.
        """
        state = self._state
        pool = state.pool
        engine = state.engine
        block_size = state.settings.block_size
        if not prompt:
            raise PromptRejected("prompt must contain at least one token")
        keys = compute_block_keys(
            prompt, tenant=tenant, model=engine.info.model, block_size=block_size,
            end=len(prompt) - 1,
            # The layout the tx's keys are in (a conductor of an older layout may send).
            layout=pool.tx_key_layout(tx_id) if tx_id else KEY_LAYOUT,
        )  # fmt: skip
        if not keys and not tx_id:
            handles: tuple[int, ...] = ()  # shorter than one block: nothing to own
        else:
            handles = pool.get_tx(tx_id).handles
        if len(handles) != len(keys) or any(
            pool.block_key(h) != k for h, k in zip(handles, keys, strict=True)
        ):
            raise InvalidArgument(
                f"transaction {tx_id!r} holds blocks for a different prompt, tenant or model"
            )
        if for_generate and engine.info.owns_kv_cache:
            cached = pool.match_prefix(keys) * block_size
            return None, cached, len(prompt) - 1 - cached, 0.0
        outcome = await engine.prefill(
            PrefillJob(
                request_id=request_id,
                prompt_ids=prompt,
                block_size=block_size,
                block_payloads=tuple(state.content(h) for h in handles),
                tenant=tenant,
            )
        )
        if handles:
            try:
                pool.get_tx(tx_id)
            except BlockPoolError:
                await state.events.after_mutation()
                raise TxExpired(tx_id) from None
        for index, kv in outcome.new_block_payloads.items():
            pool.set_payload(handles[index], kv)
        state.events.last_prefill = LastPrefill(
            outcome.prefill_s, outcome.computed_tokens, outcome.cached_tokens
        )
        if outcome.engine_transfer_params is not None:
            self._engine_transfers[request_id] = dict(outcome.engine_transfer_params)
        metrics = state.metrics
        metrics.prefill_seconds.observe(outcome.prefill_s)
        metrics.prefill_tokens.labels("computed").inc(outcome.computed_tokens)
        metrics.prefill_tokens.labels("cached").inc(outcome.cached_tokens)
        return outcome.kv, outcome.cached_tokens, outcome.computed_tokens, outcome.prefill_s

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        state = self._state
        engine = state.engine
        prompt = tuple(request.prompt_token_ids)
        sampling = sampling_from_pb(request.sampling)
        timings = pb.GenerateTimings()
        cached = 0
        state.refuse_if_draining()
        prefix_kv: KvContent | None = None
        transfer: dict[str, Any] | None = None
        if request.HasField("kv_source"):
            state.require_role("decode", "both")
            if request.kv_source.num_tokens != max(0, len(prompt) - 1):
                raise PromptRejected("kv_source.num_tokens must equal len(prompt) - 1")
            if request.kv_source.engine_transfer_params:
                transfer = _engine_transfer(request.kv_source, engine.info.owns_kv_cache)
            else:
                prefix_kv, timings.transfer_s, timings.transfer_bytes = await self._receiver.fetch(
                    request.kv_source, request.tenant
                )
        elif request.tx_id:
            state.require_role("both")
            prefix_kv, cached, _, timings.prefill_s = await self._prefill_into_tx(
                request.request_id, request.tenant, request.tx_id, prompt, for_generate=True
            )
        else:
            state.require_role("decode", "both")
        engine_started = time.perf_counter()
        steps = engine.generate(
            GenerateJob(
                request_id=request.request_id,
                prompt_ids=prompt,
                sampling=sampling,
                prefix_kv=prefix_kv,
                tenant=request.tenant,
                engine_transfer_params=transfer,
            )
        )
        produced = 0
        first = True
        async for step in steps:
            produced += len(step.token_ids)
            state.metrics.generated_tokens.inc(len(step.token_ids))
            msg = pb.GenerateResponse(token_ids=list(step.token_ids), text=step.text)
            if step.logprobs:
                msg.logprobs.extend(logprobs_to_pb(step.logprobs))
            if first:
                if engine.info.owns_kv_cache and not timings.prefill_s:
                    # The engine prefilled inside generate: its time to first token.
                    timings.prefill_s = time.perf_counter() - engine_started
                msg.timings.CopyFrom(timings)
                first = False
            if step.finish_reason is not None:
                msg.finish_reason = _FINISH[step.finish_reason]
                msg.stop_sequence = step.stop_sequence
                msg.usage.CopyFrom(
                    pb.GenerateUsage(
                        prompt_tokens=len(prompt),
                        completion_tokens=produced,
                        cached_tokens=cached if step.cached_tokens is None else step.cached_tokens,
                    )
                )
            yield msg


def _engine_transfer(source: pb.KvSource, owns_kv_cache: bool) -> dict[str, Any]:
    """The engine-to-engine hand-off of a ``KvSource`` (vLLM P/D), checked."""
    if not owns_kv_cache:
        raise PromptRejected("this node's engine cannot pull KV from another engine")
    params = fast_json.loads_object(source.engine_transfer_params)
    if params is None:
        raise PromptRejected("kv_source.engine_transfer_params must be a JSON object")
    return params
