"""The conductor's shadow prefix index: which node holds which block keys.

What it mirrors
    Every node agent owns a block table and publishes, per node *epoch* (one process
    lifetime of the agent), a stream of events numbered ``1, 2, 3, ...``: keys stored,
    keys removed, all cleared, or load only. The conductor seeds a node from a
    ``Snapshot`` (epoch, seq, cached keys) with ``reset_node`` and then feeds every event
    from ``seq + 1`` to ``apply``. The index is a *shadow*: it may lag or miss keys, never
    decides anything by itself — the agent re-checks every key on ``TxAllocate``, so a
    stale entry costs a recompute, never a wrong answer.

Structure (compact: no Python object per key)
    Each known node gets a small integer *slot* (lowest free slot first, so slot numbers
    stay below the number of live nodes) and the bit ``1 << slot``. Every distinct key maps
    to the *set* of slots holding it, and sets are interned: a set id (``uint32``) stands
    for one bitmask (a Python ``int``), shared by every key held by exactly that set of
    nodes. Sets are few (a fleet's keys fall into a handful of holder patterns: one node,
    the nodes sharing a system prompt, ...) and reference-counted, so an id is recycled
    when its last key leaves. Keys live in one open-addressing table of two NumPy arrays,
    ``keys: uint64[C]`` and ``set_ids: uint32[C]`` (12 bytes a slot), in rows of 16 slots.
    A key goes to the first row, from its home row ``(key * M mod 2**64) mod rows`` on,
    with a free slot, and every full row it passes is flagged *overflowed* (one byte a
    row); a lookup stops at the first row without the flag, so nearly every key, present
    or not, is decided at its home row. ``M`` is a random odd multiplier drawn per process
    (a tenant that can compute its own keys cannot aim them at one row). Set id 0 marks an
    empty slot, 1 a deleted one (reused by later inserts). The table is rebuilt at twice
    the live keys when live + deleted slots pass 3/4 of it or live keys fall under 1/4
    (which also clears the flags). Block keys are chained over
    their whole prefix (``block_keys``), so "node holds ``keys[i]``" already implies it
    held the prefix when the key was made; a flat map is enough.

Matching (``match``, ``best_match``)
    Look up the prompt's first 2 keys one by one, then the rest in chunks (32 keys, then
    8x larger, up to 1,024), a chunk in a few vectorised steps; walk the *runs* of equal
    set ids with ``alive`` = the slots still matching: ``alive &= mask(run)``; the slots
    that just dropped out matched exactly the run's start. Stop as soon as ``alive`` is
    empty, so a prompt nobody holds costs one scalar lookup::

        match       O(len(matched prefix) + runs + number of nodes)
        best_match  O(len(matched prefix) + runs + holders of the best prefix)

    ``match`` answers for every known node (0 when it holds no prefix); ``best_match``
    breaks ties by the smallest node id, so results are deterministic. Measured numbers
    are in docs/benchmarks.md (``python -m bench.shadow_index``).

Event rules (``apply``)
    * unknown node, other epoch, a gap (``seq > last + 1``), or a node marked stale by
      the memory bound -> ``RESYNC``: nothing applied; the caller must ``Snapshot`` again
      and ``reset_node``. The old shadow stays until then (stale but safe).
    * ``seq <= last`` -> ``DUPLICATE``: ignored (at-least-once delivery, replays).
    * ``seq == last + 1`` -> ``APPLIED``; within one event ``cleared`` is applied first,
      then ``removed``, then ``stored``. An empty event (load only) still advances seq.
      Storing a key already held, or removing one not held, is a no-op.

Memory bound (knob ``max_keys_per_node``, default 2,000,000)
    A node never holds more than ``max_keys_per_node`` keys in the shadow. When a stored
    event would push it over, the node's keys are all dropped, the node is marked stale
    (its position is kept) and ``apply`` answers ``RESYNC`` until ``reset_node``. A snapshot
    larger than the bound is truncated to its first ``max_keys_per_node`` distinct keys: the
    shadow is then a subset of the truth, which is safe. Size the bound at or above every
    node's capacity in blocks, or such a node will keep cycling through resyncs.
    Memory: ~12 bytes per table slot with live keys filling 1/4 to 3/4 of it, about half
    after a rebuild: 16-48 bytes per distinct key, ~24 typical, whatever the number of
    nodes (a key held by k nodes costs what a key held by one does), plus the interned
    sets. Budget ``distinct keys x ~24 B``; the previous design (a dict entry and an int
    object per (node, key) plus one per key) kept ~141 B per entry alive. The garbage
    collector never walks the table (NumPy buffers hold no Python objects).
    Lookups of a prompt's keys (``match``, ``best_match``, ``held_within``) probe the table
    in C where ``kvc/_native.c`` was built (``kvc/native.py``), with the same answers as
    the vectorised probe that runs otherwise.

Other costs
    ``apply`` O(keys in the event) plus a few vectorised steps (tens of microseconds);
    ``reset_node`` of a node that held keys, ``remove_node`` and ``cleared`` are O(table)
    vectorised passes (a node's keys are found through the sets that contain its bit, not
    kept in a per-node list) — resyncs and departures, not the steady state; ``nodes``
    O(1) amortised (cached, sorted by id); ``node_key_count``/``position`` O(1);
    ``stats`` O(nodes); ``node_keys`` O(table) (tests and debugging).

Invariants (checked by ``check_invariants``, used by the tests)
    * every live slot's key is found by a lookup from its home row (past overflowed rows
      only), and is stored once;
    * a set's reference count is the number of live slots carrying its id, no live set is
      empty, no two live ids share a mask;
    * a node's key count is the number of live slots whose set contains its bit, and is
      ``<= max_keys_per_node``;
    * ``stats().entries == sum(node_key_count(n) for n in nodes())``.
"""

