"""Tokenization and chat templates without torch or transformers.

The conductor tokenizes prompts itself (to hash prefix blocks and route by
cache locality) and node agents detokenize streamed output, so both need the
exact token ids the engine sees. This module reads a Hugging Face model folder
(``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``,
``generation_config.json``, ``chat_template.jinja``) with only the
``tokenizers`` library and Jinja2, rendering chat templates the way
``transformers`` does (sandboxed environment, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, a JSON-faithful ``tojson``, ``strftime_now``, the
``{% generation %}`` tag), so a prompt tokenized here matches what vLLM or the
embedded engine would produce for the same request.

``IncrementalDetokenizer`` turns a stream of token ids into text deltas that
concatenate to the full decode, holding back incomplete UTF-8 sequences and
re-decoding only a small window per token.
"""

from __future__ import annotations

import bisect
import functools
import json
import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders

__all__ = [
    "ChatMark",
    "ChatTemplateError",
    "ChatTokenizer",
    "IncrementalDetokenizer",
    "TextTooLong",
]

# transformers uses int(1e30) as "no limit" for model_max_length.
_UNBOUNDED_LENGTH: Final = 10**12
_REPLACEMENT_CHAR: Final = "\ufffd"
# Prompt tokens kept as left context by the detokenizer (as vLLM does), so
# decoders that strip a leading space at the start of text (SentencePiece
# "▁") render the first generated token correctly.
_DETOKENIZER_CONTEXT: Final = 5
# Text longer than this is encoded through ``encode_batch``, which releases the GIL
# (``encode`` holds it: 5 s for 7.9 MB with the demo tokenizer, every other thread and
# the caller's event loop frozen meanwhile); shorter text is not worth the batch wrapper.
_GIL_FREE_ENCODE_CHARS: Final = 4_096
# Token ids a ChatTokenizer keeps of the chat pieces it encoded (4 bytes each, plus the
# pieces' text): ~20 MiB at the default.
DEFAULT_PIECE_CACHE_TOKENS: Final = 2_000_000
# How much a normalizer can shorten text, by kind (tokenizer.json's "type"): Unicode
# composition joins at most three code points into one (Hangul L+V+T); the others never
# shorten. A normalizer of any other kind (Strip, Replace, BertNormalizer's control
# character removal …) can delete text, so no lower bound is drawn from the length.
_NORMALIZER_SHRINK: Final[Mapping[str, int]] = {
    "NFC": 3, "NFKC": 3, "NFD": 3, "NFKD": 3, "Prepend": 1, "Lowercase": 1,
}  # fmt: skip


class TextTooLong(ValueError):
    """The text encodes into more tokens than the caller's limit: at least
    ``min_tokens``, known from its length alone, without encoding it."""

    def __init__(self, min_tokens: int, limit: int) -> None:
        super().__init__(f"the text encodes into at least {min_tokens} tokens (limit {limit})")
        self.min_tokens = min_tokens
        self.limit = limit


