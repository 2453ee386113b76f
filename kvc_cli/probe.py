"""``kvc probe URL``: exit 0 when a component is healthy, 1 otherwise.

For container healthchecks and exec probes without curl or grpc_health_probe:
``http://HOST:PORT/PATH`` expects HTTP 200; ``grpc://HOST:PORT`` runs the standard
gRPC health check (``grpc.health.v1``) for the node agent service; ``grpcs://`` does it
over mTLS with the agent's own files (``KVC_AGENT_TLS_CERT_FILE``, ``_KEY_FILE``,
``_CA_FILE``: a probe runs in the agent's container, with its environment).
"""

from __future__ import annotations

import asyncio
import os
import sys
from urllib.parse import urlparse

import grpc
import httpx
from grpc_health.v1 import health_pb2

from kvc.tls import TlsFiles, client_channel
from kvc.wire import SERVICE_NAME


async def _grpc_serving(address: str, timeout_s: float, tls: TlsFiles | None) -> bool:
    channel = client_channel(address, tls, "any")
    async with channel:
        check = channel.unary_unary(
            "/grpc.health.v1.Health/Check",
            request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
            response_deserializer=health_pb2.HealthCheckResponse.FromString,
        )
        try:
            resp = await check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


def probe(url: str, timeout_s: float = 3.0) -> bool:
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        try:
            return httpx.get(url, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False
    if parsed.scheme == "grpc" and parsed.netloc:
        return asyncio.run(_grpc_serving(parsed.netloc, timeout_s, None))
    if parsed.scheme == "grpcs" and parsed.netloc:
        env = os.environ
        tls = TlsFiles.from_settings(
            env.get("KVC_AGENT_TLS_CERT_FILE", ""),
            env.get("KVC_AGENT_TLS_KEY_FILE", ""),
            env.get("KVC_AGENT_TLS_CA_FILE", ""),
        )
        if tls is None:
            raise ValueError("grpcs:// needs KVC_AGENT_TLS_CERT_FILE, _KEY_FILE and _CA_FILE")
        return asyncio.run(_grpc_serving(parsed.netloc, timeout_s, tls))
    raise ValueError(
        f"unsupported probe URL {url!r}: use http://…, grpc://host:port or grpcs://host:port"
    )


def main(url: str, timeout_s: float) -> int:
    try:
        healthy = probe(url, timeout_s)
    except ValueError as exc:
        print(f"kvc probe: {exc}", file=sys.stderr)
        return 2
    print("healthy" if healthy else "unhealthy")
    return 0 if healthy else 1
