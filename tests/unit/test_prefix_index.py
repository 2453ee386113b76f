"""PrefixIndex against a brute-force model, plus table-driven stream handling.

The model is what the index must equal: per node an epoch, a last applied seq, a stale
flag and a plain ``set`` of keys; ``match`` is a prefix walk per node. Keys come from a
universe of 10 so nodes overlap constantly, and a bound of 5 keys per node makes the
memory-bound path (drop everything, RESYNC) common.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from conductor.core.prefix_index import ApplyOutcome, IndexStats, NodeId, PrefixIndex
from kvc import native
from kvc.block_keys import BlockKey

A, B, C, D = NodeId("a"), NodeId("b"), NodeId("c"), NodeId("d")


def keys(*values: int) -> list[BlockKey]:
    return [BlockKey(v) for v in values]


# ------------------------------------------------------------------ brute force


@dataclass
class ModelNode:
    epoch: str
    seq: int
    keys: set[BlockKey] = field(default_factory=set)
    stale: bool = False


def model_apply(
    model: dict[NodeId, ModelNode],
    bound: int,
    node: NodeId,
    epoch: str,
    seq: int,
    stored: Sequence[BlockKey],
    removed: Sequence[BlockKey],
    cleared: bool,
) -> ApplyOutcome:
    state = model.get(node)
    if state is None or state.epoch != epoch or state.stale:
        return ApplyOutcome.RESYNC
    if seq <= state.seq:
        return ApplyOutcome.DUPLICATE
    if seq != state.seq + 1:
        return ApplyOutcome.RESYNC
    if cleared:
        state.keys.clear()
    state.keys -= set(removed)
    if len(state.keys | set(stored)) > bound:
        state.keys.clear()
        state.stale = True
        return ApplyOutcome.RESYNC
    state.keys |= set(stored)
    state.seq = seq
    return ApplyOutcome.APPLIED


def model_match(model: dict[NodeId, ModelNode], prompt: Sequence[BlockKey]) -> dict[NodeId, int]:
    result: dict[NodeId, int] = {}
    for node, state in model.items():
        depth = 0
        while depth < len(prompt) and prompt[depth] in state.keys:
            depth += 1
        if depth:  # nodes holding none are absent
            result[node] = depth
    return result


# -------------------------------------------------------------- stateful test

NODES = st.sampled_from([A, B, C, D])
EPOCHS = st.sampled_from(["e1", "e2"])
KEY_LISTS = st.lists(st.integers(0, 9).map(BlockKey), max_size=4)
BOUND = 5


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex(max_keys_per_node=BOUND)
        self.model: dict[NodeId, ModelNode] = {}

    @initialize(snapshots=st.lists(KEY_LISTS, min_size=4, max_size=4))
    def start(self, snapshots: list[list[BlockKey]]) -> None:
        for node, snapshot in zip((A, B, C, D), snapshots, strict=True):
            self.reset(node, "e1", 0, snapshot)

    @rule(node=NODES, epoch=EPOCHS, seq=st.integers(0, 5), snapshot=KEY_LISTS)
    def reset(self, node: NodeId, epoch: str, seq: int, snapshot: list[BlockKey]) -> None:
        self.index.reset_node(node, epoch, seq, snapshot)
        self.model[node] = ModelNode(epoch, seq, set(snapshot))

    @rule(node=NODES)
    def remove(self, node: NodeId) -> None:
        self.index.remove_node(node)
        self.model.pop(node, None)

    @rule(
        node=NODES,
        epoch_change=st.sampled_from([False, False, False, True]),
        step=st.sampled_from([1, 1, 1, 1, 0, -1, 2]),
        stored=KEY_LISTS,
        removed=KEY_LISTS,
        cleared=st.sampled_from([False, False, False, True]),
    )
    def apply(
        self,
        node: NodeId,
        epoch_change: bool,
        step: int,
        stored: list[BlockKey],
        removed: list[BlockKey],
        cleared: bool,
    ) -> None:
        state = self.model.get(node)
        epoch = "e1" if state is None else state.epoch
        if epoch_change:
            epoch = "e2" if epoch == "e1" else "e1"
        seq = max(0, (0 if state is None else state.seq) + step)
        was_stale = state is not None and state.stale
        expected = model_apply(self.model, BOUND, node, epoch, seq, stored, removed, cleared)
        got = self.index.apply(node, epoch, seq, stored=stored, removed=removed, cleared=cleared)
        assert got is expected
        if state is None:
            event("apply: unknown node")
        elif was_stale:
            event("apply: stale node")
        elif got is ApplyOutcome.RESYNC:
            event("apply: overflow" if state.stale else "apply: gap or epoch")
        else:
            event(f"apply: {got.name}")

    @rule(prompt=st.lists(st.integers(0, 9).map(BlockKey), max_size=8))
    def match(self, prompt: list[BlockKey]) -> None:
        got = self.index.match(prompt)
        expected = model_match(self.model, prompt)
        assert got == expected

        best_len, holder = self.index.best_match(prompt)
        top = max(expected.values(), default=0)
        assert best_len == top
        if top == 0:
            assert holder is None
        else:
            assert holder == min(n for n, depth in expected.items() if depth == top)

    @rule(node=NODES, data=st.data())
    def match_a_held_chain(self, node: NodeId, data: st.DataObject) -> None:
        held = sorted(self.model[node].keys) if node in self.model else []
        prompt = data.draw(st.permutations(held)) + data.draw(KEY_LISTS)
        assert self.index.match(prompt) == model_match(self.model, prompt)

    @invariant()
    def equals_model(self) -> None:
        self.index.check_invariants()
        assert self.index.nodes() == sorted(self.model)
        for node, state in self.model.items():
            assert self.index.position(node) == (state.epoch, state.seq)
            assert self.index.node_keys(node) == state.keys
            assert self.index.node_key_count(node) == len(state.keys) <= BOUND
        distinct = set().union(*(s.keys for s in self.model.values()))
        assert self.index.stats() == IndexStats(
            nodes=len(self.model),
            keys=len(distinct),
            entries=sum(len(s.keys) for s in self.model.values()),
        )


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_the_python_twins_follow_the_model_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine above with the compiled lookups and placing off: what runs where
    ``kvc._native`` was not built (events of a few keys: ``position_of``, ``_place_one``)."""
    for name in ("probe_set_ids", "probe_runs", "probe_slots", "place_keys"):
        monkeypatch.setattr(native, name, None)
    run_state_machine_as_test(
        IndexMachine, settings=settings(max_examples=100, stateful_step_count=40, deadline=None)
    )


