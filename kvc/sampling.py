"""How tokens are chosen: one type from the API request to the engine's sampler.

The conductor builds it from an OpenAI or Anthropic request, sends it as
``kvc.v1.SamplingParams`` (``kvc.wire.sampling_to_pb`` / ``sampling_from_pb``), and the
node agent hands it to its engine. Range checks live where the values come in (the API
schemas) and where they are used (an engine's sampler).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (and vLLM's default max_logprobs)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One generated token's log-probability under the model (its raw output: before
    temperature, penalties or any other sampling rule, as vLLM reports by default), and
    the most likely alternatives asked for, most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability)


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # nucleus sampling: (0, 1]
    max_tokens: int = 16
    seed: int | None = None  # makes sampling repeatable
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens
    # OpenAI's penalties, over the tokens generated so far (not the prompt, as vLLM):
    # logit -= frequency_penalty * count + presence_penalty * (count > 0).
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # OpenAI's response_format object as JSON (structured output); "": plain text.
    response_format: str = ""
    # vLLM's extensions (0 / empty: off).
    top_k: int = 0  # keep the k most likely tokens
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    min_tokens: int = 0  # no EOS or stop token before this many tokens
    stop_token_ids: tuple[int, ...] = ()  # end like EOS; the token is not returned
    # Per generated token, its log-probability and this many most likely alternatives
    # (0..MAX_TOP_LOGPROBS); None: none reported.
    logprobs: int | None = None
