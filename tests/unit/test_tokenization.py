"""ChatTokenizer, chat templates, incremental detokenization and the shipped model folder."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvc.models import CORPUS_PATH, DEFAULT_MODEL_DIR
from kvc.tokenization import ChatMark, ChatTemplateError, ChatTokenizer, IncrementalDetokenizer
from tools.build_tiny_llama import build

MIXED_TEXT = (
    "The lighthouse keeper wrote: “Wind NW, fresh.” — naïve café, 3.14159 ≈ π.\n"
    "你好，世界。今天天气很好。こんにちは、東京！ 안녕하세요.\n"
    "Emoji: 🎉🚀👋🏽 ❤️ family: 👨‍👩‍👧‍👦 flags: 🇯🇵🇬🇧\n"
    "def f(x):\n    return {'a': [1, 2, 3]}  # tabs\tand  spaces\n"
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी.\n"
) * 4

_TOKENIZER: ChatTokenizer | None = None


def tokenizer() -> ChatTokenizer:
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = ChatTokenizer.from_dir(DEFAULT_MODEL_DIR)
    return _TOKENIZER


# -- basics -------------------------------------------------------------------


def test_round_trip_and_special_tokens() -> None:
    tok = tokenizer()
    ids = tok.encode(MIXED_TEXT)
    assert tok.decode(ids) == MIXED_TEXT
    assert all(0 <= i < tok.vocab_size for i in ids)
    with_bos = tok.encode("Hello world", add_special_tokens=True)
    assert with_bos[0] == tok.bos_token_id
    assert with_bos[1:] == tok.encode("Hello world")


def test_properties_of_tiny_model() -> None:
    tok = tokenizer()
    assert tok.vocab_size == 2048
    assert tok.bos_token_id == tok.token_to_id("<|begin_of_text|>") == 0
    assert tok.eos_token_ids == frozenset({tok.token_to_id("<|im_end|>"), 1})
    assert tok.model_max_length == 4096
    assert tok.has_chat_template
    im_start = tok.token_to_id("<|im_start|>")
    assert im_start is not None
    assert im_start in tok.special_token_ids


def test_decode_skips_special_tokens_by_default() -> None:
    tok = tokenizer()
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


# -- chat templates ------------------------------------------------------------


def test_chat_template_system_user_generation_prompt() -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi there"},
    ]
    text = tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tokenizer().apply_chat_template(messages, add_generation_prompt=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")


def test_chat_token_ids_have_markers_once_and_no_bos() -> None:
    tok = tokenizer()
    messages = [{"role": "user", "content": "Hello"}]
    ids = tok.chat_token_ids(messages)
    assert ids == tok.encode(tok.apply_chat_template(messages))
    assert tok.bos_token_id not in ids
    im_start = tok.token_to_id("<|im_start|>")
    assert im_start is not None
    assert ids.count(im_start) == 2  # user turn + generation prompt
    assert ids[0] == im_start


def test_content_parts_are_joined() -> None:
    messages = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}],
        }
    ]
    text = tokenizer().apply_chat_template(messages)
    assert "<|im_start|>user\nfirst\nsecond<|im_end|>\n" in text


def test_non_text_part_is_rejected() -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
            ],
        }
    ]
    with pytest.raises(ChatTemplateError, match="image_url"):
        tokenizer().apply_chat_template(messages)


def test_template_raise_exception_becomes_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="Unsupported role: wizard"):
        tokenizer().apply_chat_template([{"role": "wizard", "content": "x"}])


def test_bad_content_type_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError):
        tokenizer().apply_chat_template([{"role": "user", "content": 42}])


def test_tools_render_as_plain_json() -> None:
    tools = [{"type": "function", "function": {"name": "lookup<&>", "parameters": {}}}]
    text = tokenizer().apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}], tools=tools
    )
    assert text.startswith("<|im_start|>system\nS\n\nYou can call these tools.")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert json.dumps(tools[0]) in text  # no HTML escaping of <, &, >
    assert text.count("<|im_start|>system") == 1


def test_a_tool_call_loop_renders_calls_and_results_as_hermes() -> None:
    """An assistant turn's tool_calls (arguments as a JSON string, as OpenAI sends them,
    or as an object) and the tool's result, in the format the hermes parser reads back."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for arguments in ('{"x": 1}', {"x": 1}):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "42"},
        ]
        text = tokenizer().apply_chat_template(messages, tools=tools)
        assert (
            '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
            "</tool_call><|im_end|>\n"
        ) in text
        assert "<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n" in text


