"""vLLM-compatible extras that users script against: ``POST /tokenize``,
``POST /detokenize`` and ``GET /version``, with vLLM's request and response shapes.

Tokenization uses the conductor's own tokenizer and chat template, the ones every
completion is scheduled with, so ``/tokenize`` counts exactly the prompt tokens a
request is charged for. Behind the same API keys as ``/v1/*``.
"""

from __future__ import annotations

from fastapi import APIRouter

from conductor.api.deps import StateDep, TenantDep
from conductor.api.openai import check_model, off_loop_if_long, text_size
from conductor.api.openapi_doc import errors
from conductor.api.schemas import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from conductor.errors import InvalidRequest
from kvc.fast_json import FastJsonRoute
from kvc.tokenization import ChatTemplateError
from kvc.version import package_version

router = APIRouter(route_class=FastJsonRoute)


@router.post("/tokenize", responses=errors(400, 401, 404, 413))
async def tokenize(body: TokenizeRequest, state: StateDep, tenant: TenantDep) -> TokenizeResponse:
    if body.model is not None:
        check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("Give either 'prompt' or 'messages'.", param="prompt")
    messages = None
    if body.messages is not None:
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        size = text_size(messages, body.tools)
    else:
        size = len(body.prompt or "")
    tok = state.tokenizer

    def work() -> list[int]:
        return tok.api_token_ids(
            prompt=body.prompt,
            messages=messages,
            add_special_tokens=body.add_special_tokens,
            add_generation_prompt=body.add_generation_prompt,
            tools=body.tools,
            cache_scope=tenant.name,
        )

    try:
        ids = await off_loop_if_long(size, work)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc), param="messages") from exc
    return TokenizeResponse(
        count=len(ids),
        max_model_len=state.max_model_len(),
        tokens=ids,
        token_strs=tok.token_strs(ids) if body.return_token_strs else None,
    )


@router.post("/detokenize", responses=errors(400, 401, 404, 413))
async def detokenize(
    body: DetokenizeRequest, state: StateDep, tenant: TenantDep
) -> DetokenizeResponse:
    if body.model is not None:
        check_model(state, body.model)
    vocab = state.tokenizer.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise InvalidRequest(
            f"Token ids must be below the vocabulary size {vocab}.", param="tokens"
        )
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=package_version())
