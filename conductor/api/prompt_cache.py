"""Prompt caching as a product: explicit breakpoints with retention TTLs, and what the
answer reports about them.

Requests
    Automatic prefix caching is always on. On top of it a request may ask the prefill
    node to *retain* a prefix — keep it out of eviction until a TTL after its last use —
    the way Anthropic's prompt caching works:

    * ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` (``ttl`` defaults to
      ``5m``) on a chat message's content part, on a message, or on a tool definition
      (as OpenAI-format proxies such as LiteLLM pass Anthropic's field through), and in
      the Messages API on system, message and tool blocks, or at the top level (the
      last message). The prefix retained is everything up to and including the marked
      element, in the order the prompt is rendered. At most four breakpoints; a longer
      TTL may not follow a shorter one (Anthropic's rules, same 400s).
    * OpenAI's ``prompt_cache_retention``: ``"in_memory"`` is automatic caching;
      ``"24h"`` retains the whole prompt for 24 hours (422 unless the deployment allows
      that long, ``prompt_cache_max_ttl_s``). OpenAI's ``prompt_cache_key`` is a routing
      affinity hint (``conductor.dispatch``).

    A breakpoint shorter than ``prompt_cache_min_tokens`` (Anthropic: 1,024) is not
    retained — automatic caching only — and the usage says ``below_minimum``.

Where a breakpoint falls
    ``kvc.tokenization.ChatTokenizer.chat_token_ids_marked`` renders the request cut at
    each mark and maps the character position to prompt tokens; the node retains the
    whole blocks below it.

Answers
    OpenAI routes: ``usage.prompt_tokens_details.cached_tokens`` (reads) as always, and
    when the request asked for retention an extension object ``usage.prompt_cache``:
    ``{"retention": granted | over_budget | node_full | unsupported | too_long |
    below_minimum,
    "cache_write_tokens", "cache_read_tokens"}``. Messages API: Anthropic's
    ``cache_creation_input_tokens``, ``cache_read_input_tokens`` and ``cache_creation``
    (``ephemeral_5m_input_tokens``, ``ephemeral_1h_input_tokens``), plus the same
    ``retention`` word (``usage.cache_retention``). Cache writes are the prompt tokens up
    to the breakpoints that were not read from cache, counted only when the node
    granted the retention.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from conductor.errors import InvalidRequest, UnprocessableEntity
from conductor.generation import Breakpoint
from kvc.tokenization import ChatMark

__all__ = [
    "MAX_BREAKPOINTS",
    "CacheMarks",
    "TenantCacheLedger",
    "read_marks",
    "retention_ttl_s",
    "ttl_of",
]

MAX_BREAKPOINTS: Final = 4
TTL_S: Final = {"5m": 300.0, "1h": 3600.0}
_RETENTION_24H_S: Final = 86_400.0


def ttl_of(cache_control: Any, where: str) -> float:
    """The TTL in seconds of one ``cache_control`` value (400 when malformed)."""
    param = f"{where}.cache_control"
    if not isinstance(cache_control, dict):
        raise InvalidRequest(f"'{param}' must be an object.", param=param)
    if cache_control.get("type") != "ephemeral":
        raise InvalidRequest(f"'{param}.type' must be 'ephemeral'.", param=param)
    unknown = set(cache_control) - {"type", "ttl"}
    if unknown:
        raise InvalidRequest(
            f"'{param}' has unknown field(s): {', '.join(sorted(unknown))}.", param=param
        )
    ttl = cache_control.get("ttl", "5m")
    if ttl not in TTL_S:
        raise InvalidRequest(f"'{param}.ttl' must be '5m' or '1h'.", param=param)
    return TTL_S[ttl]


@dataclass(frozen=True, slots=True)
class CacheMarks:
    """A chat request's breakpoints, and the request without its ``cache_control``
    fields (what the chat template renders)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    marks: list[ChatMark]
    ttls_s: list[float]  # one per mark


def _part_texts(content: list[Any]) -> list[str]:
    return [p.get("text") or "" if isinstance(p, dict) else "" for p in content]


def _any_marks(messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None) -> bool:
    for message in messages:
        if "cache_control" in message:
            return True
        content = message.get("content")
        if isinstance(content, list) and any(
            isinstance(part, dict) and "cache_control" in part for part in content
        ):
            return True
    return any(isinstance(tool, dict) and "cache_control" in tool for tool in tools or ())


