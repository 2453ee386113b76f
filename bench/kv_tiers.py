"""Lower KV tiers vs recompute: what a hit in host memory (L2) or on disk (L3) costs
against prefilling the same tokens again, on the embedded engine.

  python -m bench.kv_tiers [--device cpu|cuda] [--model DIR | --shape llama-8b]
      [--tokens 512,2048,8192] [--repeats 5] [--out bench/results] [--disk-dir DIR]

For each prompt length N (a multiple of the 32-token block):

1. Recompute: ``EmbeddedModel.forward`` of N prompt tokens from nothing (the prefill),
   after a warm-up; median of the repeats.
2. L2 (host memory): the prefill's KV cut into 32-token blocks with ``KvCache.slice`` (as
   the agent's pool holds it), each block demoted with ``put`` into a real
   ``LowerTiers(codec, host_bytes=..., disk_bytes=0)``, then ``load`` of every block
   (promotion onto the engine's device, one copy and one wait per block) timed; and the
   agent's own path before a transaction, ``prefetch`` of all the blocks (their copies
   queued back to back, one wait) then ``load`` of each (already staged) timed. On CUDA
   one copy of the same bytes from one pinned buffer is timed too: the link's ceiling.
3. L3 (disk): the same with ``LowerTiers(codec, host_bytes=0, disk_dir=..., disk_bytes=...)``
   (``put`` writes one CRC'd file per block); ``load`` (file read, CRC check, decode onto
   the device) timed twice: with the files in the page cache ("page cache"), and after
   each file was fsynced and dropped from the page cache with
   ``posix_fadvise(DONTNEED)`` ("cold"; the fraction of pages still resident after the
   drop is checked with ``mincore`` and reported).
4. Demotion (``put``) into each tier, timed the same way.

Every load pass is checked bit for bit against the original blocks (a mismatch raises).
On CUDA every timing is bracketed by ``torch.cuda.synchronize()``.

``--shape llama-8b`` builds a Llama-3-8B-shaped model (32 layers, 8 KV heads of 128,
bf16: 128 KiB of KV per token) with random weights on the device, nothing downloaded.

Writes ``kv_tiers-<model>-<device>.md`` / ``.json`` / ``.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import mmap
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import torch
import transformers

from bench.report import markdown_table, write_results
from kvc.block_keys import BlockKey, compute_block_keys
from kvc.models import DEFAULT_MODEL_DIR
from node_agent.blocks.tiers import LowerTiers
from node_agent.blocks.types import KvMedium
from node_agent.engines.embedded.kv_tensors import KvCache, TensorKvCodec, tensor_kv
from node_agent.engines.embedded.model import EmbeddedModel
from node_agent.kv import KvContent

BLOCK_TOKENS: Final = 32  # the agent's pool block
TENANT: Final = "bench"
MIB: Final = 1 << 20

# Llama-3-8B's shape (meta-llama/Meta-Llama-3-8B config.json); weights are random.
LLAMA_8B: Final[dict[str, Any]] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
SHAPES: Final = {"llama-8b": LLAMA_8B}


@dataclass(frozen=True, slots=True)
class Timing:
    """One operation over all of a prompt's blocks (or the whole prefill)."""

    median_ms: float
    min_ms: float
    ms_per_mib: float  # median, per MiB of KV
    gb_per_s: float  # KV bytes / median (1e9 bytes)
    samples_ms: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class LengthResult:
    tokens: int
    blocks: int
    kv_bytes: int
    recompute: Timing  # prefill of ``tokens`` from nothing (per MiB: of the KV it makes)
    l2_put: Timing
    l2_load: Timing  # ``load`` block by block
    l2_prefetch: Timing  # ``prefetch`` (one batch) then ``load``: the agent's path
    link: Timing | None  # one pinned host buffer of the same bytes copied at once (CUDA)
    l3_put: Timing
    l3_load_cached: Timing  # files in the page cache
    l3_load_cold: Timing | None  # files dropped from the page cache; None: cannot drop
    cold_resident_fraction: float | None  # file pages still cached after the drops


