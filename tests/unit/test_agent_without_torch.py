"""The agent runs without the ``embedded`` extra: torch and transformers are imported
only when the embedded engine is chosen. Checked in a fresh interpreter in which any
import of them fails, as it does where they are not installed."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCKER = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, Block())
"""

MODULES = ("node_agent.main", "node_agent.server", "node_agent.engines.vllm.adapter")


@pytest.mark.parametrize("module", MODULES)
def test_imports_without_torch_and_transformers(module: str) -> None:
    code = (
        BLOCKER
        + f"import {module}\n"
        + "roots = {m.split('.')[0] for m in sys.modules}\n"
        + "leaked = sorted(roots & {'torch', 'transformers'})\n"
        + "assert not leaked, leaked\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_the_blocker_blocks() -> None:
    code = BLOCKER + "import node_agent.engines.embedded.model\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "blocked" in result.stderr
