"""Live replay prompts: exact token counts, exact prefix sharing, determinism."""

from __future__ import annotations

import random

import pytest

from kvc.models import DEFAULT_MODEL_DIR
from kvc.tokenization import ChatTokenizer
from kvc_sim.live.prompts import PromptError, PromptSynthesizer, RoundTripVocabulary
from kvc_sim.trace import TRACE_BLOCK_TOKENS, TraceRequest

B = TRACE_BLOCK_TOKENS


@pytest.fixture(scope="module")
def tokenizer() -> ChatTokenizer:
    return ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)


@pytest.fixture(scope="module")
def vocabulary(tokenizer: ChatTokenizer) -> RoundTripVocabulary:
    return RoundTripVocabulary(tokenizer)


def request(rid: str, hash_ids: tuple[int, ...], input_tokens: int) -> TraceRequest:
    return TraceRequest(rid, 0.0, input_tokens, 8, hash_ids)


def test_every_vocabulary_word_is_one_token_of_a_space_and_letters(
    vocabulary: RoundTripVocabulary, tokenizer: ChatTokenizer
) -> None:
    assert len(vocabulary) >= 64
    assert len(set(vocabulary.ids)) == len(vocabulary)
    for word, token_id in zip(vocabulary.words, vocabulary.ids, strict=True):
        assert word[0] == " "
        assert word[1:].isascii()
        assert word[1:].isalpha()
        assert tokenizer.encode(word) == [token_id]


def test_random_blocks_of_text_tokenize_to_exactly_their_ids(
    vocabulary: RoundTripVocabulary, tokenizer: ChatTokenizer
) -> None:
    synth = PromptSynthesizer(vocabulary, seed=7)
    rng = random.Random(3)
    for n in range(60):
        blocks = rng.randint(1, 6)
        ids = tuple(rng.sample(range(10**6), blocks))
        length = rng.randint((blocks - 1) * B + 1, blocks * B)
        req = request(f"r{n}", ids, length)
        want = synth.token_ids(req)
        assert len(want) == length
        assert tokenizer.encode(synth.text(req)) == want
        synth.check_prompt(req)  # the start-up check agrees


def test_requests_sharing_k_hash_ids_share_exactly_k_blocks_of_tokens(
    vocabulary: RoundTripVocabulary, tokenizer: ChatTokenizer
) -> None:
    synth = PromptSynthesizer(vocabulary)
    for k in range(4):
        shared = tuple(range(100, 100 + k))
        a = request("a", (*shared, 1, 2), (k + 2) * B)
        b = request("b", (*shared, 3), k * B + 100)
        ta = tokenizer.encode(synth.text(a))
        tb = tokenizer.encode(synth.text(b))
        assert ta[: k * B] == tb[: k * B]
        assert ta[k * B : k * B + 100] != tb[k * B : k * B + 100]
        # the first differing token is right at the boundary (distinct blocks differ at once
        # with overwhelming odds: 933 words per position)
        assert ta[k * B] != tb[k * B]


def test_a_shorter_prompt_is_a_prefix_of_a_longer_one_with_the_same_ids(
    vocabulary: RoundTripVocabulary,
) -> None:
    synth = PromptSynthesizer(vocabulary)
    long = synth.token_ids(request("l", (5, 6, 7), 3 * B))
    short = synth.token_ids(request("s", (5, 6, 7), 2 * B + 17))
    assert long[: len(short)] == short


def test_prompts_are_deterministic_across_instances_and_depend_on_the_seed(
    vocabulary: RoundTripVocabulary, tokenizer: ChatTokenizer
) -> None:
    req = request("r", (11, 12), B + 300)
    first = PromptSynthesizer(vocabulary, seed=1).text(req)
    again = PromptSynthesizer(RoundTripVocabulary(tokenizer), seed=1, cache_blocks=1)
    assert again.text(req) == first
    assert again.text(req) == first  # rebuilt after the LRU dropped it
    assert PromptSynthesizer(vocabulary, seed=2).text(req) != first


def test_token_id_and_text_prompts_are_the_same_tokens(
    vocabulary: RoundTripVocabulary, tokenizer: ChatTokenizer
) -> None:
    synth = PromptSynthesizer(vocabulary)
    req = request("r", (1, 2, 3), 2 * B + 1)
    assert synth.token_ids(req) == tokenizer.encode(synth.text(req))


def test_a_request_with_too_few_hash_ids_is_refused(vocabulary: RoundTripVocabulary) -> None:
    synth = PromptSynthesizer(vocabulary)
    with pytest.raises(PromptError, match="need 3 hash ids"):
        synth.check_request(request("r", (1, 2), 2 * B + 1))
    with pytest.raises(PromptError):
        synth.text(request("r", (), 10))
    synth.check_request(request("r", (1, 2, 3, 4), 2 * B + 1))  # extra ids are unused
