"""Canonical chained block keys, shared by the conductor and the node agent.

Algorithm (layout 2, ``KEY_LAYOUT``)
    A prompt of token ids is cut into blocks of ``block_size`` tokens; only FULL blocks get
    a key (a trailing partial block has none, exactly as a paged KV cache can only share
    full pages). Block ``i`` gets::

        key_i = BLAKE2b-64(salt = NS(tenant, model), person = "kvc-blockkey-v2",
                           node_offset = key_{i-1},
                           data = le_u32(tok) for tok in block i)

    with ``key_{-1} = ROOT_PARENT_KEY`` (or the ``parent`` passed in, to continue a chain).
    ``NS(tenant, model)`` is a 16-byte BLAKE2b digest of the length-prefixed UTF-8 tenant
    and model names, computed once per call. It sits in BLAKE2b's salt parameter, so it
    enters every block's hash (one tenant can never produce, hit or time another tenant's
    keys) at no cost: the salt lives in the parameter block, not in the hashed data. The
    parent key sits in the same parameter block, in the 64-bit ``node_offset`` field
    (standard BLAKE2b, ``hashlib.blake2b(node_offset=...)``): the parameter block is XORed
    into the starting state, so the parent costs nothing either and a 32-token block (128
    bytes) is exactly one compression.
    Because each key covers its parent, equal keys mean equal whole prefixes (up to a
    2**-64 collision chance per pair), which is what makes a flat key map a prefix index.

Layout 1 (``kvc-blockkey-v1``), still computed on request
    ``key_i = BLAKE2b-64(salt = NS, person = "kvc-blockkey-v1", data = le_u64(key_{i-1})
    || le_u32(tok) for tok in block i)``: the parent in the data, so a 32-token block is
    136 bytes, two compressions. Conductors before layout 2 send it (their transactions
    carry no ``key_layout``); agents verify such a transaction's keys in layout 1, so
    agents can be upgraded before conductors (docs/operations.md).

Key width and collisions
    Keys are 64 bits. A false match needs two different prefixes of the same tenant and
    model to share a key; with ``N`` distinct blocks ever keyed in one namespace the
    expected number of colliding pairs is about ``N**2 / 2**65``: 2.7e-4 at 10^8 blocks,
    ~2.7 at 10 billion. What a lookup risks is smaller: one key against the ``M`` blocks
    cached at that moment collides with probability ``M / 2**64`` (5.4e-10 per key at
    M = 10^10; a fleet caches millions, not billions, at once). A collision makes an agent
    reuse the KV of another prefix. On purpose: hitting a given key of another tenant
    needs a second preimage of a salted 64-bit BLAKE2b output (~2^64 hashes); a birthday
    search (~2^32) finds colliding prompts within one's own namespace only, so a tenant
    can at worst spoil its own cache. 128-bit keys (a new layout version and wider keys
    on the wire) would make it ~1.5e-19 pairs at 10 billion; not done. The same holds in
    both layouts: each is one BLAKE2b-64 per block over an injective encoding of
    (namespace, parent, tokens).

Determinism
    Only stdlib ``hashlib.blake2b`` and explicit little-endian encodings are used: keys are
    identical across processes, machines, endianness and ``PYTHONHASHSEED``. Python's
    ``hash()`` is never used. The layout is versioned by the ``person`` string and
    ``KEY_LAYOUT``; changing anything here breaks the committed test vectors in
    ``tests/unit/test_block_keys.py`` on purpose — a changed layout is a new version,
    rolled out as such: agents say in ``NodeInfo.block_key_layout`` which layout their
    events carry, transactions say in ``TxAllocateRequest.key_layout`` which layout their
    keys are in, and a conductor schedules only onto agents of its own layout.

Knobs
    ``block_size`` (tokens per block, > 0) must equal the engine's KV page size.

Compiled and pure-Python
    ``kvc/_native.c`` computes the same keys in C (BLAKE2b written from RFC 7693): the
    token list is read straight from its int objects into little-endian uint32 bytes, then
    each block costs its compressions, without holding the GIL. It is
    built at install when a C compiler is there (``setup.py``, an optional extension) and
    used when it imports (``kvc/native.py``, whose ``AVAILABLE`` says which path this
    process runs).
    Without it the loops below compute the same keys: one conversion of the whole list to
    bytes, then one ``hashlib.blake2b`` per full block over a memoryview slice (layout 1:
    from a pre-salted template via ``copy()``). ``KVC_NATIVE=0`` forces Python (a switch
    for comparing the two, not for production). The tests check both against each other
    and against the committed vector.

Complexity
    O(n) for n tokens. The compiled path is BLAKE2b-bound: ~0.13 us per 128-byte
    compression, as fast as hashlib's own (512 KB in one call: 0.54 ms); a 32-token block
    is one compression in layout 2 (two in layout 1); reading the token list is ~1.1 ns a
    token. Measured figures: docs/benchmarks.md ("One compression per block"). Hashing
    never needs to leave the event loop.

Invariants
    * ``len(compute_block_keys(t, ...)) == len(t) // block_size``.
    * Prefix-stable: keys of ``t[:k*B]`` are the first ``k`` keys of ``t``.
    * Continuation: ``keys(a + b) == keys(a) + keys(b, parent=keys(a)[-1])`` when
      ``len(a)`` is a multiple of ``block_size``.
    * Every key is a uint64 (fits a protobuf ``fixed64``).
"""

