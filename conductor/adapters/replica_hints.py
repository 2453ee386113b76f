"""Pushes replica hints to agents that evict replica-aware (``NodeInfo.replica_hints``):
for each such agent, the keys of its cached blocks that the shadow index sees on another
node too (``PrefixIndex.replicated_keys``). The first push to an agent epoch is the
whole set (``reset``), later ones only what changed since the last push it applied; an
agent that restarted answers ``applied = false`` and gets the whole set next time.

Agents that donate before evicting (``NodeInfo.donate_before_evict``) get the hints too
(a donor offers only the blocks no other node holds), and with them, whole in every
push, their *donees*: the other usable donating agents with the time each one's next
eviction victim was last used (``LoadUpdate.eviction_tail_used_unix_s``); a push goes
out when the keys or the donees changed.

Nothing is pushed to other agents, so a fleet with neither setting pays nothing.
Per push: one vectorised pass over the index's table, then per agent O(keys
held twice or more), and O(changed keys) on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
import numpy as np
import numpy.typing as npt

from conductor.adapters.agents import AgentFleet, AgentHandle
from conductor.core.prefix_index import NodeId, PrefixIndex
from kvc.v1 import node_agent_pb2 as pb

__all__ = ["ReplicaHinter"]

log = logging.getLogger("conductor.replica_hints")

_Donees = tuple[tuple[str, float], ...]  # (advertised address, eviction tail) per donee


def _donees_of(agent: AgentHandle, donors: dict[str, tuple[str, float]]) -> _Donees:
    """The donating agents other than ``agent`` (none unless it donates itself)."""
    if agent.info is None or not agent.info.donate_before_evict:
        return ()
    return tuple(sorted(d for address, d in donors.items() if address != agent.address))


class ReplicaHinter:
    def __init__(self, fleet: AgentFleet, index: PrefixIndex) -> None:
        self._fleet = fleet
        self._index = index
        # address -> (agent epoch, the keys it was last told are held elsewhere, donees)
        self._sent: dict[str, tuple[str, npt.NDArray[np.uint64], _Donees]] = {}

    async def push_once(self) -> int:
        """One push to every usable agent that asks for hints; returns how many applied."""
        agents = [
            a
            for a in self._fleet.handles()
            if a.usable and a.info and (a.info.replica_hints or a.info.donate_before_evict)
        ]
        keys = self._index.replicated_keys(NodeId(a.address) for a in agents)
        donors = {
            a.address: (a.info.advertise_address or a.address, a.load.eviction_tail_used_unix_s)
            for a in agents
            if a.info and a.info.donate_before_evict and a.load is not None
        }
        results = await asyncio.gather(
            *(self._push(a, keys[NodeId(a.address)], _donees_of(a, donors)) for a in agents)
        )
        for address in set(self._sent) - {a.address for a in agents}:
            del self._sent[address]  # gone, or not asking: start over when it comes back
        return sum(results)

    async def _push(
        self, agent: AgentHandle, keys: npt.NDArray[np.uint64], donees: _Donees
    ) -> bool:
        assert agent.info is not None
        epoch = agent.info.epoch
        sent = self._sent.get(agent.address)
        if sent is None or sent[0] != epoch:
            request = pb.ReplicaHintsRequest(epoch=epoch, reset=True, replicated=keys.tolist())
        else:
            added = np.setdiff1d(keys, sent[1], assume_unique=True)
            removed = np.setdiff1d(sent[1], keys, assume_unique=True)
            if not len(added) and not len(removed) and donees == sent[2]:
                return False
            request = pb.ReplicaHintsRequest(
                epoch=epoch, replicated=added.tolist(), unreplicated=removed.tolist()
            )
        request.donees.extend(
            pb.Donee(address=address, eviction_tail_used_unix_s=tail) for address, tail in donees
        )
        try:
            answer = await agent.stub.ReplicaHints(request, timeout=self._fleet.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("replica hints to %s failed: %s", agent.address, exc.details())
            self._sent.pop(agent.address, None)  # whole again next time
            return False
        if not answer.applied:  # restarted since its info was read: whole again next time
            self._sent.pop(agent.address, None)
            return False
        self._sent[agent.address] = (epoch, keys, donees)
        return True

    async def run(self, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.push_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