def _timing(samples_s: Sequence[float], nbytes: int) -> Timing:
    median = statistics.median(samples_s)
    return Timing(
        median_ms=median * 1e3,
        min_ms=min(samples_s) * 1e3,
        ms_per_mib=median * 1e3 / (nbytes / MIB),
        gb_per_s=nbytes / max(median, 1e-9) / 1e9,
        samples_ms=tuple(s * 1e3 for s in samples_s),
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- model
def build_shape(shape: str, device: str) -> EmbeddedModel:
    """A model of a named shape with random bf16 weights, built on ``device``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    target = torch.device(device)
    config = LlamaConfig(**SHAPES[shape])
    with torch.device(target):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to(target)
    model.eval()
    return EmbeddedModel(model, name=shape, device=target)


def prompt_ids(num_tokens: int, vocab_size: int) -> list[int]:
    generator = torch.Generator().manual_seed(num_tokens)
    ids: list[int] = torch.randint(0, vocab_size, (num_tokens,), generator=generator).tolist()
    return ids


# ---------------------------------------------------------------------------- checks
def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(
        torch.equal(a.contiguous().view(torch.uint8), b.to(a.device).contiguous().view(torch.uint8))
    )


def verify(
    what: str, loaded: Sequence[KvContent | None], blocks: Sequence[KvCache], device: torch.device
) -> None:
    """Raise unless every loaded block is on ``device`` and bit-identical to its original."""
    if len(loaded) != len(blocks):
        raise RuntimeError(f"{what}: {len(loaded)} blocks loaded, {len(blocks)} expected")
    for index, (got, want) in enumerate(zip(loaded, blocks, strict=True)):
        if got is None:
            raise RuntimeError(f"{what}: block {index} was not loaded (a miss)")
        kv = tensor_kv(got)
        if kv.device.type != device.type:
            raise RuntimeError(f"{what}: block {index} loaded onto {kv.device}, not {device}")
        if kv.layout != want.layout or kv.num_tokens != want.num_tokens:
            raise RuntimeError(f"{what}: block {index} is {kv}, expected {want}")
        for layer, ((gk, gv), (wk, wv)) in enumerate(zip(kv.layers, want.layers, strict=True)):
            if not (_same_bits(gk, wk) and _same_bits(gv, wv)):
                raise RuntimeError(f"{what}: block {index} layer {layer} differs from the original")


# ---------------------------------------------------------------------------- page cache
def _block_files(disk_dir: Path) -> list[Path]:
    return sorted(disk_dir.glob("*.kvblock"))


def drop_page_cache(files: Sequence[Path]) -> bool:
    """fsync each file (dirty pages cannot be dropped) and tell the kernel to drop its
    pages. False where ``posix_fadvise`` does not exist."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def resident_fraction(files: Sequence[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (``mincore``); None: cannot tell."""
    try:
        mincore = ctypes.CDLL(None, use_errno=True).mincore
    except (OSError, AttributeError):
        return None
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    mincore.restype = ctypes.c_int
    resident = total = 0
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            start = ctypes.c_char.from_buffer(mm)  # the mapping's address; faults nothing
            try:
                rc = mincore(ctypes.addressof(start), size, vec)
            finally:
                del start
        if rc != 0:
            return None
        resident += sum(v & 1 for v in vec)
        total += pages
    return resident / total if total else None


# ---------------------------------------------------------------------------- timing
def _time_puts(
    tiers: LowerTiers,
    keys: Sequence[BlockKey],
    blocks: Sequence[KvCache],
    repeats: int,
    medium: KvMedium,
    device: torch.device,
) -> list[float]:
    """Demote every block; a warm-up round, then ``repeats`` timed ones. The blocks stay
    in ``tiers`` after the last round."""
    samples: list[float] = []
    for round_ in range(repeats + 1):
        _sync(device)
        started = time.perf_counter()
        moves = [tiers.put(key, TENANT, block) for key, block in zip(keys, blocks, strict=True)]
        _sync(device)
        elapsed = time.perf_counter() - started
        if round_ > 0:
            samples.append(elapsed)
        went = {move.medium for batch in moves for move in batch}
        if went != {medium}:
            raise RuntimeError(f"put into {medium.name}: blocks went to {went}")
        if round_ < repeats:
            for key in keys:
                tiers.discard(key)
    return samples


def _time_loads(
    what: str,
    tiers: LowerTiers,
    keys: Sequence[BlockKey],
    blocks: Sequence[KvCache],
    repeats: int,
    device: torch.device,
    *,
    warm_up: bool,
    before: Callable[[], None] | None = None,
) -> list[float]:
    """Promote every block (``load``; the blocks stay in ``tiers``), ``repeats`` timed
    passes, each checked against the originals."""
    samples: list[float] = []
    for round_ in range(repeats + int(warm_up)):
        if before is not None:
            before()
        _sync(device)
        started = time.perf_counter()
        loaded = [tiers.load(key) for key in keys]
        _sync(device)
        elapsed = time.perf_counter() - started
        if round_ >= int(warm_up):
            samples.append(elapsed)
        verify(what, loaded, blocks, device)
        del loaded
    return samples


def _time_prefetch(
    tiers: LowerTiers,
    keys: Sequence[BlockKey],
    blocks: Sequence[KvCache],
    repeats: int,
    device: torch.device,
) -> list[float]:
    """The agent's promotion path: ``prefetch`` every block (on an inline runner: the
    timing includes the copies), then ``load`` each, as the transaction does; a warm-up
    pass, then ``repeats`` timed ones, each checked against the originals."""
    samples: list[float] = []
    for round_ in range(repeats + 1):
        _sync(device)
        started = time.perf_counter()
        staged = tiers.prefetch(keys, lambda: None)
        loaded = [tiers.load(key) for key in keys]
        _sync(device)
        elapsed = time.perf_counter() - started
        if staged != len(keys):
            raise RuntimeError(f"prefetch staged {staged} of {len(keys)} blocks")
        if round_ > 0:
            samples.append(elapsed)
        tiers.unstage(keys)
        verify("L2 prefetch", loaded, blocks, device)
        del loaded
    return samples


def _time_link(nbytes: int, repeats: int, device: torch.device) -> list[float] | None:
    """One copy of ``nbytes`` from one pinned host buffer onto ``device`` (CUDA only)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    samples: list[float] = []
    for round_ in range(repeats + 1):
        _sync(device)
        started = time.perf_counter()
        target.copy_(host, non_blocking=True)
        _sync(device)
        if round_ > 0:
            samples.append(time.perf_counter() - started)
    del host, target
    return samples


def measure_length(
    model: EmbeddedModel,
    num_tokens: int,
    *,
    repeats: int,
    disk_dir: Path,
    log: Callable[[str], None] = lambda _: None,
) -> LengthResult:
    """Recompute vs L2 and L3 load (and put) for one prompt length; see the module doc."""
    if num_tokens <= 0 or num_tokens % BLOCK_TOKENS:
        raise ValueError(f"prompt length {num_tokens} is not a multiple of {BLOCK_TOKENS}")
    if num_tokens > model.max_model_len:
        raise ValueError(f"{num_tokens} tokens exceed {model.name}'s {model.max_model_len}")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    device = torch.device(model.device)
    ids = prompt_ids(num_tokens, model.vocab_size)

    log(f"{num_tokens} tokens: recompute")
    model.forward(ids)  # warm-up
    recompute_s: list[float] = []
    kv: KvCache | None = None
    for _ in range(repeats):
        kv = None
        _sync(device)
        started = time.perf_counter()
        _, kv = model.forward(ids)
        _sync(device)
        recompute_s.append(time.perf_counter() - started)
    assert kv is not None
    blocks = [kv.slice(start, start + BLOCK_TOKENS) for start in range(0, num_tokens, BLOCK_TOKENS)]
    del kv
    _free(device)
    keys = compute_block_keys(ids, tenant=TENANT, model=model.name, block_size=BLOCK_TOKENS)
    nbytes = sum(block.nbytes for block in blocks)
    codec = TensorKvCodec(model.device)

    log(f"{num_tokens} tokens: L2 host ({nbytes / MIB:.1f} MiB)")
    host = LowerTiers(codec, host_bytes=2 * nbytes, disk_bytes=0, stage_bytes=2 * nbytes)
    l2_put = _time_puts(host, keys, blocks, repeats, KvMedium.HOST, device)
    l2_load = _time_loads("L2 load", host, keys, blocks, repeats, device, warm_up=True)
    l2_prefetch = _time_prefetch(host, keys, blocks, repeats, device)
    host.clear()
    del host
    _free(device)
    link = _time_link(nbytes, repeats, device)
    _free(device)

    log(f"{num_tokens} tokens: L3 disk")
    tier_dir = Path(tempfile.mkdtemp(prefix=f"l3-{num_tokens}-", dir=disk_dir))
    disk = LowerTiers(codec, host_bytes=0, disk_dir=tier_dir, disk_bytes=2 * nbytes)
    try:
        l3_put = _time_puts(disk, keys, blocks, repeats, KvMedium.DISK, device)
        files = _block_files(tier_dir)
        if len(files) != len(keys):
            raise RuntimeError(f"L3 holds {len(files)} files for {len(keys)} blocks")
        l3_cached = _time_loads("L3 load", disk, keys, blocks, repeats, device, warm_up=True)
        l3_cold: list[float] | None = None
        fractions: list[float] = []
        if drop_page_cache(files):

            def drop() -> None:
                drop_page_cache(files)
                fraction = resident_fraction(files)
                if fraction is not None:
                    fractions.append(fraction)

            log(f"{num_tokens} tokens: L3 disk, cold")
            l3_cold = _time_loads(
                "L3 cold load", disk, keys, blocks, repeats, device, warm_up=False, before=drop
            )
    finally:
        disk.clear()
        with contextlib.suppress(OSError):
            for leftover in tier_dir.iterdir():
                leftover.unlink()
            tier_dir.rmdir()
    del disk, blocks
    _free(device)

    return LengthResult(
        tokens=num_tokens,
        blocks=len(keys),
        kv_bytes=nbytes,
        recompute=_timing(recompute_s, nbytes),
        l2_put=_timing(l2_put, nbytes),
        l2_load=_timing(l2_load, nbytes),
        l2_prefetch=_timing(l2_prefetch, nbytes),
        link=None if link is None else _timing(link, nbytes),
        l3_put=_timing(l3_put, nbytes),
        l3_load_cached=_timing(l3_cached, nbytes),
        l3_load_cold=None if l3_cold is None else _timing(l3_cold, nbytes),
        cold_resident_fraction=statistics.fmean(fractions) if fractions else None,
    )


def measure(
    model: EmbeddedModel,
    lengths: Sequence[int],
    *,
    repeats: int,
    disk_dir: Path,
    log: Callable[[str], None] = lambda _: None,
) -> list[LengthResult]:
    """``measure_length`` for each prompt length, in order."""
    return [measure_length(model, n, repeats=repeats, disk_dir=disk_dir, log=log) for n in lengths]


# ---------------------------------------------------------------------------- report
def _filesystem(path: Path) -> str:
    """The type of the filesystem ``path`` is on (longest mount point in /proc/mounts)."""
    best, fs = "", "unknown"
    resolved = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            mount = parts[1]
            inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) > len(best):
                best, fs = mount, parts[2]
    return fs


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (cuda)"
    return f"CPU, {torch.get_num_threads()} torch threads"


def table_rows(results: Sequence[LengthResult]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for r in results:
        rec = r.recompute.median_ms
        ops: list[tuple[str, Timing | None, bool]] = [
            ("recompute (prefill)", r.recompute, False),
            ("L2 host load, block by block", r.l2_load, True),
            ("L2 host prefetch + load (the agent's path)", r.l2_prefetch, True),
            ("one pinned copy of the same bytes (link ceiling)", r.link, True),
            ("L3 disk load, page cache (warm)", r.l3_load_cached, True),
            ("L3 disk load, cold (fadvise DONTNEED)", r.l3_load_cold, True),
            ("L2 host put", r.l2_put, False),
            ("L3 disk put", r.l3_put, False),
        ]
        for what, timing, is_load in ops:
            if timing is None:
                rows.append([r.tokens, r.kv_bytes / MIB, what, "n/a", "n/a", "n/a", ""])
                continue
            vs = f"{rec / max(timing.median_ms, 1e-9):,.1f}x" if is_load else ""
            rows.append(
                [
                    r.tokens,
                    r.kv_bytes / MIB,
                    what,
                    timing.median_ms,
                    timing.ms_per_mib,
                    timing.gb_per_s,
                    vs,
                ]
            )
    return rows


def plot(path: Path, title: str, results: Sequence[LengthResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.tokens for r in results]
    series: list[tuple[str, Callable[[LengthResult], Timing | None], str, str]] = [
        ("recompute (prefill)", lambda r: r.recompute, "black", "-"),
        ("L2 host load, block by block", lambda r: r.l2_load, "tab:olive", "-"),
        ("L2 host prefetch + load", lambda r: r.l2_prefetch, "tab:green", "-"),
        ("one pinned copy (link ceiling)", lambda r: r.link, "tab:gray", "--"),
        ("L3 disk load, page cache", lambda r: r.l3_load_cached, "tab:blue", "-"),
        ("L3 disk load, cold", lambda r: r.l3_load_cold, "tab:red", "-"),
        ("L2 host put", lambda r: r.l2_put, "tab:green", ":"),
        ("L3 disk put", lambda r: r.l3_put, "tab:blue", ":"),
    ]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, pick, color, style in series:
        points = [(n, t) for n, t in zip(x, map(pick, results), strict=True) if t is not None]
        if not points:
            continue
        xs = [n for n, _ in points]
        marker = "s" if label.startswith("recompute") else "o"
        if style == "-":
            left.plot(xs, [t.median_ms for _, t in points], style, color=color, marker=marker,
                      label=label)  # fmt: skip
        right.plot(xs, [t.gb_per_s for _, t in points], style, color=color, marker=marker,
                   label=label)  # fmt: skip
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(x, [str(n) for n in x])
        ax.set_xlabel("prompt tokens")
        ax.grid(True, which="both", alpha=0.3)
    left.set_ylabel("median ms (all blocks)")
    left.set_title("Load from a lower tier vs recompute")
    left.legend(fontsize=8)
    right.set_ylabel("GB/s of KV (recompute: KV bytes / prefill time)")
    right.set_title("Throughput: a tier pays off above the black line")
    right.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def block_token_counts(text: str) -> list[int]:
    """``--tokens``: comma-separated token counts, each a multiple of the block."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of ints: {text}") from exc
    if not values or any(v <= 0 or v % BLOCK_TOKENS for v in values):
        raise argparse.ArgumentTypeError(f"token counts must be multiples of {BLOCK_TOKENS}")
    return values


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when available, else cpu")  # fmt: skip
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--model", type=Path, default=None,
                       help=f"a model folder (default {DEFAULT_MODEL_DIR.name})")  # fmt: skip
    which.add_argument("--shape", choices=sorted(SHAPES), default=None,
                       help="a named shape with random weights, built on the device")  # fmt: skip
    parser.add_argument("--tokens", type=block_token_counts, default=[512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--disk-dir", type=Path, default=None,
                        help="where L3 files go (default: the system temp dir)")  # fmt: skip
    ns = parser.parse_args(args)
    if ns.repeats < 1:
        parser.error("--repeats must be >= 1")
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    command = "python -m bench.kv_tiers" + ("" if not args else " " + shlex.join(args))

    def log(message: str) -> None:
        print(f"[kv_tiers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    log(f"building the model on {device}")
    if ns.shape is not None:
        model = build_shape(ns.shape, device)
    else:
        model = EmbeddedModel.load(ns.model or DEFAULT_MODEL_DIR, device=device)
    lengths = [n for n in ns.tokens if n <= model.max_model_len]
    skipped = [n for n in ns.tokens if n > model.max_model_len]
    for n in skipped:
        log(f"skipping {n} tokens: {model.name}'s context is {model.max_model_len}")

    if ns.disk_dir is not None:
        ns.disk_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kv_tiers-", dir=ns.disk_dir) as tmp:
        disk_dir = Path(tmp)
        fs = _filesystem(disk_dir)
        results = measure(model, lengths, repeats=ns.repeats, disk_dir=disk_dir, log=log)

    torch_device = torch.device(model.device)
    layout = model.layout
    date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    cold = [r.cold_resident_fraction for r in results if r.cold_resident_fraction is not None]
    cold_note = (
        f"after each drop {max(cold):.1%} of the files' pages were still cached (mincore)"
        if cold
        else "page residency after the drop not checked"
    )
    l2_note = (
        " On CPU the codec's host copy *is* the device tensor (L1 and L2 are one memory):"
        " L2 put/load are bookkeeping only."
        if torch_device.type == "cpu"
        else ""
    )
    header = "\n".join(
        [
            f"Command: `{command}`",
            "",
            f"- Device: {_device_name(torch_device)}",
            f"- torch {torch.__version__}, transformers {transformers.__version__}, "
            f"Python {platform.python_version()}; {date}",
            f"- Model: {model.name} ({layout.num_layers} layers, {layout.num_kv_heads} KV heads "
            f"x {layout.head_dim}, {layout.dtype}: {layout.bytes_per_token:,} B of KV per "
            f"token), block {BLOCK_TOKENS} tokens",
            f"- L3 directory: {disk_dir.parent} ({fs}); median of {ns.repeats} repeats after a "
            "warm-up",
            *([f"- Skipped (beyond the model's context): {skipped}"] if skipped else []),
            "",
            "Times are for all of the prompt's blocks, through `LowerTiers.put`/`load` "
            "(load = promotion onto the device: L2 a host-to-device copy; L3 file read + CRC "
            "+ decode + copy). *page cache*: the block files were just written or read; "
            f"*cold*: each file fsynced and dropped with `posix_fadvise(DONTNEED)` before every "
            f"pass ({cold_note}). Put into L3 writes through the page cache (no fsync). "
            "`recompute / this`: how many times faster than the prefill a hit is; GB/s of "
            "the recompute row: KV bytes the prefill makes per second." + l2_note,
            "",
            "",
        ]
    )
    table = header + markdown_table(
        ["tokens", "KV MiB", "operation", "median ms", "ms / MiB", "GB/s", "recompute / this"],
        table_rows(results),
    )
    name = f"kv_tiers-{model.name}-{torch_device.type}"
    data: dict[str, Any] = {
        "command": command,
        "device": _device_name(torch_device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": date,
        "model": model.name,
        "layout": asdict(layout),
        "block_tokens": BLOCK_TOKENS,
        "repeats": ns.repeats,
        "disk_dir_fs": fs,
        "skipped_tokens": skipped,
        "results": [asdict(r) for r in results],
    }
    md = write_results(ns.out, name, f"KV tiers vs recompute: {model.name} on {device}",
                       table, data)  # fmt: skip
    if results:
        plot(ns.out / f"{name}.png", f"{model.name} on {_device_name(torch_device)}", results)
    print(md.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