def _hf_style_folder(tmp_path: Path, tokenizer_config: dict[str, object]) -> Path:
    folder = tmp_path / "hf-model"
    folder.mkdir()
    shutil.copy(DEFAULT_MODEL_DIR / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 1234}))
    return folder


def test_hf_style_folder_named_templates_and_dict_tokens(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% generation %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endgeneration %}"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    folder = _hf_style_folder(
        tmp_path,
        {
            "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>"},
            "eos_token": {"content": "<|end_of_text|>"},
            "model_max_length": 1000000000000000019884624838656,
            "chat_template": [
                {"name": "default", "template": template},
                {"name": "tool_use", "template": "TOOLS{{ tools | length }}"},
            ],
        },
    )
    tok = ChatTokenizer.from_dir(folder)
    assert tok.bos_token_id == 0
    assert tok.eos_token_ids == frozenset({1, 3})
    assert tok.model_max_length == 1234  # unbounded sentinel → config.json
    messages = [
        {"role": "user", "content": "a<b"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "dropped by break"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == '<|begin_of_text|>[user]"a<b"[assistant]"ok"[assistant]'
    assert tok.apply_chat_template(messages, tools=[{"type": "function"}]) == "TOOLS1"


def test_chat_template_jinja_side_file_and_special_tokens_map(tmp_path: Path) -> None:
    folder = _hf_style_folder(tmp_path, {"model_max_length": 77})
    (folder / "chat_template.jinja").write_text("{{ eos_token }}|{{ messages[0].content }}")
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = ChatTokenizer.from_dir(folder)
    assert tok.bos_token_id is None
    assert tok.eos_token_ids == frozenset({1, 3})
    assert tok.model_max_length == 77
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_end|>|x"


def test_missing_or_broken_template(tmp_path: Path) -> None:
    tok = ChatTokenizer.from_dir(_hf_style_folder(tmp_path, {}))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    broken = ChatTokenizer(tok.tokenizer, chat_templates={"default": "{% for %}"})
    with pytest.raises(ChatTemplateError, match="does not compile"):
        broken.apply_chat_template([{"role": "user", "content": "x"}])


def test_matches_transformers_rendering_and_encoding() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR), local_files_only=True)
    tok = tokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Où est la bibliothèque? 你好 🎉"},
        {"role": "assistant", "content": "Here."},
        {"role": "user", "content": "Thanks"},
    ]
    for gen in (True, False):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == expected
    assert tok.encode(MIXED_TEXT, add_special_tokens=True) == hf(MIXED_TEXT).input_ids
    # A tool loop in the Hermes-style template: tools, an assistant's calls (arguments as
    # OpenAI's JSON string and as an object), the tool's result.
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Météo",
                                          "parameters": {"type": "object"}}},
    ]  # fmt: skip
    loop: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "b", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Lima"}}},
        ]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "fog"},
    ]  # fmt: skip
    expected = hf.apply_chat_template(loop, tools=tools, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(loop, tools=tools, add_generation_prompt=True) == expected


# -- incremental detokenizer ---------------------------------------------------


def _stream(
    tok: ChatTokenizer, ids: list[int], *, skip_special_tokens: bool = True
) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    deltas = [detok.push(i) for i in ids]
    return deltas, detok.flush()


def test_incremental_equals_full_decode_mixed_text() -> None:
    tok = tokenizer()
    ids = tok.encode(MIXED_TEXT)
    detok = IncrementalDetokenizer(tok)
    pieces: list[str] = []
    max_window = 0
    for token_id in ids:
        delta = detok.push(token_id)
        assert "\ufffd" not in delta  # held back until the character completes
        pieces.append(delta)
        max_window = max(max_window, len(detok._ids))
    pieces.append(detok.flush())
    assert "".join(pieces) == MIXED_TEXT
    assert max_window <= 8  # a sliding window, not the whole output
    assert sum(1 for p in pieces if p) > len(ids) // 2  # streams, does not batch up


def test_incremental_skips_special_tokens() -> None:
    tok = tokenizer()
    ids = tok.encode("<|im_start|>assistant\nDone 🎉<|im_end|>")
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == "assistant\nDone 🎉"
    deltas, tail = _stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "<|im_start|>assistant\nDone 🎉<|im_end|>"


def test_incremental_flush_returns_dangling_bytes() -> None:
    tok = tokenizer()
    ids = tok.encode("ok 🎉")
    deltas, tail = _stream(tok, ids[:-1])  # cut inside the emoji's bytes
    streamed = "".join(deltas)
    assert streamed.startswith("ok")
    assert "\ufffd" not in streamed
    assert tail.endswith("\ufffd")
    assert streamed + tail == tok.decode(ids[:-1])


def test_incremental_with_prompt_context() -> None:
    tok = tokenizer()
    prompt = tok.chat_token_ids([{"role": "user", "content": "Say hello"}])
    generated = tok.encode("Hello there, 你好 🎉!")
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt)
    text = "".join(detok.push(t) for t in generated) + detok.flush()
    assert text == "Hello there, 你好 🎉!"


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2047), max_size=60))
def test_incremental_equals_full_decode_random_ids(ids: list[int]) -> None:
    tok = tokenizer()
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)


