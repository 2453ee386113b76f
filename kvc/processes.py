"""Process helpers shared by every ``kvc`` process that starts others."""

from __future__ import annotations

import ctypes
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: this process gets SIGTERM (a graceful stop) when its parent dies, even by
    SIGKILL. Only prctl: safe between fork and exec (a ``preexec_fn``)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
