"""Stop strings over streamed text: what is emitted, and which string matched."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from node_agent.stopping import StopStringMatcher


def test_the_earliest_match_wins_and_is_named() -> None:
    m = StopStringMatcher(["world", "lo w"])
    first = m.push("hel")
    assert (first.emit, first.stopped) == ("he", False)  # "l" may start "lo w"
    check = m.push("lo world")
    assert check.stopped
    assert check.emit == "l"
    assert check.matched == "lo w"


def test_two_strings_at_one_place_report_the_first_listed() -> None:
    check = StopStringMatcher(["ab", "abc"]).push("xxabc")
    assert (check.emit, check.matched) == ("xx", "ab")


@given(
    st.text(alphabet="abc ", max_size=40),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=4),
    st.integers(min_value=1, max_value=5),
)
def test_streamed_in_pieces_equals_whole(text: str, stops: list[str], piece: int) -> None:
    """However the text is cut into deltas, the emitted text is everything before the
    earliest stop string, and the match reported is a stop string found there (which
    one can depend on the cut: the first to complete wins while streaming)."""
    m = StopStringMatcher(stops)
    out = ""
    matched = ""
    for i in range(0, len(text), piece):
        check = m.push(text[i : i + piece])
        out += check.emit
        if check.stopped:
            matched = check.matched
            break
    else:
        out += m.flush()
    hits = [(i, n) for n, s in enumerate(stops) if (i := text.find(s)) >= 0]
    if hits:
        cut = min(hits)[0]
        assert out == text[:cut]
        assert matched in stops
        assert text.startswith(matched, cut)
    else:
        assert (out, matched) == (text, "")
