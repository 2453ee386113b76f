"""The conductor's one exception hierarchy, rendered as OpenAI error envelopes.

Every failure the conductor reports to a client is a :class:`ConductorError`.
The HTTP layer turns one into ``status_code``, ``headers`` and the body
``to_response_body()`` -- ``{"error": {"message", "type", "param", "code"}}``,
the envelope api.openai.com sends (``param`` and ``code`` are null when unset)::

    ConductorError                500  server_error
    ├── InvalidRequest            400  invalid_request_error
    │   └── ContextLengthExceeded 400  invalid_request_error  code=context_length_exceeded
    │                                                         param=messages
    ├── AuthenticationFailed      401  invalid_request_error  code=invalid_api_key
    ├── NotFound                  404  invalid_request_error
    │   └── ModelNotFound         404  invalid_request_error  code=model_not_found  param=model
    ├── RequestTimeout            408  invalid_request_error  code=request_timeout
    ├── PayloadTooLarge           413  invalid_request_error  code=request_too_large
    ├── UnprocessableEntity       422  invalid_request_error
    ├── RateLimited               429  requests (or tokens)   code=rate_limit_exceeded
    │                                  + Retry-After, retry-after-ms
    ├── UpstreamError             502  server_error           code=upstream_error
    ├── ServiceUnavailable        503  server_error           code=service_unavailable
    │                                  + Retry-After, retry-after-ms when retry_after_s given
    └── GatewayTimeout            504  server_error           code=timeout

How the ``type``/``code`` pairs were chosen.  The OpenAI error-codes guide lists
statuses and causes; the ``type`` and ``code`` strings below are the ones
api.openai.com puts in its bodies:

* 400 -- ``invalid_request_error`` for any malformed or out-of-range request;
  a too-long prompt is ``invalid_request_error`` with ``code
  "context_length_exceeded"`` and ``param "messages"``.
* 401 -- OpenAI does not use an ``authentication_error`` type: a wrong key is
  ``type "invalid_request_error"``, ``code "invalid_api_key"``.
* 404 -- an unknown model is ``invalid_request_error`` / ``model_not_found``
  (OpenAI itself leaves ``param`` null there; we name ``"model"``, which is what
  the client got wrong); an unknown URL is ``invalid_request_error`` with code null.
* 413, 422 -- no documented OpenAI body; they are request errors, so
  ``invalid_request_error`` (413 carries our own code ``request_too_large``).
* 429 -- OpenAI's rate-limit bodies use the limit's kind as the type
  (``"requests"`` or ``"tokens"``) with ``code "rate_limit_exceeded"``; we do
  the same, and keep the conductor's own cause (``queue_full``, ``tenant_rpm``...)
  in :attr:`RateLimited.reason` for logs and metrics.  ``Retry-After`` is whole
  seconds (ceil, at least 1); ``retry-after-ms`` gives the precise value, which the
  official OpenAI SDKs read before ``Retry-After``.
* 500, 502, 503, 504 -- OpenAI reports its own failures and overloads as
  ``server_error``; the codes ``upstream_error``, ``service_unavailable`` and
  ``timeout`` are ours, so a client can tell the cases apart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Final, Literal

from conductor.api.schemas import ErrorDetail, ErrorResponse

__all__ = [
    "AuthenticationFailed",
    "ConductorError",
    "ContextLengthExceeded",
    "GatewayTimeout",
    "InvalidRequest",
    "ModelNotFound",
    "NotFound",
    "PayloadTooLarge",
    "RateLimited",
    "RequestTimeout",
    "ServiceUnavailable",
    "UnprocessableEntity",
    "UpstreamError",
    "retry_after_headers",
]


class _Unset:
    """Marks an argument left out, so an explicit ``None`` can clear a class default."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Final = _Unset()

MAX_RETRY_AFTER_S: Final = 86_400
"""Retry hints are capped at one day (an infinite hint would not fit a header)."""