def read_marks(
    messages: Sequence[dict[str, Any]], tools: Sequence[Any] | None, max_ttl_s: float
) -> CacheMarks:
    """Take the ``cache_control`` fields out of a chat request: its marks in prompt
    order (tools, then messages), their TTLs, and the cleaned request."""
    if not _any_marks(messages, tools):  # the common case: nothing to copy
        plain_tools = None if tools is None else list(tools)
        return CacheMarks(list(messages), plain_tools, [], [])
    marks: list[ChatMark] = []
    ttls: list[float] = []
    where_of: list[str] = []

    def mark(value: Any, where: str, at: ChatMark) -> None:
        ttl = ttl_of(value, where)
        if ttl > max_ttl_s:
            raise UnprocessableEntity(
                f"'{where}.cache_control.ttl' is longer than this deployment retains "
                f"({max_ttl_s:g} s).",
                param=f"{where}.cache_control",
                code="unsupported_value",
            )
        marks.append(at)
        ttls.append(ttl)
        where_of.append(where)

    clean_tools: list[dict[str, Any]] | None = None
    if tools is not None:
        clean_tools = []
        for k, tool in enumerate(tools):
            if isinstance(tool, dict) and "cache_control" in tool:
                mark(tool["cache_control"], f"tools[{k}]", ChatMark(tool=k))
                tool = {n: v for n, v in tool.items() if n != "cache_control"}
            clean_tools.append(tool)
    clean: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        item = dict(message)
        content = item.get("content")
        if isinstance(content, list):
            texts = _part_texts(content)
            parts = []
            for j, part in enumerate(content):
                if isinstance(part, dict) and "cache_control" in part:
                    last = j == len(content) - 1
                    cut = None if last else len("\n".join(texts[: j + 1]))
                    mark(part["cache_control"], f"messages[{i}].content[{j}]",
                         ChatMark(message=i, cut=cut))  # fmt: skip
                    part = {n: v for n, v in part.items() if n != "cache_control"}
                parts.append(part)
            item["content"] = parts
        if "cache_control" in item:
            mark(item.pop("cache_control"), f"messages[{i}]", ChatMark(message=i))
        clean.append(item)
    if len(marks) > MAX_BREAKPOINTS:
        raise InvalidRequest(
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(marks)}.",
            param=where_of[MAX_BREAKPOINTS],
        )
    for n in range(1, len(ttls)):
        if ttls[n] > ttls[n - 1]:
            raise InvalidRequest(
                f"'{where_of[n]}.cache_control.ttl': a longer TTL may not follow a shorter "
                "one (tools, then system, then messages).",
                param=f"{where_of[n]}.cache_control",
            )
    return CacheMarks(clean, clean_tools, marks, ttls)


def retention_ttl_s(value: Any, max_ttl_s: float) -> float | None:
    """OpenAI's ``prompt_cache_retention``: None (automatic caching) or a TTL for the
    whole prompt."""
    if value is None or value == "in_memory":
        return None
    if value != "24h":
        raise InvalidRequest(
            "'prompt_cache_retention' must be 'in_memory' or '24h'.",
            param="prompt_cache_retention",
        )
    if max_ttl_s < _RETENTION_24H_S:
        raise UnprocessableEntity(
            f"'prompt_cache_retention' '24h' is longer than this deployment retains "
            f"({max_ttl_s:g} s).",
            param="prompt_cache_retention",
            code="unsupported_value",
        )
    return _RETENTION_24H_S


@dataclass(slots=True)
class TenantCacheCounts:
    requests: int = 0  # requests that asked for retention
    written_tokens: int = 0  # cache writes (granted breakpoints)
    read_tokens: int = 0  # prompt tokens served from cache (every request)
    retained_tokens: int = 0  # tokens up to granted breakpoints
    refused: int = 0  # retentions refused (over budget, node full, unsupported)


class TenantCacheLedger:
    """Per-tenant prompt-cache counters of this conductor since it started, for
    operators (``GET /admin/prompt-cache``). Bounded: past ``max_tenants`` the least
    recently counted tenant is dropped (and counted in ``dropped_tenants``)."""

    def __init__(self, max_tenants: int = 10_000) -> None:
        self._max = max_tenants
        self._by_tenant: OrderedDict[str, TenantCacheCounts] = OrderedDict()
        self.dropped_tenants = 0

    def record(
        self,
        tenant: str,
        *,
        read_tokens: int,
        breakpoints: Sequence[Breakpoint],
        retention: str,
        written_tokens: int,
    ) -> None:
        counts = self._by_tenant.get(tenant)
        if counts is None:
            counts = self._by_tenant[tenant] = TenantCacheCounts()
            if len(self._by_tenant) > self._max:
                self._by_tenant.popitem(last=False)
                self.dropped_tenants += 1
        else:
            self._by_tenant.move_to_end(tenant)
        counts.read_tokens += read_tokens
        if retention == "none":
            return
        counts.requests += 1
        counts.written_tokens += written_tokens
        if retention == "granted":
            counts.retained_tokens += max((bp.tokens for bp in breakpoints), default=0)
        elif retention != "below_minimum":
            counts.refused += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {
            name: {
                "retention_requests": c.requests,
                "written_tokens": c.written_tokens,
                "read_tokens": c.read_tokens,
                "retained_tokens": c.retained_tokens,
                "retention_refused": c.refused,
            }
            for name, c in self._by_tenant.items()
        }
