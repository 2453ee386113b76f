"""Every exception the node agent raises on purpose, in one hierarchy.

::

    Exception
    ├── EngineError            an engine could not do what was asked
    │   ├── PromptRejected     the request is invalid here (token ids, length, role)
    │   ├── EngineBusy         bounded queues or buffers are full: retry later or elsewhere
    │   └── Draining           the agent finishes in-flight work but takes no new work
    ├── TransferError          a KV transfer from a peer failed (connection, checksum,
    │                          size, layout); this node itself is fine
    ├── NotStaged              FetchKv of a request with no staged prefill
    ├── ContentMissing         ReadBlocks of blocks whose KV was never computed here
    └── NotPermitted           the caller's certificate does not allow this RPC

The block table's own errors (``node_agent.blocks.pool.BlockPoolError`` and its
subclasses: capacity, invalid argument, unknown or closed transaction) stay with the
pure pool. ``node_agent.rpc_errors`` maps all of them to gRPC status codes, in one place.
"""

from __future__ import annotations

__all__ = [
    "ContentMissing",
    "Draining",
    "EngineBusy",
    "EngineError",
    "NotPermitted",
    "NotStaged",
    "PromptRejected",
    "TransferError",
]


class EngineError(Exception):
    """An engine could not do what was asked (bad prompt, capacity, failure)."""


class PromptRejected(EngineError):
    """The prompt is invalid for this engine (token ids, length)."""


class Unsupported(EngineError):
    """A valid request parameter this engine cannot honour (structured output on the
    embedded engine): refused, never ignored."""


class EngineBusy(EngineError):
    """The engine's bounded queues are full; retry later or elsewhere."""


class Draining(EngineError):
    """The agent is draining: it finishes in-flight work but takes no new work."""


class TransferError(Exception):
    """A KV transfer from a peer failed (connection, checksum, size, layout)."""


class NotStaged(Exception):
    """FetchKv for a request with no staged prefill (never, expired, or fetched)."""


class ContentMissing(Exception):
    """ReadBlocks of blocks whose KV was never computed here (allocated or committed bare)."""


class NotPermitted(Exception):
    """The caller's role (from its client certificate) may not call this RPC."""
