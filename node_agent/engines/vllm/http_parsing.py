"""Reading vLLM's HTTP answers: server-sent events and the Prometheus exposition."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["metric_values", "sse_data"]


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data


def metric_values(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out
