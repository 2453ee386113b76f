"""The KV-cache events the simulated engine emits (vLLM's ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``), as plain values; ``kv_events`` encodes them.

Hashes are the external form (``hashing.external_hash``); ``extra_keys`` has one entry
per block, ``(salt,)`` for a salted block 0 and ``None`` elsewhere, as vLLM publishes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KvCacheEvent",
]

MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"  # the offloading connector's host-memory copies


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    extra_keys: tuple[tuple[str, ...] | None, ...] | None  # one entry per block
    medium: str = MEDIUM_GPU
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str = MEDIUM_GPU
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
