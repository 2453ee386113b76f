"""Scenario files: one named, rerunnable experiment each (``scenarios/*.json``).

A scenario fixes the fleet (``cluster``: a ``ClusterConfig``), the hardware profile (with
optional ``profile_overrides``), the SLOs, the scheduler knobs shared by every run, the
replay ``speed`` (or a ``speeds`` sweep for capacity curves) and the ``runs`` it compares:
each run is a scheduling policy with optional per-run admission/threshold/cluster
overrides. ``baseline`` names the run the others are compared with. Example::

    {"name": "ttft-by-policy", "paper": "§4.2 Fig. 5 ...", "speed": 1.25,
     "cluster": {"prefill_instances": 8, "decode_instances": 8},
     "scheduler": {"admission": "none"}, "baseline": "kv_centric",
     "runs": [{"name": "round_robin", "policy": "round_robin"}, ...]}

Knobs: every field below; unknown fields are errors. ``load_scenario`` takes a bundled
name or a path. Complexity: trivial (validation of a small JSON object).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any, ClassVar, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from conductor.core.policies import Policy
from conductor.core.scheduler import Admission, SchedulerConfig, Slo
from kvc.priors import DecodePrior, PrefillPrior
from kvc_sim.cluster_config import ClusterConfig
from kvc_sim.profile import Profile, SimConfigError, load_profile, read_config_json

__all__ = [
    "RunSpec",
    "Scenario",
    "SchedulerSpec",
    "SloSpec",
    "bundled_scenarios",
    "load_scenario",
]

_STRICT = ConfigDict(extra="forbid")


@dataclass(frozen=True, slots=True)
class SloSpec:
    __pydantic_config__: ClassVar[ConfigDict] = _STRICT

    ttft_s: float = 30.0
    tbt_s: float = 0.1
    tbt_thresholds_s: tuple[float, ...] = (0.1, 0.2, 0.3)

    def slo(self) -> Slo:
        return Slo(ttft_s=self.ttft_s, tbt_s=self.tbt_s)


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    __pydantic_config__: ClassVar[ConfigDict] = _STRICT

    admission: str = "none"
    kvcache_balancing_threshold: float = 2.0
    min_migration_blocks: int = 1
    output_length_prior_tokens: float = 256.0  # prior mean; the scheduler learns lengths
    # The conductor's priors = the profile's x prior_scale (1: exact). priors_measured:
    # each node's start-up calibration reports them (False: the conductor learns online).
    prior_scale: float = 1.0
    priors_measured: bool = True


@dataclass(frozen=True, slots=True)
class RunSpec:
    __pydantic_config__: ClassVar[ConfigDict] = _STRICT

    name: str
    policy: str
    admission: str | None = None
    kvcache_balancing_threshold: float | None = None
    cluster_overrides: Mapping[str, Any] = field(default_factory=dict)
    scheduler_overrides: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Scenario:
    __pydantic_config__: ClassVar[ConfigDict] = _STRICT

    name: str
    description: str
    paper: str
    cluster: ClusterConfig
    runs: tuple[RunSpec, ...]
    baseline: str
    profile: str = "llama3-70b-8xa800"
    profile_overrides: Mapping[str, Any] = field(default_factory=dict)
    speed: float = 1.0
    speeds: tuple[float, ...] = ()
    slo: SloSpec = field(default_factory=SloSpec)
    scheduler: SchedulerSpec = field(default_factory=SchedulerSpec)

    def __post_init__(self) -> None:
        names = [r.name for r in self.runs]
        if not names or len(set(names)) != len(names):
            raise ValueError("runs must be non-empty with unique names")
        if self.baseline not in names:
            raise ValueError(f"baseline {self.baseline!r} is not one of the runs {names}")
        for run in self.runs:
            Policy(run.policy)
            Admission(run.admission or self.scheduler.admission)
        if self.speed <= 0 or any(s <= 0 for s in self.speeds):
            raise ValueError("speeds must be > 0")

    def load_profile(self) -> Profile:
        return load_profile(self.profile, dict(self.profile_overrides))

    def select(self, name: str | None) -> tuple[RunSpec, ...]:
        """Every run, or those named ``name`` (or using policy ``name``)."""
        if name is None:
            return self.runs
        chosen = tuple(r for r in self.runs if name in (r.name, r.policy))
        if not chosen:
            known = sorted({r.name for r in self.runs} | {r.policy for r in self.runs})
            raise SimConfigError(f"scenario {self.name!r} has no run {name!r}; known: {known}")
        return chosen

    def cluster_for(self, run: RunSpec) -> ClusterConfig:
        if not run.cluster_overrides:
            return self.cluster
        return _CLUSTER_ADAPTER.validate_python(
            {**_fields(self.cluster), **dict(run.cluster_overrides)}
        )

    def scheduler_for(self, run: RunSpec, profile: Profile) -> SchedulerConfig:
        """The run's scheduler knobs; priors from the profile (the scheduler learns on)."""
        spec = self.scheduler
        if run.scheduler_overrides:
            spec = _SCHEDULER_ADAPTER.validate_python(
                {**_fields(spec), **dict(run.scheduler_overrides)}
            )
        threshold = run.kvcache_balancing_threshold
        return SchedulerConfig(
            policy=run.policy,
            admission=Admission(run.admission or spec.admission),
            kvcache_balancing_threshold=(
                spec.kvcache_balancing_threshold if threshold is None else threshold
            ),
            min_migration_blocks=spec.min_migration_blocks,
            output_length_prior_tokens=spec.output_length_prior_tokens,
            prefill_prior=_scaled(profile.prefill_prior(), spec.prior_scale),
            decode_prior=_scaled(profile.decode_prior(), spec.prior_scale),
            priors_measured=spec.priors_measured,
            transfer_bandwidth_bytes_per_s=profile.network.nic_bytes_per_s,
            transfer_latency_s=profile.network.latency_s,
        )


_P = TypeVar("_P", PrefillPrior, DecodePrior)


def _scaled(prior: _P, scale: float) -> _P:
    """``prior`` with every coefficient multiplied by ``scale`` (a misspecified prior)."""
    if scale == 1.0:
        return prior
    return type(prior)(*(c * scale for c in prior.coefficients))


_CLUSTER_ADAPTER: TypeAdapter[ClusterConfig] = TypeAdapter(ClusterConfig)
_SCHEDULER_ADAPTER: TypeAdapter[SchedulerSpec] = TypeAdapter(SchedulerSpec)
_SCENARIO_ADAPTER: TypeAdapter[Scenario] = TypeAdapter(Scenario)


def _fields(config: ClusterConfig | SchedulerSpec) -> dict[str, Any]:
    return {f.name: getattr(config, f.name) for f in fields(config)}


def bundled_scenarios() -> list[str]:
    folder = resources.files("kvc_sim") / "scenarios"
    return sorted(
        p.name.removesuffix(".json") for p in folder.iterdir() if p.name.endswith(".json")
    )


def load_scenario(name_or_path: str) -> Scenario:
    """A bundled scenario by name (``scenarios/NAME.json``) or a JSON file."""
    data, where = read_config_json(name_or_path, "scenarios")
    try:
        return _SCENARIO_ADAPTER.validate_python(data)
    except (ValidationError, ValueError) as exc:
        raise SimConfigError(f"{where}: {exc}") from exc
