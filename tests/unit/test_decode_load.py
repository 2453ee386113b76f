"""The decode-load forecast over NumPy columns equals the per-decode loop bit for bit."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core.cost_model import DecodeTimeModel
from conductor.core.decode_load import (
    VECTOR_MIN_DECODES,
    DecodeColumns,
    DecodeForecast,
    NodeBook,
    PlacedDecode,
    forecast_columns,
    forecast_decode_load,
)
from conductor.core.output_length import LengthDistribution, OutputLengthModel
from kvc.priors import DecodePrior

NOW = 100.0
MODEL = DecodeTimeModel(DecodePrior(fixed_s=0.01, per_request_s=5e-4, per_context_token_s=1e-7))


def _distributions() -> list[LengthDistribution]:
    """Learned, prior-only and short-tailed distributions (different tail starts)."""
    lengths = OutputLengthModel()
    out = [lengths.distribution("m", "none")]
    for tokens in (3, 40, 40, 41, 300, 2_000):
        lengths.observe("m", "a", tokens)
        out.append(lengths.distribution("m", "a"))
    for _ in range(300):
        lengths.observe("m", "b", 20)
    out.append(lengths.distribution("m", "b"))
    lengths.observe("m", "c", 64, censored=True)
    out.append(lengths.distribution("m", "c"))
    return out


DISTS = _distributions()

times = st.one_of(
    st.floats(NOW - 50.0, NOW + 50.0, allow_nan=False),
    st.sampled_from([NOW - 1.0, NOW, NOW + 0.5]),
)
decodes = st.builds(
    PlacedDecode,
    start_s=times,
    step_s=st.one_of(st.just(0.0), st.floats(1e-4, 0.5)),
    prompt_tokens=st.integers(1, 200_000),
    cap_tokens=st.integers(1, 4_096),
    lengths=st.sampled_from(DISTS),
    length_key=st.just(("m", "a")),
    started=st.booleans(),
)


def _same(a: DecodeForecast, b: DecodeForecast) -> bool:
    return a.requests.hex() == b.requests.hex() and a.context_tokens.hex() == b.context_tokens.hex()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(decodes, max_size=80),
    st.one_of(times, st.just(NOW)),
    st.integers(0, 300),
    st.sampled_from(DISTS),
    st.one_of(st.none(), st.floats(0.0, 0.2)),
)
def test_columns_forecast_the_loop_bit_for_bit(
    placed: list[PlacedDecode],
    at_s: float,
    reported: int,
    lengths: LengthDistribution,
    step_s: float | None,
) -> None:
    loop = forecast_decode_load(placed, reported, at_s, NOW, lengths, MODEL, step_s)
    columns = forecast_columns(DecodeColumns(placed), reported, at_s, NOW, lengths, MODEL, step_s)
    assert _same(loop, columns), (loop, columns)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "pop", "start", "forecast"]), decodes, times),
        max_size=120,
    )
)
def test_a_book_forecasts_as_the_loop_after_every_change(
    ops: list[tuple[str, PlacedDecode, float]],
) -> None:
    """Adds, removals and starts invalidate the columns; crossing the threshold both
    ways changes nothing."""
    book = NodeBook()
    ids: list[str] = []
    for i, (op, decode, t) in enumerate(ops):
        if op == "add" or len(ids) < VECTOR_MIN_DECODES // 2:
            ids.append(f"r{i}")
            book.add_decode(ids[-1], decode)
        elif op == "pop":
            assert book.pop_decode(ids.pop(i % len(ids))) is not None
        elif op == "start":
            book.start_decode(ids[i % len(ids)], t)
        want = forecast_decode_load(book.decodes.values(), 40, t, NOW, DISTS[1], MODEL)
        assert _same(book.forecast(40, t, NOW, DISTS[1], MODEL), want)
    assert book.pop_decode("unknown") is None


def test_the_book_forecasts_over_columns_from_the_threshold_on() -> None:
    book = NodeBook()
    for i in range(VECTOR_MIN_DECODES):
        assert book.columns is None
        book.add_decode(f"r{i}", PlacedDecode(NOW - 1, 0.02, 1_000, 256, DISTS[2], ("m", "a")))
        book.forecast(0, NOW + 0.5, NOW, DISTS[2], MODEL)
    assert book.columns is not None
    assert book.columns.count == VECTOR_MIN_DECODES
    book.start_decode("r0", NOW)
    assert book.columns is None
