"""Builders shared by the scheduler and simulator-policy tests."""

from __future__ import annotations

from dataclasses import replace

from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import NodeState, SchedulerConfig
from kvc.priors import DecodePrior, PrefillPrior

# Round numbers so expectations are easy to read: a prefill costs 1 ms per uncached
# token; a decode step costs 10 ms + 10 ms per request in the batch; transfers are 1 GB/s.
ROUND_PREFILL = PrefillPrior(fixed_s=0.0, per_token_s=0.001, per_token_context_s=0.0)
ROUND_DECODE = DecodePrior(fixed_s=0.01, per_request_s=0.01, per_context_token_s=0.0)


def round_number_config(**kw: object) -> SchedulerConfig:
    """A scheduler config on the round-number priors, taken as measured (the truth)."""
    base = SchedulerConfig(
        prefill_prior=ROUND_PREFILL,
        decode_prior=ROUND_DECODE,
        transfer_bandwidth_bytes_per_s=1e9,
        transfer_latency_s=0.0,
        kvcache_balancing_threshold=2.0,
        priors_measured=True,
        # Outputs far longer than any test window unless a test caps them (max_new).
        output_length_prior_tokens=1e6,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def make_node(
    name: str, role: str = "prefill", *, block_size: int, kv_bytes_per_token: int, **kw: object
) -> NodeState:
    """A healthy node with 10,000 free blocks; ``kw`` overrides any field."""
    base = NodeState(
        node_id=NodeId(name),
        role=role,  # type: ignore[arg-type]
        healthy=True,
        block_size=block_size,
        capacity_blocks=10_000,
        free_blocks=10_000,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    return replace(base, **kw)  # type: ignore[arg-type]
