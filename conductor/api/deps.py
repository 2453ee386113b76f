"""FastAPI dependencies of the API routes: the app state, the caller's tenant and the
request id."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from conductor.errors import AuthenticationFailed
from conductor.state import AppState
from conductor.tenants import Tenant


async def get_state(request: Request) -> AppState:
    """The app state. ``async`` on purpose: FastAPI runs a plain ``def`` dependency in a
    worker thread, a thread hop per request for a dict lookup."""
    state: AppState = request.app.state.conductor
    return state


StateDep = Annotated[AppState, Depends(get_state)]


async def authenticate(request: Request, state: StateDep) -> Tenant:
    """Return the caller's tenant; 401 when keys are configured and none matches."""
    if not state.tenants.auth_required:
        return state.tenants.default
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        token = request.headers.get("x-api-key", "")  # Anthropic's SDKs send it so
    if not token.strip():
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY' "
            "(or 'x-api-key: YOUR_KEY')."
        )
    tenant = await state.tenants.resolve(token.strip())
    if tenant is None:
        raise AuthenticationFailed("Incorrect API key provided.")
    return tenant


TenantDep = Annotated[Tenant, Depends(authenticate)]


def request_id(request: Request) -> str:
    """The id the request-id middleware gave this request (``X-Request-Id``)."""
    rid: str = request.state.request_id
    return rid
