"""Same-host KV transfer files: the receiver's offer, the sender's checks, cleanup."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node_agent.transfer.shm import SharedOffer, valid_name, write_shared

DATA = bytes(range(256)) * 64  # 16 KiB


def test_offer_write_map_and_close(tmp_path: Path) -> None:
    offer = SharedOffer.create(tmp_path, len(DATA))
    assert offer is not None
    assert valid_name(offer.name)
    assert oct(offer.path.stat().st_mode & 0o777) == "0o600"
    assert write_shared(tmp_path, offer.name, [DATA], len(DATA))
    view = offer.mapped()
    offer.close()
    assert not offer.path.exists()  # removed; the mapping stays readable while used
    assert bytes(view) == DATA
    offer.close()  # idempotent


def test_offer_cannot_be_made_where_there_is_no_directory_or_nothing_to_move(
    tmp_path: Path,
) -> None:
    assert SharedOffer.create(tmp_path / "absent", 10) is None
    assert SharedOffer.create(tmp_path, 0) is None


@pytest.mark.parametrize(
    "name",
    ["../kvc-kv-" + "0" * 32, "kvc-kv-" + "Z" * 32, "kvc-kv-" + "0" * 31, "passwd", ""],
)
def test_sender_refuses_names_it_did_not_see_made(tmp_path: Path, name: str) -> None:
    assert not valid_name(name)
    assert not write_shared(tmp_path, name, [DATA], len(DATA))


def test_sender_streams_when_the_file_is_not_here_or_not_the_offer(tmp_path: Path) -> None:
    name = "kvc-kv-" + "a" * 32
    assert not write_shared(tmp_path, name, [DATA], len(DATA))  # another host: no such file here
    (tmp_path / name).write_bytes(b"x" * 10)  # not the transfer's size
    assert not write_shared(tmp_path, name, [DATA], len(DATA))
    assert (tmp_path / name).read_bytes() == b"x" * 10  # untouched
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * len(DATA))
    link = tmp_path / ("kvc-kv-" + "b" * 32)
    link.symlink_to(target)
    assert not write_shared(tmp_path, link.name, [DATA], len(DATA))  # never through a link
    assert target.read_bytes() == b"\0" * len(DATA)
    folder = tmp_path / ("kvc-kv-" + "c" * 32)
    folder.mkdir()
    assert not write_shared(tmp_path, folder.name, [DATA], len(DATA))


def test_a_file_changed_after_the_write_is_refused_by_the_receiver(tmp_path: Path) -> None:
    offer = SharedOffer.create(tmp_path, len(DATA))
    assert offer is not None
    assert write_shared(tmp_path, offer.name, [DATA], len(DATA))
    os.truncate(offer.path, 10)
    with pytest.raises(ValueError, match="holds 10 bytes"):
        offer.mapped()
    offer.close()
    assert not offer.path.exists()


def test_buffers_of_another_size_than_announced_are_refused(tmp_path: Path) -> None:
    offer = SharedOffer.create(tmp_path, len(DATA))
    assert offer is not None
    half = len(DATA) // 2
    assert write_shared(tmp_path, offer.name, [DATA[:half], DATA[half:]], len(DATA))
    assert bytes(offer.mapped()) == DATA  # consecutive buffers, one file
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
