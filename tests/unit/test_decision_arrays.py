"""The decision's per-node work over arrays (``VECTOR_MIN_NODES`` nodes or more): each
array form against the scalar code it stands for, and the stages' first choice with
and without it."""

from __future__ import annotations

import math
from unittest.mock import patch

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conductor.core import policies
from conductor.core.cost_model import (
    DecodeTimeModel,
    PrefillTimeModel,
    decode_floors,
    prefill_floors,
)
from conductor.core.decode_load import with_foreign
from conductor.core.output_length import OutputLengthModel
from conductor.core.policies import DecodeCandidate, DecodeChoice, LowestTbt, Policy
from conductor.core.prefix_index import NodeId
from conductor.core.scheduler import NodeState, Placement, Scheduler, ScheduleRequest, Slo
from conductor.core.transfer_model import TransferModel
from kvc.priors import DecodePrior, PrefillPrior
from tests.scheduling_helpers import make_node, round_number_config

NOW = 100.0
coefficient = st.sampled_from([0.0, 1e-9, 1e-7, 1e-5, 1e-3, 0.01, 0.2])
scale = st.sampled_from([0.05, 0.5, 1.0, 1.7, 20.0])


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 20_000), st.booleans()), max_size=60),
    tokens=st.lists(
        st.one_of(
            st.floats(-10.0, 1e7, allow_nan=False),
            st.sampled_from([0.0, -0.0, 1.0, 31.0, 32.0, 1e9, math.inf]),
        ),
        min_size=1,
        max_size=40,
    ),
)
def test_survivals_are_survival_bit_for_bit(
    lengths: list[tuple[int, bool]], tokens: list[float]
) -> None:
    model = OutputLengthModel(prior_mean_tokens=256.0)
    for n, censored in lengths:
        model.observe("m", "t", n, censored=censored)
    dist = model.distribution("m", "t")
    got = dist.survivals(np.array(tokens)).tolist()
    assert got == [dist.survival(t) for t in tokens]


def _terms(models: list[PrefillTimeModel] | list[DecodeTimeModel]) -> npt.NDArray[np.float64]:
    """The rows the floors evaluate: each model's ``floor_row`` (the scheduler's columns)."""
    return np.array([m.floor_row() for m in models], dtype=np.float64).reshape(len(models), 4)


@st.composite
def prefill_models(draw: st.DrawFn) -> PrefillTimeModel:
    model = PrefillTimeModel(PrefillPrior(draw(coefficient), draw(coefficient), draw(coefficient)))
    for _ in range(draw(st.integers(0, 15))):
        total = draw(st.integers(1, 40_000))
        cached = draw(st.integers(0, total))
        model.observe(total, cached, max(1e-9, model.estimate(total, cached)) * draw(scale))
    return model


@st.composite
def decode_models(draw: st.DrawFn) -> DecodeTimeModel:
    model = DecodeTimeModel(DecodePrior(draw(coefficient), draw(coefficient), draw(coefficient)))
    for _ in range(draw(st.integers(0, 15))):
        batch = draw(st.floats(0.0, 256.0))
        context = draw(st.floats(0.0, 1e6))
        model.observe(batch, context, max(1e-9, model.estimate(batch, context)) * draw(scale))
    return model


@settings(max_examples=200, deadline=None)
@given(
    models=st.lists(prefill_models(), min_size=1, max_size=8),
    total=st.integers(1, 200_000),
    data=st.data(),
)
def test_prefill_floors_are_the_models_floors(
    models: list[PrefillTimeModel], total: int, data: st.DataObject
) -> None:
    cached = [data.draw(st.integers(0, total)) for _ in models]
    got = prefill_floors(_terms(models), total, np.array(cached, np.int64)).tolist()
    for model, c, floor in zip(models, cached, got, strict=True):
        assert floor == pytest.approx(model.estimate_floor(total, c), rel=1e-12, abs=0.0)
        assert floor <= model.estimate(total, c) * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(models=st.lists(decode_models(), min_size=1, max_size=8), data=st.data())
