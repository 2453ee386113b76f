"""Reading vLLM's HTTP answers: server-sent events and the Prometheus exposition."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["metric_values", "sample_values", "sse_data", "sse_payload_batches", "sse_payloads"]


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event stream, up to ``[DONE]``."""
    async for data in sse_payloads(response.aiter_bytes()):
        yield data


async def sse_payloads(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent-event body arriving in arbitrary pieces
    (lines may be split across them; ``\n`` or ``\r\n`` ends a line), up to ``[DONE]``."""
    async for batch in sse_payload_batches(chunks):
        for data in batch:
            yield data


async def sse_payload_batches(
    chunks: AsyncIterator[bytes],
) -> AsyncGenerator[list[str], None]:
    """``sse_payloads`` grouped by the piece of body that completed them: a reader that
    lags behind the server gets every event that has arrived in one batch.

    Closes ``chunks`` (when it can be closed) as it ends or is closed, so a reader that
    stops early and closes this generator (``contextlib.aclosing``) leaves neither to
    the event loop's finalizer, which would close each with a task of its own."""
    pending = b""
    try:
        async for chunk in chunks:
            pending += chunk
            if b"\n" not in chunk:
                continue
            *lines, pending = pending.split(b"\n")
            batch: list[str] = []
            for line in lines:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    if batch:
                        yield batch
                    return
                batch.append(data.decode("utf-8"))
            if batch:
                yield batch
        if pending.startswith(b"data:") and (data := pending[5:].strip()) != b"[DONE]" and data:
            yield [data.decode("utf-8")]
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()


def sample_values(text: str, names: Sequence[str]) -> dict[str, list[float]]:
    """The values of the samples named ``names`` in a Prometheus text exposition, label
    sets ignored (what a poller that sums or maxes them needs), ``[]`` for a name that
    is absent.

    Reads only those lines: a vLLM ``/metrics`` is hundreds of histogram buckets, which
    ``metric_values`` (prometheus_client's parser) turns into objects every poll.
    Label values may hold anything (quotes escaped, spaces, braces): the label block is
    skipped quote-aware. Raises ``ValueError`` on a malformed line of a wanted name.
    """
    out: dict[str, list[float]] = {name: [] for name in names}
    wanted = tuple(names)
    for line in text.splitlines():
        if not line.startswith(wanted):
            continue
        end = 0
        while end < len(line) and line[end] not in "{ \t":
            end += 1
        values = out.get(line[:end])
        if values is None:  # a longer name that merely starts like a wanted one
            continue
        rest = line[end:]
        if rest.startswith("{"):
            rest = rest[_label_block_end(rest) :]
        fields = rest.split()
        if not fields:
            raise ValueError(f"a sample without a value: {line!r}")
        values.append(float(fields[0]))
    return out


def _label_block_end(rest: str) -> int:
    """Index just past the ``}`` closing the label block ``rest`` starts with."""
    quoted = False
    i = 1
    while i < len(rest):
        c = rest[i]
        if quoted:
            if c == "\\":
                i += 1  # the escaped character
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c == "}":
            return i + 1
        i += 1
    raise ValueError(f"an unterminated label block: {rest!r}")


def metric_values(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out
