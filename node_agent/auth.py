"""Who may call what on a node agent: the role in the caller's client certificate.

With mTLS on (``kvc.tls``), every call carries a verified certificate of the cluster's
CA, and its name says the caller's role. Only conductors may change or read the block
table, run prefills and generations, or drain the node; a peer agent may only pull KV
(``FetchKv``, ``ReadBlocks``; ``LendBlocks`` where the engines move it themselves), and
then only what a conductor handed it: a staged prefill's single-use handle with its
tenant, or an open transaction's read token with its tenant and keys. ``GetInfo`` is open to both.

A conductor also names the one node each grant is for (``grantee``: the decode node that
fetches a prefill, the destination that reads a locked prefix). An agent whose
certificate names its node (``urn:kvc:node:<id>``, ``kvc certs --node``) may use only
grants for that node; with ``require_node_certificates`` every pulling agent must be
named so and every grant bound (``check_grantee``). Without TLS (plaintext,
allowed on loopback only unless a mesh encrypts: ``grpc_plaintext``) there is no
identity to check, and every caller is trusted as on a single machine.

=====================  ==========================================
RPC                    callers
=====================  ==========================================
TxAllocate/Commit/     conductor
Abort/Extend,
Snapshot, WatchEvents,
Prefill,
Generate, PullBlocks,
Drain, ReplicaHints
FetchKv, ReadBlocks,   conductor, agent
LendBlocks
GetInfo                conductor, agent
=====================  ==========================================
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from kvc.tls import Role, peer_node, peer_role
from node_agent.errors import NotPermitted

__all__ = ["Caller", "authorized", "check_grantee"]

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


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, as far as the transport tells: with mTLS, the role and the node
    the verified certificate names; plaintext: nobody verified (trusted, one machine)."""

    verified: bool
    role: Role | None = None
    node: str | None = None

    @classmethod
    def of(cls, context: Any, tls: bool) -> Caller:
        if not tls:
            return cls(verified=False)
        return cls(verified=True, role=peer_role(context), node=peer_node(context))


def check_grantee(caller: Caller, grantee: str, *, require_node_certificates: bool) -> None:
    """``NotPermitted`` unless ``caller`` may use a pull grant a conductor bound to
    ``grantee`` ("" = not bound): conductors and plaintext callers always may; an agent
    whose certificate names another node may not; under ``require_node_certificates``
    the agent's certificate must name the grantee."""
    if not caller.verified or caller.role == "conductor":
        return
    if grantee and caller.node is not None and caller.node != grantee:
        raise NotPermitted(
            f"this grant is for node {grantee!r}; the caller's certificate names {caller.node!r}"
        )
    if require_node_certificates:
        if caller.node is None:
            raise NotPermitted(
                "this agent serves KV only to agents whose certificate names their node "
                "(kvc certs --node)"
            )
        if not grantee:
            raise NotPermitted("this agent serves KV only on grants bound to a node (grantee)")


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
