"""The conductor's per-app state, built by the lifespan and reached by dependencies."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from conductor.adapters.agents import AgentFleet
from conductor.adapters.ratelimit import RateLimiter
from conductor.api.prompt_cache import TenantCacheLedger
from conductor.api.schemas import ModelCard
from conductor.api.tool_calls import ParserName
from conductor.core.prefix_index import PrefixIndex
from conductor.dispatch import Dispatcher
from conductor.metrics import ConductorMetrics
from conductor.settings import ConductorSettings
from conductor.tenants import TenantDirectory
from kvc.tokenization import ChatTokenizer


@dataclass(slots=True)
class AppState:
    settings: ConductorSettings
    tokenizer: ChatTokenizer
    fleet: AgentFleet
    index: PrefixIndex
    dispatcher: Dispatcher
    metrics: ConductorMetrics
    model_name: str
    tenants: TenantDirectory
    limiter: RateLimiter
    tool_parser: ParserName | None = None  # reads tool calls from the output; None: refused
    cache_ledger: TenantCacheLedger = field(default_factory=TenantCacheLedger)
    created: int = field(default_factory=lambda: int(time.time()))
    inflight: int = 0
    draining: bool = False

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, owned_by="kv-conductor")

    def max_model_len(self) -> int | None:
        """Context length of the model as the usable agents report it (their minimum)."""
        lens = [a.info.max_model_len for a in self.fleet.handles() if a.usable and a.info]
        return min(lens) if lens else None
