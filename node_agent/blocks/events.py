"""Per-node sequenced event log with a bounded replay buffer (the WatchEvents source).

Algorithm
    ``append`` gives each event the next sequence number (1, 2, 3, ... within one
    ``epoch``, a value new on every agent start) and stores it in a fixed-size ring of
    ``max_buffered`` slots, overwriting the oldest. ``since(from_seq)`` replays the events
    with ``seq >= from_seq`` still in the ring:

    * ``from_seq == last_seq + 1`` -> ``[]`` (caught up; the server waits for more);
    * ``from_seq`` older than the oldest buffered event -> ``None``: the gap is lost and
      the caller must resync from a Snapshot taken together with ``last_seq``;
    * ``from_seq > last_seq + 1`` -> ``None`` too: the caller's state is from a future it
      cannot have seen in this epoch (typically another epoch of this node).

    Events are opaque here (block stored/removed/cleared, load updates): the log is
    generic in the event type.

Knobs
    ``epoch`` (string, carried for the consumer's epoch check), ``max_buffered`` (ring
    size, > 0). Memory is O(max_buffered) whatever the append rate.

Complexity
    ``append`` O(1); ``since`` O(k) for k returned events.

Invariants
    Sequence numbers are strictly increasing by exactly 1, never reused within an epoch;
    the buffer holds the contiguous range ``[first_buffered_seq, last_seq]``.
    Pure and single-threaded: the gRPC server wraps it with its own condition variable.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["EventLog"]

E = TypeVar("E")


class EventLog(Generic[E]):
    """Strictly increasing per-node sequence numbers over a bounded ring buffer."""

    def __init__(self, epoch: str, max_buffered: int) -> None:
        if isinstance(max_buffered, bool) or max_buffered <= 0:
            raise ValueError(f"max_buffered must be > 0, got {max_buffered!r}")
        self.epoch = epoch
        self.max_buffered = max_buffered
        self._ring: list[tuple[int, E] | None] = [None] * max_buffered
        self._last_seq = 0

    @property
    def last_seq(self) -> int:
        """Sequence number of the newest event; 0 before the first append."""
        return self._last_seq

    @property
    def first_buffered_seq(self) -> int:
        """Oldest sequence number still replayable (``last_seq + 1`` when empty)."""
        return max(1, self._last_seq - self.max_buffered + 1)

    def append(self, event: E) -> int:
        """Store ``event`` under the next sequence number and return that number."""
        self._last_seq += 1
        self._ring[self._last_seq % self.max_buffered] = (self._last_seq, event)
        return self._last_seq

    def since(self, from_seq: int, max_events: int | None = None) -> list[tuple[int, E]] | None:
        """Events with ``seq >= from_seq`` (at most ``max_events``), or ``None`` to resync.

        ``from_seq < 1`` reads as 1 (the wire's default 0 means "from the beginning").
        """
        if from_seq > self._last_seq + 1:
            return None
        start = max(from_seq, 1)
        if start < self.first_buffered_seq:
            return None
        stop = self._last_seq
        if max_events is not None:
            if max_events <= 0:
                raise ValueError(f"max_events must be > 0, got {max_events}")
            stop = min(stop, start + max_events - 1)
        out: list[tuple[int, E]] = []
        ring, size = self._ring, self.max_buffered
        for seq in range(start, stop + 1):
            item = ring[seq % size]
            assert item is not None, "ring out of step with last_seq"
            assert item[0] == seq, "ring out of step with last_seq"
            out.append(item)
        return out

    def __len__(self) -> int:
        """Number of events currently buffered."""
        return self._last_seq - self.first_buffered_seq + 1
