"""Request bodies and response shapes of the simulated engine's OpenAI API, as vLLM 0.32.

In
    ``CompletionRequest`` and ``ChatCompletionRequest`` take the fields this engine
    honours (``model``, ``prompt``/``messages``, ``max_tokens``
    (``max_completion_tokens``), ``stream``, ``stream_options.include_usage``,
    ``temperature``, ``top_p``, ``seed``, ``stop``, ``ignore_eos``, ``return_token_ids``,
    ``cache_salt``, ``kv_transfer_params``, ``vllm_xargs.kv_cache_report_mode``,
    ``add_special_tokens``, ``add_generation_prompt``, ``chat_template_kwargs``,
    ``request_id``, ``user``, ``priority``) and fields that are accepted at their neutral value only
    (``n=1``, ``echo=false``, ``logprobs`` unset (chat: or false),
    ``continue_final_message=false`` (chat), ``skip_special_tokens=true``,
    ``no_stop_trim=false``, ``return_hidden_states=false`` — vLLM's defaults, which
    vllm-router and smg write into every body they re-serialize); chat also takes SGLang's
    ``separate_reasoning``/``stream_reasoning``/``include_reasoning`` (vllm-router sends
    them), which change nothing for a model without a reasoning parser. Anything else is
    refused (400) rather than silently ignored: a simulated engine must not pretend to do
    what it does not.

Out
    Dicts with vLLM's keys in vLLM's order: non-streamed bodies are vLLM's
    ``model_dump()`` (every field, ``null`` included), stream chunks its
    ``model_dump_json(exclude_unset=True)``, the usage chunk ``exclude_none=True``.
    ``tests/unit/test_vllm_sim_protocol.py`` compares them with shapes produced by vLLM's
    own models. Errors: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "chat_chunk",
    "chat_response",
    "chat_role_chunk",
    "completion_chunk",
    "completion_response",
    "error_body",
    "usage",
    "usage_chunk",
]

XargValue = str | int | float | list[str | int | float]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    cache_salt: str | None = Field(None, min_length=1)
    kv_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, XargValue] | None = None
    n: Literal[1] = 1
    # vLLM's defaults, which routers (vllm-router) spell out: this engine already behaves
    # so (its stand-in ids are no special tokens, stop strings are trimmed, no hidden
    # states); any other value is refused.
    skip_special_tokens: Literal[True] = True
    no_stop_trim: Literal[False] = False
    return_hidden_states: Literal[False] = False
    request_id: str | None = None
    user: str | None = None
    # vLLM's request priority (lower first) under --scheduling-policy priority; else 0.
    priority: int = Field(0, ge=-(2**31), lt=2**31)
    # Sampling that reshapes logits: this engine has none (its output ids are fixed), so
    # only the values that change nothing are served.
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    presence_penalty: float = Field(0.0, ge=0, le=0)
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value:
            raise ValueError("logit_bias is not supported by the simulated engine")
        return value

    @field_validator("vllm_xargs")
    @classmethod
    def _xargs(cls, value: dict[str, XargValue] | None) -> dict[str, XargValue] | None:
        for key, item in (value or {}).items():
            if key != "kv_cache_report_mode":
                raise ValueError(f"vllm_xargs.{key} is not supported by the simulated engine")
            if item not in ("incremental", "full"):
                raise ValueError("vllm_xargs.kv_cache_report_mode must be 'incremental' or 'full'")
        return value

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def report_full(self) -> bool:
        return (self.vllm_xargs or {}).get("kv_cache_report_mode") == "full"

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    max_tokens: int | None = Field(16, ge=1)
    echo: Literal[False] = False
    logprobs: None = None
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: str | list[int]) -> str | list[int]:
        if isinstance(value, list) and not value:  # the range: one pass, in the route
            raise ValueError("a token-id prompt must be non-empty")
        return value


class ChatCompletionRequest(_GenerationRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Chat's logprobs is a switch (OpenAI's default false), which routers (vllm-router,
    # smg) spell out; only off is served. vLLM's continue_final_message likewise.
    logprobs: Literal[False] | None = None
    continue_final_message: Literal[False] = False
    # SGLang's reasoning switches, which vllm-router writes into chat bodies. Without a
    # reasoning parser (none here, as vLLM without --reasoning-parser) an answer has no
    # reasoning part to separate, stream or include, so every value behaves the same.
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    include_reasoning: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------------- responses
def usage(prompt: int, completion: int, cached: int | None, *, full: bool) -> dict[str, Any]:
    """``UsageInfo``; ``full``: every field (``model_dump``), else ``exclude_none``."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if full:
        out["prompt_tokens_details"] = (
            None
            if cached is None
            else {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}
        )
        out["completion_tokens_details"] = None
    elif cached is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out


def completion_response(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str,
    stop_reason: str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
    usage_info: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": token_ids,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_token_ids,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_info,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def completion_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    stop_reason: str | None,
    prompt_token_ids: list[int] | None,
    token_ids: list[int] | None,
    return_token_ids: bool,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        "prompt_token_ids": prompt_token_ids,
        "token_ids": token_ids if return_token_ids else None,
    }
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def usage_chunk(
    *, request_id: str, created: int, model: str, chat: bool, usage_info: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_info,
    }


def chat_response(
    *,
    request_id: str,
    created: int,
    model: str,
    content: str,
    finish_reason: str,
    stop_reason: str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
    usage_info: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": token_ids,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_info,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "prompt_text": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_role_chunk(
    *, request_id: str, created: int, model: str, prompt_token_ids: list[int] | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": prompt_token_ids,
        "prompt_text": None,
    }


def chat_chunk(
    *,
    request_id: str,
    created: int,
    model: str,
    content: str,
    finish_reason: str | None,
    stop_reason: str | None,
    token_ids: list[int] | None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"content": content},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    choice["token_ids"] = token_ids
    return {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }


def error_body(message: str, status: int, kind: str = "BadRequestError") -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
