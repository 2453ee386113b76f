"""Prefilled KV waiting for its decode node's ``FetchKv``: bounded in bytes and time.

A ``Prefill`` stages the prompt's KV under a handle this module makes (128 random
bits, single use), bound to the request's tenant: never under the client's request id,
which two requests (two tenants, or a client's retry) may share. The first
``FetchKv`` naming the handle and the same tenant claims it (a retry cannot
double-serve it); the housekeeping loop drops what nobody claimed within its TTL.
``max_bytes`` bounds the whole area: a prefill that would exceed it is refused up
front, before any compute: ``EngineBusy`` while other prompts' KV fills it,
``PromptRejected`` when its own KV is larger than the whole area (no wait would help).
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from node_agent.errors import EngineBusy, PromptRejected
from node_agent.kv import KvContent

__all__ = ["ReadGrants", "StagedKv", "StagingArea"]


@dataclass(frozen=True, slots=True)
class StagedKv:
    kv: KvContent | None  # None for a one-token prompt
    num_tokens: int
    nbytes: int
    expires_at: float
    tenant: str
    grantee: str = ""  # the node the conductor named to fetch it ("" = not bound)


class StagingArea:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._staged: dict[str, StagedKv] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._staged)

    @property
    def max_bytes(self) -> int:
        return self._max_bytes

    def check_room(self, nbytes: int) -> None:
        """Refuse a prefill whose KV could not be staged (before computing it): busy
        while others' KV fills the area, rejected when its own KV never fits."""
        if nbytes > self._max_bytes:
            raise PromptRejected(
                f"the prompt's KV ({nbytes} bytes) is larger than this prefill node's "
                f"staging area ({self._max_bytes} bytes, max_staged_bytes)"
            )
        if self.nbytes + nbytes > self._max_bytes:
            raise EngineBusy("staged KV buffer is full")

    def stage(self, staged: StagedKv) -> str:
        """Stage ``staged``; returns its new handle."""
        handle = secrets.token_urlsafe(16)
        self._staged[handle] = staged
        self.nbytes += staged.nbytes
        return handle

    def claim(
        self, handle: str, tenant: str, may_fetch: Callable[[str], None] = lambda _: None
    ) -> StagedKv | None:
        """Take the staged KV out (None: never staged, expired, already claimed, or
        staged for another tenant, which keeps it for its owner). ``may_fetch`` is given
        its grantee first and raises to refuse; the KV then stays for its grantee."""
        staged = self._staged.get(handle)
        if staged is None or staged.tenant != tenant:
            return None
        may_fetch(staged.grantee)
        del self._staged[handle]
        self.nbytes -= staged.nbytes
        return staged

    def expire(self, now: float) -> None:
        for handle in [h for h, st in self._staged.items() if st.expires_at <= now]:
            staged = self._staged.pop(handle)
            self.nbytes -= staged.nbytes


class ReadGrants:
    """The grants to read an open LOCK_ONLY transaction's blocks (``ReadBlocks``): a
    token this agent makes when the conductor locks the blocks, which the conductor
    hands to the one destination it sends to pull them. A transaction id shows up in
    logs; the token never does. A grant lives as long as its transaction."""

    def __init__(self) -> None:
        self._tokens: dict[str, tuple[str, str]] = {}  # tx id → (token, grantee)

    def __len__(self) -> int:
        return len(self._tokens)

    def issue(self, tx_id: str, grantee: str = "") -> str:
        """The transaction's token (the same one for a retried allocation), for the node
        ``grantee`` ("" = not bound to a node)."""
        known = self._tokens.get(tx_id)
        if known is None:
            known = self._tokens[tx_id] = (secrets.token_urlsafe(16), grantee)
        return known[0]

    def grantee(self, tx_id: str, token: str) -> str | None:
        """The node the grant is for ("" = any), or None: no such grant."""
        known = self._tokens.get(tx_id)
        if known is None or not hmac.compare_digest(known[0], token):
            return None
        return known[1]

    def prune(self, is_open: Callable[[str], bool]) -> None:
        """Forget the grants of transactions that are no longer open."""
        for tx_id in [t for t in self._tokens if not is_open(t)]:
            del self._tokens[tx_id]