# ---------------------------------------------------------------- table-driven


@pytest.mark.parametrize(
    ("node", "epoch", "seq", "expected", "position_after"),
    [
        pytest.param(A, "e1", 6, ApplyOutcome.APPLIED, ("e1", 6), id="next-seq"),
        pytest.param(A, "e1", 5, ApplyOutcome.DUPLICATE, ("e1", 5), id="same-seq"),
        pytest.param(A, "e1", 1, ApplyOutcome.DUPLICATE, ("e1", 5), id="old-seq"),
        pytest.param(A, "e1", 0, ApplyOutcome.DUPLICATE, ("e1", 5), id="seq-zero"),
        pytest.param(A, "e1", 7, ApplyOutcome.RESYNC, ("e1", 5), id="gap"),
        pytest.param(A, "e1", 10**9, ApplyOutcome.RESYNC, ("e1", 5), id="huge-gap"),
        pytest.param(A, "e2", 6, ApplyOutcome.RESYNC, ("e1", 5), id="new-epoch"),
        pytest.param(A, "e2", 1, ApplyOutcome.RESYNC, ("e1", 5), id="new-epoch-restart"),
        pytest.param(B, "e1", 6, ApplyOutcome.RESYNC, None, id="unknown-node"),
    ],
)
def test_apply_stream_positions(
    node: NodeId,
    epoch: str,
    seq: int,
    expected: ApplyOutcome,
    position_after: tuple[str, int] | None,
) -> None:
    index = PrefixIndex()
    index.reset_node(A, "e1", 5, keys(1, 2))
    outcome = index.apply(node, epoch, seq, stored=keys(3))
    assert outcome is expected
    assert index.position(node) == position_after
    applied = expected is ApplyOutcome.APPLIED
    assert index.node_key_count(A) == (3 if applied else 2)  # nothing applied otherwise


