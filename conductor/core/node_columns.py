"""Per-node columns kept between decisions: what a decision over a large fleet reads.

A decision over N nodes asks every node the same few things: its role and health, its
block size, its queue estimate, its cost models' floor terms, its reported decode
batch. Asked node by node in Python that is O(N) interpreted work per decision, ~1 µs
a node. This table keeps the answers as rows of one float64 array, one row per node
ever seen, and recomputes a row only when what it is computed from changed:

- the node's ``NodeState`` object (a new agent report: the live dispatcher builds a new
  state only when one of its inputs changed, the simulator one per decision);
- ``touch(node)``: the scheduler's books of that node changed (a prefill assigned,
  ended or cancelled there, a decode placed or gone), or one of its cost models
  learned (the models call back on every change).

So a decision costs O(N) NumPy work plus O(changed nodes) Python. Recomputing a row
calls the scheduler's own per-node functions (``RowSource``), so a row holds exactly
what the per-node code would compute (the policies' bounds read these columns; every
estimate that ranks still comes from the per-node code).

Lists of nodes map to rows in two ways. ``sync(fleet)`` is for the fleet list of each
decision: it is compared with a copy of the previous one in slices, in C (an unchanged
state is the same object, or an equal one), so only the positions whose state changed
are looked up. Sublists that a decision derives from it (``NodeTable.pick_role`` for the
roles, ``NodeColumns.pick`` for the decode filters) are registered and found again by
identity until the decision ends (``end``). Any other list is looked up node by node
(``columns``): correct, only slower, and registered only while a decision is made.

Memory: one row of ``WIDTH`` floats per node seen; the table starts afresh when it
holds more than twice the fleet and 64 (nodes that left).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import compress, repeat
from operator import is_not, itemgetter
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

from conductor.core.prefix_index import NodeId

if TYPE_CHECKING:
    from conductor.core.scheduler import NodeState

__all__ = ["NodeColumns", "NodeTable", "RowSource"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# Column positions in a row.
_CAN_PREFILL, _CAN_DECODE, _BLOCK_SIZE, _UNIT_BYTES, _MIGRATION, _FAMILY = range(6)
_RUNNING, _MAX_RUNNING, _ROOM_TOKENS, _QUEUE, _PLACED, _STEP = range(6, 12)
_PREFILL_TERMS = slice(12, 16)
_DECODE_TERMS = slice(16, 20)
WIDTH = 20
_NO_TERMS = (0.0, 0.0, 0.0, 0.0)


class RowSource(Protocol):
    """The scheduler's per-node estimates a row is made of (its own per-node code)."""

    def queue_s(self, node: NodeState) -> float: ...

    def prefill_terms(self, node: NodeState) -> tuple[float, float, float, float]: ...

    def decode_terms(self, node: NodeState) -> tuple[float, float, float, float]: ...

    def reported_step_s(self, node: NodeState) -> float: ...

    def placed_decodes(self, node: NodeState) -> int: ...


