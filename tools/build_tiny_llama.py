"""Regenerate the ``tiny-llama`` model folder from ``corpus.txt``.

Usage: ``python -m tools.build_tiny_llama [--out DIR]`` (default: the
folder shipped in the package).

Everything is derived deterministically from the corpus and the constants
below: the byte-level BPE tokenizer is trained with the ``tokenizers`` library
(same corpus ⇒ byte-identical ``tokenizer.json``), and the JSON files are
written with a fixed key order. No weights are written; ``kvc_init.json`` makes
the embedded engine build random weights from a seed instead, which keeps the
repository small and the model reproducible everywhere. A test rebuilds the
folder into a temporary directory and compares it byte for byte with the
shipped one, so edits to the corpus or to this script cannot silently go stale.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Final

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from kvc.models import CORPUS_PATH, DEFAULT_MODEL_DIR

VOCAB_SIZE: Final = 2048
BOS_TOKEN: Final = "<|begin_of_text|>"
END_OF_TEXT_TOKEN: Final = "<|end_of_text|>"
IM_START_TOKEN: Final = "<|im_start|>"
IM_END_TOKEN: Final = "<|im_end|>"
# Order fixes the ids: 0 = BOS, 1 = end of text, 2/3 = ChatML turn markers.
SPECIAL_TOKENS: Final = (BOS_TOKEN, END_OF_TEXT_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
BOS_ID: Final = 0
END_OF_TEXT_ID: Final = 1
IM_END_ID: Final = 3
MAX_POSITIONS: Final = 4096
INIT_SEED: Final = 1234
# Deliberately huge (HF default is 0.02): with tiny random weights the logits
# are then far apart, so greedy decoding wanders over many distinct tokens
# instead of repeating one, which makes equality checks meaningful.
INIT_RANGE: Final = 0.5

# ChatML with Hermes-style tool calls. Roles other than system/user/assistant/tool are
# rejected; with `tools`, a system turn lists them as JSON inside <tools></tools>, with
# the call format (merged with a leading system message); an assistant turn's
# `tool_calls` are written as <tool_call>{"name", "arguments"}</tool_call> after its
# content, and a tool's result is wrapped in <tool_response></tool_response>. That is
# the format the conductor's `hermes` tool-call parser reads (and finds here by itself).
# Whitespace control (`{%-`) keeps the output independent of trim_blocks/lstrip_blocks.
CHAT_TEMPLATE: Final = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- (messages[0]['content'] or '') + '\\n\\n' }}"
    "{%- endif %}"
    '{{- \'You can call these tools. For each call, answer with <tool_call>{"name": '
    'name, "arguments": {...}}</tool_call>.\\n<tools>\\n\' }}'
    "{%- for tool in tools %}{{- tool | tojson }}{{- '\\n' }}{%- endfor %}"
    "{{- '</tools><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unsupported role: ' ~ message['role']) }}"
    "{%- endif %}"
    "{%- if not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<tool_response>\\n' + (message['content'] or '') + '\\n</tool_response>' }}"
    "{%- else %}{{- message['content'] or '' }}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set arguments = call['function']['arguments'] %}"
    "{{- '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{- (arguments if arguments is string else (arguments | tojson)) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(corpus: str) -> Tokenizer:
    """Train the byte-level BPE on ``corpus`` (deterministic for a given corpus)."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    # `add_special_tokens=True` prepends BOS (completions); chat prompts are
    # encoded without it because the template already carries the markers.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    for token_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"special token {token!r} did not get id {token_id}")
    return tokenizer


def config_json(vocab_size: int) -> dict[str, Any]:
    """``config.json`` of the tiny Llama (HF ``LlamaForCausalLM`` layout)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": BOS_ID,
        "eos_token_id": IM_END_ID,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "max_position_embeddings": MAX_POSITIONS,
        "mlp_bias": False,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "pad_token_id": END_OF_TEXT_ID,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def generation_config_json() -> dict[str, Any]:
    """``generation_config.json``: stop on ``<|im_end|>`` or end of text."""
    return {
        "bos_token_id": BOS_ID,
        "eos_token_id": [IM_END_ID, END_OF_TEXT_ID],
        "pad_token_id": END_OF_TEXT_ID,
    }


def tokenizer_config_json() -> dict[str, Any]:
    """``tokenizer_config.json`` with the ChatML chat template."""
    added = {
        str(token_id): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, token in enumerate(SPECIAL_TOKENS)
    }
    return {
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END_TOKEN,
        "model_max_length": MAX_POSITIONS,
        "pad_token": END_OF_TEXT_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map_json() -> dict[str, Any]:
    """``special_tokens_map.json`` (older HF loaders read this one)."""
    return {
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END_TOKEN,
        "pad_token": END_OF_TEXT_TOKEN,
    }


def kvc_init_json() -> dict[str, Any]:
    """Marker: no weights file, build random weights with this seed."""
    return {"seed": INIT_SEED, "initializer_range": INIT_RANGE}


def _dump(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def build(out_dir: Path, corpus_path: Path = CORPUS_PATH) -> list[Path]:
    """Write every file of the model folder into ``out_dir``; return their paths."""
    corpus = corpus_path.read_text(encoding="utf-8")
    tokenizer = train_tokenizer(corpus)
    files = {
        "config.json": _dump(config_json(tokenizer.get_vocab_size(with_added_tokens=True))),
        "generation_config.json": _dump(generation_config_json()),
        "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        "tokenizer_config.json": _dump(tokenizer_config_json()),
        "special_tokens_map.json": _dump(special_tokens_map_json()),
        "kvc_init.json": _dump(kvc_init_json()),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = out_dir / name
        path.write_text(text, encoding="utf-8", newline="\n")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR, help="output folder")
    parser.add_argument("--corpus", type=Path, default=CORPUS_PATH, help="training text")
    args = parser.parse_args(argv)
    for path in build(args.out, args.corpus):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
