"""The committed gRPC stubs in kvc/v1/ must match what proto/ generates."""

from __future__ import annotations

from pathlib import Path

from tools.protogen import REPO_ROOT, generate


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    generated = generate(tmp_path)
    assert generated, "protoc produced no files"
    for path in generated:
        rel = path.relative_to(tmp_path)
        committed = REPO_ROOT / rel
        assert committed.exists(), f"{rel} is not committed: run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{rel} is stale: run `make proto` and commit the result"
        )
