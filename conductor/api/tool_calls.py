"""Tool calls parsed out of a model's text, whole or as it streams.

Models write tool calls as text in a format their family was trained on; the parser is
chosen per deployment (``--tool-call-parser``, like vLLM's), or from the chat template:

``hermes``  Hermes, Qwen 2.5/3 and others: ``<tool_call>{"name": …, "arguments": {…}}
            </tool_call>``, any number of them, with ordinary text around them.
``llama3_json``  Llama 3.1/3.2/3.3's JSON tool calls: the whole answer is a JSON object
            ``{"name": …, "parameters": {…}}`` (or several joined by ``;``), optionally
            after ``<|python_tag|>``.

A parser is fed the text deltas of one generation and answers events: ``Content`` (text
for the client) and, per call, ``CallStart`` (its id and name), ``CallArguments`` (text of
its arguments, a JSON object) and ``CallEnd``. Text that may still turn out to be part of
a call is held back, never shown twice. Feeding the same text in any split gives the same
events' concatenation (``tests/unit/test_tool_calls.py``).

Two modes, as vLLM's parsers have:

- *whole* (``incremental=False``, for answers sent at once): a call is made when its whole
  JSON parses, and its arguments are re-encoded; a call whose JSON does not parse is
  passed through as content (what the model wrote, not a made-up call).
- *incremental* (for streamed answers): a call starts as soon as its head is read —
  ``{"name": "…", "arguments": {`` (``"parameters"`` for Llama) — and its arguments then
  stream as the model writes them, fragment by fragment, as OpenAI streams them; their
  concatenation is the model's own text of the arguments object. Text already sent
  cannot be taken back, so a call whose arguments turn out malformed or cut short ends
  with what was written. A call laid out otherwise (arguments first, arguments as a JSON
  string, no arguments) is held until it ends and then sent whole, as in the other mode.
  A call the text ends inside ends with ``CallEnd(complete=False)``.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

__all__ = [
    "PARSERS",
    "Call",
    "CallArguments",
    "CallEnd",
    "CallStart",
    "Content",
    "Event",
    "ToolCallParser",
    "call_events",
    "collect",
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
class CallStart:
    id: str  # "call_" + 24 hex digits, as OpenAI's ids look
    name: str


@dataclass(frozen=True, slots=True)
class CallArguments:
    text: str  # a fragment of the current call's arguments


@dataclass(frozen=True, slots=True)
class CallEnd:
    complete: bool = True  # False: the text ended inside the call's arguments


Event = Content | CallStart | CallArguments | CallEnd


@dataclass(frozen=True, slots=True)
class Call:
    """A whole call: what a ``CallStart``, its ``CallArguments`` and ``CallEnd`` add up to."""

    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI sends it (a string)


class ToolCallParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...
    def finish(self) -> list[Event]: ...


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


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
    return Call(id=_call_id(), name=name, arguments=json.dumps(arguments, ensure_ascii=False))


def call_events(call: Call) -> list[Event]:
    return [CallStart(call.id, call.name), CallArguments(call.arguments), CallEnd()]


def collect(events: list[Event]) -> tuple[str, list[Call]]:
    """The text and the whole calls that ``events`` add up to."""
    said: list[str] = []
    calls: list[tuple[str, str, list[str]]] = []
    for event in events:
        if isinstance(event, Content):
            said.append(event.text)
        elif isinstance(event, CallStart):
            calls.append((event.id, event.name, []))
        elif isinstance(event, CallArguments) and calls:
            calls[-1][2].append(event.text)
    return "".join(said), [Call(i, name, "".join(parts)) for i, name, parts in calls]


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


# ---------------------------------------------------------------- reading a call's head

_WS: Final = " \t\r\n"
_MORE: Final = -1  # the text ends before the answer is known
_NO: Final = -2  # the text cannot be what was asked for


def _skip_ws(text: str, at: int) -> int:
    while at < len(text) and text[at] in _WS:
        at += 1
    return at


def _string_end(text: str, at: int) -> int:
    """Index after the JSON string starting at ``at`` (a quote), or ``_MORE``."""
    at += 1
    while at < len(text):
        c = text[at]
        if c == "\\":
            at += 2
            continue
        if c == '"':
            return at + 1
        at += 1
    return _MORE


def _read_string(text: str, at: int) -> tuple[int, str]:
    """``(index after, value)`` of the JSON string at ``at``; ``_MORE``/``_NO`` as index."""
    if at >= len(text):
        return _MORE, ""
    if text[at] != '"':
        return _NO, ""
    end = _string_end(text, at)
    if end < 0:
        return end, ""
    try:
        value = json.loads(text[at:end])
    except ValueError:
        return _NO, ""
    return end, value


def _read_symbol(text: str, at: int, symbol: str) -> int:
    at = _skip_ws(text, at)
    if at >= len(text):
        return _MORE
    return at + 1 if text[at] == symbol else _NO


def _read_key(text: str, at: int, keys: tuple[str, ...]) -> int:
    """Past ``"<one of keys>":`` (after blanks), or ``_MORE``/``_NO``."""
    at, key = _read_string(text, _skip_ws(text, at))
    if at < 0:
        return at
    if key not in keys:
        return _NO
    return _read_symbol(text, at, ":")


@dataclass(frozen=True, slots=True)
class _Head:
    name: str
    arguments_at: int  # where the arguments object's "{" is


def _read_head(text: str, arguments_keys: tuple[str, ...]) -> _Head | int:
    """``{"name": "…", "<arguments key>": {`` at the start of ``text`` (after blanks):
    the head, or ``_MORE`` (it may still come) or ``_NO`` (this call is laid out
    otherwise)."""
    at = _read_symbol(text, 0, "{")
    if at < 0:
        return at
    at = _read_key(text, at, ("name",))
    if at < 0:
        return at
    at, name = _read_string(text, _skip_ws(text, at))
    if at < 0:
        return at
    if not name:
        return _NO
    at = _read_symbol(text, at, ",")
    if at < 0:
        return at
    at = _read_key(text, at, arguments_keys)
    if at < 0:
        return at
    at = _skip_ws(text, at)
    if at >= len(text):
        return _MORE
    return _Head(name, at) if text[at] == "{" else _NO


class _ObjectScanner:
    """Follows a JSON object's text as it arrives and says where it closes."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escaped = False
        self.closed = False

    def scan(self, text: str) -> int:
        """How much of ``text`` belongs to the object (all of it while it is open)."""
        for i, c in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = True
                    return i + 1
        return len(text)


class _StreamedCall:
    """One call's JSON text read incrementally: its head, then its arguments streamed.
    ``body`` is everything of the call seen so far; events come from what is new."""

    def __init__(self, arguments_keys: tuple[str, ...]) -> None:
        self._keys = arguments_keys
        self.body = ""
        self.head: _Head | None = None
        self.whole = False  # laid out otherwise: held to the end, parsed whole
        self._sent = 0  # characters of the body already handled as arguments
        self._scanner = _ObjectScanner()

    @property
    def started(self) -> bool:
        return self.head is not None

    @property
    def arguments_closed(self) -> bool:
        return self._scanner.closed

    def extend(self, text: str) -> list[Event]:
        self.body += text
        events: list[Event] = []
        if self.head is None and not self.whole:
            head = _read_head(self.body, self._keys)
            if head == _NO:
                self.whole = True
            elif isinstance(head, _Head):
                self.head = head
                self._sent = head.arguments_at
                events.append(CallStart(_call_id(), head.name))
        if self.head is not None and not self._scanner.closed:
            new = self.body[self._sent :]
            taken = self._scanner.scan(new)
            self._sent += taken  # all of it while open; up to the close once closed
            if taken:
                events.append(CallArguments(new[:taken]))
        return events

    def rest(self) -> str:
        """What follows the arguments object (once it closed)."""
        return self.body[self._sent :] if self._scanner.closed else ""


# ---------------------------------------------------------------- the parsers


class HermesParser:
    OPEN: Final = "<tool_call>"
    CLOSE: Final = "</tool_call>"
    _KEYS: Final = ("arguments",)

    def __init__(self, *, incremental: bool = False) -> None:
        self._incremental = incremental
        self._buffer = ""
        self._inside = False
        self._call: _StreamedCall | None = None  # incremental: the call being read

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
                if self._incremental:
                    self._call = _StreamedCall(self._KEYS)
            at = self._buffer.find(self.CLOSE)
            if at < 0:
                if self._call is not None:
                    # Stream what cannot be the start of the closing tag.
                    keep = _held_prefix(self._buffer, self.CLOSE)
                    events += self._call.extend(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                return events
            body, self._buffer = self._buffer[:at], self._buffer[at + len(self.CLOSE) :]
            self._inside = False
            events += self._end_call(body)

    def _end_call(self, body: str) -> list[Event]:
        call, self._call = self._call, None
        if call is None:
            return self._parse(body)
        events = call.extend(body)
        if call.started:
            return [*events, CallEnd()]
        return self._parse(call.body)

    def _parse(self, body: str) -> list[Event]:
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        call = (
            make_call(data.get("name"), data.get("arguments")) if isinstance(data, dict) else None
        )
        if call is None:
            return [Content(f"{self.OPEN}{body}{self.CLOSE}")]
        return call_events(call)

    def finish(self) -> list[Event]:
        call, self._call = self._call, None
        rest, self._buffer = self._buffer, ""
        inside, self._inside = self._inside, False
        if call is not None:
            events = call.extend(rest)
            if call.started:  # cut short: the call ends with what was written
                return [*events, CallEnd(complete=call.arguments_closed)]
            rest = call.body
        # An unclosed call is what the model wrote: text, not a call.
        text = (self.OPEN if inside else "") + rest
        return [Content(text)] if text else []


class Llama3JsonParser:
    TAG: Final = "<|python_tag|>"
    _KEYS: Final = ("parameters", "arguments")

    def __init__(self, *, incremental: bool = False) -> None:
        self._incremental = incremental
        self._buffer = ""
        self._mode: Literal["undecided", "json", "text"] = "undecided"
        # Incremental, once the answer is JSON: where the calls stand.
        self._state: Literal["head", "args", "after", "sep", "held", "held_text"] = "head"
        self._call: _StreamedCall | None = None
        self._head_text = ""  # the call being read before its head is known
        self._held = ""  # text kept for the end
        self._blank = ""  # blanks after a call, kept until what follows them is known
        self._all = ""  # everything, for the whole reading when nothing streamed
        self._calls = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if not head:
                return []
            if head.startswith(("{", self.TAG)):
                self._mode = "json"
                if self._incremental:  # the tag is whole by now: drop it once
                    self._all, self._buffer = self._buffer, ""
                    body = head[len(self.TAG) :] if head.startswith(self.TAG) else head
                    return self._advance(body)
            elif self.TAG.startswith(head):
                return []  # could still be the tag
            else:
                self._mode = "text"
        if self._mode == "json":
            if not self._incremental:
                return []  # whole: a call is only known once the whole answer is in
            new, self._buffer = self._buffer, ""
            self._all += new
            return self._advance(new)
        shown, self._buffer = self._buffer, ""
        return [Content(shown)] if shown else []

    def _advance(self, text: str) -> list[Event]:
        """Incremental: calls as they are written (``call; call; …``); a layout this
        cannot follow is held and read whole at the end."""
        events: list[Event] = []
        text, self._blank = self._blank + text, ""
        while True:
            state = self._state
            if state == "head":
                if self._call is None:
                    self._call, self._head_text = _StreamedCall(self._KEYS), ""
                call = self._call
                self._head_text += text
                found, text = call.extend(text), ""
                if call.whole:
                    self._state, self._held = "held", self._head_text
                    return events
                if not call.started:
                    return events
                events += found
                self._calls += 1
                self._state = "args"
            elif state == "args":
                assert self._call is not None
                if text:
                    events += self._call.extend(text)
                    text = ""
                if not self._call.arguments_closed:
                    return events
                text, self._state = self._call.rest(), "after"
            elif state in ("after", "sep"):
                at = _skip_ws(text, 0)
                if at >= len(text):
                    self._blank = text
                    return events
                expected = "}" if state == "after" else ";"
                if text[at] != expected:
                    if state == "after":
                        events.append(CallEnd())
                    self._state, self._held = "held_text", text
                    return events
                text = text[at + 1 :]
                if state == "after":
                    events.append(CallEnd())
                    self._state = "sep"
                else:
                    self._state, self._call = "head", None
            else:
                self._held += text
                return events

    def finish(self) -> list[Event]:
        if self._incremental and self._mode == "json":
            return self._finish_incremental()
        text, self._buffer = self._buffer, ""
        if self._mode != "json":
            return [Content(text)] if text else []
        return self._whole(text)

    def _whole(self, text: str) -> list[Event]:
        body = text.lstrip()
        body = body[len(self.TAG) :] if body.startswith(self.TAG) else body
        calls = _parse_calls(body)
        return [Content(text)] if calls is None else [e for c in calls for e in call_events(c)]

    def _finish_incremental(self) -> list[Event]:
        state, self._state, self._blank = self._state, "head", ""
        if state == "head" and self._head_text.strip():
            state, self._held = "held", self._head_text
        if state == "held":
            if not self._calls:  # nothing streamed: read as a whole answer
                return self._whole(self._all)
            calls = _parse_calls(self._held)
            if calls is None:
                return [Content(self._held)]
            return [e for c in calls for e in call_events(c)]
        if state in ("args", "after"):  # cut short: the call ends with what was written
            return [CallEnd(complete=state == "after")]
        if state == "held_text":
            return [Content(self._held)]
        return []


def _parse_calls(body: str) -> list[Call] | None:
    """``call; call; …`` read whole; None unless every part is a call."""
    calls: list[Call] = []
    for part in body.split(";"):
        try:
            data = json.loads(part)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        call = make_call(data.get("name"), data.get("parameters", data.get("arguments")))
        if call is None:
            return None
        calls.append(call)
    return calls


def new_parser(name: ParserName, *, incremental: bool = False) -> ToolCallParser:
    if name == "hermes":
        return HermesParser(incremental=incremental)
    return Llama3JsonParser(incremental=incremental)


def detect(chat_template: str) -> ParserName | None:
    """The parser a chat template's own tool-call format calls for, if it shows one."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|python_tag|>" in chat_template or (
        '"parameters"' in chat_template and "ipython" in chat_template
    ):
        return "llama3_json"
    return None
