"""System tier: real processes on loopback — conductor, prefill agent, decode agent.

The official ``openai`` client talks to the conductor; every process is started
with ``python -m kvc_cli.cli`` exactly as an operator would, and stopped with SIGTERM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import openai
import pytest

from kvc.processes import free_port

pytestmark = pytest.mark.system

MODEL = "tiny-llama"
STARTUP_S = 120.0


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "kvc_cli", *args], stdout=out, stderr=subprocess.STDOUT
        )


def wait_ready(base: str, procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                raise AssertionError(f"{proc.args!r} exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise AssertionError("system did not become ready:\n" + logs[-1].read_text()[-3000:])


def stop(procs: list[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> list[int]:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{proc.args!r} ignored SIGTERM") from None
    return codes


class System:
    """A prefill agent, a decode agent and a conductor, each with extra flags if given."""

    def __init__(
        self,
        tmp: Path,
        drain_delay_s: float = 0.0,
        *,
        prefill_args: Sequence[str] = (),
        conductor_args: Sequence[str] = (),
    ) -> None:
        self.http_port, self.prefill_port, self.decode_port = free_port(), free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.logs = [tmp / "prefill.log", tmp / "decode.log", tmp / "conductor.log"]
        agent = ["agent", "--host", "127.0.0.1", "--threads", "1"]
        prefill = [*agent, *prefill_args, "--role", "prefill", "--port", str(self.prefill_port)]
        self.procs = [
            spawn(prefill, self.logs[0]),
            spawn([*agent, "--role", "decode", "--port", str(self.decode_port)], self.logs[1]),
            spawn(
                [
                    "conductor",
                    "--port",
                    str(self.http_port),
                    "--agents",
                    f"127.0.0.1:{self.prefill_port},127.0.0.1:{self.decode_port}",
                    "--drain-delay-s",
                    str(drain_delay_s),
                    *conductor_args,
                ],
                self.logs[2],
            ),
        ]


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    sysm = System(tmp_path_factory.mktemp("system"))
    try:
        wait_ready(sysm.base, sysm.procs, sysm.logs)
        yield sysm
    finally:
        stop(sysm.procs)


def test_openai_client_streams_a_chat_completion(system: System) -> None:
    client = openai.OpenAI(base_url=f"{system.base}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a short poem about the sea."},
        ],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    pieces: list[str] = []
    usage = None
    finish = None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(pieces), "no text streamed"
    assert finish == "length"
    assert usage is not None
    assert usage.completion_tokens == 16
    # The same request, not streamed, gives the same greedy text (and reuses the prefix).
    again = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a short poem about the sea."},
        ],
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert again.choices[0].message.content == "".join(pieces)


def test_openai_client_sees_proper_errors(system: System) -> None:
    client = openai.OpenAI(base_url=f"{system.base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=5
        )
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1_000_000
        )
    assert too_long.value.code == "context_length_exceeded"


def test_sigterm_leaves_no_process_behind(tmp_path: Path) -> None:
    sysm = System(tmp_path)
    try:
        wait_ready(sysm.base, sysm.procs, sysm.logs)
        r = httpx.post(
            f"{sysm.base}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200
    finally:
        codes = stop(sysm.procs)
    assert codes == [0, 0, 0], [log.read_text()[-2000:] for log in sysm.logs]
    for port in (sysm.http_port, sysm.prefill_port, sysm.decode_port):
        assert not port_open(port)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for child pids")
def test_kvc_demo_serves_and_stops_everything(tmp_path: Path) -> None:
    ports = [free_port(), free_port(), free_port(), free_port(), free_port()]
    log = tmp_path / "demo.log"
    with log.open("wb") as out:
        demo = subprocess.Popen(
            [
                sys.executable, "-m", "kvc_cli", "demo",
                "--port", str(ports[0]), "--prefill-port", str(ports[1]),
                "--decode-port", str(ports[2]), "--prefill-metrics-port", str(ports[3]),
                "--decode-metrics-port", str(ports[4]),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{ports[0]}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while "kv-conductor is ready" not in log.read_text():
            assert demo.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.25)
        text = log.read_text()
        assert f"{base}/v1" in text
        assert "curl" in text
        children = _children(demo.pid)
        assert len(children) == 3
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=8
        )
        assert reply.choices[0].message.content is not None
        # Regression: the first (cold, slow) short request taught the conductor a prefill
        # estimate that refused every long prompt afterwards with 429 on an idle cluster.
        system = "You are the assistant of the Xylophone Club and answer briefly. " * 150
        long_reply = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
            max_tokens=8,
        )
        assert long_reply.usage is not None
        assert 3_000 <= long_reply.usage.prompt_tokens <= 4_000
        short = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8
        )
        assert short.choices[0].message.content is not None
        # The agents' own metrics agree: three prefills, each committed, none aborted.
        assert f"prefill agent metrics: http://127.0.0.1:{ports[3]}/metrics" in text
        prefill = httpx.get(f"http://127.0.0.1:{ports[3]}/metrics", timeout=5).text
        assert "node_agent_prefill_duration_seconds_count 3.0" in prefill
        assert 'node_agent_tx_total{op="abort",outcome="ok"} 0.0' in prefill
        allocs = re.search(r'node_agent_tx_total\{op="allocate",outcome="ok"\} (\S+)', prefill)
        commits = re.search(r'node_agent_tx_total\{op="commit",outcome="ok"\} (\S+)', prefill)
        assert allocs is not None
        assert commits is not None
        assert float(allocs[1]) == float(commits[1]) >= 1
        decode = httpx.get(f"http://127.0.0.1:{ports[4]}/metrics", timeout=5).text
        generated = sum(
            r.usage.completion_tokens for r in (reply, long_reply, short) if r.usage is not None
        )
        assert f"node_agent_generated_tokens_total {float(generated)}" in decode
    finally:
        demo.send_signal(signal.SIGTERM)
        code = demo.wait(timeout=60)
    assert code == 0, log.read_text()[-3000:]
    assert not any(_alive(pid) for pid in children)
    assert not any(port_open(p) for p in ports)


def test_rolling_update_old_and_new_conductor_side_by_side(tmp_path: Path) -> None:
    """SIGTERM to the old conductor mid-stream: it turns not-ready at once, finishes the
    stream it is serving, and exits 0, while a new conductor on the same agents serves."""
    import threading

    sysm = System(tmp_path, drain_delay_s=3.0)
    new_port = free_port()
    new_log = tmp_path / "conductor-new.log"
    try:
        wait_ready(sysm.base, sysm.procs, sysm.logs)
        agents = f"127.0.0.1:{sysm.prefill_port},127.0.0.1:{sysm.decode_port}"
        new = spawn(
            ["conductor", "--port", str(new_port), "--agents", agents, "--drain-delay-s", "0"],
            new_log,
        )
        sysm.procs.append(new)
        sysm.logs.append(new_log)
        new_base = f"http://127.0.0.1:{new_port}"
        wait_ready(new_base, sysm.procs, sysm.logs)

        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 1200, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        first_chunk = threading.Event()
        result: dict[str, object] = {}

        def stream_from_old() -> None:
            with httpx.stream(
                "POST", f"{sysm.base}/v1/chat/completions", json=body, timeout=120
            ) as resp:
                lines = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        first_chunk.set()
                result["lines"] = lines

        reader = threading.Thread(target=stream_from_old)
        reader.start()
        assert first_chunk.wait(60)
        old = sysm.procs[2]
        old.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 2.0  # well inside the 3 s drain delay
        while httpx.get(f"{sysm.base}/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "the draining conductor still reports ready"
            time.sleep(0.05)
        for _ in range(3):  # the new conductor serves throughout the rollout
            r = httpx.post(
                f"{new_base}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4},
                timeout=60,
            )  # fmt: skip
            assert r.status_code == 200
        reader.join(120)
        lines = result["lines"]
        assert isinstance(lines, list)
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2][len("data: ") :])["usage"]
        assert usage["completion_tokens"] == 1200  # the in-flight stream was not cut
        assert old.wait(timeout=60) == 0
    finally:
        stop(sysm.procs)
