"""The agent's lower KV tiers: host DRAM (L2) and a local disk directory (L3).

The block pool (``node_agent.blocks.pool``) is L1: blocks in the engine's own memory.
When the pool evicts a cached block that holds content, it *demotes* it here instead of
dropping it: L1 -> L2 (the content copied to host memory), L2's own LRU victims -> L3
(one file per block), L3's victims -> dropped. A later transaction that names a demoted
key *promotes* it back into L1 (``load`` then ``discard``): the prefill reuses it as a
cached block and never recomputes it. A key lives in exactly one place on a node: L1,
L2 or L3 (the pool checks it).

Budgets are bytes (``host_bytes``, ``disk_bytes``; 0 switches a tier off). A block larger
than a tier's whole budget skips it. Each tier is an LRU, refreshed when a key enters it.

Crash safety (L3)
    A file is written under a temporary name and renamed into place, and carries a
    header (magic, version, key, layout, token count, payload length, CRC-32 of the
    payload). A file that is short, long, of another key or layout, or whose CRC does not
    match is a *miss*: it is deleted and ``load`` answers None — never loaded, never a
    crash. Files are this process's alone: at start the directory's ``*.kvblock`` files
    (a previous process's, listed by no snapshot) are deleted; nothing else is touched.

Bandwidth
    Every demotion and promotion is timed; each tier keeps an exponentially weighted
    mean of bytes per second for writes (demotion into it) and reads (promotion out of it
    onto the engine's device, which is what a hit costs). ``measure`` times one sample
    block through each tier at agent start so a node reports figures before any traffic.
    The agent publishes them in ``NodeInfo``/``LoadUpdate``; conductors charge a hit in a
    lower tier ``bytes / read bandwidth``.

Threads
    Not thread-safe: the pool's owner (the agent's event loop) calls it, and all its
    state changes happen there. The copies and the disk I/O do not: each is handed to a
    ``Runner`` (the agent's: one I/O thread, ``node_agent/tier_runner.py``; tests and
    the simulator: ``InlineRunner``, at once). A demoted entry keeps its content until
    its host copy or file write completes, so it stays readable meanwhile; a write that
    fails makes the key *lost* (``take_lost``: the pool reports it removed). File
    writes, reads and removals run on that one thread, so they never overlap for a key;
    background work (copies to host, writes, removals) in submission order, and a
    transaction's ``prefetch`` before any of it still queued (it reads a file only once
    its write finished; until then it reads the block from memory). ``prefetch`` loads
    a transaction's lower-tier blocks onto the device there before the transaction
    promotes them (``load`` then finds them staged); what it did not stage, ``load``
    copies on the caller's thread.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol, TypeVar

from kvc.block_keys import BlockKey
from node_agent.blocks.types import KvMedium
from node_agent.kv import KV_DTYPE_BYTES, KvCodec, KvContent, KvLayout

__all__ = [
    "DiskStore",
    "FileStore",
    "InlineRunner",
    "LowerTiers",
    "MemoryStore",
    "Runner",
    "TierMove",
    "TierStats",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TierMove:
    """A demoted key went to ``medium``; None: it left the node (dropped)."""

    key: BlockKey
    medium: KvMedium | None


@dataclass(frozen=True, slots=True)
class TierStats:
    medium: KvMedium
    capacity_bytes: int
    used_bytes: int
    blocks: int
    read_bytes_per_s: float  # promotion out of this tier onto the device (0: not measured)
    write_bytes_per_s: float  # demotion into this tier (0: not measured)
    torn_files: int = 0  # L3 files found damaged and treated as misses


_SUFFIX: Final = ".kvblock"
_MAGIC: Final = b"KVCB"
_VERSION: Final = 1
_HEADER: Final = struct.Struct("<4sHHQIIIIQI")  # magic ver dtype key L H D tokens len crc
_DTYPES: Final = tuple(sorted(KV_DTYPE_BYTES))
_EWMA: Final = 0.2  # weight of the newest measurement
_PROBE_KEY: Final = BlockKey(0)  # ``measure``'s sample (skipped if a real block has it)


class _Rate:
    """Bytes per second, an exponentially weighted mean of timed transfers."""

    __slots__ = ("bytes_per_s",)

    def __init__(self) -> None:
        self.bytes_per_s = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0:
            return
        rate = nbytes / max(seconds, 1e-7)
        self.bytes_per_s = (
            rate if self.bytes_per_s == 0.0 else ((1 - _EWMA) * self.bytes_per_s + _EWMA * rate)
        )


@dataclass(slots=True)
class _Entry:
    tenant: str | None
    nbytes: int
    # L2: the host copy (the device one until the copy completes); L3: None once the file
    # is written (the content until then).
    content: KvContent | None
    layout: KvLayout
    num_tokens: int


class _Tier:
    def __init__(self, medium: KvMedium, capacity_bytes: int) -> None:
        self.medium = medium
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.entries: OrderedDict[BlockKey, _Entry] = OrderedDict()  # oldest first
        self.reads = _Rate()
        self.writes = _Rate()

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.capacity_bytes

    def add(self, key: BlockKey, entry: _Entry) -> None:
        self.entries[key] = entry
        self.used_bytes += entry.nbytes

    def pop(self, key: BlockKey) -> _Entry:
        entry = self.entries.pop(key)
        self.used_bytes -= entry.nbytes
        return entry

    def pop_oldest(self) -> tuple[BlockKey, _Entry]:
        key, entry = self.entries.popitem(last=False)
        self.used_bytes -= entry.nbytes
        return key, entry

    def stats(self, torn: int = 0) -> TierStats:
        return TierStats(
            medium=self.medium,
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes,
            blocks=len(self.entries),
            read_bytes_per_s=self.reads.bytes_per_s,
            write_bytes_per_s=self.writes.bytes_per_s,
            torn_files=torn,
        )


class Runner(Protocol):
    """Runs ``work`` (a copy or disk I/O) somewhere, then ``done(result, error)`` on the
    tiers' owner thread; ``urgent`` work (a transaction's promotions) before any queued
    background work, each kind in submission order. ``InlineRunner``: at once, on the
    caller's thread (tests, the simulator); the agent's runs work on one I/O thread."""

    @property
    def pending(self) -> int:
        """Work submitted and not started yet (the I/O backlog)."""
        ...

    def submit(
        self,
        work: Callable[[], T],
        done: Callable[[T | None, BaseException | None], None],
        *,
        urgent: bool = False,
    ) -> None: ...


class InlineRunner:
    """Work runs at once on the caller's thread (nothing waits, so urgency is moot)."""

    @property
    def pending(self) -> int:
        return 0

    def submit(
        self,
        work: Callable[[], T],
        done: Callable[[T | None, BaseException | None], None],
        *,
        urgent: bool = False,
    ) -> None:
        try:
            result = work()
        except Exception as exc:  # handed to done, which decides
            done(None, exc)
            return
        done(result, None)


