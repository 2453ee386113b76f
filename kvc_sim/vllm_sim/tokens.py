"""Output tokens of the simulated engine: deterministic ids, and stop strings.

Output ids (``OutputTokens``)
    No model runs: output token ``i`` of a request is a pure function of a key and
    ``i``. The key is the request's ``seed`` when it has one, else a digest of its
    prompt ids, so identical requests give identical outputs (as greedy decoding
    would) whatever their temperature. Ids are drawn from the vocabulary minus every
    special and end-of-sequence id: the simulated model never emits EOS, so every
    generation runs to ``max_tokens`` (or the context limit) unless a stop string
    ends it; ``ignore_eos`` is therefore always satisfied. Also left out: ids that do
    not decode to text on their own (byte pieces of a multi-byte character,
    ``incomplete_text_ids``), so every generated token streams as one chunk with text
    and a client times every token gap, as it would for a model writing words.

Stop strings (``StopStrings``)
    The output is detokenized as it grows (``kvc.tokenization.IncrementalDetokenizer``)
    and checked for each stop string; on a match the text ends before it (vLLM's
    default, ``include_stop_str_in_output=False``) and the request finishes with
    ``finish_reason="stop"``, ``stop_reason`` = the string. While streaming, the last
    ``len(longest stop) - 1`` characters are held back so a stop split across tokens is
    never sent.

Complexity
    O(1) per output id (one splitmix64 step); stop checks O(text held back x stops).
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Callable, Sequence

__all__ = ["OutputTokens", "StopStrings", "incomplete_text_ids"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def incomplete_text_ids(decode: Callable[[list[int]], str], vocab_size: int) -> frozenset[int]:
    """Ids whose text alone is empty or a partial character (U+FFFD). O(vocabulary)."""
    return frozenset(i for i in range(vocab_size) if not (text := decode([i])) or "\ufffd" in text)


class OutputTokens:
    """The ids a request generates (see the module docstring)."""

    def __init__(self, vocab_size: int, excluded: frozenset[int]) -> None:
        self._ids = [i for i in range(vocab_size) if i not in excluded]
        if not self._ids:
            raise ValueError("no ordinary token ids to generate")

    @staticmethod
    def request_key(prompt_ids: Sequence[int], seed: int | None) -> int:
        if seed is not None:
            return _splitmix64(seed & _MASK64)
        ids = array.array("i", prompt_ids)  # 4-byte signed, as the key has always read
        if sys.byteorder != "little":
            ids.byteswap()
        return int.from_bytes(hashlib.blake2b(ids.tobytes(), digest_size=8).digest(), "little")

    def token(self, key: int, position: int) -> int:
        return self._ids[_splitmix64(key ^ position) % len(self._ids)]


class StopStrings:
    """Finds the first stop string in a growing text; holds back what may start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    def push(self, text: str) -> str:
        """Add generated text; return what may be sent now (nothing after a match)."""
        if self.matched is not None:
            return ""
        pending = self._pending + text
        first: tuple[int, str] | None = None
        for stop in self._stops:
            at = pending.find(stop)
            if at >= 0 and (first is None or at < first[0]):
                first = (at, stop)
        if first is not None:
            self.matched = first[1]
            self._pending = ""
            return pending[: first[0]]
        if self._hold <= 0:
            self._pending = ""
            return pending
        cut = max(0, len(pending) - self._hold)
        self._pending = pending[cut:]
        return pending[:cut]

    def flush(self) -> str:
        """The text held back, at the end of a generation that matched nothing."""
        out, self._pending = self._pending, ""
        return out