def test_gap_is_sticky_until_snapshot_and_late_event_fills_it() -> None:
    index = PrefixIndex()
    index.reset_node(A, "e1", 0, [])
    assert index.apply(A, "e1", 1, stored=keys(1)) is ApplyOutcome.APPLIED
    assert index.apply(A, "e1", 3, stored=keys(3)) is ApplyOutcome.RESYNC
    assert index.apply(A, "e1", 4, stored=keys(4)) is ApplyOutcome.RESYNC
    assert index.apply(A, "e1", 2, stored=keys(2)) is ApplyOutcome.APPLIED  # reordered
    assert index.apply(A, "e1", 3, stored=keys(3)) is ApplyOutcome.APPLIED
    assert index.node_keys(A) == frozenset(keys(1, 2, 3))
    # A restarted agent: new epoch, keys wiped, new snapshot resumes the stream.
    assert index.apply(A, "e2", 1, stored=keys(9)) is ApplyOutcome.RESYNC
    index.reset_node(A, "e2", 7, keys(8))
    assert index.position(A) == ("e2", 7)
    assert index.node_keys(A) == frozenset(keys(8))
    assert index.apply(A, "e2", 8) is ApplyOutcome.APPLIED  # load-only: seq advances
    assert index.position(A) == ("e2", 8)


@pytest.mark.parametrize(
    ("stored", "removed", "cleared", "after"),
    [
        pytest.param([], [], False, {1, 2, 3}, id="load-only"),
        pytest.param([4, 5], [], False, {1, 2, 3, 4, 5}, id="stored"),
        pytest.param([3, 3, 4], [], False, {1, 2, 3, 4}, id="stored-dup-keys"),
        pytest.param([], [2, 9], False, {1, 3}, id="removed-incl-unknown"),
        pytest.param([], [], True, set(), id="cleared"),
        pytest.param([7], [1], True, {7}, id="cleared-then-stored"),
        pytest.param([2], [2], False, {1, 2, 3}, id="removed-then-stored"),
    ],
)
def test_event_contents(
    stored: list[int], removed: list[int], cleared: bool, after: set[int]
) -> None:
    index = PrefixIndex()
    index.reset_node(A, "e", 0, keys(1, 2, 3))
    outcome = index.apply(A, "e", 1, stored=keys(*stored), removed=keys(*removed), cleared=cleared)
    assert outcome is ApplyOutcome.APPLIED
    assert index.node_keys(A) == frozenset(keys(*after))
    index.check_invariants()


@pytest.mark.parametrize("bad_seq", [-1, True, 1.5])
def test_rejects_malformed_seq(bad_seq: object) -> None:
    index = PrefixIndex()
    with pytest.raises(ValueError, match="seq"):
        index.reset_node(A, "e", bad_seq, [])  # type: ignore[arg-type]
    index.reset_node(A, "e", 0, [])
    with pytest.raises(ValueError, match="seq"):
        index.apply(A, "e", bad_seq)  # type: ignore[arg-type]


@pytest.mark.parametrize("bound", [0, -5, True])
def test_rejects_bad_bound(bound: int) -> None:
    with pytest.raises(ValueError, match="max_keys_per_node"):
        PrefixIndex(max_keys_per_node=bound)


# ---------------------------------------------------------------- memory bound


def test_memory_bound_drops_node_and_demands_resync() -> None:
    index = PrefixIndex(max_keys_per_node=4)
    index.reset_node(A, "e", 0, keys(1, 2, 3))
    index.reset_node(B, "e", 0, keys(1, 2))
    assert index.apply(A, "e", 1, stored=keys(3, 4)) is ApplyOutcome.APPLIED  # exactly 4
    assert index.apply(A, "e", 2, stored=keys(5), removed=keys(1)) is ApplyOutcome.APPLIED
    assert index.apply(A, "e", 3, stored=keys(6)) is ApplyOutcome.RESYNC  # would be 5
    assert index.node_key_count(A) == 0  # dropped, not partially kept
    assert index.match(keys(1, 2)) == {B: 2}  # other nodes untouched
    assert index.apply(A, "e", 3) is ApplyOutcome.RESYNC  # stale until a snapshot
    assert index.apply(A, "e", 4) is ApplyOutcome.RESYNC
    assert index.position(A) == ("e", 2)
    index.reset_node(A, "e", 9, keys(7, 8))
    assert index.apply(A, "e", 10, stored=keys(9)) is ApplyOutcome.APPLIED
    index.check_invariants()


def test_oversized_snapshot_is_truncated_to_a_subset() -> None:
    index = PrefixIndex(max_keys_per_node=3)
    index.reset_node(A, "e", 0, keys(1, 1, 2, 3, 4, 5))
    assert index.node_keys(A) == frozenset(keys(1, 2, 3))
    assert index.match(keys(1, 2, 3, 4)) == {A: 3}
    index.check_invariants()


# --------------------------------------------------------------- nodes, match


