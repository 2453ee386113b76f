"""OpenAI wire schemas: permissive in, exact out.

Requests (``OpenAIBaseModel`` subclasses) accept any extra field, so a client
that sends a parameter this gateway does not know is served rather than
rejected; the route reads :meth:`OpenAIBaseModel.unknown_fields` and logs the
names.  Parameters the gateway does understand are range-checked the way the
OpenAI API checks them.

Responses (``_ResponseModel`` subclasses) forbid extra fields and declare their
fields in the order the OpenAI API reference prints them, so
``model_dump_json()`` yields the same key order as api.openai.com.  Two models
shape their own output: :class:`ChoiceDelta` leaves out unset keys (OpenAI's
deltas are ``{"role": "assistant", "content": ""}``, ``{"content": "..."}``,
then ``{}``), and :class:`Usage` leaves out absent ``*_tokens_details``.
Whether a streamed chunk carries a ``usage`` key depends on the request, which
the chunk cannot know; :func:`chunk_json` takes that as an argument.

This module imports nothing but pydantic and the standard library.
"""

from __future__ import annotations

import json
import secrets
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from kvc.fast_json import body_text_is_unicode

__all__ = [
    "SSE_DONE",
    "AgentReadiness",
    "ChatCompletionChoice",
    "ChatCompletionChunk",
    "ChatCompletionMessage",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "ChoiceDelta",
    "ChunkChoice",
    "CompletionChoice",
    "CompletionChunk",
    "CompletionChunkChoice",
    "CompletionFinishReason",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionTokensDetails",
    "ContentPart",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "ErrorDetail",
    "ErrorResponse",
    "FinishReason",
    "FunctionCall",
    "FunctionCallDelta",
    "HealthResponse",
    "MessageRole",
    "ModelCard",
    "ModelList",
    "NotReadyResponse",
    "OpenAIBaseModel",
    "PromptTokensDetails",
    "ReadyResponse",
    "StreamOptions",
    "TokenizeRequest",
    "TokenizeResponse",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "VersionResponse",
    "chunk_json",
    "logit_bias_pairs",
    "new_chat_completion_id",
    "new_completion_id",
    "sse_data",
]

MessageRole = Literal["system", "developer", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "content_filter", "tool_calls"]
CompletionFinishReason = Literal["stop", "length", "content_filter"]

MAX_STOP_SEQUENCES = 4
"""OpenAI accepts up to 4 stop sequences."""

_Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
_TokenId = Annotated[int, Field(ge=0)]
_TOKEN_ID_LIST: TypeAdapter[list[int]] = TypeAdapter(list[int])


# --------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------


_ABSENT: Any = Field(default=None, exclude_if=lambda value: value is None)
"""A response field left out of the JSON while it is None (and optional in the schema)."""


_Seed = Annotated[int, Field(ge=-(2**63), lt=2**63)]
"""A sampling seed: vLLM's range (a signed 64-bit integer)."""


_TEXTLESS: frozenset[type] = frozenset({int, float, bool, type(None)})


def _lone_surrogate_at(value: Any, path: str) -> str | None:
    """The path of the first string in a parsed JSON body that holds a lone UTF-16
    surrogate (JSON allows ``"\\ud800"``; no tokenizer, protobuf or UTF-8 encoder
    does), or None. An ASCII string is known good without being read."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = _lone_surrogate_at(key, where) or _lone_surrogate_at(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        if _TEXTLESS.issuperset(map(type, value)):  # e.g. token ids: one pass at C speed
            return None
        for i, item in enumerate(value):
            found = _lone_surrogate_at(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


class OpenAIBaseModel(BaseModel):
    """Base for request bodies: unknown fields are kept, not rejected."""

    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> set[str]:
        """Names of the fields in the payload that this model does not declare."""
        return set(self.model_extra or {})


class OpenAIRequest(OpenAIBaseModel):
    """Base for a whole request body: text that is not valid Unicode (a lone surrogate
    escaped in the JSON) is a 400 naming where it is, before any field is read."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if body_text_is_unicode():  # orjson decoded the body: it refuses lone surrogates
            return data
        where = _lone_surrogate_at(data, "")
        if where is not None:
            # conductor.errors builds its envelope from this module's models.
            from conductor.errors import InvalidRequest

            raise InvalidRequest(
                f"Invalid '{where}': the text holds a lone UTF-16 surrogate, which is not "
                "valid Unicode.",
                param=where,
                code="invalid_value",
            )
        return data


