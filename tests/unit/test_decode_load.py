"""The decode-load forecast over NumPy columns (one pass over many nodes) equals the
per-decode loop bit for bit."""

from __future__ import annotations

import dataclasses
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core.cost_model import DecodeTimeModel
from conductor.core.decode_load import (
    DecodeColumns,
    DecodeForecast,
    NodeBook,
    PlacedDecode,
    forecast_decode_load,
    own_loads,
    with_foreign,
)
from conductor.core.output_length import LengthDistribution, OutputLengthModel, SurvivalTable
from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import NodeState, Scheduler, SchedulerConfig
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


def _columns_forecasts(
    groups: list[list[PlacedDecode]],
    table: SurvivalTable,
    reported: int,
    at_s: float,
    lengths: LengthDistribution,
    step_s: float | None,
) -> list[DecodeForecast]:
    parts = [DecodeColumns.build(g, table) for g in groups]
    return [
        with_foreign(o.requests, o.context_tokens, o.running_now, reported, at_s, NOW, lengths,
                     MODEL, step_s)
        for o in own_loads(parts, table, at_s, NOW)
    ]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.lists(decodes, min_size=1, max_size=40), min_size=1, max_size=5),
    st.one_of(times, st.just(NOW)),
    st.integers(0, 300),
    st.sampled_from(DISTS),
    st.one_of(st.none(), st.floats(0.0, 0.2)),
)
def test_one_pass_over_many_nodes_forecasts_each_as_the_loop_bit_for_bit(
    groups: list[list[PlacedDecode]],
    at_s: float,
    reported: int,
    lengths: LengthDistribution,
    step_s: float | None,
) -> None:
    table = SurvivalTable()
    got = _columns_forecasts(groups, table, reported, at_s, lengths, step_s)
    for group, columns in zip(groups, got, strict=True):
        loop = forecast_decode_load(group, reported, at_s, NOW, lengths, MODEL, step_s)
        assert _same(loop, columns), (loop, columns)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(decodes, min_size=1, max_size=30), min_size=1, max_size=4), times)
def test_a_reset_table_still_forecasts_the_same(
    groups: list[list[PlacedDecode]], at_s: float
) -> None:
    """Rows are renumbered by a reset (and the table grows past its first size)."""
    table = SurvivalTable()
    for dist in DISTS * 10:  # rows the groups will not use
        table.row(dataclasses.replace(dist))
    before = _columns_forecasts(groups, table, 7, at_s, DISTS[3], 0.02)
    table.reset(d.lengths for g in groups for d in g)
    after = _columns_forecasts(groups, table, 7, at_s, DISTS[3], 0.02)
    assert all(_same(a, b) for a, b in zip(before, after, strict=True))


def test_book_columns_are_kept_until_the_decodes_or_the_table_change() -> None:
    table = SurvivalTable()
    book = NodeBook()
    book.add_decode("r0", PlacedDecode(NOW - 1, 0.02, 1_000, 256, DISTS[2], ("m", "a")))
    columns = book.columns_in(table)
    assert book.columns_in(table) is columns
    book.start_decode("r0", NOW)
    assert book.columns_in(table) is not columns
    assert book.columns_in(table).start_s.tolist() == [NOW]
    columns = book.columns_in(table)
    table.reset([])
    assert book.columns_in(table) is not columns
    book.add_decode("r1", PlacedDecode(NOW, 0.02, 1_000, 256, DISTS[3], ("m", "a")))
    assert book.columns_in(table).count == 2
    assert book.pop_decode("r0") is not None
    assert book.columns_in(table).count == 1
    assert book.pop_decode("unknown") is None


nodes = st.lists(st.lists(decodes, max_size=12), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(nodes, st.one_of(times, st.just(NOW)), st.lists(st.integers(0, 40), min_size=6, max_size=6))
def test_the_scheduler_forecasts_the_same_whichever_nodes_run_over_columns(
    placed: list[list[PlacedDecode]], at_s: float, reported: list[int]
) -> None:
    """Every node over columns (with the table reset before each pass, or not), none,
    or those with 6 or more: identical forecasts."""
    fleet = [
        NodeState(
            node_id=NodeId(f"d{i}"),
            role="decode",
            healthy=True,
            block_size=16,
            capacity_blocks=10_000,
            free_blocks=10_000,
            kv_bytes_per_token=1_000,
            running_requests=reported[i],
        )
        for i in range(len(placed))
    ]
    results = []
    for vector_min, reset_above in ((1, 0), (1, 10**9), (6, 10**9), (10**9, 10**9)):
        scheduler = Scheduler(SchedulerConfig())
        scheduler.vector_min_decodes = vector_min
        scheduler._length_table_limit = reset_above
        for node, group in zip(fleet, placed, strict=True):
            book = scheduler._book(node.node_id)  # what on_assigned books, as given
            for j, decode in enumerate(group):
                book.add_decode(f"{node.node_id}-{j}", dataclasses.replace(decode))
        scheduler.forecasts(fleet, at_s, NOW, DISTS[1])  # columns built, maybe reset
        results.append(scheduler.forecasts(fleet, at_s, NOW, DISTS[1]))
    for a, b in itertools.pairwise(results):
        assert all(_same(x, y) for x, y in zip(a, b, strict=True))
    # And the loop itself, node by node.
    fresh = Scheduler(SchedulerConfig())
    for node, group, got in zip(fleet, placed, results[0], strict=True):
        model = fresh.decode_model(node.node_id)
        loop = forecast_decode_load(group, node.running_requests, at_s, NOW, DISTS[1], model)
        assert _same(got, loop)
