"""Canonical chained block keys: committed test vector, isolation, chaining, determinism."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvc.block_keys import (
    ROOT_PARENT_KEY,
    BlockKey,
    BlockKeySpec,
    compute_block_keys,
    namespace_digest,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

# The shared test vector. Computed once by kvc/block_keys.py and committed:
# any change to these numbers is a wire-format change (every shadow index and every
# node's cache would stop matching) and needs a new key version, not an edited vector.
VECTOR_TOKENS = [(i * 7919 + 13) % 151936 for i in range(100)]  # 6 full blocks + 4 tokens
VECTOR_TENANT = "tenant-a"
VECTOR_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
VECTOR_BLOCK_SIZE = 16
VECTOR_KEYS = [
    0x3CDF531C3B7A317F,
    0x8A17423F8D5D41EE,
    0xE934811023552E23,
    0x5AB92E2BCB4FA7A4,
    0xDE421F29294EE98A,
    0x8353E74758B3E3AE,
]


def reference_keys(
    tokens: list[int], tenant: str, model: str, block_size: int, parent: int = 0
) -> list[int]:
    """The layout written out independently (struct, one hash per block, no template)."""
    salt = namespace_digest(tenant, model)
    keys: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[start : start + block_size]
        data = struct.pack("<Q", parent) + struct.pack(f"<{block_size}I", *block)
        digest = hashlib.blake2b(data, digest_size=8, salt=salt, person=b"kvc-blockkey-v1")
        parent = int.from_bytes(digest.digest(), "little")
        keys.append(parent)
    return keys


def keys_of(
    tokens: list[int], tenant: str = "t", model: str = "m", block_size: int = 4
) -> list[BlockKey]:
    return compute_block_keys(tokens, tenant=tenant, model=model, block_size=block_size)


def test_committed_vector() -> None:
    got = compute_block_keys(
        VECTOR_TOKENS, tenant=VECTOR_TENANT, model=VECTOR_MODEL, block_size=VECTOR_BLOCK_SIZE
    )
    assert got == VECTOR_KEYS


def test_namespace_digest_vector() -> None:
    salt = hashlib.blake2b(digest_size=16, person=b"kvc-namespace-v1")
    for part in (VECTOR_TENANT.encode(), VECTOR_MODEL.encode()):
        salt.update(struct.pack("<Q", len(part)) + part)
    assert namespace_digest(VECTOR_TENANT, VECTOR_MODEL) == salt.digest()


def test_matches_reference_layout() -> None:
    reference = reference_keys(VECTOR_TOKENS, VECTOR_TENANT, VECTOR_MODEL, VECTOR_BLOCK_SIZE)
    assert reference == VECTOR_KEYS


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


def test_extreme_token_ids() -> None:
    tokens = [0, 2**32 - 1, 2**31, 1]
    assert keys_of(tokens, block_size=2) == reference_keys(tokens, "t", "m", 2)


@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=80),
    block_size=st.integers(min_value=1, max_value=9),
    split_blocks=st.integers(min_value=0, max_value=10),
    tenant=st.text(max_size=6),
)
def test_properties(tokens: list[int], block_size: int, split_blocks: int, tenant: str) -> None:
    keys = keys_of(tokens, tenant=tenant, model="m", block_size=block_size)
    assert len(keys) == len(tokens) // block_size
    assert all(0 <= k < 2**64 for k in keys)
    assert keys == reference_keys(tokens, tenant, "m", block_size)
    # Prefix stability and continuation at any block boundary.
    cut = min(split_blocks, len(keys)) * block_size
    head = keys_of(tokens[:cut], tenant=tenant, model="m", block_size=block_size)
    assert head == keys[: len(head)]
    parent = head[-1] if head else None
    tail = compute_block_keys(
        tokens[cut:], tenant=tenant, model="m", block_size=block_size, parent=parent
    )
    assert head + tail == keys
    # Another tenant shares no key with this one.
    other = keys_of(tokens, tenant=tenant + "x", model="m", block_size=block_size)
    assert not set(other) & set(keys)


_SUBPROCESS_SCRIPT = """
import json
from kvc.block_keys import compute_block_keys
tokens = [(i * 7919 + 13) % 151936 for i in range(100)]
keys = compute_block_keys(tokens, tenant="tenant-a", model="m\\u00e9", block_size=16)
print(json.dumps([hash("salt-check"), keys]))
"""


def _keys_in_subprocess(hash_seed: str) -> tuple[int, list[int]]:
    env = dict(os.environ)
    env["PYTHONHASHSEED"] = hash_seed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_SCRIPT],
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    )
    str_hash, keys = json.loads(out.stdout)
    return int(str_hash), [int(k) for k in keys]


def test_keys_do_not_depend_on_pythonhashseed() -> None:
    hash_a, keys_a = _keys_in_subprocess("0")
    hash_b, keys_b = _keys_in_subprocess("12345")
    _, keys_random = _keys_in_subprocess("random")
    assert hash_a != hash_b, "the seeds should change str hashing, else the test proves nothing"
    assert keys_a == keys_b == keys_random
    in_process = compute_block_keys(VECTOR_TOKENS, tenant="tenant-a", model="mé", block_size=16)
    assert keys_a == in_process
