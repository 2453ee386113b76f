"""Short prompts are tokenized on the event loop; long ones in a worker thread, so one
long prompt never stalls the other requests."""

from __future__ import annotations

import threading

from conductor.api.openai import _INLINE_TOKENIZE_CHARS, _off_loop_if_long, _text_size


async def test_short_text_stays_on_the_loop_and_long_text_leaves_it() -> None:
    loop_thread = threading.get_ident()
    short = await _off_loop_if_long(_INLINE_TOKENIZE_CHARS, lambda: [threading.get_ident()])
    long = await _off_loop_if_long(_INLINE_TOKENIZE_CHARS + 1, lambda: [threading.get_ident()])
    assert short == [loop_thread]
    assert long != [loop_thread]


def test_text_size_counts_every_message_and_the_tools() -> None:
    messages = [{"role": "system", "content": "ab"}, {"role": "user", "content": "cde"}]
    assert _text_size(messages, None) == 5
    assert _text_size([*messages, {"role": "assistant"}], [{"x": 1}]) == 5 + len("[{'x': 1}]")
