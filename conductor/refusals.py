"""Refusals in the log: each with its reason and the figures behind it, rate-limited."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from conductor.core.placement import Refusal
from conductor.core.scheduler import Slo

log = logging.getLogger("conductor.dispatch")


class RefusalLog:
    """Logs each refusal with its reason and the figures behind it, at most once per
    second per reason (the rest are counted into the next line for that reason)."""

    def __init__(
        self, interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, reason: str, request_id: str, detail: str) -> None:
        now = self._clock()
        if now - self._last.get(reason, -math.inf) < self._interval_s:
            self._suppressed[reason] = self._suppressed.get(reason, 0) + 1
            return
        self._last[reason] = now
        more = self._suppressed.pop(reason, 0)
        log.warning(
            "refused %s: %s (%s)%s", request_id, reason, detail,
            f" (+{more} more for this reason since its last line)" if more else "",
        )  # fmt: skip

    def log_schedule(self, request_id: str, refusal: Refusal, slo: Slo, waited_s: float) -> None:
        """A placement refusal: the estimates it rests on, against the SLO left after waiting."""
        self.log(
            refusal.reason,
            request_id,
            f"predicted TTFT {refusal.ttft_s:.3f} s vs SLO {slo.ttft_s:.3f} s"
            + (f" less {waited_s:.3f} s waited" if waited_s >= 0.0005 else "")
            + f", TBT {refusal.tbt_s:.4f} s vs SLO {slo.tbt_s:.4f} s, failure "
            + (refusal.last_failure[1].value if refusal.last_failure else "none")
            + ("; the waiting queue is full" if refusal.queue_full else "")
            + f"; Retry-After {refusal.retry_after_s:.1f} s",
        )
