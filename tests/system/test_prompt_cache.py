"""System tier: prompt-cache breakpoints hold across a cache flood, through both SDKs.

Real processes on loopback, started as an operator would (``python -m kvc_cli``): a
prefill and a decode agent on the embedded engine with a small pool, and a conductor.
Each SDK runs a two-turn conversation whose system prompt carries a 1-hour
``cache_control`` breakpoint, next to a control conversation without one; between the
turns unrelated traffic pushes several times the pool's capacity through the prefill
node. The second turn still reads the breakpoint's tokens from the cache; the control
does not (so the flood really evicts).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import anthropic
import httpx
import openai
import pytest

from tests.system.test_processes import System, stop, wait_ready

pytestmark = pytest.mark.system

MODEL = "tiny-llama"
BLOCK = 32  # the agents' default block size
CAPACITY_BLOCKS = 96  # the prefill pool: 3,072 tokens, at most half of it retained
MIN_TOKENS = 128  # the conductor's --prompt-cache-min-tokens here (Anthropic: 1,024)
ADMIN_KEY = "adm-prompt-cache-test"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[System]:
    f = System(
        tmp_path_factory.mktemp("prompt-cache"),
        prefill_args=["--capacity-blocks", str(CAPACITY_BLOCKS)],
        conductor_args=["--prompt-cache-min-tokens", str(MIN_TOKENS), "--admin-keys", ADMIN_KEY],
    )
    try:
        wait_ready(f.base, f.procs, f.logs)
        yield f
    finally:
        stop(f.procs)


def system_prompt(topic: str) -> str:
    """About 330 tokens (10 blocks) of instructions, different per topic."""
    return " ".join(f"Rule {i} for {topic}: answer briefly and stay on {topic}." for i in range(14))


def flood(base: str, rounds: int = 10) -> None:
    """Unrelated prompts of about 20 blocks each through the prefill node: twice its
    pool."""
    for i in range(rounds):
        words = " ".join(f"unrelated{i}x{j}" for j in range(80))
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": words}],
                  "max_tokens": 1},
            timeout=120,
        )  # fmt: skip
        assert r.status_code == 200, r.text


def test_openai_sdk_breakpoint_survives_a_flood(fleet: System) -> None:
    client = openai.OpenAI(base_url=f"{fleet.base}/v1", api_key="unused", max_retries=0)

    def turn(topic: str, history: list[dict[str, Any]], breakpoint_: bool) -> Any:
        system: dict[str, Any] = {"type": "text", "text": system_prompt(topic)}
        if breakpoint_:
            system["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
        messages = [{"role": "system", "content": [system]}, *history]
        return client.chat.completions.create(
            model=MODEL, messages=cast(Any, messages), max_tokens=4, temperature=0
        )

    kept_history = [{"role": "user", "content": "What is rule 3?"}]
    control_history = [{"role": "user", "content": "What is rule 3?"}]
    first = turn("lighthouses", kept_history, True)
    control = turn("harbours", control_history, False)
    usage = first.usage
    assert usage is not None
    prompt_cache = (usage.model_extra or {}).get("prompt_cache")
    assert prompt_cache is not None
    assert prompt_cache["retention"] == "granted", usage
    written = prompt_cache["cache_write_tokens"]
    assert written >= 300, usage  # the system prompt, up to its breakpoint
    assert control.usage is not None
    assert "prompt_cache" not in (control.usage.model_extra or {})

    flood(fleet.base)

    for history, reply in ((kept_history, first), (control_history, control)):
        history += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": "And rule 4?"},
        ]
    second = turn("lighthouses", kept_history, True)
    control_second = turn("harbours", control_history, False)
    assert second.usage is not None
    assert control_second.usage is not None
    read = second.usage.prompt_tokens_details
    assert read is not None
    assert (read.cached_tokens or 0) >= written // BLOCK * BLOCK, second.usage
    control_read = control_second.usage.prompt_tokens_details
    assert control_read is not None
    assert (control_read.cached_tokens or 0) < BLOCK * 8, (
        "the flood did not evict the control conversation: the test proves nothing"
    )


def test_anthropic_sdk_breakpoint_survives_a_flood(fleet: System) -> None:
    client = anthropic.Anthropic(base_url=fleet.base, api_key="unused", max_retries=0)

    def turn(topic: str, history: list[dict[str, Any]], breakpoint_: bool) -> Any:
        system: dict[str, Any] = {"type": "text", "text": system_prompt(topic)}
        if breakpoint_:
            system["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
        return client.messages.create(
            model=MODEL, max_tokens=4, system=cast(Any, [system]), messages=cast(Any, history)
        )

    kept = [{"role": "user", "content": "Which rule comes first?"}]
    control = [{"role": "user", "content": "Which rule comes first?"}]
    first = turn("semaphores", kept, True)
    control_first = turn("buoys", control, False)
    assert first.usage.cache_creation_input_tokens >= 300, first.usage
    assert first.usage.cache_creation is not None
    assert first.usage.cache_creation.ephemeral_1h_input_tokens == (
        first.usage.cache_creation_input_tokens
    )
    assert (control_first.usage.cache_creation_input_tokens or 0) == 0

    flood(fleet.base)

    for history, reply in ((kept, first), (control, control_first)):
        text = "".join(b.text for b in reply.content if b.type == "text") or "ok"
        history += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "And the last one?"}]  # fmt: skip
    second = turn("semaphores", kept, True)
    control_second = turn("buoys", control, False)
    wanted = first.usage.cache_creation_input_tokens // BLOCK * BLOCK
    assert (second.usage.cache_read_input_tokens or 0) >= wanted, second.usage
    assert (control_second.usage.cache_read_input_tokens or 0) < BLOCK * 8, (
        "the flood did not evict the control conversation: the test proves nothing"
    )
    # Operators see the tenant's books.
    books = httpx.get(
        f"{fleet.base}/admin/prompt-cache",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=10,
    ).json()
    assert books["tenants"]["default"]["written_tokens"] > 0
    assert books["tenants"]["default"]["read_tokens"] > 0
