"""Same-host KV transfer files: the receiver's offer, the sender's checks, cleanup."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from node_agent.transfer.shm import SharedOffer, remove_orphans, valid_name, write_shared

DATA = bytes(range(256)) * 64  # 16 KiB


def name(tag: str, pid: int = 1) -> str:
    return f"kvc-kv-{pid}-{tag * 32}"


def test_offer_write_read_and_close(tmp_path: Path) -> None:
    offer = SharedOffer.create(tmp_path, len(DATA))
    assert offer is not None
    assert valid_name(offer.name)
    assert offer.name.startswith(f"kvc-kv-{os.getpid()}-")
    assert oct(offer.path.stat().st_mode & 0o777) == "0o600"
    assert offer.path.stat().st_blocks == 0  # sparse until the sender writes
    assert write_shared(tmp_path, offer.name, [DATA], len(DATA))
    assert offer.read() == DATA
    offer.close()
    assert not offer.path.exists()
    offer.close()  # idempotent


def test_offer_cannot_be_made_where_there_is_no_directory_or_nothing_to_move(
    tmp_path: Path,
) -> None:
    assert SharedOffer.create(tmp_path / "absent", 10) is None
    assert SharedOffer.create(tmp_path, 0) is None


@pytest.mark.parametrize(
    "bad",
    ["../" + name("0"), "kvc-kv-1-" + "Z" * 32, "kvc-kv-1-" + "0" * 31, "kvc-kv-" + "0" * 32,
     "passwd", ""],
)  # fmt: skip
def test_sender_refuses_names_it_did_not_see_made(tmp_path: Path, bad: str) -> None:
    assert not valid_name(bad)
    assert not write_shared(tmp_path, bad, [DATA], len(DATA))


def test_sender_streams_when_the_file_is_not_here_or_not_the_offer(tmp_path: Path) -> None:
    assert not write_shared(tmp_path, name("a"), [DATA], len(DATA))  # another host
    (tmp_path / name("a")).write_bytes(b"x" * 10)  # not the transfer's size
    assert not write_shared(tmp_path, name("a"), [DATA], len(DATA))
    assert (tmp_path / name("a")).read_bytes() == b"x" * 10  # untouched
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * len(DATA))
    (tmp_path / name("b")).symlink_to(target)
    assert not write_shared(tmp_path, name("b"), [DATA], len(DATA))  # never through a link
    os.link(target, tmp_path / name("d"))
    assert not write_shared(tmp_path, name("d"), [DATA], len(DATA))  # nor into a hard link
    assert target.read_bytes() == b"\0" * len(DATA)
    (tmp_path / name("c")).mkdir()
    assert not write_shared(tmp_path, name("c"), [DATA], len(DATA))


def test_the_receiver_refuses_a_file_nobody_wrote_or_that_changed(tmp_path: Path) -> None:
    offer = SharedOffer.create(tmp_path, len(DATA))
    assert offer is not None
    with pytest.raises(ValueError, match="not written"):
        offer.read()  # a peer that claims a write it did not make: never zeros
    assert write_shared(tmp_path, offer.name, [DATA], len(DATA))
    os.truncate(offer.path, 10)
    with pytest.raises(ValueError, match="holds 10 bytes"):
        offer.read()
    offer.close()
    assert not offer.path.exists()


def test_no_room_fails_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from node_agent.transfer import shm

    def full(_fd: int, _nbytes: int) -> None:
        raise OSError(28, "No space left on device")

    offer = SharedOffer.create(tmp_path, len(DATA))
    assert offer is not None
    monkeypatch.setattr(shm, "_reserve", full)
    assert not write_shared(tmp_path, offer.name, [DATA], len(DATA))
    assert offer.path.stat().st_blocks == 0  # nothing written: the sender streams
    offer.close()


def test_files_of_receivers_gone_are_removed_at_start(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])  # a pid that has exited
    dead.wait()
    (tmp_path / name("a", dead.pid)).write_bytes(b"x")
    (tmp_path / name("b", os.getpid())).write_bytes(b"x")  # ours: in use
    (tmp_path / "other-file").write_bytes(b"x")  # not ours at all
    assert remove_orphans(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [name("b", os.getpid()), "other-file"]
    )
    assert remove_orphans(tmp_path / "absent") == 0


def test_buffers_of_another_size_than_announced_are_refused(tmp_path: Path) -> None:
    offer = SharedOffer.create(tmp_path, len(DATA))
    assert offer is not None
    half = len(DATA) // 2
    assert write_shared(tmp_path, offer.name, [DATA[:half], DATA[half:]], len(DATA))
    assert offer.read() == DATA  # consecutive buffers, one file
    assert not write_shared(tmp_path, offer.name, [DATA[:half]], len(DATA))  # short
    assert not write_shared(tmp_path, offer.name, [DATA, b"x"], len(DATA))  # long
    offer.close()


def test_kv_buffers_are_the_wire_format() -> None:
    import torch

    from node_agent.engines.embedded.kv_tensors import KvCache

    def joined(cache: KvCache) -> bytes:
        return b"".join(bytes(b) for b in cache.to_buffers())

    bf16 = torch.bfloat16
    big = [(torch.randn(1, 2, 10, 4, dtype=bf16), torch.randn(1, 2, 10, 4, dtype=bf16))]
    kv = KvCache([(k[:, :, :5], v[:, :, :5].clone()) for k, v in big * 3])
    assert joined(kv) == kv.to_bytes()
    flat = KvCache.from_bytes(kv.layout, bytearray(kv.to_bytes()), kv.num_tokens)
    assert joined(flat) == kv.to_bytes()  # one buffer: the cache's own
    strided = KvCache([(k[:, :, ::2], v[:, :, ::2]) for k, v in big])
    assert not strided.layers[0][0].is_contiguous()
    assert joined(strided) == strided.to_bytes()
