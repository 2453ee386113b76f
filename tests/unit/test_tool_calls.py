"""Tool-call parsers: what the model wrote becomes content and calls, whatever the split."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.api.tool_calls import (
    CallArguments,
    CallEnd,
    CallStart,
    Content,
    Event,
    collect,
    detect,
    new_parser,
)

HERMES = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
    '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)
LLAMA = (
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
    '{"name": "get_time", "parameters": {}}'
)


def events_of(name: str, pieces: list[str], *, incremental: bool = False) -> list[Event]:
    parser = new_parser(name, incremental=incremental)  # type: ignore[arg-type]
    events: list[Event] = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def run(
    name: str, pieces: list[str], *, incremental: bool = False
) -> tuple[str, list[tuple[str, dict[str, object]]]]:
    text, calls = collect(events_of(name, pieces, incremental=incremental))
    return text, [(c.name, json.loads(c.arguments)) for c in calls]


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


NESTED = (
    'Sure. <tool_call>{"name": "plan", "arguments": {"steps": [{"do": "a}b"}, {"do": "c\\\\"}],'
    ' "note": "</tool"}}</tool_call> done'
)
ODD_LAYOUTS = [
    '<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>',  # arguments first
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # as a string
    '<tool_call>{"name": "f"}</tool_call>',  # no arguments
    '{"name": "a", "parameters": {}}; {"parameters": {"y": 2}, "name": "b"}',
]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_streamed_calls_match_the_whole_reading_whatever_the_split(data: st.DataObject) -> None:
    """The incremental parser (streamed answers) gives, for well-formed calls in any
    split, the text and calls the whole reading gives — arguments equal as JSON."""
    name, output = data.draw(
        st.sampled_from(
            [("hermes", HERMES), ("llama3_json", LLAMA), ("hermes", NESTED),
             ("hermes", "plain text <tool"), ("llama3_json", "Sunny, 21."),
             ("hermes", ODD_LAYOUTS[0]), ("hermes", ODD_LAYOUTS[1]), ("hermes", ODD_LAYOUTS[2]),
             ("llama3_json", ODD_LAYOUTS[3])]
        )
    )  # fmt: skip
    cuts = sorted(data.draw(st.sets(st.integers(0, len(output)), max_size=16)))
    pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)], strict=True)]
    assert run(name, pieces, incremental=True) == run(name, [output])
    events = events_of(name, pieces, incremental=True)
    starts = sum(isinstance(e, CallStart) for e in events)
    assert starts == sum(isinstance(e, CallEnd) for e in events)


@pytest.mark.parametrize("name", ["hermes", "llama3_json"])
def test_arguments_stream_as_they_are_written(name: str) -> None:
    """Fed a character at a time, a call starts once its head is read and its
    arguments arrive in fragments, before the call is closed; their concatenation is
    the model's own text of the arguments."""
    output = HERMES if name == "hermes" else LLAMA
    parser = new_parser(name, incremental=True)  # type: ignore[arg-type]
    seen: list[tuple[int, Event]] = []
    for at, ch in enumerate(output):
        seen += [(at, e) for e in parser.feed(ch)]
    seen += [(len(output), e) for e in parser.finish()]
    start_at = next(at for at, e in seen if isinstance(e, CallStart))
    first_close = output.index("}") + 1  # the first call's arguments are {"city": "Oslo"}
    assert start_at < first_close
    fragments = [e.text for _, e in seen if isinstance(e, CallArguments)]
    assert len(fragments) > 10
    assert "".join(fragments) == '{"city": "Oslo"}{}'
    assert [type(e) for _, e in seen if not isinstance(e, Content | CallArguments)] == [
        CallStart, CallEnd, CallStart, CallEnd
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "output", "text", "arguments"),
    [
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1', "", '{"a": 1'),
        ("llama3_json", '{"name": "f", "parameters": {"a": [1, 2', "", '{"a": [1, 2'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1} junk</tool_call>!', "!",
         '{"a": 1}'),
        ("llama3_json", '{"name": "f", "parameters": {}} then text', " then text", "{}"),
    ],
)  # fmt: skip
def test_a_streamed_call_cut_short_ends_with_what_was_written(
    name: str, output: str, text: str, arguments: str
) -> None:
    """Once a call has started streaming it cannot be taken back: cut by max_tokens
    (or followed by something else), it ends with the arguments as written."""
    events = events_of(name, list(output), incremental=True)
    said, calls = collect(events)
    assert said == text
    (end,) = [e for e in events if isinstance(e, CallEnd)]
    assert end.complete == arguments.endswith("}")  # cut inside the arguments or not
    ((call_name, call_arguments),) = [(c.name, c.arguments) for c in calls]
    assert (call_name, call_arguments) == ("f", arguments)


def test_held_text_is_never_shown_twice() -> None:
    parser = new_parser("hermes")
    shown = parser.feed("Hello <tool")
    assert shown == [Content("Hello ")]  # "<tool" might open a call: held
    assert parser.feed("kit> done") == [Content("<toolkit> done")]
    assert parser.finish() == []


def test_call_ids_look_like_openais_and_differ() -> None:
    parser = new_parser("hermes")
    events = parser.feed(HERMES) + parser.finish()
    ids = [e.id for e in events if isinstance(e, CallStart)]
    assert len(set(ids)) == 2
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_detect_from_the_chat_template() -> None:
    assert detect("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}") == "hermes"
    assert detect("<|python_tag|>{{ call }}") == "llama3_json"
    assert detect('{"name": function name, "parameters": …} ipython') == "llama3_json"
    assert detect("{{ messages }}") is None