# -- shipped model folder --------------------------------------------------------


def test_model_folder_is_not_stale(tmp_path: Path) -> None:
    """Rebuilding from corpus.txt must reproduce the shipped files byte for byte."""
    written = build(tmp_path / "rebuilt", CORPUS_PATH)
    shipped = sorted(p.name for p in DEFAULT_MODEL_DIR.iterdir() if p.is_file())
    assert sorted(p.name for p in written) == shipped
    for path in written:
        assert path.read_bytes() == (DEFAULT_MODEL_DIR / path.name).read_bytes(), (
            f"{path.name} is stale: run `python -m tools.build_tiny_llama`"
        )


def test_corpus_size() -> None:
    assert 40_000 <= len(CORPUS_PATH.read_bytes()) <= 80_000


def test_tokenization_does_not_import_torch_or_transformers() -> None:
    code = (
        "import sys\n"
        "import kvc.tokenization, tools.build_tiny_llama\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"


# -- the length bound and long text -----------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=0, max_size=400) | st.sampled_from([MIXED_TEXT, "a" * 5000, " " * 3000]))
def test_min_tokens_is_a_lower_bound(text: str) -> None:
    tok = tokenizer()
    assert tok.min_tokens(text) > 0 or not text
    assert len(tok.encode(text)) >= tok.min_tokens(text)


def test_encode_with_a_limit_refuses_only_what_cannot_fit() -> None:
    from kvc.tokenization import TextTooLong

    tok = tokenizer()
    text = MIXED_TEXT * 40  # > 4,096 characters: the GIL-free path
    ids = tok.encode(text)
    assert tok.encode(text, limit=len(ids)) == ids  # fits exactly: encoded, same ids
    assert ids == list(tok.tokenizer.encode(text, add_special_tokens=False).ids)
    huge = "word " * 200_000
    with pytest.raises(TextTooLong) as caught:
        tok.encode(huge, limit=4096)
    assert caught.value.min_tokens == tok.min_tokens(huge) > 4096
    assert caught.value.limit == 4096


@pytest.mark.parametrize(
    ("normalizer", "model", "bounded"),
    [
        (None, {"type": "BPE", "fuse_unk": False}, True),
        ({"type": "NFC"}, {"type": "BPE", "byte_fallback": True, "fuse_unk": True}, True),
        ({"type": "Sequence", "normalizers": [{"type": "Prepend"}, {"type": "NFKC"}]},
         {"type": "WordPiece"}, True),
        ({"type": "Strip"}, {"type": "BPE"}, False),  # can delete text
        ({"type": "Sequence", "normalizers": [{"type": "Replace"}]}, {"type": "BPE"}, False),
        (None, {"type": "BPE", "fuse_unk": True}, False),  # unknown runs fuse
        (None, {"type": "Unigram"}, False),
        (None, {"type": "WordLevel"}, False),
    ],
)  # fmt: skip
def test_no_bound_where_text_can_vanish(
    normalizer: Any, model: dict[str, Any], bounded: bool
) -> None:
    from kvc.tokenization import _chars_per_token_bound

    class Fake:
        def to_str(self) -> str:
            return json.dumps({"normalizer": normalizer, "model": model})

        def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
            return {"ab": 0, "<|long_special|>": 1}

    bound = _chars_per_token_bound(Fake())  # type: ignore[arg-type]
    assert (bound is not None) == bounded
    if bound is not None and model["type"] == "WordPiece":
        assert bound == 100 * 3  # max_input_chars_per_word, NFKC composition


# -- prompt-cache marks ---------------------------------------------------------


def _conversation() -> list[dict[str, object]]:
    return [
        {"role": "system", "content": "You are a careful assistant. " * 20},
        {"role": "user", "content": "First question about the weather in Lisbon."},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "Part one of the follow-up.\nPart two, dynamic 12:03."},
    ]