def test_remove_node_frees_its_keys_and_slot() -> None:
    index = PrefixIndex()
    index.reset_node(A, "e", 0, keys(1, 2, 3))
    index.reset_node(B, "e", 0, keys(1, 2))
    index.reset_node(C, "e", 0, keys(1))
    index.remove_node(A)
    index.remove_node(A)  # idempotent
    index.remove_node(NodeId("nobody"))
    assert index.nodes() == [B, C]
    assert index.position(A) is None
    assert index.node_key_count(A) == 0
    assert index.stats() == IndexStats(nodes=2, keys=2, entries=3)
    assert index.match(keys(1, 2, 3)) == {B: 2, C: 1}
    index.reset_node(D, "e", 0, keys(1, 2, 3))  # reuses the freed slot
    assert index.match(keys(1, 2, 3)) == {B: 2, C: 1, D: 3}
    index.check_invariants()
    for node in (B, C, D):
        index.remove_node(node)
    assert index.stats() == IndexStats(nodes=0, keys=0, entries=0)
    assert index.match(keys(1)) == {}
    assert index.best_match(keys(1)) == (0, None)
    index.check_invariants()


def test_match_reports_the_holders_and_best_breaks_ties_by_id() -> None:
    index = PrefixIndex()
    assert index.match(keys(1, 2)) == {}
    for node, held in [(C, (1, 2, 3)), (B, (1, 2, 3, 9)), (A, (2, 3)), (D, ())]:
        index.reset_node(node, "e", 0, keys(*held))
    assert index.match(keys(1, 2, 3, 4)) == {B: 3, C: 3}
    assert index.match([]) == {}
    assert index.best_match(keys(1, 2, 3, 4)) == (3, B)
    assert index.best_match(keys(2, 3)) == (2, A)
    assert index.best_match(keys(5)) == (0, None)
    # The prefix stops at the first miss, even when later keys are held.
    assert index.match(keys(1, 4, 2, 3)) == {B: 1, C: 1}
    assert index.match(keys(1, 2, 9, 3)) == {B: 4, C: 2}


def test_match_over_many_nodes() -> None:
    index = PrefixIndex()
    chain = keys(*range(100))
    nodes = [NodeId(f"n{i:03d}") for i in range(200)]
    for depth, node in enumerate(nodes):
        index.reset_node(node, "e", 0, chain[: depth % 101])
    result = index.match(chain)
    assert result == {node: depth % 101 for depth, node in enumerate(nodes) if depth % 101}
    assert index.best_match(chain) == (100, NodeId("n100"))


# ------------------------------------------------------------- the key table


