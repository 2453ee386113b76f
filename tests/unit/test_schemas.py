"""OpenAI wire schemas: permissive requests, exact responses."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import Field, TypeAdapter, ValidationError

from conductor.api.schemas import (
    SSE_DONE,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceDelta,
    ChunkChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionChunkChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    ContentChunks,
    ContentPart,
    ErrorDetail,
    ErrorResponse,
    ModelCard,
    ModelList,
    Usage,
    chunk_json,
    new_chat_completion_id,
    new_completion_id,
    sse_data,
)

USER = {"role": "user", "content": "hi"}


def chat(**fields: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "m", "messages": [USER]}
    body.update(fields)
    return ChatCompletionRequest.model_validate(body)


def chat_error(**fields: Any) -> list[Any]:
    with pytest.raises(ValidationError) as info:
        chat(**fields)
    return [e["loc"] for e in info.value.errors()]


# -- requests: permissive in -----------------------------------------------------------


def test_minimal_chat_request_defaults() -> None:
    req = chat()
    assert req.n == 1
    assert req.stream is False
    assert req.stream_options is None
    assert req.temperature is None
    assert req.stop_sequences == []
    assert req.include_usage is False
    assert req.unknown_fields() == set()


def test_unknown_fields_are_accepted_and_reported() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi", "reasoning_content": "x"}],
            "store": True,
            "metadata": {"a": "b"},
            "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False},
        }
    )
    assert req.unknown_fields() == {
        "store",
        "metadata",
        "messages[0].reasoning_content",
        "stream_options.include_obfuscation",
    }
    assert req.model_extra == {"store": True, "metadata": {"a": "b"}}


def test_permissive_fields_take_anything() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = chat(
        tools=tools,
        tool_choice="auto",
        response_format={"type": "json_object"},
        parallel_tool_calls=False,
    )
    assert req.tools == tools
    assert req.unknown_fields() == set()


def test_explicit_nulls_mean_defaults() -> None:
    req = chat(n=None, stream=None, temperature=None, stop=None)
    assert req.n == 1
    assert req.stream is False


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0.0),
        ("temperature", 2.0),
        ("top_p", 1.0),
        ("top_p", 1e-6),
        ("frequency_penalty", -2.0),
        ("presence_penalty", 2.0),
        ("max_tokens", 1),
        ("max_completion_tokens", 1),
        ("n", 3),
        ("seed", -5),
        ("logit_bias", {"50256": -100}),
    ],
)
def test_values_in_range_accepted(field: str, value: Any) -> None:
    assert getattr(chat(**{field: value}), field) == value


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", 2.01),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("frequency_penalty", -2.5),
        ("presence_penalty", 2.5),
        ("top_logprobs", 21),
        ("top_logprobs", -1),
        ("max_tokens", 0),
        ("max_completion_tokens", 0),
        ("n", 0),
        ("model", 5),
    ],
)
def test_values_out_of_range_rejected(field: str, value: Any) -> None:
    locs = chat_error(**{field: value}, logprobs=True)
    assert locs[0][0] == field


def test_messages_required_and_non_empty() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m"})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})


def test_message_roles() -> None:
    for role in ("system", "developer", "user", "assistant", "tool"):
        assert chat(messages=[{"role": role, "content": "x"}]).messages[0].role == role
    assert chat_error(messages=[{"role": "wizard", "content": "x"}])[0][:3] == (
        "messages",
        0,
        "role",
    )


def test_content_parts_are_permissive() -> None:
    msg = ChatMessage.model_validate(
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look:"},
                {"type": "image_url", "image_url": {"url": "data:..."}},
                {"type": "text", "text": "what?"},
            ],
        }
    )
    assert isinstance(msg.content, list)
    part = msg.content[1]
    assert isinstance(part, ContentPart)
    assert part.model_extra == {"image_url": {"url": "data:..."}}


def test_assistant_message_with_tool_calls_and_null_content() -> None:
    req = chat(
        messages=[
            USER,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c1", "type": "function", "function": {}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]
    )
    assert req.messages[1].content is None
    assert req.messages[2].tool_call_id == "c1"


def test_max_new_tokens_prefers_max_completion_tokens() -> None:
    assert chat().max_new_tokens(256) == 256
    assert chat(max_tokens=10).max_new_tokens(256) == 10
    assert chat(max_completion_tokens=20).max_new_tokens(256) == 20
    assert chat(max_tokens=10, max_completion_tokens=20).max_new_tokens(256) == 20


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        (None, []),
        ("END", ["END"]),
        ("", []),
        (["a", "b"], ["a", "b"]),
        (["a", "", "a", "b"], ["a", "b"]),
        ([], []),
    ],
)
def test_stop_normalised_to_list(stop: Any, expected: list[str]) -> None:
    assert chat(stop=stop).stop_sequences == expected


def test_at_most_four_stop_sequences() -> None:
    assert chat(stop=["1", "2", "3", "4"]).stop_sequences == ["1", "2", "3", "4"]
    assert chat_error(stop=["1", "2", "3", "4", "5"])[0][0] == "stop"
    assert chat_error(stop=7)[0][0] == "stop"


def test_stream_options_require_stream() -> None:
    assert chat_error(stream_options={"include_usage": True}) == [("stream_options",)]
    assert chat_error(stream=False, stream_options={"include_usage": False}) == [
        ("stream_options",)
    ]
    # null stream_options is fine either way
    assert chat(stream_options=None).stream_options is None


def test_include_usage() -> None:
    assert chat(stream=True).include_usage is False
    assert chat(stream=True, stream_options={}).include_usage is False
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage is True


def test_top_logprobs_requires_logprobs() -> None:
    assert chat_error(top_logprobs=2) == [("top_logprobs",)]
    assert chat(logprobs=True, top_logprobs=20).top_logprobs == 20


def test_completion_request_defaults_and_prompt_forms() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": "Say hi"})
    assert req.max_tokens == 16
    assert req.echo is False
    assert req.max_new_tokens(99) == 16
    assert req.single_prompt() == "Say hi"
    nulled = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "max_tokens": None, "echo": None}
    )
    assert nulled.max_new_tokens(99) == 99
    assert nulled.echo is False


@pytest.mark.parametrize(
    ("prompt", "single"),
    [
        ("", ""),
        (["one"], "one"),
        (["one", "two"], None),
        ([1, 2, 3], [1, 2, 3]),
        ([7], [7]),
        ([[1, 2]], [1, 2]),
        ([[1], [2]], None),
    ],
)
def test_completion_single_prompt(prompt: Any, single: Any) -> None:
    assert CompletionRequest(model="m", prompt=prompt).single_prompt() == single


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": []},
        {"prompt": [-1]},
        {"prompt": "x", "stream_options": {"include_usage": True}},
        {"prompt": "x", "logprobs": 6},
        {"prompt": "x", "stop": ["1", "2", "3", "4", "5"]},
        {"prompt": "x", "max_tokens": 0},
    ],
)
def test_completion_request_rejects(body: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", **body})


def test_completion_request_unknown_fields_and_stop() -> None:
    req = CompletionRequest.model_validate(
        {
            "model": "m",
            "prompt": "x",
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
            "guided_json": {},
        }
    )
    assert req.unknown_fields() == {"guided_json"}
    assert req.stop_sequences == ["\n"]
    assert req.include_usage is True


# -- responses: exact out --------------------------------------------------------------


def keys(s: str) -> list[str]:
    return list(json.loads(s).keys())


def test_chat_completion_response_key_order() -> None:
    resp = ChatCompletionResponse(
        id="chatcmpl-1",
        created=1_700_000_000,
        model="m",
        choices=[
            ChatCompletionChoice(
                index=0,
                message=ChatCompletionMessage(content="Hello!"),
                finish_reason="stop",
            )
        ],
        usage=Usage.from_counts(5, 2, cached_tokens=4),
        system_fingerprint="fp_1",
    )
    s = resp.model_dump_json()
    doc = json.loads(s)
    assert keys(s) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "usage",
        "system_fingerprint",
    ]
    assert doc["object"] == "chat.completion"
    assert list(doc["choices"][0]) == ["index", "message", "logprobs", "finish_reason"]
    assert doc["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello!",
        "refusal": None,
    }
    assert list(doc["choices"][0]["message"]) == ["role", "content", "refusal"]
    assert doc["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert list(doc["usage"]) == [
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
    ]


def test_usage_details_absent_not_null() -> None:
    assert json.loads(Usage.from_counts(1, 2).model_dump_json()) == {
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "total_tokens": 3,
    }
    full = Usage(
        prompt_tokens=1,
        completion_tokens=2,
        total_tokens=3,
        completion_tokens_details=CompletionTokensDetails(),
    )
    assert keys(full.model_dump_json()) == [
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "completion_tokens_details",
    ]


def test_responses_forbid_extra_fields() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionMessage(content="x", surprise=1)  # type: ignore[call-arg]


def chunk(delta: ChoiceDelta, finish: Any = None) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id="chatcmpl-1",
        created=1,
        model="m",
        system_fingerprint="fp_1",
        choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish)],
    )


def test_chunk_key_order_and_deltas() -> None:
    first = json.loads(chunk_json(chunk(ChoiceDelta(role="assistant", content="")), False))
    assert list(first) == ["id", "object", "created", "model", "system_fingerprint", "choices"]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert list(first["choices"][0]) == ["index", "delta", "logprobs", "finish_reason"]
    middle = json.loads(chunk_json(chunk(ChoiceDelta(content="Hel")), False))
    assert middle["choices"][0]["delta"] == {"content": "Hel"}
    last = json.loads(chunk_json(chunk(ChoiceDelta(), finish="length"), False))
    assert last["choices"][0]["delta"] == {}
    assert last["choices"][0]["finish_reason"] == "length"


def test_chunk_usage_absent_without_include_usage() -> None:
    c = chunk(ChoiceDelta(content="x"))
    assert "usage" not in json.loads(chunk_json(c, include_usage=False))
    # a usage set by mistake is not leaked to a client that did not ask for it
    c.usage = Usage.from_counts(1, 1)
    assert "usage" not in json.loads(chunk_json(c, include_usage=False))


def test_chunk_usage_null_then_final_usage_chunk() -> None:
    s = chunk_json(chunk(ChoiceDelta(content="x")), include_usage=True)
    doc = json.loads(s)
    assert keys(s)[-1] == "usage"
    assert doc["usage"] is None
    final = ChatCompletionChunk(
        id="chatcmpl-1",
        created=1,
        model="m",
        system_fingerprint="fp_1",
        choices=[],
        usage=Usage.from_counts(3, 1),
    )
    fdoc = json.loads(chunk_json(final, include_usage=True))
    assert list(fdoc) == [
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
        "usage",
    ]
    assert fdoc["choices"] == []
    assert fdoc["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_chunk_json_is_one_compact_line() -> None:
    s = chunk_json(chunk(ChoiceDelta(content="a\nb é")), include_usage=False)
    assert "\n" not in s
    assert ", " not in s
    assert json.loads(s)["choices"][0]["delta"]["content"] == "a\nb é"
    assert sse_data(s) == f"data: {s}\n\n"
    assert SSE_DONE == "data: [DONE]\n\n"


def test_completion_response_and_chunk_shapes() -> None:
    resp = CompletionResponse(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[CompletionChoice(text="hi", index=0, finish_reason="length")],
        usage=Usage.from_counts(2, 1),
    )
    doc = json.loads(resp.model_dump_json())
    assert list(doc) == [
        "id",
        "object",
        "created",
        "model",
        "system_fingerprint",
        "choices",
        "usage",
    ]
    assert doc["object"] == "text_completion"
    assert list(doc["choices"][0]) == ["text", "index", "logprobs", "finish_reason"]

    c = CompletionChunk(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[CompletionChunkChoice(text="h", index=0)],
    )
    plain = json.loads(chunk_json(c, include_usage=False))
    assert plain["object"] == "text_completion"
    assert "usage" not in plain
    assert plain["choices"][0] == {
        "text": "h",
        "index": 0,
        "logprobs": None,
        "finish_reason": None,
    }
    assert json.loads(chunk_json(c, include_usage=True))["usage"] is None


def test_model_list_shape() -> None:
    doc = json.loads(
        ModelList(data=[ModelCard(id="m", created=1, owned_by="kv-conductor")]).model_dump_json()
    )
    assert doc == {
        "object": "list",
        "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "kv-conductor"}],
    }
    assert list(doc["data"][0]) == ["id", "object", "created", "owned_by"]


def test_error_envelope_shape() -> None:
    body = ErrorResponse(error=ErrorDetail(message="bad", type="invalid_request_error"))
    doc = json.loads(body.model_dump_json())
    assert doc == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert list(doc["error"]) == ["message", "type", "param", "code"]


def test_ids() -> None:
    a, b = new_chat_completion_id(), new_chat_completion_id()
    assert a != b
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", a)
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", new_completion_id())


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(st.characters(exclude_categories=["Cs"]), max_size=40),
    index=st.integers(0, 15),
    include_usage=st.booleans(),
    model=st.sampled_from(["m", 'Ünï/cødé "model"', "kvc-content-7c1f0e"]),
)
def test_plain_content_chunks_are_byte_for_byte_what_the_model_writes(
    text: str, index: int, include_usage: bool, model: str
) -> None:
    """The per-token fast path of the streamed chat answer writes exactly what the
    pydantic chunk would, for any text (escapes, non-ASCII, control characters)."""
    chunks = ContentChunks("chatcmpl-x", 1700000000, model, include_usage)
    chunk = ChatCompletionChunk(
        id="chatcmpl-x",
        created=1700000000,
        model=model,
        choices=[ChunkChoice(index=index, delta=ChoiceDelta(content=text))],
    )
    event = chunks.event(index, text)
    if "kvc-content-7c1f0e" in model:  # a marker it cannot place: the model writes it
        assert event is None
    else:
        assert event == sse_data(chunk_json(chunk, include_usage))
    # The legacy completions API's chunks, the same way.
    texts = ContentChunks("cmpl-x", 1700000000, model, include_usage, "completions")
    legacy = CompletionChunk(
        id="cmpl-x",
        created=1700000000,
        model=model,
        choices=[CompletionChunkChoice(text=text, index=index)],
    )
    event = texts.event(index, text)
    if "kvc-content-7c1f0e" in model:
        assert event is None
    else:
        assert event == sse_data(chunk_json(legacy, include_usage))


_PROMPT_UNION: TypeAdapter[Any] = TypeAdapter(
    str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
)


def _outcome(validate: Any, value: Any) -> Any:
    try:
        return ("ok", validate(value))
    except ValidationError as exc:
        return ("error", [(e["type"], e["loc"]) for e in exc.errors()])


@given(
    st.lists(
        st.one_of(
            st.integers(min_value=-3, max_value=2**40),
            st.booleans(),
            st.sampled_from(["7", "x", 2.0, 2.5, None, [1]]),
        ),
        min_size=1,
        max_size=6,
    ).filter(lambda v: type(v[0]) is int)
)
@settings(max_examples=200)
def test_token_id_prompts_validate_as_the_union_does(prompt: list[Any]) -> None:
    """The fast path for token-id lists (one ``list[int]`` instead of the union) gives the
    union's result or the union's errors, whatever the list holds."""
    union = _outcome(_PROMPT_UNION.validate_python, prompt)
    model = _outcome(lambda v: CompletionRequest(model="m", prompt=v).prompt, prompt)
    if union[0] == "ok":
        assert model == union
    else:
        assert model[0] == "error"
        assert [t for t, _ in model[1]] == [t for t, _ in union[1]]