from __future__ import annotations

import functools
import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, NewType, cast

from kvc import native

__all__ = [
    "KEY_BITS",
    "KEY_LAYOUT",
    "KEY_LAYOUTS",
    "MAX_TOKEN_ID",
    "ROOT_PARENT_KEY",
    "BlockKey",
    "BlockKeySpec",
    "compute_block_keys",
    "is_key_layout",
    "namespace_digest",
]

BlockKey = NewType("BlockKey", int)
"""A chained block key: an unsigned 64-bit integer."""

KEY_BITS: Final = 64
MAX_TOKEN_ID: Final = 2**32 - 1
ROOT_PARENT_KEY: Final = BlockKey(0)
"""The parent of block 0 of every prompt."""

KEY_LAYOUT: Final = 2
"""The layout this version computes by default and keys engine events in."""
KEY_LAYOUTS: Final = (1, 2)
"""The layouts ``compute_block_keys`` computes (an agent verifies transactions in any)."""

_KEY_PERSONS: Final = {1: b"kvc-blockkey-v1", 2: b"kvc-blockkey-v2"}  # BLAKE2b person


def is_key_layout(layout: object) -> bool:
    """``layout`` is one of ``KEY_LAYOUTS`` (an int, not a bool or a float)."""
    return isinstance(layout, int) and not isinstance(layout, bool) and layout in _KEY_PERSONS


_NS_PERSON: Final = b"kvc-namespace-v1"
_KEY_BYTES: Final = KEY_BITS // 8
_TOKEN_BYTES: Final = 4


def _u32_typecode() -> str:
    for code in ("I", "L"):
        if array(code).itemsize == _TOKEN_BYTES:
            return code
    raise RuntimeError("no 4-byte unsigned array typecode on this platform")  # pragma: no cover


_U32: Final = _u32_typecode()
_BIG_ENDIAN_HOST: Final = sys.byteorder == "big"


@functools.lru_cache(maxsize=4096)
def namespace_digest(tenant: str, model: str) -> bytes:
    """The 16-byte namespace salt of ``(tenant, model)``: unambiguous by length prefixes.

    Remembered for the last 4,096 namespaces: every request hashes under one.
    """
    tenant_b = tenant.encode("utf-8")
    model_b = model.encode("utf-8")
    h = hashlib.blake2b(digest_size=16, person=_NS_PERSON)
    h.update(len(tenant_b).to_bytes(8, "little"))
    h.update(tenant_b)
    h.update(len(model_b).to_bytes(8, "little"))
    h.update(model_b)
    return h.digest()


def _tokens_to_le_u32(token_ids: Sequence[int]) -> bytes:
    try:
        arr = array(_U32, token_ids)
    except OverflowError as exc:
        raise ValueError(f"token ids must lie in [0, 2**32): {exc}") from exc
    except TypeError as exc:
        raise ValueError(f"token ids must be integers: {exc}") from exc
    if _BIG_ENDIAN_HOST:  # pragma: no cover - exercised only on big-endian hosts
        arr.byteswap()
    return arr.tobytes()