def test_decode_floors_bound_the_estimates(
    models: list[DecodeTimeModel], data: st.DataObject
) -> None:
    batch = [data.draw(st.floats(0.0, 512.0)) for _ in models]
    context = [data.draw(st.floats(0.0, 1e7)) for _ in models]
    got = decode_floors(_terms(models), np.array(batch), np.array(context)).tolist()
    for model, b, c, floor in zip(models, batch, context, got, strict=True):
        estimate = model.estimate(b, c)
        assert 0.0 <= floor <= estimate * (1 + 1e-9)
        if model.sample_count == 0:
            assert floor == estimate  # the prior itself


def test_a_models_floor_row_follows_its_observations() -> None:
    model = PrefillTimeModel(PrefillPrior(0.01, 1e-4, 1e-9))
    assert model.floor_row() == (0.01, 1e-4, 1e-9, 1.0)
    model.observe(1000, 0, 10 * model.estimate(1000, 0))
    assert model.floor_row()[3] == model.floor_factor() > 1.0
    model.set_prior(PrefillPrior(0.02, 1e-4, 1e-9), measured=True)
    assert model.floor_row() == (0.02, 1e-4, 1e-9, 1.0)


def test_transfer_fits_over_arrays_are_estimate_per_pair() -> None:
    """What the pull bounds compute from ``fits_from`` and ``default_fit``, over arrays."""
    model = TransferModel(default_bandwidth_bytes_per_s=1e9, default_latency_s=0.002)
    a, b, c = NodeId("a"), NodeId("b"), NodeId("c")
    model.observe(a, b, 10**6, 0.01)
    model.observe(a, b, 10**8, 0.2)
    pairs = [(a, b), (a, c), (b, a), (a, b)]
    nbytes = np.array([10**7, 5 * 10**6, 0, -5], np.int64)
    learned = {(src, dst): (lat, spb) for src in (a, b) for dst, lat, spb in model.fits_from(src)}
    fits = np.array([learned.get(pair, model.default_fit) for pair in pairs])
    got = (fits[:, 0] + np.maximum(nbytes, 0) * fits[:, 1]).tolist()
    assert got == [model.estimate(s, d, int(n)) for (s, d), n in zip(pairs, nbytes, strict=True)]


@st.composite
def decode_situations(
    draw: st.DrawFn,
) -> tuple[Scheduler, list[NodeState], DecodeChoice]:
    s = Scheduler(
        round_number_config(policy=Policy.KV_CENTRIC, priors_measured=draw(st.booleans()))
    )
    for _ in range(draw(st.integers(0, 30))):  # lengths seen so far
        s.output_lengths.observe("m", "t", draw(st.integers(1, 4000)), censored=draw(st.booleans()))
    prefill = make_node("p", block_size=16, kv_bytes_per_token=1000)
    nodes = []
    for i in range(draw(st.integers(1, 14))):
        node = make_node(
            f"d{i:02d}",
            "decode",
            block_size=16,
            kv_bytes_per_token=1000,
            running_requests=draw(st.sampled_from([0, 1, 3, 8, 64, -1])),
            free_blocks=draw(st.sampled_from([10, 10_000])),
        )
        nodes.append(node)
        if draw(st.booleans()):
            s.set_measured_priors(
                node.node_id,
                None,
                DecodePrior(draw(coefficient), draw(coefficient), draw(coefficient)),
            )
        model = s.decode_model(node.node_id)
        for _ in range(draw(st.integers(0, 10))):
            batch, context = draw(st.floats(1.0, 64.0)), draw(st.floats(0.0, 1e6))
            model.observe(batch, context, max(1e-9, model.estimate(batch, context)) * draw(scale))
    for k in range(draw(st.integers(0, 8))):  # decodes of ours on some nodes
        target = draw(st.sampled_from(nodes))
        placed = ScheduleRequest(
            request_id=f"q{k}",
            prompt_tokens=draw(st.integers(1, 8000)),
            prefix_blocks={},
            max_new_tokens=draw(st.integers(1, 512)),
            slo=Slo(ttft_s=1e9, tbt_s=1e9),
            length_key=("m", "t"),
        )
        decision = s.schedule(placed, [prefill, target], NOW - draw(st.floats(0.0, 5.0)))
        if isinstance(decision, Placement):
            s.on_assigned(placed, decision, NOW - 1)
            if draw(st.booleans()):
                s.on_decode_started(placed.request_id, target.node_id, NOW - 0.5)
    req = ScheduleRequest(
        request_id="r",
        prompt_tokens=draw(st.integers(1, 20_000)),
        prefix_blocks={},
        max_new_tokens=8,
        slo=Slo(ttft_s=30.0, tbt_s=1.0),
        length_key=("m", "t"),
    )
    at_s = NOW + draw(st.sampled_from([0.0, 0.01, 0.5, 3.0, 60.0, -1.0]))
    return s, nodes, DecodeChoice(req, prefill, at_s, NOW)


