"""Prefilled KV waiting for its decode node's ``FetchKv``: bounded in bytes and time.

A ``Prefill`` stages the prompt's KV under its request id; the first ``FetchKv``
claims it (a retry cannot double-serve it); the housekeeping loop drops what nobody
claimed within its TTL. ``max_bytes`` bounds the whole area: a prefill that would
exceed it is refused up front (``EngineBusy``), before any compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from node_agent.errors import EngineBusy, PromptRejected
from node_agent.kv import KvContent

__all__ = ["StagedKv", "StagingArea"]


@dataclass(frozen=True, slots=True)
class StagedKv:
    kv: KvContent | None  # None for a one-token prompt
    num_tokens: int
    nbytes: int
    expires_at: float


class StagingArea:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._staged: dict[str, StagedKv] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._staged)

    def check_room(self, request_id: str, nbytes: int) -> None:
        """Refuse a prefill whose KV could not be staged (before computing it)."""
        if request_id in self._staged:
            raise PromptRejected(f"request {request_id!r} is already staged")
        if self.nbytes + nbytes > self._max_bytes:
            raise EngineBusy("staged KV buffer is full")

    def stage(self, request_id: str, staged: StagedKv) -> None:
        self._staged[request_id] = staged
        self.nbytes += staged.nbytes

    def claim(self, request_id: str) -> StagedKv | None:
        """Take the staged KV out (None: never staged, expired or already claimed)."""
        staged = self._staged.pop(request_id, None)
        if staged is not None:
            self.nbytes -= staged.nbytes
        return staged

    def expire(self, now: float) -> None:
        for request_id in [r for r, st in self._staged.items() if st.expires_at <= now]:
            self.claim(request_id)
