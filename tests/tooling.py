"""External tools some tests need (promtool, prometheus, checkov): found or a clear failure.

These tests do not skip when a tool is missing: a skipped check looks like a passed
one in CI. The failure names the make target that installs the tool.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS_DIR = ROOT / ".tools"

_HINTS = {
    "promtool": "make system-deps (Debian package prometheus)",
    "prometheus": "make system-deps (Debian package prometheus)",
    "checkov": "make tools (checkov in its own virtual environment under .tools/)",
}


def require_tool(name: str) -> str:
    """Path of executable ``name`` (PATH, then ``.tools/*/bin``), or fail the test."""
    found = shutil.which(name)
    if found is None:
        candidates = sorted(TOOLS_DIR.glob(f"*/bin/{name}"))
        found = str(candidates[0]) if candidates else None
    if found is None:
        pytest.fail(f"{name} is not installed: run `{_HINTS.get(name, 'make system-deps')}`")
    return found


def run_tool(
    args: list[str],
    *,
    input_text: str | None = None,
    timeout_s: float = 120.0,
    cwd: Path | None = None,
) -> str:
    """Run a tool; fail the test with its output unless it exits 0. Returns stdout + stderr."""
    proc = subprocess.run(
        args,
        input=input_text,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=cwd,
    )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {proc.returncode}:\n{output[-6000:]}")
    return output
