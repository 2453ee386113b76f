"""Constants of the conductor ↔ node-agent wire that both sides must agree on.

The message types themselves are the generated stubs in ``kvc.v1``; this module holds
what the stubs cannot: the gRPC service name both health checks use, the trailing-metadata
key that carries a structured ``ErrorInfo``, the message-size limit of every channel and
server, and the mapping of node roles (``kvc.roles``) to the wire's ``NodeRole`` enum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvc.roles import NodeRole
from kvc.sampling import Sampling, TokenLogprob
from kvc.v1 import node_agent_pb2 as pb

#: Full name of the agent's gRPC service, also its name in the gRPC health service.
SERVICE_NAME: Final = pb.DESCRIPTOR.services_by_name["NodeAgent"].full_name

#: Trailing-metadata key of a serialized ``kvc.v1.ErrorInfo`` (binary: ``-bin``).
ERROR_INFO_KEY: Final = "kvc-error-info-bin"

#: Largest gRPC message either side sends or accepts (KV chunks stay well below it).
MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024

ROLE_TO_PB: Final[dict[NodeRole, pb.NodeRole.ValueType]] = {
    "prefill": pb.NODE_ROLE_PREFILL,
    "decode": pb.NODE_ROLE_DECODE,
    "both": pb.NODE_ROLE_BOTH,
}
ROLE_FROM_PB: Final[dict[pb.NodeRole.ValueType, NodeRole]] = {v: k for k, v in ROLE_TO_PB.items()}


def sampling_to_pb(sampling: Sampling) -> pb.SamplingParams:
    message = pb.SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        max_tokens=sampling.max_tokens,
        stop=list(sampling.stop),
        ignore_eos=sampling.ignore_eos,
        frequency_penalty=sampling.frequency_penalty,
        presence_penalty=sampling.presence_penalty,
        logit_bias=dict(sampling.logit_bias),
        response_format=sampling.response_format,
        top_k=sampling.top_k,
        min_p=sampling.min_p,
        min_tokens=sampling.min_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
    )
    if sampling.seed is not None:
        message.seed = sampling.seed
    if sampling.logprobs is not None:
        message.logprobs = sampling.logprobs
    return message


def logprobs_to_pb(entries: Sequence[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [
        pb.TokenLogprob(
            logprob=e.logprob,
            top_ids=[t for t, _ in e.top],
            top_logprobs=[lp for _, lp in e.top],
        )
        for e in entries
    ]


def logprobs_from_pb(entries: Sequence[pb.TokenLogprob]) -> tuple[TokenLogprob, ...]:
    return tuple(
        TokenLogprob(e.logprob, tuple(zip(e.top_ids, e.top_logprobs, strict=True))) for e in entries
    )


def sampling_from_pb(message: pb.SamplingParams) -> Sampling:
    """Unset fields take the API's defaults: ``top_p`` 1, ``max_tokens`` 16."""
    return Sampling(
        temperature=message.temperature,
        top_p=message.top_p if message.top_p > 0 else 1.0,
        max_tokens=message.max_tokens or 16,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        ignore_eos=message.ignore_eos,
        frequency_penalty=message.frequency_penalty,
        presence_penalty=message.presence_penalty,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        response_format=message.response_format,
        top_k=message.top_k,
        min_p=message.min_p,
        min_tokens=message.min_tokens,
        stop_token_ids=tuple(message.stop_token_ids),
        logprobs=message.logprobs if message.HasField("logprobs") else None,
    )