def test_marks_fall_where_the_marked_content_ends() -> None:
    tok = tokenizer()
    messages = _conversation()
    tools = [
        {"type": "function", "function": {"name": "get_weather", "description": "Weather."}},
        {"type": "function", "function": {"name": "get_time", "description": "Time."}},
    ]
    cut = len("Part one of the follow-up.")
    marks = [
        ChatMark(message=0),
        ChatMark(message=2),
        ChatMark(message=3, cut=cut),
        ChatMark(tool=0),
        ChatMark(tool=1),
    ]
    ids, counts = tok.chat_token_ids_marked(messages, marks, tools=tools)
    assert ids == tok.chat_token_ids(messages, tools=tools)
    text = tok.apply_chat_template(messages, tools=tools)
    for count, marked in zip(
        counts, ["You are a careful assistant. ", "It is sunny."], strict=False
    ):
        # The prefix of the prompt up to the mark decodes to text ending at or
        # after the marked content (its closing markers included), before what follows.
        head = tok.decode(ids[:count], skip_special_tokens=False)
        assert marked in head
        assert text.startswith(head)
    system_end, turn_end, part_end, tool0, tool1 = counts
    assert 0 < system_end < turn_end < part_end < len(ids)
    head = tok.decode(ids[:part_end], skip_special_tokens=False)
    assert head.rstrip().endswith("follow-up.") or head.endswith("follow-up")
    assert "Part two" not in head
    assert tool0 <= tool1 <= len(ids)
    assert "get_time" not in tok.decode(ids[:tool0], skip_special_tokens=False)


def test_a_mark_outside_the_request_is_an_error() -> None:
    tok = tokenizer()
    with pytest.raises(ChatTemplateError):
        tok.chat_token_ids_marked(_conversation(), [ChatMark(message=9)])
    with pytest.raises(ChatTemplateError):
        tok.chat_token_ids_marked(_conversation(), [ChatMark(tool=0)])


