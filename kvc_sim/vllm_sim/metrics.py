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

Values are read from the engine at scrape time (a custom collector on a private
registry): O(1) per scrape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvc_sim.vllm_sim.runner import EngineRunner

__all__ = ["EngineMetrics"]


class _EngineCollector(Collector):
    def __init__(self, runner: Callable[[], EngineRunner], model: str) -> None:
        self._runner = runner
        self._model = model

    def collect(self) -> Iterator[Metric]:
        runner = self._runner()
        scheduler = runner.scheduler
        pool = scheduler.pool
        labels = ["model_name", "engine"]
        values = [self._model, "0"]
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
                "engine",
            ],
        )
        info.add_metric(
            [
                str(pool.block_size),
                str(pool.enable_caching),
                str(pool.num_gpu_blocks),
                "sha256",
                "0",
            ],
            1.0,
        )
        yield info
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             runner.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             runner.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             pool.usage),
        )  # fmt: skip
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, float(value))
            yield gauge
        counters = (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             scheduler.prefix_cache_queries),
            ("vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.",
             scheduler.prefix_cache_hits),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.",
             scheduler.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.",
             scheduler.generation_tokens),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             scheduler.preemptions),
        )  # fmt: skip
        for name, doc, count in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(values, float(count))
            yield counter


class EngineMetrics:
    """A private registry holding the engine's collector."""

    def __init__(self, runner: Callable[[], EngineRunner], model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(runner, model))

    def render(self) -> bytes:
        return generate_latest(self.registry)
