"""One streamed ``/v1/completions`` request against any OpenAI-compatible server, timed.

The body: ``prompt`` (text or token ids), ``max_tokens``, ``stream: true`` with
``stream_options.include_usage`` (the last chunk carries ``usage``, with
``prompt_tokens_details.cached_tokens`` where the server reports cache hits),
``ignore_eos: true`` (vLLM's extension: outputs run to ``max_tokens``) and
``temperature: 0``. The server's SSE chunks are read as they come; each chunk with text
is stamped on the clock. The body is encoded before the request's arrival
(``CompletionTarget.encode``, by the dispatcher's ``prepare``), so the client's own work
on a long prompt is not counted in the server's TTFT.

Failures are recorded, never raised: an HTTP error status (its ``Retry-After``, the
OpenAI error envelope's ``code``, the ``X-Kvc-Reject-Reason`` header), an error event
inside the stream, a stream that ends without a ``finish_reason``, a transport error or
the per-request timeout (``timeout_s`` over the whole exchange, queueing excluded).

Knobs: ``CompletionTarget``. Complexity: O(response bytes).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from kvc import fast_json
from kvc_sim.live.records import LiveResult
from kvc_sim.live.schedule import Clock
from kvc_sim.trace import TraceRequest

__all__ = ["CompletionTarget", "PromptFormat", "completions_url", "send_completion"]

PromptFormat = Literal["text", "token-ids"]
_ERROR_BODY_BYTES = 64 * 1024


def completions_url(base_url: str) -> str:
    """``…/v1/completions`` from a server's base URL (with or without ``/v1``).

    Raises ``ValueError`` for anything but an absolute http(s) URL.
    """
    url = httpx.URL(base_url)
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"not an http(s) URL with a host: {base_url!r}")
    path = url.path.rstrip("/")
    if path.endswith("/completions"):
        return str(url.copy_with(path=path))
    if not path.endswith("/v1"):
        path += "/v1"
    return str(url.copy_with(path=path + "/completions"))


@dataclass(frozen=True, slots=True)
class CompletionTarget:
    url: str  # the full /v1/completions URL
    model: str
    timeout_s: float = 600.0
    headers: dict[str, str] = field(default_factory=dict)

    def encode(self, prompt: str | list[int], max_tokens: int) -> bytes:
        """The request's JSON body, encoded (orjson: ~0.2 ms for 16k token ids, where
        httpx's ``json=`` spends ~2.5 ms)."""
        return fast_json.dumps(self.body(prompt, max_tokens))

    def body(self, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }


def _retry_after_s(response: httpx.Response) -> float | None:
    raw = response.headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None  # an HTTP date: not produced by the servers we replay against
    return value if math.isfinite(value) and value >= 0 else None


def _error_fields(payload: Any) -> tuple[str | None, str | None]:
    """(code, message) of an OpenAI error envelope; (None, None) if it is not one."""
    if not isinstance(payload, dict):
        return None, None
    error = payload.get("error")
    if isinstance(error, dict):
        code = error.get("code") or error.get("type")
        message = error.get("message")
        return (
            str(code) if code is not None else "error",
            str(message) if message is not None else None,
        )
    if isinstance(error, str):  # some servers send {"error": "text"}
        return "error", error
    return None, None


async def send_completion(
    client: httpx.AsyncClient,
    target: CompletionTarget,
    request: TraceRequest,
    body: bytes,
    max_tokens: int,
    *,
    clock: Clock,
    origin: float,
    arrival: float,
) -> LiveResult:
    """Send one streamed completion now (``body``: ``target.encode``'s for ``request``
    and ``max_tokens``); ``origin`` is the replay's start on ``clock`` and ``arrival`` the
    request's scheduled arrival on it (both turn into offsets)."""
    sent = clock.now()
    fields: dict[str, Any] = {}
    chunk_times: list[float] = []
    try:
        async with asyncio.timeout(target.timeout_s):
            await _exchange(client, target, body, clock, origin, fields, chunk_times)
    except TimeoutError:
        fields["client_error"] = "timeout"
        fields["error_message"] = f"no complete answer within {target.timeout_s:g} s"
    except httpx.TransportError as exc:
        fields["client_error"] = (
            "connect_error" if isinstance(exc, httpx.ConnectError) else type(exc).__name__
        )
        fields["error_message"] = str(exc) or type(exc).__name__
    if "finish_s" not in fields:
        fields["finish_s"] = clock.now() - origin
    return LiveResult(
        request=request,
        arrival_s=arrival - origin,
        sent_s=sent - origin,
        max_tokens=max_tokens,
        chunk_times_s=tuple(chunk_times),
        **fields,
    )


async def _exchange(
    client: httpx.AsyncClient,
    target: CompletionTarget,
    body: bytes,
    clock: Clock,
    origin: float,
    fields: dict[str, Any],
    chunk_times: list[float],
) -> None:
    """Fill ``fields`` (LiveResult's) and ``chunk_times`` from one exchange."""
    headers = httpx.Headers(target.headers)
    headers["Content-Type"] = "application/json"
    async with client.stream("POST", target.url, content=body, headers=headers) as response:
        fields["status"] = response.status_code
        fields["prefill_node"] = response.headers.get("x-kvc-prefill-node")
        fields["decode_node"] = response.headers.get("x-kvc-decode-node")
        if response.status_code != 200:
            fields["retry_after_s"] = _retry_after_s(response)
            fields["reject_reason"] = response.headers.get("x-kvc-reject-reason")
            raw = b""
            async for part in response.aiter_bytes():
                raw += part
                if len(raw) >= _ERROR_BODY_BYTES:
                    break
            try:
                payload = json.loads(raw)
            except ValueError:
                payload = None
            code, message = _error_fields(payload)
            fields["error_code"] = code
            fields["error_message"] = message or raw[:200].decode("utf-8", "replace")
            fields["finish_s"] = clock.now() - origin
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, event names
            data = line[5:].strip()
            if data == "[DONE]":
                break
            try:
                chunk = fast_json.loads(data)
            except ValueError:
                fields["client_error"] = "bad_stream"
                fields["error_message"] = f"not JSON: {data[:200]!r}"
                return
            code, message = _error_fields(chunk)
            if code is not None:  # an error event inside a 200 stream
                fields["error_code"] = code
                fields["error_message"] = message
                return
            _read_chunk(chunk, clock.now() - origin, fields, chunk_times)
        fields["finish_s"] = clock.now() - origin
        if fields.get("finish_reason") is None:
            fields["client_error"] = "stream_cut"
            fields["error_message"] = "the stream ended without a finish_reason"


def _read_chunk(chunk: Any, now: float, fields: dict[str, Any], chunk_times: list[float]) -> None:
    if not isinstance(chunk, dict):
        return
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        text = choice.get("text")
        if text is None and isinstance(choice.get("delta"), dict):  # a chat-shaped chunk
            text = choice["delta"].get("content")
        if text:
            chunk_times.append(now)
            fields.setdefault("first_token_s", now)
        if choice.get("finish_reason") is not None:
            fields["finish_reason"] = str(choice["finish_reason"])
            fields.setdefault("first_token_s", now)
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        fields["prompt_tokens"] = _int_or_none(usage.get("prompt_tokens"))
        fields["completion_tokens"] = _int_or_none(usage.get("completion_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            fields["cached_tokens"] = _int_or_none(details.get("cached_tokens"))


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