class NodeColumns:
    """The table's rows for one list of nodes, in its order (a snapshot: read it within
    the decision that asked for it)."""

    __slots__ = ("_positions", "_table", "data", "rows")

    def __init__(self, table: NodeTable, rows: IntArray, data: FloatArray) -> None:
        self._table = table
        self.rows = rows
        self.data = data
        self._positions: IntArray | None = None

    @property
    def can_prefill(self) -> npt.NDArray[np.bool_]:
        return self.data[:, _CAN_PREFILL] > 0

    @property
    def can_decode(self) -> npt.NDArray[np.bool_]:
        return self.data[:, _CAN_DECODE] > 0

    @property
    def block_size(self) -> FloatArray:
        return self.data[:, _BLOCK_SIZE]

    @property
    def unit_bytes(self) -> FloatArray:
        """``block_size * kv_bytes_per_token``: bytes of one block's KV."""
        return self.data[:, _UNIT_BYTES]

    @property
    def kv_migration(self) -> npt.NDArray[np.bool_]:
        return self.data[:, _MIGRATION] > 0

    @property
    def family(self) -> IntArray:
        """The node's ``kv_family`` as a small code (``NodeTable.family_code``)."""
        return self.data[:, _FAMILY].astype(np.int64)

    @property
    def running(self) -> FloatArray:
        return self.data[:, _RUNNING]

    @property
    def max_running(self) -> FloatArray:
        return self.data[:, _MAX_RUNNING]

    @property
    def room_tokens(self) -> FloatArray:
        """``room_blocks * block_size``."""
        return self.data[:, _ROOM_TOKENS]

    @property
    def queue_s(self) -> FloatArray:
        """``Scheduler.queue_s`` (prefill-capable nodes; 0 elsewhere)."""
        return self.data[:, _QUEUE]

    @property
    def placed(self) -> FloatArray:
        """Decodes this scheduler placed there (decode-capable nodes; 0 elsewhere)."""
        return self.data[:, _PLACED]

    @property
    def step_s(self) -> FloatArray:
        """The decode step at the reported batch (decode-capable nodes; 0 elsewhere)."""
        return self.data[:, _STEP]

    @property
    def prefill_terms(self) -> FloatArray:
        """The prefill models' ``floor_row``s (what ``cost_model.prefill_floors`` takes)."""
        return self.data[:, _PREFILL_TERMS]

    @property
    def decode_terms(self) -> FloatArray:
        return self.data[:, _DECODE_TERMS]

    def code(self, family: str) -> int:
        """The small integer ``family`` (a ``kv_family``) has in the ``family`` column."""
        return self._table.family_code(family)

    def position_of(self, node: NodeId) -> int:
        """``node``'s position in the list, -1 where absent."""
        row = self._table.row_of.get(node)
        if row is None:
            return -1
        positions = self._positions
        if positions is None:
            positions = self._positions = self._table.positions(self.rows)
        return int(positions[row])

    def of(self, per_node: Mapping[NodeId, int]) -> IntArray:
        """``per_node``'s value for each node of the list (0 where absent). O(entries)."""
        out = np.zeros(len(self.rows), np.int64)
        if per_node and len(self.rows):
            positions = self._positions
            if positions is None:
                positions = self._positions = self._table.positions(self.rows)
            count = len(per_node)
            rows = np.fromiter(map(self._table.row_of.get, per_node, repeat(-1)), np.int64, count)
            at = np.where(rows >= 0, positions[rows], -1)  # row -1: a node never seen
            present = at >= 0
            out[at[present]] = np.fromiter(per_node.values(), np.int64, count)[present]
        return out

    def pick(
        self, nodes: Sequence[NodeState], mask: npt.NDArray[np.bool_]
    ) -> tuple[list[NodeState], NodeColumns]:
        """The nodes of ``nodes`` (the list these columns are of) where ``mask`` holds,
        and their columns; the new list is registered for ``NodeTable.columns``."""
        at = np.flatnonzero(mask)
        picked = _items(nodes, at.tolist())
        columns = NodeColumns(self._table, self.rows.take(at), self.data.take(at, axis=0))
        self._table.register(picked, columns)
        return picked, columns


_CHUNK = 64  # states compared at once by ``_changed``


def _changed(current: list[NodeState], before: list[NodeState]) -> list[int]:
    """Positions where ``current`` has another state than ``before`` (same lengths).

    Slices are compared as lists, in C: an item identical to its twin costs a pointer
    comparison. A state equal to its twin but not the same object counts as unchanged
    (its row would be the same); only the chunks that differ are searched by identity.
    """
    out: list[int] = []
    for start in range(0, len(current), _CHUNK):
        end = start + _CHUNK
        now, then = current[start:end], before[start:end]
        if now != then:
            out.extend(compress(range(start, start + len(now)), map(is_not, now, then)))
    return out


def _items(nodes: Sequence[NodeState], at: list[int]) -> list[NodeState]:
    """``[nodes[i] for i in at]``, the loop in C."""
    if len(at) > 1:
        return list(itemgetter(*at)(nodes))
    return [nodes[i] for i in at]


