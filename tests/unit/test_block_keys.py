"""Canonical chained block keys: committed test vector, isolation, chaining, determinism."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import sysconfig
from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvc import block_keys, native
from kvc.block_keys import (
    KEY_LAYOUT,
    KEY_LAYOUTS,
    ROOT_PARENT_KEY,
    BlockKey,
    BlockKeySpec,
    compute_block_keys,
    namespace_digest,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# The shared test vectors, one per layout. Computed once and committed: any change to
# these numbers is a wire-format change (every shadow index and every node's cache would
# stop matching) and needs a new key layout, not an edited vector.
VECTOR_TOKENS = [(i * 7919 + 13) % 151936 for i in range(100)]  # 6 full blocks + 4 tokens
VECTOR_TENANT = "tenant-a"
VECTOR_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
VECTOR_BLOCK_SIZE = 16
VECTOR_KEYS = {
    1: [
        0x3CDF531C3B7A317F,
        0x8A17423F8D5D41EE,
        0xE934811023552E23,
        0x5AB92E2BCB4FA7A4,
        0xDE421F29294EE98A,
        0x8353E74758B3E3AE,
    ],
    2: [
        0xF8E8CFBC46BB6880,
        0x3C4143AD29ADA369,
        0xEEA60635C516884E,
        0xD64D1F417582C70A,
        0xCA6E88D5BBD7014C,
        0x513E5CF74DE61315,
    ],
}


def reference_keys(
    tokens: list[int],
    tenant: str,
    model: str,
    block_size: int,
    parent: int = 0,
    layout: int = KEY_LAYOUT,
) -> list[int]:
    """The layouts written out independently (struct, one stdlib hash per block, no
    template): layout 2 with the parent as hashlib's own ``node_offset``."""
    salt = namespace_digest(tenant, model)
    keys: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
        if layout == 1:
            digest = hashlib.blake2b(
                struct.pack("<Q", parent) + block, digest_size=8, salt=salt,
                person=b"kvc-blockkey-v1",
            )  # fmt: skip
        else:
            digest = hashlib.blake2b(
                block, digest_size=8, salt=salt, person=b"kvc-blockkey-v2", node_offset=parent
            )
        parent = int.from_bytes(digest.digest(), "little")
        keys.append(parent)
    return keys


def keys_of(
    tokens: list[int], tenant: str = "t", model: str = "m", block_size: int = 4
) -> list[BlockKey]:
    return compute_block_keys(tokens, tenant=tenant, model=model, block_size=block_size)


@pytest.mark.parametrize("layout", KEY_LAYOUTS)
def test_committed_vector(layout: int) -> None:
    got = compute_block_keys(
        VECTOR_TOKENS, tenant=VECTOR_TENANT, model=VECTOR_MODEL, block_size=VECTOR_BLOCK_SIZE,
        layout=layout,
    )  # fmt: skip
    assert got == VECTOR_KEYS[layout]


def test_layout_2_is_the_default() -> None:
    assert KEY_LAYOUT == 2
    got = compute_block_keys(
        VECTOR_TOKENS, tenant=VECTOR_TENANT, model=VECTOR_MODEL, block_size=VECTOR_BLOCK_SIZE
    )
    assert got == VECTOR_KEYS[2]


@pytest.mark.parametrize("layout", [0, 3, -1, True, 2.0, "2"])
def test_unknown_layout_is_a_value_error(layout: object) -> None:
    with pytest.raises(ValueError, match="layout"):
        compute_block_keys([1, 2, 3, 4], tenant="t", model="m", block_size=2, layout=layout)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [0, 3, -1])
def test_the_compiled_path_refuses_an_unknown_layout(layout: int) -> None:
    if native.chain_keys is None:
        pytest.skip(
            "kvc._native was not built here: no C compiler "
            "(test_the_compiled_module_is_built_where_a_compiler_is fails otherwise)"
        )
    with pytest.raises(ValueError, match="layout"):
        native.chain_keys([1, 2], b"s", b"p", 2, 0, layout)


def test_namespace_digest_vector() -> None:
    salt = hashlib.blake2b(digest_size=16, person=b"kvc-namespace-v1")
    for part in (VECTOR_TENANT.encode(), VECTOR_MODEL.encode()):
        salt.update(struct.pack("<Q", len(part)) + part)
    assert namespace_digest(VECTOR_TENANT, VECTOR_MODEL) == salt.digest()


@pytest.mark.parametrize("layout", KEY_LAYOUTS)
def test_matches_reference_layout(layout: int) -> None:
    reference = reference_keys(
        VECTOR_TOKENS, VECTOR_TENANT, VECTOR_MODEL, VECTOR_BLOCK_SIZE, layout=layout
    )
    assert reference == VECTOR_KEYS[layout]


