"""A vLLM OpenAI server the agent launches: command line, environment, stop.

Launch mode starts ``<vllm_python> -m vllm.entrypoints.openai.api_server`` in its own
process group on 127.0.0.1, with vLLM's caches in a private temp dir and KV events on
private ipc sockets unless configured; ``stop`` sends SIGTERM (vLLM stops its engine
core and workers), waits, and kills whatever of the group is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Final

from kvc.processes import die_with_parent, free_port
from node_agent.engines.vllm.config import VllmConfig

log = logging.getLogger("node_agent.vllm")

__all__ = ["VllmProcess"]

_STOP_WAIT_S: Final = 20.0


def _bind_form(endpoint: str) -> str:
    """What vLLM must be given to *bind* the endpoint the agent connects to."""
    if endpoint.startswith("tcp://"):
        return "tcp://*:" + endpoint.rsplit(":", 1)[1]
    return endpoint


class VllmProcess:
    """A vLLM OpenAI server the agent launched; owns its temp dir and process group."""

    def __init__(self, config: VllmConfig) -> None:
        self._config = config
        self._tmp = Path(tempfile.mkdtemp(prefix="kvc-vllm-"))
        self.port = config.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events_endpoint = config.kv_events_endpoint or f"ipc://{self._tmp}/kv-events"
        self.replay_endpoint = config.kv_events_replay_endpoint or f"ipc://{self._tmp}/kv-replay"
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    async def wait(self) -> int:
        assert self._proc is not None
        return await self._proc.wait()

    def command(self) -> list[str]:
        c = self._config
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": _bind_form(self.events_endpoint),
            "replay_endpoint": _bind_form(self.replay_endpoint),
            "topic": c.kv_events_topic,
        }
        args = [
            c.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(c.model_dir),
            "--served-model-name", c.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--block-size", str(c.block_size),
            # vLLM keeps one block back (its null block): ask for one more.
            "--num-gpu-blocks-override", str(c.capacity_blocks + 1),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-events-config", json.dumps(events),
        ]  # fmt: skip
        if not any(a.split("=")[0] == "--max-num-seqs" for a in c.launch_args):
            # vLLM batches as many as the agent admits: the agent's busy limit is the batch.
            args += ["--max-num-seqs", str(c.max_running)]
        if (c.model_dir / "kvc_init.json").is_file() and "--load-format" not in c.launch_args:
            args += ["--load-format", "dummy"]  # a random-weights model folder (tiny-llama)
        return [*args, *c.launch_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        for name, sub in (("VLLM_CACHE_ROOT", "cache"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
            env.setdefault(name, str(self._tmp / sub))
        tmp = self._tmp / "tmp"
        tmp.mkdir(exist_ok=True)
        env.setdefault("TMPDIR", str(tmp))
        for name, value in (
            ("HF_HUB_OFFLINE", "1"),
            ("VLLM_NO_USAGE_STATS", "1"),
            ("DO_NOT_TRACK", "1"),
            ("PYTHONUNBUFFERED", "1"),
        ):
            env.setdefault(name, value)
        return env

    async def start(self) -> None:
        command = self.command()
        log.info("launching vLLM: %s", " ".join(command))
        self._proc = await asyncio.create_subprocess_exec(
            *command,
            env=self.environment(),
            stdin=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped as one
            preexec_fn=die_with_parent,
        )

    async def stop(self) -> None:
        proc = self._proc
        try:
            if proc is None:
                return
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), timeout=_STOP_WAIT_S)
                except TimeoutError:
                    log.warning("vLLM ignored SIGTERM for %.0f s; killing it", _STOP_WAIT_S)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
            await self._reap_group(proc.pid)
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)

    @staticmethod
    async def _reap_group(pgid: int) -> None:
        """Give vLLM's engine core and workers a moment to exit, then kill what is left."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            await asyncio.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