def test_marks_work_with_a_template_that_checks_the_whole_conversation() -> None:
    """Templates that refuse a conversation without a user turn (Qwen3's do) render a
    mark on the system prompt: the request is never cut short to find it."""
    strict = (
        "{% if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
        "{{ raise_exception('No user query found in messages.') }}{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok = ChatTokenizer(tokenizer().tokenizer, chat_templates={"default": strict})
    messages = [
        {"role": "system", "content": "Rules. " * 30},
        {"role": "user", "content": "Hi"},
    ]
    ids, (count,) = tok.chat_token_ids_marked(messages, [ChatMark(message=0)])
    head = tok.decode(ids[:count], skip_special_tokens=False)
    assert head.rstrip().endswith("Rules.")
    assert "Hi" not in head


# -- the chat piece cache ---------------------------------------------------------

_WORDS = CORPUS_PATH.read_text(encoding="utf-8").split()[:400]
_ADDED = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|end_of_text|>"]


def _with_cache(max_tokens: int) -> ChatTokenizer:
    shipped = tokenizer()
    return ChatTokenizer(
        shipped.tokenizer,
        chat_templates={"default": shipped.chat_template_source},
        bos_token=shipped.bos_token,
        eos_token=shipped.eos_token,
        piece_cache_tokens=max_tokens,
    )


_text = st.lists(
    st.one_of(
        st.sampled_from(_WORDS),
        st.sampled_from(_ADDED),  # a special token's text inside a message is one too
        st.sampled_from([" ", "  ", "\n", "\n\n ", "\t", "’", "🎉", "日本"]),
    ),
    max_size=40,
).map("".join)


@settings(max_examples=150, deadline=None)
@given(
    turns=st.lists(_text, min_size=1, max_size=6),
    again=st.integers(min_value=0, max_value=5),
)
def test_chat_pieces_encode_as_the_whole_text(turns: list[str], again: int) -> None:
    """Encoded piece by piece (and from the cache, for the turns seen before), a chat
    prompt has exactly the ids of encoding its whole rendered text."""
    cached = _with_cache(10_000)
    whole = _with_cache(0)
    assert whole.piece_cache_tokens is None
    messages: list[dict[str, Any]] = []
    for i, text in enumerate([*turns, *turns[:again]]):  # later turns repeat earlier ones
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
        got = cached.chat_token_ids(messages, add_generation_prompt=True)
        assert got == whole.chat_token_ids(messages, add_generation_prompt=True)
        rendered = whole.apply_chat_template(messages, add_generation_prompt=True)
        assert got == whole.encode(rendered)


def _count_pieces(tok: ChatTokenizer) -> list[str]:
    """The pieces ``tok`` encodes from now on (cache misses), in order."""
    encoded: list[str] = []
    encode_piece = tok._encode_piece

    def counting(piece: str) -> list[int]:
        encoded.append(piece)
        return encode_piece(piece)

    tok._encode_piece = counting  # type: ignore[method-assign]
    return encoded


def test_a_conversation_sent_again_reuses_its_pieces() -> None:
    tok = _with_cache(10_000)
    encoded = _count_pieces(tok)
    long_turn = " ".join(_WORDS[:200])
    history = [{"role": "user", "content": long_turn}]
    tok.chat_token_ids(history)
    assert any(long_turn in piece for piece in encoded)
    held = tok.piece_cache_tokens
    assert held is not None
    assert held > 150
    encoded.clear()
    history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    tok.chat_token_ids(history)
    assert encoded  # the new turns were encoded ...
    assert all(long_turn not in piece for piece in encoded)  # ... the old one was not
    assert sum(map(len, encoded)) < 40


def test_the_piece_cache_stays_within_its_bound() -> None:
    tok = _with_cache(400)
    for i in range(30):
        text = " ".join(_WORDS[i * 10 : i * 10 + 40])
        ids = tok.chat_token_ids([{"role": "user", "content": text}])
        assert ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        held = tok.piece_cache_tokens
        assert held is not None
        assert held <= 400
    big = " ".join(_WORDS[:300])  # more than a quarter of the bound: encoded, not kept
    before = tok.piece_cache_tokens
    tok.chat_token_ids([{"role": "user", "content": big}])
    assert before is not None
    assert tok.piece_cache_tokens == before  # the others were not pushed out for it
    with pytest.raises(ValueError, match="piece_cache_tokens"):
        ChatTokenizer(tokenizer().tokenizer, piece_cache_tokens=-1)


def _variant(change: Any) -> ChatTokenizer:
    from tokenizers import Tokenizer

    spec = json.loads(tokenizer().tokenizer.to_str())
    change(spec)
    return ChatTokenizer(
        Tokenizer.from_str(json.dumps(spec)),
        chat_templates={"default": tokenizer().chat_template_source},
    )


def _metaspace_first(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first",
                             "split": True}  # fmt: skip
    spec["decoder"] = None


def _stripping_added_token(spec: dict[str, Any]) -> None:
    spec["added_tokens"][3]["lstrip"] = True


def _normalizer(spec: dict[str, Any]) -> None:
    spec["normalizer"] = {"type": "NFC"}


@pytest.mark.parametrize("change", [_metaspace_first, _stripping_added_token, _normalizer])
def test_tokenizers_whose_pieces_depend_on_the_whole_are_encoded_whole(change: Any) -> None:
    tok = _variant(change)
    assert tok.piece_cache_tokens is None
    messages = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "x"}]
    rendered = tok.apply_chat_template(messages)
    assert tok.chat_token_ids(messages) == tok.encode(rendered)