def test_the_layouts_share_no_key() -> None:
    assert not set(VECTOR_KEYS[1]) & set(VECTOR_KEYS[2])


def test_partial_block_has_no_key() -> None:
    full = keys_of(VECTOR_TOKENS[:96], block_size=16)
    assert len(full) == 6
    assert keys_of(VECTOR_TOKENS, block_size=16) == full
    assert keys_of(VECTOR_TOKENS[:15], block_size=16) == []
    assert keys_of([], block_size=16) == []


@pytest.mark.parametrize(
    ("other_tenant", "other_model"),
    [
        ("tenant-b", VECTOR_MODEL),
        (VECTOR_TENANT, "other-model"),
        # Length prefixes: moving characters between tenant and model changes the keys.
        ("tenant-aQ", "wen/Qwen2.5-0.5B-Instruct"),
        ("", VECTOR_TENANT + VECTOR_MODEL),
    ],
)
def test_tenant_and_model_isolation(other_tenant: str, other_model: str) -> None:
    mine = keys_of(VECTOR_TOKENS, VECTOR_TENANT, VECTOR_MODEL, 16)
    theirs = keys_of(VECTOR_TOKENS, other_tenant, other_model, 16)
    assert not set(mine) & set(theirs)


def test_chaining_changing_block_zero_changes_every_key() -> None:
    tokens = list(range(64))
    changed = [1000, *tokens[1:]]
    a, b = keys_of(tokens), keys_of(changed)
    assert len(a) == len(b) == 16
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_changing_a_later_block_keeps_earlier_keys() -> None:
    tokens = list(range(64))
    changed = list(tokens)
    changed[40] = 9999  # block 10
    a, b = keys_of(tokens), keys_of(changed)
    assert a[:10] == b[:10]
    assert all(x != y for x, y in zip(a[10:], b[10:], strict=True))


def test_parent_continuation() -> None:
    tokens = list(range(200))
    whole = keys_of(tokens, block_size=16)
    head = keys_of(tokens[:64], block_size=16)
    tail = compute_block_keys(tokens[64:], tenant="t", model="m", block_size=16, parent=head[-1])
    assert head + tail == whole


def test_root_parent_is_the_default() -> None:
    tokens = list(range(32))
    explicit = compute_block_keys(
        tokens, tenant="t", model="m", block_size=8, parent=ROOT_PARENT_KEY
    )
    assert explicit == keys_of(tokens, block_size=8)


def test_spec_matches_function() -> None:
    spec = BlockKeySpec(tenant="t", model="m", block_size=4)
    tokens = list(range(13))
    assert spec.keys(tokens) == keys_of(tokens)
    assert spec.keys(tokens[4:], parent=BlockKey(spec.keys(tokens)[0])) == keys_of(tokens)[1:]
    with pytest.raises(ValueError, match="block_size"):
        BlockKeySpec(tenant="t", model="m", block_size=0)


@pytest.mark.parametrize(
    ("tokens", "block_size", "parent", "match"),
    [
        ([1, 2, 3, 4], 0, None, "block_size"),
        ([1, 2, 3, 4], -4, None, "block_size"),
        ([1, -1, 3, 4], 2, None, r"\[0, 2\*\*32\)"),
        ([1, 2**32, 3, 4], 2, None, r"\[0, 2\*\*32\)"),
        ([1, 2, 3, 4], 2, BlockKey(2**64), "uint64"),
        ([1, 2, 3, 4], 2, BlockKey(-1), "uint64"),
    ],
)
def test_validation(
    tokens: list[int], block_size: int, parent: BlockKey | None, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        compute_block_keys(tokens, tenant="t", model="m", block_size=block_size, parent=parent)


def test_non_integer_token_is_value_error() -> None:
    with pytest.raises(ValueError, match="integers"):
        compute_block_keys([1.5, 2], tenant="t", model="m", block_size=2)  # type: ignore[list-item]


@pytest.mark.parametrize("layout", KEY_LAYOUTS)
def test_extreme_token_ids(layout: int) -> None:
    tokens = [0, 2**32 - 1, 2**31, 1]
    got = compute_block_keys(tokens, tenant="t", model="m", block_size=2, layout=layout)
    assert got == reference_keys(tokens, "t", "m", 2, layout=layout)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=80),
    block_size=st.integers(min_value=1, max_value=9),
    split_blocks=st.integers(min_value=0, max_value=10),
    tenant=st.text(max_size=6),
    layout=st.sampled_from(KEY_LAYOUTS),
)
def test_properties(
    tokens: list[int], block_size: int, split_blocks: int, tenant: str, layout: int
) -> None:
    def keys(tokens: list[int], tenant: str, parent: BlockKey | None = None) -> list[BlockKey]:
        return compute_block_keys(
            tokens, tenant=tenant, model="m", block_size=block_size, parent=parent, layout=layout
        )

    whole = keys(tokens, tenant)
    assert len(whole) == len(tokens) // block_size
    assert all(0 <= k < 2**64 for k in whole)
    assert whole == reference_keys(tokens, tenant, "m", block_size, layout=layout)
    # Prefix stability and continuation at any block boundary.
    cut = min(split_blocks, len(whole)) * block_size
    head = keys(tokens[:cut], tenant)
    assert head == whole[: len(head)]
    tail = keys(tokens[cut:], tenant, parent=head[-1] if head else None)
    assert head + tail == whole
    # Another tenant shares no key with this one.
    assert not set(keys(tokens, tenant + "x")) & set(whole)


