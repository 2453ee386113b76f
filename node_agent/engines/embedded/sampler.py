"""Next-token sampling of the embedded engine: greedy, or temperature with vLLM's top-k,
nucleus (top-p) and min-p filters, after OpenAI's logit bias and frequency/presence
penalties (over the tokens this sampler has produced, as vLLM counts them)."""

from __future__ import annotations

import torch

from kvc.sampling import Sampling, TokenLogprob

__all__ = ["GREEDY_BELOW", "Sampler"]

# Temperatures under this are greedy, as in vLLM (its _SAMPLING_EPS): dividing logits by
# a temperature near the smallest float overflows them to inf and the softmax to NaN.
GREEDY_BELOW = 1e-5


class Sampler:
    """Picks the next token from logits; one per request (it owns the RNG)."""

    def __init__(self, params: Sampling) -> None:
        if not params.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(params, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(params, name)}")
        if params.top_k < 0 or not 0.0 <= params.min_p <= 1.0 or params.min_tokens < 0:
            raise ValueError(
                f"top_k must be >= 0, min_p in [0, 1], min_tokens >= 0; got {params.top_k}, "
                f"{params.min_p}, {params.min_tokens}"
            )
        for token, bias in params.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias {token}: {bias} is outside ids >= 0, [-100, 100]")
        self.params = params
        self._bias = dict(params.logit_bias)
        self._penalised = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self._counts: dict[int, int] = {}  # produced token -> times
        self._generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        else:
            self._generator.seed()

    def sample(self, logits: torch.Tensor, ban: frozenset[int] = frozenset()) -> int:
        """Greedy when temperature is 0 (below ``GREEDY_BELOW``), else temperature + top-k +
        nucleus (top-p) + min-p sampling; never a token in ``ban`` (``min_tokens``: EOS and
        stop ids).

        Raises ``ValueError`` when a biased token id is outside the logits."""
        scores = self._adjusted(logits)
        if ban:
            scores[[t for t in ban if t < scores.numel()]] = float("-inf")
        token = self._pick(scores)
        if self._penalised:
            self._counts[token] = self._counts.get(token, 0) + 1
        return token

    def logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        """``token``'s log-probability under the model's raw output (before temperature,
        penalties and the other rules, as vLLM reports by default) and the
        ``params.logprobs`` most likely tokens."""
        logp = torch.log_softmax(
            logits.detach().reshape(-1).to(device="cpu", dtype=torch.float32), dim=-1
        )
        k = min(self.params.logprobs or 0, logp.numel())
        top: tuple[tuple[int, float], ...] = ()
        if k:
            values, ids = torch.topk(logp, k)
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        return TokenLogprob(float(logp[token].item()), top)

    def _adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        scores = logits.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        scores = scores.clone()
        if self._bias:
            ids = list(self._bias)
            if max(ids) >= scores.numel():
                raise ValueError(f"logit_bias token id {max(ids)} is outside the vocabulary")
            scores[ids] += torch.tensor(list(self._bias.values()), dtype=torch.float32)
        if self._counts:
            ids = list(self._counts)
            counts = torch.tensor(list(self._counts.values()), dtype=torch.float32)
            scores[ids] -= self.params.frequency_penalty * counts + self.params.presence_penalty
        return scores

    def _pick(self, scores: torch.Tensor) -> int:
        if self.params.temperature < GREEDY_BELOW:
            return int(torch.argmax(scores).item())
        k = self.params.top_k
        if 0 < k < scores.numel():
            kth = torch.topk(scores, k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores / self.params.temperature, dim=-1)
        if self.params.min_p > 0.0:
            probs = probs.masked_fill(probs < self.params.min_p * probs.max(), 0.0)
            probs = probs / probs.sum()
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            drop = (cumulative - sorted_probs) >= self.params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=self._generator)
            return int(order[choice].item())
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
