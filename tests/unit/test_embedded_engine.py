"""The embedded engine: deterministic weights, prefix reuse, KV bytes/blocks, sampling."""

from __future__ import annotations

import hashlib
import itertools
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvc.models import CORPUS_PATH, DEFAULT_MODEL_DIR
from kvc.sampling import Sampling
from kvc.tokenization import ChatTokenizer
from node_agent.engines.embedded.kv_tensors import KvCache
from node_agent.engines.embedded.model import EmbeddedModel
from node_agent.engines.embedded.sampler import Sampler
from node_agent.kv import KvLayout

BLOCK = 32


@pytest.fixture(scope="module")
def model() -> EmbeddedModel:
    return EmbeddedModel.load(DEFAULT_MODEL_DIR, device="cpu")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    tok = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    ids = tok.encode(CORPUS_PATH.read_text(encoding="utf-8")[:4000])
    assert len(ids) >= 7 * BLOCK
    return ids[: 6 * BLOCK + 13]


def greedy(model: EmbeddedModel, logits: torch.Tensor, kv: KvCache, n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        token = int(torch.argmax(logits).item())
        out.append(token)
        logits, kv = model.forward([token], kv)
    return out


def assert_same_cache(a: KvCache, b: KvCache) -> None:
    assert a.layout == b.layout
    assert a.num_tokens == b.num_tokens
    for (ka, va), (kb, vb) in zip(a.layers, b.layers, strict=True):
        assert torch.equal(ka, kb)
        assert torch.equal(va, vb)


def _weights_digest(m: EmbeddedModel) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(m.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


# -- loading ---------------------------------------------------------------------


def test_layout_and_metadata(model: EmbeddedModel) -> None:
    assert model.name == "tiny-llama"
    assert model.device == "cpu"
    assert model.layout == KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    assert model.layout.bytes_per_token == 2048
    assert model.max_model_len == 4096
    assert model.vocab_size == 2048


def test_load_is_deterministic_and_leaves_global_rng_alone(model: EmbeddedModel) -> None:
    rng_before = torch.random.get_rng_state()
    again = EmbeddedModel.load(DEFAULT_MODEL_DIR, device="cpu")
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    first, second = model.model.state_dict(), again.model.state_dict()
    assert first.keys() == second.keys()
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name
    # Large initializer_range really applied (HF default std would be 0.02).
    assert float(first["model.embed_tokens.weight"].std()) > 0.3


def test_weights_identical_in_another_process(model: EmbeddedModel) -> None:
    code = (
        "import hashlib, torch\n"
        "from kvc.models import DEFAULT_MODEL_DIR\n"
        "from node_agent.engines.embedded.model import EmbeddedModel\n"
        "m = EmbeddedModel.load(DEFAULT_MODEL_DIR, device='cpu')\n"
        "d = hashlib.sha256()\n"
        "for n, t in sorted(m.model.state_dict().items()):\n"
        "    d.update(n.encode())\n"
        "    d.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())\n"
        "print(d.hexdigest())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == _weights_digest(model)


# -- forward & prefix reuse --------------------------------------------------------


def test_forward_shapes_and_errors(model: EmbeddedModel, prompt: list[int]) -> None:
    logits, kv = model.forward(prompt[:10])
    assert logits.shape == (model.vocab_size,)
    assert logits.dtype == torch.float32
    assert logits.device.type == "cpu"
    assert kv.num_tokens == 10
    assert kv.layout == model.layout
    with pytest.raises(ValueError, match="at least one token"):
        model.forward([])
    with pytest.raises(ValueError, match="token ids"):
        model.forward([model.vocab_size])
    long_past = KvCache.from_bytes(
        model.layout, bytes(model.layout.bytes_per_token * model.max_model_len), 4096
    )
    with pytest.raises(ValueError, match="context length"):
        model.forward([1], long_past)


def test_prefix_reuse_matches_full_recompute(model: EmbeddedModel, prompt: list[int]) -> None:
    full_logits, full_kv = model.forward(prompt)
    split = 4 * BLOCK
    _, prefix_kv = model.forward(prompt[:split])
    snapshot = [(k.clone(), v.clone()) for k, v in prefix_kv.layers]
    reuse_logits, reuse_kv = model.forward(prompt[split:], prefix_kv)
    # past is never mutated
    for (k, v), (k0, v0) in zip(prefix_kv.layers, snapshot, strict=True):
        assert torch.equal(k, k0)
        assert torch.equal(v, v0)
    assert float((full_logits - reuse_logits).abs().max()) <= 1e-5
    assert reuse_kv.num_tokens == full_kv.num_tokens == len(prompt)
    full_tokens = greedy(model, full_logits, full_kv, 32)
    reuse_tokens = greedy(model, reuse_logits, reuse_kv, 32)
    assert full_tokens == reuse_tokens


def test_greedy_output_is_diverse(model: EmbeddedModel, prompt: list[int]) -> None:
    logits, kv = model.forward(prompt[:50])
    tokens = greedy(model, logits, kv, 32)
    assert len(set(tokens)) >= 20


def test_kv_bytes_round_trip_continues_identically(model: EmbeddedModel, prompt: list[int]) -> None:
    prefix, rest = prompt[:-1], prompt[-1:]
    _, kv = model.forward(prefix)
    data = kv.to_bytes()
    assert len(data) == kv.num_tokens * model.layout.bytes_per_token == kv.nbytes
    restored = KvCache.from_bytes(model.layout, data, kv.num_tokens, None)
    assert_same_cache(kv, restored)
    direct = greedy(model, *model.forward(rest, kv), 32)
    via_bytes = greedy(model, *model.forward(rest, restored), 32)
    assert direct == via_bytes
    with pytest.raises(ValueError, match="bytes"):
        KvCache.from_bytes(model.layout, data[:-1], kv.num_tokens)
    with pytest.raises(ValueError, match="bytes"):
        KvCache.from_bytes(model.layout, data, kv.num_tokens + 1)
    empty = KvCache.from_bytes(model.layout, b"", 0)
    assert empty.num_tokens == 0
    assert empty.to_bytes() == b""


def test_blocks_slice_and_concat_reassemble(model: EmbeddedModel, prompt: list[int]) -> None:
    _, kv = model.forward(prompt)
    bounds = [*range(0, kv.num_tokens, BLOCK), kv.num_tokens]
    blocks = [kv.slice(a, b) for a, b in itertools.pairwise(bounds)]
    assert [b.num_tokens for b in blocks[:-1]] == [BLOCK] * (len(blocks) - 1)
    assert all(k.is_contiguous() for b in blocks for k, _ in b.layers)
    assert_same_cache(KvCache.concat(blocks), kv)
    # Blocks through bytes (as a KV transfer would) reassemble identically too.
    wired = [KvCache.from_bytes(b.layout, b.to_bytes(), b.num_tokens) for b in blocks]
    assert_same_cache(KvCache.concat(wired), kv)
    # Reused blocks + computed remainder == full computation, as the agent does it.
    cached = KvCache.concat(blocks[:3])
    logits_reuse, kv_reuse = model.forward(prompt[3 * BLOCK :], cached)
    logits_full, _ = model.forward(prompt)
    assert float((logits_full - logits_reuse).abs().max()) <= 1e-5
    assert kv_reuse.num_tokens == kv.num_tokens
    with pytest.raises(ValueError, match="outside"):
        kv.slice(0, kv.num_tokens + 1)
    with pytest.raises(ValueError, match="at least one part"):
        KvCache.concat([])


def test_dynamic_cache_round_trip(model: EmbeddedModel, prompt: list[int]) -> None:
    _, kv = model.forward(prompt[:40])
    assert_same_cache(KvCache.from_model_cache(kv.to_dynamic_cache()), kv)


# -- sampling ------------------------------------------------------------------------


def test_sampling(model: EmbeddedModel, prompt: list[int]) -> None:
    logits, _ = model.forward(prompt[:20])
    greedy_sampler = Sampler(Sampling(temperature=0.0))
    assert greedy_sampler.sample(logits) == int(torch.argmax(logits).item())
    # The smallest normal float overflowed logits / temperature to inf (a NaN softmax,
    # a 502 found by the API fuzzer): below vLLM's epsilon it is greedy, as there.
    tiny = Sampler(Sampling(temperature=1.175494351e-38, seed=1))
    assert tiny.sample(logits) == int(torch.argmax(logits).item())

    def draws(seed: int) -> list[int]:
        sampler = Sampler(Sampling(temperature=1.5, top_p=0.95, seed=seed))
        return [sampler.sample(logits) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 5
    narrow = Sampler(Sampling(temperature=1.0, top_p=1e-6, seed=1))
    assert {narrow.sample(logits) for _ in range(10)} == {int(torch.argmax(logits).item())}
    with pytest.raises(ValueError, match="temperature"):
        Sampler(Sampling(temperature=-1.0))
    with pytest.raises(ValueError, match="top_p"):
        Sampler(Sampling(top_p=0.0))


def test_logit_bias_moves_the_greedy_choice() -> None:
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0])
    assert Sampler(Sampling(temperature=0.0)).sample(logits) == 1
    biased = Sampler(Sampling(temperature=0.0, logit_bias=((2, 10.0),)))
    assert [biased.sample(logits) for _ in range(3)] == [2, 2, 2]
    banned = Sampler(Sampling(temperature=0.0, logit_bias=((1, -100.0),)))
    assert banned.sample(logits) == 3
    # Sampling at any temperature never draws a token biased down by 100.
    hot = Sampler(Sampling(temperature=2.0, seed=3, logit_bias=((1, -100.0),)))
    assert 1 not in {hot.sample(logits) for _ in range(200)}
    with pytest.raises(ValueError, match="vocabulary"):
        Sampler(Sampling(temperature=0.0, logit_bias=((4, 1.0),))).sample(logits)


def test_penalties_count_the_tokens_this_sampler_produced() -> None:
    logits = torch.tensor([0.0, 3.0, 2.5, 1.0])
    # No penalty: greedy repeats token 1 forever.
    plain = Sampler(Sampling(temperature=0.0))
    assert [plain.sample(logits) for _ in range(4)] == [1, 1, 1, 1]
    # presence 1.0: token 1 drops to 2.0 after one use, below token 2's 2.5; then token 2
    # drops to 1.5, and token 1 (2.0) wins again: each penalised once.
    presence = Sampler(Sampling(temperature=0.0, presence_penalty=1.0))
    assert [presence.sample(logits) for _ in range(4)] == [1, 2, 1, 1]
    # frequency 0.4: token 1 scores 3.0 - 0.4k; it yields to token 2 (2.5 - 0.4j) in turn.
    frequency = Sampler(Sampling(temperature=0.0, frequency_penalty=0.4))
    assert [frequency.sample(logits) for _ in range(5)] == [1, 1, 2, 1, 2]
    # A negative penalty rewards repetition.
    eager = Sampler(Sampling(temperature=0.0, presence_penalty=-2.0, logit_bias=((2, 0.6),)))
    assert [eager.sample(logits) for _ in range(3)] == [2, 2, 2]


def test_top_k_min_p_and_banned_tokens() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, 2.8, -5.0])
    # top_k=1 at any temperature is greedy.
    one = Sampler(Sampling(temperature=5.0, top_k=1, seed=1))
    assert {one.sample(logits) for _ in range(50)} == {1}
    two = Sampler(Sampling(temperature=5.0, top_k=2, seed=1))
    assert {two.sample(logits) for _ in range(200)} == {1, 2}
    # min_p 0.5: only tokens at least half as likely as the best (1, 2, 3) remain.
    near = Sampler(Sampling(temperature=1.0, min_p=0.5, seed=2))
    assert {near.sample(logits) for _ in range(300)} == {1, 2, 3}
    # A banned token (min_tokens keeps EOS and stop ids out) is never drawn.
    assert Sampler(Sampling(temperature=0.0)).sample(logits, ban=frozenset({1, 9})) == 2


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (Sampling(frequency_penalty=2.5), "frequency_penalty"),
        (Sampling(presence_penalty=-2.5), "presence_penalty"),
        (Sampling(logit_bias=((1, 101.0),)), "logit_bias"),
        (Sampling(logit_bias=((-1, 1.0),)), "logit_bias"),
        (Sampling(top_k=-1), "top_k"),
        (Sampling(min_p=1.5), "min_p"),
    ],
)
def test_sampler_refuses_out_of_range_parameters(params: Sampling, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Sampler(params)


def test_loads_a_hugging_face_folder_with_real_weights(
    model: EmbeddedModel, prompt: list[int], tmp_path: Path
) -> None:
    """``--model PATH`` with weights on disk (no kvc_init.json) takes the real-weights path."""
    folder = tmp_path / "saved-model"
    model.model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(DEFAULT_MODEL_DIR / name, folder / name)
    assert not (folder / "kvc_init.json").exists()
    loaded = EmbeddedModel.load(folder, device="cpu")
    assert loaded.name == "saved-model"
    assert loaded.layout == model.layout
    expected, _ = model.forward(prompt)
    actual, _ = loaded.forward(prompt)
    assert torch.equal(expected, actual)
    assert ChatTokenizer.from_dir(folder).vocab_size == model.vocab_size


def test_logprobs_are_of_the_raw_logits_whatever_the_sampling_rules() -> None:
    logits = torch.tensor([2.0, 0.0, 1.0, -1.0])
    expected = torch.log_softmax(logits, dim=-1)
    for rules in (
        Sampling(logprobs=2),
        Sampling(logprobs=2, temperature=0.3, logit_bias=((1, 50.0),), top_k=1),
    ):
        sampler = Sampler(rules)
        entry = sampler.logprob(logits, 1)
        assert entry.logprob == pytest.approx(float(expected[1]))
        assert [t for t, _ in entry.top] == [0, 2]
        assert [lp for _, lp in entry.top] == pytest.approx(
            [float(expected[0]), float(expected[2])]
        )
    assert Sampler(Sampling(logprobs=0)).logprob(logits, 3).top == ()
    assert len(Sampler(Sampling(logprobs=20)).logprob(logits, 3).top) == 4  # the whole vocabulary


@pytest.mark.parametrize(
    ("prompt", "named"),
    [((5, 2048, 7), "2048"), ((5, -1, 9999), "-1"), ((1, 2, 3, 4, 5000), "5000")],
)
def test_an_out_of_vocabulary_id_is_refused_by_name(prompt: tuple[int, ...], named: str) -> None:
    from node_agent.engines.base import EngineInfo, validate_prompt
    from node_agent.errors import PromptRejected

    layout = KvLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float32")
    info = EngineInfo("m", "embedded", 64, 2048, layout, frozenset())
    validate_prompt(info, (0, 2047, 5))
    with pytest.raises(PromptRejected, match=f"token id {named} is outside"):
        validate_prompt(info, prompt)


# -- load reports -------------------------------------------------------------------


async def test_a_queued_prefill_reports_its_whole_prompt(
    model: EmbeddedModel, prompt: list[int]
) -> None:
    """The queue counts whole prompts, the cached part included, as vLLM's adapter does
    and as a conductor subtracts when its prefill ends (LoadUpdate.queued_prefill_tokens)."""
    import asyncio
    import threading

    from node_agent.engines.base import PrefillJob
    from node_agent.engines.embedded.adapter import EmbeddedEngineAdapter
    from tests.conftest import wait_until

    engine = EmbeddedEngineAdapter(
        model, ChatTokenizer.from_dir(DEFAULT_MODEL_DIR), served_model_name="m"
    )
    ids = tuple(prompt[: 4 * BLOCK + 5])
    first = await engine.prefill(PrefillJob("r0", ids, BLOCK, (None,) * 4))
    cached = (first.new_block_payloads[0], first.new_block_payloads[1])  # two blocks cached
    release = threading.Event()
    busy = asyncio.get_running_loop().run_in_executor(engine._executor, release.wait)
    job = PrefillJob("r1", ids, BLOCK, (*cached, None, None))
    task = asyncio.create_task(engine.prefill(job))
    try:
        # The prefill is queued behind the held engine thread.
        await wait_until(lambda: engine.load().waiting_requests > 0)
        assert engine.load().queued_prefill_tokens == len(ids)
    finally:
        release.set()
        await busy
    outcome = await task
    assert outcome.cached_tokens == 2 * BLOCK
    assert engine.load().queued_prefill_tokens == 0
    await engine.aclose()
