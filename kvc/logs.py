"""Log set-up shared by every ``kvc`` process (the command line and the processes it
starts, such as the conductor's HTTP workers)."""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging"]


def setup_logging(level: str) -> None:
    """One format on stderr at ``level``; httpx's one line per request only at DEBUG."""
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if level.upper() != "DEBUG":  # one line per HTTP request (probes, bench clients): noise
        logging.getLogger("httpx").setLevel(logging.WARNING)
