"""Tool-call parsers: what the model wrote becomes content and calls, whatever the split."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.api.tool_calls import Call, Content, Event, detect, new_parser

HERMES = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
LLAMA = (
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}'
)


def run(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    parser = new_parser(name)  # type: ignore[arg-type]
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    text = "".join(e.text for e in events if isinstance(e, Content))
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, Call)]
    return text, calls


@pytest.mark.parametrize(
    ("name", "output", "text", "calls"),
    [
        (
            "hermes",
            HERMES,
            "Let me check.\n",
            [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        ),
        ("hermes", "No tools needed: 4.", "No tools needed: 4.", []),
        ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        ("hermes", 'a <tool_call>{"name": "f"', 'a <tool_call>{"name": "f"', []),  # unclosed
        (
            "hermes",
            '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
            "",
            [("f", {"x": 1})],
        ),
        ("hermes", "a < b <tool", "a < b <tool", []),
        ("llama3_json", LLAMA, "", [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "f", "arguments": {"q": "x"}}',
            "",
            [("f", {"q": "x"})],
        ),
        ("llama3_json", "Sunny, 21 degrees.", "Sunny, 21 degrees.", []),
        ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
        ("llama3_json", "  {broken", "  {broken", []),
    ],
)
def test_whole_outputs(
    name: str, output: str, text: str, calls: list[tuple[str, dict[str, object]]]
) -> None:
    assert run(name, [output]) == (text, calls)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), name=st.sampled_from(["hermes", "llama3_json"]))
def test_any_split_gives_the_same_result(data: st.DataObject, name: str) -> None:
    output = data.draw(st.sampled_from([HERMES, LLAMA, "plain text <tool", "x" * 30]))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(output)), max_size=12)))
    pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)]
    assert run(name, pieces) == run(name, [output])


def test_held_text_is_never_shown_twice() -> None:
    parser = new_parser("hermes")
    shown = parser.feed("Hello <tool")
    assert shown == [Content("Hello ")]  # "<tool" might open a call: held
    assert parser.feed("kit> done") == [Content("<toolkit> done")]
    assert parser.finish() == []


def test_call_ids_look_like_openais_and_differ() -> None:
    parser = new_parser("hermes")
    events = parser.feed(HERMES) + parser.finish()
    ids = [e.id for e in events if isinstance(e, Call)]
    assert len(set(ids)) == 2
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_detect_from_the_chat_template() -> None:
    assert detect("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}") == "hermes"
    assert detect("<|python_tag|>{{ call }}") == "llama3_json"
    assert detect('{"name": function name, "parameters": …} ipython') == "llama3_json"
    assert detect("{{ messages }}") is None