def retry_after_headers(retry_after_s: float) -> dict[str, str]:
    """``Retry-After`` (whole seconds, rounded up, at least 1) and ``retry-after-ms``.

    A NaN or negative hint counts as 0 (so ``Retry-After: 1``); one above a day,
    infinity included, is capped at a day.
    """
    seconds = retry_after_s if retry_after_s > 0 else 0.0  # NaN > 0 is False
    seconds = min(seconds, float(MAX_RETRY_AFTER_S))
    return {
        "Retry-After": str(max(1, math.ceil(seconds))),
        "retry-after-ms": str(math.ceil(seconds * 1000)),
    }


class ConductorError(Exception):
    """Base of every error the conductor reports; raised as is it is a 500."""

    status_code: ClassVar[int] = 500
    error_type: str = "server_error"
    default_message: ClassVar[str] = "The server had an error while processing your request."
    default_param: ClassVar[str | None] = None
    default_code: ClassVar[str | None] = None

    message: str
    param: str | None
    code: str | None
    headers: dict[str, str]

    def __init__(
        self,
        message: str | None = None,
        *,
        param: str | _Unset | None = _UNSET,
        code: str | _Unset | None = _UNSET,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.message = message if message is not None else self.default_message
        self.param = self.default_param if isinstance(param, _Unset) else param
        self.code = self.default_code if isinstance(code, _Unset) else code
        self.headers = dict(headers) if headers is not None else {}
        super().__init__(self.message)

    def to_error_detail(self) -> ErrorDetail:
        return ErrorDetail(
            message=self.message, type=self.error_type, param=self.param, code=self.code
        )

    def to_response_body(self) -> dict[str, Any]:
        """The OpenAI envelope: ``{"error": {"message", "type", "param", "code"}}``."""
        return ErrorResponse(error=self.to_error_detail()).model_dump(mode="json")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status={self.status_code}, type={self.error_type!r}, "
            f"code={self.code!r}, param={self.param!r}, message={self.message!r})"
        )


class InvalidRequest(ConductorError):
    status_code = 400
    error_type = "invalid_request_error"
    default_message = "Invalid request."

    @classmethod
    def from_validation_errors(cls, errors: Iterable[Mapping[str, Any]]) -> InvalidRequest:
        """One 400 from pydantic's ``errors()`` (or FastAPI's ``RequestValidationError``).

        OpenAI reports a single problem, so the first one is used; where a union made
        pydantic report one error per member (``stop`` as ``str`` and as ``list``), a
        violated constraint is preferred over a type mismatch.  ``param`` is the path
        into the body (``"messages[0].role"``); codes follow OpenAI's
        ``missing_required_parameter`` / ``invalid_type`` / ``invalid_value``.
        """
        errs = list(errors)
        if not errs:
            return cls()
        first = errs[0]
        param = _param_from_loc(first.get("loc", ()))
        if first.get("type") == "json_invalid":
            return cls(
                "We could not parse the JSON body of your request. The API expects a JSON payload.",
                param=None,
            )
        same = [e for e in errs if _param_from_loc(e.get("loc", ())) == param]
        chosen = next((e for e in same if not _is_type_error(e)), first)
        err_type = str(chosen.get("type", ""))
        msg = str(chosen.get("msg", "invalid value")).removeprefix("Value error, ")
        if param is None:
            return cls(f"Invalid request body: {msg}", param=None, code="invalid_type")
        if err_type == "missing":
            return cls(
                f"Missing required parameter: '{param}'.",
                param=param,
                code="missing_required_parameter",
            )
        code = "invalid_type" if _is_type_error(chosen) else "invalid_value"
        return cls(f"Invalid '{param}': {msg}", param=param, code=code)


