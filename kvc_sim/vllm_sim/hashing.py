"""vLLM's engine block hashes, as vLLM 0.32 computes them with its default settings.

Algorithm (``prefix_caching_hash_algo="sha256"``, ``PYTHONHASHSEED`` unset)
    ``NONE_HASH = sha256(pickle("vllm-none-hash"))`` and, for each full block,
    ``hash = sha256(pickle((parent or NONE_HASH, tuple(block_tokens), extra_keys)))``
    with pickle's highest protocol. ``extra_keys`` is ``(("cache_salt", salt),)`` for
    block 0 of a salted request and ``None`` otherwise (no LoRA, multimodal or prompt
    embeddings here). KV events carry the low 64 bits of the digest read big-endian
    (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, vLLM's default). With ``PYTHONHASHSEED``
    set, vLLM seeds ``NONE_HASH`` with it; so does this module.

So two engines (simulated or real) give the same prompt the same block hashes.

Complexity
    One sha256 over a pickle of ``block_size`` ints per block.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Sequence
from typing import Final, NewType

__all__ = [
    "NONE_HASH",
    "BlockHash",
    "ExtraKeys",
    "block_extra_keys",
    "external_hash",
    "hash_block",
    "hash_blocks",
]

BlockHash = NewType("BlockHash", bytes)
ExtraKeys = tuple[tuple[str, str], ...] | None

_DEFAULT_SEED: Final = "vllm-none-hash"


def _sha256(value: object) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


NONE_HASH: Final = BlockHash(_sha256(os.environ.get("PYTHONHASHSEED", _DEFAULT_SEED)))


def block_extra_keys(index: int, cache_salt: str | None) -> ExtraKeys:
    """The extra keys vLLM hashes into block ``index``: the salt in block 0 only."""
    if index == 0 and cache_salt:
        return (("cache_salt", cache_salt),)
    return None


def hash_block(parent: BlockHash | None, tokens: Sequence[int], extra: ExtraKeys) -> BlockHash:
    return BlockHash(_sha256((parent or NONE_HASH, tuple(tokens), extra)))


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    *,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from block ``start`` on (chained from
    ``parent``, the hash of block ``start - 1``)."""
    out: list[BlockHash] = []
    for index in range(start, len(token_ids) // block_size):
        tokens = token_ids[index * block_size : (index + 1) * block_size]
        parent = hash_block(parent, tokens, block_extra_keys(index, cache_salt))
        out.append(parent)
    return out


def external_hash(block_hash: BlockHash) -> int:
    """The hash as KV events carry it: the digest's low 64 bits, big-endian."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