@settings(max_examples=300, deadline=None)
@given(decode_situations())
def test_the_decode_contenders_first_is_the_full_rankings_first(
    situation: tuple[Scheduler, list[NodeState], DecodeChoice],
) -> None:
    s, nodes, choice = situation
    with patch.object(policies, "VECTOR_MIN_NODES", 10**9):  # every node's TBT, ranked
        full = s.policy.order_decode(list(nodes), choice, s)
    with patch.object(policies, "VECTOR_MIN_NODES", 0):
        fast = s.policy.order_decode(list(nodes), choice, s)
    assert fast[:1] == full[:1]
    assert all(c in full for c in fast)
    tbts = s.tbt_all(nodes, choice.at_s, choice.now_s, choice.request)
    assert full == LowestTbt().rank(
        [
            DecodeCandidate(n, t)
            for n, t in zip(nodes, tbts, strict=True)
            if n in [c.node for c in full]
        ]
    )
    bounds = s.tbt_floors(nodes, choice.at_s, choice.now_s, choice.request)
    for bound, tbt in zip(bounds, tbts, strict=True):
        assert bound <= tbt * (1 + 1e-9)


def test_decode_nodes_that_cannot_win_get_no_tbt() -> None:
    """One idle decode node among 199 with large reported batches: only its TBT and those
    whose bound reaches it are evaluated."""
    s = Scheduler(round_number_config(policy=Policy.KV_CENTRIC))
    nodes = [
        make_node(f"d{i:03d}", "decode", block_size=16, kv_bytes_per_token=1000,
                  running_requests=0 if i == 150 else 64)
        for i in range(200)
    ]  # fmt: skip
    req = ScheduleRequest("r", 1000, {}, 8, Slo(30.0, 1.0))
    choice = DecodeChoice(req, make_node("p", block_size=16, kv_bytes_per_token=1000), NOW, NOW)
    asked: list[str] = []
    real = s.tbt_at

    def counting(node: NodeState, at_s: float, now_s: float, r: ScheduleRequest) -> float:
        asked.append(node.node_id)
        return real(node, at_s, now_s, r)

    with patch.object(s, "tbt_at", counting):
        ranked = s.policy.order_decode(nodes, choice, s)
    assert [c.node.node_id for c in ranked] == ["d150"]
    assert asked == ["d150"]


@settings(max_examples=300, deadline=None)
@given(decode_situations(), st.integers(0, 24))
def test_forecasts_of_nodes_without_our_decodes_are_with_foreign(
    situation: tuple[Scheduler, list[NodeState], DecodeChoice], extra: int
) -> None:
    """``forecasts`` takes the survivals of nodes running none of our decodes in one
    array call (from ``_VECTOR_MIN_SHARES`` of them): each must be ``with_foreign``'s."""
    s, nodes, choice = situation
    nodes = nodes + [
        make_node(f"x{i:02d}", "decode", block_size=16, kv_bytes_per_token=1000,
                  running_requests=(i * 7) % 70 - 1)
        for i in range(extra)
    ]  # fmt: skip
    lengths = s.lengths_for(choice.request)
    got = s.forecasts(nodes, choice.at_s, choice.now_s, lengths)
    for node, forecast in zip(nodes, got, strict=True):
        book = s._book(node.node_id)
        if book.decodes:
            continue
        model = s.decode_model(node.node_id)
        step_s = s.reported_step_s(node)
        want = with_foreign(
            0.0, 0.0, 0, node.running_requests, choice.at_s, choice.now_s, lengths, model, step_s
        )
        assert forecast == want