class NodeTable:
    """Rows of per-node columns, recomputed only where their inputs changed."""

    def __init__(self, source: RowSource) -> None:
        self._source = source
        self._data: FloatArray = np.zeros((64, WIDTH))
        self._states: list[NodeState | None] = []
        self.row_of: dict[NodeId, int] = {}
        self._dirty: set[int] = set()
        self._families: dict[str, int] = {}
        # A copy of the previous fleet list and its rows.
        self._fleet: tuple[list[NodeState], IntArray] | None = None
        self._registered: dict[int, tuple[Sequence[NodeState], NodeColumns]] = {}
        self._replaced = 0  # rows added or given another state object so far
        self._deciding = False  # between ``begin()`` and ``end()``
        # Positions of the fleet whose state the last ``sync`` found changed (None: the
        # fleet was rebuilt or its nodes moved), and per role the last mask, list and
        # positions ``pick_role`` made.
        self._moved: list[int] | None = None
        self._roles: dict[str, tuple[npt.NDArray[np.bool_], list[NodeState], IntArray]] = {}

    def family_code(self, family: str) -> int:
        code = self._families.get(family)
        if code is None:
            code = self._families[family] = len(self._families)
        return code

    def pick_role(
        self, role: str, fleet: NodeColumns, mask: npt.NDArray[np.bool_]
    ) -> list[NodeState]:
        """``fleet.pick`` of the last ``sync``'s fleet for one role (``mask``), with the
        previous decision's list reused where the same nodes take the role: only the
        states that changed are put in (O(changed) instead of O(nodes))."""
        assert self._fleet is not None, "pick_role() before sync()"
        nodes = self._fleet[0]
        cached = self._roles.get(role)
        moved = self._moved
        if cached is not None and moved is not None and np.array_equal(cached[0], mask):
            _, picked, at = cached
            inside = [i for i in moved if mask[i]]
            if inside:
                picked = picked.copy()
                for i, j in zip(inside, np.searchsorted(at, inside).tolist(), strict=True):
                    picked[j] = nodes[i]
        else:
            at = np.flatnonzero(mask)
            picked = _items(nodes, at.tolist())
        self._roles[role] = (mask, picked, at)
        self.register(picked, NodeColumns(self, fleet.rows.take(at), fleet.data.take(at, axis=0)))
        return picked

    def touch(self, node: NodeId) -> None:
        """What ``node``'s row is computed from changed (books, cost models)."""
        row = self.row_of.get(node)
        if row is not None:
            self._dirty.add(row)

    def begin(self) -> None:
        """A decision starts: lists registered from now on are found by identity."""
        self._registered.clear()
        self._deciding = True

    def end(self) -> None:
        """The decision ended: forget its lists (outside a decision nothing is registered,
        since a caller's list may change in place)."""
        self._registered.clear()
        self._deciding = False

    def register(self, nodes: Sequence[NodeState], columns: NodeColumns) -> None:
        self._registered[id(nodes)] = (nodes, columns)

    def positions(self, rows: IntArray) -> IntArray:
        """Per row of the table: its position in ``rows``, -1 where absent."""
        out = np.full(len(self._states), -1, np.int64)
        out[rows] = np.arange(len(rows))
        return out

    # ------------------------------------------------------------------ lists to rows
    def sync(self, fleet: Sequence[NodeState]) -> NodeColumns:
        """The columns of this decision's fleet list (compared with the previous one's)."""
        current = fleet if type(fleet) is list else list(fleet)
        if len(self.row_of) > 2 * len(current) + 64:  # nodes that left: start afresh
            self._clear()
        previous = self._fleet
        self._moved = None
        if previous is not None and len(previous[0]) == len(current):
            before, rows = previous
            changed = _changed(current, before)
            self._moved = changed
            if changed:
                rows = rows.copy()
                for i in changed:
                    rows[i] = row = self._row(current[i])
                    if row != previous[1][i]:  # another node at this position
                        self._moved = None
        else:
            rows = self._rows(current)
        self._fleet = (list(current), rows)
        columns = self._gather(rows)
        self.register(fleet, columns)
        return columns

    def columns(self, nodes: Sequence[NodeState]) -> NodeColumns:
        """The columns of ``nodes``: registered in this decision, else looked up (and
        registered for the rest of the decision, if one is being made)."""
        registered = self._registered.get(id(nodes))
        if registered is not None and registered[0] is nodes:
            return registered[1]
        replaced = self._replaced
        rows = self._rows(nodes)
        if self._replaced != replaced:  # rows now hold states the fleet list may not
            self._fleet = None
        columns = self._gather(rows)
        if self._deciding:  # the stages ask again for the same list within a decision
            self.register(nodes, columns)
        return columns

    def _rows(self, nodes: Sequence[NodeState]) -> IntArray:
        return np.fromiter(map(self._row, nodes), np.int64, len(nodes))

    def _row(self, state: NodeState) -> int:
        """The row of ``state``'s node (its state replaced and marked stale if new)."""
        row = self.row_of.get(state.node_id)
        if row is None:
            row = self.row_of[state.node_id] = len(self._states)
            self._states.append(state)
            if row >= len(self._data):
                self._data = np.concatenate([self._data, np.zeros_like(self._data)])
            self._dirty.add(row)
            self._replaced += 1
        elif self._states[row] is not state:
            self._states[row] = state
            self._dirty.add(row)
            self._replaced += 1
        return row

    def _gather(self, rows: IntArray) -> NodeColumns:
        if self._dirty:
            self._refresh()
        return NodeColumns(self, rows, self._data.take(rows, axis=0))

    def _refresh(self) -> None:
        source, states = self._source, self._states
        rows = list(self._dirty)
        self._dirty.clear()
        table = []
        for row in rows:
            state = states[row]
            assert state is not None
            prefill, decode = state.can_prefill, state.can_decode
            block_size = state.block_size
            # The estimates only of the roles the node can take (the per-node code asks
            # nothing else of it, and asking creates its models).
            table.append((
                prefill, decode, block_size, block_size * state.kv_bytes_per_token,
                state.kv_migration, self.family_code(state.kv_family), state.running_requests,
                state.max_running_requests, state.room_blocks * block_size,
                source.queue_s(state) if prefill else 0.0,
                source.placed_decodes(state) if decode else 0,
                source.reported_step_s(state) if decode else 0.0,
                *(source.prefill_terms(state) if prefill else _NO_TERMS),
                *(source.decode_terms(state) if decode else _NO_TERMS),
            ))  # fmt: skip
        self._data[rows] = table

    def _clear(self) -> None:
        self._roles.clear()
        self._states.clear()
        self.row_of.clear()
        self._dirty.clear()
        self._fleet = None
        self._registered.clear()
