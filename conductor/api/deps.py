"""FastAPI dependencies of the API routes: the app state, the caller's tenant and the
request id; and the route class that resolves them itself on the generation endpoints."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Annotated, Any, Final

from fastapi import Depends, Request, Response
from fastapi.dependencies.models import Dependant
from pydantic import BaseModel, ValidationError

from conductor.errors import AuthenticationFailed
from conductor.state import AppState
from conductor.tenants import Tenant
from kvc.fast_json import DirectHandler, FastJsonRoute


def _telemetry_getter() -> Callable[[], object]:
    """FastAPI's ``get_telemetry_data`` (None unless its telemetry is on for the request)."""
    try:
        module = importlib.import_module("fastapi.telemetry")
    except ImportError:  # a FastAPI before its telemetry: nothing to keep
        return lambda: None
    getter: Callable[[], object] = module.get_telemetry_data
    return getter


_telemetry_data: Final = _telemetry_getter()


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


class GenerationRoute(FastJsonRoute):
    """The route class of the generation endpoints (``(body, request, state, tenant)``).

    A request whose JSON body orjson decoded into an object that validates as the
    endpoint's body model is served by resolving the two dependencies here and calling
    the endpoint, without FastAPI's per-request dependency solving and its handler
    around the endpoint: ~0.13 ms less CPU per request on the 2-core reference machine
    (the median of seven interleaved pairs of whole ASGI calls; docs/benchmarks.md,
    "The fleet view per request, and FastAPI's dependency solving"). The same functions
    run in the order FastAPI runs them (the state, then authentication, whose
    ``AuthenticationFailed`` propagates as from FastAPI), with the body validated as
    FastAPI validates it (``model_validate`` of the decoded object). Anything else — a
    body that is not a JSON object or does not validate, a media type FastAPI does not
    read as JSON, FastAPI's telemetry active for the request — goes to FastAPI's handler
    unchanged, which reports errors exactly as before. A route of any other shape (other
    parameters or dependencies) is FastAPI's alone: nothing is skipped there.
    """

    def direct_handler(self) -> DirectHandler | None:
        return _direct_handler(self.dependant, self.endpoint)


def _direct_handler(dependant: Dependant, endpoint: Callable[..., Any]) -> DirectHandler | None:
    """A handler calling ``endpoint`` with its body, request, state and tenant, or None
    when the route takes anything else."""
    d = dependant
    if (
        d.path_params
        or d.query_params
        or d.header_params
        or d.cookie_params
        or d.websocket_param_name
        or d.http_connection_param_name
        or d.response_param_name
        or d.background_tasks_param_name
        or d.security_scopes_param_name
        or d.request_param_name is None
        or len(d.body_params) != 1
        or len(d.dependencies) != 2
        or not inspect.iscoroutinefunction(endpoint)
    ):
        return None
    names = {sub.call: sub.name for sub in d.dependencies}
    state_name, tenant_name = names.get(get_state), names.get(authenticate)
    if state_name is None or tenant_name is None:
        return None
    field = d.body_params[0]
    model = field.field_info.annotation
    if (
        not isinstance(model, type)
        or not issubclass(model, BaseModel)
        or getattr(field.field_info, "embed", False)
    ):
        return None
    body_name, request_name = field.name, d.request_param_name

    async def direct(request: Request, parsed: Any) -> Response | None:
        if not isinstance(parsed, dict) or _telemetry_data() is not None:
            return None
        try:
            body = model.model_validate(parsed)
        except ValidationError:
            return None  # FastAPI validates it again and reports its errors
        state = await get_state(request)
        tenant = await authenticate(request, state)
        response = await endpoint(
            **{body_name: body, request_name: request, state_name: state, tenant_name: tenant}
        )
        if not isinstance(response, Response):
            raise TypeError(
                f"{endpoint.__name__} returned {type(response).__name__}, not a Response"
            )
        return response

    return direct


def request_id(request: Request) -> str:
    """The id the request-id middleware gave this request (``X-Request-Id``)."""
    rid: str = request.state.request_id
    return rid