def test_pieces_are_kept_per_scope() -> None:
    """A tenant's pieces are not another's: the same text in another scope is encoded
    again (its timing cannot tell whether another tenant sent it)."""
    tok = _with_cache(10_000)
    encoded = _count_pieces(tok)
    messages = [{"role": "user", "content": " ".join(_WORDS[:50])}]
    first = tok.chat_token_ids(messages, cache_scope="tenant-a")
    n = len(encoded)
    assert tok.chat_token_ids(messages, cache_scope="tenant-a") == first
    assert len(encoded) == n  # all from the cache
    assert tok.chat_token_ids(messages, cache_scope="tenant-b") == first
    assert len(encoded) == 2 * n  # encoded again


# -- ASCII text without the tokenizer's pre-tokenizer ----------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_O200K_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _split_then_bytes(pattern: str, **byte_level: Any) -> Any:
    def change(spec: dict[str, Any]) -> None:
        spec["pre_tokenizer"] = {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": False, **byte_level},
            ],
        }  # fmt: skip

    return change


_FAST_VARIANTS: dict[str, ChatTokenizer] = {}


def _fast_variant(name: str) -> ChatTokenizer:
    if name not in _FAST_VARIANTS:
        changes = {"llama3": _split_then_bytes(_LLAMA3_SPLIT),
                   "qwen2": _split_then_bytes(_QWEN2_SPLIT),
                   "o200k": _split_then_bytes(_O200K_SPLIT)}  # fmt: skip
        _FAST_VARIANTS[name] = tokenizer() if name == "gpt2" else _variant(changes[name])
    return _FAST_VARIANTS[name]


# ASCII with every class boundary the splits draw: letters of both cases, digits,
# contractions, the six characters Oniguruma calls space and four it does not, other
# controls, punctuation, an added token's text.
_ASCII_ATOMS = ["a", "Z", "q", "7", "0", "'", "s", "S", "ll", "LL", "ve", "d", " ", "  ", "\t",
                "\n", "\r", "\r\n", "\x0b", "\x0c", "\x1c", "\x1f", "\x00", "\x7f", ".", ",",
                "/", "-", "_", "(", "]", "\\", "$", "^", "123456", "Hello", " world",
                "<|eot_id|>", "<|im_start|>"]  # fmt: skip
_ASCII_TEXT = st.lists(
    st.sampled_from(_ASCII_ATOMS) | st.text(st.characters(max_codepoint=0x7F), max_size=8),
    max_size=40,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(["gpt2", "llama3", "qwen2", "o200k"]), text=_ASCII_TEXT)
def test_ascii_text_encodes_as_the_tokenizer_does(name: str, text: str) -> None:
    """The ASCII path (the pre-tokenizer's regex run as a Python regex, each
    pre-token's ids from the BPE model) gives the tokenizer's own ids, for the demo
    model's GPT-2 split and for Llama 3's, Qwen 2's and o200k's splits."""
    tok = _fast_variant(name)
    assert tok.ascii_fast_path  # the path under test is the one taken
    assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=True) == tok.tokenizer.encode(text).ids
    fast = tok._ascii_byte_pairs
    assert fast is not None
    pieces = fast.pieces(text)
    if pieces is not None:  # cut where the pre-tokenizer cuts, not only the same ids
        pre = tok.tokenizer.pre_tokenizer
        assert pre is not None
        assert [p.translate(fast._chars) for p in pieces if p] == [
            p for p, _ in pre.pre_tokenize_str(text)
        ]


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=60) | st.sampled_from([MIXED_TEXT[:300], "naïve 'café' – done"]))
def test_any_text_encodes_as_the_tokenizer_does(text: str) -> None:
    tok = tokenizer()
    assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=True) == tok.tokenizer.encode(text).ids


