"""Next-token sampling of the embedded engine: greedy, or temperature + nucleus (top-p)."""

from __future__ import annotations

import torch

from kvc.sampling import Sampling

__all__ = ["Sampler"]


class Sampler:
    """Picks the next token from logits; one per request (it owns the RNG)."""

    def __init__(self, params: Sampling) -> None:
        if not params.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {params.temperature}")
        if not 0.0 < params.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
        self.params = params
        self._generator = torch.Generator(device="cpu")
        if params.seed is not None:
            self._generator.manual_seed(params.seed)
        else:
            self._generator.seed()

    def sample(self, logits: torch.Tensor) -> int:
        """Greedy when temperature is 0, else temperature + nucleus (top-p) sampling."""
        scores = logits.detach().reshape(-1).to(device="cpu", dtype=torch.float32)
        if self.params.temperature == 0.0:
            return int(torch.argmax(scores).item())
        probs = torch.softmax(scores / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (at least one token).
            drop = (cumulative - sorted_probs) >= self.params.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            choice = torch.multinomial(sorted_probs, 1, generator=self._generator)
            return int(order[choice].item())
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
