"""``/metrics`` of the simulated engine: the vLLM 0.32 families a node agent reads.

Families (labels ``model_name`` = served name, ``engine="0"``, as vLLM's)
    ``vllm:cache_config_info`` (gauge 1; labels ``block_size``, ``enable_prefix_caching``,
    ``num_gpu_blocks`` (with the null block), ``prefix_caching_hash_algo``, ``engine``),
    ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
    ``vllm:kv_cache_usage_perc`` (0-1), and the counters
    ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens
    looked up / found), ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
    ``vllm:num_preemptions_total``. The names are vLLM's (``vllm/v1/metrics/loggers.py``),
    colons included: they are not this project's own metrics.

Rendering
    The text exposition (format 0.0.4) is written here, byte for byte what
    ``prometheus_client.generate_latest`` writes for the same families (a test compares
    them): every agent polls its engine twice a second, and on a fleet of simulated
    engines sharing a few cores prometheus_client's collect-and-render was a seventh of
    an engine's CPU. The fixed lines are built once; a scrape formats eight numbers.

Values are read from the engine at scrape time: O(1) per scrape.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, cast

from prometheus_client.utils import floatToGoString

from kvc_sim.vllm_sim.runner import EngineRunner

__all__ = ["METRICS_MEDIA_TYPE", "EngineMetrics"]

# A sample's value as prometheus_client writes it (Go's float format).
_go_float = cast(Callable[[float], str], floatToGoString)

METRICS_MEDIA_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES: Final = (
    ("vllm:num_requests_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
)
_COUNTERS: Final = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("vllm:generation_tokens", "Number of generation tokens processed."),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
)


def _label_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class EngineMetrics:
    """The engine's exposition, rendered from ``runner()`` at each scrape."""

    def __init__(self, runner: Callable[[], EngineRunner], model: str) -> None:
        self._runner = runner
        labels = f'{{engine="0",model_name="{_label_value(model)}"}}'  # sorted, as it does
        self._gauge_heads = [
            f"# HELP {name} {_help(doc)}\n# TYPE {name} gauge\n{name}{labels} "
            for name, doc in _GAUGES
        ]
        self._counter_heads = [
            f"# HELP {name}_total {_help(doc)}\n# TYPE {name}_total counter\n{name}_total{labels} "
            for name, doc in _COUNTERS
        ]
        self._info: str | None = None  # the cache config: fixed once the pool exists

    def _info_lines(self, runner: EngineRunner) -> str:
        if self._info is None:
            pool = runner.scheduler.pool
            name = "vllm:cache_config_info"
            self._info = (
                f"# HELP {name} Information of the LLMEngine CacheConfig\n"
                f"# TYPE {name} gauge\n"
                f'{name}{{block_size="{pool.block_size}",'
                f'enable_prefix_caching="{pool.enable_caching}",engine="0",'
                f'num_gpu_blocks="{pool.num_gpu_blocks}",'
                f'prefix_caching_hash_algo="sha256"}} 1.0\n'
            )
        return self._info

    def render(self) -> bytes:
        runner = self._runner()
        scheduler = runner.scheduler
        gauges = (runner.num_running, runner.num_waiting, scheduler.pool.usage)
        counters = (
            scheduler.prefix_cache_queries,
            scheduler.prefix_cache_hits,
            scheduler.prompt_tokens,
            scheduler.generation_tokens,
            scheduler.preemptions,
        )
        parts = [self._info_lines(runner)]
        for head, value in zip(self._gauge_heads, gauges, strict=True):
            parts += (head, _go_float(float(value)), "\n")
        for head, count in zip(self._counter_heads, counters, strict=True):
            parts += (head, _go_float(float(count)), "\n")
        return "".join(parts).encode("utf-8")
