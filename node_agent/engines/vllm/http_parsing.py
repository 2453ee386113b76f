"""Reading vLLM's HTTP answers: server-sent events and the Prometheus exposition."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["metric_values", "sse_data", "sse_payloads"]


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, up to ``[DONE]``."""
    async for data in sse_payloads(response.aiter_bytes()):
        yield data


async def sse_payloads(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event body arriving in arbitrary pieces
    (lines may be split across them; ``\n`` or ``\r\n`` ends a line), up to ``[DONE]``."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        if b"\n" not in chunk:
            continue
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield data.decode("utf-8")
    if pending.startswith(b"data:") and (data := pending[5:].strip()) != b"[DONE]" and data:
        yield data.decode("utf-8")


def metric_values(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out