def _none_to_default(value: Any, info: ValidationInfo, defaults: dict[str, Any]) -> Any:
    """OpenAI marks ``n``, ``stream``, ``echo`` nullable: an explicit null means the default."""
    if value is None and info.field_name is not None:
        return defaults[info.field_name]
    return value


def _stop_list(stop: str | list[str] | None) -> list[str]:
    """``stop`` as a list: order kept, duplicates and empty strings dropped."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    return list(dict.fromkeys(s for s in items if s))


def _check_logit_bias(value: dict[str, float] | None) -> dict[str, float] | None:
    # OpenAI: token ids (as JSON object keys, so strings) to a bias in [-100, 100].
    for token, bias in (value or {}).items():
        if not token.isdecimal():
            raise ValueError(f"logit_bias keys must be token ids, got {token!r}.")
        if not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for {token}.")
    return value


def logit_bias_pairs(value: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """A validated ``logit_bias`` as sorted ``(token id, bias)`` pairs."""
    return tuple(sorted((int(token), float(bias)) for token, bias in (value or {}).items()))


def _check_stream_options(
    value: StreamOptions | None, info: ValidationInfo
) -> StreamOptions | None:
    # OpenAI answers 400 when stream_options is given without stream=true.
    if value is not None and not info.data.get("stream", False):
        raise ValueError("The 'stream_options' parameter is only allowed when 'stream' is enabled.")
    return value


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class ContentPart(OpenAIBaseModel):
    """One element of an array ``content``: ``{"type": "text", "text": ...}`` or any other part.

    Non-text parts (``image_url``, ``input_audio``, ``file`` ...) keep their payload as
    extra fields; whether they are supported is the route's decision.
    """

    type: str
    text: str | None = None
    cache_control: Any = None  # a prompt-cache breakpoint (conductor.api.prompt_cache)


class ChatMessage(OpenAIBaseModel):
    role: MessageRole
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: Any = None
    tool_calls: Any = None
    cache_control: Any = None  # a breakpoint after the whole message


class ChatCompletionRequest(OpenAIRequest):
    """Body of ``POST /v1/chat/completions``."""

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    frequency_penalty: _Penalty | None = None
    presence_penalty: _Penalty | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tokens: int | None = Field(default=None, ge=1)
    """Deprecated by OpenAI in favour of ``max_completion_tokens``; still accepted."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    seed: _Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    # vLLM's sampling extensions: -1 and 0 turn top_k off, as vLLM reads them.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[_TokenId] | None = None
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None
    # Prompt caching (conductor.api.prompt_cache): OpenAI's routing affinity hint and
    # retention ("in_memory" | "24h").
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: str | None = None

    @field_validator("n", "stream", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        return _none_to_default(value, info, {"n": 1, "stream": False})

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("'logprobs' must be set to true when 'top_logprobs' is used.")
        return value

    @field_validator("stream_options")
    @classmethod
    def _stream_options_needs_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        return _check_stream_options(value, info)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return _check_logit_bias(value)

    def unknown_fields(self) -> set[str]:
        """Unknown top-level names, plus ``messages[i].<name>`` and ``stream_options.<name>``."""
        names = super().unknown_fields()
        for i, message in enumerate(self.messages):
            names.update(f"messages[{i}].{k}" for k in message.unknown_fields())
        if self.stream_options is not None:
            names.update(f"stream_options.{k}" for k in self.stream_options.unknown_fields())
        return names

    def max_new_tokens(self, default: int) -> int:
        """``max_completion_tokens``, else the deprecated ``max_tokens``, else ``default``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        if self.max_tokens is not None:
            return self.max_tokens
        return default

    @property
    def stop_sequences(self) -> list[str]:
        """``stop`` normalised to a list (order kept, duplicates and empty strings dropped)."""
        return _stop_list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer must carry ``usage`` (null per chunk, then a usage chunk)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(OpenAIRequest):
    """Body of the legacy ``POST /v1/completions``."""

    model: str
    prompt: str | list[str] | list[_TokenId] | list[list[_TokenId]]
    best_of: int | None = Field(default=None, ge=1)
    echo: bool = False
    frequency_penalty: _Penalty | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    max_tokens: int | None = Field(default=16, ge=1)
    n: int = Field(default=1, ge=1)
    presence_penalty: _Penalty | None = None
    seed: _Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    response_format: Any = None  # vLLM's extension of completions (structured output)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: str | None = None
    # vLLM's: a text prompt gets the tokenizer's special tokens (BOS…), as vLLM adds them.
    add_special_tokens: bool = True
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    # vLLM's sampling extensions: -1 and 0 turn top_k off, as vLLM reads them.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int | None = Field(default=None, ge=0)
    stop_token_ids: list[_TokenId] | None = None

    @field_validator("n", "stream", "echo", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        return _none_to_default(value, info, {"n": 1, "stream": False, "echo": False})

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty_list(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        if isinstance(value, list) and not value:
            raise ValueError("'prompt' must not be an empty list.")
        return value

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_at_c_speed(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A list of token ids validated as one ``list[int]`` instead of through the union.

        The union tries ``list[str]`` first and builds an error per element before it gets
        to ``list[int]``: 17 ms for a 32k-token prompt, against 0.6 ms this way (2-core
        AMD EPYC). Whatever the fast path does not accept as is goes through the union,
        so results and errors are the union's."""
        if type(value) is list and value and type(value[0]) is int:
            try:
                ids = _TOKEN_ID_LIST.validate_python(value)
            except ValidationError:
                return handler(value)
            if min(ids) >= 0:
                return ids
        return handler(value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_needs_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        return _check_stream_options(value, info)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        return _check_logit_bias(value)

    def unknown_fields(self) -> set[str]:
        """Unknown top-level names, plus ``stream_options.<name>``."""
        names = super().unknown_fields()
        if self.stream_options is not None:
            names.update(f"stream_options.{k}" for k in self.stream_options.unknown_fields())
        return names

    def single_prompt(self) -> str | list[int] | None:
        """The one prompt, as text or as token ids; ``None`` when the request is a batch.

        ``"text"`` and ``["text"]`` give ``"text"``; ``[1, 2]`` and ``[[1, 2]]`` give
        ``[1, 2]``; two or more prompts give ``None`` (the route answers 400).
        """
        p = self.prompt
        if isinstance(p, str):
            return p
        if isinstance(p[0], int):  # validated: a list of ints, or of strs, or of lists
            return list(p)
        if len(p) != 1:
            return None
        only = p[0]
        return only if isinstance(only, str) else list(only)

    def max_new_tokens(self, default: int) -> int:
        """``max_tokens`` (16 unless the client sent another value), or ``default`` if null."""
        return self.max_tokens if self.max_tokens is not None else default

    @property
    def stop_sequences(self) -> list[str]:
        """``stop`` normalised to a list (order kept, duplicates and empty strings dropped)."""
        return _stop_list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed answer must carry ``usage`` (null per chunk, then a usage chunk)."""
        return self.stream and self.stream_options is not None and self.stream_options.include_usage


# --------------------------------------------------------------------------------------
# Responses: exactly OpenAI's fields, in OpenAI's order
# --------------------------------------------------------------------------------------


class _ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_ResponseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(_ResponseModel):
    reasoning_tokens: int = 0
    audio_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class PromptCacheUsage(_ResponseModel):
    """This conductor's extension of ``usage`` for a request that asked for prompt-cache
    retention (``cache_control``, ``prompt_cache_retention``)."""

    # granted | over_budget (the tenant's budget) | node_full | unsupported (the engine
    # evicts on its own: vLLM) | too_long (a TTL past the node's longest) | below_minimum
    # (shorter than the deployment retains)
    retention: str
    cache_write_tokens: int  # prompt tokens written to the cache at granted breakpoints
    cache_read_tokens: int  # prompt tokens read from the cache (= cached_tokens)


class Usage(_ResponseModel):
    """Token counts.  An absent ``*_tokens_details`` is left out of the JSON, not null."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = _ABSENT
    completion_tokens_details: CompletionTokensDetails | None = _ABSENT
    prompt_cache: PromptCacheUsage | None = _ABSENT

    @classmethod
    def from_counts(
        cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
    ) -> Usage:
        """Usage with ``total_tokens`` summed; ``cached_tokens`` fills ``prompt_tokens_details``."""
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=(
                None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
            ),
        )


class FunctionCall(_ResponseModel):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's form)


class ToolCall(_ResponseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatCompletionMessage(_ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = _ABSENT  # present only when the model called tools


class FunctionCallDelta(_ResponseModel):
    name: str | None = _ABSENT
    arguments: str | None = _ABSENT


class ToolCallDelta(_ResponseModel):
    """One streamed tool call: ``index`` names it across chunks; the first chunk of a
    call carries ``id``, ``type`` and the function's name."""

    index: int
    id: str | None = _ABSENT
    type: Literal["function"] | None = _ABSENT
    function: FunctionCallDelta | None = _ABSENT


class TopLogprob(_ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatCompletionTokenLogprob(_ResponseModel):
    """One generated token: its text, log-probability, UTF-8 bytes (a piece of a
    multi-byte character has only its own) and the most likely alternatives asked for."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_ResponseModel):
    content: list[ChatCompletionTokenLogprob] | None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class CompletionLogprobs(_ResponseModel):
    """The legacy completions' shape: parallel lists, one entry per generated token."""

    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class ChatCompletionChoice(_ResponseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(_ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChoiceDelta(_ResponseModel):
    """A streamed delta.  Unset keys are left out of the JSON, so ``ChoiceDelta()`` is ``{}``."""

    role: Literal["assistant"] | None = _ABSENT
    content: str | None = _ABSENT
    refusal: str | None = _ABSENT
    tool_calls: list[ToolCallDelta] | None = _ABSENT


class ChunkChoice(_ResponseModel):
    index: int
    delta: ChoiceDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(_ResponseModel):
    """One ``chat.completion.chunk``; serialise it with :func:`chunk_json`.

    With ``stream_options.include_usage`` OpenAI sends ``"usage": null`` on every
    chunk and ends with a chunk whose ``choices`` is ``[]`` and whose ``usage`` is
    set; without it no chunk has a ``usage`` key.
    """

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None


class CompletionChoice(_ResponseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: CompletionFinishReason


class CompletionResponse(_ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(_ResponseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: CompletionFinishReason | None = None


class CompletionChunk(_ResponseModel):
    """One streamed legacy completion (``object`` is ``"text_completion"`` here too).

    ``usage`` follows the same include_usage rule as :class:`ChatCompletionChunk`.
    """

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class ModelCard(_ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(_ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# vLLM-compatible extras (its OpenAI server's /tokenize, /detokenize, /version).


class TokenizeRequest(OpenAIRequest):
    """Exactly one of ``prompt`` and ``messages`` (checked by the route)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # prompt only; default true, as vLLM
    add_generation_prompt: bool = True  # messages only
    tools: list[dict[str, Any]] | None = None  # messages only: rendered by the template
    return_token_strs: bool = False


class TokenizeResponse(_ResponseModel):
    count: int
    max_model_len: int | None  # null while no agent reports the model's context
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[_TokenId]


class DetokenizeResponse(_ResponseModel):
    prompt: str


class VersionResponse(_ResponseModel):
    version: str


class ErrorDetail(_ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_ResponseModel):
    """``{"error": {"message", "type", "param", "code"}}``; param and code are null when unset."""

    error: ErrorDetail


class AgentReadiness(_ResponseModel):
    address: str
    node_id: str | None
    role: str | None
    usable: bool
    inflight: int
    error: str | None


class ReadyResponse(_ResponseModel):
    status: Literal["ready"] = "ready"
    agents: list[AgentReadiness]  # empty unless the caller may see them (an admin key)


class NotReadyResponse(ErrorResponse):
    """The 503 of ``/ready``: the error envelope plus the agents as the conductor sees them."""

    agents: list[AgentReadiness]


class HealthResponse(_ResponseModel):
    status: Literal["ok"] = "ok"


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------

SSE_DONE = "data: [DONE]\n\n"
"""The event that ends an OpenAI stream."""


def chunk_json(chunk: ChatCompletionChunk | CompletionChunk, include_usage: bool) -> str:
    """The exact wire JSON of a streamed chunk.

    ``include_usage`` is the request's ``stream_options.include_usage``: when true the
    ``usage`` key is always present (null on ordinary chunks); when false it is
    absent, and a ``usage`` set on the chunk is dropped rather than leaked.
    """
    if include_usage:
        return chunk.model_dump_json()
    return chunk.model_dump_json(exclude={"usage"})


class ContentChunks:
    """The server-sent events of plain content deltas (one choice, text only: nearly
    every chunk of an answer), exactly as ``chunk_json`` writes them, without building
    and serialising a model per token: the JSON is rendered once per choice index with a
    marker where the text goes, and each delta's text is JSON-encoded into it.

    ``api``: ``"chat"`` (``ChatCompletionChunk``, the text in ``delta.content``) or
    ``"completions"`` (``CompletionChunk``, the text in ``text``, no logprobs or finish
    reason: the streamed legacy completions of ``kvc bench live`` and vLLM's clients)."""

    _MARKER = "kvc-content-7c1f0e"

    def __init__(
        self,
        completion_id: str,
        created: int,
        model: str,
        include_usage: bool,
        api: Literal["chat", "completions"] = "chat",
    ) -> None:
        self._fields = (completion_id, created, model, include_usage)
        self._api = api
        self._parts: dict[int, tuple[str, str] | None] = {}  # by choice index

    def _template(self, index: int) -> tuple[str, str] | None:
        completion_id, created, model, include_usage = self._fields
        chunk: ChatCompletionChunk | CompletionChunk
        if self._api == "chat":
            choice = ChunkChoice(index=index, delta=ChoiceDelta(content=self._MARKER))
            chunk = ChatCompletionChunk(
                id=completion_id, created=created, model=model, choices=[choice]
            )
        else:
            chunk = CompletionChunk(
                id=completion_id, created=created, model=model,
                choices=[CompletionChunkChoice(text=self._MARKER, index=index)],
            )  # fmt: skip
        rendered = chunk_json(chunk, include_usage)
        marker = json.dumps(self._MARKER)
        if rendered.count(marker) != 1:  # the id or model name carries it: no template
            return None
        head, tail = rendered.split(marker)
        return f"data: {head}", f"{tail}\n\n"

    def event(self, index: int, text: str) -> str | None:
        """The event of choice ``index`` saying ``text``; None where only the model
        can write it."""
        if index not in self._parts:
            self._parts[index] = self._template(index)
        parts = self._parts[index]
        if parts is None:
            return None
        head, tail = parts
        return f"{head}{json.dumps(text, ensure_ascii=False)}{tail}"


def sse_data(payload: str) -> str:
    """One server-sent event carrying ``payload`` (a JSON document on one line)."""
    return f"data: {payload}\n\n"


def new_chat_completion_id() -> str:
    """A fresh ``chatcmpl-`` id (32 random hex digits)."""
    return f"chatcmpl-{secrets.token_hex(16)}"


def new_completion_id() -> str:
    """A fresh ``cmpl-`` id (32 random hex digits), for the legacy completions API."""
    return f"cmpl-{secrets.token_hex(16)}"