def _bos_prefix(spec: dict[str, Any]) -> None:
    spec["pre_tokenizer"]["add_prefix_space"] = True


def _truncating(spec: dict[str, Any]) -> None:
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                          "stride": 0}  # fmt: skip


def _padding(spec: dict[str, Any]) -> None:
    spec["padding"] = {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None,
                       "pad_id": 0, "pad_type_id": 0, "pad_token": "<|begin_of_text|>"}  # fmt: skip


@pytest.mark.parametrize(
    "change",
    [
        _normalizer,
        _metaspace_first,
        _bos_prefix,
        _truncating,
        _padding,
        _split_then_bytes(r"\d+|\D+"),  # escapes it does not translate
        _split_then_bytes(r"^\s+|\S+|\s+"),  # Oniguruma's ^ is per line
        _split_then_bytes(r"(\p{L}+)|\P{L}+"),  # a capturing group, \P
        _split_then_bytes(_LLAMA3_SPLIT, add_prefix_space=True),
    ],
)
def test_tokenizers_the_ascii_path_cannot_reproduce_go_to_the_tokenizer(change: Any) -> None:
    tok = _variant(change)
    assert not tok.ascii_fast_path
    text = "It's 12345 o'clock,  Mr. Smith!\n\tdone  "
    assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert tok.encode(text, add_special_tokens=True) == tok.tokenizer.encode(text).ids


def _bos_and_eos(spec: dict[str, Any]) -> None:
    bos = "<|begin_of_text|>"
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|eot_id|>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            bos: {"id": bos, "ids": [0], "tokens": [bos]},
            "<|eot_id|>": {"id": "<|eot_id|>", "ids": [3], "tokens": ["<|eot_id|>"]},
        },
    }  # fmt: skip


def test_special_tokens_around_the_ascii_path() -> None:
    """The post-processor's tokens before and after the text (the demo model's BOS; a
    template with an EOS after as well; none at all) come around the ASCII path's ids."""
    none = _variant(lambda spec: spec.update(post_processor=None))
    for tok in (tokenizer(), _variant(_bos_and_eos), none):
        fast = tok._ascii_byte_pairs
        assert fast is not None
        assert fast._affixes is not None
        for text in ("", "Hello there", "x" * 5_000):
            want = tok.tokenizer.encode(text).ids
            assert fast.encode(text, add_special_tokens=True) == want
    assert tokenizer()._ascii_byte_pairs._affixes == ([0], [])  # type: ignore[union-attr]


def test_a_split_that_leaves_gaps_goes_to_the_tokenizer() -> None:
    """A Split keeps the text between its matches as pieces; where a regex leaves such
    gaps, the ASCII path hands the text over rather than drop them."""
    tok = _variant(_split_then_bytes(r"[a-z]+"))
    assert tok.ascii_fast_path  # the probes with gaps were handed over too
    text = "abc DEF ghi"
    assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_the_ascii_path_forgets_its_pre_tokens_past_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvc.tokenization as tokenization

    monkeypatch.setattr(tokenization, "_PRE_TOKENS_KEPT", 50)
    fast = tokenization._AsciiBytePairs.build(tokenizer().tokenizer)
    assert fast is not None
    for i in range(20):
        text = " ".join(f"w{i}x{j}" for j in range(10))
        assert fast.encode(text) == tokenizer().tokenizer.encode(text, add_special_tokens=False).ids
        assert len(fast._known) <= 50


def test_long_ascii_text_takes_the_ascii_path() -> None:
    """Past the length where the tokenizer would run without the GIL, ASCII text still
    takes the ASCII path (a fifth of the CPU at 8k tokens), with the tokenizer's ids."""
    import kvc.tokenization as tokenization

    tok = _variant(lambda spec: None)  # its own pre-token cache
    words = [w for w in _WORDS if w.isascii()]
    text = "\n".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12)) * 8
    assert len(text) > tokenization._GIL_FREE_ENCODE_CHARS
    fast = tok._ascii_byte_pairs
    assert fast is not None
    assert tok.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert fast._known  # the pre-tokens went through the ASCII path
