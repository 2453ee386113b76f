"""Prompts for a live replay that keep a Mooncake trace's prefix structure exactly.

What it builds
    Each trace ``hash_id`` names one block of ``block_tokens`` (512) tokens, drawn from a
    seeded RNG keyed by ``(seed, hash_id)``: the same id gives the same block in every
    request, every run and every process. A request's prompt is its blocks concatenated,
    truncated to ``input_length`` tokens. Two requests sharing their first ``k`` hash ids
    therefore share exactly their first ``k * 512`` tokens, and differ right after.

    Prompts go out as text (routers that hash text see the same text; engines tokenize
    it) or as token-id lists. For text to come back as exactly those tokens, blocks are
    drawn from a *round-tripping vocabulary*: entries whose text is one leading space and
    ASCII letters (``" word"``) and that the tokenizer encodes back to that one id. A
    byte-level BPE pre-tokenizer splits text before every `` word``, so concatenations
    tokenize to the concatenation of ids and block boundaries never merge
    (``check_prompt`` verifies it for one request; the unit tests over many random blocks).

    The engine may add special tokens of its own (vLLM prepends BOS to a text prompt):
    those are not in the prompt built here, and its ``usage.prompt_tokens`` counts them.

Knobs
    ``seed`` (which words each id draws), ``block_tokens`` (the trace's 512),
    ``cache_blocks`` (bound on memoised blocks, LRU), the tokenizer (the vocabulary).

Complexity
    Vocabulary: one encode per vocabulary entry, once. A prompt: O(input tokens) to join,
    plus O(block_tokens) per block not in the cache.
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from typing import Final

from kvc.tokenization import ChatTokenizer
from kvc_sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

__all__ = ["PromptError", "PromptSynthesizer", "RoundTripVocabulary"]

_WORD: Final = re.compile(r" [A-Za-z]+")
MIN_WORDS: Final = 64
"""Fewer round-tripping words than this and blocks would repeat too often to be distinct."""


class PromptError(ValueError):
    """No prompt can be built: a tokenizer without enough words, or a malformed request."""


class RoundTripVocabulary:
    """The tokenizer's entries that are ``" " + letters`` and encode back to themselves.

    Words are kept in token-id order, so the same tokenizer gives the same vocabulary.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        words: list[str] = []
        ids: list[int] = []
        special = tokenizer.special_token_ids
        for token_id in range(tokenizer.vocab_size):
            if token_id in special:
                continue
            text = tokenizer.decode([token_id], skip_special_tokens=False)
            if _WORD.fullmatch(text) and tokenizer.encode(text) == [token_id]:
                words.append(text)
                ids.append(token_id)
        if len(words) < MIN_WORDS:
            raise PromptError(
                f"the tokenizer has {len(words)} single-token words of the form ' letters' "
                f"(at least {MIN_WORDS} needed): use --prompt-format token-ids"
            )
        self.tokenizer = tokenizer
        self.words: tuple[str, ...] = tuple(words)
        self.ids: tuple[int, ...] = tuple(ids)

    def __len__(self) -> int:
        return len(self.ids)


class PromptSynthesizer:
    """Deterministic prompts for trace requests (see the module docstring)."""

    def __init__(
        self,
        vocabulary: RoundTripVocabulary,
        *,
        seed: int = 0,
        block_tokens: int = TRACE_BLOCK_TOKENS,
        cache_blocks: int = 4096,
    ) -> None:
        if block_tokens <= 0 or cache_blocks <= 0:
            raise ValueError("block_tokens and cache_blocks must be > 0")
        self.vocabulary = vocabulary
        self.seed = seed
        self.block_tokens = block_tokens
        self._cache_blocks = cache_blocks
        self._blocks: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # hash id -> indices

    def _block(self, hash_id: int) -> tuple[int, ...]:
        """Indices into the vocabulary of block ``hash_id`` (memoised, LRU-bounded)."""
        block = self._blocks.get(hash_id)
        if block is not None:
            self._blocks.move_to_end(hash_id)
            return block
        # A string seed is hashed with SHA-512 by random.seed: stable across processes.
        rng = random.Random(f"kvc-live:{self.seed}:{hash_id}")
        block = tuple(rng.choices(range(len(self.vocabulary)), k=self.block_tokens))
        self._blocks[hash_id] = block
        if len(self._blocks) > self._cache_blocks:
            self._blocks.popitem(last=False)
        return block

    def check_request(self, request: TraceRequest) -> None:
        """Raise ``PromptError`` if no prompt can be built for ``request``."""
        needed = -(-request.input_tokens // self.block_tokens)
        if request.input_tokens <= 0 or len(request.hash_ids) < needed:
            raise PromptError(
                f"request {request.request_id}: {request.input_tokens} input tokens need "
                f"{needed} hash ids of {self.block_tokens} tokens, it has "
                f"{len(request.hash_ids)}"
            )

    def _indices(self, request: TraceRequest) -> list[int]:
        self.check_request(request)
        needed = -(-request.input_tokens // self.block_tokens)
        out: list[int] = []
        for hash_id in request.hash_ids[:needed]:
            out.extend(self._block(hash_id))
        del out[request.input_tokens :]
        return out

    def token_ids(self, request: TraceRequest) -> list[int]:
        """The prompt as token ids: exactly ``request.input_tokens`` of them."""
        ids = self.vocabulary.ids
        return [ids[i] for i in self._indices(request)]

    def text(self, request: TraceRequest) -> str:
        """The prompt as text: encodes (no special tokens) to ``token_ids(request)``."""
        words = self.vocabulary.words
        return "".join(words[i] for i in self._indices(request))

    def check_prompt(self, request: TraceRequest) -> None:
        """Tokenize the text prompt of ``request`` and raise ``PromptError`` unless it gives
        exactly ``token_ids(request)`` (O(input tokens); run on a sample at start-up)."""
        got = self.vocabulary.tokenizer.encode(self.text(request))
        want = self.token_ids(request)
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
            raise PromptError(
                f"request {request.request_id}: the text prompt tokenizes to {len(got)} "
                f"tokens, {len(want)} intended (first difference at "
                f"{at if at is not None else min(len(got), len(want))}); "
                "use --prompt-format token-ids with this tokenizer"
            )
