"""Prefill/decode hand-off between simulated engines through ``kv_transfer_params``, the
way vLLM's NixlConnector (pull mode) does it, with an HTTP side channel for the KV.

Prefill leg (``do_remote_decode: true``)
    The request runs as usual (the client sends ``max_tokens=1``, unstreamed); when it
    finishes, its blocks are kept, not freed, and the response carries
    ``kv_transfer_params = {do_remote_prefill: true, do_remote_decode: false,
    remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port,
    tp_size: 1, remote_num_tokens}`` (``prefill_params``). The blocks stay held until
    the decode engine pulls them, or for ``kv_transfer_timeout_s`` (vLLM's
    ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, 480 s by default).

Decode leg (``do_remote_prefill: true`` with those parameters)
    Before the request enters the engine, ``KvPuller.pull`` asks the prefill engine's
    side channel (``POST http://remote_host:remote_port/kvc_sim/kv_pull`` with the
    remote request and engine ids), which releases the held blocks and answers their
    token count ``n``; the pull takes ``wire_s(n x kv_bytes_per_token) + latency_s``
    profile seconds (scaled) from its start, the side channel's round trip included (as
    an engine step lasts its profile time from the previous step's end: on a machine
    shared by a whole fleet that exchange is not part of what is simulated). The
    request joins the engine with ``n`` prompt tokens already computed (blocks
    allocated and cached locally as it is admitted); its first token comes from the
    next step. A failed pull (unknown or expired
    request, engine unreachable) is logged and the prompt is computed locally, as
    vLLM's default ``kv_load_failure_policy="recompute"`` does.

Complexity
    One HTTP round trip per decode leg.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import httpx

from kvc_sim.profile import Profile

log = logging.getLogger("kvc_sim.vllm_sim.transfer")

__all__ = ["PULL_PATH", "KvPullError", "KvPuller", "RemotePrefill", "prefill_params"]

PULL_PATH: Final = "/kvc_sim/kv_pull"


class KvPullError(Exception):
    """The prefill engine could not hand over the KV (unknown request, unreachable)."""


def prefill_params(
    *,
    block_ids: Sequence[int],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    num_tokens: int,
) -> dict[str, Any]:
    """The prefill leg's ``kv_transfer_params`` (NixlConnector's keys)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": list(block_ids),
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "remote_num_tokens": num_tokens,
    }


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode leg's KV waits."""

    engine_id: str
    request_id: str
    host: str
    port: int

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemotePrefill:
        """Read ``kv_transfer_params`` of a decode leg; ``ValueError`` names what is wrong."""
        missing = [
            key
            for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
            if params.get(key) in (None, "")
        ]
        if missing:
            raise ValueError(f"kv_transfer_params with do_remote_prefill lacks {missing}")
        port = params["remote_port"]
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError("kv_transfer_params.remote_port must be a TCP port")
        return cls(
            engine_id=str(params["remote_engine_id"]),
            request_id=str(params["remote_request_id"]),
            host=str(params["remote_host"]),
            port=port,
        )


class KvPuller:
    """The decode side of the hand-off (see the module docstring)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        profile: Profile,
        *,
        time_scale: float,
        sleep: Callable[[float], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._http = http
        self._profile = profile
        self._time_scale = time_scale
        self._sleep = sleep
        self._clock = clock
        self.pulls = 0
        self.failures = 0

    def transfer_s(self, tokens: int) -> float:
        """Profile seconds to move ``tokens`` tokens of KV between two engines."""
        nbytes = tokens * self._profile.kv_bytes_per_token
        return self._profile.wire_s(nbytes) + self._profile.network.latency_s

    async def pull(self, remote: RemotePrefill) -> int:
        """Release the remote blocks, wait for the bytes; the token count pulled."""
        started = self._clock()
        url = f"http://{remote.host}:{remote.port}{PULL_PATH}"
        body = {"remote_request_id": remote.request_id, "remote_engine_id": remote.engine_id}
        try:
            response = await self._http.post(url, json=body)
        except httpx.HTTPError as exc:
            self.failures += 1
            raise KvPullError(f"prefill engine at {url} unreachable: {exc}") from exc
        if response.status_code != 200:
            self.failures += 1
            raise KvPullError(f"prefill engine at {url} answered {response.status_code}")
        tokens = int(response.json()["num_tokens"])
        exchange_s = self._clock() - started
        await self._sleep(max(0.0, self.transfer_s(tokens) * self._time_scale - exchange_s))
        self.pulls += 1
        return tokens
