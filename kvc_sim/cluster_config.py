"""The simulated cluster's knobs, validated when built (``kvc_sim/cluster.py`` runs it).

``prefill_instances``, ``decode_instances``, ``block_tokens`` (a divisor of the
trace's 512: each trace block becomes ``512 / block_tokens`` pool blocks with derived
chained keys ``id * (512 / block_tokens) + j``), ``cache_tokens`` per prefill instance
(None: the profile's) or ``unbounded_cache`` (the pool is sized to hold every block
of the replayed requests: no eviction ever), ``index_event_delay_s``,
``decode_refuses`` (decode nodes refuse what does not fit or would break the TBT
SLO), ``output_tokens`` (override every request's output length, e.g. 1),
``max_tokens`` (the client's cap on every request; longer outputs are cut there),
``max_waiting`` (the placement loop's bound on waiting requests), engines that differ
from their profile (``timing_noise_sigma``: log-normal noise on every duration;
``cold_start_s`` added to each prefill instance's first ``cold_start_prefills``
prefills; ``seed``), ``lease_s``, ``load_sample_s``, ``kv_migration`` (False: prefill
nodes can neither lend nor receive prefix blocks, as engines that own their KV — vLLM
nodes — report to the live conductor; the live-parity scenario uses it).

What a prefix pull waits for at its holder (``lend_wait``): ``"none"``, the transfer
starts at once (pool payloads, the embedded engine); ``"queue"``, the holder lends with a
request to its engine (vLLM's LendBlocks leg) that joins the back of its prefill queue
(first come first served) and computes the prefix's last token; ``"running"``, that
request goes to the front of the queue and waits only for the prefill running there
(vLLM's priority scheduling with the legs first). The transfer leaves when the request
ends. ``lend_wait_reported`` (default True): the nodes tell the scheduler
(``NodeState.lend_wait``, as agents do since ``NodeInfo.lend_wait``), which charges a
pull that wait; False: the scheduler plans as if pulls waited for nothing (conductors
before that field).

The prefill → decode hand-off (``kv_handoff``): ``"layerwise"`` (Mooncake's, the
default) streams the prompt's KV to the decode node while the prefill runs and the first
token is the prefill's own, at the later of the prefill's end + one latency and the
transfer's arrival. ``"pull"`` is vLLM's NixlConnector as ``kvc sim-engine`` and real
vLLM run it: the decode node pulls the KV only once the prefill has ended (its NICs
reserved from then), the request joins the decode batch at the next step boundary, and
that step — one decode step of the running batch plus the prompt's last token computed
again (``prefill_compute_s(n, n - 1)``) — yields the first token; the prefill leg's own
token is dropped. The live-parity scenario uses it.

KV tiers as the agent keeps them (``host_tier_tokens``, ``disk_tier_tokens``; either set,
0 switches that tier off): ``cache_tokens`` is then the engine-memory pool (L1) alone,
evicted blocks are demoted to host memory (L2) and disk (L3) by the agent's own
``LowerTiers``, a hit there is promoted back in the transaction and costs its load time
(``h2d_bytes_per_s``, ``disk_read_bytes_per_s`` of the profile) before the prefill, and
the conductor's shadow follows the moves and charges them. Both unset: the profile's
older model (``hbm_cache_tokens`` of a ``cache_tokens`` pool in HBM, the rest in DRAM,
loads overlapped with compute), which the paper's scenarios use.
``replica_aware_eviction``: each prefill node's pool drops, instead of demoting, the
victims the conductor's shadow sees on another node (``BlockPool``'s
``replicas_elsewhere``), so its lower tiers keep the fleet's last copies.
``donate_before_evict``: a prefill node's victim that leaves it for good (no lower tier
takes it), was reused there at least ``donate_min_hits`` times and is the fleet's last
copy as the shadow sees it is offered to the peer whose own next victim sat unused
longest, if longer (``kvc.donation``; ``BlockPool``'s ``donate``); a block is
donated at most ``donate_max_hops`` times. The copy is taken at once (its transfer is
off every request's path and not charged); ``SimResult.donated_blocks`` counts them.

Prompt-cache retention (``retention``; off: the requests' breakpoints are ignored and
every pool is LRU-only, as before): the ALLOCATE tx on the prefill node carries the
request's breakpoints (``TraceRequest.breakpoints``) as ``AllocateParams.retain``, so
those leading blocks stay out of LRU eviction until their TTL runs out after their last
use (``BlockPool``'s module docstring, "Retention"). Each pool refuses a retention (never
the request) past ``retention_budget_block_s`` (KV block-seconds outstanding for the
tenant; every trace request is one tenant, so per node; None: unlimited, the pool's
default) or ``max_retained_blocks`` (blocks per node; None: half the pool, the pool's
default). A breakpoint's TTL is cut to the pool's ``max_retention_s`` (1 hour).
``retention_min_ttl_s``: honour only the breakpoints with at least this TTL (e.g. 3600:
an agent's static prefix, not the 5-minute conversation marks); 0: every one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import ConfigDict

from kvc_sim.trace import TRACE_BLOCK_TOKENS

__all__ = ["ClusterConfig"]


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(extra="forbid")

    prefill_instances: int
    decode_instances: int
    block_tokens: int = TRACE_BLOCK_TOKENS
    cache_tokens: int | None = None
    unbounded_cache: bool = False
    index_event_delay_s: float = 0.0
    decode_refuses: bool = False
    output_tokens: int | None = None
    max_tokens: int = 1024
    max_waiting: int = 0
    timing_noise_sigma: float = 0.0
    cold_start_s: float = 0.0
    cold_start_prefills: int = 0
    seed: int = 0
    lease_s: float = 86_400.0
    load_sample_s: float = 5.0
    kv_migration: bool = True
    kv_handoff: Literal["layerwise", "pull"] = "layerwise"
    lend_wait: Literal["none", "queue", "running"] = "none"
    lend_wait_reported: bool = True
    host_tier_tokens: int | None = None
    disk_tier_tokens: int | None = None
    replica_aware_eviction: bool = False
    donate_before_evict: bool = False
    donate_min_hits: int = 1
    donate_max_hops: int = 1
    retention: bool = False
    retention_budget_block_s: float | None = None
    max_retained_blocks: int | None = None
    retention_min_ttl_s: float = 0.0

    @property
    def tiered(self) -> bool:
        """The agent's tier model (L1 pool + LowerTiers) instead of the HBM/DRAM split."""
        return self.host_tier_tokens is not None or self.disk_tier_tokens is not None

    def __post_init__(self) -> None:
        if self.prefill_instances <= 0 or self.decode_instances <= 0:
            raise ValueError("a cluster needs at least one prefill and one decode instance")
        if self.block_tokens <= 0 or TRACE_BLOCK_TOKENS % self.block_tokens:
            raise ValueError(f"block_tokens must divide {TRACE_BLOCK_TOKENS}")
        if self.cache_tokens is not None and self.cache_tokens < self.block_tokens:
            raise ValueError("cache_tokens must hold at least one block")
        if self.index_event_delay_s < 0 or self.load_sample_s <= 0 or self.lease_s <= 0:
            raise ValueError("delays must be >= 0, sample interval and lease > 0")
        if self.output_tokens is not None and self.output_tokens < 1:
            raise ValueError("output_tokens must be >= 1")
        if self.max_tokens < 1 or self.max_waiting < 0:
            raise ValueError("max_tokens must be >= 1 and max_waiting >= 0")
        if self.timing_noise_sigma < 0 or self.cold_start_s < 0:
            raise ValueError("timing_noise_sigma and cold_start_s must be >= 0")
        if (self.host_tier_tokens or 0) < 0 or (self.disk_tier_tokens or 0) < 0:
            raise ValueError("host_tier_tokens and disk_tier_tokens must be >= 0")
        if self.cold_start_prefills < 0:
            raise ValueError("cold_start_prefills must be >= 0")
        if (self.retention_budget_block_s or 0) < 0 or (self.max_retained_blocks or 0) < 0:
            raise ValueError("retention_budget_block_s and max_retained_blocks must be >= 0")
        if self.donate_min_hits < 0 or self.donate_max_hops < 1:
            raise ValueError("donate_min_hits must be >= 0 and donate_max_hops >= 1")
        if self.retention_min_ttl_s < 0:
            raise ValueError("retention_min_ttl_s must be >= 0")