@pytest.fixture(params=["compiled", "python"])
def probe(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Lookups (and the placing of a few keys) through the compiled code
    (kvc/_native.c) and through the NumPy and Python twins."""
    if request.param == "python":
        monkeypatch.setattr(native, "probe_set_ids", None)
        monkeypatch.setattr(native, "probe_runs", None)
        monkeypatch.setattr(native, "probe_slots", None)
        monkeypatch.setattr(native, "place_keys", None)
    elif native.probe_set_ids is None:
        pytest.skip("kvc._native was not built here (tests/unit/test_block_keys.py says why)")
    return str(request.param)


@pytest.mark.parametrize(("seed", "most"), [(0, 300), (1, 300), (2, 300), (3, 300), (4, 3), (5, 9)])
def test_key_table_grows_shrinks_and_reuses_deleted_slots(seed: int, most: int, probe: str) -> None:
    """Thousands of keys over a few nodes: the table grows from its minimum, deleted slots
    are reused, it shrinks when nodes leave, and every answer equals the model's; with
    events of up to ``most`` keys (a few: looked up and placed one by one)."""
    rng = random.Random(seed)
    index = PrefixIndex(max_keys_per_node=5_000)
    model: dict[NodeId, ModelNode] = {}
    universe = [BlockKey(rng.getrandbits(64)) for _ in range(3_000)] + keys(0, 1, 2**64 - 1)
    nodes = [NodeId(f"n{i}") for i in range(6)]
    seqs = dict.fromkeys(nodes, 0)
    for step in range(400):
        node = rng.choice(nodes)
        roll = rng.random()
        if roll < 0.05:
            index.remove_node(node)
            model.pop(node, None)
        elif roll < 0.12 or node not in model:
            snapshot = rng.sample(universe, rng.randint(0, 1_500))
            index.reset_node(node, "e", seqs[node], snapshot)
            model[node] = ModelNode("e", seqs[node], set(snapshot))
        else:
            seqs[node] = model[node].seq + 1
            stored = rng.sample(universe, rng.randint(0, most))
            held = sorted(model[node].keys)
            removed = rng.sample(held, min(len(held), rng.randint(0, most), 200))
            cleared = rng.random() < 0.03
            expected = model_apply(model, 5_000, node, "e", seqs[node], stored, removed, cleared)
            got = index.apply(
                node, "e", seqs[node], stored=stored, removed=removed, cleared=cleared
            )
            assert got is expected
        if step % 25 == 0:
            index.check_invariants()
            for other, state in model.items():
                assert index.node_keys(other) == state.keys
            chain = rng.sample(universe, 64)
            for state in model.values():
                chain = sorted(state.keys)[:40] + chain
                break
            assert index.match(chain) == model_match(model, chain)
    index.check_invariants()
    for node in nodes:
        index.remove_node(node)
    assert index.stats() == IndexStats(nodes=0, keys=0, entries=0)
    assert index.memory_bytes() == PrefixIndex().memory_bytes()  # back to the minimum table
    index.check_invariants()


def test_long_prompt_matches_across_lookup_chunks(probe: str) -> None:
    """Prefixes that end inside, at and across the chunk boundaries of the lookup."""
    index = PrefixIndex()
    chain = [BlockKey(k) for k in range(5_000, 8_000)]
    depths = [0, 1, 15, 16, 17, 79, 80, 81, 335, 336, 337, 1_360, 2_999, 3_000]
    nodes = [NodeId(f"n{i:02d}") for i in range(len(depths))]
    for node, depth in zip(nodes, depths, strict=True):
        index.reset_node(node, "e", 0, chain[:depth])
    assert index.match(chain) == {n: d for n, d in zip(nodes, depths, strict=True) if d}
    assert index.best_match(chain) == (3_000, nodes[-1])
    assert index.best_match(chain[:337]) == (337, nodes[10])
    assert index.best_match(chain[:336]) == (336, nodes[9])
    index.check_invariants()


@pytest.mark.parametrize("seed", range(4))
def test_compiled_and_numpy_probes_agree_on_a_crowded_table(seed: int) -> None:
    """Set ids of present, deleted and never-seen keys, in a table with overflowed rows
    and tombstones, the same through both probes (and through both ends of a slice)."""
    if native.probe_set_ids is None:
        pytest.skip("kvc._native was not built here (tests/unit/test_block_keys.py says why)")
    rng = random.Random(seed)
    index = PrefixIndex(max_keys_per_node=100_000)
    universe = [BlockKey(rng.getrandbits(64)) for _ in range(6_000)] + keys(0, 2**64 - 1)
    for i in range(5):
        index.reset_node(NodeId(f"n{i}"), "e", 0, rng.sample(universe, 2_500))
    index.apply(
        NodeId("n0"), "e", 1, removed=rng.sample(sorted(index.node_keys(NodeId("n0"))), 900)
    )
    table = index._table
    assert table.overflowed.any(), "the test wants overflowed rows"
    assert table.tombs, "the test wants deleted slots"
    probe_keys = [
        *rng.sample(universe, 3_000),
        *(BlockKey(rng.getrandbits(64)) for _ in range(500)),
    ]
    for start, end in ((0, len(probe_keys)), (17, 1_041), (5, 5)):
        numpy_ids = table.set_ids_of(np.array(probe_keys[start:end], dtype=np.uint64))
        compiled = table.set_ids_in(probe_keys, start, end)
        assert compiled.tolist() == numpy_ids.tolist()
    assert (
        table.set_ids_in(tuple(probe_keys), 3, 9).tolist()
        == table.set_ids_of(np.array(probe_keys[3:9], dtype=np.uint64)).tolist()
    )
    # Where the set id changes: the compiled runs, the NumPy ones and a plain walk.
    run_keys = [k for k in probe_keys for _ in range(rng.randint(1, 4))]  # runs of a key
    for start, end, last in ((0, len(run_keys), -1), (17, 1_041, 0), (5, 5, 2), (3, 9, 7)):
        ids = table.set_ids_of(np.array(run_keys[start:end], dtype=np.uint64)).tolist()
        walked: list[int] = []
        before = last
        for at, set_id in enumerate(ids, start):
            if set_id != before:
                walked += (at, set_id)
                before = set_id
        compiled_runs = table.run_changes(run_keys, start, end, last)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(native, "probe_runs", None)
            patch.setattr(native, "probe_set_ids", None)
            numpy_runs = table.run_changes(run_keys, start, end, last)
        assert compiled_runs == numpy_runs == walked


@pytest.mark.parametrize("bad", [2**64, -1, "k"])
def test_match_rejects_keys_outside_uint64(bad: object, probe: str) -> None:
    index = PrefixIndex()
    index.reset_node(A, "e", 0, keys(*range(100)))
    prompt = [*keys(*range(50)), bad]
    with pytest.raises(ValueError, match="64-bit"):
        index.match(prompt)  # type: ignore[arg-type]


def test_rejects_keys_outside_uint64() -> None:
    index = PrefixIndex()
    with pytest.raises(ValueError, match="64-bit"):
        index.reset_node(A, "e", 0, keys(-1))
    index.reset_node(A, "e", 0, keys(1))
    with pytest.raises(ValueError, match="64-bit"):
        index.apply(A, "e", 1, stored=keys(2**64))
    assert index.position(A) == ("e", 0)
    index.check_invariants()


def test_other_holders_counts_the_replicas_elsewhere() -> None:
    index = PrefixIndex()
    for node in ("a", "b", "c"):
        index.reset_node(NodeId(node), "e", 0, [BlockKey(1)] if node != "c" else [])
    assert index.other_holders(BlockKey(1), NodeId("a")) == 1
    assert index.other_holders(BlockKey(1), NodeId("c")) == 2
    assert index.other_holders(BlockKey(9), NodeId("a")) == 0
    assert index.other_holders(BlockKey(1), NodeId("unknown")) == 2


@settings(max_examples=60, deadline=None)
@given(
    holdings=st.lists(
        st.sets(st.integers(min_value=0, max_value=40), max_size=30), min_size=1, max_size=6
    ),
    removed=st.sets(st.integers(min_value=0, max_value=40), max_size=10),
)
def test_replicated_keys_are_each_nodes_keys_held_elsewhere(
    holdings: list[set[int]], removed: set[int]
) -> None:
    """Against a brute-force count over the same holdings, after removals too."""
    index = PrefixIndex()
    nodes = [NodeId(f"n{i}") for i in range(len(holdings))]
    for node, held in zip(nodes, holdings, strict=True):
        index.reset_node(node, "e", 0, [BlockKey(k) for k in held])
    index.apply(nodes[0], "e", 1, removed=[BlockKey(k) for k in removed])
    holdings[0] -= removed
    got = index.replicated_keys([*nodes, NodeId("unknown")])
    for i, node in enumerate(nodes):
        others = set().union(*(h for j, h in enumerate(holdings) if j != i))
        assert got[node].tolist() == sorted(holdings[i] & others)
        assert other_holders_agree(index, node, got[node].tolist())
    assert got[NodeId("unknown")].tolist() == []


def other_holders_agree(index: PrefixIndex, node: NodeId, keys: list[int]) -> bool:
    return all(index.other_holders(BlockKey(k), node) > 0 for k in keys)


def test_the_compiled_slot_probe_and_placing_refuse_what_they_cannot_take() -> None:
    if native.probe_slots is None or native.place_keys is None:
        pytest.skip("kvc._native was not built here (tests/unit/test_block_keys.py says why)")
    rows, row = 8, 16
    table_keys = np.zeros(rows * row, dtype=np.uint64)
    table_ids = np.zeros(rows * row, dtype=np.uint32)
    overflowed = np.zeros(rows, dtype=bool)
    args = (table_keys, table_ids, overflowed, rows, 5, row)
    assert native.place_keys([7, 2**64 - 1], 2, *args) == 0
    assert native.probe_slots([7, 8], *args)[1::2] == [2, 0]
    assert native.probe_slots([7, 8], *args)[2] == -1
    with pytest.raises(ValueError, match="64-bit"):
        native.place_keys([9, -1], 2, *args)
    assert native.probe_slots([9], *args) == [-1, 0]  # a bad key: nothing placed
    with pytest.raises(ValueError, match="live set id"):
        native.place_keys([9], 1, *args)
    with pytest.raises(ValueError, match="list or a tuple"):
        native.probe_slots(iter([7]), *args)  # type: ignore[arg-type]
    full = np.full(rows * row, 3, dtype=np.uint32)
    with pytest.raises(ValueError, match="no free slot"):
        native.place_keys([11], 2, table_keys, full, overflowed, rows, 5, row)
    assert overflowed.all()  # every row it passed is flagged
