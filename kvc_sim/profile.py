"""Hardware and model profiles: the simulator's *truth* for prefill, decode and transfer times.

What it models
    One instance = one serving node (the paper's 8xA800 machine). A profile gives:

    * prefill compute from the paper's Eq. (1), ``flops(n) = l*(a*n^2*d + b*n*d^2)``.
      Reusing ``c`` cached tokens leaves ``flops(n) - flops(c)``; the work runs in chunks
      of ``chunk_tokens`` uncached tokens at ``peak_flops * mfu``, each chunk paying
      ``chunk_overhead_s`` (kernel launches, TP all-reduce latency)::

          compute_s(n, c) = (flops(n) - flops(c)) / (peak_flops * mfu)
                            + ceil((n - c) / chunk_tokens) * chunk_overhead_s

      Reused blocks that sit in DRAM (not in the HBM share of the cache) are loaded
      host-to-device at ``h2d_bytes_per_s`` layer by layer, overlapped with compute, so a
      prefill takes ``max(compute_s, load_s)``.
    * decode time between tokens of a continuous batch of ``b`` requests holding ``k`` KV
      tokens: ``tbt_s(b, k) = fixed_s + per_request_s*b + per_context_token_s*k`` (weights
      read once per step, per-sequence work, attention reading every cached KV token).
    * transfers: ``latency_s + bytes / nic_bytes_per_s`` on the sender's and receiver's NIC.
    * KV size per token ``= layers * 2 * (hidden / gqa) * dtype_bytes`` (320 KiB for
      LLaMA3-70B, §2.2).

    These are what the simulated hardware *does*. The scheduler never reads them: it starts
    from priors derived here (``prefill_prior``, ``decode_prior``) and learns from the
    durations the simulator reports through its hooks.

Knobs
    Everything in the JSON file (``profiles/*.json``, package data); a scenario may
    override any field (``profile_overrides``). ``load_profile`` takes a bundled name or a
    path.

Complexity
    Every time function is O(1) (the chunk count is a closed form).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from kvc.priors import DecodePrior, PrefillPrior

__all__ = [
    "DecodeSpec",
    "ModelSpec",
    "NetworkSpec",
    "PrefillSpec",
    "Profile",
    "SimConfigError",
    "bundled_profiles",
    "deep_merge",
    "load_profile",
    "read_config_json",
]

_STRICT = ConfigDict(extra="forbid")


class SimConfigError(ValueError):
    """A profile or scenario file is missing, malformed or out of range."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    __pydantic_config__: ClassVar[ConfigDict] = _STRICT

    name: str
    layers: int  # l
    hidden: int  # d
    a: float  # attention coefficient of Eq. (1)
    b: float  # projection/MLP coefficient of Eq. (1)
    gqa: int  # query heads per KV head
    dtype_bytes: int  # s

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * (self.hidden // self.gqa) * self.dtype_bytes

    def flops(self, tokens: int) -> float:
        """Eq. (1): prefill FLOPs of ``tokens`` tokens from scratch."""
        n = float(tokens)
        return self.layers * (self.a * n * n * self.hidden + self.b * n * self.hidden**2)


@dataclass(frozen=True, slots=True)
class PrefillSpec:
    __pydantic_config__: ClassVar[ConfigDict] = _STRICT

    peak_flops: float  # the instance's total peak (8 x 312 TFLOPS for 8xA800)
    mfu: float  # share of peak a prefill achieves, (0, 1]
    chunk_tokens: int  # chunked prefill: uncached tokens per forward pass
    chunk_overhead_s: float  # fixed cost per chunk
    h2d_bytes_per_s: float  # DRAM -> HBM for reused cached blocks
    hbm_cache_tokens: int  # share of the prefix cache kept in HBM (no load needed)
    cache_tokens: int  # prefix cache per instance, HBM + DRAM (Mooncake: ~3M, §7.3.1)
    # Reading a block back from local disk (the agent's L3 tier, tiered clusters only):
    # a few NVMe drives per instance.
    disk_read_bytes_per_s: float = 4e9


@dataclass(frozen=True, slots=True)
class DecodeSpec:
    __pydantic_config__: ClassVar[ConfigDict] = _STRICT

    fixed_s: float
    per_request_s: float
    per_context_token_s: float
    hbm_kv_tokens: int  # KV the running batch may hold
    max_batch_requests: int


@dataclass(frozen=True, slots=True)
class NetworkSpec:
    __pydantic_config__: ClassVar[ConfigDict] = _STRICT

    nic_bytes_per_s: float  # per instance, each direction
    latency_s: float


@dataclass(frozen=True, slots=True)
class Profile:
    __pydantic_config__: ClassVar[ConfigDict] = _STRICT

    name: str
    description: str
    model: ModelSpec
    prefill: PrefillSpec
    decode: DecodeSpec
    network: NetworkSpec

    def __post_init__(self) -> None:
        m, p, d, n = self.model, self.prefill, self.decode, self.network
        checks = [
            (m.layers > 0 and m.hidden > 0 and m.gqa > 0, "model sizes must be > 0"),
            (m.hidden % m.gqa == 0, "hidden must be a multiple of gqa"),
            (m.a >= 0 and m.b >= 0 and m.dtype_bytes > 0, "model coefficients must be >= 0"),
            (p.peak_flops > 0 and 0 < p.mfu <= 1, "prefill peak_flops > 0 and mfu in (0, 1]"),
            (p.chunk_tokens > 0 and p.chunk_overhead_s >= 0, "chunk_tokens > 0"),
            (p.h2d_bytes_per_s > 0, "h2d_bytes_per_s must be > 0"),
            (p.disk_read_bytes_per_s > 0, "disk_read_bytes_per_s must be > 0"),
            (p.hbm_cache_tokens >= 0 and p.cache_tokens > 0, "cache sizes must be >= 0"),
            (min(d.fixed_s, d.per_request_s, d.per_context_token_s) >= 0, "decode coef >= 0"),
            (d.hbm_kv_tokens > 0 and d.max_batch_requests > 0, "decode capacity must be > 0"),
            (n.nic_bytes_per_s > 0 and n.latency_s >= 0, "network bandwidth must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise SimConfigError(f"profile {self.name!r}: {message}")

    # ------------------------------------------------------------------ truth
    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def prefill_flops_per_s(self) -> float:
        return self.prefill.peak_flops * self.prefill.mfu

    def prefill_compute_s(self, total_tokens: int, cached_tokens: int) -> float:
        """Seconds of GPU time to prefill ``total_tokens`` with ``cached_tokens`` reused."""
        cached = max(0, min(cached_tokens, total_tokens))
        uncached = total_tokens - cached
        if uncached <= 0:
            return 0.0
        work = self.model.flops(total_tokens) - self.model.flops(cached)
        chunks = -(-uncached // self.prefill.chunk_tokens)
        return work / self.prefill_flops_per_s + chunks * self.prefill.chunk_overhead_s

    def h2d_load_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.prefill.h2d_bytes_per_s

    def tier_load_s(self, host_tokens: int, disk_tokens: int) -> float:
        """Promoting blocks from the agent's host-memory and disk tiers (not overlapped:
        the agent loads them in the transaction, before the prefill runs)."""
        kvb = self.kv_bytes_per_token
        return self.h2d_load_s(host_tokens) + disk_tokens * kvb / self.prefill.disk_read_bytes_per_s

    def tbt_s(self, batch_requests: int, context_tokens: int) -> float:
        d = self.decode
        return d.fixed_s + d.per_request_s * batch_requests + d.per_context_token_s * context_tokens

    def wire_s(self, nbytes: int) -> float:
        """Seconds a transfer occupies a NIC (latency excluded)."""
        return nbytes / self.network.nic_bytes_per_s

    # ------------------------------------------------------------------ priors
    def prefill_prior(self) -> PrefillPrior:
        """The scheduler's starting point: Eq. (1) at this profile's peak and MFU."""
        return PrefillPrior.from_flops(
            layers=self.model.layers,
            hidden=self.model.hidden,
            peak_flops=self.prefill.peak_flops,
            mfu=self.prefill.mfu,
            a=self.model.a,
            b=self.model.b,
            fixed_s=self.prefill.chunk_overhead_s,
        )

    def decode_prior(self) -> DecodePrior:
        d = self.decode
        return DecodePrior(d.fixed_s, d.per_request_s, d.per_context_token_s)


_PROFILE_ADAPTER: TypeAdapter[Profile] = TypeAdapter(Profile)


def deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied recursively (dicts merge, anything else replaces)."""
    out = dict(base)
    for key, value in overrides.items():
        old = out.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            out[key] = deep_merge(old, value)
        else:
            out[key] = value
    return out


def bundled_profiles() -> list[str]:
    folder = resources.files("kvc_sim") / "profiles"
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def read_config_json(name_or_path: str, folder: str) -> tuple[dict[str, Any], str]:
    path = Path(name_or_path)
    try:
        if path.suffix == ".json" and path.exists():
            text, where = path.read_text(), str(path)
        else:
            res = resources.files("kvc_sim") / folder / f"{name_or_path}.json"
            text, where = res.read_text(), f"{folder}/{name_or_path}.json"
    except (FileNotFoundError, OSError) as exc:
        raise SimConfigError(f"no {folder[:-1]} named {name_or_path!r}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SimConfigError(f"{where}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise SimConfigError(f"{where}: expected a JSON object")
    return data, where


def load_profile(name_or_path: str, overrides: dict[str, Any] | None = None) -> Profile:
    """A bundled profile by name (``profiles/NAME.json``) or a JSON file, with overrides."""
    data, where = read_config_json(name_or_path, "profiles")
    if overrides:
        data = deep_merge(data, overrides)
    try:
        return _PROFILE_ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise SimConfigError(f"{where}: {exc}") from exc
