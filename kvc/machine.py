"""The machine a measurement ran on, in one line (benchmarks and replays print it)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

__all__ = ["machine"]


def machine() -> str:
    """CPU model, core count and Python version, e.g. ``AMD EPYC 7B13, 2 cores, Python 3.11.7``."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"
