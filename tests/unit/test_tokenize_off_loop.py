"""Short prompts are tokenized on the event loop; long ones in a worker thread, so one
long prompt never stalls the other requests. Unknown request fields are logged once per
name."""

from __future__ import annotations

import logging
import threading

import pytest

from conductor.api.openai import (
    _INLINE_TOKENIZE_CHARS,
    log_unknown_fields,
    off_loop_if_long,
    text_size,
)


async def test_short_text_stays_on_the_loop_and_long_text_leaves_it() -> None:
    loop_thread = threading.get_ident()
    short = await off_loop_if_long(_INLINE_TOKENIZE_CHARS, lambda: [threading.get_ident()])
    long = await off_loop_if_long(_INLINE_TOKENIZE_CHARS + 1, lambda: [threading.get_ident()])
    assert short == [loop_thread]
    assert long != [loop_thread]


def testtext_size_counts_every_message_and_the_tools() -> None:
    messages = [{"role": "system", "content": "ab"}, {"role": "user", "content": "cde"}]
    assert text_size(messages, None) == 5
    assert text_size([*messages, {"role": "assistant"}], [{"x": 1}]) == 5 + len("[{'x': 1}]")


def test_unknown_fields_are_logged_once_per_name(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="conductor.api")
    log_unknown_fields("r1", {"messages[0].x_unknown_a", "x_unknown_b"})
    log_unknown_fields("r2", {"messages[4].x_unknown_a", "x_unknown_b"})
    log_unknown_fields("r3", {"x_unknown_b", "x_unknown_c"})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "request r1: ignoring unknown fields ['messages[].x_unknown_a', 'x_unknown_b'] "
        "(logged once per name)",
        "request r3: ignoring unknown fields ['x_unknown_c'] (logged once per name)",
    ]