_SUBPROCESS_SCRIPT = """
import json
from kvc.block_keys import compute_block_keys
tokens = [(i * 7919 + 13) % 151936 for i in range(100)]
keys = compute_block_keys(tokens, tenant="tenant-a", model="m\\u00e9", block_size=16)
print(json.dumps([hash("salt-check"), keys]))
"""


def _json_of_script(script: str, **env_vars: str) -> Any:
    """What ``script`` prints as JSON, run by a fresh interpreter with ``env_vars`` set."""
    env = dict(os.environ, **env_vars)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    return json.loads(out.stdout)


def _keys_in_subprocess(hash_seed: str) -> tuple[int, list[int]]:
    str_hash, keys = _json_of_script(_SUBPROCESS_SCRIPT, PYTHONHASHSEED=hash_seed)
    return int(str_hash), [int(k) for k in keys]


def test_keys_do_not_depend_on_pythonhashseed() -> None:
    hash_a, keys_a = _keys_in_subprocess("0")
    hash_b, keys_b = _keys_in_subprocess("12345")
    _, keys_random = _keys_in_subprocess("random")
    assert hash_a != hash_b, "the seeds should change str hashing, else the test proves nothing"
    assert keys_a == keys_b == keys_random
    in_process = compute_block_keys(VECTOR_TOKENS, tenant="tenant-a", model="mé", block_size=16)
    assert keys_a == in_process


# --- The compiled path (kvc/_native.c) and the pure-Python fallback ---------------


def python_keys(
    tokens: Sequence[int], block_size: int, parent: int = 0, layout: int = KEY_LAYOUT
) -> list[BlockKey]:
    salt = namespace_digest("t", "m")
    person = block_keys._KEY_PERSONS[layout]
    chain = block_keys._python_chain_keys_v2 if layout == 2 else block_keys._python_chain_keys
    return chain(tokens, salt, person, block_size, parent)


def test_the_compiled_module_is_built_where_a_compiler_is() -> None:
    # setup.py marks the extension optional, so an install without a compiler still works
    # and falls back to Python. Where `make test` had a compiler it must have been built:
    # otherwise a broken C file would pass every test here through the fallback.
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) here: the keys come from the Python loop")
    assert native.AVAILABLE, "kvc._native did not build or import; see the pip log"


def test_pure_python_switch_gives_the_same_keys() -> None:
    script = (
        "import json\n"
        "from kvc import block_keys as b, native\n"
        "tokens = [(i * 7919 + 13) % 151936 for i in range(100)]\n"
        "keys = {n: b.compute_block_keys(tokens, tenant='tenant-a', model="
        "'Qwen/Qwen2.5-0.5B-Instruct', block_size=16, layout=n) for n in b.KEY_LAYOUTS}\n"
        "print(json.dumps([native.AVAILABLE, keys]))\n"
    )
    native, keys = _json_of_script(script, KVC_NATIVE="0")
    assert native is False
    assert {int(n): k for n, k in keys.items()} == VECTOR_KEYS


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=2**32 - 1),
            st.sampled_from([0, 1, 2**30 - 1, 2**30, 2**31, 2**32 - 1]),  # digit edges
        ),
        max_size=300,
    ),
    block_size=st.integers(min_value=1, max_value=70),  # one, two and three compressions
    parent=st.integers(min_value=0, max_value=2**64 - 1),
    layout=st.sampled_from(KEY_LAYOUTS),
)
def test_compiled_and_python_paths_agree(
    tokens: list[int], block_size: int, parent: int, layout: int
) -> None:
    got = compute_block_keys(
        tokens, tenant="t", model="m", block_size=block_size, parent=BlockKey(parent),
        layout=layout,
    )  # fmt: skip
    assert got == python_keys(tokens, block_size, parent, layout)