class ContextLengthExceeded(InvalidRequest):
    default_message = "The prompt is longer than the model's context length."
    default_param = "messages"
    default_code = "context_length_exceeded"

    def __init__(
        self,
        message: str | None = None,
        *,
        max_context_tokens: int | None = None,
        prompt_tokens: int | None = None,
        max_new_tokens: int | None = None,
        param: str | _Unset | None = _UNSET,
        code: str | _Unset | None = _UNSET,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """Given the token counts, the message reads like OpenAI's."""
        if message is None and max_context_tokens is not None and prompt_tokens is not None:
            message = f"This model's maximum context length is {max_context_tokens} tokens. "
            if max_new_tokens is not None:
                total = prompt_tokens + max_new_tokens
                message += (
                    f"However, you requested {total} tokens ({prompt_tokens} in the messages, "
                    f"{max_new_tokens} in the completion). Please reduce the length of the "
                    "messages or completion."
                )
            else:
                message += (
                    f"However, your messages resulted in {prompt_tokens} tokens. "
                    "Please reduce the length of the messages."
                )
        super().__init__(message, param=param, code=code, headers=headers)
        self.max_context_tokens = max_context_tokens
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens


class AuthenticationFailed(ConductorError):
    status_code = 401
    error_type = "invalid_request_error"
    default_message = "Incorrect API key provided."
    default_code = "invalid_api_key"


class NotFound(ConductorError):
    status_code = 404
    error_type = "invalid_request_error"
    default_message = "Not found."


class ModelNotFound(NotFound):
    default_param = "model"
    default_code = "model_not_found"

    def __init__(
        self,
        model: str,
        message: str | None = None,
        *,
        param: str | _Unset | None = _UNSET,
        code: str | _Unset | None = _UNSET,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        if message is None:
            message = f"The model `{model}` does not exist or you do not have access to it."
        super().__init__(message, param=param, code=code, headers=headers)
        self.model = model


class RequestTimeout(ConductorError):
    status_code = 408
    error_type = "invalid_request_error"
    default_message = "The request body did not arrive in time."
    default_code = "request_timeout"


class PayloadTooLarge(ConductorError):
    status_code = 413
    error_type = "invalid_request_error"
    default_message = "The request body is too large."
    default_code = "request_too_large"


class UnprocessableEntity(ConductorError):
    status_code = 422
    error_type = "invalid_request_error"
    default_message = "The request could not be processed."


REJECT_REASON_HEADER = "X-Kvc-Reject-Reason"


class RateLimited(ConductorError):
    """429.  ``reason`` is the conductor's own machine-readable cause: it is sent in the
    ``X-Kvc-Reject-Reason`` header and used as the metrics label."""

    status_code = 429
    error_type = "requests"
    default_message = "Rate limit reached. Please try again later."
    default_code = "rate_limit_exceeded"

    def __init__(
        self,
        message: str | None = None,
        *,
        retry_after_s: float | None = None,
        reason: str = "rate_limit_exceeded",
        limit_type: Literal["requests", "tokens"] = "requests",
        param: str | _Unset | None = _UNSET,
        code: str | _Unset | None = _UNSET,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        merged = retry_after_headers(retry_after_s) if retry_after_s is not None else {}
        merged[REJECT_REASON_HEADER] = reason
        merged.update(headers or {})
        super().__init__(message, param=param, code=code, headers=merged)
        self.error_type = limit_type
        self.retry_after_s = retry_after_s
        self.reason = reason


class UpstreamError(ConductorError):
    """502: a node agent failed (or vanished) while serving the request."""

    status_code = 502
    default_message = "The upstream inference worker failed while processing your request."
    default_code = "upstream_error"


class ServiceUnavailable(ConductorError):
    status_code = 503
    default_message = "The server is overloaded or not ready yet."
    default_code = "service_unavailable"

    def __init__(
        self,
        message: str | None = None,
        *,
        retry_after_s: float | None = None,
        param: str | _Unset | None = _UNSET,
        code: str | _Unset | None = _UNSET,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        merged = retry_after_headers(retry_after_s) if retry_after_s is not None else {}
        merged.update(headers or {})
        super().__init__(message, param=param, code=code, headers=merged)
        self.retry_after_s = retry_after_s


class GatewayTimeout(ConductorError):
    status_code = 504
    default_message = "The request timed out."
    default_code = "timeout"


# --------------------------------------------------------------------------------------

_FIELD_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "bytes"})


def _param_from_loc(loc: Iterable[Any]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``"messages[0].role"``.

    The leading ``body`` is FastAPI's; union-member tags pydantic inserts
    (``"str"``, ``"list[str]"``, ``"ContentPart"``) are dropped.
    """
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    path = ""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and _FIELD_NAME.match(part) and part not in _UNION_TAGS:
            path += f".{part}" if path else part
    return path or None


def _is_type_error(err: Mapping[str, Any]) -> bool:
    t = str(err.get("type", ""))
    return t.endswith(("_type", "_parsing"))
