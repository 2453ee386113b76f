"""conductor/core must stay pure: importable with every I/O framework blocked."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import conductor.core

BLOCKED = ("asyncio", "fastapi", "grpc", "redis", "prometheus_client", "httpx", "torch", "uvicorn")


def test_core_imports_with_io_frameworks_blocked() -> None:
    modules = [m.name for m in pkgutil.walk_packages(conductor.core.__path__, "conductor.core.")]
    assert modules, "no core modules found"
    script = "\n".join(
        [
            "import sys",
            *(f"sys.modules[{name!r}] = None" for name in BLOCKED),
            *(f"import {module}" for module in modules),
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