class LowerTiers:
    """L2 (host DRAM) and L3 (disk files) below the pool; see the module docstring."""

    def __init__(
        self,
        codec: KvCodec,
        *,
        host_bytes: int,
        disk_dir: Path | None = None,
        disk_bytes: int = 0,
        disk_store: DiskStore | None = None,
        stage_bytes: int = 1 << 30,
        runner: Runner | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``disk_dir``: L3 as files there (``FileStore``); ``disk_store``: any other
        ``DiskStore`` (the simulator's ``MemoryStore``). ``stage_bytes`` bounds what
        ``prefetch`` holds on the device for transactions about to promote it."""
        if host_bytes < 0 or disk_bytes < 0 or stage_bytes < 0:
            raise ValueError("tier budgets must be >= 0 bytes")
        if disk_bytes > 0 and disk_dir is None and disk_store is None:
            raise ValueError("a disk tier budget needs a directory")
        self._codec = codec
        self._timer = timer
        self._runner: Runner = runner if runner is not None else InlineRunner()
        self._host = _Tier(KvMedium.HOST, host_bytes)
        if disk_store is None and disk_dir is not None and disk_bytes > 0:
            disk_store = FileStore(disk_dir, codec)
        self._store = disk_store if disk_bytes > 0 else None
        self._disk = _Tier(KvMedium.DISK, disk_bytes if self._store is not None else 0)
        self._stage_bytes = stage_bytes
        self._staged: dict[BlockKey, tuple[_Entry, KvContent]] = {}
        self._staged_used = 0
        self._lost: list[BlockKey] = []
        self.torn_files = 0

    @property
    def enabled(self) -> bool:
        return self._host.capacity_bytes > 0 or self._disk.capacity_bytes > 0

    def set_runner(self, runner: Runner) -> None:
        """Where copies and disk I/O run from now on (the agent's I/O thread)."""
        self._runner = runner

    @property
    def io_backlog(self) -> int:
        """Copies and disk I/O waiting to run (demotions outpacing the disk grow it)."""
        return self._runner.pending

    # ------------------------------------------------------------------ queries
    def medium_of(self, key: BlockKey) -> KvMedium | None:
        if key in self._host.entries:
            return KvMedium.HOST
        if key in self._disk.entries:
            return KvMedium.DISK
        return None

    def tenant_of(self, key: BlockKey) -> str | None:
        entry = self._host.entries.get(key) or self._disk.entries.get(key)
        return None if entry is None else entry.tenant

    def keys(self, medium: KvMedium) -> list[BlockKey]:
        tier = self._tier(medium)
        return list(tier.entries)

    def stats(self) -> tuple[TierStats, TierStats]:
        return self._host.stats(), self._disk.stats(self.torn_files)

    def __len__(self) -> int:
        return len(self._host.entries) + len(self._disk.entries)

    def take_lost(self) -> list[BlockKey]:
        """Keys a tier lost after it reported them held (a disk write that failed, a
        file found damaged by a prefetch): the pool reports them removed."""
        lost, self._lost = self._lost, []
        return lost

    # ------------------------------------------------------------------ demotion
    def put(self, key: BlockKey, tenant: str | None, content: KvContent) -> list[TierMove]:
        """Demote an L1 block's content. Returns where it and any key it displaced went,
        in order (the key itself first: HOST, DISK, or None when no tier takes it).

        The bookkeeping is done now; the copy to host memory or the file write runs on
        the runner, and until it completes the entry keeps ``content`` (still readable,
        from where it was)."""
        if self.medium_of(key) is not None:
            raise ValueError(f"key {key:#x} is already in a lower tier")
        nbytes = content.nbytes
        entry = _Entry(tenant, nbytes, content, content.layout, content.num_tokens)
        if not self._host.fits(nbytes):
            return self._to_disk(key, entry)
        moves = [TierMove(key, KvMedium.HOST)]
        displaced = self._make_room(self._host, nbytes)
        self._host.add(key, entry)
        self._copy_to_host(key, entry, content)
        for old_key, old in displaced:
            moves.extend(self._to_disk(old_key, old))
        return moves

    def _copy_to_host(self, key: BlockKey, entry: _Entry, content: KvContent) -> None:
        codec, timer = self._codec, self._timer

        def work() -> tuple[KvContent, float]:
            started = timer()
            return codec.to_host(content), timer() - started

        def done(result: tuple[KvContent, float] | None, error: BaseException | None) -> None:
            if result is None:  # the device copy stays readable: nothing is lost
                return
            host, seconds = result
            if self._host.entries.get(key) is entry:
                entry.content = host
                self._host.writes.add(entry.nbytes, seconds)

        self._runner.submit(work, done)

    def _make_room(self, tier: _Tier, nbytes: int) -> list[tuple[BlockKey, _Entry]]:
        out = []
        while tier.used_bytes + nbytes > tier.capacity_bytes and tier.entries:
            key, entry = tier.pop_oldest()
            self._unstage(key)
            out.append((key, entry))
        return out

    def _to_disk(self, key: BlockKey, entry: _Entry) -> list[TierMove]:
        store = self._store
        data = entry.content
        if data is None or store is None or not self._disk.fits(entry.nbytes):
            return [TierMove(key, None)]
        moves = [TierMove(key, KvMedium.DISK)]
        for old_key, _old in self._make_room(self._disk, entry.nbytes):
            self._remove_file(old_key)
            moves.append(TierMove(old_key, None))
        self._disk.add(key, entry)  # content kept (readable) until the file is written
        timer = self._timer

        def work() -> float:
            started = timer()
            store.write(key, data)
            return timer() - started

        def done(seconds: float | None, error: BaseException | None) -> None:
            current = self._disk.entries.get(key) is entry
            if error is not None:
                if not isinstance(error, OSError):
                    raise error
                if current:  # the write failed: the block is gone after all
                    self._disk.pop(key)
                    self._unstage(key)
                    self._lost.append(key)
                    # Only then: a key no longer current was discarded (its removal is
                    # queued) and may be on disk again, newer, by the time this runs.
                    self._remove_file(key)
            elif current and seconds is not None:
                entry.content = None
                self._disk.writes.add(entry.nbytes, seconds)

        self._runner.submit(work, done)
        return moves

    def _remove_file(self, key: BlockKey) -> None:
        store = self._store
        if store is not None:
            self._runner.submit(lambda: store.remove(key), _ignore)

    # ------------------------------------------------------------------ promotion
    def prefetch(self, keys: Sequence[BlockKey], done: Callable[[], None]) -> int:
        """Bring the lower-tier blocks among ``keys`` onto the engine's device on the
        runner (host copies, file reads), up to ``stage_bytes``, so the transaction that
        follows promotes them without copying on the caller's thread. Calls ``done`` when
        they are ready; returns how many it is loading (0: ``done`` is not called)."""
        jobs: list[tuple[BlockKey, _Entry, KvMedium]] = []
        budget = self._stage_bytes - self._staged_used
        for key in keys:
            if key in self._staged:
                continue
            medium = self.medium_of(key)
            if medium is None:
                continue
            entry = self._tier(medium).entries[key]
            if entry.nbytes > budget:
                break
            budget -= entry.nbytes
            jobs.append((key, entry, medium))
        if not jobs:
            return 0
        codec, store, timer = self._codec, self._store, self._timer

        def work() -> list[tuple[KvContent | None, float]]:
            out: list[tuple[KvContent | None, float]] = [(None, 0.0)] * len(jobs)
            # What is in memory (host copies, not-yet-written files) goes in one batch of
            # copies with one wait; its time is shared out by bytes. The rest is on disk.
            in_memory: list[tuple[int, int, KvContent]] = []
            for i, (key, entry, _medium) in enumerate(jobs):
                content = entry.content  # read once: a finished file write clears it
                if content is not None:
                    in_memory.append((i, entry.nbytes, content))
                    continue
                assert store is not None
                started = timer()
                out[i] = (store.read(key, entry.layout, entry.num_tokens), timer() - started)
            if in_memory:
                started = timer()
                moved = codec.to_device_many([content for _i, _n, content in in_memory])
                seconds = timer() - started
                total = sum(nbytes for _i, nbytes, _c in in_memory)
                for (i, nbytes, _c), content in zip(in_memory, moved, strict=True):
                    out[i] = (content, seconds * nbytes / max(total, 1))
            return out

        def finish(
            results: list[tuple[KvContent | None, float]] | None, error: BaseException | None
        ) -> None:
            try:
                if results is not None:
                    for (key, entry, medium), (content, seconds) in zip(jobs, results, strict=True):
                        self._staged_result(key, entry, medium, content, seconds)
            finally:
                done()

        # Urgent: a request waits on it; demotions queued before it can wait. Safe to run
        # ahead of them: a file is read only once its write finished (``content`` None),
        # and a removal queued meanwhile belongs to an entry this result then ignores.
        self._runner.submit(work, finish, urgent=True)
        return len(jobs)

    def _staged_result(
        self,
        key: BlockKey,
        entry: _Entry,
        medium: KvMedium,
        content: KvContent | None,
        seconds: float,
    ) -> None:
        tier = self._tier(medium)
        if tier.entries.get(key) is not entry:
            return  # moved or gone meanwhile: the transaction looks it up afresh
        if content is None:  # a damaged file: a miss, reported removed
            self.torn_files += 1
            tier.pop(key)
            self._remove_file(key)
            self._lost.append(key)
            return
        tier.reads.add(entry.nbytes, seconds)
        self._staged[key] = (entry, content)
        self._staged_used += entry.nbytes

    def unstage(self, keys: Sequence[BlockKey]) -> None:
        """Drop what ``prefetch`` staged for ``keys`` and nobody promoted."""
        for key in keys:
            self._unstage(key)

    def _unstage(self, key: BlockKey) -> None:
        staged = self._staged.pop(key, None)
        if staged is not None:
            self._staged_used -= staged[0].nbytes

    def load(self, key: BlockKey) -> KvContent | None:
        """The key's content on the engine's device, the key staying here until
        ``discard``: what ``prefetch`` staged, else copied now on the caller's thread.
        None: not here, or its file was damaged (then it is gone: the caller reports it
        removed)."""
        staged = self._staged.get(key)
        medium = self.medium_of(key)
        if medium is None:
            return None
        tier = self._tier(medium)
        entry = tier.entries[key]
        if staged is not None and staged[0] is entry:
            return staged[1]
        started = self._timer()
        if entry.content is not None:
            content: KvContent | None = self._codec.to_device(entry.content)
        else:
            assert self._store is not None
            content = self._store.read(key, entry.layout, entry.num_tokens)
        if content is None:
            self.torn_files += 1
            tier.pop(key)
            self._remove_file(key)
            return None
        tier.reads.add(entry.nbytes, self._timer() - started)
        return content

    def discard(self, key: BlockKey) -> None:
        """Forget the key (promoted into L1, or superseded there): no event of its own."""
        self._unstage(key)
        if key in self._host.entries:
            self._host.pop(key)
        elif key in self._disk.entries:
            self._disk.pop(key)
            self._remove_file(key)

    def clear(self) -> list[BlockKey]:
        """Drop everything (an engine reset); returns the keys dropped."""
        dropped = list(self._host.entries) + list(self._disk.entries)
        self._host.entries.clear()
        self._host.used_bytes = 0
        for key in self._disk.entries:
            self._remove_file(key)
        self._disk.entries.clear()
        self._disk.used_bytes = 0
        self._staged.clear()
        self._staged_used = 0
        return dropped

    # ------------------------------------------------------------------ measuring
    def measure(self, sample: KvContent, rounds: int = 3) -> None:
        """Time ``sample`` through each enabled tier and back, on the caller's thread
        (at agent start, before serving; nothing is kept)."""
        for _ in range(rounds):
            if self._host.capacity_bytes > 0:
                started = self._timer()
                host = self._codec.to_host(sample)
                self._host.writes.add(sample.nbytes, self._timer() - started)
                started = self._timer()
                self._codec.to_device(host)
                self._host.reads.add(sample.nbytes, self._timer() - started)
            store = self._store
            if store is not None and _PROBE_KEY not in self._disk.entries:
                try:
                    started = self._timer()
                    store.write(_PROBE_KEY, sample)
                    self._disk.writes.add(sample.nbytes, self._timer() - started)
                    started = self._timer()
                    if store.read(_PROBE_KEY, sample.layout, sample.num_tokens) is not None:
                        self._disk.reads.add(sample.nbytes, self._timer() - started)
                finally:
                    store.remove(_PROBE_KEY)

    def _tier(self, medium: KvMedium) -> _Tier:
        if medium is KvMedium.HOST:
            return self._host
        if medium is KvMedium.DISK:
            return self._disk
        raise ValueError("the device tier is the block pool itself")


def _ignore(_result: object, _error: BaseException | None) -> None:
    """A removal's outcome: a file already gone is what was wanted."""


class DiskStore(Protocol):
    """Where L3 blocks go: ``write`` (raises ``OSError`` when it cannot), ``read`` (None:
    missing or damaged), ``remove`` (absent is fine)."""

    def write(self, key: BlockKey, content: KvContent) -> None: ...

    def read(self, key: BlockKey, layout: KvLayout, num_tokens: int) -> KvContent | None: ...

    def remove(self, key: BlockKey) -> None: ...


class FileStore:
    """One ``<key>.kvblock`` file per block in ``directory`` (see the module docstring:
    atomic rename, header, CRC-32); deletes the directory's ``*.kvblock`` files at start."""

    def __init__(self, directory: Path, codec: KvCodec) -> None:
        self._dir = directory
        self._codec = codec
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(f"*{_SUFFIX}*"):
            with contextlib.suppress(OSError):
                stale.unlink()

    def path(self, key: BlockKey) -> Path:
        return self._dir / f"{key:016x}{_SUFFIX}"

    def write(self, key: BlockKey, content: KvContent) -> None:
        _write_atomic(self.path(key), *_encode(key, content))

    def read(self, key: BlockKey, layout: KvLayout, num_tokens: int) -> KvContent | None:
        try:
            raw = _read_all(self.path(key))
        except OSError:
            return None
        data = _decode(key, layout, num_tokens, raw)
        return None if data is None else self._codec.from_bytes(layout, data, num_tokens)

    def remove(self, key: BlockKey) -> None:
        with contextlib.suppress(OSError):
            self.path(key).unlink()


class MemoryStore:
    """A disk that keeps what it was given, in memory: for the simulator, which models
    L3's capacity and bandwidth, not its bytes."""

    def __init__(self) -> None:
        self._blocks: dict[BlockKey, KvContent] = {}

    def write(self, key: BlockKey, content: KvContent) -> None:
        self._blocks[key] = content

    def read(self, key: BlockKey, layout: KvLayout, num_tokens: int) -> KvContent | None:
        return self._blocks.get(key)

    def remove(self, key: BlockKey) -> None:
        self._blocks.pop(key, None)


def _encode(key: BlockKey, content: KvContent) -> tuple[bytes, bytes]:
    """(header, payload) of a block file."""
    payload = content.to_bytes()
    layout = content.layout
    header = _HEADER.pack(
        _MAGIC,
        _VERSION,
        _DTYPES.index(layout.dtype),
        key,
        layout.num_layers,
        layout.num_kv_heads,
        layout.head_dim,
        content.num_tokens,
        len(payload),
        zlib.crc32(payload),
    )
    return header, payload


def _decode(key: BlockKey, layout: KvLayout, num_tokens: int, raw: bytearray) -> memoryview | None:
    """The payload of a block file (a view into ``raw``, which the caller hands over), or
    None when the file is not exactly what was written."""
    if len(raw) < _HEADER.size:
        return None
    magic, version, dtype, file_key, layers, heads, dim, tokens, length, crc = _HEADER.unpack_from(
        raw
    )
    expected = (_MAGIC, _VERSION, _DTYPES.index(layout.dtype), key)
    shape = (layout.num_layers, layout.num_kv_heads, layout.head_dim, num_tokens)
    if (magic, version, dtype, file_key) != expected or (layers, heads, dim, tokens) != shape:
        return None
    payload = memoryview(raw)[_HEADER.size :]
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    return payload


def _read_all(path: Path) -> bytearray:
    """A file's bytes in a fresh, writable buffer (decoded in place, no second copy)."""
    with path.open("rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        buffer = bytearray(size)
        if handle.readinto(buffer) != size:
            raise OSError(f"{path} changed size while being read")
    return buffer


def _write_atomic(path: Path, *parts: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as handle:
            for part in parts:
                handle.write(part)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):  # no half-written file left behind
            tmp.unlink()
        raise
