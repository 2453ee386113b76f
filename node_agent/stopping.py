"""Stop-sequence handling for streamed text (engine independent, pure).

A generation stops when its text contains one of up to four stop strings; the
stop string itself is not returned (OpenAI semantics). While streaming, text that
could still turn out to be the start of a stop string is held back, so a client
never sees part of a stop string. Cost per push: O(len(delta) + Σ len(stop)).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopCheck:
    """What to emit for one pushed delta, and whether a stop string matched."""

    emit: str
    stopped: bool
    matched: str = ""  # the stop string that matched (when ``stopped``)


class StopStringMatcher:
    """Feeds text deltas; emits the part that can no longer start a stop string."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(s for s in stop if s)
        self._pending = ""
        self._longest = max((len(s) for s in self._stop), default=0)

    def push(self, delta: str) -> StopCheck:
        if not self._stop:
            return StopCheck(emit=delta, stopped=False)
        text = self._pending + delta
        # The first stop string to be completed wins, as when the text arrives a
        # character at a time (an engine stops as soon as one appears), so the answer
        # does not depend on how the text was cut into deltas: a shorter string that
        # completes first beats a longer one that began earlier. Two completing at the
        # same character: the one that began earlier (then the first listed).
        found = [(i + len(s), i, n) for n, s in enumerate(self._stop) if (i := text.find(s)) >= 0]
        if found:
            _, cut, which = min(found)
            self._pending = ""
            return StopCheck(emit=text[:cut], stopped=True, matched=self._stop[which])
        hold = self._held_suffix_len(text)
        self._pending = text[len(text) - hold :] if hold else ""
        return StopCheck(emit=text[: len(text) - hold], stopped=False)

    def flush(self) -> str:
        """Text held back when the generation ends for another reason."""
        rest, self._pending = self._pending, ""
        return rest

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        for n in range(min(self._longest - 1, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stop):
                return n
        return 0