def compute_block_keys(
    token_ids: Sequence[int],
    *,
    tenant: str,
    model: str,
    block_size: int,
    parent: BlockKey | None = None,
    end: int | None = None,
    layout: int = KEY_LAYOUT,
) -> list[BlockKey]:
    """Chained keys of the full blocks of ``token_ids``, in order, in ``layout``.

    ``parent`` continues a chain (the key of the block just before ``token_ids[0]``);
    ``None`` starts at ``ROOT_PARENT_KEY``. ``end``: the keys of ``token_ids[:end]``
    (``0 <= end <= len(token_ids)``) — a prompt's keys leave its last token out, which is
    always computed — without copying a long list: within a block of the length, the
    keys of the whole list are cut instead (an invalid id past ``end`` then falls back to
    the copy, so it never raises). Raises ``ValueError`` when ``block_size <= 0``, a token
    id is outside ``[0, 2**32)``, ``parent`` is not a uint64, ``end`` is out of range or
    ``layout`` is not one of ``KEY_LAYOUTS``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if not is_key_layout(layout):
        raise ValueError(f"unknown block-key layout {layout!r}; known: {KEY_LAYOUTS}")
    parent_key = ROOT_PARENT_KEY if parent is None else parent
    if not 0 <= parent_key < 2**KEY_BITS:
        raise ValueError(f"parent must be a uint64, got {parent_key!r}")
    salt = namespace_digest(tenant, model)
    if end is not None:
        if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= len(token_ids):
            raise ValueError(f"end must be an int in [0, {len(token_ids)}], got {end!r}")
        if len(token_ids) - end < block_size:
            try:
                keys = _chain_keys(token_ids, salt, block_size, parent_key, layout)
            except ValueError:
                pass  # an id past ``end`` may be the invalid one: hash the slice alone
            else:
                del keys[end // block_size :]  # at most one key: the block ``end`` cuts
                return keys
        token_ids = token_ids[:end]
    return _chain_keys(token_ids, salt, block_size, parent_key, layout)


def _chain_keys(
    token_ids: Sequence[int], salt: bytes, block_size: int, parent_key: int, layout: int
) -> list[BlockKey]:
    person = _KEY_PERSONS[layout]
    if native.chain_keys is not None:
        keys = native.chain_keys(token_ids, salt, person, block_size, parent_key, layout)
        return cast("list[BlockKey]", keys)
    if layout == 2:
        return _python_chain_keys_v2(token_ids, salt, person, block_size, parent_key)
    return _python_chain_keys(token_ids, salt, person, block_size, parent_key)


def _python_chain_keys_v2(
    token_ids: Sequence[int], salt: bytes, person: bytes, block_size: int, parent_key: int
) -> list[BlockKey]:
    """Layout 2 in pure Python: the fallback, and the reference the compiled path is
    tested against. The parent is a parameter, so each block makes its own hash object."""
    data = _tokens_to_le_u32(token_ids)
    n_blocks = len(token_ids) // block_size
    view = memoryview(data)
    step = block_size * _TOKEN_BYTES
    prev = parent_key
    keys: list[int] = []
    append = keys.append
    from_bytes = int.from_bytes
    blake2b = hashlib.blake2b
    for off in range(0, n_blocks * step, step):
        digest = blake2b(
            view[off : off + step], digest_size=_KEY_BYTES, salt=salt, person=person,
            node_offset=prev,
        ).digest()  # fmt: skip
        prev = from_bytes(digest, "little")
        append(prev)
    return cast("list[BlockKey]", keys)


def _python_chain_keys(
    token_ids: Sequence[int], salt: bytes, person: bytes, block_size: int, parent_key: int
) -> list[BlockKey]:
    """Layout 1 in pure Python: the fallback, and the reference the compiled path is
    tested against."""
    data = _tokens_to_le_u32(token_ids)
    n_blocks = len(token_ids) // block_size
    if n_blocks == 0:
        return []
    template = hashlib.blake2b(digest_size=_KEY_BYTES, salt=salt, person=person)
    view = memoryview(data)
    step = block_size * _TOKEN_BYTES
    prev = parent_key.to_bytes(_KEY_BYTES, "little")
    keys: list[int] = []  # BlockKey is int at run time: no wrapper call per key
    append = keys.append
    from_bytes = int.from_bytes
    copy = template.copy
    for off in range(0, n_blocks * step, step):
        h = copy()
        h.update(prev)
        h.update(view[off : off + step])
        prev = h.digest()
        append(from_bytes(prev, "little"))
    return cast("list[BlockKey]", keys)


@dataclass(frozen=True, slots=True)
class BlockKeySpec:
    """The namespace and page size a deployment hashes prompts under."""

    tenant: str
    model: str
    block_size: int

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")

    def keys(self, token_ids: Sequence[int], parent: BlockKey | None = None) -> list[BlockKey]:
        """``compute_block_keys`` under this spec (layout ``KEY_LAYOUT``)."""
        return compute_block_keys(
            token_ids,
            tenant=self.tenant,
            model=self.model,
            block_size=self.block_size,
            parent=parent,
        )