class _Index:
    """An object with ``__index__`` (as NumPy integers have), not an int."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize(
    "tokens",
    [
        (5, 6, 7, 8),  # a tuple
        range(5, 9),
        array("I", [5, 6, 7, 8]),
        [_Index(5), 6, _Index(7), 8],
        [True, False, 7, 8],  # bool is an int, as array('I') takes it
    ],
)
def test_any_sequence_of_integers(tokens: Sequence[int]) -> None:
    expected = python_keys([int(t) for t in tokens], 2)
    assert compute_block_keys(tokens, tenant="t", model="m", block_size=2) == expected
    assert python_keys(tokens, 2) == expected


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, 2, 3, 2**32], r"\[0, 2\*\*32\)"),  # checked in the trailing partial block too
        ([1, 2, -5], r"\[0, 2\*\*32\)"),
        ([1, 2**64], r"\[0, 2\*\*32\)"),
        ([1, -(2**70)], r"\[0, 2\*\*32\)"),
        ([1, _Index(2**40)], r"\[0, 2\*\*32\)"),
        ([1, "2"], "integers"),
        ([1, None], "integers"),
        ([1, 2.0], "integers"),
    ],
)
def test_bad_token_ids_fail_alike_on_both_paths(tokens: list[object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compute_block_keys(tokens, tenant="t", model="m", block_size=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        python_keys(tokens, 2)  # type: ignore[arg-type]


def test_not_a_sequence_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="integers"):
        compute_block_keys(5, tenant="t", model="m", block_size=2)  # type: ignore[arg-type]


def test_a_list_emptied_while_it_is_read_is_an_error_not_a_crash() -> None:
    tokens: list[object] = [1, 2, 3, 4, 5, 6]

    class Shrinks:
        def __index__(self) -> int:
            tokens.clear()
            return 9

    tokens[1] = Shrinks()
    if native.chain_keys is not None:
        with pytest.raises(ValueError, match="changed while being read"):
            compute_block_keys(tokens, tenant="t", model="m", block_size=2)  # type: ignore[arg-type]
    else:  # array('I', ...) reads the list as it goes, and stops where it now ends
        compute_block_keys(tokens, tenant="t", model="m", block_size=2)  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", KEY_LAYOUTS)
@pytest.mark.parametrize("block_size", [29, 30, 31, 32, 33, 61, 62, 63, 64, 65, 128, 512])
def test_blocks_of_one_two_and_more_compressions(block_size: int, layout: int) -> None:
    # Layout 1, 8 bytes of parent + 4 per token: 30 tokens fill one 128-byte BLAKE2b block
    # exactly, 31 spill into a second; 62 and 63 are the edge of a third. Layout 2, tokens
    # alone: 32 fill one block (compressed where it lies), 33 spill; 64 and 65 likewise.
    rng = random.Random(block_size)
    tokens = [rng.randrange(2**32) for _ in range(block_size * 5 + 3)]
    expected = reference_keys(tokens, "t", "m", block_size, parent=12345, layout=layout)
    got = compute_block_keys(
        tokens, tenant="t", model="m", block_size=block_size, parent=BlockKey(12345),
        layout=layout,
    )  # fmt: skip
    assert got == expected
    assert python_keys(tokens, block_size, 12345, layout) == expected


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=200),
    block_size=st.integers(min_value=1, max_value=40),
    data=st.data(),
)
def test_end_is_the_keys_of_the_slice(
    tokens: list[int], block_size: int, data: st.DataObject
) -> None:
    """``end`` hashes ``tokens[:end]``: whether it cuts the whole list's keys (within a
    block of the length) or hashes the slice, compiled or not."""
    end = data.draw(st.integers(min_value=0, max_value=len(tokens)))
    expected = python_keys(tokens[:end], block_size)
    for sequence in (tokens, tuple(tokens)):
        got = compute_block_keys(sequence, tenant="t", model="m", block_size=block_size, end=end)
        assert got == expected


def test_end_never_reads_past_itself() -> None:
    """An invalid id after ``end`` raises nothing (the prompt's keys leave it out)."""
    tokens: list[object] = [1, 2, 3, 4, 5, 2**40]
    expected = python_keys([1, 2, 3, 4, 5], 2)
    got = compute_block_keys(tokens, tenant="t", model="m", block_size=2, end=5)  # type: ignore[arg-type]
    assert got == expected
    assert compute_block_keys([1, "x"], tenant="t", model="m", block_size=2, end=1) == []  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"\[0, 2\*\*32\)"):
        compute_block_keys([1, 2**40, 3], tenant="t", model="m", block_size=2, end=2)


@pytest.mark.parametrize("end", [-1, 5, True, 2.0])
def test_end_out_of_range_is_a_value_error(end: object) -> None:
    with pytest.raises(ValueError, match="end must be"):
        compute_block_keys([1, 2, 3, 4], tenant="t", model="m", block_size=2, end=end)  # type: ignore[arg-type]
