"""Who may call what on a node agent: the role in the caller's client certificate.

With mTLS on (``kvc.tls``), every call carries a verified certificate of the cluster's
CA, and its name says the caller's role. Only conductors may change or read the block
table, run prefills and generations, or drain the node; a peer agent may only pull KV
(``FetchKv``, ``ReadBlocks``), and then only what a conductor handed it: a staged
prefill's single-use handle with its tenant, or an open transaction's id (122 random
bits) with its tenant and keys. ``GetInfo`` is open to both. Without TLS (plaintext,
allowed on loopback only unless a mesh encrypts: ``grpc_plaintext``) there is no
identity to check, and every caller is trusted as on a single machine.

=====================  ==========================================
RPC                    callers
=====================  ==========================================
TxAllocate/Commit/     conductor
Abort, Snapshot,
WatchEvents, Prefill,
Generate, PullBlocks,
Drain
FetchKv, ReadBlocks    conductor, agent
GetInfo                conductor, agent
=====================  ==========================================
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

from kvc.tls import Role, peer_role
from node_agent.errors import NotPermitted

__all__ = ["authorized"]

F = TypeVar("F", bound=Callable[..., Any])


class _Authorizing:
    """What ``authorized`` needs of the service: whether callers carry certificates."""

    tls: bool


def _check(service: _Authorizing, context: Any, roles: frozenset[Role], rpc: str) -> None:
    if not service.tls:
        return
    role = peer_role(context)
    if role not in roles:
        raise NotPermitted(
            f"{rpc} is for {' and '.join(sorted(roles))}s; the caller's certificate "
            f"names {role or 'no kvc role'}"
        )


def authorized(*roles: Role) -> Callable[[F], F]:
    """Let only callers whose certificate names one of ``roles`` run the RPC method
    (``NotPermitted`` otherwise; ``maps_errors`` outside turns it into
    PERMISSION_DENIED)."""
    allowed = frozenset(roles)

    def wrap(method: F) -> F:
        name = method.__name__
        if inspect.isasyncgenfunction(method):

            @functools.wraps(method)
            async def stream(self: _Authorizing, request: Any, context: Any) -> AsyncIterator[Any]:
                _check(self, context, allowed, name)
                async for msg in method(self, request, context):
                    yield msg

            return cast(F, stream)

        @functools.wraps(method)
        async def unary(self: _Authorizing, request: Any, context: Any) -> Any:
            _check(self, context, allowed, name)
            return await method(self, request, context)

        return cast(F, unary)

    return wrap
