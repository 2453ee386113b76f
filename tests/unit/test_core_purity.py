"""The pure packages import with every forbidden module blocked, at run time.

``lint-imports`` checks the contract in ``pyproject.toml`` ("The scheduling core and the
block table are pure") on our own source: it does not follow imports made inside the
standard library or third-party packages (``logging.handlers`` imports ``socket``,
``unittest.mock`` imports ``asyncio``), nor imports made at run time. This test imports
every module of the contract's source packages in a fresh interpreter with the contract's
forbidden modules blocked, so those paths fail too. The lists come from the contract
itself: one place says what is pure and what it may not use.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"
CONTRACT_NAME = "The scheduling core and the block table are pure: no I/O frameworks"


def _contract() -> tuple[list[str], list[str]]:
    config = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    for contract in config["contracts"]:
        if contract["name"] == CONTRACT_NAME:
            return list(contract["source_modules"]), list(contract["forbidden_modules"])
    raise AssertionError(f"no import-linter contract named {CONTRACT_NAME!r}")


def test_pure_packages_import_with_forbidden_modules_blocked() -> None:
    sources, forbidden = _contract()
    modules = []
    for source in sources:
        package = importlib.import_module(source)
        modules += [
            source,
            *(m.name for m in pkgutil.walk_packages(package.__path__, f"{source}.")),
        ]
    assert len(modules) > len(sources), "no modules found in the pure packages"
    script = "\n".join(
        [
            "import sys",
            *(f"sys.modules[{name!r}] = None" for name in forbidden),
            *(f"import {module}" for module in modules),
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
