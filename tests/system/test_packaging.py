"""The package installs what each role needs and no more, in a clean virtual environment.

A conductor and a node agent in front of vLLM carry no torch: the core install holds the
conductor, the `[vllm]` extra adds what the vLLM engine adapter imports (pyzmq, msgpack),
and only the `[embedded]` extra brings torch. The wheel is built from a copy of the
working tree (no stale `build/`), then installed from this machine's pip indexes into a
fresh virtual environment without system site packages.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[2]
# What an agent in front of vLLM imports: its entry point, the vLLM engine adapter and
# what the `[vllm]` extra adds for the adapter's KV-event mirror (ZMQ, msgpack).
VLLM_SIDECAR = (
    "node_agent.main", "node_agent.engines.vllm", "node_agent.engines.vllm.adapter", "zmq",
    "msgpack",
)  # fmt: skip
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv*", ".tools", "build", "dist", "*.egg-info", "__pycache__", ".*_cache",
    ".hypothesis", "bench", "tests", "docs", "deploy", "*.so",
)  # fmt: skip


def _run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=600, cwd=cwd, check=False
    )


def _ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src") / "kv-conductor"
    shutil.copytree(REPO, src, ignore=_NOT_SOURCES)
    out = tmp_path_factory.mktemp("wheel")
    # The dev extra carries setuptools and wheel: building in this environment saves the
    # few seconds pip spends making an isolated build environment.
    _ok(_run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
             "-w", out, src))  # fmt: skip
    (built,) = out.glob("kv_conductor-*.whl")
    return built


def _clean_venv(root: Path) -> Path:
    """A virtual environment without system site packages, and without its own pip (this
    environment's pip installs into it: seconds saved on every run)."""
    venv.EnvBuilder(with_pip=False, system_site_packages=False, clear=True).create(root)
    return root / "bin" / "python"


def _pip_install(python: Path, *requirements: str | Path) -> None:
    # --no-compile: only the modules the checks import are byte-compiled, on import.
    _ok(_run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
             "--no-compile", *requirements))  # fmt: skip


def _imports(python: Path, *modules: str) -> subprocess.CompletedProcess[str]:
    return _run(python, "-c", "; ".join(f"import {m}" for m in modules))


def test_conductor_and_vllm_sidecar_install_and_import_without_torch(
    wheel: Path, tmp_path: Path
) -> None:
    python = _clean_venv(tmp_path / "venv")
    _pip_install(python, wheel)
    _ok(_imports(python, "conductor.app", "conductor.main", "kvc_cli.cli"))
    # The compiled block keys came with the wheel (built from the copied sources: the
    # copy leaves out any module built in place), and the installed package uses them.
    native = _run(python, "-c", "from kvc.native import AVAILABLE; print(AVAILABLE)", cwd=tmp_path)
    _ok(native)
    assert native.stdout.strip() == "True"
    for absent in ("torch", "transformers", "zmq", "msgpack"):
        assert _imports(python, absent).returncode != 0, f"core install carries {absent}"

    # An agent asked for the embedded engine without its extra says which extra it needs.
    agent = _run(
        python, "-m", "kvc_cli", "agent", "--engine", "embedded", "--port", "0",
        "--metrics-port", "0", cwd=tmp_path,
    )  # fmt: skip
    assert agent.returncode == 1, agent.stderr[-2000:]
    assert "kv-conductor[embedded]" in agent.stderr

    _pip_install(python, f"{wheel}[vllm]")
    _ok(_imports(python, *VLLM_SIDECAR))
    for absent in ("torch", "transformers"):
        assert _imports(python, absent).returncode != 0, f"the vLLM sidecar carries {absent}"
