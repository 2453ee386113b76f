"""The conductor's error hierarchy and its OpenAI envelopes."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from pydantic import ValidationError

from conductor.api.schemas import ChatCompletionRequest, ErrorResponse
from conductor.errors import (
    AuthenticationFailed,
    ConductorError,
    ContextLengthExceeded,
    GatewayTimeout,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    PayloadTooLarge,
    RateLimited,
    ServiceUnavailable,
    UnprocessableEntity,
    UpstreamError,
    retry_after_headers,
)


@pytest.mark.parametrize(
    ("error", "status", "etype", "code", "param"),
    [
        (ConductorError(), 500, "server_error", None, None),
        (InvalidRequest("bad"), 400, "invalid_request_error", None, None),
        (
            ContextLengthExceeded(),
            400,
            "invalid_request_error",
            "context_length_exceeded",
            "messages",
        ),
        (AuthenticationFailed(), 401, "invalid_request_error", "invalid_api_key", None),
        (NotFound("Invalid URL (GET /v1/nope)"), 404, "invalid_request_error", None, None),
        (ModelNotFound("gpt-x"), 404, "invalid_request_error", "model_not_found", "model"),
        (PayloadTooLarge(), 413, "invalid_request_error", "request_too_large", None),
        (UnprocessableEntity(), 422, "invalid_request_error", None, None),
        (RateLimited(), 429, "requests", "rate_limit_exceeded", None),
        (UpstreamError(), 502, "server_error", "upstream_error", None),
        (ServiceUnavailable(), 503, "server_error", "service_unavailable", None),
        (GatewayTimeout(), 504, "server_error", "timeout", None),
    ],
)
def test_mapping(
    error: ConductorError, status: int, etype: str, code: str | None, param: str | None
) -> None:
    assert isinstance(error, ConductorError)
    assert error.status_code == status
    body = error.to_response_body()
    assert list(body) == ["error"]
    assert list(body["error"]) == ["message", "type", "param", "code"]
    assert body["error"]["type"] == etype
    assert body["error"]["code"] == code
    assert body["error"]["param"] == param
    assert body["error"]["message"] == error.message
    assert str(error) == error.message
    # round-trips through the schema and is plain JSON
    assert ErrorResponse.model_validate(json.loads(json.dumps(body))).error.type == etype


def test_envelope_exact() -> None:
    err = InvalidRequest("n must be 1", param="n", code="unsupported_value")
    assert err.to_response_body() == {
        "error": {
            "message": "n must be 1",
            "type": "invalid_request_error",
            "param": "n",
            "code": "unsupported_value",
        }
    }


def test_hierarchy() -> None:
    assert issubclass(ContextLengthExceeded, InvalidRequest)
    assert issubclass(ModelNotFound, NotFound)
    with pytest.raises(ConductorError):
        raise RateLimited(retry_after_s=1)


def test_explicit_none_clears_class_defaults() -> None:
    err = ModelNotFound("m", param=None, code=None)
    assert err.param is None
    assert err.code is None
    assert err.model == "m"
    assert "`m`" in err.message


def test_model_not_found_message_like_openai() -> None:
    assert ModelNotFound("gpt-9").message == (
        "The model `gpt-9` does not exist or you do not have access to it."
    )


def test_context_length_message() -> None:
    err = ContextLengthExceeded(max_context_tokens=4096, prompt_tokens=5000)
    assert err.message.startswith("This model's maximum context length is 4096 tokens.")
    assert "5000" in err.message
    with_completion = ContextLengthExceeded(
        max_context_tokens=4096, prompt_tokens=4000, max_new_tokens=200, param="prompt"
    )
    assert "4200" in with_completion.message
    assert with_completion.param == "prompt"
    assert with_completion.code == "context_length_exceeded"


@pytest.mark.parametrize(
    ("seconds", "header", "ms"),
    [
        (0.0, "1", "0"),
        (0.2, "1", "200"),
        (1.0, "1", "1000"),
        (1.0001, "2", "1001"),
        (2.5, "3", "2500"),
        (59.9, "60", "59900"),
        (-3.0, "1", "0"),
        (math.nan, "1", "0"),
        (math.inf, "86400", "86400000"),
    ],
)
def test_retry_after_rounding(seconds: float, header: str, ms: str) -> None:
    assert retry_after_headers(seconds) == {"Retry-After": header, "retry-after-ms": ms}
    err = RateLimited(retry_after_s=seconds)
    assert err.headers["Retry-After"] == header
    assert err.retry_after_s == seconds or math.isnan(seconds)


def test_rate_limited_fields() -> None:
    err = RateLimited("slow down", retry_after_s=0.4, reason="queue_full", limit_type="tokens")
    assert err.reason == "queue_full"
    assert err.headers == {
        "Retry-After": "1",
        "retry-after-ms": "400",
        "X-Kvc-Reject-Reason": "queue_full",
    }
    assert err.to_response_body()["error"] == {
        "message": "slow down",
        "type": "tokens",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    # instance type does not leak into the class
    assert RateLimited.error_type == "requests"
    assert RateLimited().headers == {"X-Kvc-Reject-Reason": "rate_limit_exceeded"}


def test_service_unavailable_retry_after_optional() -> None:
    assert ServiceUnavailable().headers == {}
    assert ServiceUnavailable(retry_after_s=4.2).headers["Retry-After"] == "5"
    extra = ServiceUnavailable(retry_after_s=1, headers={"X-Reason": "draining"})
    assert extra.headers == {"Retry-After": "1", "retry-after-ms": "1000", "X-Reason": "draining"}


def test_headers_are_copied() -> None:
    given = {"A": "1"}
    err = InvalidRequest(headers=given)
    given["B"] = "2"
    assert err.headers == {"A": "1"}


def validation_errors(body: dict[str, Any]) -> list[Any]:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    return list(info.value.errors())


MSG = [{"role": "user", "content": "hi"}]


def test_from_validation_errors_missing() -> None:
    err = InvalidRequest.from_validation_errors(validation_errors({"model": "m"}))
    assert err.param == "messages"
    assert err.code == "missing_required_parameter"
    assert err.message == "Missing required parameter: 'messages'."


def test_from_validation_errors_range_and_nested() -> None:
    err = InvalidRequest.from_validation_errors(
        validation_errors({"model": "m", "messages": MSG, "temperature": 3})
    )
    assert err.param == "temperature"
    assert err.code == "invalid_value"
    err = InvalidRequest.from_validation_errors(
        validation_errors({"model": "m", "messages": [{"role": "bot", "content": "x"}]})
    )
    assert err.param == "messages[0].role"
    assert err.code == "invalid_value"


def test_from_validation_errors_union_prefers_constraint() -> None:
    err = InvalidRequest.from_validation_errors(
        validation_errors({"model": "m", "messages": MSG, "stop": ["a", "b", "c", "d", "e"]})
    )
    assert err.param == "stop"
    assert err.code == "invalid_value"
    assert "at most 4" in err.message


def test_from_validation_errors_model_validator_message() -> None:
    err = InvalidRequest.from_validation_errors(
        validation_errors(
            {"model": "m", "messages": MSG, "stream_options": {"include_usage": True}}
        )
    )
    assert err.param == "stream_options"
    assert "Value error" not in err.message
    assert "only allowed when 'stream' is enabled" in err.message


def test_from_validation_errors_fastapi_shapes() -> None:
    err = InvalidRequest.from_validation_errors(
        [{"type": "float_parsing", "loc": ("body", "top_p"), "msg": "Input should be a number"}]
    )
    assert err.param == "top_p"
    assert err.code == "invalid_type"
    bad_json = InvalidRequest.from_validation_errors(
        [{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error"}]
    )
    assert bad_json.param is None
    assert "parse the JSON body" in bad_json.message
    not_object = InvalidRequest.from_validation_errors(
        [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be an object"}]
    )
    assert not_object.param is None
    assert InvalidRequest.from_validation_errors([]).status_code == 400