from __future__ import annotations

import enum
import heapq
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, NewType

import numpy as np
import numpy.typing as npt

from kvc import native
from kvc.block_keys import BlockKey

__all__ = ["ApplyOutcome", "IndexStats", "NodeId", "PrefixIndex"]

NodeId = NewType("NodeId", str)
"""A node agent's stable identifier (as registered and reported by ``GetInfo``)."""

_U64 = npt.NDArray[np.uint64]
_U32 = npt.NDArray[np.uint32]
_I64 = npt.NDArray[np.int64]

_MASK64: Final = 2**64 - 1
_ROW: Final = 16  # slots per row: 128 bytes of keys, two cache lines
_EMPTY: Final = 0  # set id of a never-used slot
_TOMB: Final = 1  # set id of a deleted slot (reused by inserts, skipped by lookups)
_FIRST_SET: Final = 2
_MIN_ROWS: Final = 8
_MAX_FILL: Final = 0.75  # live + deleted slots over capacity that triggers a rebuild
_MIN_FILL: Final = 0.25  # live slots over capacity under which the table shrinks
_SCALAR_KEYS: Final = 2  # a prompt's first keys, looked up one by one
_FIRST_CHUNK: Final = 32  # then keys looked up together, 8x more each time
_MAX_CHUNK: Final = 1024
_SMALL: Final = 64  # arrays up to this length are cheaper walked in Python than in NumPy
# Keys up to this many are looked up and placed one by one: a vectorised probe costs
# tens of microseconds whatever its length (most events store or remove a block or two).
_FEW: Final = 8


