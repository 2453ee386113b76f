"""Same-host KV transfer through a shared-memory file, beside the gRPC stream.

Seen on an H200 (docs/benchmarks.md, P/D on the embedded engine): a prefill agent's KV
handed to a decode agent on the same machine as a gRPC stream of 1 MiB chunks moved
0.37-0.42 GB/s — copies into and out of protobuf messages and a CRC-32 per chunk, in
Python on both sides — 76-82% of the request's TTFT. Two agents on one host (a prefill
GPU and a decode GPU of one server, or any test or demo fleet) need none of that.

The receiver owns the file, from start to end:

1. ``SharedOffer.create`` makes ``kvc-kv-<its pid>-<32 hex>`` in its directory
   (``/dev/shm`` by default: memory, not disk), mode 0600, sized to the transfer but
   sparse (nothing allocated: an offer a remote peer ignores costs a few system calls),
   and names it in its ``FetchKv``/``ReadBlocks`` request;
2. the sender (``write_shared``) opens that name in *its* directory — found only on the
   same host (and the same mount) — checks it is a regular file of this user with one
   link, of exactly the transfer's size (no symbolic link: ``O_NOFOLLOW``), reserves the
   whole size first (``posix_fallocate``: a full file system fails at once and leaves
   nothing allocated), writes the KV with ``pwrite`` straight from its tensors' host
   buffers, and answers one chunk with ``in_shared_memory``; anything else and it
   streams as before;
3. the receiver checks the file is fully allocated (a peer that claims a write it did
   not make is refused, not read as zeros; no hole is left for a full file system to
   turn into SIGBUS), maps it copy-on-write and decodes the KV from the mapping (one
   copy onto a GPU; on a CPU engine the KV stays in those pages, counted against the
   directory's file system, until the request's KV is dropped), and removes the name
   in every case.

A receiver killed mid-transfer leaves its file; ``remove_orphans`` (run at the agent's
start) deletes the files of processes that no longer exist. No checksum: nothing
crossed a wire; the file is private to the agents' user.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Final

__all__ = ["SharedOffer", "remove_orphans", "valid_name", "write_shared"]

_PREFIX: Final = "kvc-kv-"
_NAME: Final = re.compile(r"kvc-kv-([0-9]{1,10})-[0-9a-f]{32}")
_OPEN_FLAGS: Final = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def valid_name(name: str) -> bool:
    """A name ``SharedOffer`` makes (no path, nothing else)."""
    return _NAME.fullmatch(name) is not None


def _reserve(fd: int, nbytes: int) -> None:
    """Allocate the file's whole size now (ENOSPC here, not halfway through a write)."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is not None:
        fallocate(fd, 0, nbytes)


class SharedOffer:
    """A receiver's file for one transfer; ``close`` removes it (idempotent)."""

    def __init__(self, path: Path, fd: int, nbytes: int) -> None:
        self.path = path
        self.name = path.name
        self.nbytes = nbytes
        self._fd = fd

    @classmethod
    def create(cls, directory: Path, nbytes: int) -> SharedOffer | None:
        """A new sparse file of ``nbytes`` in ``directory``; None when it cannot be made
        (no such directory, no room for the name): the transfer streams instead. Quick
        (no allocation), so it runs on the caller's thread: nothing to leak if the
        caller is cancelled."""
        if nbytes <= 0:
            return None
        path = directory / f"{_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
        except OSError:
            return None
        try:
            os.ftruncate(fd, nbytes)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        return cls(path, fd, nbytes)

    def read(self) -> memoryview:
        """The written file, mapped copy-on-write (decoding in place never writes back;
        the mapping outlives ``close`` for as long as it is used). Raises ``ValueError``
        when it is not exactly ``nbytes`` long or not wholly allocated: a peer claiming
        a write it did not make is refused (not read as zeros), and no page of the
        mapping is a hole that a full file system would turn into SIGBUS on reading.
        (Reading into a fresh ``bytearray`` instead measured 330-355 ms for 256 MiB on
        the CPU machine, twice the sender's whole write.)"""
        if self._fd < 0:
            raise ValueError("the offer is closed")
        info = os.fstat(self._fd)
        if info.st_size != self.nbytes:
            raise ValueError(f"the shared file holds {info.st_size} bytes, expected {self.nbytes}")
        if info.st_blocks * 512 < self.nbytes:
            raise ValueError("the shared file was not written (it is still sparse)")
        return memoryview(mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_PRIVATE))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            self.path.unlink()


def write_shared(
    directory: Path, name: str, buffers: Iterable[bytes | memoryview], nbytes: int
) -> bool:
    """Write ``buffers`` (``nbytes`` in all, consecutive) into the receiver's offer
    ``name`` in ``directory``: True when done; False (nothing written that anyone reads)
    when there is no such file here, it is not a regular file of this user with one
    link of exactly ``nbytes``, there is no room for it, the buffers hold another size,
    or a write fails."""
    if not valid_name(name) or nbytes <= 0:
        return False
    try:
        fd = os.open(directory / name, os.O_WRONLY | _OPEN_FLAGS)
    except OSError:
        return False  # another host (or mount): the receiver's file is not here
    try:
        info = os.fstat(fd)
        if (
            not stat.S_ISREG(info.st_mode)
            or info.st_uid != os.getuid()
            or info.st_nlink != 1
            or info.st_size != nbytes
        ):
            return False
        _reserve(fd, nbytes)
        offset = 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            if offset + len(view) > nbytes:
                return False
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
            offset += len(view)
        return offset == nbytes
    except OSError:
        return False  # e.g. the file system is full: the caller streams instead
    finally:
        os.close(fd)


def remove_orphans(directory: Path) -> int:
    """Delete offers left by receivers that no longer run (killed mid-transfer); returns
    how many. A pid that is alive — or that this user may not signal — keeps its files."""
    removed = 0
    try:
        names = [path.name for path in directory.iterdir()]
    except OSError:
        return 0
    for name in names:
        found = _NAME.fullmatch(name)
        if found is None:
            continue
        pid = int(found.group(1))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                (directory / name).unlink()
                removed += 1
        except OSError:
            continue  # alive under another user, or unknowable: left alone
    return removed