def _normalizer_shrink(spec: Any) -> int | None:
    """The factor by which ``tokenizer.json``'s normalizer can shorten text, or None
    when it can delete characters (or is of a kind this module does not know)."""
    if spec is None:
        return 1
    if not isinstance(spec, Mapping):
        return None
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers") or []:
            inner = _normalizer_shrink(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    return _NORMALIZER_SHRINK.get(str(kind))


def _chars_per_token_bound(tokenizer: Tokenizer) -> int | None:
    """At most how many characters of input one token stands for, or None when the
    tokenizer's normalizer could delete text (no bound then).

    A vocabulary entry is at least as long as the text it matches (byte-level BPE
    spells each byte as one character, SentencePiece a space as ``▁``, WordPiece adds
    ``##``); added tokens match their own content; an unknown character is one token
    (byte fallback: one per byte) unless the model fuses unknown runs. The normalizer
    runs first and may shorten the text by its factor."""
    spec = json.loads(tokenizer.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    model = spec.get("model") or {}
    kind = model.get("type")
    if shrink is None or kind not in ("BPE", "WordPiece", "Unigram"):
        return None  # WordLevel: any unknown word, however long, is one token
    fuses_unknown = kind == "Unigram" or bool(model.get("fuse_unk", False))
    if kind != "WordPiece" and fuses_unknown and not model.get("byte_fallback", False):
        return None  # a run of unknown characters can fuse into one token
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    longest = max((len(piece) for piece in vocab), default=1)
    if kind == "WordPiece":  # a word it cannot split is one [UNK]
        longest = max(longest, int(model.get("max_input_chars_per_word") or 100))
    return max(1, longest) * shrink


def _splits_independently(tokenizer: Tokenizer) -> bool:
    """Whether the text between two added tokens encodes the same on its own as inside
    the whole text, so the pieces of a rendered chat can be encoded (and remembered)
    apart.

    ``tokenizers`` first cuts the input at its added tokens (leftmost-longest, by plain
    substring when no added token strips spaces, matches whole words only or matches
    normalized text), then normalizes and pre-tokenizes each piece on its own. To be
    safe, tokenizers with a step that may look at where a piece lies in the input (a
    ``Metaspace`` pre-tokenizer, whose ``prepend_scheme`` can be ``first``) or with any
    normalizer are encoded whole."""
    if getattr(tokenizer, "encode_special_tokens", False):  # added tokens as plain text
        return False
    for added in tokenizer.get_added_tokens_decoder().values():
        if added.lstrip or added.rstrip or added.single_word or added.normalized:
            return False
    spec = json.loads(tokenizer.to_str())
    if spec.get("normalizer") is not None:
        return False
    pre = json.dumps(spec.get("pre_tokenizer"))
    return "Metaspace" not in pre and "prepend_scheme" not in pre


def _added_token_pattern(contents: Iterable[str]) -> re.Pattern[str] | None:
    """A regex whose one group matches any added token's content, longest first: at
    the leftmost place the longest added token wins, as in the tokenizer's own
    leftmost-longest matcher (None: no added tokens)."""
    alternatives = sorted(contents, key=len, reverse=True)
    if not alternatives:
        return None
    return re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")


class _PieceCache:
    """Token ids of the text between added tokens, remembered (least recently used
    first out, bounded by the tokens kept), so a conversation sent again with one more
    turn tokenizes only what is new: chat templates put special tokens around every
    message. Pieces are kept per scope (the conductor's tenant): how fast a piece
    encodes tells nothing of another scope's prompts. Thread-safe (long prompts are
    encoded in worker threads)."""

    __slots__ = ("_ids", "_lock", "_max_tokens", "_pieces", "_split", "_tokens")

    def __init__(self, tokenizer: Tokenizer, max_tokens: int) -> None:
        added = {a.content: i for i, a in tokenizer.get_added_tokens_decoder().items() if a.content}
        self._split = _added_token_pattern(added)
        self._ids = added
        self._max_tokens = max_tokens
        self._pieces: OrderedDict[tuple[str, str], array[int]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    def encode(self, text: str, encode: Callable[[str], list[int]], scope: str) -> list[int]:
        parts = self._split.split(text) if self._split is not None else [text]
        out: list[int] = []
        for index, part in enumerate(parts):
            if index % 2:  # the split pattern's group: an added token
                out.append(self._ids[part])
            elif part:
                out.extend(self._piece((scope, part), encode))
        return out

    def _piece(self, key: tuple[str, str], encode: Callable[[str], list[int]]) -> list[int]:
        with self._lock:
            ids = self._pieces.get(key)
            if ids is not None:
                self._pieces.move_to_end(key)
                return ids.tolist()
        fresh = encode(key[1])
        if len(fresh) <= self._max_tokens // 4:  # one piece never flushes the rest
            with self._lock:
                if key not in self._pieces:
                    self._pieces[key] = array("I", fresh)
                    self._tokens += len(fresh)
                    while self._tokens > self._max_tokens:
                        _, dropped = self._pieces.popitem(last=False)
                        self._tokens -= len(dropped)
        return fresh

    @property
    def tokens(self) -> int:
        """Token ids held."""
        return self._tokens


# -- ASCII text through byte-level BPE without the tokenizer's pre-tokenizer ----------

# What the pre-tokenizer's regex classes (Oniguruma, Unicode) match among ASCII
# characters: \s is U+0009–U+000D and the space (not U+001C–U+001F, which Python's
# ``str.isspace`` counts); \p{L} the letters, \p{N} the digits. Categories with no ASCII
# member become a range of non-ASCII characters, which ASCII text never holds.
_ASCII_SPACE: Final = r"\t\n\x0b\x0c\r "
_NO_ASCII: Final = r"\x80-\U0010ffff"
_ASCII_CLASSES: Final[Mapping[str, str]] = {
    r"\s": _ASCII_SPACE,
    r"\p{L}": "A-Za-z", r"\p{Lu}": "A-Z", r"\p{Ll}": "a-z",
    r"\p{Lt}": _NO_ASCII, r"\p{Lm}": _NO_ASCII, r"\p{Lo}": _NO_ASCII,
    r"\p{M}": _NO_ASCII, r"\p{N}": "0-9",
}  # fmt: skip
_ESCAPE: Final = re.compile(r"\\(p\{[A-Za-z]+\}|.)", re.DOTALL)
# The byte-level pre-tokenizer's own split (GPT-2's), used when it splits by itself.
_GPT2_SPLIT: Final = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Distinct pre-tokens whose ids an _AsciiBytePairs remembers (~14 MiB when full of words
# of 3-10 letters, measured with tracemalloc; then forgotten at once). The BPE model
# inside ``tokenizers`` keeps such a cache of its own (10,000 words), shared by every
# caller as this one is.
_PRE_TOKENS_KEPT: Final = 65_536
# Text the ASCII path is checked against when built: every pre-tokenizer rule's case
# (contractions, runs of digits, punctuation, whitespace before a word and at the end).
_ASCII_PROBES: Final = (
    "Hello, world! It's 3:45pm -- we'll see.  Don't   stop\n\n\tnow?",
    "x=[1, 22, 333, 4444, 55555];  // CAPS and MiXeD\r\n  trailing   ",
    "I'M HERE, YOU'RE THERE; they'd've said 'quote' \"dq\" \x0b\x0c\x1c\x1f\x7f\x00 end",
    "    def f(a, b):\n        return a**2 + b  # comment\n\n\n",
    "",
    " ",
    "'s's'S 'LL 'll 12abc abc12 a_b-c.d/e\\f@g#h$i%j^k&l*m(n)o{p}q|r~s`t<u>v",
)


def _ascii_regex(pattern: str) -> re.Pattern[str] | None:
    """``pattern`` (an Oniguruma regex of a pre-tokenizer) as a Python regex that
    matches the same on ASCII text, or None when it uses anything not known to
    translate exactly (other escapes, anchors, which Oniguruma reads per line)."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            match = _ESCAPE.match(pattern, i)
            assert match is not None
            escape = "\\" + match.group(1)
            i = match.end()
            if escape in _ASCII_CLASSES:
                inner = _ASCII_CLASSES[escape]
                out.append(inner if in_class else f"[{inner}]")
            elif escape == r"\S" and not in_class:
                out.append(f"[^{_ASCII_SPACE}]")
            elif escape in (r"\r", r"\n", r"\t") or not escape[1].isalnum():
                out.append(escape)
            else:
                return None
            continue
        if char in "^$" and not in_class:
            return None
        if char == "[" and not in_class:
            in_class = True
            out.append(char)
            i += 1
            if pattern.startswith("^", i):  # a negated class
                out.append("^")
                i += 1
            if pattern.startswith("]", i):  # a literal ] first in a class
                out.append(r"\]")
                i += 1
            continue
        if char == "[":  # a nested class: Oniguruma's, not Python's
            return None
        if char == "]" and in_class:
            in_class = False
        out.append(char)
        i += 1
    try:
        return re.compile("".join(out))
    except re.error:
        return None


def _byte_level_chars() -> list[str]:
    """The byte-level alphabet (GPT-2's): bytes that print stand for themselves, the
    others for the code points from 256 up, in byte order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = [""] * 256
    for byte in printable:
        chars[byte] = chr(byte)
    shifted = 256
    for byte in range(256):
        if not chars[byte]:
            chars[byte] = chr(shifted)
            shifted += 1
    return chars


class _AsciiBytePairs:
    """Token ids of ASCII text for a byte-level BPE tokenizer, several times faster
    than ``Tokenizer.encode`` for prompt-sized text: ``tokenizers`` spends most of a
    short encode in its Oniguruma pre-tokenizer and in building the ``Encoding``
    (offsets, masks). Here the pre-tokenizer's regex runs as a Python regex that matches
    the same on ASCII text, and each pre-token's ids come from the BPE model, once: a
    pre-token encodes alone as it does in context (that is what pre-tokenizing means).

    Built only for tokenizers whose pipeline is exactly that (no normalizer, a
    byte-level pre-tokenizer alone or after regex splits, a BPE model, no truncation
    or padding) and whose translated regex reproduces the tokenizer on probe text;
    text that holds an added token's content or a character outside ASCII goes to the
    tokenizer. With special tokens, the post-processor's are put around the ids where
    they are the same for every text (a template such as ``<bos> $A``: what the probe
    text shows, checked on every probe), else the tokenizer encodes."""

    __slots__ = ("_added", "_affixes", "_chars", "_known", "_model", "_splits")

    def __init__(
        self, tokenizer: Tokenizer, splits: Sequence[re.Pattern[str]], added: Sequence[str]
    ) -> None:
        self._model = tokenizer.model
        self._splits = tuple(splits)
        self._chars = dict(enumerate(_byte_level_chars()[:128]))
        self._added = _added_token_pattern(added)  # the tokenizer cuts these out first
        self._known: dict[str, tuple[int, ...]] = {}
        # The special tokens the post-processor puts before and after one text.
        self._affixes: tuple[list[int], list[int]] | None = None

    @classmethod
    def build(cls, tokenizer: Tokenizer) -> _AsciiBytePairs | None:
        """The fast path for ``tokenizer``, or None where it would not be exact."""
        spec = json.loads(tokenizer.to_str())
        model = spec.get("model") or {}
        if spec.get("normalizer") is not None or model.get("type") != "BPE":
            return None
        if model.get("dropout") or getattr(tokenizer, "encode_special_tokens", False):
            return None
        if tokenizer.truncation is not None or tokenizer.padding is not None:
            return None
        splits = _pre_token_splits(spec.get("pre_tokenizer"))
        if splits is None:
            return None
        added = [a.content for a in tokenizer.get_added_tokens_decoder().values() if a.content]
        fast = cls(tokenizer, splits, added)
        pre_tokenizer = tokenizer.pre_tokenizer
        for probe in _ASCII_PROBES:
            pieces = fast.pieces(probe)
            if pieces is None:
                continue
            mapped = [piece.translate(fast._chars) for piece in pieces if piece]
            if pre_tokenizer is None or mapped != [
                piece for piece, _ in pre_tokenizer.pre_tokenize_str(probe)
            ]:
                return None
            if fast.encode(probe) != tokenizer.encode(probe, add_special_tokens=False).ids:
                return None
        fast._affixes = _special_affixes(tokenizer)
        for probe in _ASCII_PROBES:
            ids = fast.encode(probe, add_special_tokens=True)
            if ids is not None and ids != tokenizer.encode(probe, add_special_tokens=True).ids:
                fast._affixes = None
                break
        fast._known.clear()
        return fast

    def pieces(self, text: str) -> list[str] | None:
        """ASCII ``text`` cut as the pre-tokenizer cuts it (before its byte-level
        mapping), or None when it holds an added token's content (the tokenizer cuts
        those out first) or a split would leave text between its matches."""
        if self._added is not None and self._added.search(text) is not None:
            return None
        pieces = [text]
        for split in self._splits:
            pieces = [part for piece in pieces for part in split.findall(piece)]
            if sum(map(len, pieces)) != len(text):  # a gap between matches
                return None
        return pieces

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int] | None:
        """Ids of ASCII ``text`` (as ``encode(text, add_special_tokens=...)``), or None
        when it holds an added token's content (the tokenizer must cut it out) or the
        special tokens asked for are not known to be the same for every text."""
        if add_special_tokens and self._affixes is None:
            return None
        pieces = self.pieces(text)
        if pieces is None:
            return None
        known = self._known
        out: list[int] = list(self._affixes[0]) if add_special_tokens and self._affixes else []
        for piece in pieces:
            ids = known.get(piece)
            if ids is None:
                mapped = piece.translate(self._chars)
                ids = tuple(token.id for token in self._model.tokenize(mapped))
                if len(known) >= _PRE_TOKENS_KEPT:
                    known.clear()
                known[piece] = ids
            out.extend(ids)
        if add_special_tokens and self._affixes:
            out.extend(self._affixes[1])
        return out


def _special_affixes(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """What the post-processor puts before and after a probe text's ids (None when
    its ids are not found whole among them)."""
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return None


def _pre_token_splits(spec: Any) -> list[re.Pattern[str]] | None:
    """The Python regexes that split ASCII text as ``spec`` (a pre-tokenizer) does
    before its byte-level mapping, or None when it is not such a pipeline."""
    if not isinstance(spec, Mapping):
        return None
    kind = spec.get("type")
    parts = list(spec.get("pretokenizers") or []) if kind == "Sequence" else [spec]
    if not parts or not isinstance(last := parts[-1], Mapping) or last.get("type") != "ByteLevel":
        return None
    if last.get("add_prefix_space"):
        return None
    sources: list[str] = []
    for part in parts[:-1]:
        if not isinstance(part, Mapping) or part.get("type") != "Split":
            return None
        pattern = part.get("pattern")
        if (
            part.get("behavior") != "Isolated"
            or part.get("invert")
            or not isinstance(pattern, Mapping)
            or not isinstance(pattern.get("Regex"), str)
        ):
            return None
        sources.append(pattern["Regex"])
    if last.get("use_regex", True):
        sources.append(_GPT2_SPLIT)
    compiled = [_ascii_regex(source) for source in sources]
    # findall gives whole matches only when the pattern captures no group.
    if any(c is None or c.groups for c in compiled):
        return None
    return [c for c in compiled if c is not None]


class ChatTemplateError(ValueError):
    """A chat template could not be rendered for these messages."""


class _GenerationTagExtension(Extension):
    """Accept HF's ``{% generation %}…{% endgeneration %}`` and render its body.

    transformers uses the tag to mark assistant tokens for training masks;
    for inference it only has to parse, and the body renders unchanged.
    """

    tags = {"generation"}  # noqa: RUF012 - Extension declares tags as set[str]

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's built-in tojson HTML-escapes <, >, & and '; transformers replaces
    # it with plain json.dumps, and templates are written against that.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTagExtension, loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written in HF files: a string, ``{"content": …}`` or null."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return None


def _int_ids(value: Any) -> list[int]:
    """An id field that may be an int, a list of ints or null."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _load_chat_templates(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """Named chat templates: tokenizer_config (string or named list), else side files."""
    raw: Any = tokenizer_config.get("chat_template")
    if raw is None:
        jinja_file = model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            raw = jinja_file.read_text(encoding="utf-8")
        else:
            raw = _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    templates: dict[str, str] = {}
    if isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, Mapping):
                name, template = entry.get("name"), entry.get("template")
                if isinstance(name, str) and isinstance(template, str):
                    templates[name] = template
    return templates


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character of each byte (GPT-2's scheme:
    printable Latin-1 bytes stand for themselves, the rest for 256, 257, ...), inverted."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    codes = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


_BYTE_OF_CHAR: Final = _byte_level_table()
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


@dataclass(frozen=True, slots=True)
class ChatMark:
    """A place in a chat request whose rendered prompt position is wanted: the end of
    ``messages[message]`` (``cut`` None: its whole turn; else the first ``cut``
    characters of its text content), or the end of ``tools[tool]``. Exactly one of
    ``message`` and ``tool`` is set."""

    message: int | None = None
    tool: int | None = None
    cut: int | None = None


_MARK_PROBE = "\x07"  # a character no template adds: where a probe render parts ways


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _normalise_content(content: Any, index: int) -> Any:
    """Flatten OpenAI content parts to one string (text parts joined by newlines)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, Sequence):
        raise ChatTemplateError(f"messages[{index}].content must be a string or a list of parts")
    texts: list[str] = []
    for part_index, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatTemplateError(f"messages[{index}].content[{part_index}] must be an object")
        part_type = part.get("type")
        if part_type != "text":
            raise ChatTemplateError(
                f"messages[{index}].content[{part_index}] has type {part_type!r}; "
                "this model accepts only 'text' content parts"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise ChatTemplateError(
                f"messages[{index}].content[{part_index}].text must be a string"
            )
        texts.append(text)
    # vLLM joins text parts of text-only models with "\n"; match it so both
    # sides produce the same prompt tokens.
    return "\n".join(texts)


class ChatTokenizer:
    """A Hugging Face tokenizer folder, readable without transformers."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        chat_templates: Mapping[str, str] | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        special_tokens: Mapping[str, str] | None = None,
        model_max_length: int | None = None,
        piece_cache_tokens: int = DEFAULT_PIECE_CACHE_TOKENS,
    ) -> None:
        if piece_cache_tokens < 0:
            raise ValueError(f"piece_cache_tokens must be >= 0, got {piece_cache_tokens}")
        self._piece_cache_tokens = piece_cache_tokens
        self._tokenizer = tokenizer
        self._chat_templates: dict[str, str] = dict(chat_templates or {})
        self._compiled: dict[str, jinja2.Template] = {}
        self._env = _make_environment()
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._template_tokens: dict[str, str] = dict(special_tokens or {})
        if bos_token is not None:
            self._template_tokens["bos_token"] = bos_token
        if eos_token is not None:
            self._template_tokens["eos_token"] = eos_token
        self._bos_token_id = tokenizer.token_to_id(bos_token) if bos_token is not None else None
        eos_ids = set(extra_eos_token_ids)
        if eos_token is not None and (eos_id := tokenizer.token_to_id(eos_token)) is not None:
            eos_ids.add(eos_id)
        self._eos_token_ids = frozenset(eos_ids)
        self._special_token_ids = frozenset(
            token_id
            for token_id, added in tokenizer.get_added_tokens_decoder().items()
            if added.special
        )
        self._model_max_length = model_max_length

    @classmethod
    def from_dir(cls, model_dir: Path) -> ChatTokenizer:
        """Load ``tokenizer.json`` and the HF side files from a model folder."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tok_config = _read_json(model_dir / "tokenizer_config.json")
        special_map = _read_json(model_dir / "special_tokens_map.json")
        generation = _read_json(model_dir / "generation_config.json")

        special: dict[str, str] = {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token"):
            value = _token_content(tok_config.get(key))
            if value is None:
                value = _token_content(special_map.get(key))
            if value is not None:
                special[key] = value

        max_length: int | None = None
        raw_max = tok_config.get("model_max_length")
        if isinstance(raw_max, int | float) and 0 < raw_max < _UNBOUNDED_LENGTH:
            max_length = int(raw_max)
        else:
            model_config = _read_json(model_dir / "config.json")
            text_config = model_config.get("text_config")
            if isinstance(text_config, Mapping):
                model_config = {**model_config, **text_config}
            positions = model_config.get("max_position_embeddings")
            if isinstance(positions, int) and positions > 0:
                max_length = positions

        return cls(
            tokenizer,
            chat_templates=_load_chat_templates(model_dir, tok_config),
            bos_token=special.get("bos_token"),
            eos_token=special.get("eos_token"),
            extra_eos_token_ids=_int_ids(generation.get("eos_token_id")),
            special_tokens=special,
            model_max_length=max_length,
        )

    # -- properties ---------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: the tokenizer's EOS plus generation_config's."""
        return self._eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of added tokens flagged special (dropped by ``skip_special_tokens``)."""
        return self._special_token_ids

    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def model_max_length(self) -> int | None:
        """Longest sequence the model accepts, when the folder says so."""
        return self._model_max_length

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    @property
    def chat_template_source(self) -> str:
        """Every chat template's source, joined (for telling the model family's formats)."""
        return "\n".join(self._chat_templates.values())

    # -- encode / decode ----------------------------------------------------

    @functools.cached_property
    def _chars_per_token(self) -> int | None:
        # On first use only: it reads the whole tokenizer.json (megabytes for a large
        # vocabulary), which agents and other users that never bound a prompt skip.
        return _chars_per_token_bound(self._tokenizer)

    @functools.cached_property
    def _piece_cache(self) -> _PieceCache | None:
        # On first use (reads tokenizer.json, like ``_chars_per_token``).
        if self._piece_cache_tokens == 0 or not _splits_independently(self._tokenizer):
            return None
        return _PieceCache(self._tokenizer, self._piece_cache_tokens)

    @functools.cached_property
    def _ascii_byte_pairs(self) -> _AsciiBytePairs | None:
        # On first use (reads tokenizer.json and checks itself against the tokenizer).
        return _AsciiBytePairs.build(self._tokenizer)

    @property
    def ascii_fast_path(self) -> bool:
        """Whether short ASCII text is encoded without the tokenizer's pre-tokenizer
        (a byte-level BPE whose split this module reproduces exactly)."""
        return self._ascii_byte_pairs is not None

    @property
    def piece_cache_tokens(self) -> int | None:
        """Token ids the chat piece cache holds now (None: this tokenizer has none)."""
        cache = self._piece_cache
        return None if cache is None else cache.tokens

    def _encode_piece(self, piece: str) -> list[int]:
        return self.encode(piece, add_special_tokens=False)

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens ``text`` encodes into, from its length alone
        (0 when the tokenizer's normalizer allows no bound)."""
        bound = self._chars_per_token
        if bound is None:
            return 0
        return -(-len(text) // bound)

    def encode(
        self, text: str, *, add_special_tokens: bool = False, limit: int | None = None
    ) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (BOS…).

        With ``limit``, text whose length alone shows it encodes into more than
        ``limit`` tokens raises ``TextTooLong`` before any encoding (a body of
        megabytes is refused in microseconds). ASCII text for a byte-level BPE takes
        the ASCII path (``ascii_fast_path``: 5x less CPU than the tokenizer at 8k
        tokens, in Python, so a worker thread running it yields the GIL every switch
        interval); other long text is encoded without holding the GIL, so a caller may
        run this in a worker thread and keep its loop free."""
        if limit is not None and (bound := self.min_tokens(text)) > limit:
            raise TextTooLong(bound, limit)
        if text.isascii() and (fast := self._ascii_byte_pairs) is not None:
            ids = fast.encode(text, add_special_tokens=add_special_tokens)
            if ids is not None:
                return ids
        if len(text) > _GIL_FREE_ENCODE_CHARS:
            batch = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
            return list(batch[0].ids)
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    # -- chat templates -----------------------------------------------------

    def _template(self, *, with_tools: bool) -> jinja2.Template:
        if not self._chat_templates:
            raise ChatTemplateError("this model has no chat template")
        if with_tools and "tool_use" in self._chat_templates:
            name = "tool_use"
        elif "default" in self._chat_templates:
            name = "default"
        elif len(self._chat_templates) == 1:
            name = next(iter(self._chat_templates))
        else:
            names = ", ".join(sorted(self._chat_templates))
            raise ChatTemplateError(f"no 'default' chat template among: {names}")
        compiled = self._compiled.get(name)
        if compiled is None:
            try:
                compiled = self._env.from_string(self._chat_templates[name])
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"chat template {name!r} does not compile: {exc}") from exc
            self._compiled[name] = compiled
        return compiled

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` to the prompt text, like ``transformers`` does.

        ``template_kwargs`` are extra template variables (e.g. ``enable_thinking``).
        Raises ``ChatTemplateError`` for non-text content parts and for any
        failure inside the template (including its ``raise_exception``).
        """
        normalised = []
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping):
                raise ChatTemplateError(f"messages[{index}] must be an object")
            item = dict(message)
            if "content" in item:
                item["content"] = _normalise_content(item["content"], index)
            normalised.append(item)
        tool_list = [dict(tool) for tool in tools] if tools else None
        template = self._template(with_tools=bool(tool_list))
        context: dict[str, Any] = {
            **self._template_tokens,
            **dict(template_kwargs or {}),
            "messages": normalised,
            "tools": tool_list,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(context)
        except ChatTemplateError:
            raise
        except Exception as exc:
            # Templates are data from the model folder: anything they raise
            # (TemplateError, TypeError on bad concatenation, …) is a bad request.
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    def chat_token_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        limit: int | None = None,
        cache_scope: str = "",
    ) -> list[int]:
        """Prompt token ids for a chat request (``limit`` as for ``encode``).

        The rendered template already contains BOS/turn markers, so it is
        encoded without the post-processor's special tokens (as HF and vLLM do).
        The text between its added tokens (the messages, in every template that wraps
        them in special tokens) is encoded piece by piece and remembered, so a
        conversation sent again with one more turn encodes only the new turn: the ids
        are the same as encoding the whole text (``_splits_independently`` says for
        which tokenizers; the others are encoded whole). Pieces are remembered per
        ``cache_scope`` (the conductor passes the tenant).
        """
        text = self.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            template_kwargs=template_kwargs,
        )
        cache = self._piece_cache
        if cache is None:
            return self.encode(text, add_special_tokens=False, limit=limit)
        if limit is not None and (bound := self.min_tokens(text)) > limit:
            raise TextTooLong(bound, limit)
        return cache.encode(text, self._encode_piece, cache_scope)

    def chat_token_ids_marked(
        self,
        messages: Sequence[Mapping[str, Any]],
        marks: Sequence[ChatMark],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        limit: int | None = None,
    ) -> tuple[list[int], list[int]]:
        """``chat_token_ids`` plus, per mark, how many leading prompt tokens end at or
        before it (a prompt-cache breakpoint's position).

        A message mark's character position is found by rendering the whole request
        again with a probe character inserted at the mark: where that render parts ways
        with the plain one is where the marked content ends in the rendered prompt,
        whatever the template wraps around it (the conversation is never truncated, so
        templates that check its shape render it as they do the request). A tool mark
        renders the tools up to it, with and without a probe tool after it, and keeps
        the shorter prefix the plain render agrees with. Characters become tokens by the
        full prompt's offsets: a token that straddles the position is not counted. Costs
        one or two extra renders per mark.
        """
        full = self.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
        if limit is not None and (bound := self.min_tokens(full)) > limit:
            raise TextTooLong(bound, limit)
        positions = [self._mark_position(full, messages, tools, mark) for mark in marks]
        # As ``encode`` does for long text: without holding the GIL.
        encoding = self._tokenizer.encode_batch([full], add_special_tokens=False)[0]
        ends = [end for _, end in encoding.offsets]
        # Offsets are non-decreasing in practice; take the running max to be safe.
        for i in range(1, len(ends)):
            ends[i] = max(ends[i], ends[i - 1])
        return list(encoding.ids), [bisect.bisect_right(ends, pos) for pos in positions]

    def _mark_position(
        self,
        full: str,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        mark: ChatMark,
    ) -> int:
        render = self.apply_chat_template
        if mark.tool is not None:
            if not tools or not 0 <= mark.tool < len(tools):
                raise ChatTemplateError(f"mark on tools[{mark.tool}], which does not exist")
            head = list(tools[: mark.tool + 1])
            cut = render(messages, add_generation_prompt=True, tools=head)
            probe_tool = {"type": "function", "function": {"name": _MARK_PROBE}}
            probe = render(messages, add_generation_prompt=True, tools=[*head, probe_tool])
            return min(_common_prefix(cut, probe), _common_prefix(cut, full))
        index = mark.message
        if index is None or not 0 <= index < len(messages):
            raise ChatTemplateError(f"mark on messages[{index}], which does not exist")
        message = dict(messages[index])
        text = _normalise_content(message.get("content"), index)
        if not isinstance(text, str):  # no text (an assistant's calls only): the whole turn
            turn = render(messages[: index + 1], add_generation_prompt=False, tools=tools)
            return _common_prefix(turn, full)
        at = len(text) if mark.cut is None else mark.cut
        if not 0 <= at <= len(text):
            raise ChatTemplateError(f"mark cuts messages[{index}] outside its text")
        # The whole request with a probe character at the mark: a template that checks
        # the conversation (a user turn after the system prompt...) sees it all.
        probed = [
            *messages[:index],
            {**message, "content": text[:at] + _MARK_PROBE + text[at:]},
            *messages[index + 1 :],
        ]
        return _common_prefix(render(probed, add_generation_prompt=True, tools=tools), full)

    def api_token_ids(
        self,
        *,
        prompt: str | None,
        messages: Sequence[Mapping[str, Any]] | None,
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        cache_scope: str = "",
    ) -> list[int]:
        """What vLLM's ``/tokenize`` answers: exactly one of a ``prompt`` (its special
        tokens added unless ``add_special_tokens`` is false) or chat ``messages`` (rendered
        as for a chat completion, ``cache_scope`` as there). Raises ``ValueError`` for
        neither or both, and ``ChatTemplateError`` (a ``ValueError``) when the template
        fails."""
        if (prompt is None) == (messages is None):
            raise ValueError("give either prompt or messages")
        if messages is not None:
            return self.chat_token_ids(
                messages, add_generation_prompt=add_generation_prompt, tools=tools,
                cache_scope=cache_scope,
            )  # fmt: skip
        assert prompt is not None
        add = True if add_special_tokens is None else add_special_tokens
        return self.encode(prompt, add_special_tokens=add)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: exact for byte-level BPE and byte-fallback
        tokens (a piece of a multi-byte character is its own bytes), else the UTF-8 of
        its decoded text."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self._tokenizer.decoder, decoders.ByteLevel):
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            except KeyError:
                pass  # an added token written in plain text
        if (m := _BYTE_TOKEN.fullmatch(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        return self.decode([token_id], skip_special_tokens=False).encode()

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token string (``""`` for an id the vocabulary does not name)."""
        return [self.id_to_token(t) or "" for t in ids]


class IncrementalDetokenizer:
    """Turn generated token ids, one at a time, into text deltas.

    Keeps two offsets into a short id window (as vLLM and TGI do): text is
    emitted as ``decode(window) - decode(window[:read])`` once it does not end
    in U+FFFD (an incomplete multi-byte character), then the window slides.
    Each push decodes only the window, so the cost does not grow with the
    length of the output. The concatenated deltas plus ``flush()`` equal the
    decode of all pushed ids.
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._special = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        context: list[int] = []  # the prompt's last ordinary ids, read from its end
        for t in reversed(prompt_ids):
            if len(context) == _DETOKENIZER_CONTEXT:
                break
            if t not in self._special:
                context.append(t)
        context.reverse()
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        if token_id in self._special:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        # Slide: keep the just-read tokens as the new left context.
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return delta

    def flush(self) -> str:
        """Return text still held back (e.g. a dangling partial character)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._ids = self._ids[self._read_offset :]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return delta
