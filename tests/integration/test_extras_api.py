"""vLLM-compatible extras on the conductor: /tokenize, /detokenize, /version."""

from __future__ import annotations

from kvc.version import package_version
from tests.conftest import MODEL, AgentFactory, ConductorFactory, chat_body


async def test_tokenize_counts_what_a_chat_completion_is_charged(
    start_agent: AgentFactory, conductor: ConductorFactory
) -> None:
    agent = await start_agent("both")
    async with conductor([agent]) as c:
        tok = c.state.tokenizer
        body = chat_body("How many tokens is this?", max_tokens=2)
        counted = await c.client.post(
            "/tokenize", json={"model": MODEL, "messages": body["messages"]}
        )
        assert counted.status_code == 200, counted.text
        data = counted.json()
        assert set(data) == {"count", "max_model_len", "tokens", "token_strs"}
        answered = await c.client.post("/v1/chat/completions", json=body)
        assert data["count"] == answered.json()["usage"]["prompt_tokens"] == len(data["tokens"])
        assert data["max_model_len"] == agent.service.node_info.max_model_len
        assert data["token_strs"] is None

        text = "Once upon a time"
        plain = (await c.client.post("/tokenize", json={"prompt": text})).json()
        assert plain["tokens"] == tok.encode(text, add_special_tokens=True)
        bare = (
            await c.client.post(
                "/tokenize",
                json={"prompt": text, "add_special_tokens": False, "return_token_strs": True},
            )
        ).json()
        assert bare["tokens"] == tok.encode(text)
        assert bare["token_strs"] == [tok.id_to_token(t) for t in bare["tokens"]]

        back = await c.client.post("/detokenize", json={"model": MODEL, "tokens": bare["tokens"]})
        assert back.status_code == 200, back.text
        assert back.json() == {"prompt": tok.decode(bare["tokens"])}


async def test_tokenize_and_detokenize_refuse_bad_input(conductor: ConductorFactory) -> None:
    async with conductor([]) as c:
        cases = [
            ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
            ("/tokenize", {}, 400),
            ("/tokenize", {"prompt": "x", "model": "gpt-9"}, 404),
            ("/tokenize", {"messages": []}, 400),
            ("/detokenize", {"tokens": [10**9]}, 400),
            ("/detokenize", {"tokens": [-1]}, 400),
            ("/detokenize", {"tokens": [1], "model": "gpt-9"}, 404),
        ]
        for path, payload, status in cases:
            r = await c.client.post(path, json=payload)
            assert r.status_code == status, (path, payload, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        # No agent reports the model yet: the context length is unknown, not made up.
        r = await c.client.post("/tokenize", json={"prompt": "x"})
        assert r.json()["max_model_len"] is None
        version = await c.client.get("/version")
        assert version.json() == {"version": package_version()}


async def test_extras_sit_behind_the_api_keys(conductor: ConductorFactory) -> None:
    async with conductor([], api_keys=["sk-1"]) as c:
        r = await c.client.post("/tokenize", json={"prompt": "x"})
        assert r.status_code == 401
        r = await c.client.post("/detokenize", json={"tokens": [1]})
        assert r.status_code == 401
        r = await c.client.post(
            "/tokenize", json={"prompt": "x"}, headers={"Authorization": "Bearer sk-1"}
        )
        assert r.status_code == 200, r.text
