"""One simulated request's state while it is in the cluster, and its final record."""

from __future__ import annotations

from conductor.core.placement import RequestPlacement
from conductor.core.scheduler import Placement
from kvc.block_keys import BlockKey
from kvc_sim.instances import DecodeInstance, PrefillInstance, QueuedPrefill
from kvc_sim.metrics import RequestOutcome, RequestRecord
from kvc_sim.trace import TraceRequest

__all__ = ["Flight"]


class Flight:
    """Everything known about one request while it is in the system (mutable)."""

    __slots__ = (
        "arrival_s",
        "cached_tokens",
        "decode",
        "handoff_at_s",
        "job",
        "keys",
        "loop",
        "migrated_tokens",
        "output_tokens",
        "placement",
        "prefill",
        "prefill_end_s",
        "prefill_s",
        "req",
        "ttft_s",
        "wait_token",
    )

    def __init__(self, req: TraceRequest, keys: tuple[BlockKey, ...], output_tokens: int) -> None:
        self.req = req
        self.arrival_s = 0.0  # virtual (speed applied)
        self.job: QueuedPrefill | None = None
        self.keys = keys
        self.output_tokens = output_tokens
        self.loop: RequestPlacement | None = None  # its way through the placement loop
        self.wait_token = 0  # bumped on every Wait: stale wake-ups are ignored
        self.placement: Placement | None = None
        self.prefill: PrefillInstance | None = None
        self.decode: DecodeInstance | None = None
        self.cached_tokens = 0
        self.migrated_tokens = 0
        self.prefill_s = 0.0
        self.prefill_end_s = 0.0
        self.handoff_at_s = 0.0
        self.ttft_s: float | None = None

    def record(
        self, outcome: RequestOutcome, reason: str | None, tbt_s: float | None, finish_s: float
    ) -> RequestRecord:
        """What the request left behind (a refusal before any work reports no prefill)."""
        placement = self.placement
        prefilled = outcome != "rejected"
        return RequestRecord(
            request_id=self.req.request_id,
            arrival_s=self.arrival_s,
            input_tokens=self.req.input_tokens,
            output_tokens=self.output_tokens,
            outcome=outcome,
            reject_reason=reason,
            prefill_node=placement.prefill if placement and prefilled else None,
            decode_node=placement.decode if placement and prefilled else None,
            cached_tokens=self.cached_tokens if prefilled else 0,
            migrated_tokens=self.migrated_tokens if prefilled else 0,
            prefill_s=self.prefill_s if prefilled else 0.0,
            ttft_s=self.ttft_s if outcome == "completed" else None,
            tbt_s=tbt_s,
            finish_s=finish_s,
        )
