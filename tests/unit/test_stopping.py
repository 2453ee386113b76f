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


def test_the_first_string_completed_wins_whatever_the_cut() -> None:
    """'a' completes before 'baa', which began earlier: the engine would have stopped
    at 'ba' already, so the answer is 'b' however the text arrives."""
    for pieces in (["baa"], ["b", "a", "a"], ["ba", "a"]):
        m = StopStringMatcher(["baa", "a"])
        checks = [m.push(p) for p in pieces]
        stopped = next(c for c in checks if c.stopped)
        assert "".join(c.emit for c in checks[: checks.index(stopped) + 1]) == "b"
        assert stopped.matched == "a"


@given(
    st.text(alphabet="abc ", max_size=40),
    st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=4),
    st.integers(min_value=1, max_value=5),
)
def test_streamed_in_pieces_equals_whole(text: str, stops: list[str], piece: int) -> None:
    """However the text is cut into deltas, the emitted text is everything before the
    first stop string to be completed (reading the text a character at a time, as an
    engine produces it), and that is the match reported."""
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
    hits = [(i + len(s), i, n) for n, s in enumerate(stops) if (i := text.find(s)) >= 0]
    if hits:
        _, cut, which = min(hits)
        assert out == text[:cut]
        assert matched == stops[which]
    else:
        assert (out, matched) == (text, "")
