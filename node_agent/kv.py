"""KV content as the agent sees it: a layout, a token count and bytes, no tensors.

The server and the transfer code handle prompt KV through two ports an engine provides:

* ``KvContent``: one token range of KV (a pool block, a staged prefill). It knows its
  ``num_tokens``, its ``layout`` and its size, cuts sub-ranges (``slice``) and writes
  the wire format (``to_bytes``: layer-major, key then value, native little-endian
  dtype, as ``docs/protocol.md`` describes; ``to_buffers``: the same as a sequence of
  host buffers, for a same-host transfer that writes them straight into a file).
* ``KvCodec``: what only the engine can do, build content: ``concat`` consecutive
  ranges and ``from_bytes`` (the inverse of ``to_bytes``, onto the engine's device).

The embedded engine implements both with torch tensors
(``node_agent.engines.embedded.kv_tensors``); an engine that keeps KV in its own
process (vLLM) has no codec, and its pool blocks hold no content. Nothing here imports
torch: the agent, the gRPC server and the vLLM adapter run without it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Protocol, Self, TypeGuard, runtime_checkable

__all__ = ["KV_DTYPE_BYTES", "KvCodec", "KvContent", "KvLayout", "is_kv_content"]

# Bytes per element of every KV dtype two agents may exchange.
KV_DTYPE_BYTES: Final[dict[str, int]] = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True, slots=True)
class KvLayout:
    """Shape of one token's KV: what two nodes must agree on to exchange blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in KV_DTYPE_BYTES:
            raise ValueError(
                f"unsupported KV dtype {self.dtype!r}; expected one of {list(KV_DTYPE_BYTES)}"
            )
        if min(self.num_layers, self.num_kv_heads, self.head_dim) <= 0:
            raise ValueError(f"KV layout dimensions must be positive: {self}")

    @property
    def itemsize(self) -> int:
        return KV_DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of all layers for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize


@runtime_checkable
class KvContent(Protocol):
    """The KV of a token range; immutable (``slice`` returns a compact copy)."""

    @property
    def num_tokens(self) -> int: ...

    @property
    def layout(self) -> KvLayout: ...

    @property
    def nbytes(self) -> int: ...

    def slice(self, start: int, end: int) -> Self: ...

    def to_bytes(self) -> bytes: ...

    def to_buffers(self) -> Iterator[memoryview]:
        """What ``to_bytes`` writes, as consecutive host buffers: no copy into one
        ``bytes`` (none at all for content already in host memory)."""
        ...


_CONTENT_TYPES: dict[type, bool] = {}  # type → whether its instances are KvContent


def is_kv_content(obj: object) -> TypeGuard[KvContent]:
    """``isinstance(obj, KvContent)``, answered once per type: a runtime protocol check
    looks up every member on every call (~26 us on Python 3.11), and the pool asks for
    every block of a prompt (None, for a mirrored block, is the common answer)."""
    if obj is None:
        return False
    kind = type(obj)
    known = _CONTENT_TYPES.get(kind)
    if known is None:
        known = _CONTENT_TYPES[kind] = isinstance(obj, KvContent)
    return known


class KvCodec(Protocol):
    """Builds an engine's ``KvContent``: joins ranges, reads the wire format."""

    def concat(self, parts: Sequence[KvContent]) -> KvContent: ...

    def from_bytes(
        self, layout: KvLayout, data: bytes | bytearray | memoryview, num_tokens: int
    ) -> KvContent: ...

    def to_host(self, content: KvContent) -> KvContent:
        """A copy of ``content`` in host memory (the agent's L2 tier)."""
        ...

    def to_device(self, content: KvContent) -> KvContent:
        """``content`` on the engine's device (itself when already there)."""
        ...

    def to_device_many(self, contents: Sequence[KvContent]) -> Sequence[KvContent]:
        """``to_device`` of each, in order, waiting once for all the copies (a
        transaction's promotions)."""
        ...
