"""Tool calls parsed out of a model's text, whole or as it streams.

Models write tool calls as text in a format their family was trained on; the parser is
chosen per deployment (``--tool-call-parser``, like vLLM's), or from the chat template:

``hermes``  Hermes, Qwen 2.5/3 and others: ``<tool_call>{"name": …, "arguments": {…}}
            </tool_call>``, any number of them, with ordinary text around them.
``llama3_json``  Llama 3.1/3.2/3.3's JSON tool calls: the whole answer is a JSON object
            ``{"name": …, "parameters": {…}}`` (or several joined by ``;``), optionally
            after ``<|python_tag|>``.

A parser is fed the text deltas of one generation and answers ``Content`` (text for the
client) and ``Call`` events. Text that may still turn out to be part of a call is held
back, never shown twice; a call whose JSON does not parse is passed through as content
(what the model wrote, not a made-up call). Feeding the same text in any split gives the
same events' concatenation (``tests/unit/test_tool_calls.py``).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

__all__ = [
    "PARSERS",
    "Call",
    "Content",
    "Event",
    "ToolCallParser",
    "detect",
    "make_call",
    "new_parser",
]

ParserName = Literal["hermes", "llama3_json"]
PARSERS: Final[tuple[ParserName, ...]] = ("hermes", "llama3_json")


@dataclass(frozen=True, slots=True)
class Content:
    text: str


@dataclass(frozen=True, slots=True)
class Call:
    id: str  # "call_" + 24 hex digits, as OpenAI's ids look
    name: str
    arguments: str  # a JSON object, as OpenAI sends it (a string)


Event = Content | Call


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...


def make_call(name: Any, arguments: Any) -> Call | None:
    """A call from a parsed name and arguments (an object, or JSON text of one); None
    when they are not that."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return Call(
        id=f"call_{secrets.token_hex(12)}",
        name=name,
        arguments=json.dumps(arguments, ensure_ascii=False),
    )


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser:
    OPEN: Final = "<tool_call>"
    CLOSE: Final = "</tool_call>"

    def __init__(self) -> None:
        self._buffer = ""
        self._inside = False

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._inside:
                at = self._buffer.find(self.OPEN)
                if at < 0:
                    keep = _held_prefix(self._buffer, self.OPEN)
                    shown = self._buffer[: len(self._buffer) - keep]
                    if shown:
                        events.append(Content(shown))
                    self._buffer = self._buffer[len(shown) :]
                    return events
                if at:
                    events.append(Content(self._buffer[:at]))
                self._buffer = self._buffer[at + len(self.OPEN) :]
                self._inside = True
            at = self._buffer.find(self.CLOSE)
            if at < 0:
                return events
            body, self._buffer = self._buffer[:at], self._buffer[at + len(self.CLOSE) :]
            self._inside = False
            events.append(self._parse(body))

    def _parse(self, body: str) -> Event:
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        call = (
            make_call(data.get("name"), data.get("arguments")) if isinstance(data, dict) else None
        )
        return call if call is not None else Content(f"{self.OPEN}{body}{self.CLOSE}")

    def finish(self) -> list[Event]:
        # An unclosed call is what the model wrote: text, not a call.
        rest = (self.OPEN if self._inside else "") + self._buffer
        self._buffer, self._inside = "", False
        return [Content(rest)] if rest else []


class Llama3JsonParser:
    TAG: Final = "<|python_tag|>"

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: Literal["undecided", "json", "text"] = "undecided"

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if not head:
                return []
            if head.startswith(("{", self.TAG)):
                self._mode = "json"
            elif self.TAG.startswith(head):
                return []  # could still be the tag
            else:
                self._mode = "text"
        if self._mode == "json":
            return []  # a call is only known once the whole answer is in
        shown, self._buffer = self._buffer, ""
        return [Content(shown)] if shown else []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        if self._mode != "json":
            return [Content(text)] if text else []
        body = text.lstrip()
        body = body[len(self.TAG) :] if body.startswith(self.TAG) else body
        calls: list[Event] = []
        for part in body.split(";"):
            try:
                data = json.loads(part)
            except ValueError:
                return [Content(text)]
            if not isinstance(data, dict):
                return [Content(text)]
            call = make_call(data.get("name"), data.get("parameters", data.get("arguments")))
            if call is None:
                return [Content(text)]
            calls.append(call)
        return calls


def new_parser(name: ParserName) -> ToolCallParser:
    return HermesParser() if name == "hermes" else Llama3JsonParser()


def detect(chat_template: str) -> ParserName | None:
    """The parser a chat template's own tool-call format calls for, if it shows one."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or (
        '"parameters"' in chat_template and "ipython" in chat_template
    ):
        return "llama3_json"
    return None