class ApplyOutcome(enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # seq <= last applied: already seen, ignored
    RESYNC = "resync"  # unknown node, other epoch, gap, or over the bound: Snapshot again


@dataclass(frozen=True, slots=True)
class IndexStats:
    nodes: int  # known nodes
    keys: int  # distinct keys held by at least one node
    entries: int  # (node, key) pairs


@dataclass(slots=True)
class _NodeState:
    """Mutable per-node bookkeeping (private: never handed out)."""

    slot: int
    bit: int  # 1 << slot
    epoch: str
    seq: int
    count: int = 0  # keys this node holds in the shadow
    stale: bool = False


def _check_seq(seq: int) -> None:
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ValueError(f"seq must be a non-negative int, got {seq!r}")


def _as_keys(keys: Iterable[BlockKey]) -> _U64:
    try:
        return np.fromiter(keys, dtype=np.uint64)
    except (OverflowError, ValueError, TypeError) as exc:
        raise ValueError(f"block keys must be unsigned 64-bit ints: {exc}") from exc


def _few_keys(keys: Sequence[BlockKey]) -> list[BlockKey] | None:
    """Up to ``_FEW`` keys without repeats, as ints (first occurrence order), or None
    when there are more or one is not a plain int in ``0..2**64 - 1`` (then the array
    path converts them, or refuses them, as it always has)."""
    if len(keys) > _FEW:
        return None
    distinct = list(dict.fromkeys(keys))
    for key in distinct:
        if type(key) is not int or not 0 <= key <= _MASK64:
            return None
    return distinct


def _distinct_keys(keys: Sequence[BlockKey]) -> _U64:
    """``keys`` without repeats, in any order."""
    if len(keys) <= _SMALL:
        return _as_keys(dict.fromkeys(keys))
    return np.unique(_as_keys(keys))


class _KeyTable:
    """Open-addressing map ``uint64 key -> uint32 set id`` in two NumPy arrays.

    A key sits in the first row, from its home row on, that had a free slot when it was
    inserted; every row it passed is flagged as *overflowed*. A lookup therefore stops at
    the first row without the flag: most keys (present or not) are decided at their home
    row, in one vectorised step. Flags are only cleared by a rebuild.
    """

    __slots__ = ("_mult", "_mult_int", "ids", "keys", "live", "overflowed", "rows", "tombs")

    def __init__(self, rows: int, mult: np.uint64) -> None:
        self._mult = mult
        self._mult_int = int(mult)
        self.rows = rows
        self.keys: _U64 = np.zeros(rows * _ROW, dtype=np.uint64)
        self.ids: _U32 = np.zeros(rows * _ROW, dtype=np.uint32)
        self.overflowed: npt.NDArray[np.bool_] = np.zeros(rows, dtype=bool)
        self.live = 0  # slots holding a key
        self.tombs = 0  # deleted slots

    def nbytes(self) -> int:
        return int(self.keys.nbytes + self.ids.nbytes + self.overflowed.nbytes)

    def home(self, keys: _U64) -> _I64:
        return ((keys * self._mult) % np.uint64(self.rows)).astype(np.int64)

    def position_of(self, key: int) -> int:
        """The slot of one key (-1 when absent), without vectorising: a few row reads,
        cheaper than ``find`` for a key or two."""
        row = (key * self._mult_int & _MASK64) % self.rows
        while True:
            at = row * _ROW
            row_keys = self.keys[at : at + _ROW].tolist()
            if key in row_keys:
                row_ids = self.ids[at : at + _ROW].tolist()
                for col in range(_ROW):
                    if row_keys[col] == key and row_ids[col] > _TOMB:
                        return at + col
            if not self.overflowed[row]:
                return -1
            row = row + 1 if row + 1 < self.rows else 0

    def slots_of(self, keys: Sequence[int]) -> list[int]:
        """``[slot, set id]`` of each of ``keys``, flat (-1 and ``_EMPTY`` where absent).
        Compiled where built: an event of a block or two then costs no NumPy call (a
        dozen of those were ~70 µs of the conductor's thread per request in
        ``bench.hot_path``); else ``position_of`` per key."""
        if native.probe_slots is not None:
            return native.probe_slots(
                keys, self.keys, self.ids, self.overflowed, self.rows, self._mult_int, _ROW
            )
        out: list[int] = []
        for key in keys:
            at = self.position_of(key)
            out += (at, int(self.ids[at]) if at >= 0 else _EMPTY)
        return out

    def place_few(self, keys: Sequence[int], set_id: int) -> None:
        """``place`` of distinct absent ``keys`` given as ints (compiled where built)."""
        if native.place_keys is None:
            for key in keys:
                self._place_one(key, set_id)
            return
        reused = native.place_keys(
            keys, set_id, self.keys, self.ids, self.overflowed, self.rows, self._mult_int, _ROW
        )
        self.live += len(keys)
        self.tombs -= reused

    def set_id_of(self, key: int) -> int:
        """The set id of one key (``_EMPTY`` when absent), as ``position_of``."""
        at = self.position_of(key)
        return _EMPTY if at < 0 else int(self.ids[at])

    def find(self, keys: _U64) -> _I64:
        """Table position of each key, -1 where absent."""
        if len(keys) <= _FEW:
            return np.array([self.position_of(k) for k in keys.tolist()], dtype=np.int64)
        found = np.full(len(keys), -1, dtype=np.int64)
        self._probe(keys, found, positions=True)
        return found

    def set_ids_of(self, keys: _U64) -> _U32:
        """The set id of each key (``_EMPTY`` where absent)."""
        ids = np.zeros(len(keys), dtype=np.uint32)
        self._probe(keys, ids, positions=False)
        return ids

    def set_ids_in(self, keys: Sequence[BlockKey], start: int, end: int) -> _U32:
        """``set_ids_of(keys[start:end])``. Compiled (``kvc/_native.c``) where built: the
        keys are read from the list and probed row by row in C, with no array made first
        (``match`` over 4,096 keys in bench.scheduler_decision: ~1.4 -> ~0.3 ms); otherwise
        the vectorised probe."""
        start = min(start, len(keys))  # the bounds a slice would take
        end = max(start, min(end, len(keys)))
        if native.probe_set_ids is not None and isinstance(keys, list | tuple):
            ids = np.empty(end - start, dtype=np.uint32)
            native.probe_set_ids(
                keys, start, end, self.keys, self.ids, self.overflowed, self.rows,
                self._mult_int, _ROW, ids,
            )  # fmt: skip
            return ids
        return self.set_ids_of(_as_keys(keys[start:end]))

    def run_changes(self, keys: Sequence[BlockKey], start: int, end: int, last: int) -> list[int]:
        """Where the set id changes along ``keys[start:end]``: ``[i0, id0, i1, id1, ...]``,
        the absolute positions whose set id differs from the key's before (``last`` for
        ``keys[start]``) and their ids. Compiled where built (no array per chunk: a
        prompt changes set a few times over thousands of keys); otherwise from
        ``set_ids_in``."""
        start = min(start, len(keys))
        end = max(start, min(end, len(keys)))
        if native.probe_runs is not None and isinstance(keys, list | tuple):
            return native.probe_runs(
                keys, start, end, self.keys, self.ids, self.overflowed, self.rows,
                self._mult_int, _ROW, last,
            )  # fmt: skip
        ids = self.set_ids_in(keys, start, end)
        if len(ids) == 0:
            return []
        heads = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        if int(ids[0]) != last:
            heads = np.concatenate(([0], heads))
        out: list[int] = []
        for head, set_id in zip(heads.tolist(), ids[heads].tolist(), strict=True):
            out += (start + head, set_id)
        return out

    def _probe(self, keys: _U64, out: npt.NDArray[Any], *, positions: bool) -> None:
        """Look ``keys`` up row by row from their home rows, past overflowed rows only;
        write each found key's slot (``positions``) or set id into ``out``."""
        if len(keys) == 0:
            return
        row = self.home(keys)
        pending: _I64 | None = None  # None: every key (saves the index arrays)
        key_rows = self.keys.reshape(self.rows, _ROW)
        id_rows = self.ids.reshape(self.rows, _ROW)
        probe_keys = keys
        while True:
            row_ids = id_rows[row]
            hits = (key_rows[row] == probe_keys[:, None]) & (row_ids > _TOMB)
            if positions:
                hit = hits.any(axis=1)
                at = pending[hit] if pending is not None else hit
                out[at] = row[hit] * _ROW + hits[hit].argmax(axis=1)
            else:
                # A key is live at most once: its row's sum over hits is its set id.
                found = (row_ids * hits).sum(axis=1, dtype=np.uint32)
                hit = found != _EMPTY
                out[pending if pending is not None else slice(None)] = found
            go_on = ~hit & self.overflowed[row]
            if not go_on.any():
                return
            pending = np.flatnonzero(go_on) if pending is None else pending[go_on]
            probe_keys = probe_keys[go_on]
            row = row[go_on] + 1
            row[row == self.rows] = 0

    def place(self, keys: _U64, ids: _U32) -> None:
        """Insert distinct keys known to be absent (the caller keeps the fill in bounds)."""
        n = len(keys)
        if n == 0:
            return
        if n <= _FEW:
            for key, set_id in zip(keys.tolist(), ids.tolist(), strict=True):
                self._place_one(key, set_id)
            return
        row = self.home(keys)
        pending = np.arange(n)
        id_rows = self.ids.reshape(self.rows, _ROW)
        reused = 0
        while True:
            row_ids = id_rows[row]
            free = row_ids <= _TOMB
            if len(row) <= _SMALL and len(set(row.tolist())) == len(row):
                repeats = None  # one key per row (the usual small batch)
            else:
                order = np.argsort(row)  # any order within a row will do
                sorted_rows = row[order]
                repeats = sorted_rows[1:] == sorted_rows[:-1]
            if repeats is not None and repeats.any():
                # Rank each key among the pending keys aiming at the same row this
                # round: the r-th of them takes the row's r-th free slot, if any.
                positions = np.arange(len(row))
                starts = np.concatenate(([True], ~repeats))
                group_start = np.maximum.accumulate(np.where(starts, positions, 0))
                rank = np.empty(len(row), dtype=np.int64)
                rank[order] = positions - group_start
                taken = free & (np.cumsum(free, axis=1) == (rank + 1)[:, None])
            else:  # one key per row: the first free slot
                taken = free & (np.cumsum(free, axis=1) == 1)
            fits = taken.any(axis=1)
            if fits.any():
                col = taken[fits].argmax(axis=1)
                where = row[fits] * _ROW + col
                reused += int(np.count_nonzero(row_ids[fits, col] == _TOMB))
                self.keys[where] = keys[pending[fits]]
                self.ids[where] = ids[pending[fits]]
            if fits.all():
                break
            self.overflowed[row[~fits]] = True
            pending = pending[~fits]
            row = row[~fits] + 1
            row[row == self.rows] = 0
        self.live += n
        self.tombs -= reused

    def _place_one(self, key: int, set_id: int) -> None:
        """``place`` for one key: the first free slot from its home row on, flagging
        each full row it passes."""
        row = (key * self._mult_int & _MASK64) % self.rows
        while True:
            at = row * _ROW
            row_ids = self.ids[at : at + _ROW].tolist()
            for col in range(_ROW):
                if row_ids[col] <= _TOMB:
                    if row_ids[col] == _TOMB:
                        self.tombs -= 1
                    self.keys[at + col] = key
                    self.ids[at + col] = set_id
                    self.live += 1
                    return
            self.overflowed[row] = True
            row = row + 1 if row + 1 < self.rows else 0

    def live_slots(self) -> _I64:
        return np.flatnonzero(self.ids > _TOMB)


class PrefixIndex:
    """Shadow map of block keys to the nodes holding them (see the module docstring)."""

    __slots__ = (
        "_all_mask",
        "_free_ids",
        "_free_slots",
        "_mask_ids",
        "_masks",
        "_max_keys",
        "_mult",
        "_nodes",
        "_refs",
        "_slots",
        "_sorted",
        "_table",
    )

    def __init__(self, max_keys_per_node: int = 2_000_000) -> None:
        if (
            isinstance(max_keys_per_node, bool)
            or not isinstance(max_keys_per_node, int)
            or max_keys_per_node <= 0
        ):
            raise ValueError(f"max_keys_per_node must be a positive int, got {max_keys_per_node!r}")
        self._max_keys = max_keys_per_node
        self._mult = np.uint64(secrets.randbits(64) | 1)
        self._table = _KeyTable(_MIN_ROWS, self._mult)
        # Interned holder sets: id -> mask (ids 0 and 1 are the empty/deleted markers).
        self._masks: list[int] = [0, 0]
        self._refs: list[int] = [0, 0]  # id -> live slots carrying it
        self._mask_ids: dict[int, int] = {}  # mask -> id, for live sets
        self._free_ids: list[int] = []
        self._nodes: dict[NodeId, _NodeState] = {}
        self._slots: list[NodeId | None] = []  # slot -> node (None: free)
        self._free_slots: list[int] = []  # min-heap of free slot numbers
        self._all_mask = 0  # bits of every known node
        self._sorted: tuple[NodeId, ...] | None = ()  # cached sorted node ids

    @property
    def max_keys_per_node(self) -> int:
        return self._max_keys

    # ------------------------------------------------------------------ membership

    def reset_node(self, node: NodeId, epoch: str, seq: int, keys: Iterable[BlockKey]) -> None:
        """Replace everything known about ``node`` with a snapshot taken at ``(epoch, seq)``.

        Keys beyond the first ``max_keys_per_node`` distinct ones are dropped (the shadow
        becomes a safe subset).
        """
        _check_seq(seq)
        snapshot = _as_keys(keys)
        state = self._nodes.get(node)
        if state is None:
            state = self._add_node(node, epoch, seq)
        else:
            self._drop_keys(state)
            state.epoch = epoch
            state.seq = seq
            state.stale = False
        distinct, first = np.unique(snapshot, return_index=True)
        if len(distinct) > self._max_keys:
            distinct = snapshot[np.sort(first)[: self._max_keys]]
        self._store(state, distinct, self._max_keys)

    def remove_node(self, node: NodeId) -> None:
        """Forget ``node`` and every key it held; unknown nodes are ignored."""
        state = self._nodes.pop(node, None)
        if state is None:
            return
        self._drop_keys(state)
        self._slots[state.slot] = None
        heapq.heappush(self._free_slots, state.slot)
        self._all_mask &= ~state.bit
        while self._slots and self._slots[-1] is None:  # keep slot numbers compact
            self._slots.pop()
        limit = len(self._slots)
        self._free_slots = [s for s in self._free_slots if s < limit]
        heapq.heapify(self._free_slots)
        self._sorted = None

    def _add_node(self, node: NodeId, epoch: str, seq: int) -> _NodeState:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
            self._slots[slot] = node
        else:
            slot = len(self._slots)
            self._slots.append(node)
        state = _NodeState(slot=slot, bit=1 << slot, epoch=epoch, seq=seq)
        self._nodes[node] = state
        self._all_mask |= state.bit
        self._sorted = None
        return state

    # ---------------------------------------------------------------- holder sets

    def _intern(self, mask: int) -> int:
        set_id = self._mask_ids.get(mask)
        if set_id is None:
            if self._free_ids:
                set_id = self._free_ids.pop()
                self._masks[set_id] = mask
            else:
                set_id = len(self._masks)
                self._masks.append(mask)
                self._refs.append(0)
            self._mask_ids[mask] = set_id
        return set_id

    def _release_unused(self, set_ids: Iterable[int]) -> None:
        refs = self._refs
        for set_id in set_ids:
            if set_id >= _FIRST_SET and refs[set_id] == 0 and self._masks[set_id]:
                del self._mask_ids[self._masks[set_id]]
                self._masks[set_id] = 0
                self._free_ids.append(set_id)

    def _recount(self, old: _U32, new: _U32) -> None:
        """Move one reference from ``old[i]`` to ``new[i]`` for every i (TOMB/EMPTY ignored)."""
        refs = self._refs
        if len(old) <= _SMALL:
            olds = old.tolist()
            for set_id in olds:
                refs[set_id] -= 1
            for set_id in new.tolist():
                refs[set_id] += 1
            touched = set(olds)
        else:
            uniq, counts = np.unique(old, return_counts=True)
            for set_id, count in zip(uniq.tolist(), counts.tolist(), strict=True):
                refs[set_id] -= count
            uniq, counts = np.unique(new, return_counts=True)
            for set_id, count in zip(uniq.tolist(), counts.tolist(), strict=True):
                refs[set_id] += count
            touched = set(np.unique(old).tolist())
        refs[_EMPTY] = refs[_TOMB] = 0
        self._release_unused(touched)

    def _regroup(self, set_ids: _U32, change: dict[int, int]) -> _U32:
        """``set_ids`` with each id in ``change`` replaced by its value."""
        if len(set_ids) <= _SMALL:
            get = change.get
            return np.fromiter(
                (get(s, s) for s in set_ids.tolist()), dtype=np.uint32, count=len(set_ids)
            )
        uniq, inverse = np.unique(set_ids, return_inverse=True)
        targets = np.array([change.get(s, s) for s in uniq.tolist()], dtype=np.uint32)
        return targets[inverse.reshape(-1)]

    # ----------------------------------------------------------------- key storage

    def _grow_for(self, extra: int) -> None:
        table = self._table
        capacity = table.rows * _ROW
        if table.live + table.tombs + extra > _MAX_FILL * capacity:
            self._rebuild(table.live + extra)

    def _shrink_if_sparse(self) -> None:
        table = self._table
        if table.rows > _MIN_ROWS and table.live < _MIN_FILL * table.rows * _ROW:
            self._rebuild(table.live)

    def _rebuild(self, live: int) -> None:
        old = self._table
        rows = max(_MIN_ROWS, -(-2 * live // _ROW))
        new = _KeyTable(rows, self._mult)
        slots = old.live_slots()
        new.place(old.keys[slots], old.ids[slots])
        self._table = new

    def _store(self, state: _NodeState, keys: _U64, bound: int) -> bool:
        """Add ``state``'s bit to each of the distinct ``keys``; False (nothing changed)
        when the node would then hold more than ``bound`` keys."""
        if len(keys) == 0:
            return True
        table = self._table
        where = table.find(keys)
        present = where >= 0
        at = where[present]
        old = table.ids[at]
        masks = self._masks
        bit = state.bit
        old_ids = set(old.tolist())
        lacking = {s: masks[s] | bit for s in old_ids if not masks[s] & bit}
        if not lacking:
            n_gains = 0
        elif len(lacking) == len(old_ids):
            n_gains = len(old)
        else:
            n_gains = int(np.count_nonzero(np.isin(old, np.fromiter(lacking, dtype=np.uint32))))
        absent = keys[~present]
        if state.count + n_gains + len(absent) > bound:
            return False
        if lacking:
            change = {s: self._intern(mask) for s, mask in lacking.items()}
            new = self._regroup(old, change)
            moved = new != old
            table.ids[at[moved]] = new[moved]
            self._recount(old[moved], new[moved])
        if len(absent):
            self._grow_for(len(absent))
            single = self._intern(bit)
            self._table.place(absent, np.full(len(absent), single, dtype=np.uint32))
            self._refs[single] += len(absent)
        state.count += n_gains + len(absent)
        return True

    def _store_few(self, state: _NodeState, keys: Sequence[int], bound: int) -> bool:
        """``_store`` of a few distinct keys given as ints, without NumPy calls (the same
        changes; interned set ids may be numbered in another order)."""
        if not keys:
            return True
        table = self._table
        found = table.slots_of(keys)
        masks = self._masks
        bit = state.bit
        gains: list[tuple[int, int]] = []  # (slot, set id) of held keys lacking the bit
        absent: list[int] = []
        for i, key in enumerate(keys):
            at, set_id = found[2 * i], found[2 * i + 1]
            if at < 0:
                absent.append(key)
            elif not masks[set_id] & bit:
                gains.append((at, set_id))
        if state.count + len(gains) + len(absent) > bound:
            return False
        if gains:
            change: dict[int, int] = {}
            for _, set_id in gains:
                if set_id not in change:
                    change[set_id] = self._intern(masks[set_id] | bit)
            ids, refs = table.ids, self._refs
            for at, set_id in gains:
                new = change[set_id]
                ids[at] = new
                refs[set_id] -= 1
                refs[new] += 1
            self._release_unused(change)
        if absent:
            self._grow_for(len(absent))  # may rebuild: self._table is then a new table
            single = self._intern(bit)
            self._table.place_few(absent, single)
            self._refs[single] += len(absent)
        state.count += len(gains) + len(absent)
        return True

    def _unstore_few(self, state: _NodeState, keys: Sequence[int]) -> None:
        """``_unstore`` of a few distinct keys given as ints, without NumPy calls."""
        table = self._table
        found = table.slots_of(keys)
        masks = self._masks
        bit = state.bit
        change: dict[int, int] = {}
        moves: list[tuple[int, int]] = []  # (slot, set id) of keys holding the bit
        for i in range(len(keys)):
            at, set_id = found[2 * i], found[2 * i + 1]
            if at < 0 or not masks[set_id] & bit:
                continue
            if set_id not in change:
                rest = masks[set_id] & ~bit
                change[set_id] = self._intern(rest) if rest else _TOMB
            moves.append((at, set_id))
        if not moves:
            return
        ids, refs = table.ids, self._refs
        deleted = 0
        for at, set_id in moves:
            new = change[set_id]
            ids[at] = new
            refs[set_id] -= 1
            if new == _TOMB:
                deleted += 1
            else:
                refs[new] += 1
        table.live -= deleted
        table.tombs += deleted
        self._release_unused(change)
        state.count -= len(moves)
        self._shrink_if_sparse()

    def _unstore(self, state: _NodeState, keys: _U64) -> None:
        """Take ``state``'s bit off each of the distinct ``keys`` it holds."""
        table = self._table
        at = table.find(keys)
        at = at[at >= 0]
        if len(at) == 0:
            return
        old = table.ids[at]
        bit = state.bit
        masks = self._masks
        change: dict[int, int] = {}
        for s in np.unique(old).tolist():
            if masks[s] & bit:
                rest = masks[s] & ~bit
                change[s] = self._intern(rest) if rest else _TOMB
        if not change:
            return
        new = self._regroup(old, change)
        moved = new != old
        table.ids[at[moved]] = new[moved]
        deleted = int(np.count_nonzero(new[moved] == _TOMB))
        table.live -= deleted
        table.tombs += deleted
        self._recount(old[moved], new[moved])
        state.count -= int(np.count_nonzero(moved))
        self._shrink_if_sparse()

    def _drop_keys(self, state: _NodeState) -> None:
        """Take ``state``'s bit off every key (one vectorised pass over the table)."""
        if state.count == 0:
            return
        bit = state.bit
        masks = self._masks
        remap = np.arange(len(masks), dtype=np.uint32)
        touched: list[int] = []
        for set_id in range(_FIRST_SET, len(masks)):
            mask = masks[set_id]
            if mask & bit:
                rest = mask & ~bit
                remap[set_id] = self._intern(rest) if rest else _TOMB
                touched.append(set_id)
        if len(remap) < len(masks):  # interning grew the table of sets
            remap = np.concatenate([remap, np.arange(len(remap), len(masks), dtype=np.uint32)])
        table = self._table
        old = table.ids
        new = remap[old]
        deleted = int(np.count_nonzero((new == _TOMB) & (old != _TOMB)))
        table.ids = new
        table.live -= deleted
        table.tombs += deleted
        counts = np.bincount(new, minlength=len(masks)).tolist()
        refs = self._refs
        for set_id in range(_FIRST_SET, len(masks)):
            refs[set_id] = counts[set_id]
        self._release_unused(touched)
        state.count = 0
        self._shrink_if_sparse()

    # ---------------------------------------------------------------------- events

    def apply(
        self,
        node: NodeId,
        epoch: str,
        seq: int,
        *,
        stored: Sequence[BlockKey] = (),
        removed: Sequence[BlockKey] = (),
        cleared: bool = False,
    ) -> ApplyOutcome:
        """Apply one event of ``node``'s stream (order inside it: cleared, removed, stored)."""
        _check_seq(seq)
        state = self._nodes.get(node)
        if state is None or state.epoch != epoch or state.stale:
            return ApplyOutcome.RESYNC
        if seq <= state.seq:
            return ApplyOutcome.DUPLICATE
        if seq != state.seq + 1:
            return ApplyOutcome.RESYNC
        # Nearly every event stores or removes a block or two: those skip NumPy.
        fresh = _few_keys(stored)
        gone = _few_keys(removed)
        if fresh is not None and gone is not None:
            if cleared:
                self._drop_keys(state)
            if gone:
                self._unstore_few(state, gone)
            if fresh and not self._store_few(state, fresh, self._max_keys):
                self._drop_keys(state)
                state.stale = True
                return ApplyOutcome.RESYNC
            state.seq = seq
            return ApplyOutcome.APPLIED
        fresh_keys = _distinct_keys(stored) if stored else None
        gone_keys = _distinct_keys(removed) if removed else None
        if cleared:
            self._drop_keys(state)
        if gone_keys is not None:
            self._unstore(state, gone_keys)
        if fresh_keys is not None and not self._store(state, fresh_keys, self._max_keys):
            # Over the bound: a partial shadow could silently drift, so drop it all
            # and make the caller resync (a stale shadow only costs recomputes).
            self._drop_keys(state)
            state.stale = True
            return ApplyOutcome.RESYNC
        state.seq = seq
        return ApplyOutcome.APPLIED

    # --------------------------------------------------------------------- queries

    def position(self, node: NodeId) -> tuple[str, int] | None:
        """``(epoch, last applied seq)`` of ``node``, or ``None`` when unknown."""
        state = self._nodes.get(node)
        return None if state is None else (state.epoch, state.seq)

    def _runs(self, keys: Sequence[BlockKey]) -> Iterable[tuple[int, int]]:
        """``(start, mask)`` of each run of keys held by the same set, in prompt order.

        A key nobody holds is a run with mask 0; lookups go chunk by chunk, so a caller
        that stops early never pays for the rest of the prompt.
        """
        table = self._table
        masks = self._masks
        n = len(keys)
        last_id = -1
        # The first keys one by one: a prompt nobody holds ends the walk at its first
        # key, and a scalar lookup costs a tenth of a vectorised one.
        start = min(n, _SCALAR_KEYS)
        for depth in range(start):
            set_id = table.set_id_of(keys[depth])
            if set_id != last_id:
                yield depth, masks[set_id]
                last_id = set_id
        chunk = _FIRST_CHUNK
        while start < n:
            end = min(n, start + chunk)
            changes = table.run_changes(keys, start, end, last_id)
            for i in range(0, len(changes), 2):
                yield changes[i], masks[changes[i + 1]]
            if changes:
                last_id = changes[-1]
            start = end
            chunk = min(_MAX_CHUNK, chunk * 8)

    def match(self, keys: Sequence[BlockKey]) -> dict[NodeId, int]:
        """For every node holding ``keys[0]``, the number of leading ``keys`` it holds.

        Nodes holding none are absent (read it with ``.get(node, 0)``), so the answer
        costs what the holders cost, not what the fleet costs. The order of the dict is
        not defined.
        """
        result: dict[NodeId, int] = {}
        alive = self._all_mask
        if not alive or not keys:
            return result
        slots = self._slots
        for depth, mask in self._runs(keys):
            still = alive & mask
            if still != alive:
                dropped = alive ^ still if depth else 0  # at depth 0: they hold none
                while dropped:
                    low = dropped & -dropped
                    node = slots[low.bit_length() - 1]
                    assert node is not None
                    result[node] = depth
                    dropped ^= low
                alive = still
                if not alive:
                    return result
        n_keys = len(keys)
        while alive:  # survivors hold every key
            low = alive & -alive
            node = slots[low.bit_length() - 1]
            assert node is not None
            result[node] = n_keys
            alive ^= low
        return result

    def held_within(
        self, keys: Sequence[BlockKey], upto: Mapping[NodeId, int]
    ) -> dict[NodeId, int]:
        """For each node of ``upto`` holding some of ``keys[:upto[node]]``: how many of
        them. One vectorised lookup of the longest range, then a membership test per
        node: O(max(upto) + nodes x that range)."""
        asked = [
            (node, depth, state.bit)
            for node, depth in upto.items()
            if depth > 0 and (state := self._nodes.get(node)) is not None and state.count
        ]
        if not asked:
            return {}
        longest = max(depth for _, depth, _ in asked)
        ids = self._table.set_ids_in(keys, 0, longest)
        present = [i for i in np.unique(ids).tolist() if i >= _FIRST_SET]
        out: dict[NodeId, int] = {}
        for node, depth, bit in asked:
            mine = [i for i in present if self._masks[i] & bit]
            if mine and (count := int(np.isin(ids[:depth], mine).sum())):
                out[node] = count
        return out

    def best_match(self, keys: Sequence[BlockKey]) -> tuple[int, NodeId | None]:
        """``(longest prefix in blocks, its holder)``; ties -> smallest node id; ``(0, None)``."""
        alive = self._all_mask
        best_mask = 0
        depth = 0
        if alive and keys:
            for start, mask in self._runs(keys):
                still = alive & mask
                if not still:
                    depth = start
                    break
                best_mask = alive = still
            else:
                depth = len(keys)
        if not best_mask or depth == 0:
            return 0, None
        slots = self._slots
        holders: list[NodeId] = []
        while best_mask:
            low = best_mask & -best_mask
            node = slots[low.bit_length() - 1]
            assert node is not None
            holders.append(node)
            best_mask ^= low
        return depth, min(holders)

    def nodes(self) -> list[NodeId]:
        """Known nodes, sorted by id."""
        return list(self._sorted_nodes())

    @property
    def node_count(self) -> int:
        """How many nodes the index knows (O(1))."""
        return len(self._nodes)

    def other_holders(self, key: BlockKey, node: NodeId) -> int:
        """How many nodes other than ``node`` hold ``key`` (its replicas elsewhere)."""
        mask = self._masks[self._table.set_id_of(key)]
        state = self._nodes.get(node)
        if state is not None:
            mask &= ~state.bit
        return mask.bit_count()

    def replicated_keys(self, nodes: Iterable[NodeId]) -> dict[NodeId, npt.NDArray[np.uint64]]:
        """For each of ``nodes``, its keys that another node also holds, sorted: the
        replica hints a replica-aware agent evicts by (unknown nodes: none).

        One vectorised pass over the table for the keys held twice or more, then per node
        O(holder sets + those keys)."""
        masks = self._masks
        table = self._table
        twice = np.array([m & (m - 1) != 0 for m in masks], dtype=bool)  # >= 2 holders
        selected = twice[table.ids]
        keys, ids = table.keys[selected], table.ids[selected]
        out: dict[NodeId, npt.NDArray[np.uint64]] = {}
        for node in nodes:
            state = self._nodes.get(node)
            if state is None or not len(keys):
                out[node] = np.empty(0, dtype=np.uint64)
                continue
            bit = state.bit
            holds = np.array([bool(m & bit) for m in masks], dtype=bool)
            out[node] = np.sort(keys[holds[ids]])
        return out

    def node_key_count(self, node: NodeId) -> int:
        """Keys the shadow holds for ``node`` (0 when unknown)."""
        state = self._nodes.get(node)
        return 0 if state is None else state.count

    def node_keys(self, node: NodeId) -> frozenset[BlockKey]:
        """A copy of ``node``'s keys (O(table); for tests and debugging)."""
        state = self._nodes.get(node)
        if state is None or state.count == 0:
            return frozenset()
        holds = np.array([bool(m & state.bit) for m in self._masks], dtype=bool)
        table = self._table
        return frozenset(BlockKey(k) for k in table.keys[holds[table.ids]].tolist())

    def stats(self) -> IndexStats:
        return IndexStats(
            nodes=len(self._nodes),
            keys=self._table.live,
            entries=sum(state.count for state in self._nodes.values()),
        )

    def memory_bytes(self) -> int:
        """Bytes held by the key table (the interned sets and node records excluded)."""
        return self._table.nbytes()

    def _sorted_nodes(self) -> tuple[NodeId, ...]:
        cached = self._sorted
        if cached is None:
            cached = self._sorted = tuple(sorted(self._nodes))
        return cached

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` when the structure is inconsistent (O(table))."""
        table = self._table
        slots = table.live_slots()
        if len(slots) != table.live:
            raise AssertionError(f"{len(slots)} live slots, {table.live} counted")
        if int(np.count_nonzero(table.ids == _TOMB)) != table.tombs:
            raise AssertionError("deleted-slot count is wrong")
        keys = table.keys[slots]
        if len(np.unique(keys)) != len(keys):
            raise AssertionError("a key is stored twice")
        if not np.array_equal(table.find(keys), slots):
            raise AssertionError("a live key is not found from its home row")
        counts = np.bincount(table.ids, minlength=len(self._masks)).tolist()
        for set_id in range(_FIRST_SET, len(self._masks)):
            mask = self._masks[set_id]
            if counts[set_id] != self._refs[set_id]:
                raise AssertionError(
                    f"set {set_id} has {self._refs[set_id]} refs, used {counts[set_id]}"
                )
            if counts[set_id] and (not mask or self._mask_ids.get(mask) != set_id):
                raise AssertionError(f"set {set_id} is used but not interned as {mask:#x}")
            if not counts[set_id] and mask:
                raise AssertionError(f"set {set_id} is unused but still interned")
        if len(self._mask_ids) != sum(1 for m in self._masks[_FIRST_SET:] if m):
            raise AssertionError("mask -> set id map has stray entries")
        all_mask = 0
        for node, state in self._nodes.items():
            if self._slots[state.slot] != node or state.bit != 1 << state.slot:
                raise AssertionError(f"slot table broken for {node!r}")
            held = sum(c for m, c in zip(self._masks, counts, strict=False) if m & state.bit)
            if held != state.count:
                raise AssertionError(f"{node!r} counts {state.count} keys, holds {held}")
            if state.count > self._max_keys:
                raise AssertionError(f"{node!r} holds {state.count} keys, over the bound")
            all_mask |= state.bit
        for mask in self._mask_ids:
            if mask & ~all_mask:
                raise AssertionError(f"set {mask:#x} names a node that is gone")
        if all_mask != self._all_mask:
            raise AssertionError("all-nodes mask is wrong")
        used = sum(1 for node in self._slots if node is not None)
        if used != len(self._nodes) or (self._slots and self._slots[-1] is None):
            raise AssertionError("slot table has stray or trailing entries")
        free = sorted(self._free_slots)
        expected_free = [s for s, node in enumerate(self._slots) if node is None]
        if free != expected_free:
            raise AssertionError("free slot heap disagrees with the slot table")
